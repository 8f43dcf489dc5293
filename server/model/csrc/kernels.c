/* Specula's CPU kernels in one translation unit, built once per instruction set (cpu_kernels.py: `-mavx2 ...` or
   `-mavx512f ...`, picked at load by the CPU's features): the block products (`block_gemm`) and a decoder stack in
   one call (`decoder_forward`, cpu_decoder.py says how). What differs between instruction sets is in
   arch_avx2.h / arch_avx512.h; the int8-activation products (int8.h) and everything below run on AVX2
   instructions, which AVX-512 hosts have too. */
#include <float.h>
#include <math.h>
#include <omp.h>

#include "specula.h"
#include "vec.h"
#if defined(__AVX512F__)
#include "arch_avx512.h"
#else
#include "arch_avx2.h"
#endif
#include "int8.h"

void specula_abi(int64_t* sizes) {
  sizes[0] = (int64_t)sizeof(struct weights);
  sizes[1] = (int64_t)sizeof(struct product);
  sizes[2] = (int64_t)sizeof(struct layer);
  sizes[3] = (int64_t)sizeof(struct dims);
}

/* Each row's sum over each group of 32 inputs, in one fixed order: xs [M, K/32]. */
static void group_sums(const float* x, int64_t K, float* xs) {
  for (int64_t g = 0; g < K / 32; g++) {
    const v16 lo = load16(x + g * 32), hi = load16(x + g * 32 + 16);
    v16 t = lo + hi;
    float u[16];
    memcpy(u, &t, 64);
    xs[g] = (((u[0] + u[1]) + (u[2] + u[3])) + ((u[4] + u[5]) + (u[6] + u[7]))) +
            (((u[8] + u[9]) + (u[10] + u[11])) + ((u[12] + u[13]) + (u[14] + u[15])));
  }
}

/* Bytes of one tile's values over K inputs: Q4 half a byte a weight, Q5 five eighths, Q6 three quarters, Q8 one, F16
   two (16 outputs each). */
static inline int64_t tile_bytes(int64_t kind, int64_t K) {
  if (kind == KIND_Q5M_INT8 || kind == KIND_Q5_INT8) return K / 32 * 320;
  if (kind == KIND_Q6_INT8) return K / 32 * 384;
  return kind == KIND_Q4 || kind == KIND_Q4_INT8 ? K / 2 * 16 : kind == KIND_F16 ? K * 32 : K * 16;  /* Q8 kinds */
}

/* Floats of a tile's scales over K inputs (mins: `mins` set): float32, one row of 16 per group (16 inputs for
   KIND_Q8G16_INT8's scales, else 32), or in two levels (specula.h): 16 floats and a group's 16 int8s (4 floats) per
   super-block of 256 inputs and group. */
static inline int64_t scale_floats(const struct weights* w, int mins) {
  const int64_t groups = (w->kind == KIND_Q8G16_INT8 || w->kind == KIND_Q6_INT8) && !mins ? w->K / 16 : w->K / 32;
  return w->scales == SCALES_TWO_LEVEL ? w->K / 256 * 16 + groups * 4 : groups * 16;
}

static inline int needs_sums(int kind) {
  return kind == KIND_Q4 || kind == KIND_Q4_INT8 || kind == KIND_Q8M_INT8 || kind == KIND_Q5M_INT8;
}
static inline int needs_int8(int kind) {
  return kind == KIND_Q4_INT8 || (kind >= KIND_Q8_INT8 && kind <= KIND_Q6_INT8);
}

/* What a product needs of row r of x [M, K] (every row's, before any tile): its group sums xs [M, K/32] (the
   minimum's term: `sums`) and, on int8 activations (`ints`), its scales after them [M, K/32], its int8 values
   after those [M, K] bytes and their sums per group after those [M, K/32] int32 (`scratch_floats` a row). */
static void prepare_row(int sums, int ints, const float* x, int64_t M, int64_t K, float* xs, int64_t r) {
  const int64_t G = K / 32;
  if (sums) group_sums(x + r * K, K, xs + r * G);
  if (ints)
    quantize_row(x + r * K, K, xs + M * G + r * G, (int8_t*)(xs + 2 * M * G) + r * K,
                 (int32_t*)(xs + 2 * M * G + M * K / 4) + r * G);
}

