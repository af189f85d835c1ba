/* int4 weights times int8-quantized activations on integer dot products, for the CPU (AVX2, or AVX-512 with VNNI):
   GGUF's Q4_1 weight blocks against Q8_1 activation blocks, as llama.cpp's ggml_vec_dot_q4_1_q8_1
   (ggml-quants.c) multiplies them.

   Weights: asymmetric groups of 32 inputs, two 4-bit values per byte, an fp16 scale and an fp16 minimum per group
   (GGUF's Q4_1 block), w[n, 32 g + k] = scale[n, g] * q[n, 32 g + k] + minimum[n, g], q in 0 .. 15.
   Activations: each row quantized per group of 32 (cpu_kernels.h's quantize32, llama.cpp's Q8_1 block):
   d[m, g] = max|x| / 127, a[m, 32 g + k] = round(x / d) in [-127, 127], and the block's sum
   xs[m, g] = d[m, g] * sum_k a[m, 32 g + k] (Q8_1's s, kept in fp32). Then

     y[m, n] = sum_g ( scale[n, g] * d[m, g] * I[m, n, g] + minimum[n, g] * xs[m, g] ),
     I[m, n, g] = sum_{k < 32} q[n, 32 g + k] * a[m, 32 g + k]   (exact, in int32)

   i.e. the exact product of the dequantized weights and the dequantized activations, rounded in fp32. The
   minimum's term takes the quantized sum, as llama.cpp does, rather than the float one: the activations'
   rounding error e then meets the weight itself (e . w) instead of the weight less its minimum (or less its
   group's midpoint, were the nibbles centred), which in a group skewed by one outlier is several times larger
   than w. Measured on SmolLM2 (docs/performance.md, "4-bit weights"): centred nibbles with float sums lost up to
   +1.5% perplexity where these block sums keep within +0.6%.

   x        float32 [M, K] row-major, K = 32 G
   packed   uint8   [N, K / 2]: group g of channel n is the 16 bytes at packed[n, 16 g ..]; byte j holds input
                    32 g + j in its low nibble and input 32 g + 16 + j in its high nibble (one 16-byte load, a
                    per-half shift and an AND give the group's 32 values in input order)
   scale    fp16    [N, G] (IEEE half, as uint16)
   minimum  fp16    [N, G]
   xq       int8    [M, K] scratch: the quantized activations, written here first
   xd, xs   float32 [M, G] scratch: their scales d and sums xs
   y        float32 [M, N] row-major (written, not accumulated)

   Order of the float arithmetic (every build): per row and channel two 8-lane accumulators, even groups on one
   and odd groups on the other (two FMA chains: one chain's latency bounded a decode row), per group
   acc = fma(float(P), scale * d, acc) where lane i of P is the exact int32 sum of the products of inputs
   4 i .. 4 i + 3 of the group (vpdpbusd forms exactly that, and so do vpmaddubsw, whose pair sums of at most
   2 x 15 x 127 never saturate, then vpmaddwd by ones); then y = hsum8(even + odd) + groups_dot(minimum, xs)
   (cpu_kernels.h). scale * d is one fp32 product. So a row's bits depend on neither M (a decode row alone or
   among others) nor the thread count (threads split output channels, each channel's sum is one thread's), and
   the avx2, avx512 and avx512vnni builds compute the same bits: the integers are exact whichever instructions
   form them and the float steps are the same 8-lane operations in the same order. Rows run in eights (fours on
   AVX2), then the rest together, only to unpack each weight byte once for several rows.

   Threads: an OpenMP team of `threads` splits the N output channels (blocks of 8); torch's pool (cpu_build.py).
   The activations are quantized by the calling thread for a few rows, by the team for many. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#define MAX_GROUPS 1024 /* a channel's widened scales and minima live on the stack: K up to 32768 inputs */
#ifdef KVCHAT_AVX512
#define ROWS_MAX 8 /* rows per pass over a channel's weights: two chains each, in the 32 registers */
#else
#define ROWS_MAX 4 /* in AVX2's 16 */
#endif
#define TEAM_QUANTIZE_GROUPS 2048 /* fewer activation groups than this are quantized by the calling thread */

/* The G fp16 values at h as floats at f (exact). */
static inline void widen_halves(const uint16_t *h, float *f, int64_t G) {
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) _mm256_storeu_ps(f + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
  for (; g < G; ++g) f[g] = _cvtsh_ss(h[g]);
}

