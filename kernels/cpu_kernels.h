/* The compiled CPU kernels' entry points and the helpers they share, declared once: cpu_int8.c, cpu_int4.c and cpu_attention.c define them, and
   cpu_decode.c (a whole decode layer in one call) is built together with both and calls them. Arguments and
   layouts are documented where each is defined. */

#ifndef KVCHAT_CPU_KERNELS_H
#define KVCHAT_CPU_KERNELS_H

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define GROUP 32 /* int8 and int4 weights: inputs per scale and offset (kvchat.kernels.cpu_int8.GROUP) */

/* The sum of v's 8 lanes. */
static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

/* cpu_int8.c's arithmetic: a group's 32 products as one 8-lane chain over its four blocks of 8 inputs (w0..w3:
   the group's widened weights, x: its 32 inputs) ... */
static inline __m256 group_dot(__m256 w0, __m256 w1, __m256 w2, __m256 w3, const float *x) {
  __m256 d = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
  d = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), d);
  d = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), d);
  return _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), d);
}

/* ... and sum_g c[g] * xs[g] (c: a channel's per-group offsets or minima, xs: a row's group sums; cpu_int4.c's
   minima too), eight groups per step, then the rest in order. */
static inline float groups_dot(const float *c, const float *xs, int64_t G) {
  __m256 v = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(c + g), _mm256_loadu_ps(xs + g), v);
  float r = hsum8(v);
  for (; g < G; ++g) r += c[g] * xs[g];
  return r;
}

/* xsum [M, G]: each row's sums of its groups of 32 inputs (x float32 [M, 32 G]), as (x0 + x1) + (x2 + x3) over the
   group's four blocks of 8, then the 8 lanes: the terms cpu_int8.c's and cpu_int8_int8.c's offsets multiply. */
static inline void group_sums(const float *x, float *xsum, int64_t M, int64_t G) {
  for (int64_t mg = 0; mg < M * G; ++mg) {
    const float *v = x + mg * GROUP;
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)));
    xsum[mg] = hsum8(s);
  }
}

/* The largest of v's 8 lanes. */
static inline float hmax8(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

/* The integer kernels' activations (cpu_int8_int8.c, cpu_int4.c): a group of 32 floats at v quantized to int8,
   symmetric, as llama.cpp's Q8_0 / Q8_1 blocks (ggml-quants.c, quantize_row_q8_0 / q8_1): *d = max|v| / 127 and
   the 32 values round(v / d) (half to even: _mm256_cvtps_epi32 under the default MXCSR) in [-127, 127], returned
   in order. A group whose max|v| is below 127 x FLT_MIN (127 / max|v| overflows to inf and the values would be
   NaN) counts as zeros (d 0). */
static inline __m256i quantize32(const float *v, float *d) {
  const __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8), a2 = _mm256_loadu_ps(v + 16),
               a3 = _mm256_loadu_ps(v + 24);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, a2), _mm256_andnot_ps(sign, a3)));
  const float amax = hmax8(mx);
  const int zero = !(amax >= 127.0f * FLT_MIN);
  *d = zero ? 0.0f : amax / 127.0f;
  const __m256 id = _mm256_set1_ps(zero ? 0.0f : 127.0f / amax);
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, id)),
                i2 = _mm256_cvtps_epi32(_mm256_mul_ps(a2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(a3, id));
  /* packs interleave the 128-bit halves: the permutation puts the 32 bytes back in order */
  __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  return _mm256_max_epi8(b, _mm256_set1_epi8(-127));
}

/* Q8_1's block sum: d times the exact sum of a quantize32 group's 32 values b (byte pairs, at most 254 in
   magnitude, into int16, then into int32 lanes; at most 32 x 127 in all, exact in fp32), as one fp32 product. */
static inline float block_sum(__m256i b, float d) {
  const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), b), _mm256_set1_epi16(1));
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  const __m128i q = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
  return d * (float)_mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 1)));
}

#ifdef KVCHAT_AVX512
/* 8 floats at x in both halves. */
static inline __m512 both(const float *x) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(x)); }

/* group_dot for two channels at once: channel n's weights in lanes 0-7, channel n + 1's in lanes 8-15, each half
   the same operations in the same order as group_dot (so the bits equal the avx2 build's). */
