// Shared helpers for every edgellm CUDA source.
//
// The loader (edgellm/kernels/cuda/__init__.py) pastes this file in place of `#include "common.cuh"`
// before handing the source to NVRTC, so nothing here may include a system header: NVRTC has no
// host headers and CuPy's wheels need not ship cuda_fp16.h. Half precision values are therefore
// carried as `unsigned short` bit patterns and converted with one PTX instruction.
//
// Functions marked EDGELLM_HD also compile for the host, so the block decoders can be checked on
// a machine without a GPU (tests/test_cuda_compile.py builds them into a small host program).
#ifndef EDGELLM_COMMON_CUH
#define EDGELLM_COMMON_CUH

// NVRTC defines __CUDACC_RTC__ (and __CUDACC__); nvcc defines __CUDACC__; a host compiler neither.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define EDGELLM_CUDA 1
#endif

#if defined(EDGELLM_CUDA)
#define EDGELLM_HD __host__ __device__ __forceinline__
#define EDGELLM_D __device__ __forceinline__
#else
#define EDGELLM_HD inline
#define EDGELLM_D inline
#endif

#define QK 32     // weights per block, legacy types
#define QK_K 256  // weights per super-block, K-quants
#define WARP_SIZE 32

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// ---- half / bfloat16 bit patterns <-> float ---------------------------------------------------
EDGELLM_HD float bits_to_float(u32 b) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(b);
#else
    union { u32 u; float f; } v;
    v.u = b;
    return v.f;
#endif
}

EDGELLM_HD u32 float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    union { u32 u; float f; } v;
    v.f = f;
    return v.u;
#endif
}

EDGELLM_HD float f16_to_f32(u16 h) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    // IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
    const u32 sign = (u32)(h & 0x8000) << 16;
    const u32 exponent = (h >> 10) & 0x1f;
    u32 mantissa = h & 0x3ff;
    if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
    if (mantissa == 0) return bits_to_float(sign);
    // subnormal: value = mantissa * 2^-24
    float v = (float)mantissa * (1.0f / 16777216.0f);
    return sign ? -v : v;
#endif
}

#if defined(EDGELLM_CUDA)
EDGELLM_D u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

#if defined(EDGELLM_CUDA)
// float32 rounded to the nearest half (ties to even), as float32: an fp16 scale field's value.
EDGELLM_D float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }
#endif

// bfloat16 is the top half of a float32.
EDGELLM_HD float bf16_to_f32(u16 b) { return bits_to_float((u32)b << 16); }

// Little-endian 16-bit load. Every f16 field of every block format sits at an even offset and
// blocks start at multiples of their (even) type size, so 2-byte loads are aligned.
EDGELLM_HD u16 load_u16(const u8* p) { return *(const u16*)p; }

// Four little-endian bytes as one int from an address that is only 2-byte aligned (block fields sit at
// even offsets of blocks whose size is even but not always a multiple of 4: Q4_0 is 18 bytes).
EDGELLM_HD int load_i32_2(const u8* p) { return (int)((u32)load_u16(p) | ((u32)load_u16(p + 2) << 16)); }

// ---- integer dot products -----------------------------------------------------------------------
#if defined(EDGELLM_CUDA)
// c + the dot product of the four signed bytes of a with those of b (__dp4a from sm_61 on).
EDGELLM_D int dot4(int a, int b, int c) {
#if __CUDA_ARCH__ >= 610
    return __dp4a(a, b, c);
#else
#pragma unroll
    for (int k = 0; k < 32; k += 8) c += (int)(signed char)(a >> k) * (int)(signed char)(b >> k);
    return c;
#endif
}
#endif

// ---- warp reductions ----------------------------------------------------------------------------
#if defined(EDGELLM_CUDA)
EDGELLM_D float warp_sum(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

EDGELLM_D float warp_max(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

EDGELLM_D float neg_infinity() { return __int_as_float(0xff800000); }
#endif

#endif  // EDGELLM_COMMON_CUH
