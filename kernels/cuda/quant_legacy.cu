// Legacy 32-weight block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//
// Four threads share a block; chunk c (0..3) takes qs bytes 4c..4c+3. In the 4- and 5-bit formats a
// byte holds weight j in its low nibble and weight j + 16 in its high nibble, so chunk c yields weights
// 4c..4c+3 and 4c+16..4c+19. In Q8_0 chunk c yields weights 8c..8c+7.
#include "common.cuh"
#include "quant_kernels.cuh"

#if defined(EDGELLM_CUDA)
// The 4 bits b0..b3 of `bits` moved to bit 4 of bytes 0..3 (the 5th bit of four 5-bit weights).
EDGELLM_D int spread_bit4(u32 bits) {
    return (int)(((bits & 1) << 4) | ((bits & 2) << 11) | ((bits & 4) << 18) | ((bits & 8) << 25));
}

// Chunk c of a legacy block: the low nibbles of its 4 bytes are weights 4c..4c+3 (x int c), the high
// nibbles weights 4c+16..4c+19 (x int c + 4). q8 dot products of those 8 weights, raw and minus `zero`.
EDGELLM_D int dot_nibbles(int lo, int hi, const Q8Block& a, int c, int zero) {
    const int x0 = a.q[c], x1 = a.q[c + 4];
    const int sum_x = dot4(0x01010101, x0, dot4(0x01010101, x1, 0));
    return dot4(lo, x0, dot4(hi, x1, 0)) - zero * sum_x;
}
#endif

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
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_32;  // activations: 8-bit blocks of 32
    // d_w * d_x * sum((q - 8) * q_x) over the chunk's 8 weights
    static EDGELLM_D float dot_q8(const u8* blk, int c, const Q8Block& a) {
        const int v = load_i32_2(blk + 2 + 4 * c);
        const int sumi = dot_nibbles(v & 0x0f0f0f0f, (v >> 4) & 0x0f0f0f0f, a, c, 8);
        return f16_to_f32(load_u16(blk)) * a.d * (float)sumi;
    }
#endif
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
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_32;  // activations: 8-bit blocks of 32
    // d_w * d_x * sum(q * q_x), plus m_w * s_x once per block (chunk 0)
    static EDGELLM_D float dot_q8(const u8* blk, int c, const Q8Block& a) {
        const int v = load_i32_2(blk + 4 + 4 * c);
        const int sumi = dot_nibbles(v & 0x0f0f0f0f, (v >> 4) & 0x0f0f0f0f, a, c, 0);
        const float r = f16_to_f32(load_u16(blk)) * a.d * (float)sumi;
        return c == 0 ? r + f16_to_f32(load_u16(blk + 2)) * *a.m : r;
    }
#endif
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
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_32;  // activations: 8-bit blocks of 32
    // d_w * d_x * sum((q - 16) * q_x)
    static EDGELLM_D float dot_q8(const u8* blk, int c, const Q8Block& a) {
        const u32 qh = (u32)load_i32_2(blk + 2);
        const int v = load_i32_2(blk + 6 + 4 * c);
        const int lo = (v & 0x0f0f0f0f) | spread_bit4((qh >> (4 * c)) & 0xf);
        const int hi = ((v >> 4) & 0x0f0f0f0f) | spread_bit4((qh >> (4 * c + 16)) & 0xf);
        return f16_to_f32(load_u16(blk)) * a.d * (float)dot_nibbles(lo, hi, a, c, 16);
    }
#endif
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
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_32;  // activations: 8-bit blocks of 32
    // d_w * d_x * sum(q * q_x), plus m_w * s_x once per block (chunk 0)
    static EDGELLM_D float dot_q8(const u8* blk, int c, const Q8Block& a) {
        const u32 qh = (u32)load_i32_2(blk + 4);
        const int v = load_i32_2(blk + 8 + 4 * c);
        const int lo = (v & 0x0f0f0f0f) | spread_bit4((qh >> (4 * c)) & 0xf);
        const int hi = ((v >> 4) & 0x0f0f0f0f) | spread_bit4((qh >> (4 * c + 16)) & 0xf);
        const float r = f16_to_f32(load_u16(blk)) * a.d * (float)dot_nibbles(lo, hi, a, c, 0);
        return c == 0 ? r + f16_to_f32(load_u16(blk + 2)) * *a.m : r;
    }
#endif
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
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_32;  // activations: 8-bit blocks of 32
    // d_w * d_x * sum(q * q_x) over weights 8c..8c+7
    static EDGELLM_D float dot_q8(const u8* blk, int c, const Q8Block& a) {
        const int sumi = dot4(load_i32_2(blk + 2 + 8 * c), a.q[2 * c], dot4(load_i32_2(blk + 6 + 8 * c), a.q[2 * c + 1], 0));
        return f16_to_f32(load_u16(blk)) * a.d * (float)sumi;
    }
#endif
};

EDGELLM_QUANT_KERNELS(q4_0, BlockQ4_0)
EDGELLM_QUANT_KERNELS(q4_1, BlockQ4_1)
EDGELLM_QUANT_KERNELS(q5_0, BlockQ5_0)
EDGELLM_QUANT_KERNELS(q5_1, BlockQ5_1)
EDGELLM_QUANT_KERNELS(q8_0, BlockQ8_0)

EDGELLM_Q8_KERNELS(q4_0, BlockQ4_0)
EDGELLM_Q8_KERNELS(q4_1, BlockQ4_1)
EDGELLM_Q8_KERNELS(q5_0, BlockQ5_0)
EDGELLM_Q8_KERNELS(q5_1, BlockQ5_1)
EDGELLM_Q8_KERNELS(q8_0, BlockQ8_0)