/* One tile's outputs for all M rows, by kind, then its bias (if any). */
static inline void tile_of(const struct weights* w, int64_t t, const float* x, int64_t M, const float* xs, float* y,
                           int64_t ldy) {
  const int64_t K = w->K;
  const int two = w->scales == SCALES_TWO_LEVEL;
  const uint8_t* q = w->q + t * tile_bytes(w->kind, K);
  const float* s = w->s + t * scale_floats(w, 0);
  const float* m = w->m + t * scale_floats(w, 1);
  if (w->kind == KIND_Q4_INT8) tile_q4i(M, K, q, s, m, two, xs, y, ldy);
  else if ((w->kind >= KIND_Q8_INT8 && w->kind <= KIND_Q8G16_INT8) || w->kind == KIND_Q6_INT8)
    tile_q8i(w->kind, M, K, q, s, m, two, xs, y, ldy);
  else if (w->kind == KIND_Q5M_INT8 || w->kind == KIND_Q5_INT8) tile_q5i(w->kind, M, K, q, s, m, two, xs, y, ldy);
  else tile(w->kind, x, M, K, q, s, m, xs, y, ldy);  /* float32 activations: float32 scales only */
  if (w->bias)
    for (int64_t r = 0; r < M; r++) store16(y + r * ldy, load16(y + r * ldy) + load16(w->bias + t * 16));
}

/* ---- the decoder stack of a Llama model on these weights, in one call (cpu_decoder.py) ---------------- */
#ifndef __F16C__
#error "the decoder's float16 cache needs F16C"
#endif
/* The cache's storage (`kv_kind`): 0 float32, 1 float16, 2 bfloat16. A key or value of d elements (a multiple of
   16) is written rounded to nearest even, as torch's .to(float16 / bfloat16) rounds, and read back as floats. */
static void put_kv(void* cache, int64_t at, const float* src, int64_t d, int64_t kind) {
  if (kind == 1) {
    uint16_t* dst = (uint16_t*)cache + at;
    for (int64_t i = 0; i < d; i += 8)
      _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if (kind == 2) {
    uint16_t* dst = (uint16_t*)cache + at;
    for (int64_t i = 0; i < d; i++) {
      uint32_t u;
      memcpy(&u, src + i, 4);
      if ((u & 0x7fffffffu) > 0x7f800000u) u = (u & 0x80000000u) | 0x7fc00000u;  /* NaN stays a NaN */
      else u = u + 0x7fffu + ((u >> 16) & 1u);
      dst[i] = (uint16_t)(u >> 16);
    }
  } else {
    memcpy((float*)cache + at, src, d * sizeof(float));
  }
}

/* 8 elements of the cache from element `at` on, as floats. */
static inline __m256 kv8(const void* cache, int64_t at, int64_t kind) {
  if (kind == 0) return _mm256_loadu_ps((const float*)cache + at);
  const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)cache + at));
  return kind == 1 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The threads' share of a product (called inside a parallel region): y [M, ldy] = x [M, K] times each part's
   tiles, part after part side by side; the input prepared once for all parts, every part's tiles split statically
   between the threads as one list. xs: scratch of M * (K/32 * 2 + K/4) floats (`prepare_row`). */
static void gemm_in(const struct product* p, const float* x, int64_t M, float* xs, float* y, int64_t ldy) {
  int sums = 0, ints = 0;
  int64_t total = 0;
  for (int64_t i = 0; i < p->parts; i++) {
    sums |= needs_sums(p->part[i].kind);
    ints |= needs_int8(p->part[i].kind);
    total += p->part[i].tiles;
  }
  if (sums || ints) {
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++) prepare_row(sums, ints, x, M, p->part[0].K, xs, r);
  }
  #pragma omp for schedule(static)
  for (int64_t t = 0; t < total; t++) {
    int64_t i = 0, start = 0;
    while (t - start >= p->part[i].tiles) start += p->part[i++].tiles;
    tile_of(&p->part[i], t - start, x, M, xs, y + t * 16, ldy);
  }
}

/* y [M, tiles * 16] = x [M, K] times the tiles' weights: q [tiles][K/2 or K][16] bytes (F16: [tiles][K][16]
   float16; the int8-activation kinds in their own order, Tiles.q4 / q8), s and m [tiles][K/group][16] float32 or in
   two levels (`scales`: specula.h; m read only by the kinds with a minimum). */
