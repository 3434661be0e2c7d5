// Causal multi-head attention over a KV cache, for decode (n_tok = 1) and prefill (n_tok > 1).
//
// q        (n_tok, n_head, head_dim_k) float32, contiguous; q_pos (n_tok,) int32: each query's position
// k_cache  (n_slots, n_kv_head, head_dim_k) float16 (or float32)
// v_cache  (n_slots, n_kv_head, head_dim_v), same dtype
// kv_pos   (n_slots,) int32: the position held by each slot, -1 when empty (the cache may be a ring,
//          slot = position % n_slots, as in edgellm.backend.KVLayer); only slots < n_used are read
// out      (n_tok, n_head * head_dim_v) float32
// Query at position p sees slot j when 0 <= kv_pos[j] <= p and, for a sliding window (window > 0),
// p - kv_pos[j] < window (llama.cpp masks a key when query_pos - key_pos >= n_swa). Head h reads kv
// head h / (n_head / n_kv_head) (GQA). Scores are (q . k) * scale with q rounded to float16 when the
// cache is float16, like ggml's f16 K x f32 Q product; softmax and the value sum are float32.
//
// One thread block per (head, token); each of its ATTN_WARPS warps takes every ATTN_WARPS-th slot and
// keeps a running softmax (max m, sum l, weighted sum of values) in float32, lane k holding
// dimensions k, k + 32, ...; the warps' partial results are merged at the end.
// Launch: grid (n_head, n_tok), block ATTN_WARPS * 32. head_dim_k, head_dim_v <= ATTN_MAX_HEAD_DIM.
#include "common.cuh"

#define ATTN_WARPS 8
#define ATTN_MAX_HEAD_DIM 256
#define ATTN_PER_LANE (ATTN_MAX_HEAD_DIM / WARP_SIZE)

EDGELLM_D float load_kv(const u16* p) { return f16_to_f32(*p); }
EDGELLM_D float load_kv(const float* p) { return *p; }
// q as the K cache's dtype sees it.
EDGELLM_D float round_like(const u16*, float x) { return f16_to_f32(f32_to_f16(x)); }
EDGELLM_D float round_like(const float*, float x) { return x; }

template <class KV>
__device__ __forceinline__ void attention_heads(const float* __restrict__ q, const int* __restrict__ q_pos,
                                                const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                                                const int* __restrict__ kv_pos, int n_used, float* __restrict__ out,
                                                int n_head, int n_kv_head, int head_dim_k, int head_dim_v,
                                                float scale, int window) {
    __shared__ float m_part[ATTN_WARPS];
    __shared__ float l_part[ATTN_WARPS];
    __shared__ float acc_part[ATTN_WARPS][ATTN_MAX_HEAD_DIM];

    const int h = blockIdx.x;
    const int t = blockIdx.y;
    const int kv_head = h / (n_head / n_kv_head);
    const int p = q_pos[t];
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const i64 k_row = (i64)n_kv_head * head_dim_k;  // elements per cache slot
    const i64 v_row = (i64)n_kv_head * head_dim_v;

    const float* q_head = q + ((i64)t * n_head + h) * head_dim_k;
    float q_reg[ATTN_PER_LANE];
    float acc[ATTN_PER_LANE];
#pragma unroll
    for (int i = 0; i < ATTN_PER_LANE; ++i) {
        const int d = lane + WARP_SIZE * i;
        q_reg[i] = d < head_dim_k ? round_like(k_cache, q_head[d]) : 0.0f;
        acc[i] = 0.0f;
    }

    float m = neg_infinity();
    float l = 0.0f;
    for (int j = warp; j < n_used; j += ATTN_WARPS) {
        const int key_pos = kv_pos[j];  // the same for the whole warp: the branch below is uniform
        if (key_pos < 0 || key_pos > p || (window > 0 && p - key_pos >= window)) continue;
        const KV* k = k_cache + (i64)j * k_row + (i64)kv_head * head_dim_k;
        const KV* v = v_cache + (i64)j * v_row + (i64)kv_head * head_dim_v;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < ATTN_PER_LANE; ++i) {
            const int d = lane + WARP_SIZE * i;
            if (d < head_dim_k) s += q_reg[i] * load_kv(k + d);
        }
        s = warp_sum(s) * scale;
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new);  // 0 for the first key (m = -inf)
        const float weight = expf(s - m_new);
        l = l * correction + weight;
#pragma unroll
        for (int i = 0; i < ATTN_PER_LANE; ++i) {
            const int d = lane + WARP_SIZE * i;
            if (d < head_dim_v) acc[i] = acc[i] * correction + weight * load_kv(v + d);
        }
        m = m_new;
    }

    if (lane == 0) {
        m_part[warp] = m;
        l_part[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATTN_PER_LANE; ++i) {
        const int d = lane + WARP_SIZE * i;
        if (d < head_dim_v) acc_part[warp][d] = acc[i];
    }
    __syncthreads();

    // Merge: out = sum_w acc_w e^(m_w - M) / sum_w l_w e^(m_w - M). A warp that saw no key has
    // m = -inf and l = acc = 0. The query's own key is in the cache, so M is finite.
    float m_max = neg_infinity();
    for (int w = 0; w < ATTN_WARPS; ++w) m_max = fmaxf(m_max, m_part[w]);
    float denominator = 0.0f;
    for (int w = 0; w < ATTN_WARPS; ++w) denominator += l_part[w] * expf(m_part[w] - m_max);
    float* out_head = out + ((i64)t * n_head + h) * head_dim_v;
    for (int d = threadIdx.x; d < head_dim_v; d += blockDim.x) {
        float numerator = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) numerator += acc_part[w][d] * expf(m_part[w] - m_max);
        out_head[d] = numerator / denominator;
    }
}

#define EDGELLM_ATTENTION_KERNEL(NAME, KV)                                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP_SIZE)                                     \
    NAME(const float* __restrict__ q, const int* __restrict__ q_pos, const KV* __restrict__ k_cache,          \
         const KV* __restrict__ v_cache, const int* __restrict__ kv_pos, int n_used, float* __restrict__ out,  \
         int n_head, int n_kv_head, int head_dim_k, int head_dim_v, float scale, int window) {                \
        attention_heads<KV>(q, q_pos, k_cache, v_cache, kv_pos, n_used, out, n_head, n_kv_head, head_dim_k,  \
                            head_dim_v, scale, window);                                                       \
    }

EDGELLM_ATTENTION_KERNEL(attention_f16kv, u16)
EDGELLM_ATTENTION_KERNEL(attention_f32kv, float)
