// K-quant 256-weight super-block formats: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
//
// Sixteen threads share a super-block, each decoding 16 weights, so a warp covers two super-blocks
// per step. Positions below are p = 0..255 within the super-block.
#include "common.cuh"
#include "quant_kernels.cuh"

// scales: u8[16] (lo nibble = scale, hi nibble = min, one per 16 weights) | qs: u8[64] | d, dmin: f16
// Weight p: 2 bits of qs[32 * (p / 128) + p % 32] at shift 2 * ((p % 128) / 32), group p / 16;
// w = d * sc * q - dmin * m. Chunk g = group g (16 weights).
struct BlockQ2_K {
    static constexpr int block_size = QK_K;
    static constexpr int type_size = QK_K / 16 + QK_K / 4 + 2 + 2;
    static constexpr int chunks = 16;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int g, Sink& sink) {
        const u8* scales = blk;
        const u8* qs = blk + QK_K / 16 + 32 * (g / 8) + 16 * (g % 2);
        const float d = f16_to_f32(load_u16(blk + QK_K / 16 + QK_K / 4));
        const float dmin = f16_to_f32(load_u16(blk + QK_K / 16 + QK_K / 4 + 2));
        const float dl = d * (float)(scales[g] & 0x0f);
        const float ml = dmin * (float)(scales[g] >> 4);
        const int shift = 2 * ((g % 8) / 2);
#pragma unroll
        for (int l = 0; l < 16; ++l) sink.put(16 * g + l, dl * (float)((qs[l] >> shift) & 3) - ml);
    }
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_K;  // activations: 8-bit blocks of 256, float d, sums per 16
    // d_x * (d * sc * sum(q * q_x) - dmin * m * sum(q_x)) over group g (weights 16g..16g+15)
    static EDGELLM_D float dot_q8(const u8* blk, int g, const Q8Block& a) {
        const u8* qs = blk + QK_K / 16 + 32 * (g / 8) + 16 * (g % 2);
        const int shift = 2 * ((g % 8) / 2);
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) sumi = dot4((load_i32_2(qs + 4 * i) >> shift) & 0x03030303, a.q[4 * g + i], sumi);
        const int sc = blk[g];
        const float d = f16_to_f32(load_u16(blk + QK_K / 16 + QK_K / 4));
        const float dmin = f16_to_f32(load_u16(blk + QK_K / 16 + QK_K / 4 + 2));
        return a.d * d * (float)((sc & 0x0f) * sumi) - a.d * dmin * (float)((sc >> 4) * a.s[g]);
    }
#endif
};

// The 6-bit scale s (0..15) of Q3_K: its low 4 bits are a nibble of scales[0..7] (low nibbles for
// s < 8, high nibbles of scales[s - 8] otherwise), its high 2 bits sit in scales[8 + s % 4] at bit
// 2 * (s / 4). Stored with an offset of 32.
EDGELLM_HD int q3_k_scale(const u8* scales, int s) {
    const int low = s < 8 ? (scales[s] & 0x0f) : (scales[s - 8] >> 4);
    const int high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
    return (low | (high << 4)) - 32;
}

