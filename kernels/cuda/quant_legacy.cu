// Legacy 32-weight block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//
// Four threads share a block; chunk c (0..3) takes qs bytes 4c..4c+3. In the 4- and 5-bit formats a
// byte holds weight j in its low nibble and weight j + 16 in its high nibble, so chunk c yields weights
// 4c..4c+3 and 4c+16..4c+19. In Q8_0 chunk c yields weights 8c..8c+7.
#include "common.cuh"
#include "quant_kernels.cuh"

// d: f16 | qs: u8[16];  w = d * (q - 8)
struct BlockQ4_0 {
    static constexpr int block_size = QK;
    static constexpr int type_size = 2 + QK / 2;
    static constexpr int chunks = 4;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int c, Sink& sink) {
        const float d = f16_to_f32(load_u16(blk));
        const u8* qs = blk + 2;
#pragma unroll
        for (int j = 4 * c; j < 4 * c + 4; ++j) {
            sink.put(j, d * (float)((qs[j] & 0x0f) - 8));
            sink.put(j + 16, d * (float)((qs[j] >> 4) - 8));
        }
    }
};

// d, m: f16 | qs: u8[16];  w = d * q + m
struct BlockQ4_1 {
    static constexpr int block_size = QK;
    static constexpr int type_size = 2 + 2 + QK / 2;
    static constexpr int chunks = 4;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int c, Sink& sink) {
        const float d = f16_to_f32(load_u16(blk));
        const float m = f16_to_f32(load_u16(blk + 2));
        const u8* qs = blk + 4;
#pragma unroll
        for (int j = 4 * c; j < 4 * c + 4; ++j) {
            sink.put(j, d * (float)(qs[j] & 0x0f) + m);
            sink.put(j + 16, d * (float)(qs[j] >> 4) + m);
        }
    }
};

// d: f16 | qh: u32 (bit j = 5th bit of weight j), little endian | qs: u8[16];  w = d * (q - 16)
struct BlockQ5_0 {
    static constexpr int block_size = QK;
    static constexpr int type_size = 2 + 4 + QK / 2;
    static constexpr int chunks = 4;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int c, Sink& sink) {
        const float d = f16_to_f32(load_u16(blk));
        const u32 qh = (u32)load_u16(blk + 2) | ((u32)load_u16(blk + 4) << 16);
        const u8* qs = blk + 6;
#pragma unroll
        for (int j = 4 * c; j < 4 * c + 4; ++j) {
            const int lo = (qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
            const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            sink.put(j, d * (float)(lo - 16));
            sink.put(j + 16, d * (float)(hi - 16));
        }
    }
};

// d, m: f16 | qh: u32 | qs: u8[16];  w = d * q + m
struct BlockQ5_1 {
    static constexpr int block_size = QK;
    static constexpr int type_size = 2 + 2 + 4 + QK / 2;
    static constexpr int chunks = 4;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int c, Sink& sink) {
        const float d = f16_to_f32(load_u16(blk));
        const float m = f16_to_f32(load_u16(blk + 2));
        const u32 qh = (u32)load_u16(blk + 4) | ((u32)load_u16(blk + 6) << 16);
        const u8* qs = blk + 8;
#pragma unroll
        for (int j = 4 * c; j < 4 * c + 4; ++j) {
            const int lo = (qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
            const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            sink.put(j, d * (float)lo + m);
            sink.put(j + 16, d * (float)hi + m);
        }
    }
};

// d: f16 | qs: i8[32];  w = d * q
struct BlockQ8_0 {
    static constexpr int block_size = QK;
    static constexpr int type_size = 2 + QK;
    static constexpr int chunks = 4;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int c, Sink& sink) {
        const float d = f16_to_f32(load_u16(blk));
        const signed char* qs = (const signed char*)(blk + 2);
#pragma unroll
        for (int j = 8 * c; j < 8 * c + 8; ++j) sink.put(j, d * (float)qs[j]);
    }
};

EDGELLM_QUANT_KERNELS(q4_0, BlockQ4_0)
EDGELLM_QUANT_KERNELS(q4_1, BlockQ4_1)
EDGELLM_QUANT_KERNELS(q5_0, BlockQ5_0)
EDGELLM_QUANT_KERNELS(q5_1, BlockQ5_1)
EDGELLM_QUANT_KERNELS(q8_0, BlockQ8_0)