/* f[g] = a[g] * b[g] for g < G (one fp32 product each, vector or not). */
static inline void products(const float *a, const float *b, float *f, int64_t G) {
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) _mm256_storeu_ps(f + g, _mm256_mul_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g)));
  for (; g < G; ++g) f[g] = a[g] * b[g];
}

/* A group's 32 nibbles at p (16 bytes) as 32 bytes 0 .. 15 in input order: the low nibbles below, the high above. */
static inline __m256i nibbles(const uint8_t *p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
  return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

/* Lane i: the exact int32 sum_{k < 4} w[4 i + k] * a[4 i + k] (w unsigned 0 .. 15, a signed). */
static inline __m256i dot4(__m256i w, const int8_t *a) {
  const __m256i v = _mm256_loadu_si256((const __m256i *)a);
#ifdef KVCHAT_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, v);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, v), _mm256_set1_epi16(1));
#endif
}

/* Output channel n for rows m .. m + ROWS - 1 (ROWS a compile-time constant at each call). */
static inline __attribute__((always_inline)) void channel(const int8_t *xq, const float *xd, const float *xs,
                                                         const uint8_t *packed, const uint16_t *scale,
                                                         const uint16_t *minimum, float *y, int64_t N, int64_t G,
                                                         int64_t n, int64_t m, const int ROWS) {
  const int64_t K = G * GROUP;
  const uint8_t *w = packed + n * (K / 2);
  float sc[MAX_GROUPS], mn[MAX_GROUPS], sd[ROWS_MAX][MAX_GROUPS];
  widen_halves(scale + n * G, sc, G);
  widen_halves(minimum + n * G, mn, G);
  for (int i = 0; i < ROWS; ++i) products(sc, xd + (m + i) * G, sd[i], G);
  __m256 even[ROWS_MAX], odd[ROWS_MAX];
  for (int i = 0; i < ROWS; ++i) even[i] = odd[i] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    if (g % 4 == 0 && n + 1 < N) /* the next channel's line of these 4 groups: its short stream starts warm */
      _mm_prefetch((const char *)(w + K / 2 + g * (GROUP / 2)), _MM_HINT_T0);
    const __m256i w0 = nibbles(w + g * (GROUP / 2)), w1 = nibbles(w + (g + 1) * (GROUP / 2));
    for (int i = 0; i < ROWS; ++i) {
      const int8_t *a = xq + ((m + i) * G + g) * GROUP;
      even[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(w0, a)), _mm256_broadcast_ss(&sd[i][g]), even[i]);
      odd[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(w1, a + GROUP)), _mm256_broadcast_ss(&sd[i][g + 1]), odd[i]);
    }
  }
  if (g < G) { /* an odd count: the last group on the even chain */
    const __m256i w0 = nibbles(w + g * (GROUP / 2));
    for (int i = 0; i < ROWS; ++i)
      even[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(w0, xq + ((m + i) * G + g) * GROUP)),
                                _mm256_broadcast_ss(&sd[i][g]), even[i]);
  }
  for (int i = 0; i < ROWS; ++i)
    y[(m + i) * N + n] = hsum8(_mm256_add_ps(even[i], odd[i])) + groups_dot(mn, xs + (m + i) * G, G);
}

/* Row group mg of x into xq, xd and xs (the comment at the top). */
static inline void quantize_row_group(const float *x, int8_t *xq, float *xd, float *xs, int64_t mg) {
  const __m256i b = quantize32(x + mg * GROUP, xd + mg);
  _mm256_storeu_si256((__m256i *)(xq + mg * GROUP), b);
  xs[mg] = block_sum(b, xd[mg]);
}

int64_t kvchat_int4_max_groups(void) { return MAX_GROUPS; }

void kvchat_int4_matmul(const float *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum,
                        int8_t *xq, float *xd, float *xs, float *y, int64_t M, int64_t N, int64_t G, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * G >= TEAM_QUANTIZE_GROUPS)
  for (int64_t mg = 0; mg < M * G; ++mg) quantize_row_group(x, xq, xd, xs, mg);
  const int64_t blocks = (N + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n1 = (blk + 1) * 8 < N ? (blk + 1) * 8 : N;
    for (int64_t m = 0; m < M;) { /* rows in ROWS_MAX, then the rest together (two FMA chains per row) */
      const int rows = M - m >= ROWS_MAX ? ROWS_MAX : (int)(M - m);
      for (int64_t n = blk * 8; n < n1; ++n) {
#define ROWS_CASE(R) case R: channel(xq, xd, xs, packed, scale, minimum, y, N, G, n, m, R); break;
        switch (rows) {
#if ROWS_MAX > 4
          ROWS_CASE(8) ROWS_CASE(7) ROWS_CASE(6) ROWS_CASE(5)
#endif
          ROWS_CASE(4) ROWS_CASE(3) ROWS_CASE(2) ROWS_CASE(1)
        }
#undef ROWS_CASE
      }
      m += rows;
    }
  }
}

