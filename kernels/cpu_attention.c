/* Decode attention and the K/V cache write for the CPU (AVX2, FMA, F16C; or AVX-512), straight on the paged pool.

   Pool layout (kvchat.kernels.reference): per layer K and V [num_blocks, BS, H, D] in float8_e4m3fn (KIND_FP8,
   then one float32 scale per token and KV head, [num_blocks, BS, H]), bfloat16 (KIND_BF16) or float16
   (KIND_FP16); token t of a sequence sits at slot block_table[t / BS] * BS + t % BS.

   kvchat_paged_write:  the new tokens' K/V into their slots, quantized as kvchat.kernels.reference.write_kv
                        does (same bits: per token and KV head absmax / 448, x / scale clamped to +-448, round
                        to nearest even, NaN and inf as torch's ops give them; 16-bit pools a
                        round-to-nearest-even cast). Slots must lie in the pool (the Python wrapper checks).
   kvchat_paged_scores: s[r, h, g, t] = sm_scale * (q[r, h, g] . k[r, h, t]) for t < L_rg, -inf up to Lmax
   kvchat_paged_values: o[r, h, g]    = sum_t p[r, h, g, t] * v[r, h, t]
   The softmax between the two passes is the caller's, with p = 0 past L_rg (the values pass still multiplies
   those zeros by the V of the later tokens up to L_r: a NaN or inf there reaches the earlier tokens' output,
   as in a masked matmul).

   q      float32 [R, H, G, D] contiguous (R sequences, H KV heads, G queries per KV head). The G queries of a
          KV head are T consecutive tokens of G / T query heads each (GQA), token-major: query g is token
          g / (G / T) of the T newest and sees L_rg = L_r - T + 1 + g / (G / T) tokens (causal). A decode step
          has T = 1; a short chunk of one sequence (T > 1) reads each K/V range once for all its tokens.
   s, p   float32 [R, H, G, Lmax] contiguous
   o      float32 [R, H, G, D] contiguous
   table  int32, row r at table + r * table_stride; lens int32 [R] (L_r, the T new tokens included)
   sink   float32 exact position-0 K (or V) of row r at sink + r * sink_stride, [H, D] contiguous; NULL: none
   tile   float32 scratch of threads * H * SPLIT * (D + 1): per thread H * SPLIT * D values, then H * SPLIT factors; work float32 [R * ceil(Lmax / SPLIT), H, G, D] scratch

   D is a multiple of 16 and at most 8 * MAX_VEC (kvchat_decode_limits says both).

   Both passes split each row's tokens into fixed SPLIT-token ranges, all KV heads in one task, shared by an
   OpenMP team of `threads` (so the two cores stay busy for 3 KV heads). A task first converts its range to
   float32 in a tile (fp8: the byte as float16 bits, i.e. value * 2**-8 / scale; the factor 2**8 * scale is
   applied after the dot product in the scores pass and folded into p in the values pass), then runs 8-lane
   loops over the tile. Every table row must hold ceil(L_r / BS) valid blocks (the wrapper checks the width). The values pass sums
   each range's partial output into `work`, then adds the ranges in order: a query's bits depend on L_r, T and
   its index alone, never on the thread count or on the other rows (split-K as in FlashDecoding, Dao et al. 2023, without its
   rescaling since the softmax is done first).

   Built with KVCHAT_AVX512 (cpu_build.py's avx512 variant): the scores pass runs two queries per 16-lane register,
   each half doing the 8-lane loop's operations in its order; the values pass two queries at a time, 16 output values
   per register, each lane its own sum over the tokens in order; fp8 converts 32 values a step (an exact conversion). The bits equal
   the AVX2 build's. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define SPLIT 128
#define MAX_VEC 32 /* D / 8: the values pass's accumulators */
#define KIND_FP8 0
#define KIND_BF16 1
#define KIND_FP16 2
#define FP8_MAX 448.0f
#define FP8_EPS 1e-6f

/* SPLIT and the largest D, for the caller's scratch sizes and checks. */
void kvchat_decode_limits(int64_t *split, int64_t *max_head_dim) {
  *split = SPLIT;
  *max_head_dim = 8 * MAX_VEC;
}


static inline int64_t elem_bytes(int kind) { return kind == KIND_FP8 ? 1 : 2; }

/* One token's D values of one head into dst (float32); fp8 without its scale (the byte as float16 bits:
   value * 2**-8 / scale). */