void block_gemm(int kind, int scales, const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s,
                const float* m, float* xs, float* y, int64_t tiles, int threads) {
  const struct product p = {{{q, s, m, NULL, tiles, K, kind, scales}}, 1};
  #pragma omp parallel num_threads(threads)
  gemm_in(&p, x, M, xs, y, tiles * 16);
}

/* out[i] = gelu_tanh(g[i]) u[i] for i < n (a multiple of 8): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as
   transformers' gelu_pytorch_tanh (Gemma's MLP). */
static void gelu_mul(const float* g, const float* u, float* out, int64_t n) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(0.7978845608028654f);
  const __m256 k = _mm256_set1_ps(0.044715f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 a = _mm256_loadu_ps(g + i);
    const __m256 z = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(k, a), _mm256_mul_ps(a, a), a));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(half, a), _mm256_add_ps(one, tanh8(z)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
  }
}

/* transformers' RMSNorm in float32: h = (x * rsqrt(mean(x^2) + eps)) * w, the mean summed in one fixed order. */
static void rms_row(const float* x, const float* w, float* h, int64_t n, float eps) {
  v16 acc = splat(0.0f);
  for (int64_t i = 0; i < n; i += 16) { const v16 v = load16(x + i); acc += v * v; }
  const float r = 1.0f / sqrtf(hsum(acc) / (float)n + eps);
  for (int64_t i = 0; i < n; i += 16) store16(h + i, (load16(x + i) * splat(r)) * load16(w + i));
}

/* RoPE in place over a head's first d dimensions (all of it, or a partial rotary's share; the rest stays):
   v = v * cos + roll(v, d/2) * signed_sin (decoder.py's `rotate`). */
static void rope(float* v, const float* cos, const float* ssin, int64_t d) {
  float t[256];
  memcpy(t, v, d * sizeof(float));
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; i++) v[i] = t[i] * cos[i] + t[i < half ? i + half : i - half] * ssin[i];
}

/* Attention over one run of a row's live keys (at most KCHUNK of them, in the keys' order) for a block of up to
   QBLOCK consecutive queries of that row (a prompt chunk's, a verify pass's) and the G query heads of one KV head.
   Query b sees the run's first n[b] keys (its live keys are a prefix of the block's last query's: decoder_forward
   forms blocks so), each key read from the cache and converted once for the whole block. Per query and head the
   operations do not depend on the block: the score of key i is its dot product (`dots8`) times the scale plus the
   mask, the scores' softmax parts run as one query's would, and the output sums p_i v_i over the query's keys in
   order. So a position's result is the same bits alone, in a verify pass or in a prompt chunk, beside any rows.
   Writes query b's part at part[b] (G x d unnormalised output, then per head its top score and its sum of
   exp(score - top): `merge` combines a query's parts in order); part[b] NULL: query b has no keys in this run.
   sc: QBLOCK x G x (KCHUNK + 16) floats, kb: 32 x d. */
#define KCHUNK 256
#define QBLOCK 8

/* Lane sums of 8 vectors, as one vector: lane i = ((t_i0 + t_i1) + (t_i2 + t_i3)) + ((t_i4 + t_i5) + (t_i6 + t_i7)). */
static inline __m256 sum8(const __m256* t) {
  const __m256 a = _mm256_hadd_ps(t[0], t[1]), b = _mm256_hadd_ps(t[2], t[3]);
  const __m256 c = _mm256_hadd_ps(t[4], t[5]), e = _mm256_hadd_ps(t[6], t[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), ce = _mm256_hadd_ps(c, e);
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, ce, 0x20), _mm256_permute2f128_ps(ab, ce, 0x31));
}

/* q . k for 8 keys kb (d a multiple of 8; kb holds them interleaved: [d / 8][8 keys][8]): per key 8 lanes of
   products summed over the d / 8 blocks in order (one multiply-add each), then the lanes folded as sum8 folds them. */
static inline __m256 dots8(const float* q, const float* kb, int64_t d) {
  __m256 t[8];
  for (int i = 0; i < 8; i++) t[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) {
    const __m256 qv = _mm256_loadu_ps(q + j);
    const float* k = kb + j * 8;
    for (int i = 0; i < 8; i++) t[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 8 * i), t[i]);
  }
  return sum8(t);
}

