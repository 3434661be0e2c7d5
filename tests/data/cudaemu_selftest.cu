// The CUDA executor's own test kernels (tests/test_cudaemu_selftest.py checks them against NumPy).
#include <cuda_fp16.h>

extern "C" __global__ void __launch_bounds__(128) shuffles(const int* in, int* out, int width) {
    const int t = threadIdx.x, v = in[t];
    out[0 * 128 + t] = __shfl_sync(0xffffffffu, v, 3, width);
    out[1 * 128 + t] = __shfl_up_sync(0xffffffffu, v, 2, width);
    out[2 * 128 + t] = __shfl_down_sync(0xffffffffu, v, 5, width);
    out[3 * 128 + t] = __shfl_xor_sync(0xffffffffu, v, 9, width);
    out[4 * 128 + t] = (int)__ballot_sync(0xffffffffu, v & 1);
    out[5 * 128 + t] = __any_sync(0xffffffffu, v == 77) + 2 * __all_sync(0xffffffffu, v >= 0);
}

// dynamic shared memory, __syncthreads_count, a block-wide tree reduction
extern "C" __global__ void block_sum(const float* x, float* out, int* counts, int n) {
    extern __shared__ float buf[];
    const int t = threadIdx.x;
    const int i = blockIdx.x * blockDim.x + t;
    buf[t] = i < n ? x[i] : 0.0f;
    const int c = __syncthreads_count(i < n);
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] += buf[t + s];
        __syncthreads();
    }
    if (t == 0) { out[blockIdx.x] = buf[0]; counts[blockIdx.x] = c; }
}

extern "C" __global__ void half_roundtrip(const float* x, unsigned short* h, float* back, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const __half v = __float2half(x[i]);
    h[i] = __half_as_ushort(v);
    back[i] = __half2float(v);
}

extern "C" __global__ void divergent_barrier(int* out) {
    if (threadIdx.x < 16) { __syncthreads(); out[threadIdx.x] = 1; }
    else { __syncthreads(); out[threadIdx.x] = 2; }
}

extern "C" __global__ void atomics(int* counter, float* fsum) {
    atomicAdd(counter, 1);
    atomicAdd(fsum, 0.5f);
}

extern "C" __global__ void early_exit_before_shuffle(int* out) {
    if (threadIdx.x == 0) return;  // lane 0 leaves; the others name it in their mask
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
