// RMSNorm (also per-head QK-norm) and rotary position embedding, float32 activations.
// The rounding follows edgellm.kernels.cpu.backend (which follows ggml's CPU code) so both devices agree.
#include "common.cuh"

#define NORM_THREADS 256

// out[r, :] = x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps)) * w    (has_weight = 0: no w)
// x (n_rows, n) with row stride x_stride, out (n_rows, n) with row stride out_stride, in elements;
// out may alias x. QK-norm is this with rows = (token, head) and n = head_dim.
// The sum of squares is accumulated in float64 like ggml's CPU rms_norm.
// Launch: grid n_rows, block NORM_THREADS.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rms_norm_f32(const float* x, const float* __restrict__ w, int has_weight, float* out, int n, float eps,
             i64 x_stride, i64 out_stride) {
    __shared__ double warp_sums[NORM_THREADS / WARP_SIZE];
    const float* x_row = x + (i64)blockIdx.x * x_stride;
    float* out_row = out + (i64)blockIdx.x * out_stride;
    double sum = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += (double)(x_row[i] * x_row[i]);
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (lane == 0) warp_sums[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int k = 0; k < (int)(blockDim.x / WARP_SIZE); ++k) total += warp_sums[k];
        warp_sums[0] = total;
    }
    __syncthreads();
    const float mean = (float)(warp_sums[0] / (double)n);
    const float inv = 1.0f / sqrtf(mean + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float y = x_row[i] * inv;
        out_row[i] = has_weight ? y * w[i] : y;
    }
}

// Rotary embedding in place on x (n_tok, n_head, head_dim) with strides tok_stride, head_stride.
// Pair i (0 <= i < n_rot / 2) of the token at position p turns by
//   theta_i = (p * theta_scale^i) * freq_scale,   theta_scale = freq_base^(-2 / n_rot) (float32),
// the power taken by repeated float32 multiplication as ggml's CPU rope cache does; with
// has_freq_factors, theta_i is first divided by freq_factors[i] (llama-3 "rope_freqs").
//   normal (GGUF llama order): rotates (x[2i], x[2i + 1])
//   neox:                      rotates (x[i], x[i + n_rot / 2])
// Dimensions n_rot .. head_dim - 1 are left as they are.
// Launch: grid (n_tok, n_head), block a multiple of 32 (n_rot / 2 rounded up is plenty).
extern "C" __global__ void rope_f32(float* x, const int* __restrict__ pos, int n_rot, float theta_scale,
                                    float freq_scale, int neox, const float* __restrict__ freq_factors,
                                    int has_freq_factors, i64 tok_stride, i64 head_stride) {
    float* v = x + (i64)blockIdx.x * tok_stride + (i64)blockIdx.y * head_stride;
    const float p = (float)pos[blockIdx.x];
    for (int i = threadIdx.x; i < n_rot / 2; i += blockDim.x) {
        float theta = p;
        for (int k = 0; k < i; ++k) theta *= theta_scale;
        if (has_freq_factors) theta /= freq_factors[i];
        theta *= freq_scale;
        const float c = cosf(theta), s = sinf(theta);
        const int a = neox ? i : 2 * i;
        const int b = neox ? i + n_rot / 2 : 2 * i + 1;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}
