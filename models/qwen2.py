"""qwen2: the llama block with biases on Q, K and V, and RoPE in the neox (split-half) layout."""
from edgellm.models.decoder import Decoder

ROPE_FREQ_BASE_SWA = 10000.0


def swa_layers(n_layer: int, window: int, metadata) -> tuple[bool, ...]:
    return (False,) * n_layer


class Model(Decoder):
    ROPE_NEOX = True
    ACTIVATION = "silu"