// hmask: u8[32] | qs: u8[64] | scales: u8[12] (16 x 6 bits) | d: f16
// Weight p: low 2 bits as in Q2_K; high bit = bit p / 32 of hmask[p % 32]; q = low - (high ? 0 : 4);
// w = d * scale(p / 16) * q. Chunk g = group g (16 weights).
struct BlockQ3_K {
    static constexpr int block_size = QK_K;
    static constexpr int type_size = QK_K / 8 + QK_K / 4 + 12 + 2;
    static constexpr int chunks = 16;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int g, Sink& sink) {
        const u8* hmask = blk + 16 * (g % 2);
        const u8* qs = blk + QK_K / 8 + 32 * (g / 8) + 16 * (g % 2);
        const u8* scales = blk + QK_K / 8 + QK_K / 4;
        const float d = f16_to_f32(load_u16(blk + QK_K / 8 + QK_K / 4 + 12));
        const float dl = d * (float)q3_k_scale(scales, g);
        const int shift = 2 * ((g % 8) / 2);
        const int hbit = g / 2;
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int q = ((qs[l] >> shift) & 3) - (((hmask[l] >> hbit) & 1) ? 0 : 4);
            sink.put(16 * g + l, dl * (float)q);
        }
    }
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_K;  // activations: 8-bit blocks of 256, float d, sums per 16
    // d_x * d * scale * sum(q * q_x), q = low 2 bits - (high bit ? 0 : 4), over group g
    static EDGELLM_D float dot_q8(const u8* blk, int g, const Q8Block& a) {
        const u8* hmask = blk + 16 * (g % 2);
        const u8* qs = blk + QK_K / 8 + 32 * (g / 8) + 16 * (g % 2);
        const int shift = 2 * ((g % 8) / 2);
        const int hbit = g / 2;
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int x = a.q[4 * g + i];
            const int no_high = ((load_i32_2(hmask + 4 * i) >> hbit) & 0x01010101) ^ 0x01010101;
            sumi = dot4((load_i32_2(qs + 4 * i) >> shift) & 0x03030303, x, sumi) - 4 * dot4(no_high, x, 0);
        }
        const float d = f16_to_f32(load_u16(blk + QK_K / 8 + QK_K / 4 + 12));
        return a.d * d * (float)(q3_k_scale(blk + QK_K / 8 + QK_K / 4, g) * sumi);
    }
#endif
};

