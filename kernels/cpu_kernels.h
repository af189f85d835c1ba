/* The compiled CPU kernels' entry points, declared once: cpu_int8.c and cpu_attention.c define them, and
   cpu_decode.c (a whole decode layer in one call) is built together with both and calls them. Arguments and
   layouts are documented where each is defined. */

#ifndef KVCHAT_CPU_KERNELS_H
#define KVCHAT_CPU_KERNELS_H

#include <stdint.h>

void kvchat_int8_matmul(const float *x, const int8_t *q, const float *scale, const float *offset, float *xsum, float *y,
                        int64_t M, int64_t N, int64_t G, int threads);

void kvchat_paged_scores(const float *q, const uint8_t *k_cache, const float *k_scale, const int32_t *table,
                         int64_t table_stride, const int32_t *lens, const float *sink, int64_t sink_stride,
                         float *s, float *tile, int64_t R, int64_t H, int64_t G, int64_t D, int64_t BS,
                         int64_t Lmax, float sm_scale, int kind, int threads);

void kvchat_paged_values(const float *p, const uint8_t *v_cache, const float *v_scale, const int32_t *table,
                         int64_t table_stride, const int32_t *lens, const float *sink, int64_t sink_stride,
                         float *o, float *work, float *tile, int64_t R, int64_t H, int64_t G, int64_t D,
                         int64_t BS, int64_t Lmax, int kind, int threads);

void kvchat_paged_write(const float *k, const float *v, uint8_t *k_cache, uint8_t *v_cache, float *k_scale,
                        float *v_scale, const int64_t *slots, int64_t T, int64_t H, int64_t D, int kind);

void kvchat_decode_limits(int64_t *split, int64_t *max_head_dim);

#endif