/* ---- Chunk rows: the channel-lanes kernel ----

   For the rows of a prefill chunk (kvchat_int4_matmul_lanes), the same product in another float order, with
   output channels in the lanes instead of inputs: per block of 16 channels, each group's nibbles are first
   transposed into 8 steps, step s (inputs 32 g + 4 s .. + 3) one 16-lane register whose lane j holds channel
   n0 + j's 4 values as bytes, so per row a group is 8 dot-product instructions against the row's 4 activations
   broadcast, leaving I[m, n0 .. n0 + 15, g] in the lanes with no horizontal sum, and the float work is per group
   and 16 channels, not per group and channel. Per row, lane and group, in group order (every build):

     acc = fma(float(I), scale * d, acc);  acc = fma(minimum, xs, acc)        (acc from 0; y = acc)

   with scale * d one fp32 product: a row's bits depend on neither M nor the thread count, and the avx2, avx512
   and avx512vnni builds compute the same bits (exact integers, the same lane-wise float steps). They differ from
   kvchat_int4_matmul's order, so which kernel ran is part of the cache fingerprint (kvchat.model.int4_scheme).

   The transpose: four 128-bit loads of channels c, c + 4, c + 8, c + 12 (one group's 16 bytes each) make a
   register A_c (A 256-bit one holds c and c + 4); 32-bit and 64-bit unpacks of A_0 .. A_3 give T_t, whose
   dword p of 128-bit lane l is dword t of channel p + 4 l, i.e. lane p + 4 l = channel p + 4 l (no
   permutation); step t is T_t's low nibbles, step 4 + t its high ones (the packed order: cpu_int4.py's pack). */

#define LANE_CHANNELS 16
#define LANE_STEPS (GROUP / 4)
#define LANE_WORK_PER_GROUP (LANE_STEPS * LANE_CHANNELS * 4 + LANE_CHANNELS * 8) /* 640 bytes: 64-byte aligned */
#ifdef KVCHAT_AVX512
#define LANE_ROWS 4 /* rows per pass over a block's steps: 8 steps + 2 per row of the 32 registers */
#else
#define LANE_ROWS 2 /* in AVX2's 16: 8 steps of one half + 2 per row */
#endif

static inline __m128i load16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }

/* Block n0's steps for every group into st (G x 8 x 16 int32) and its scales and minima as floats into sc, mn
   (G x 16); a block past the last of the N channels (N not a multiple of 16) reads the last channel in its place
   and its scales and minima are 0, so its lanes hold finite values the caller does not store. With prefetch_next,
   the next block's lines are prefetched to L2 as this one is read (the block after is that thread's next under
   a static schedule). */
