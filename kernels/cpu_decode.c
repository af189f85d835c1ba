/* One decoder layer of a Llama-family model for the CPU (AVX2, FMA), in one call: the torch code of
   kvchat.model.transformer.Block for a decode step or a short chunk, with int8 group weights (cpu_int8.c) or
   int4 ones (cpu_int4.c) and the paged attention and cache write (cpu_attention.c), built together with all three
   (cpu_kernels.h).

   x[r] += attn(rms_norm(x[r]) * attn_norm);  x[r] += mlp(rms_norm(x[r]) * mlp_norm), for the R rows of a step.
   The rows are S sequences of T consecutive new tokens each (row r = s T + t): a decode step has T = 1 (S rows
   of a batch), a short chunk of one sequence S = 1 (cpu_attention.c then reads each cached K/V range once for
   all T tokens, each token seeing the tokens up to itself); the Python wrapper passes no other mix:

     qkv   = matmul(h, qkv) (+ bias)               [R, (H + 2 Hkv) D], q heads, then k heads, then v heads
     q, k  = RoPE (rotate-half, sin carrying its sign: kvchat.model.transformer.apply_rope), k -= k_shift
     pool  <- k, v at slots (kvchat_paged_write)
     a     = softmax(q . K^T * sm_scale) V over the token's own L_s - T + 1 + t tokens (kvchat_paged_attention)
     x    += matmul(a, o)
     gu    = matmul(rms_norm(x) * mlp_norm, gate_up)   [R, 2 I], gate then up
     x    += matmul(silu(gate) * up, down)

   (matmul: cpu_int8.c's or cpu_int4.c's, by the weight's bits.)

   Why one call: a decode step of SmolLM2 ran ~40 torch ops per layer besides the kernels (norms, RoPE's
   cat/mul/addcmul, slicing, softmax, SiLU, residuals, the ctypes wrappers' checks), each a few microseconds
   of dispatch for a few hundred floats of work. Here they are plain loops between the kernels' OpenMP regions.

   Numerics: fp32 throughout (int4 weights meet int8-quantized activations: cpu_int4.c); the rounding differs from torch's (summation order of the norms, the
   polynomial exp below). Decode K/V are provisional (recomputed as prefill chunks when the turn ends;
   kvchat.engine.runner.Engine.decode); a short chunk's K/V are stored, and every chunk of its size runs
   here, cold or resumed, so they are the same bits either way (kvchat.model.int8_scheme.COMPILED_LAYER_MAX_TOKENS,
   which names this path in the cache fingerprint). A row's bits depend on its token, its position and the
   cached K/V alone: the norms, RoPE and SiLU work row by row, the int8 and int4 kernels and the attention are
   row-invariant (their sources say why), and the softmax runs over the token's own length.

   Layout of the caller's scratch (float32, kvchat_decode_scratch_floats of it): carved below in `carve`. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"

typedef struct {
  const void *q;                    /* bits 8: int8 [n, k] (cpu_int8.c); bits 4: uint8 [n, k / 2] nibbles (cpu_int4.c) */
  const void *scale, *offset;       /* [n, k / GROUP]: bits 8 float32; bits 4 fp16 scale and minimum */
  const float *bias;                /* [n] or NULL */
  int64_t n, k, bits;
} Weight;

typedef struct DecodeLayer {
  const float *attn_norm, *mlp_norm; /* [hidden] */
  Weight qkv, o, gate_up, down;
  const float *k_shift;              /* [Hkv, D] or NULL */
  uint8_t *k_cache, *v_cache;        /* the layer's pool, cpu_attention.c's layout */
  float *k_scale, *v_scale;          /* fp8 pools' scales, else NULL */
  int64_t index;                     /* the layer's index: its rows of the sink */
} DecodeLayer;

typedef struct DecodeStep {
  int64_t rows, hidden, heads, kv_heads, head_dim, inter, block_size, table_stride, num_layers;
  int64_t tokens;                    /* T, new tokens per sequence: rows / T sequences (S) */
  const int32_t *table, *lens;       /* [S, >= ceil(L_s / BS)] (row stride table_stride), [S], the new tokens included */
  const int64_t *slots;              /* [rows], -1: nothing written */
  const float *cos, *sin;            /* [rows, D] */
  const float *sink_k, *sink_v;      /* [S, num_layers, Hkv, D] exact position-0 K/V, or NULL */
  float eps, sm_scale;
  int kind, threads;                 /* cpu_attention.c's KIND_*; OpenMP team size */
  float *scratch;
} DecodeStep;

