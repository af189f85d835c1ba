/* int8 weights times int8-quantized activations on integer dot products, for int8 weights' prefill chunks on the
   CPU (kvchat.model.quant.Int8GroupLinear; int4 weights have their own channel-lanes kernel, cpu_int4.c).

   The weights are cpu_int8.c's: int8 q[N, K] with a float32 scale and offset per 32 inputs of each output
   channel, w[n, 32 g + k] = scale[n, g] * q[n, 32 g + k] + offset[n, g]. Each activation row is quantized per
   group of 32 inputs, symmetric (cpu_kernels.h's quantize32, as llama.cpp's Q8_0 blocks): d[m, g] = max|x| / 127,
   a[m, 32 g + k] = round(x / d) in [-127, 127] (round half to even: _mm256_cvtps_epi32 under the default MXCSR).
   Then

     y[m, n] = sum_g ( scale[n, g] * d[m, g] * I[m, n, g] + offset[n, g] * xsum[m, g] ),
     I[m, n, g] = sum_{k < 32} a[m, 32 g + k] * q[n, 32 g + k]   (exact, in int32)

   with xsum the float sum of the group's 32 activations as they are (the same pairwise sum as cpu_int8.c).

   Layout: each thread repacks 16 output channels at a time into a small buffer (16 x K bytes, in L2): for every 4
   inputs, the 4 bytes of each of the 16 channels side by side, so one 16-lane int32 register holds 16 channels'
   partial dot products and a group's 8 steps leave I[m, n .. n + 15, g] in its lanes, with no horizontal sum;
   the group's scales, offsets and (VNNI) corrections are gathered beside. The float epilogue per group and lane
   is fixed: acc = fma(float(I), scale * d, acc), then acc = fma(offset, xsum, acc); acc starts at 0 and is
   stored as y. So a row's bits depend on neither M nor the thread count, and every build computes the same
   bits: the integer sums are exact whichever instructions form them, and the float steps are the same
   lane-wise operations in the same order.

   Builds (kernels/cpu_build.py):
   - avx2: per 8 channels, vpabsb of the weights (once per block, shared by the rows) and vpsignb of the
     activation by the weight's sign, then vpmaddubsw (u8 x s8 pairs into int16: at most 2 x 128 x 127 = 32512,
     never saturating since a is never -128) and vpmaddwd by ones into int32.
   - avx512 (KVCHAT_AVX512): the same for 16 channels, the sign applied by a masked byte subtraction.
   - avx512vnni (KVCHAT_VNNI too): vpdpbusd, unsigned x signed, with the activations stored as a + 128 (u8) and
     128 * sum_k q[n, 32 g + k] subtracted per group: the same integers.

   Threads: an OpenMP team of `threads` splits the blocks of 16 channels; the activations are quantized first
   (rows split over the team). N must be a multiple of 16, K = 32 G. */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define LANES 16 /* output channels per block */
#define STEPS (GROUP / 4) /* int32 lanes' steps of 4 inputs per group */

int64_t kvchat_int8_int8_work_bytes(int64_t G);
void kvchat_int8_int8_matmul(const float *x, const int8_t *q, const float *scale, const float *offset, int8_t *xq,
                             float *xd, float *xsum, float *y, char *work, int64_t M, int64_t N, int64_t G,
                             int threads);

/* Group mg (row m, group g) of x: its float sum, its scale d and its 32 int8 values (VNNI build: + 128, u8). */
static inline void quantize_group(const float *v, int8_t *out, float *d, float *sum) {
  __m256i b = quantize32(v, d);
  group_sums(v, sum, 1, 1);
#ifdef KVCHAT_VNNI
  b = _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80));
#endif
  _mm256_storeu_si256((__m256i *)out, b);
}

/* Channels n0 .. n0 + 15 into the block buffers: qp[(g * STEPS + s) * LANES + j] holds q[n0 + j, 32 g + 4 s ..
   + 3] as one int32; sp, op, corr [G, LANES]: scales, offsets, 128 x each group's sum of q. */
static void repack(const int8_t *q, const float *scale, const float *offset, int64_t n0, int64_t G, int32_t *qp,
                   float *sp, float *op, int32_t *corr) {
  const int64_t K = G * GROUP;
  for (int j = 0; j < LANES; ++j) {
    const int8_t *w = q + (n0 + j) * K;
    for (int64_t s = 0; s < K / 4; ++s) memcpy(qp + s * LANES + j, w + 4 * s, 4);
    for (int64_t g = 0; g < G; ++g) {
      int32_t t = 0;
      for (int k = 0; k < GROUP; ++k) t += w[g * GROUP + k];
      corr[g * LANES + j] = 128 * t;
      sp[g * LANES + j] = scale[(n0 + j) * G + g];
      op[g * LANES + j] = offset[(n0 + j) * G + g];
    }
  }
}

