// Element-wise float32 ops on flat, contiguous arrays of n elements. Launch: 1-D, n threads.
#include "common.cuh"

// out = silu(gate) * up, silu(g) = g / (1 + exp(-g))
extern "C" __global__ void silu_mul_f32(const float* __restrict__ gate, const float* __restrict__ up,
                                        float* __restrict__ out, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
}

// out = gelu(gate) * up with the tanh approximation ggml uses:
// gelu(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
extern "C" __global__ void gelu_mul_f32(const float* __restrict__ gate, const float* __restrict__ up,
                                        float* __restrict__ out, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate[i];
    const float sqrt_2_over_pi = 0.7978845608028654f;
    out[i] = 0.5f * g * (1.0f + tanhf(sqrt_2_over_pi * g * (1.0f + 0.044715f * g * g))) * up[i];
}

// out = x + y (residual connection, bias). out may alias x or y.
extern "C" __global__ void add_f32(const float* x, const float* y, float* out, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}

// out (n_rows, n) = x (n_rows, n) + y (n,): a bias broadcast over rows. out may alias x.
extern "C" __global__ void add_row_f32(const float* x, const float* __restrict__ y, float* out, i64 n_total, int n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_total) out[i] = x[i] + y[i % n];
}

// x *= s in place.
extern "C" __global__ void scale_f32(float* x, float s, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

