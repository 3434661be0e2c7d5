"""llama (SmolLM2, Llama 2/3, Mistral): RMSNorm, RoPE in the normal (interleaved-pair) layout — the
GGUF converter permutes Q/K for it — GQA, SwiGLU; tied or separate output head."""
from edgellm.models.decoder import Decoder


class Model(Decoder):
    ROPE_NEOX = False
    ACTIVATION = "silu"
