"""qwen2: the llama block with biases on Q, K and V, and RoPE in the neox (split-half) layout."""
from edgellm.models.decoder import Decoder


class Model(Decoder):
    ROPE_NEOX = True
    ACTIVATION = "silu"
    FILE_TENSORS = (("attn_q.bias", "q_bias"), ("attn_k.bias", "kv_bias"), ("attn_v.bias", "kv_bias"))
    FILE_ROPE_FREQ_BASE = 1000000.0
    FILE_RMS_EPS = 1e-6
    FILE_TOKENIZER_PRE = "qwen2"
