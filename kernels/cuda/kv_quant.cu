// K and V written into a block-quantized KV cache (llama.cpp's -ctk/-ctv q8_0 | q4_0), in exactly the
// bytes the CPU backend stores (kernels/cpu/backend.py quantize_kv_rows: what llama.cpp's CPU
// writes: x86's quantize_row_q8_0, ggml's reference quantize_row_q4_0_ref), so a GPU layer's cache
// equals a CPU layer's for the same K/V:
//   q8_0  d: f16 | qs: i8[32];   amax = max |x|, d = amax / 127, id = 127 / amax (0 when amax == 0),
//         q = round-half-to-even(x * id)     (x86's quantize_row_q8_0, which llama.cpp's CPU writes
//         its cache with; ggml's reference, 1 / d and roundf, differs in the last bit of id and at ties)
//   q4_0  d: f16 | qs: u8[16];   v = the value of largest magnitude (the first one), d = v / -8,
//         id = 1 / d (0 when d == 0), q = min(15, trunc(x * id + 8.5)); byte j holds q[j] in its
//         low nibble and q[j + 16] in its high nibble
// id is the reciprocal of the float32 d (not of its f16 rounding), as in ggml. x * id + 8.5 is
// written with __fmul_rn / __fadd_rn so that nvcc does not contract it into an FMA (one rounding
// instead of ggml's two). With CuPy's -ftz=true a block whose amax / 127 is subnormal (|x| < 1.5e-36)
// stores 0 where ggml stores garbage-sized q; K and V never come near that.
//
// x      (n_tok, blocks_per_tok * 32) float32, contiguous: a token's K (or V), all its heads
// cache  (n_slots, blocks_per_tok * type_size) bytes: slot s holds one token's blocks
// slots  (n_tok,) int64: the slot each token's blocks go to
// Launch: block (32, 4), one warp per block of 32 values (lane l: value l); grid ceil(n_blocks / 4),
// n_blocks = n_tok * blocks_per_tok.
#include "common.cuh"

EDGELLM_D void store_f16(u8* p, float f) {
    const u16 h = f32_to_f16(f);
    p[0] = (u8)(h & 0xff);
    p[1] = (u8)(h >> 8);
}

// The block's address in the cache for warp block b.
EDGELLM_D u8* block_at(u8* cache, const i64* slots, i64 b, i64 blocks_per_tok, int type_size) {
    const i64 t = b / blocks_per_tok;
    return cache + slots[t] * blocks_per_tok * type_size + (b % blocks_per_tok) * type_size;
}

extern "C" __global__ void kv_store_q8_0(const float* __restrict__ x, u8* __restrict__ cache,
                                         const i64* __restrict__ slots, i64 blocks_per_tok, i64 n_blocks) {
    const i64 b = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (b >= n_blocks) return;  // uniform per warp
    const int lane = threadIdx.x;
    const float v = x[b * QK + lane];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    u8* blk = block_at(cache, slots, b, blocks_per_tok, 2 + QK);
    blk[2 + lane] = (u8)(signed char)__float2int_rn(v * id);
    if (lane == 0) store_f16(blk, d);
}

extern "C" __global__ void kv_store_q4_0(const float* __restrict__ x, u8* __restrict__ cache,
                                         const i64* __restrict__ slots, i64 blocks_per_tok, i64 n_blocks) {
    const i64 b = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (b >= n_blocks) return;  // uniform per warp
    const int lane = threadIdx.x;
    const float v = x[b * QK + lane];
    float amax = fabsf(v), vmax = v;
    int at = lane;
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {  // the first value of largest magnitude
        const float o_amax = __shfl_xor_sync(0xffffffffu, amax, offset);
        const float o_vmax = __shfl_xor_sync(0xffffffffu, vmax, offset);
        const int o_at = __shfl_xor_sync(0xffffffffu, at, offset);
        if (o_amax > amax || (o_amax == amax && o_at < at)) {
            amax = o_amax;
            vmax = o_vmax;
            at = o_at;
        }
    }
    const float d = vmax / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = min(15, (int)__fadd_rn(__fmul_rn(v, id), 8.5f));
    const int q_hi = __shfl_down_sync(0xffffffffu, q, 16);  // lane l < 16: value l + 16's
    u8* blk = block_at(cache, slots, b, blocks_per_tok, 2 + QK / 2);
    if (lane < 16) blk[2 + lane] = (u8)(q | (q_hi << 4));
    if (lane == 0) store_f16(blk, d);
}
