/* Decode attention and the K/V cache write for the CPU (AVX2, FMA, F16C; or AVX-512), straight on the paged pool.

   Pool layout (kvchat.kernels.reference): per layer K and V [num_blocks, BS, H, D] in float8_e4m3fn (KIND_FP8,
   then one float32 scale per token and KV head, [num_blocks, BS, H]), bfloat16 (KIND_BF16) or float16
   (KIND_FP16); token t of a sequence sits at slot block_table[t / BS] * BS + t % BS.

   kvchat_paged_write:  the new tokens' K/V into their slots, quantized as kvchat.kernels.reference.write_kv
                        does (same bits: per token and KV head absmax / 448, x / scale clamped to +-448, round
                        to nearest even, NaN and inf as torch's ops give them; 16-bit pools a
                        round-to-nearest-even cast). Slots must lie in the pool (the Python wrapper checks).
   kvchat_paged_attention: o[r, h, g] = softmax_t(sm_scale * q[r, h, g] . k[r, h, t]) v[r, h, t] over t < L_rg

   q      float32 [R, H, G, D] contiguous (R sequences, H KV heads, G queries per KV head). The G queries of a
          KV head are T consecutive tokens of G / T query heads each (GQA), token-major: query g is token
          g / (G / T) of the T newest and sees L_rg = L_r - T + 1 + g / (G / T) tokens (causal). A decode step
          has T = 1; a short chunk of one sequence (T > 1) reads each K/V range once for all its tokens.
   o      float32 [R, H, G, D] contiguous; zeros for a query that sees no token (L_rg <= 0)
   table  int32, row r at table + r * table_stride; lens int32 [R] (L_r, the T new tokens included)
   sink   float32 exact position-0 K (or V) of row r at sink + r * sink_stride, [H, D] contiguous; NULL: none
   tile   float32 scratch, kvchat_attention_tile_floats of it: per thread H * SPLIT * D values, H * SPLIT factors,
          H * G * SPLIT scores, then one head's K transposed (D * SPLIT)
   work   float32 scratch, kvchat_attention_work_floats of it: per range [H, G, D] partial outputs, then per range
          [H, G, 2] the scores' max and the sum of their exps

   D is a multiple of 16 and at most 8 * MAX_VEC (kvchat_attention_max_head_dim).

   Each row's tokens split into fixed SPLIT-token ranges, one task per range with all KV heads, shared by an
   OpenMP team of `threads` (so the two cores stay busy for 3 KV heads). A task converts its range's K to float32
   in a tile (fp8: the byte as float16 bits, i.e. value * 2**-8 / scale; the factor 2**8 * scale is applied after
   the dot product), transposes one head's K at a time to [D, SPLIT] and scores its queries against it with the
   tokens in the vector lanes (each lane a token's dot product summed over d in order; QB queries by BLOCK tokens a
   step, so each K vector loaded serves QB queries and no lanes need adding up), takes each query's max m over
   the range and p = exp(s - m) in place (zero past L_rg), converts the range's V into the same tile (its factor
   folded into p) and sums p * v into the range's partial output (QB queries by BLOCK output values a step, each
   lane its sum over the tokens in order), beside m and the sum l of the exps. Then each query's ranges merge in
   order: out = sum_i e_i o_i / sum_i e_i l_i with e_i = exp(m_i - max_i m_i). This is split-K attention with
   the online softmax's rescaling (FlashDecoding: Dao, Haziza, Massa, Sizov 2023; the rescaling from Milakov and
   Gimelshein 2018): the scores never leave the thread's cache (at a 15-token question over 4,096 tokens they
   were 2.2 MB a layer, written, normalised and read back by three passes). A query's bits depend on L_r, T and
   its index alone, never on the thread count or on the other rows. A NaN or inf in a V row the query does not
   see but its range holds reaches its output (0 * inf), as in a masked matmul. Every table row must hold
   ceil(L_r / BS) valid blocks (the wrapper checks the width).

   Built with KVCHAT_AVX512 (cpu_build.py's avx512 variant): the scores and values loops run on 16-lane vectors,
   every lane doing the 8-lane build's operations in its order, and fp8 converts 32 values a step (an exact
   conversion), so the bits equal the AVX2 build's; the softmax and the merge are the same 8-lane code in both. Figures:
   docs/performance.md, "the CPU attention in one pass". */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define SPLIT 128