static inline void load_row(const uint8_t *src, int kind, int64_t D, float *dst) {
#ifdef KVCHAT_AVX512
  if (kind == KIND_FP8 && D % 32 == 0) { /* the same bit trick, 32 values a step */
    const __m512i clear = _mm512_set1_epi16((short)~0x4000);
    for (int64_t d = 0; d < D; d += 32) {
      __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(src + d)));
      w = _mm512_and_si512(_mm512_slli_epi16(w, 7), clear);
      _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm512_castsi512_si256(w)));
      _mm512_storeu_ps(dst + d + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1)));
    }
    return;
  }
#endif
  if (kind == KIND_FP8) {
    /* e4m3 byte, sign-extended to 16 bits, shifted left 7, bit 14 cleared: float16 bits */
    const __m256i clear = _mm256_set1_epi16((short)~0x4000);
    for (int64_t d = 0; d < D; d += 16) {
      __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + d)));
      w = _mm256_and_si256(_mm256_slli_epi16(w, 7), clear);
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm256_castsi256_si128(w)));
      _mm256_storeu_ps(dst + d + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1)));
    }
  } else if (kind == KIND_BF16) {
    for (int64_t d = 0; d < D; d += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * d)));
      _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  } else {
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * d))));
  }
}

/* Tokens [t0, t1) of one sequence of L tokens, all H heads, into tile [H, SPLIT, D] and each row's factor into
   factor [H, SPLIT] (fp8: 2**8 * scale, else 1), so value = tile * factor; position 0 from sink when given
   (factor 1). Each token's H * D values are one contiguous run of the pool, read in order; the block table
   is walked a block at a time (no division per token), and while a block converts, the block PREFETCH
   blocks ahead is fetched a few lines per token (the conversion is otherwise stalled on DRAM: measured). */
#define PREFETCH 4 /* blocks; measured at 4,096 tokens (30 layers, 2 threads): 1 and 2 no better than none, 4 best, 8-16 no better */
static void load_tile(const uint8_t *cache, const float *scale, const int32_t *table, const float *sink,
                      int64_t BS, int64_t H, int64_t D, int kind, int64_t t0, int64_t t1, int64_t L, float *tile,
                      float *factor) {
  const int64_t eb = elem_bytes(kind), row = H * D * eb, lines = (BS * row + 63) / 64;
  const int64_t per_token = (lines + BS - 1) / BS;
  int64_t t = t0, blk = t0 / BS, off = t0 % BS;
  for (; t < t1; ++blk, off = 0) {
    const int64_t base = (int64_t)table[blk] * BS;
    const int ahead = (blk + PREFETCH) * BS < L;
    const uint8_t *pf = ahead ? cache + (int64_t)table[blk + PREFETCH] * BS * row : NULL;
    const float *pf_scale = ahead && kind == KIND_FP8 ? scale + (int64_t)table[blk + PREFETCH] * BS * H : NULL;
    for (; off < BS && t < t1; ++off, ++t) {
      if (pf != NULL)
        for (int64_t i = off * per_token; i < (off + 1) * per_token && i < lines; ++i)
          _mm_prefetch((const char *)(pf + 64 * i), _MM_HINT_T0);
      if (pf_scale != NULL && off * 16 < BS * H) _mm_prefetch((const char *)(pf_scale + 16 * off), _MM_HINT_T0);
      for (int64_t h = 0; h < H; ++h) {
        float *dst = tile + (h * SPLIT + t - t0) * D;
        const int64_t slot = base + off;
        if (t == 0 && sink != NULL) {
          for (int64_t d = 0; d < D; ++d) dst[d] = sink[h * D + d];
          factor[h * SPLIT] = 1.0f;
        } else {
          load_row(cache + (slot * H + h) * D * eb, kind, D, dst);
          factor[h * SPLIT + t - t0] = kind == KIND_FP8 ? scale[slot * H + h] * 256.0f : 1.0f;
        }
      }
    }
  }
}

/* The 8 lane sums of a0..a7, in order. */
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* Scores of G query rows over n tile tokens, 8 tokens at a time (one lane reduction per 8), then the
   rest one at a time. NV = D / 8 is a compile-time constant in the specialised copies below. */
