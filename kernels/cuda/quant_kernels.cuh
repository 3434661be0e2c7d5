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
#else
#define EDGELLM_QUANT_KERNELS(NAME, BLOCK)
#endif

#endif  // EDGELLM_QUANT_KERNELS_CUH
