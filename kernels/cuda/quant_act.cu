// Activations quantized to 8 bits before a product with quantized weights (quant_kernels.cuh's
// matvec_q8_rows), in exactly the formats and roundings of the CPU backend (kernels/cpu/common.py,
// llama.cpp's x86 quantizers), so that a GPU layer's products equal a CPU layer's up to float32
// summation order:
//   "q8_32" (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights): blocks of 32; amax = max |x|, d = amax / 127,
//           q = round-half-even(x * (127 / amax)); xd = fp16(d), xs = sum(q), xm = fp16(d * sum(q)).
//   "q8_k"  (K-quant weights): blocks of 256; v = the value of largest magnitude (the first one),
//           iscale = -127 / v, q = min(127, round-half-even(iscale * x)), xd = 1 / iscale (float32),
//           xs = the sums of q over each 16 values.
// llama.cpp's CUDA backend quantizes to q8_1 blocks of 32 for every type (so its GPU and CPU results
// differ); edgellm keeps the CPU's formats so a hybrid run agrees with a CPU-only one.
//
// With write_xr the kernels also store xr = d * q as float32 (the activations a prompt batch's float
// product multiplies, as the CPU's requantize_rows_* do); otherwise xr is not touched.
// Launch: block (32, 4), one warp per activation block; grid ceil(n_blocks / 4).
#include "common.cuh"

extern "C" __global__ void quantize_q8_32_f32(const float* __restrict__ x, signed char* __restrict__ xq,
                                              float* __restrict__ xd, int* __restrict__ xs, float* __restrict__ xm,
                                              float* __restrict__ xr, int write_xr, i64 n_blocks) {
    const i64 b = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (b >= n_blocks) return;  // uniform per warp
    const int lane = threadIdx.x;
    const float v = x[b * QK + lane];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    const int q = __float2int_rn(v * inv);
    xq[b * QK + lane] = (signed char)q;
    const int sum = (int)warp_sum((float)q);  // |sum| <= 32 * 127: exact in float32
    const float d16 = round_f16(d);
    if (write_xr) xr[b * QK + lane] = d16 * (float)q;
    if (lane == 0) {
        xd[b] = d16;
        xs[b] = sum;
        xm[b] = round_f16(d * (float)sum);
    }
}

// Lane l takes values 8l .. 8l + 7 of the block, so lanes 2g and 2g + 1 hold group g's 16.
extern "C" __global__ void quantize_q8_k_f32(const float* __restrict__ x, signed char* __restrict__ xq,
                                             float* __restrict__ xd, int* __restrict__ xs, float* __restrict__ xr,
                                             int write_xr, i64 n_blocks) {
    const i64 b = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (b >= n_blocks) return;  // uniform per warp
    const int lane = threadIdx.x;
    const float* xb = x + b * QK_K + 8 * lane;
    float v[8];
    float amax = 0.0f, vmax = 0.0f;  // the lane's first value of largest magnitude
    int at = 8 * lane;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        v[j] = xb[j];
        if (fabsf(v[j]) > amax) {
            amax = fabsf(v[j]);
            vmax = v[j];
            at = 8 * lane + j;
        }
    }
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {  // the block's first one: ties go to the lower index
        const float o_amax = __shfl_xor_sync(0xffffffffu, amax, offset);
        const float o_vmax = __shfl_xor_sync(0xffffffffu, vmax, offset);
        const int o_at = __shfl_xor_sync(0xffffffffu, at, offset);
        if (o_amax > amax || (o_amax == amax && o_at < at)) {
            amax = o_amax;
            vmax = o_vmax;
            at = o_at;
        }
    }
    const float iscale = amax != 0.0f ? -127.0f / vmax : 0.0f;
    const float d = amax != 0.0f ? 1.0f / iscale : 0.0f;
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int q = min(__float2int_rn(iscale * v[j]), 127);
        xq[b * QK_K + 8 * lane + j] = (signed char)q;
        if (write_xr) xr[b * QK_K + 8 * lane + j] = d * (float)q;
        sum += q;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (lane % 2 == 0) xs[b * (QK_K / 16) + lane / 2] = sum;
    if (lane == 0) xd[b] = d;
}