static inline __m512 group_dot2(__m512 w0, __m512 w1, __m512 w2, __m512 w3, const float *x) {
  __m512 d = _mm512_mul_ps(w0, both(x));
  d = _mm512_fmadd_ps(w1, both(x + 8), d);
  d = _mm512_fmadd_ps(w2, both(x + 16), d);
  return _mm512_fmadd_ps(w3, both(x + 24), d);
}
#endif

/* exp(x) in 8 lanes: Cephes' expf (S. Moshier): x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts),
   exp(r) by its degree-7 polynomial, times 2**n. Inputs are clamped to [-87.3, 88.3] (normal results); a NaN
   stays NaN (min/max return their second operand when one is NaN). */
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(_mm256_set1_ps(-87.3365447505531f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The 8 floats at x[i..i+8) where i + 8 <= n, else the n - i left, padded with pad. */
static inline __m256 load_part(const float *x, int64_t i, int64_t n, float pad) {
  if (i + 8 <= n) return _mm256_loadu_ps(x + i);
  float t[8];
  for (int j = 0; j < 8; ++j) t[j] = i + j < n ? x[i + j] : pad;
  return _mm256_loadu_ps(t);
}

static inline void store_part(float *y, int64_t i, int64_t n, __m256 v) {
  if (i + 8 <= n) {
    _mm256_storeu_ps(y + i, v);
    return;
  }
  float t[8];
  _mm256_storeu_ps(t, v);
  for (int j = 0; i + j < n; ++j) y[i + j] = t[j];
}

void kvchat_int8_matmul(const float *x, const int8_t *q, const float *scale, const float *offset, float *xsum, float *y,
                        int64_t M, int64_t N, int64_t G, int threads);

/* cpu_int4.c: packed uint8 [N, K / 2] nibbles, fp16 (uint16) scale and minimum [N, G]; scratch xq int8 [M, K],
   xd and xs float32 [M, G]. */
void kvchat_int4_matmul(const float *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum,
                        int8_t *xq, float *xd, float *xs, float *y, int64_t M, int64_t N, int64_t G, int threads);
int64_t kvchat_int4_max_groups(void);
/* The same product in the channel-lanes order (cpu_int4.c), with a work buffer of kvchat_int4_lanes_work_bytes:
   the compiled decoder layers run a chunk of at least INT4_LANE_MIN_TOKENS tokens on it
   (kvchat.model.int4_scheme.INT4_LANE_MIN_TOKENS, the same number), their decode steps and shorter chunks on
   kvchat_int4_matmul. */
#define INT4_LANE_MIN_TOKENS 5
void kvchat_int4_matmul_lanes(const float *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum,
                              int8_t *xq, float *xd, float *xs, float *y, char *work, int64_t M, int64_t N,
                              int64_t G, int threads);
int64_t kvchat_int4_lanes_work_bytes(int64_t G, int threads);
int64_t kvchat_int4_lane_min_tokens(void);

void kvchat_paged_attention(const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const float *k_scale,
                            const float *v_scale, const int32_t *table, int64_t table_stride, const int32_t *lens,
                            const float *sink_k, const float *sink_v, int64_t sink_stride, float *o, float *work,
                            float *tile, int64_t R, int64_t H, int64_t G, int64_t T, int64_t D, int64_t BS,
                            int64_t Lmax, float sm_scale, int kind, int threads);

void kvchat_paged_write(const float *k, const float *v, uint8_t *k_cache, uint8_t *v_cache, float *k_scale,
                        float *v_scale, const int64_t *slots, int64_t T, int64_t H, int64_t D, int kind);

int64_t kvchat_attention_max_head_dim(void);
int64_t kvchat_attention_tile_floats(int64_t H, int64_t G, int64_t D, int threads);
int64_t kvchat_attention_work_floats(int64_t R, int64_t H, int64_t G, int64_t D, int64_t Lmax);

/* cpu_decode.c: x float32 [rows, hidden] updated in place by one decoder layer (DecodeLayer, DecodeStep and the
   scratch are defined there); the scratch floats a step of s->rows rows over at most lmax tokens needs. */
struct DecodeLayer;
struct DecodeStep;
void kvchat_decode_layer(float *x, const struct DecodeLayer *w, const struct DecodeStep *s);
int64_t kvchat_decode_scratch_floats(const struct DecodeStep *s, int64_t lmax);

#endif