static inline int32_t four(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

#ifdef KVCHAT_AVX512
#define ROWS_MAX 8
/* ROWS rows from m against the repacked block (16 channels in one register). */
static inline __attribute__((always_inline)) void block_rows(const int8_t *xq, const float *xd, const float *xsum,
                                                            const int32_t *qp, const float *sp, const float *op,
                                                            const int32_t *corr, float *y, int64_t N, int64_t G,
                                                            int64_t n0, int64_t m, const int ROWS) {
  const int64_t K = G * GROUP;
  __m512 acc[ROWS_MAX];
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
#ifndef KVCHAT_VNNI
  const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
  (void)corr;
#endif
  for (int64_t g = 0; g < G; ++g) {
    __m512i s[ROWS_MAX];
    for (int i = 0; i < ROWS; ++i) s[i] = _mm512_setzero_si512();
    for (int t = 0; t < STEPS; ++t) {
      const __m512i w = _mm512_load_si512(qp + (g * STEPS + t) * LANES);
      const int8_t *a = xq + m * K + g * GROUP + 4 * t;
#ifdef KVCHAT_VNNI
      for (int i = 0; i < ROWS; ++i) s[i] = _mm512_dpbusd_epi32(s[i], _mm512_set1_epi32(four(a + i * K)), w);
#else
      const __m512i u = _mm512_abs_epi8(w);
      const __mmask64 neg = _mm512_movepi8_mask(w);
      for (int i = 0; i < ROWS; ++i) {
        const __m512i v = _mm512_set1_epi32(four(a + i * K));
        const __m512i sv = _mm512_mask_sub_epi8(v, neg, zero, v);
        s[i] = _mm512_add_epi32(s[i], _mm512_madd_epi16(_mm512_maddubs_epi16(u, sv), ones));
      }
#endif
    }
#ifdef KVCHAT_VNNI
    const __m512i c = _mm512_load_si512(corr + g * LANES);
    for (int i = 0; i < ROWS; ++i) s[i] = _mm512_sub_epi32(s[i], c);
#endif
    const __m512 sc = _mm512_load_ps(sp + g * LANES), of = _mm512_load_ps(op + g * LANES);
    for (int i = 0; i < ROWS; ++i) {
      const int64_t mg = (m + i) * G + g;
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(sc, _mm512_set1_ps(xd[mg])), acc[i]);
      acc[i] = _mm512_fmadd_ps(of, _mm512_set1_ps(xsum[mg]), acc[i]);
    }
  }
  for (int i = 0; i < ROWS; ++i) _mm512_storeu_ps(y + (m + i) * N + n0, acc[i]);
}
#else
#define ROWS_MAX 4
/* ROWS rows from m against the repacked block, as two halves of 8 channels. */
static inline __attribute__((always_inline)) void block_rows(const int8_t *xq, const float *xd, const float *xsum,
                                                            const int32_t *qp, const float *sp, const float *op,
                                                            const int32_t *corr, float *y, int64_t N, int64_t G,
                                                            int64_t n0, int64_t m, const int ROWS) {
  const int64_t K = G * GROUP;
  const __m256i ones = _mm256_set1_epi16(1);
  (void)corr;
  for (int h = 0; h < LANES; h += 8) {
    __m256 acc[ROWS_MAX];
    for (int i = 0; i < ROWS; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256i s[ROWS_MAX];
      for (int i = 0; i < ROWS; ++i) s[i] = _mm256_setzero_si256();
      for (int t = 0; t < STEPS; ++t) {
        const __m256i w = _mm256_load_si256((const __m256i *)(qp + (g * STEPS + t) * LANES + h));
        const __m256i u = _mm256_abs_epi8(w);
        const int8_t *a = xq + m * K + g * GROUP + 4 * t;
        for (int i = 0; i < ROWS; ++i) {
          const __m256i sv = _mm256_sign_epi8(_mm256_set1_epi32(four(a + i * K)), w);
          s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, sv), ones));
        }
      }
      const __m256 sc = _mm256_load_ps(sp + g * LANES + h), of = _mm256_load_ps(op + g * LANES + h);
      for (int i = 0; i < ROWS; ++i) {
        const int64_t mg = (m + i) * G + g;
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(sc, _mm256_set1_ps(xd[mg])), acc[i]);
        acc[i] = _mm256_fmadd_ps(of, _mm256_set1_ps(xsum[mg]), acc[i]);
      }
    }
    for (int i = 0; i < ROWS; ++i) _mm256_storeu_ps(y + (m + i) * N + n0 + h, acc[i]);
  }
}
#endif

/* Bytes of one thread's block buffer for G groups (a multiple of 64): the block's int8 weights, then its
   scales, offsets and corrections. The caller allocates `threads` of them, 64-byte aligned, so an allocation
   that fails is the caller's error, not a crash in here. */
int64_t kvchat_int8_int8_work_bytes(int64_t G) {
  const int64_t bytes = G * GROUP * LANES + G * LANES * 12;
  return (bytes + 63) / 64 * 64;
}

void kvchat_int8_int8_matmul(const float *x, const int8_t *q, const float *scale, const float *offset, int8_t *xq,
                             float *xd, float *xsum, float *y, char *work, int64_t M, int64_t N, int64_t G,
                             int threads) {
  const int64_t K = G * GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t mg = 0; mg < M * G; ++mg) quantize_group(x + mg * GROUP, xq + mg * GROUP, xd + mg, xsum + mg);
  const int64_t blocks = N / LANES;
#pragma omp parallel num_threads(threads)
  {
    char *buf = work + omp_get_thread_num() * kvchat_int8_int8_work_bytes(G);
    int32_t *qp = (int32_t *)buf;
    float *sp = (float *)(buf + K * LANES), *op = sp + G * LANES;
    int32_t *corr = (int32_t *)(op + G * LANES);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t n0 = blk * LANES;
      repack(q, scale, offset, n0, G, qp, sp, op, corr);
      for (int64_t m = 0; m < M;) {
        const int rows = M - m >= ROWS_MAX ? ROWS_MAX : (int)(M - m);
#define ROWS_CASE(R) case R: block_rows(xq, xd, xsum, qp, sp, op, corr, y, N, G, n0, m, R); break;
        switch (rows) {
          ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
#if ROWS_MAX > 4
          ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#endif
        }
#undef ROWS_CASE
        m += rows;
      }
    }
  }
}