static inline __attribute__((always_inline)) void scores_tile(const float *qh, const float *tile,
                                                             const float *factor, float *sh, int64_t G,
                                                             int64_t Lmax, int64_t t0, int64_t n, float sm_scale,
                                                             const int NV) {
  const __m256 sm = _mm256_set1_ps(sm_scale);
  int64_t g = 0;
#ifdef KVCHAT_AVX512
  /* queries g and g + 1 in the low and high halves of 16-lane registers, each half doing the 8-lane loop below
     in the same order (same bits), every K vector loaded once for both */
  for (; g + 2 <= G; g += 2) {
    const float *qg = qh + g * NV * 8;
    __m512 qv[MAX_VEC];
    for (int j = 0; j < NV; ++j)
      qv[j] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qg + 8 * j)), _mm256_loadu_ps(qg + NV * 8 + 8 * j), 1);
    float *out = sh + g * Lmax + t0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const float *kt = tile + i * NV * 8;
      __m512 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm512_mul_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(kt + u * NV * 8)), qv[0]);
      for (int j = 1; j < NV; ++j)
        for (int u = 0; u < 8; ++u)
          a[u] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(kt + u * NV * 8 + 8 * j)), qv[j], a[u]);
      const __m256 f = _mm256_mul_ps(_mm256_loadu_ps(factor + i), sm);
#define LO(u) _mm512_castps512_ps256(a[u])
#define HI(u) _mm512_extractf32x8_ps(a[u], 1)
      _mm256_storeu_ps(out + i, _mm256_mul_ps(hsum8x8(LO(0), LO(1), LO(2), LO(3), LO(4), LO(5), LO(6), LO(7)), f));
      _mm256_storeu_ps(out + Lmax + i, _mm256_mul_ps(hsum8x8(HI(0), HI(1), HI(2), HI(3), HI(4), HI(5), HI(6), HI(7)), f));
#undef LO
#undef HI
    }
    for (; i < n; ++i) {
      const float *kt = tile + i * NV * 8;
      __m512 a = _mm512_mul_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(kt)), qv[0]);
      for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(kt + 8 * j)), qv[j], a);
      out[i] = hsum8(_mm512_castps512_ps256(a)) * (factor[i] * sm_scale);
      out[Lmax + i] = hsum8(_mm512_extractf32x8_ps(a, 1)) * (factor[i] * sm_scale);
    }
  }
#endif
  for (; g < G; ++g) {
    const float *qg = qh + g * NV * 8;
    float *out = sh + g * Lmax + t0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const float *kt = tile + i * NV * 8;
      __m256 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm256_mul_ps(_mm256_loadu_ps(kt + u * NV * 8), _mm256_loadu_ps(qg));
      for (int j = 1; j < NV; ++j) {
        const __m256 qj = _mm256_loadu_ps(qg + 8 * j);
        for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(kt + u * NV * 8 + 8 * j), qj, a[u]);
      }
      const __m256 f = _mm256_mul_ps(_mm256_loadu_ps(factor + i), sm);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(hsum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]), f));
    }
    for (; i < n; ++i) {
      const float *kt = tile + i * NV * 8;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(kt), _mm256_loadu_ps(qg));
      for (int j = 1; j < NV; ++j) a = _mm256_fmadd_ps(_mm256_loadu_ps(kt + 8 * j), _mm256_loadu_ps(qg + 8 * j), a);
      out[i] = hsum8(a) * (factor[i] * sm_scale);
    }
  }
}

/* The unnormalised partial output of G query rows over n tile tokens into out [G, D]. */
static inline __attribute__((always_inline)) void values_tile(const float *ph, const float *tile,
                                                             const float *factor, float *out, int64_t G,
                                                             int64_t Lmax, int64_t t0, int64_t n, const int NV) {
  int64_t g = 0;
#ifdef KVCHAT_AVX512
  /* two queries at a time, 16 output values per register: each lane sums its own value over the tokens in order,
     as the 8-lane loop below does (same bits); each V vector is loaded once for both queries, and the two
     queries' accumulators make enough independent FMA chains to hide the FMA's latency */
  for (; NV % 2 == 0 && g + 2 <= G; g += 2) { /* 16-lane vectors: an even NV (the wrapper's D % 16 == 0) */
    const float *p0 = ph + g * Lmax + t0, *p1 = p0 + Lmax;
    __m512 a0[MAX_VEC / 2], a1[MAX_VEC / 2];
    for (int j = 0; j < NV / 2; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const float *vt = tile + i * NV * 8;
      const __m512 w0 = _mm512_set1_ps(p0[i] * factor[i]), w1 = _mm512_set1_ps(p1[i] * factor[i]);
      for (int j = 0; j < NV / 2; ++j) {
        const __m512 v = _mm512_loadu_ps(vt + 16 * j);
        a0[j] = _mm512_fmadd_ps(w0, v, a0[j]);
        a1[j] = _mm512_fmadd_ps(w1, v, a1[j]);
      }
    }
    for (int j = 0; j < NV / 2; ++j) {
      _mm512_storeu_ps(out + g * NV * 8 + 16 * j, a0[j]);
      _mm512_storeu_ps(out + (g + 1) * NV * 8 + 16 * j, a1[j]);
    }
  }
#endif
  for (; g < G; ++g) {
    const float *pg = ph + g * Lmax + t0;
    __m256 acc[MAX_VEC];
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const float *vt = tile + i * NV * 8;
      const __m256 w = _mm256_set1_ps(pg[i] * factor[i]);
      for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * j), acc[j]);
    }
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + g * NV * 8 + 8 * j, acc[j]);
  }
}

