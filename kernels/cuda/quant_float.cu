// F32, F16, BF16 weights: "blocks" of one element, so a warp's 32 lanes read 32 neighbouring values.
#include "common.cuh"
#include "quant_kernels.cuh"

struct BlockF32 {
    static constexpr int block_size = 1;
    static constexpr int type_size = 4;
    static constexpr int chunks = 1;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int, Sink& sink) {
        sink.put(0, *(const float*)blk);
    }
};

struct BlockF16 {
    static constexpr int block_size = 1;
    static constexpr int type_size = 2;
    static constexpr int chunks = 1;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int, Sink& sink) {
        sink.put(0, f16_to_f32(load_u16(blk)));
    }
};

struct BlockBF16 {
    static constexpr int block_size = 1;
    static constexpr int type_size = 2;
    static constexpr int chunks = 1;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int, Sink& sink) {
        sink.put(0, bf16_to_f32(load_u16(blk)));
    }
};

EDGELLM_QUANT_KERNELS(f32, BlockF32)
EDGELLM_QUANT_KERNELS(f16, BlockF16)
EDGELLM_QUANT_KERNELS(bf16, BlockBF16)