/* Keys live[i0 .. i0 + 8) of a cache (kind: its dtype) as floats into kb, interleaved for dots8; keys past n zero. */
static void keys8(const void* cache, const int32_t* live, int64_t i0, int64_t n, int64_t d, int64_t kind, float* kb) {
  for (int64_t i = 0; i < 8; i++) {
    const int64_t at = i0 + i < n ? (int64_t)live[i0 + i] * d : -1;
    for (int64_t j = 0; j < d; j += 8)
      _mm256_storeu_ps(kb + j * 8 + i * 8, at >= 0 ? kv8(cache, at + j, kind) : _mm256_setzero_ps());
  }
}

/* Values live[i0 .. i0 + count) of a cache as floats into vb [count][d]. */
static void values_f32(const void* cache, const int32_t* live, int64_t i0, int64_t count, int64_t d, int64_t kind,
                       float* vb) {
  for (int64_t i = 0; i < count; i++) {
    const int64_t at = (int64_t)live[i0 + i] * d;
    for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(vb + i * d + j, kv8(cache, at + j, kind));
  }
}

/* o [w8 x 8] (w8 <= 8) += sum over the keys i < count in order of p[i] v_i, v_i = vb + i * d. */
static inline __attribute__((always_inline)) void weigh_n(float* out, int first, const float* p, const float* vb,
                                                          int32_t count, int64_t d, int64_t w8) {
  __m256 o[8];
  for (int64_t j = 0; j < w8; j++) o[j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + 8 * j);
  for (int32_t i = 0; i < count; i++) {
    const __m256 pv = _mm256_set1_ps(p[i]);
    for (int64_t j = 0; j < w8; j++) o[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vb + i * d + 8 * j), o[j]);
  }
  for (int64_t j = 0; j < w8; j++) _mm256_storeu_ps(out + 8 * j, o[j]);
}

/* The common case (64 dimensions) with constant bounds, so the sums stay in registers. */
static void weigh(float* out, int first, const float* p, const float* vb, int32_t count, int64_t d, int64_t w8) {
  if (w8 == 8) weigh_n(out, first, p, vb, count, d, 8);
  else weigh_n(out, first, p, vb, count, d, w8);
}

