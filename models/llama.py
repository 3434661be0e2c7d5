"""llama (SmolLM2, Llama 2/3, Mistral): RMSNorm, RoPE in the normal (interleaved-pair) layout — the
GGUF converter permutes Q/K for it — GQA, SwiGLU; tied or separate output head."""
from edgellm.models.decoder import Decoder

ROPE_FREQ_BASE_SWA = 10000.0


def swa_layers(n_layer: int, window: int, metadata) -> tuple[bool, ...]:
    return (False,) * n_layer


class Model(Decoder):
    ROPE_NEOX = False
    ACTIVATION = "silu"