#define BY_NV(call_with_nv)           \
  switch (nv) {                       \
    case 8: call_with_nv(8); break;   \
    case 16: call_with_nv(16); break; \
    default: call_with_nv(nv);        \
  }

/* One task of either pass: row r, tokens [t0, t1) of that row (t1 clipped to L_r, so t1 <= t0 for a range
   past the row's end), with the row's block table and sink and the calling thread's tile. */
typedef struct {
  int64_t r, t0, t1;
  const int32_t *table;
  const float *sink;
  float *tile, *factor;
} Task;

static inline Task task_at(int64_t task, int64_t ranges, int64_t H, int64_t D, const int32_t *lens,
                           const int32_t *table, int64_t table_stride, const float *sink, int64_t sink_stride,
                           float *tile) {
  Task k;
  k.r = task / ranges;
  k.t0 = (task % ranges) * SPLIT;
  k.t1 = k.t0 + SPLIT < lens[k.r] ? k.t0 + SPLIT : lens[k.r];
  k.table = table + k.r * table_stride;
  k.sink = sink == NULL ? NULL : sink + k.r * sink_stride;
  k.tile = tile + (int64_t)omp_get_thread_num() * H * SPLIT * (D + 1);
  k.factor = k.tile + H * SPLIT * D;
  return k;
}

#define SCORES(NV) scores_tile(q + (k.r * H + h) * G * D, k.tile + h * SPLIT * D, k.factor + h * SPLIT, sh, G, Lmax, k.t0, k.t1 - k.t0, \
                               sm_scale, NV)
#define VALUES(NV) values_tile(p + (k.r * H + h) * G * Lmax, k.tile + h * SPLIT * D, k.factor + h * SPLIT, work + (task * H + h) * G * D, \
                               G, Lmax, k.t0, k.t1 - k.t0, NV)
/* SCORES and VALUES are used by the two passes below. */

void kvchat_paged_scores(const float *q, const uint8_t *k_cache, const float *k_scale, const int32_t *table,
                         int64_t table_stride, const int32_t *lens, const float *sink, int64_t sink_stride,
                         float *s, float *tile, int64_t R, int64_t H, int64_t G, int64_t T, int64_t D,
                         int64_t BS, int64_t Lmax, float sm_scale, int kind, int threads) {
  const int64_t ranges = (Lmax + SPLIT - 1) / SPLIT, per_token = G / T;
  const int nv = (int)(D / 8);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < R * ranges; ++task) {
    const Task k = task_at(task, ranges, H, D, lens, table, table_stride, sink, sink_stride, tile);
    if (k.t0 < k.t1) load_tile(k_cache, k_scale, k.table, k.sink, BS, H, D, kind, k.t0, k.t1, lens[k.r], k.tile, k.factor);
    for (int64_t h = 0; h < H; ++h) {
      float *sh = s + (k.r * H + h) * G * Lmax;
      if (k.t0 < k.t1) BY_NV(SCORES)
      for (int64_t g = 0; g < G; ++g) { /* past the query's own length: nothing to attend to */
        const int64_t seen = lens[k.r] - T + 1 + g / per_token, from = k.t0 > seen ? k.t0 : seen;
        for (int64_t t = from; t < k.t0 + SPLIT && t < Lmax; ++t) sh[g * Lmax + t] = -INFINITY;
      }
    }
  }
}