typedef struct {
  float *h, *qkv, *q, *k, *v, *attn, *proj, *gu, *act, *xsum, *xq, *xd, *tile, *work, *lanes;
} Scratch; /* xq: int4 matmuls' int8 activations (R * widest bytes); xd: their scales; lanes: the int4
             channel-lanes kernel's work (kvchat_int4_lanes_work_bytes) */

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int64_t longest(const DecodeStep *s) {
  int64_t lmax = 0;
  for (int64_t r = 0; r < s->rows / s->tokens; ++r) lmax = max64(lmax, s->lens[r]);
  return lmax;
}

/* The scratch of a step of s->rows rows and at most lmax tokens, at base (NULL: sizes only); returns floats used. */
static int64_t carve(const DecodeStep *s, int64_t lmax, float *base, Scratch *b) {
  const int64_t R = s->rows, H = s->heads, Hkv = s->kv_heads, D = s->head_dim, I = s->inter, TG = s->tokens * H / Hkv;
  const int64_t widest = max64(max64(s->hidden, H * D), I);
  const int64_t sizes[15] = {R * s->hidden,       R * (H + 2 * Hkv) * D, R * H * D,  R * Hkv * D,
                             R * Hkv * D,         R * H * D,             R * s->hidden, R * 2 * I,
                             R * I,               R * (widest / GROUP),  (R * widest + 3) / 4, R * (widest / GROUP),
                             kvchat_attention_tile_floats(Hkv, TG, D, s->threads),
                             kvchat_attention_work_floats(R / s->tokens, Hkv, TG, D, lmax),
                             (kvchat_int4_lanes_work_bytes(widest / GROUP, s->threads) + 3) / 4};
  float **slot[15] = {&b->h, &b->qkv, &b->q, &b->k, &b->v, &b->attn, &b->proj, &b->gu, &b->act, &b->xsum,
                      &b->xq, &b->xd, &b->tile, &b->work, &b->lanes};
  int64_t used = 0;
  for (int i = 0; i < 15; ++i) {
    if (base != NULL) *slot[i] = base + used;
    used += (sizes[i] + 15) / 16 * 16; /* each part on a 64-byte boundary of the base */
  }
  return used;
}

/* Floats of scratch a step of s->rows rows over at most lmax tokens needs (s->scratch unused): the parts, and
   16 more for aligning the base to 64 bytes. */
int64_t kvchat_decode_scratch_floats(const DecodeStep *s, int64_t lmax) { return carve(s, lmax, NULL, NULL) + 16; }

/* y[r] = x[r] / sqrt(mean(x[r]**2) + eps) * w (Zhang & Sennrich 2019), n a multiple of 8. */
static void rms_norm(const float *x, const float *w, float *y, int64_t R, int64_t n, float eps) {
  for (int64_t r = 0; r < R; ++r) {
    const float *xr = x + r * n;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(xr + i), acc);
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(y + r * n + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv), _mm256_loadu_ps(w + i)));
  }
}

/* y = x W^T (+ bias) for R rows of chunks of T tokens each (T = 1: a decode step). int4: a chunk of at least
   INT4_LANE_MIN_TOKENS tokens on the channel-lanes kernel, else the group kernel; the choice follows T alone, so
   a chunk's bits are the same cold or resumed. */
static void linear(const Weight *w, const float *x, float *y, int64_t R, int64_t T, const Scratch *b, int threads) {
  if (w->bits == 4 && T >= INT4_LANE_MIN_TOKENS)
    kvchat_int4_matmul_lanes(x, w->q, w->scale, w->offset, (int8_t *)b->xq, b->xd, b->xsum, y, (char *)b->lanes, R,
                             w->n, w->k / GROUP, threads);
  else if (w->bits == 4)
    kvchat_int4_matmul(x, w->q, w->scale, w->offset, (int8_t *)b->xq, b->xd, b->xsum, y, R, w->n, w->k / GROUP,
                       threads);
  else
    kvchat_int8_matmul(x, w->q, w->scale, w->offset, b->xsum, y, R, w->n, w->k / GROUP, threads);
  if (w->bias != NULL)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < w->n; ++i) y[r * w->n + i] += w->bias[i];
}

