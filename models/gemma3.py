"""gemma3: embeddings scaled by sqrt(n_embd); RMSNorm weights used as stored (the GGUF converter has
already added Gemma's +1); QK-norm; norms after attention and after the FFN; GELU-tanh gated FFN;
neox RoPE. Five of every six layers attend within a sliding window and use RoPE base 10000; every
sixth layer (il % 6 == 5) is global with the file's RoPE base and scaling (llama.cpp's pattern).
The attention scale is 1/sqrt(key_length)."""
from edgellm.models.decoder import Decoder

SWA_PERIOD = 6


class Model(Decoder):
    ROPE_NEOX = True
    ACTIVATION = "gelu"
    EMBED_SCALE = True
    SCALE_Q = True  # llama.cpp scales q by the attention scale in the graph (ggml_scale), not the scores
    ROPE_FREQ_BASE_SWA = 10000.0  # llama.cpp's gemma3 default for rope.freq_base_swa
    FILE_TENSORS = (("attn_q_norm.weight", "head_norm"), ("attn_k_norm.weight", "head_norm"),
                    ("post_attention_norm.weight", "embd_norm"), ("post_ffw_norm.weight", "embd_norm"))
    FILE_ROPE_FREQ_BASE = 1000000.0
    FILE_RMS_EPS = 1e-6
    FILE_KEY_LENGTH = True
    FILE_SLIDING_WINDOW = True

    @staticmethod
    def swa_layers(n_layer: int, window: int, metadata) -> tuple[bool, ...]:
        if window <= 0:
            return (False,) * n_layer
        return tuple(il % SWA_PERIOD < SWA_PERIOD - 1 for il in range(n_layer))