static void attend_block(const float* q, int64_t ldq, int64_t B, int64_t G, const void* K, const void* V,
                         int64_t kind, const int32_t* live, const int32_t* n, const int32_t* lo,
                         const float* const* mrow, int64_t d, float scale, float cap, float* sc, float* kb,
                         float* const* part) {
  const int64_t stride = KCHUNK + 16;
  int32_t nmax = 0;
  float* empty[QBLOCK];  /* queries whose window starts past this run: an empty part, nothing attended here */
  float* used[QBLOCK];
  for (int64_t b = 0; b < B; b++) {
    const int none = part[b] && lo[b] >= n[b];
    empty[b] = none ? part[b] : NULL;
    used[b] = none ? NULL : part[b];
    nmax = used[b] && n[b] > nmax ? n[b] : nmax;
  }
  for (int64_t b = 0; b < B; b++) {
    if (!empty[b]) continue;
    memset(empty[b], 0, G * d * sizeof(float));
    for (int64_t h = 0; h < G; h++) empty[b][G * d + h] = -INFINITY, empty[b][G * d + G + h] = 0.0f;
  }
  part = used;
  __m256 top[QBLOCK * 16];
  for (int64_t v = 0; v < B * G; v++) top[v] = _mm256_set1_ps(-INFINITY);
  const __m256 sv = _mm256_set1_ps(scale), lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 capv = _mm256_set1_ps(cap);
  for (int32_t i0 = 0; i0 < nmax; i0 += 8) {
    keys8(K, live, i0, nmax, d, kind, kb);
    for (int64_t b = 0; b < B; b++) {
      if (!part[b] || i0 >= n[b] || i0 + 8 <= lo[b]) {
        if (part[b] && i0 < n[b])  /* all 8 keys before the query's window */
          for (int64_t h = 0; h < G; h++) _mm256_storeu_ps(sc + (b * G + h) * stride + i0, _mm256_set1_ps(-INFINITY));
        continue;
      }
      float m[8];
      for (int i = 0; i < 8; i++) m[i] = i0 + i < n[b] ? mrow[b][live[i0 + i]] : 0.0f;
      const __m256 mv = _mm256_loadu_ps(m);
      const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(lanes, _mm256_set1_ps((float)(n[b] - i0)), _CMP_LT_OQ),
                                        _mm256_cmp_ps(lanes, _mm256_set1_ps((float)(lo[b] - i0)), _CMP_GE_OQ));
      for (int64_t h = 0; h < G; h++) {
        __m256 s;
        if (cap > 0.0f)  /* Gemma 2: cap tanh(score / cap), then the mask */
          s = _mm256_add_ps(_mm256_mul_ps(capv, tanh8(_mm256_div_ps(_mm256_mul_ps(dots8(q + b * ldq + h * d, kb, d),
                                                                                 sv), capv))), mv);
        else
          s = _mm256_fmadd_ps(dots8(q + b * ldq + h * d, kb, d), sv, mv);
        s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, seen);
        _mm256_storeu_ps(sc + (b * G + h) * stride + i0, s);
        top[b * G + h] = _mm256_max_ps(top[b * G + h], s);
      }
    }
  }
  for (int64_t b = 0; b < B; b++) {
    if (!part[b]) continue;
    const int32_t n16 = (n[b] + 15) & ~15;
    for (int64_t h = 0; h < G; h++) {
      float* row = sc + (b * G + h) * stride;
      float t8[8];
      _mm256_storeu_ps(t8, top[b * G + h]);
      float top1 = t8[0];
      for (int i = 1; i < 8; i++) top1 = t8[i] > top1 ? t8[i] : top1;
      for (int32_t i = n[b]; i < n16; i++) row[i] = -INFINITY;
      part[b][G * d + h] = top1;
      part[b][G * d + G + h] = exp_row(row, n16, top1);
    }
  }
  /* outputs: per query and head, 64 dimensions at a time in 8 registers, over the keys in order; the values of
     32 keys at a time converted once for the block */
  for (int32_t i0 = 0; i0 == 0 || i0 < nmax; i0 += 32) {
    const int32_t span = nmax - i0 < 32 ? nmax - i0 : 32;
    if (span > 0) values_f32(V, live, i0, span, d, kind, kb);
    for (int64_t b = 0; b < B; b++) {
      if (!part[b] || (i0 && i0 >= n[b])) continue;
      const int32_t end = n[b] - i0 < 32 ? n[b] - i0 : 32;
      for (int64_t h = 0; h < G; h++)
        for (int64_t jb = 0; jb < d; jb += 64)
          weigh(part[b] + h * d + jb, i0 == 0, sc + (b * G + h) * stride + i0, kb + jb, end, d,
                (d - jb < 64 ? d - jb : 64) / 8);
    }
  }
}

/* A query's parts (`attend_block`, in key order) combined: out = sum_c e_c o_c / sum_c e_c s_c with
   e_c = exp(top_c - max top), part after part. One part: e = 1 exactly. */
static void merge(const float* parts, int64_t count, int64_t G, int64_t d, float* out) {
  const int64_t size = G * (d + 2);
  for (int64_t h = 0; h < G; h++) {
    float top = -INFINITY;
    for (int64_t c = 0; c < count; c++) top = parts[c * size + G * d + h] > top ? parts[c * size + G * d + h] : top;
    if (top == -INFINITY) { memset(out + h * d, 0, d * sizeof(float)); continue; }  /* no key: nothing seen */
    v16 o[16];
    for (int64_t j = 0; j < d / 16; j++) o[j] = splat(0.0f);
    float total = 0.0f;
    for (int64_t c = 0; c < count; c++) {
      const float* part = parts + c * size;
      const float e = expf(part[G * d + h] - top);
      total += e * part[G * d + G + h];
      for (int64_t j = 0; j < d / 16; j++) o[j] += splat(e) * load16(part + h * d + 16 * j);
    }
    const v16 inv = splat(total > 0.0f ? 1.0f / total : 0.0f);
    for (int64_t j = 0; j < d / 16; j++) store16(out + h * d + 16 * j, o[j] * inv);
  }
}