#define MAX_VEC 32 /* the largest D / 8: the merge's accumulators */
#define KIND_FP8 0
#define KIND_BF16 1
#define KIND_FP16 2
#define FP8_MAX 448.0f
#define FP8_EPS 1e-6f

/* The largest D, for the caller's checks. */
int64_t kvchat_attention_max_head_dim(void) { return 8 * MAX_VEC; }

/* Floats of kvchat_paged_attention's tile scratch (H KV heads of G queries, head_dim D, on `threads` threads) and
   work scratch (R rows of at most Lmax tokens). */
int64_t kvchat_attention_tile_floats(int64_t H, int64_t G, int64_t D, int threads) {
  return (int64_t)threads * SPLIT * (H * (D + 1 + G) + D);
}

int64_t kvchat_attention_work_floats(int64_t R, int64_t H, int64_t G, int64_t D, int64_t Lmax) {
  return R * ((Lmax + SPLIT - 1) / SPLIT) * H * G * (D + 2);
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

/* The scores and values loops on W-lane vectors: 8 (AVX2) or 16 (the avx512 build). Every lane does the same
   operations in the same order in both, so the bits do not depend on the build. */
#ifdef KVCHAT_AVX512
#define W 16
typedef __m512 vec;
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vzero _mm512_setzero_ps
#else
#define W 8
typedef __m256 vec;
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vzero _mm256_setzero_ps
#endif
#define BLOCK 32 /* tokens per scores block, values per values block (a multiple of 16; SPLIT a multiple of it) */
#define QB 3     /* queries per block: 3 * BLOCK / 8 = 12 of AVX2's 16 registers accumulate */
/* queries per KV head from which the scores transpose K (below: scores_rows); measured, see the README */
#define TRANSPOSE_MIN_QUERIES 6

/* Rows [0, n) of one head's tile [SPLIT, D] transposed into kt [D, SPLIT], 8 x 8 at a time (n a multiple of 8). */
static void transpose_tile(const float *tile, float *kt, int64_t D, int64_t n) {
  for (int64_t t = 0; t < n; t += 8)
    for (int64_t d = 0; d < D; d += 8) {
      __m256 r[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(tile + (t + i) * D + d);
      for (int i = 0; i < 8; i += 2) {
        u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xEE);
      }
      /* r[0..3]: columns 0, 1, 2, 3 of rows 0-3 (low) and 4-7 of the same rows (high); r[4..7] of rows 4-7 */
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(kt + (d + i) * SPLIT + t, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(kt + (d + i + 4) * SPLIT + t, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
}

/* Scores of NQ queries qh [NQ, D] over BLOCK tokens of kt [D, SPLIT] into sh [NQ, SPLIT]: each token a lane, its
   sum over d in order (d = 0 first), times factor * sm_scale. */
static inline __attribute__((always_inline)) void scores_block(const float *qh, const float *kt, const float *factor,
                                                              float *sh, int64_t D, float sm_scale, const int NQ) {
  vec a[QB][BLOCK / W];
  for (int g = 0; g < NQ; ++g)
    for (int j = 0; j < BLOCK / W; ++j) a[g][j] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    vec k[BLOCK / W];
    for (int j = 0; j < BLOCK / W; ++j) k[j] = vload(kt + d * SPLIT + j * W);
    for (int g = 0; g < NQ; ++g) {
      const vec b = vset1(qh[g * D + d]);
      for (int j = 0; j < BLOCK / W; ++j) a[g][j] = vfma(b, k[j], a[g][j]);
    }
  }
  for (int j = 0; j < BLOCK / W; ++j) {
    const vec f = vmul(vload(factor + j * W), vset1(sm_scale));
    for (int g = 0; g < NQ; ++g) vstore(sh + g * SPLIT + j * W, vmul(a[g][j], f));
  }
}

/* The 8 lane sums of a0..a7, in order. */
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* Scores of few queries (G < TRANSPOSE_MIN_QUERIES: a decode step) straight on the tile's rows [SPLIT, D], with
   no transpose: each token's dot product in 8 lanes over d, the lanes added up 8 tokens at a time. The same
   8-lane code in both builds. */
static void scores_rows(const float *qh, const float *tile, const float *factor, float *sh, int64_t G, int64_t D,
                        int64_t n, float sm_scale) {
  const __m256 sm = _mm256_set1_ps(sm_scale);
  for (int64_t g = 0; g < G; ++g) {
    const float *qg = qh + g * D;
    float *out = sh + g * SPLIT;
    for (int64_t i = 0; i < n; i += 8) { /* up to a multiple of 8: the extra entries are never read */
      const float *kt = tile + i * D;
      __m256 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm256_mul_ps(_mm256_loadu_ps(kt + u * D), _mm256_loadu_ps(qg));
      for (int64_t j = 8; j < D; j += 8) {
        const __m256 qj = _mm256_loadu_ps(qg + j);
        for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(kt + u * D + j), qj, a[u]);
      }
      _mm256_storeu_ps(out + i, _mm256_mul_ps(hsum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                              _mm256_mul_ps(_mm256_loadu_ps(factor + i), sm)));
    }
  }
}

/* One head's scores: G queries qh [G, D] over the range's tokens [0, n) (up to a multiple of BLOCK: the extra
   entries are never read) of kt [D, SPLIT] into sh [G, SPLIT]. */
static void scores_head(const float *qh, const float *kt, const float *factor, float *sh, int64_t G, int64_t D,
                        int64_t n, float sm_scale) {
  for (int64_t t = 0; t < n; t += BLOCK) {
    int64_t g = 0;
    for (; g + QB <= G; g += QB) scores_block(qh + g * D, kt + t, factor + t, sh + g * SPLIT + t, D, sm_scale, QB);
    for (; g < G; ++g) scores_block(qh + g * D, kt + t, factor + t, sh + g * SPLIT + t, D, sm_scale, 1);
  }
}

/* Values [d0, d0 + NV * W) of NQ queries' outputs out [NQ, D]: sum over tokens t < n in order of ph [NQ, SPLIT]
   (p times the token's factor) * tile [SPLIT, D]. */
static inline __attribute__((always_inline)) void values_block(const float *ph, const float *tile, float *out,
                                                              int64_t D, int64_t n, const int NQ, const int NV) {
  vec a[QB][BLOCK / W];
  for (int g = 0; g < NQ; ++g)
    for (int j = 0; j < NV; ++j) a[g][j] = vzero();
  for (int64_t t = 0; t < n; ++t) {
    vec v[BLOCK / W];
    for (int j = 0; j < NV; ++j) v[j] = vload(tile + t * D + j * W);
    for (int g = 0; g < NQ; ++g) {
      const vec b = vset1(ph[g * SPLIT + t]);
      for (int j = 0; j < NV; ++j) a[g][j] = vfma(b, v[j], a[g][j]);
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int j = 0; j < NV; ++j) vstore(out + g * D + j * W, a[g][j]);
}

/* One head's partial outputs out [G, D] over the range's n tokens: weights ph [G, SPLIT], V rows tile [SPLIT, D]
   (D a multiple of 16: BLOCK values at a time, then 16). */
static void values_head(const float *ph, const float *tile, float *out, int64_t G, int64_t D, int64_t n) {
  for (int64_t d = 0; d < D; d += BLOCK) {
    const int full = d + BLOCK <= D;
    int64_t g = 0;
    for (; g + QB <= G; g += QB)
      full ? values_block(ph + g * SPLIT, tile + d, out + g * D + d, D, n, QB, BLOCK / W)
           : values_block(ph + g * SPLIT, tile + d, out + g * D + d, D, n, QB, 16 / W);
    for (; g < G; ++g)
      full ? values_block(ph + g * SPLIT, tile + d, out + g * D + d, D, n, 1, BLOCK / W)
           : values_block(ph + g * SPLIT, tile + d, out + g * D + d, D, n, 1, 16 / W);
  }
}

/* One task: row r, tokens [t0, t1) of that row (t1 clipped to L_r, so t1 <= t0 for a range past the row's end),
   with the row's block table and the calling thread's tile, factors and scores. */
typedef struct {
  int64_t r, t0, t1;
  const int32_t *table;
  float *tile, *factor, *p, *kt;
} Task;

static inline Task task_at(int64_t task, int64_t ranges, int64_t H, int64_t G, int64_t D, const int32_t *lens,
                           const int32_t *table, int64_t table_stride, float *tile) {
  Task k;
  k.r = task / ranges;
  k.t0 = (task % ranges) * SPLIT;
  k.t1 = k.t0 + SPLIT < lens[k.r] ? k.t0 + SPLIT : lens[k.r];
  k.table = table + k.r * table_stride;
  k.tile = tile + (int64_t)omp_get_thread_num() * SPLIT * (H * (D + 1 + G) + D);
  k.factor = k.tile + H * SPLIT * D;
  k.p = k.factor + H * SPLIT;
  k.kt = k.p + H * G * SPLIT;
  return k;
}

/* One query's n scores x of a range in place: p = exp(x - m) for the first `seen` (m their max), 0 after;
   stat = (m, sum of p), (-inf, 0) when seen <= 0. */
static void range_softmax(float *x, int64_t n, int64_t seen, float *stat) {
  if (seen > n) seen = n;
  if (seen <= 0) {
    for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
    stat[0] = -INFINITY;
    stat[1] = 0.0f;
    return;
  }
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < seen; i += 8) m = _mm256_max_ps(m, load_part(x, i, seen, -INFINITY));
  float mx = -INFINITY, t[8];
  _mm256_storeu_ps(t, m);
  for (int j = 0; j < 8; ++j) mx = t[j] > mx ? t[j] : mx;
  const __m256 vm = _mm256_set1_ps(mx);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(load_part(x, i, n, mx), vm));
    if (i + 8 > seen) /* lanes past `seen` (or padding past n): zero */
      e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(seen - i)), lane)));
    sum = _mm256_add_ps(sum, e);
    store_part(x, i, n, e);
  }
  stat[0] = mx;
  stat[1] = hsum8(sum);
}