void kvchat_paged_values(const float *p, const uint8_t *v_cache, const float *v_scale, const int32_t *table,
                         int64_t table_stride, const int32_t *lens, const float *sink, int64_t sink_stride,
                         float *o, float *work, float *tile, int64_t R, int64_t H, int64_t G, int64_t D,
                         int64_t BS, int64_t Lmax, int kind, int threads) {
  const int64_t ranges = (Lmax + SPLIT - 1) / SPLIT;
  const int nv = (int)(D / 8);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < R * ranges; ++task) {
    const Task k = task_at(task, ranges, H, D, lens, table, table_stride, sink, sink_stride, tile);
    if (k.t0 >= k.t1) continue;
    load_tile(v_cache, v_scale, k.table, k.sink, BS, H, D, kind, k.t0, k.t1, lens[k.r], k.tile, k.factor);
    for (int64_t h = 0; h < H; ++h) BY_NV(VALUES)
  }
  for (int64_t r = 0; r < R; ++r) { /* each range's partial output, added in order */
    const int64_t used = (lens[r] + SPLIT - 1) / SPLIT;
    for (int64_t hg = 0; hg < H * G; ++hg) {
      float *out = o + (r * H * G + hg) * D;
      const float *part = work + (r * ranges * H * G + hg) * D;
      for (int64_t d = 0; d < D; d += 8) {
        __m256 sum = used > 0 ? _mm256_loadu_ps(part + d) : _mm256_setzero_ps();
        for (int64_t i = 1; i < used; ++i) sum = _mm256_add_ps(sum, _mm256_loadu_ps(part + i * H * G * D + d));
        _mm256_storeu_ps(out + d, sum);
      }
    }
  }
}

/* float32 -> float8_e4m3fn bits, round to nearest even; |x| <= 448 (the caller clamps). */
static inline uint8_t to_e4m3(float x) {
  union { float f; uint32_t u; } v = {x};
  const uint8_t sign = (uint8_t)((v.u >> 24) & 0x80);
  v.u &= 0x7FFFFFFFu;
  if (v.f != v.f) return sign | 0x7F; /* NaN, as torch's cast: e4m3fn's one NaN pattern, the sign kept */
  if (v.f < 0.015625f) /* below 2**-6: subnormal, steps of 2**-9 (a carry to 8 is the smallest normal, 0x08) */
    return sign | (uint8_t)_mm_cvtss_si32(_mm_set_ss(v.f * 512.0f)); /* MXCSR's default: to nearest even */
  const uint32_t rounded = v.u + 0x7FFFFu + ((v.u >> 20) & 1u); /* 23 -> 3 mantissa bits, ties to even */
  return sign | (uint8_t)((rounded >> 20) - ((127 - 7) << 3));  /* exponent bias 127 -> 7 */
}

/* float32 -> bfloat16 bits, round to nearest even; NaN as torch's cast writes it (all ones). */
static inline uint16_t to_bf16(float x) {
  union { float f; uint32_t u; } v = {x};
  if (x != x) return 0xFFFF;
  return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

void kvchat_paged_write(const float *k, const float *v, uint8_t *k_cache, uint8_t *v_cache, float *k_scale,
                        float *v_scale, const int64_t *slots, int64_t T, int64_t H, int64_t D, int kind) {
  const int64_t eb = elem_bytes(kind);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int which = 0; which < 2; ++which) {
      const float *src = (which ? v : k) + t * H * D;
      uint8_t *cache = which ? v_cache : k_cache;
      float *scale = which ? v_scale : k_scale;
      for (int64_t h = 0; h < H; ++h) {
        const float *x = src + h * D;
        uint8_t *dst = cache + (slot * H + h) * D * eb;
        if (kind == KIND_FP8) {
          float amax = 0.0f;
          for (int64_t d = 0; d < D; ++d) { /* a NaN propagates (torch's amax), so the head is written as NaN */
            const float a = fabsf(x[d]);
            amax = (a > amax || a != a) && amax == amax ? a : amax;
          }
          const float sc = (amax > FP8_EPS || amax != amax ? amax : FP8_EPS) / FP8_MAX;
          scale[slot * H + h] = sc;
          for (int64_t d = 0; d < D; ++d) {
            float y = x[d] / sc;
            y = y > FP8_MAX ? FP8_MAX : (y < -FP8_MAX ? -FP8_MAX : y);
            dst[d] = to_e4m3(y);
          }
        } else if (kind == KIND_BF16) {
          for (int64_t d = 0; d < D; ++d) ((uint16_t *)dst)[d] = to_bf16(x[d]);
        } else {
          for (int64_t d = 0; d < D; ++d) ((uint16_t *)dst)[d] = _cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT);
        }
      }
    }
  }
}
