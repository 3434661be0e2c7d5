// Matrix-vector product and dequantization, written once for every block format.
//
// A block format is a struct with
//   block_size   weights per block (1 for the float types)
//   type_size    bytes per block
//   chunks       how many threads share one block; chunk c of a block yields block_size / chunks
//                weights (not necessarily contiguous ones: a chunk follows the format's bit layout)
//   decode(blk, c, sink)   calls sink.put(i, w) for every weight i (0 <= i < block_size) of chunk c
// The weights stay in their raw GGUF blocks in VRAM: W is uint8 (n_rows, row_bytes), row r holds
// n_cols / block_size consecutive blocks. decode() turns bits into floats in registers, and the sink
// decides what happens to them: a dot product with x (matvec) or a store (dequantize).
#ifndef EDGELLM_QUANT_KERNELS_CUH
#define EDGELLM_QUANT_KERNELS_CUH

#include "common.cuh"

// acc += w[i] * x[i] for the block whose activations start at x.
struct DotSink {
    const float* x;
    float acc;
    EDGELLM_HD void put(int i, float w) { acc += w * x[i]; }
};

// out[i] = w[i] for the block whose output starts at out.
struct StoreF32Sink {
    float* out;
    EDGELLM_HD void put(int i, float w) { out[i] = w; }
};

#if defined(EDGELLM_CUDA)
struct StoreF16Sink {
    u16* out;
    EDGELLM_D void put(int i, float w) { out[i] = f32_to_f16(w); }
};
#endif

#if defined(EDGELLM_CUDA)
// y (n_tok, n_rows) = x (n_tok, n_cols) @ W.T, one warp per output row.
// Launch: block (32, MATVEC_ROWS), grid (ceil(n_rows / MATVEC_ROWS), n_tok).
// The 32 lanes of a warp walk the row's (block, chunk) pairs, so neighbouring lanes read
// neighbouring bytes and each block is read from memory once.
template <class Block>
__device__ __forceinline__ void matvec_rows(const u8* __restrict__ w, const float* __restrict__ x,
                                            float* __restrict__ y, int n_rows, int n_cols, i64 row_bytes) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= n_rows) return;  // uniform per warp: the shuffles below see all 32 lanes
    const int tok = blockIdx.y;
    const u8* w_row = w + (i64)row * row_bytes;
    const float* x_tok = x + (i64)tok * n_cols;
    const int n_work = (n_cols / Block::block_size) * Block::chunks;
    DotSink sink = {x_tok, 0.0f};
    for (int i = threadIdx.x; i < n_work; i += WARP_SIZE) {
        const int b = i / Block::chunks;
        sink.x = x_tok + (i64)b * Block::block_size;
        Block::decode(w_row + (i64)b * Block::type_size, i % Block::chunks, sink);
    }
    const float acc = warp_sum(sink.acc);
    if (threadIdx.x == 0) y[(i64)tok * n_rows + row] = acc;
}

// The activations of one weight block, quantized to 8 bits by quant_act.cu in the format the CPU
// backend uses for the weight type (Block::act): "q8_32" for the legacy types (blocks of 32: d =
// fp16(amax / 127), s = sum of q, m = fp16(d * s)), "q8_k" for the K-quants (blocks of 256: d float32,
// s = the 16 sums of q over 16 values, m unused). q is read four values (one int) at a time.
struct Q8Block {
    const int* q;    // the block's int8 values, 4 to an int
    float d;         // scale
    const int* s;    // q8_32: &sum; q8_k: the 16 group sums
    const float* m;  // q8_32: &fp16(d * sum); q8_k: not to be read
};

#define ACT_Q8_32 32
#define ACT_Q8_K 256