/* x[i] *= factor[i] for i < n: a query's p times the V tile's factors. */
static void scale_by(float *x, const float *factor, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store_part(x, i, n, _mm256_mul_ps(load_part(x, i, n, 0.0f), load_part(factor, i, n, 0.0f)));
}

/* Query (r, hg)'s output from its `used` ranges' partials (stride HG * D floats) and stats (stride HG * 2), as the
   module comment says; zeros when no range saw a token. */
static void merge_ranges(const float *part, const float *stat, int64_t used, int64_t HG, int64_t D, float *out) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < used; ++i) mx = stat[i * HG * 2] > mx ? stat[i * HG * 2] : mx;
  __m256 acc[MAX_VEC];
  for (int64_t j = 0; j < D / 8; ++j) acc[j] = _mm256_setzero_ps();
  float total = 0.0f;
  if (mx != -INFINITY)
    for (int64_t i0 = 0; i0 < used; i0 += 8) { /* the ranges' weights e_i, 8 at a time */
      float m[8], e[8];
      for (int j = 0; j < 8; ++j) m[j] = i0 + j < used ? stat[(i0 + j) * HG * 2] - mx : -INFINITY;
      _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(m)));
      for (int j = 0; j < 8 && i0 + j < used; ++j) {
        if (stat[(i0 + j) * HG * 2] == -INFINITY) continue; /* a range the query does not see */
        const float *pi = part + (i0 + j) * HG * D;
        const __m256 w = _mm256_set1_ps(e[j]);
        for (int64_t d = 0; d < D / 8; ++d) acc[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(pi + 8 * d), acc[d]);
        total += e[j] * stat[(i0 + j) * HG * 2 + 1];
      }
    }
  const __m256 inv = _mm256_set1_ps(mx == -INFINITY ? 0.0f : 1.0f / total);
  for (int64_t d = 0; d < D / 8; ++d) _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], inv));
}

