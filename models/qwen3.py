"""qwen3: the llama block with per-head RMSNorm on Q and K (before RoPE), neox RoPE, no biases."""
from edgellm.models.decoder import Decoder


class Model(Decoder):
    ROPE_NEOX = True
    ACTIVATION = "silu"
    FILE_TENSORS = (("attn_q_norm.weight", "head_norm"), ("attn_k_norm.weight", "head_norm"))
    FILE_ROPE_FREQ_BASE = 1000000.0
    FILE_RMS_EPS = 1e-6
    FILE_KEY_LENGTH = True