// y (n_tok, n_rows) = x (n_tok, n_cols) @ W.T with x quantized to 8 bits first (xq, xd, xs, xm of
// quant_act.cu): integer dot products per block (dot4 = __dp4a), scaled by the weight and activation
// scales, as llama.cpp's CPU backend and its CUDA MMVQ kernels compute products. One warp per row;
// launch as matvec_rows. A weight block is one activation block (block_size == Block::act).
template <class Block>
__device__ __forceinline__ void matvec_q8_rows(const u8* __restrict__ w, const signed char* __restrict__ xq,
                                               const float* __restrict__ xd, const int* __restrict__ xs,
                                               const float* __restrict__ xm, float* __restrict__ y, int n_rows,
                                               int n_cols, i64 row_bytes) {
    static_assert(Block::block_size == Block::act, "one weight block per activation block");
    constexpr int sums = Block::act == ACT_Q8_K ? QK_K / 16 : 1;  // xs entries per block
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= n_rows) return;  // uniform per warp: the shuffles below see all 32 lanes
    const int tok = blockIdx.y;
    const int n_blocks = n_cols / Block::block_size;
    const u8* w_row = w + (i64)row * row_bytes;
    const i64 first = (i64)tok * n_blocks;  // the token's first activation block
    float acc = 0.0f;
    for (int i = threadIdx.x; i < n_blocks * Block::chunks; i += WARP_SIZE) {
        const int b = i / Block::chunks;
        const Q8Block a = {(const int*)(xq + (first + b) * Block::block_size), xd[first + b], xs + (first + b) * sums,
                           xm + (first + b)};
        acc += Block::dot_q8(w_row + (i64)b * Block::type_size, i % Block::chunks, a);
    }
    acc = warp_sum(acc);
    if (threadIdx.x == 0) y[(i64)tok * n_rows + row] = acc;
}

// out (n_rows, n_cols) = dequantized W; one thread per (row, block, chunk).
// Launch: 1-D, n_rows * (n_cols / block_size) * chunks threads.
template <class Block, class Sink, class Out>
__device__ __forceinline__ void dequantize_rows(const u8* __restrict__ w, Out* __restrict__ out, int n_rows,
                                                int n_cols, i64 row_bytes) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const int n_blocks = n_cols / Block::block_size;
    if (i >= (i64)n_rows * n_blocks * Block::chunks) return;
    const int c = (int)(i % Block::chunks);
    const i64 block_index = i / Block::chunks;
    const i64 row = block_index / n_blocks;
    const i64 b = block_index % n_blocks;
    Sink sink = {out + row * n_cols + b * Block::block_size};
    Block::decode(w + row * row_bytes + b * Block::type_size, c, sink);
}

// The extern "C" entry points of one block format: matvec_NAME, dequantize_NAME_f32, dequantize_NAME_f16.
#define EDGELLM_QUANT_KERNELS(NAME, BLOCK)                                                                     \
    extern "C" __global__ void matvec_##NAME(const u8* __restrict__ w, const float* __restrict__ x,           \
                                             float* __restrict__ y, int n_rows, int n_cols, i64 row_bytes) {  \
        matvec_rows<BLOCK>(w, x, y, n_rows, n_cols, row_bytes);                                               \
    }                                                                                                         \
    extern "C" __global__ void dequantize_##NAME##_f32(const u8* __restrict__ w, float* __restrict__ out,     \
                                                       int n_rows, int n_cols, i64 row_bytes) {               \
        dequantize_rows<BLOCK, StoreF32Sink>(w, out, n_rows, n_cols, row_bytes);                              \
    }                                                                                                         \
    extern "C" __global__ void dequantize_##NAME##_f16(const u8* __restrict__ w, u16* __restrict__ out,       \
                                                       int n_rows, int n_cols, i64 row_bytes) {               \
        dequantize_rows<BLOCK, StoreF16Sink>(w, out, n_rows, n_cols, row_bytes);                              \
    }

// matvec_q8_NAME: the product with 8-bit activations, for the quantized block formats.
#define EDGELLM_Q8_KERNELS(NAME, BLOCK)                                                                        \
    extern "C" __global__ void matvec_q8_##NAME(const u8* __restrict__ w, const signed char* __restrict__ xq,   \
                                                const float* __restrict__ xd, const int* __restrict__ xs,      \
                                                const float* __restrict__ xm, float* __restrict__ y, int n_rows, \
                                                int n_cols, i64 row_bytes) {                                   \
        matvec_q8_rows<BLOCK>(w, xq, xd, xs, xm, y, n_rows, n_cols, row_bytes);                                \
    }
#else
#define EDGELLM_QUANT_KERNELS(NAME, BLOCK)
#define EDGELLM_Q8_KERNELS(NAME, BLOCK)
#endif

#endif  // EDGELLM_QUANT_KERNELS_CUH