// Scale and min j (0..7) of Q4_K / Q5_K from their 12 packed bytes (ggml's get_scale_min_k4):
// j < 4: sc = q[j] & 63, m = q[j + 4] & 63;
// else   sc = (q[j + 4] & 15) | (q[j - 4] >> 6) << 4,  m = (q[j + 4] >> 4) | (q[j] >> 6) << 4.
EDGELLM_HD void scale_min_k4(const u8* q, int j, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

#if defined(EDGELLM_CUDA)
// scale_min_k4 as integers
EDGELLM_D void scale_min_k4_int(const u8* q, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// The q8 part of Q4_K / Q5_K chunk c (group k = c / 4, offset o = 8 * (c % 4)): lo0, lo1 hold the
// 5-bit (or 4-bit) weights 64k + o .. + 7 of sub-block 2k, hi0, hi1 weights 64k + 32 + o .. + 7 of
// sub-block 2k + 1. d_x * (d * sum(sc * q * q_x) - dmin * sum(m * q_x)); the mins of both sub-blocks
// (sums of q_x per 16 from the activation block) are added by the group's first chunk only.
EDGELLM_D float dot_q8_k4(const u8* blk, int c, const Q8Block& a, int lo0, int lo1, int hi0, int hi1) {
    const int k = c / 4;
    const int x = (64 * k + 8 * (c % 4)) / 4;  // int index of weight 64k + o
    int sc1, m1, sc2, m2;
    scale_min_k4_int(blk + 4, 2 * k, &sc1, &m1);
    scale_min_k4_int(blk + 4, 2 * k + 1, &sc2, &m2);
    const int sum_lo = dot4(lo0, a.q[x], dot4(lo1, a.q[x + 1], 0));
    const int sum_hi = dot4(hi0, a.q[x + 8], dot4(hi1, a.q[x + 9], 0));
    const float d = f16_to_f32(load_u16(blk)), dmin = f16_to_f32(load_u16(blk + 2));
    const float r = a.d * d * (float)(sc1 * sum_lo + sc2 * sum_hi);
    if (c % 4) return r;
    const int mins = m1 * (a.s[4 * k] + a.s[4 * k + 1]) + m2 * (a.s[4 * k + 2] + a.s[4 * k + 3]);
    return r - a.d * dmin * (float)mins;
}
#endif

// d, dmin: f16 | scales: u8[12] | qs: u8[128]
// 64-weight group k (0..3) uses qs[32k .. 32k + 31]: low nibbles are weights 64k + l (sub-block 2k),
// high nibbles weights 64k + 32 + l (sub-block 2k + 1); w = d * sc * q - dmin * m.
// Chunk c: group c / 4, bytes 8 * (c % 4) .. + 7 of it, i.e. 8 low-nibble and 8 high-nibble weights.
struct BlockQ4_K {
    static constexpr int block_size = QK_K;
    static constexpr int type_size = 2 + 2 + 12 + QK_K / 2;
    static constexpr int chunks = 16;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int c, Sink& sink) {
        const float d = f16_to_f32(load_u16(blk));
        const float dmin = f16_to_f32(load_u16(blk + 2));
        const u8* scales = blk + 4;
        const int k = c / 4;
        const int o = 8 * (c % 4);
        const u8* qs = blk + 16 + 32 * k + o;
        float sc, m;
        scale_min_k4(scales, 2 * k, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(scales, 2 * k + 1, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            sink.put(64 * k + o + l, d1 * (float)(qs[l] & 0x0f) - m1);
            sink.put(64 * k + 32 + o + l, d2 * (float)(qs[l] >> 4) - m2);
        }
    }
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_K;  // activations: 8-bit blocks of 256, float d, sums per 16
    static EDGELLM_D float dot_q8(const u8* blk, int c, const Q8Block& a) {
        const u8* qs = blk + 16 + 32 * (c / 4) + 8 * (c % 4);
        const int v0 = load_i32_2(qs), v1 = load_i32_2(qs + 4);
        return dot_q8_k4(blk, c, a, v0 & 0x0f0f0f0f, v1 & 0x0f0f0f0f, (v0 >> 4) & 0x0f0f0f0f, (v1 >> 4) & 0x0f0f0f0f);
    }
#endif
};

// d, dmin: f16 | scales: u8[12] | qh: u8[32] | qs: u8[128]
// As Q4_K plus a 5th bit: weight p's is bit (p / 32) of qh[p % 32].
struct BlockQ5_K {
    static constexpr int block_size = QK_K;
    static constexpr int type_size = 2 + 2 + 12 + QK_K / 8 + QK_K / 2;
    static constexpr int chunks = 16;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int c, Sink& sink) {
        const float d = f16_to_f32(load_u16(blk));
        const float dmin = f16_to_f32(load_u16(blk + 2));
        const u8* scales = blk + 4;
        const int k = c / 4;
        const int o = 8 * (c % 4);
        const u8* qh = blk + 16 + o;
        const u8* qs = blk + 16 + QK_K / 8 + 32 * k + o;
        float sc, m;
        scale_min_k4(scales, 2 * k, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(scales, 2 * k + 1, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            const int lo = (qs[l] & 0x0f) | (((qh[l] >> (2 * k)) & 1) << 4);
            const int hi = (qs[l] >> 4) | (((qh[l] >> (2 * k + 1)) & 1) << 4);
            sink.put(64 * k + o + l, d1 * (float)lo - m1);
            sink.put(64 * k + 32 + o + l, d2 * (float)hi - m2);
        }
    }
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_K;  // activations: 8-bit blocks of 256, float d, sums per 16
    static EDGELLM_D float dot_q8(const u8* blk, int c, const Q8Block& a) {
        const int k = c / 4, o = 8 * (c % 4);
        const u8* qh = blk + 16 + o;
        const u8* qs = blk + 16 + QK_K / 8 + 32 * k + o;
        const int v0 = load_i32_2(qs), v1 = load_i32_2(qs + 4);
        const int h0 = load_i32_2(qh), h1 = load_i32_2(qh + 4);
        return dot_q8_k4(blk, c, a, (v0 & 0x0f0f0f0f) | (((h0 >> (2 * k)) & 0x01010101) << 4),
                         (v1 & 0x0f0f0f0f) | (((h1 >> (2 * k)) & 0x01010101) << 4),
                         ((v0 >> 4) & 0x0f0f0f0f) | (((h0 >> (2 * k + 1)) & 0x01010101) << 4),
                         ((v1 >> 4) & 0x0f0f0f0f) | (((h1 >> (2 * k + 1)) & 0x01010101) << 4));
    }
#endif
};

// ql: u8[128] (low 4 bits) | qh: u8[64] (high 2 bits) | scales: i8[16] | d: f16;  w = d * sc * (q - 32)
// Half n (0..1) covers weights 128n .. 128n + 127 with ql[64n ..], qh[32n ..], scales[8n ..]; for
// l = 0..31 the four weights 128n + l + 32r (r = 0..3) take ql[l] lo, ql[l + 32] lo, ql[l] hi,
// ql[l + 32] hi and bits 2r..2r+1 of qh[l], with scale 16-weight group l / 16 + 2r.
// Chunk c: half c / 8, l = 4 * (c % 8) .. + 3, i.e. 4 weights of each of the four runs.
struct BlockQ6_K {
    static constexpr int block_size = QK_K;
    static constexpr int type_size = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
    static constexpr int chunks = 16;
    template <class Sink>
    static EDGELLM_HD void decode(const u8* blk, int c, Sink& sink) {
        const int n = c / 8;
        const int l0 = 4 * (c % 8);
        const u8* ql = blk + 64 * n;
        const u8* qh = blk + QK_K / 2 + 32 * n;
        const signed char* sc = (const signed char*)(blk + QK_K / 2 + QK_K / 4) + 8 * n;
        const float d = f16_to_f32(load_u16(blk + QK_K / 2 + QK_K / 4 + QK_K / 16));
        const int is = l0 / 16;
        const float d0 = d * (float)sc[is], d1 = d * (float)sc[is + 2];
        const float d2 = d * (float)sc[is + 4], d3 = d * (float)sc[is + 6];
#pragma unroll
        for (int l = l0; l < l0 + 4; ++l) {
            const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            sink.put(128 * n + l, d0 * (float)q1);
            sink.put(128 * n + l + 32, d1 * (float)q2);
            sink.put(128 * n + l + 64, d2 * (float)q3);
            sink.put(128 * n + l + 96, d3 * (float)q4);
        }
    }
#if defined(EDGELLM_CUDA)
    static constexpr int act = ACT_Q8_K;  // activations: 8-bit blocks of 256, float d, sums per 16
    // d_x * d * sum(sc * (q - 32) * q_x) over the chunk's four runs of 4 weights
    static EDGELLM_D float dot_q8(const u8* blk, int c, const Q8Block& a) {
        const int n = c / 8, l0 = 4 * (c % 8);
        const int lo_a = load_i32_2(blk + 64 * n + l0), lo_b = load_i32_2(blk + 64 * n + l0 + 32);
        const int h = load_i32_2(blk + QK_K / 2 + 32 * n + l0);
        const signed char* sc = (const signed char*)(blk + QK_K / 2 + QK_K / 4) + 8 * n + l0 / 16;
        const int q[4] = {(lo_a & 0x0f0f0f0f) | ((h & 0x03030303) << 4),
                          (lo_b & 0x0f0f0f0f) | (((h >> 2) & 0x03030303) << 4),
                          ((lo_a >> 4) & 0x0f0f0f0f) | (((h >> 4) & 0x03030303) << 4),
                          ((lo_b >> 4) & 0x0f0f0f0f) | (((h >> 6) & 0x03030303) << 4)};
        int sumi = 0;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int x = a.q[(128 * n + l0 + 32 * r) / 4];
            sumi += (int)sc[2 * r] * (dot4(q[r], x, 0) - 32 * dot4(0x01010101, x, 0));
        }
        return a.d * f16_to_f32(load_u16(blk + QK_K / 2 + QK_K / 4 + QK_K / 16)) * (float)sumi;
    }
#endif
};

EDGELLM_QUANT_KERNELS(q2_k, BlockQ2_K)
EDGELLM_QUANT_KERNELS(q3_k, BlockQ3_K)
EDGELLM_QUANT_KERNELS(q4_k, BlockQ4_K)
EDGELLM_QUANT_KERNELS(q5_k, BlockQ5_K)
EDGELLM_QUANT_KERNELS(q6_k, BlockQ6_K)

EDGELLM_Q8_KERNELS(q2_k, BlockQ2_K)
EDGELLM_Q8_KERNELS(q3_k, BlockQ3_K)
EDGELLM_Q8_KERNELS(q4_k, BlockQ4_K)
EDGELLM_Q8_KERNELS(q5_k, BlockQ5_K)
EDGELLM_Q8_KERNELS(q6_k, BlockQ6_K)