/* Every decoder layer over N tokens: x [N, hidden] (the residual stream, updated in place). Token t belongs
   to cache row row[t], is written at column col[t], and attends with mask row mask + mrow[t] * Lk (additive;
   -FLT_MAX or -inf: not attended). keys[l] / values[l]: layer l's cache [rows, kv_heads, cap, head_dim], in
   D->kv_kind. cos / ssin: [rope sets][N][rot_dim] (a layer's `rope` picks its set: Gemma 3's local layers rotate
   with another base).
   states (or NULL): x after each layer [layers, N, hidden]; final_norm (or NULL): the model's last RMSNorm,
   applied to x after the last layer (after its state is copied). work: float scratch (cpu_decoder.py sizes it);
   live: int32 [N, Lk + 1]; first: int64 [2 N + 2], items: int64 [N x kv heads x runs], parts: float [N x kv heads
   x runs x group x (head_dim + 2)], with runs = Lk / KCHUNK + 1 at most per token (attention's key runs). */
void decoder_forward(const struct dims* D, const struct layer* layers, int64_t n_layers, void* const* keys,
                     void* const* values, int64_t cap, float* x, int64_t N, const float* cos, const float* ssin,
                     const int64_t* row, const int64_t* col, const int64_t* mrow, const float* mask, int64_t Lk,
                     float* states, const float* final_norm, float* work, int32_t* live, int64_t* first,
                     int64_t* items, float* parts, int threads) {
  const int64_t H = D->hidden, d = D->head_dim, nh = D->heads, nkv = D->kv_heads, group = nh / nkv, qd = nh * d;
  const int64_t wide = D->o_ld > D->down_ld ? D->o_ld : D->down_ld, rd = D->rot_dim;
  float* h = work;
  float* qkv = h + N * H;
  float* att = qkv + N * D->qkv_ld;
  float* o = att + N * qd;
  float* gu = o + N * wide;
  float* act = gu + N * D->gu_ld;
  const int64_t widest = D->inter > qd ? (D->inter > H ? D->inter : H) : (qd > H ? qd : H);
  float* xs = act + N * D->inter;  /* [N, scratch_floats(widest)]: `prepare_row`'s */
  /* per thread: attend_block's sc [QBLOCK][group][KCHUNK + 16] and kb [32][d] */
  float* scores = xs + N * scratch_floats(widest);
  int32_t* count = live + N * Lk;
  int64_t* block = first + N + 1;  /* attention's query blocks: block b is tokens block[b] .. block[b + 1] - 1 */
  int64_t n_items = 0;
  #pragma omp parallel num_threads(threads)
  {
    float* sc = scores + (int64_t)omp_get_thread_num() * (QBLOCK * group * (KCHUNK + 16) + 32 * d);
    float* kb = sc + QBLOCK * group * (KCHUNK + 16);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < N; t++) {
      const float* m = mask + mrow[t] * Lk;
      int32_t n = 0;
      for (int64_t c = 0; c < Lk; c++) if (m[c] > -FLT_MAX) live[t * Lk + n++] = (int32_t)c;
      count[t] = n;
    }
    /* attention's work: per token its live keys in runs of KCHUNK (at least one run; `first`: where its parts
       start), so that a long context's keys are shared out between threads the same way whatever else the call
       holds. Consecutive tokens of one row whose live keys extend each other's (a prompt chunk, a verify pass)
       form blocks of up to QBLOCK queries that read each key once; a work item is a block's run for one KV head. */
    #pragma omp single
    {
      first[0] = 0;
      for (int64_t t = 0; t < N; t++) first[t + 1] = first[t] + (count[t] + KCHUNK - 1) / KCHUNK + (count[t] == 0);
      int64_t blocks = 0;
      for (int64_t t = 0; t < N; t++) {
        const int joins = blocks && t - block[blocks - 1] < QBLOCK && row[t] == row[t - 1] &&
                          count[t - 1] <= count[t] &&
                          !memcmp(live + (t - 1) * Lk, live + t * Lk, (size_t)count[t - 1] * sizeof(int32_t));
        if (!joins) block[blocks++] = t;
      }
      block[blocks] = N;
      for (int64_t b = 0; b < blocks; b++) {
        const int64_t last = block[b + 1] - 1;
        for (int64_t g = 0; g < nkv; g++)
          for (int64_t c = 0; c < first[last + 1] - first[last]; c++) items[n_items++] = (b * nkv + g) << 20 | c;
      }
    }
    for (int64_t l = 0; l < n_layers; l++) {
      const struct layer* L = layers + l;
      const float* lcos = cos + L->rope * N * rd;
      const float* lsin = ssin + L->rope * N * rd;
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < N; r++) rms_row(x + r * H, L->attn_in, h + r * H, H, D->eps);
      gemm_in(&L->qkv, h, N, xs, qkv, D->qkv_ld);
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < N; t++) {
        float* y = qkv + t * D->qkv_ld;
        for (int64_t i = 0; i < nh; i++) {
          if (L->q_norm) rms_row(y + i * d, L->q_norm, y + i * d, d, D->eps);
          rope(y + i * d, lcos + t * rd, lsin + t * rd, rd);
        }
        for (int64_t g = 0; g < nkv; g++) {
          float* k = y + D->k_off + g * d;
          if (L->k_norm) rms_row(k, L->k_norm, k, d, D->eps);
          rope(k, lcos + t * rd, lsin + t * rd, rd);
          const int64_t at = ((row[t] * nkv + g) * cap + col[t]) * d;
          put_kv(keys[l], at, k, d, D->kv_kind);
          put_kv(values[l], at, y + D->v_off + g * d, d, D->kv_kind);
        }
      }
      #pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < n_items; it++) {
        const int64_t bg = items[it] >> 20, c = items[it] & ((1 << 20) - 1), g = bg % nkv;
        const int64_t t0 = block[bg / nkv], B = block[bg / nkv + 1] - t0;
        const int64_t base = (row[t0] * nkv + g) * cap * d * (D->kv_kind ? 2 : 4), start = c * KCHUNK;
        int32_t n[QBLOCK], lo[QBLOCK];
        const float* mr[QBLOCK];
        float* part[QBLOCK];
        for (int64_t b = 0; b < B; b++) {
          const int64_t t = t0 + b, runs = first[t + 1] - first[t];
          const int64_t left = count[t] - start;
          n[b] = left <= 0 ? 0 : left < KCHUNK ? (int32_t)left : KCHUNK;
          /* a window: the query's last `window` live keys (itself the last), from this run's first on */
          const int64_t from = L->window ? count[t] - L->window - start : 0;
          lo[b] = from <= 0 ? 0 : from > KCHUNK ? KCHUNK : (int32_t)from;
          mr[b] = mask + mrow[t] * Lk;
          part[b] = c < runs ? parts + (first[t] * nkv + g * runs + c) * group * (d + 2) : NULL;
        }
        attend_block(qkv + t0 * D->qkv_ld + g * group * d, D->qkv_ld, B, group, (const char*)keys[l] + base,
                     (const char*)values[l] + base, D->kv_kind, live + (t0 + B - 1) * Lk + start, n, lo, mr, d,
                     D->scale, D->softcap, sc, kb, part);
      }
      #pragma omp for schedule(static)
      for (int64_t tg = 0; tg < N * nkv; tg++) {
        const int64_t t = tg / nkv, g = tg % nkv, runs = first[t + 1] - first[t];
        merge(parts + (first[t] * nkv + g * runs) * group * (d + 2), runs, group, d, att + t * qd + g * group * d);
      }
      gemm_in(&L->o, att, N, xs, o, D->o_ld);
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < N; r++) {
        float* y = o + r * D->o_ld;
        if (L->attn_out) rms_row(y, L->attn_out, y, H, D->eps);
        for (int64_t i = 0; i < H; i += 16) store16(x + r * H + i, load16(x + r * H + i) + load16(y + i));
        rms_row(x + r * H, L->ffn_in, h + r * H, H, D->eps);
      }
      gemm_in(&L->gate_up, h, N, xs, gu, D->gu_ld);
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < N; r++) {
        if (D->act) gelu_mul(gu + r * D->gu_ld, gu + r * D->gu_ld + D->u_off, act + r * D->inter, D->inter);
        else silu_mul(gu + r * D->gu_ld, gu + r * D->gu_ld + D->u_off, act + r * D->inter, D->inter);
      }
      gemm_in(&L->down, act, N, xs, o, D->down_ld);
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < N; r++) {
        float* y = o + r * D->down_ld;
        if (L->ffn_out) rms_row(y, L->ffn_out, y, H, D->eps);
        for (int64_t i = 0; i < H; i += 16) store16(x + r * H + i, load16(x + r * H + i) + load16(y + i));
        if (states) memcpy(states + (l * N + r) * H, x + r * H, H * sizeof(float));
        if (final_norm && l == n_layers - 1) rms_row(x + r * H, final_norm, x + r * H, H, D->eps);
      }
    }
  }
}