static void transpose_block(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum, int64_t n0,
                            int64_t N, int64_t G, int32_t *st, float *sc, float *mn, int prefetch_next) {
  const int64_t stride = G * (GROUP / 2); /* bytes per channel */
  const uint8_t *ch[LANE_CHANNELS];          /* each lane's channel (the last one past N) */
  for (int j = 0; j < LANE_CHANNELS; ++j) ch[j] = packed + (n0 + j < N ? n0 + j : N - 1) * stride;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t at = g * (GROUP / 2);
    int32_t *out = st + g * LANE_STEPS * LANE_CHANNELS;
    if (g % 4 == 0 && prefetch_next) /* the next block's line of these 4 groups, to L2 while this block's rows run */
      for (int j = 0; j < LANE_CHANNELS; ++j) _mm_prefetch((const char *)(ch[j] + LANE_CHANNELS * stride + at), _MM_HINT_T1);
#ifdef KVCHAT_AVX512
    __m512i A[4];
    for (int c = 0; c < 4; ++c) {
      __m512i a = _mm512_castsi128_si512(load16(ch[c] + at));
      a = _mm512_inserti32x4(a, load16(ch[c + 4] + at), 1);
      a = _mm512_inserti32x4(a, load16(ch[c + 8] + at), 2);
      A[c] = _mm512_inserti32x4(a, load16(ch[c + 12] + at), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(A[0], A[1]), t1 = _mm512_unpackhi_epi32(A[0], A[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(A[2], A[3]), t3 = _mm512_unpackhi_epi32(A[2], A[3]);
    const __m512i T[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                          _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      _mm512_storeu_si512(out + t * LANE_CHANNELS, _mm512_and_si512(T[t], low));
      _mm512_storeu_si512(out + (t + 4) * LANE_CHANNELS, _mm512_and_si512(_mm512_srli_epi32(T[t], 4), low));
    }
#else
    for (int h = 0; h < 2; ++h) { /* channels 8 h .. 8 h + 7 into lanes 8 h .. */
      const uint8_t *const *chh = ch + 8 * h;
      __m256i A[4];
      for (int c = 0; c < 4; ++c)
        A[c] = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(chh[c] + at)), load16(chh[c + 4] + at), 1);
      const __m256i t0 = _mm256_unpacklo_epi32(A[0], A[1]), t1 = _mm256_unpackhi_epi32(A[0], A[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(A[2], A[3]), t3 = _mm256_unpackhi_epi32(A[2], A[3]);
      const __m256i T[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                            _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
      const __m256i low = _mm256_set1_epi8(0x0F);
      for (int t = 0; t < 4; ++t) {
        _mm256_storeu_si256((__m256i *)(out + t * LANE_CHANNELS + 8 * h), _mm256_and_si256(T[t], low));
        _mm256_storeu_si256((__m256i *)(out + (t + 4) * LANE_CHANNELS + 8 * h),
                            _mm256_and_si256(_mm256_srli_epi32(T[t], 4), low));
      }
    }
#endif
    for (int j = 0; j < LANE_CHANNELS; ++j) {
      sc[g * LANE_CHANNELS + j] = n0 + j < N ? _cvtsh_ss(scale[(n0 + j) * G + g]) : 0.0f;
      mn[g * LANE_CHANNELS + j] = n0 + j < N ? _cvtsh_ss(minimum[(n0 + j) * G + g]) : 0.0f;
    }
  }
}

/* The 4 activations at a as one int32 (to broadcast). */
static inline int32_t four(const int8_t *a) {
  int32_t v;
  memcpy(&v, a, 4);
  return v;
}

#ifdef KVCHAT_AVX512
/* lane-wise: the exact sum of the 4 products of w's unsigned bytes (0 .. 15) and a's signed ones, added to acc */
static inline __m512i dot4_16(__m512i acc, __m512i w, __m512i a) {
#ifdef KVCHAT_VNNI
  return _mm512_dpbusd_epi32(acc, w, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
#endif
}

/* Rows m .. m + ROWS - 1 of block n0 (16 channels) from its steps. */
static inline __attribute__((always_inline)) void lane_rows(const int8_t *xq, const float *xd, const float *xs,
                                                           const int32_t *st, const float *sc, const float *mn,
                                                           float *y, int64_t N, int64_t G, int64_t n0, int64_t m,
                                                           const int ROWS) {
  __m512 acc[LANE_ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int32_t *sg = st + g * LANE_STEPS * LANE_CHANNELS;
    __m512i I[LANE_ROWS];
    for (int r = 0; r < ROWS; ++r) I[r] = _mm512_setzero_si512();
    for (int s = 0; s < LANE_STEPS; ++s) {
      const __m512i w = _mm512_loadu_si512(sg + s * LANE_CHANNELS);
      for (int r = 0; r < ROWS; ++r)
        I[r] = dot4_16(I[r], w, _mm512_set1_epi32(four(xq + ((m + r) * G + g) * GROUP + 4 * s)));
    }
    const __m512 scv = _mm512_loadu_ps(sc + g * LANE_CHANNELS), mnv = _mm512_loadu_ps(mn + g * LANE_CHANNELS);
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[r]), _mm512_mul_ps(scv, _mm512_set1_ps(xd[(m + r) * G + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mnv, _mm512_set1_ps(xs[(m + r) * G + g]), acc[r]);
    }
  }
  /* a block past N stores its first N - n0 lanes */
  const __mmask16 keep = n0 + LANE_CHANNELS <= N ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
  for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(y + (m + r) * N + n0, keep, acc[r]);
}
#else
static inline __m256i dot4_8(__m256i acc, __m256i w, __m256i a) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}

/* Rows m .. m + ROWS - 1 of block n0's half h (channels n0 + 8 h ..) from its steps. */
static inline __attribute__((always_inline)) void lane_rows_half(const int8_t *xq, const float *xd, const float *xs,
                                                                const int32_t *st, const float *sc, const float *mn,
                                                                float *y, int64_t N, int64_t G, int64_t n0, int h,
                                                                int64_t m, const int ROWS) {
  __m256 acc[LANE_ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int32_t *sg = st + g * LANE_STEPS * LANE_CHANNELS + 8 * h;
    __m256i I[LANE_ROWS];
    for (int r = 0; r < ROWS; ++r) I[r] = _mm256_setzero_si256();
    for (int s = 0; s < LANE_STEPS; ++s) {
      const __m256i w = _mm256_loadu_si256((const __m256i *)(sg + s * LANE_CHANNELS));
      for (int r = 0; r < ROWS; ++r)
        I[r] = dot4_8(I[r], w, _mm256_set1_epi32(four(xq + ((m + r) * G + g) * GROUP + 4 * s)));
    }
    const __m256 scv = _mm256_loadu_ps(sc + g * LANE_CHANNELS + 8 * h), mnv = _mm256_loadu_ps(mn + g * LANE_CHANNELS + 8 * h);
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(scv, _mm256_set1_ps(xd[(m + r) * G + g])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mnv, _mm256_set1_ps(xs[(m + r) * G + g]), acc[r]);
    }
  }
  const int64_t n = n0 + 8 * h; /* a half past N stores its first N - n lanes (the caller skips one wholly past) */
  for (int r = 0; r < ROWS; ++r) {
    if (n + 8 <= N) {
      _mm256_storeu_ps(y + (m + r) * N + n, acc[r]);
    } else {
      float t[8];
      _mm256_storeu_ps(t, acc[r]);
      memcpy(y + (m + r) * N + n, t, (size_t)(N - n) * sizeof(float));
    }
  }
}
#endif

int64_t kvchat_int4_lane_min_tokens(void) { return INT4_LANE_MIN_TOKENS; }

/* Bytes of kvchat_int4_matmul_lanes' work buffer for G groups and `threads` threads: each thread's block of steps
   (G x 512 bytes) and scales and minima (G x 128), on 64-byte boundaries, and 64 for aligning the base. */
int64_t kvchat_int4_lanes_work_bytes(int64_t G, int threads) { return (int64_t)threads * G * LANE_WORK_PER_GROUP + 64; }

/* kvchat_int4_matmul's arguments and result with the channel-lanes order (above), any N; work: the caller's
   buffer of kvchat_int4_lanes_work_bytes(G, threads) bytes (any alignment). */
void kvchat_int4_matmul_lanes(const float *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum,
                              int8_t *xq, float *xd, float *xs, float *y, char *work, int64_t M, int64_t N,
                              int64_t G, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * G >= TEAM_QUANTIZE_GROUPS)
  for (int64_t mg = 0; mg < M * G; ++mg) quantize_row_group(x, xq, xd, xs, mg);
  const int64_t blocks = (N + LANE_CHANNELS - 1) / LANE_CHANNELS;
  char *base = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
#pragma omp parallel num_threads(threads)
  {
    int32_t *st = (int32_t *)(base + (int64_t)omp_get_thread_num() * G * LANE_WORK_PER_GROUP);
    float *sc = (float *)(st + G * LANE_STEPS * LANE_CHANNELS), *mn = sc + G * LANE_CHANNELS;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t n0 = blk * LANE_CHANNELS;
      transpose_block(packed, scale, minimum, n0, N, G, st, sc, mn, n0 + 2 * LANE_CHANNELS <= N);
#ifdef KVCHAT_AVX512
      for (int64_t m = 0; m < M;) {
        const int rows = M - m >= LANE_ROWS ? LANE_ROWS : (int)(M - m);
        switch (rows) {
          case 4: lane_rows(xq, xd, xs, st, sc, mn, y, N, G, n0, m, 4); break;
          case 3: lane_rows(xq, xd, xs, st, sc, mn, y, N, G, n0, m, 3); break;
          case 2: lane_rows(xq, xd, xs, st, sc, mn, y, N, G, n0, m, 2); break;
          default: lane_rows(xq, xd, xs, st, sc, mn, y, N, G, n0, m, 1);
        }
        m += rows;
      }
#else
      for (int h = 0; h < 2 && n0 + 8 * h < N; ++h)
        for (int64_t m = 0; m < M;) {
          const int rows = M - m >= LANE_ROWS ? LANE_ROWS : (int)(M - m);
          if (rows == 2)
            lane_rows_half(xq, xd, xs, st, sc, mn, y, N, G, n0, h, m, 2);
          else
            lane_rows_half(xq, xd, xs, st, sc, mn, y, N, G, n0, h, m, 1);
          m += rows;
        }
#endif
    }
  }
}
