/* The compiled CPU kernels' entry points and the helpers they share, declared once: cpu_int8.c and cpu_attention.c define them, and
   cpu_decode.c (a whole decode layer in one call) is built together with both and calls them. Arguments and
   layouts are documented where each is defined. */

#ifndef KVCHAT_CPU_KERNELS_H
#define KVCHAT_CPU_KERNELS_H

#include <immintrin.h>
#include <stdint.h>

#define GROUP 32 /* int8 weights: inputs per scale and offset (kvchat.kernels.cpu_int8.GROUP) */

/* The sum of v's 8 lanes. */
static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

void kvchat_int8_matmul(const float *x, const int8_t *q, const float *scale, const float *offset, float *xsum, float *y,
                        int64_t M, int64_t N, int64_t G, int threads);

void kvchat_paged_scores(const float *q, const uint8_t *k_cache, const float *k_scale, const int32_t *table,
                         int64_t table_stride, const int32_t *lens, const float *sink, int64_t sink_stride,
                         float *s, float *tile, int64_t R, int64_t H, int64_t G, int64_t T, int64_t D,
                         int64_t BS, int64_t Lmax, float sm_scale, int kind, int threads);

void kvchat_paged_values(const float *p, const uint8_t *v_cache, const float *v_scale, const int32_t *table,
                         int64_t table_stride, const int32_t *lens, const float *sink, int64_t sink_stride,
                         float *o, float *work, float *tile, int64_t R, int64_t H, int64_t G, int64_t D,
                         int64_t BS, int64_t Lmax, int kind, int threads);

void kvchat_paged_write(const float *k, const float *v, uint8_t *k_cache, uint8_t *v_cache, float *k_scale,
                        float *v_scale, const int64_t *slots, int64_t T, int64_t H, int64_t D, int kind);

void kvchat_decode_limits(int64_t *split, int64_t *max_head_dim);

/* cpu_decode.c: x float32 [rows, hidden] updated in place by one decoder layer (DecodeLayer, DecodeStep and the
   scratch are defined there); the scratch floats a step of s->rows rows over at most lmax tokens needs. */
struct DecodeLayer;
struct DecodeStep;
void kvchat_decode_layer(float *x, const struct DecodeLayer *w, const struct DecodeStep *s);
int64_t kvchat_decode_scratch_floats(const struct DecodeStep *s, int64_t lmax);

#endif