void kvchat_paged_attention(const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const float *k_scale,
                            const float *v_scale, const int32_t *table, int64_t table_stride, const int32_t *lens,
                            const float *sink_k, const float *sink_v, int64_t sink_stride, float *o, float *work,
                            float *tile, int64_t R, int64_t H, int64_t G, int64_t T, int64_t D, int64_t BS,
                            int64_t Lmax, float sm_scale, int kind, int threads) {
  const int64_t ranges = (Lmax + SPLIT - 1) / SPLIT, per_token = G / T, HG = H * G;
  float *part = work, *stats = work + R * ranges * HG * D;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < R * ranges; ++task) {
      const Task k = task_at(task, ranges, H, G, D, lens, table, table_stride, tile);
      if (k.t0 >= k.t1) continue;
      const int64_t n = k.t1 - k.t0, L = lens[k.r];
      load_tile(k_cache, k_scale, k.table, sink_k == NULL ? NULL : sink_k + k.r * sink_stride, BS, H, D, kind, k.t0,
                k.t1, L, k.tile, k.factor);
      const int64_t blocks = (n + BLOCK - 1) / BLOCK * BLOCK; /* the scores' tokens: whole blocks */
      for (int64_t h = 0; h < H; ++h) {
        float *ph = k.p + h * G * SPLIT;
        const float *qh = q + (k.r * H + h) * G * D;
        if (G >= TRANSPOSE_MIN_QUERIES) {
          transpose_tile(k.tile + h * SPLIT * D, k.kt, D, blocks);
          scores_head(qh, k.kt, k.factor + h * SPLIT, ph, G, D, n, sm_scale);
        } else {
          scores_rows(qh, k.tile + h * SPLIT * D, k.factor + h * SPLIT, ph, G, D, n, sm_scale);
        }
        for (int64_t g = 0; g < G; ++g)
          range_softmax(ph + g * SPLIT, n, L - T + 1 + g / per_token - k.t0, stats + (task * HG + h * G + g) * 2);
      }
      load_tile(v_cache, v_scale, k.table, sink_v == NULL ? NULL : sink_v + k.r * sink_stride, BS, H, D, kind, k.t0,
                k.t1, L, k.tile, k.factor);
      for (int64_t h = 0; h < H; ++h) {
        float *ph = k.p + h * G * SPLIT;
        for (int64_t g = 0; g < G; ++g) scale_by(ph + g * SPLIT, k.factor + h * SPLIT, n);
        values_head(ph, k.tile + h * SPLIT * D, part + (task * H + h) * G * D, G, D, n);
      }
    }
#pragma omp for schedule(static)
    for (int64_t rhg = 0; rhg < R * HG; ++rhg) {
      const int64_t r = rhg / HG, hg = rhg % HG;
      merge_ranges(part + (r * ranges * HG + hg) * D, stats + (r * ranges * HG + hg) * 2, (lens[r] + SPLIT - 1) / SPLIT,
                   HG, D, o + rhg * D);
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
