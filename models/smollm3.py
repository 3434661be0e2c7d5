"""smollm3 (SmolLM3): the llama block, except that every fourth layer (il % 4 == 3) has no RoPE —
llama.cpp's fixed step, read from no GGUF key: its q and k stay unrotated, and K is cached so."""
from edgellm.models.decoder import Decoder

NO_ROPE_STEP = 4


class Model(Decoder):
    ROPE_NEOX = False
    ACTIVATION = "silu"

    def rope_params(self, il: int) -> tuple[float, float]:
        if (il + 1) % NO_ROPE_STEP == 0:
            # angle 0 at every position: cos 1, sin 0, so each pair keeps its values (the kernels,
            # fused and GPU ones too, need no path of their own)
            return self.cfg.rope_freq_base, 0.0
        return super().rope_params(il)