/* heads rows of D values: dst = src * cos + swap_halves(src) * sin (- shift), D a multiple of 16. */
static void rope(const float *src, float *dst, int64_t heads, int64_t D, const float *cos, const float *sin,
                 const float *shift) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float *x = src + h * D;
    float *y = dst + h * D;
    for (int64_t d = 0; d < D; d += 8) {
      const int64_t other = d < half ? d + half : d - half;
      __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(x + other), _mm256_loadu_ps(sin + d),
                                 _mm256_mul_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(cos + d)));
      if (shift != NULL) v = _mm256_sub_ps(v, _mm256_loadu_ps(shift + h * D + d));
      _mm256_storeu_ps(y + d, v);
    }
  }
}

/* act[r] = silu(gate[r]) * up[r] with gu[r] = (gate, up), I values each (a multiple of 8: down's inputs are
   groups of 32); silu(g) = g / (1 + exp(-g)). */
static void silu_mul(const float *gu, float *act, int64_t R, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 g = _mm256_loadu_ps(gu + r * 2 * I + i), u = _mm256_loadu_ps(gu + r * 2 * I + I + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
      _mm256_storeu_ps(act + r * I + i, _mm256_mul_ps(silu, u));
    }
}

static void add_rows(float *x, const float *y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

/* x float32 [rows, hidden] (hidden a multiple of 32) += one decoder layer, as the module comment says. */
void kvchat_decode_layer(float *x, const DecodeLayer *w, const DecodeStep *s) {
  const int64_t R = s->rows, Hd = s->hidden, H = s->heads, Hkv = s->kv_heads, D = s->head_dim, I = s->inter;
  const int64_t T = s->tokens, S = R / T, G = H / Hkv, lmax = longest(s), width = (H + 2 * Hkv) * D;
  const int th = s->threads;
  Scratch b;
  carve(s, lmax, (float *)(((uintptr_t)s->scratch + 63) & ~(uintptr_t)63), &b);

  rms_norm(x, w->attn_norm, b.h, R, Hd, s->eps);
  linear(&w->qkv, b.h, b.qkv, R, T, &b, th);
  for (int64_t r = 0; r < R; ++r) {
    const float *row = b.qkv + r * width, *c = s->cos + r * D, *sn = s->sin + r * D;
    for (int64_t h = 0; h < Hkv; ++h) /* q as [S, Hkv, T, G, D]: a KV head's T * G queries together */
      rope(row + h * G * D, b.q + (((r / T * Hkv + h) * T + r % T) * G) * D, G, D, c, sn, NULL);
    rope(row + H * D, b.k + r * Hkv * D, Hkv, D, c, sn, w->k_shift);
    for (int64_t i = 0; i < Hkv * D; ++i) b.v[r * Hkv * D + i] = row[(H + Hkv) * D + i];
  }
  kvchat_paged_write(b.k, b.v, w->k_cache, w->v_cache, w->k_scale, w->v_scale, s->slots, R, Hkv, D, s->kind);
  const int64_t sink_off = w->index * Hkv * D, sink_stride = s->num_layers * Hkv * D;
  const float *sink_k = s->sink_k == NULL ? NULL : s->sink_k + sink_off;
  const float *sink_v = s->sink_v == NULL ? NULL : s->sink_v + sink_off;
  kvchat_paged_attention(b.q, w->k_cache, w->v_cache, w->k_scale, w->v_scale, s->table, s->table_stride, s->lens,
                         sink_k, sink_v, sink_stride, b.attn, b.work, b.tile, S, Hkv, T * G, T, D, s->block_size, lmax,
                         s->sm_scale, s->kind, th);
  const float *attn = b.attn; /* [S, Hkv, T, G, D]; with T > 1 reordered to rows [R, H * D] in b.q (free now) */
  if (T > 1) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t i = 0; i < G * D; ++i)
          b.q[r * H * D + h * G * D + i] = b.attn[(((r / T * Hkv + h) * T + r % T) * G) * D + i];
    attn = b.q;
  }
  linear(&w->o, attn, b.proj, R, T, &b, th);
  add_rows(x, b.proj, R * Hd);

  rms_norm(x, w->mlp_norm, b.h, R, Hd, s->eps);
  linear(&w->gate_up, b.h, b.gu, R, T, &b, th);
  silu_mul(b.gu, b.act, R, I);
  linear(&w->down, b.act, b.proj, R, T, &b, th);
  add_rows(x, b.proj, R * Hd);
}
