/* Decode attention for the CPU (AVX2 + FMA): one query token over one sequence's contiguous float32 K/V.

   Two passes around a softmax the caller runs (torch's, vectorized):
     kvchat_decode_scores: s[h, g, t] = sm_scale * (q[h, g] . k[h, t])
     kvchat_decode_values: o[h, g]    = sum_t p[h, g, t] * v[h, t]

   q      float32 [H, G, D] contiguous (H KV heads, G query heads per KV head: GQA, K/V never repeated)
   k, v   float32, element (h, t, d) at h * head_stride + t * token_stride + d (D contiguous)
   s, p   float32 [H, G, L] contiguous
   o      float32 [H, G, D] contiguous
   work   float32 [H * ceil(L / SPLIT), G, D] scratch for the values pass

   D must be a multiple of 8 and at most 8 * MAX_VEC; L at least 1 (kvchat_decode_limits says both).

   Both passes split each head's L tokens into fixed SPLIT-token ranges and
   an OpenMP team of `threads` shares the (head, range) tasks, so the two
   cores stay busy even for 3 KV heads. The values pass sums each range's
   partial output into `work`, then adds the ranges in order: the bits depend
   on L alone, never on the thread count (split-K as in FlashDecoding, Dao et
   al. 2023, without its rescaling since the softmax is done first). */

#include <immintrin.h>
#include <stdint.h>

#define SPLIT 256
#define MAX_VEC 32 /* D / 8: the values pass's accumulators */

/* SPLIT and the largest D, for the caller's scratch size and checks. */
void kvchat_decode_limits(int64_t *split, int64_t *max_head_dim) {
  *split = SPLIT;
  *max_head_dim = 8 * MAX_VEC;
}

static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

/* Tokens [t0, t1) of one head: scores of its G query rows. NV = D / 8 is a compile-time constant in the
   specialised copies below, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void scores_range(const float *qh, const float *kh, float *sh,
                                                              int64_t G, int64_t L, int64_t token_stride,
                                                              int64_t t0, int64_t t1, float sm_scale, const int NV) {
  for (int64_t t = t0; t < t1; ++t) {
    const float *kt = kh + t * token_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float *qg = qh + g * NV * 8;
      __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(kt), _mm256_loadu_ps(qg)), a1 = _mm256_setzero_ps();
      for (int j = 1; j < NV; j += 2) {
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(kt + 8 * j), _mm256_loadu_ps(qg + 8 * j), a1);
        if (j + 1 < NV) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kt + 8 * j + 8), _mm256_loadu_ps(qg + 8 * j + 8), a0);
      }
      sh[g * L + t] = hsum8(_mm256_add_ps(a0, a1)) * sm_scale;
    }
  }
}

/* Tokens [t0, t1) of one head: the unnormalised partial output of its G query rows into out [G, D]. */
static inline __attribute__((always_inline)) void values_range(const float *ph, const float *vh, float *out,
                                                              int64_t G, int64_t L, int64_t token_stride,
                                                              int64_t t0, int64_t t1, const int NV) {
  for (int64_t g = 0; g < G; ++g) {
    const float *pg = ph + g * L;
    __m256 acc[MAX_VEC];
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      const float *vt = vh + t * token_stride;
      const __m256 w = _mm256_set1_ps(pg[t]);
      for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * j), acc[j]);
    }
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + g * NV * 8 + 8 * j, acc[j]);
  }
}

#define BY_NV(call_with_nv)      \
  switch (nv) {                  \
    case 4: call_with_nv(4); break;   \
    case 8: call_with_nv(8); break;   \
    case 16: call_with_nv(16); break; \
    default: call_with_nv(nv);        \
  }

void kvchat_decode_scores(const float *q, const float *k, float *s, int64_t H, int64_t G, int64_t D, int64_t L,
                          int64_t head_stride, int64_t token_stride, float sm_scale, int threads) {
  const int64_t ranges = (L + SPLIT - 1) / SPLIT;
  const int nv = (int)(D / 8);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < H * ranges; ++task) {
    const int64_t h = task / ranges, t0 = (task % ranges) * SPLIT;
    const int64_t t1 = t0 + SPLIT < L ? t0 + SPLIT : L;
#define SCORES(NV) scores_range(q + h * G * D, k + h * head_stride, s + h * G * L, G, L, token_stride, t0, t1, sm_scale, NV)
    BY_NV(SCORES)
#undef SCORES
  }
}

void kvchat_decode_values(const float *p, const float *v, float *o, float *work, int64_t H, int64_t G, int64_t D,
                          int64_t L, int64_t head_stride, int64_t token_stride, int threads) {
  const int64_t ranges = (L + SPLIT - 1) / SPLIT;
  const int nv = (int)(D / 8);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < H * ranges; ++task) {
    const int64_t h = task / ranges, t0 = (task % ranges) * SPLIT;
    const int64_t t1 = t0 + SPLIT < L ? t0 + SPLIT : L;
#define VALUES(NV) values_range(p + h * G * L, v + h * head_stride, work + task * G * D, G, L, token_stride, t0, t1, NV)
    BY_NV(VALUES)
#undef VALUES
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t g = 0; g < G; ++g) {
      float *out = o + (h * G + g) * D;
      for (int64_t d = 0; d < D; d += 8) {
        __m256 sum = _mm256_loadu_ps(work + ((h * ranges) * G + g) * D + d);
        for (int64_t r = 1; r < ranges; ++r)
          sum = _mm256_add_ps(sum, _mm256_loadu_ps(work + ((h * ranges + r) * G + g) * D + d));
        _mm256_storeu_ps(out + d, sum);
      }
    }
}
