"""Float32 CPU kernels for GGUF block weights, compiled on the host at first use (quantized.py calls them).

torch's int4 kernel (the other way quantized.py multiplies) rounds activations and outputs to bfloat16, so a
model on it must attend in float64 to keep greedy text independent of a pass's width (attention.py), and it
dequantizes the weights again for every block of 4 rows. The kernel here takes and gives float32: with w = s q + m
(Q4_0 / Q4_1: q in [0, 15], Q8_0: q in [-128, 127], m = 0), each output sums, per group of 32 inputs, s times
the group's sum of x q (four interleaved chains, k mod 4, combined as (c0 + c1) + (c2 + c3)) plus m times the
group's sum of x (computed once per row and call), in float32, group after group: the scale and minimum are
applied once per group instead of once per weight. The same operations in the same order whatever rows share
the call and however many threads split the outputs, so a row's result is the same bits alone or in any batch
(tests check it). The quantized values are decoded once per tile of 16 outputs and applied to 4 rows at a time
(then 2, 1).

Measured on the 2-core development machine (AMD EPYC, AVX-512, 2 threads; docs/bench-journal.md): 3072 x 576 at
8 / 32 / 128 / 512 rows 0.15 / 0.56 / 2.2 / 9.0 ms, 94-103 GMAC/s, as fast as MKL's float32 GEMM on dense
weights from 128 rows on (88-90 GMAC/s) and 2x it at 8 rows; torch's int4 kernel was 1.5-2x slower at every
row count. An AVX2 host (AMD EPYC without AVX-512, 2 cores) has its own loops (the 512-bit vectors of the
AVX-512 ones would live on the stack there: 5 GMAC/s): per group of 32 inputs a tile's values are decoded once
into L1 and every row runs over them, 3072 x 576 at 1 / 4 / 17 / 128 rows 18 / 40 / 43 / 54 GMAC/s, the Q8_0
head 23 / 46 / 52 / 55 (a one-token step of SmolLM2-135M 12.4 -> 8.0 ms, a 17-token verify pass at 300 tokens
of context 128 -> 58 ms). Float16 weights (`Tiles.f16`, an fp16 embedding table as the LM head) run the same
loops, unscaled.

On such a host a product is bound by float arithmetic, not bytes: decoding the 4-bit values to floats costs more
than the multiply-add. There Q4 and Q8 blocks take int8 activations (`KIND_Q4_INT8`, `KIND_Q8_INT8`,
`int8_activations`; `SPECULA_INT8_ACTIVATIONS=0` / `1` decides): each row's inputs rounded per group of 32 to int8
with the scale max|x| / 127 (llama.cpp's Q8_1 and Q8_0 for its Q4_1 and Q8_0 products), multiplied by the
weights' values in integers (exact), each group's sum scaled once, Q4's minimum term on the float sum of the
inputs. Per row, so a row's result is still the same bits in any batch; each input is off by at most half its
group's step (`activation_error`). In-process on the AVX2 host, float32 against int8 activations: 3072 x 576 Q4
at 1 / 4 / 17 / 128 rows 18-20 / 40 / 38-51 / 50 against 37 / 77-79 / 80-98 / 104-107 GMAC/s (since the Q4 tile
takes 4 inputs an instruction, unpacked once per 3 rows: 4 / 17 / 128 rows on one thread 57 / 68-71 / 68-69
against the earlier 46 / 52 / 55, on two 70-101 / 85-131 / 134); the 49152 x 576
Q8_0 head at 1 / 5 / 17 rows 21 / 48 / 54 against 31 / 65 / 85; a one-token step of SmolLM2-135M at 300 tokens
of context 8.6-9.9 against 6.0-6.2 ms, a 17-token verify pass 55-62 against 34-35 ms. AVX-512 hosts keep float32
activations (their float loops reached 94-103 GMAC/s there and keep the inputs exact; int8 is not measured there).

`decoder_forward` runs a whole Llama decoder stack on these kernels in one call (cpu_decoder.py says how).

Built with the host's C compiler (`CC`, default `cc`; `-O3 -march=native -fopenmp`, AVX2 or AVX-512 needed)
into `kernels/` under the server's `cache_dir` (`~/.cache/specula/kernels/` by default; `SPECULA_KERNEL_DIR`
wins) under a name hashed from the source, the compiler, the flags and this CPU's model and flags (a library
built for another CPU is never loaded), written to a temporary file and renamed into place. OpenMP resolves
to the libgomp torch already loaded, so both share one thread pool; a call uses torch's current thread count.
The library is checked against a reference product once when loaded. Any failure (no compiler, no AVX2, a
wrong probe) leaves `library()` None and quantized.py on torch's kernel; `SPECULA_CPU_KERNELS=0` asks for that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TILE = 16  # outputs a tile holds (one 512-bit vector of float32)
KIND_Q4, KIND_Q4_INT8, KIND_Q8, KIND_Q8_INT8, KIND_F16 = 4, 5, 8, 9, 16  # the kernels' kinds (on float32 or int8
# activations)
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
typedef float v16 __attribute__((vector_size(64)));
#if defined(__AVX512F__)
static inline v16 nib_lo(const uint8_t* p) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  return (v16)_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
}
static inline v16 nib_hi(const uint8_t* p) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  return (v16)_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
static inline v16 sbyte(const uint8_t* p) {
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline v16 half16(const uint8_t* p) { return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(__AVX2__)
static inline v16 join(__m256 a, __m256 b) { v16 r; memcpy(&r, &a, 32); memcpy((char*)&r + 32, &b, 32); return r; }
static inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256i s8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline v16 nib_lo(const uint8_t* p) {
  __m256i m = _mm256_set1_epi32(15);
  return join(_mm256_cvtepi32_ps(_mm256_and_si256(u8x8(p), m)), _mm256_cvtepi32_ps(_mm256_and_si256(u8x8(p + 8), m)));
}
static inline v16 nib_hi(const uint8_t* p) {
  return join(_mm256_cvtepi32_ps(_mm256_srli_epi32(u8x8(p), 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(u8x8(p + 8), 4)));
}
static inline v16 sbyte(const uint8_t* p) { return join(_mm256_cvtepi32_ps(s8x8(p)), _mm256_cvtepi32_ps(s8x8(p + 8))); }
static inline v16 half16(const uint8_t* p) {
  const __m128i lo = _mm_loadu_si128((const __m128i*)p), hi = _mm_loadu_si128((const __m128i*)(p + 16));
  return join(_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi));
}
#else
#error "the float kernels need AVX2 or AVX-512"
#endif

static inline v16 load16(const float* p) { v16 r; memcpy(&r, p, 64); return r; }

/* The quantized values (as floats, unscaled) of 4 consecutive inputs k..k+3 of a tile's 16 outputs. Q4: byte j
   of the 16 at pair (k, k+1) holds q[k][j] in its low nibble and q[k+1][j] in its high one; Q8: 16 signed bytes
   per input; F16 (kind 16): 16 float16 values per input, the weights themselves (no scale). */
#define VALUES4(kind, q, k, w)                                                                          \
  if (kind == 4) {                                                                                      \
    const uint8_t* p = q + ((k) / 2) * 16;                                                              \
    w[0] = nib_lo(p); w[1] = nib_hi(p); w[2] = nib_lo(p + 16); w[3] = nib_hi(p + 16);                   \
  } else if (kind == 16) {                                                                              \
    const uint8_t* p = q + (k) * 32;                                                                    \
    w[0] = half16(p); w[1] = half16(p + 32); w[2] = half16(p + 64); w[3] = half16(p + 96);              \
  } else {                                                                                              \
    const uint8_t* p = q + (k) * 16;                                                                    \
    w[0] = sbyte(p); w[1] = sbyte(p + 16); w[2] = sbyte(p + 32); w[3] = sbyte(p + 48);                  \
  }

/* R rows of x [R, K] against one tile. Per group of 32 inputs and row: four chains (k mod 4) of x * q over the
   group's 8 inputs each, combined as (c0 + c1) + (c2 + c3) = t; then y += s t, and for Q4 y += m xs with xs the
   row's sum over the group (`group_sums`): w = s q + m summed as s (sum x q) + m (sum x), the scale and minimum
   applied once per group rather than once per weight. The same operations per row for every R, so a row's
   result does not depend on the block it falls in. */
#define ROWS(R)                                                                                         \
  static void rows##R(int kind, const float* x0, int64_t K, const uint8_t* q, const float* s,          \
                      const float* m, const float* xs, float* y, int64_t ldy) {                         \
    v16 a[R];                                                                                           \
    memset(a, 0, sizeof a);                                                                             \
    for (int64_t g = 0; g < K / 32; g++) {                                                              \
      v16 p[R][4];                                                                                      \
      memset(p, 0, sizeof p);                                                                           \
      for (int64_t k = g * 32; k < g * 32 + 32; k += 4) {                                               \
        v16 w[4];                                                                                       \
        VALUES4(kind, q, k, w)                                                                          \
        for (int r = 0; r < R; r++)                                                                     \
          for (int c = 0; c < 4; c++) p[r][c] += x0[r * K + k + c] * w[c];                              \
      }                                                                                                 \
      if (kind == 16) {                                                                                 \
        for (int r = 0; r < R; r++) a[r] += (p[r][0] + p[r][1]) + (p[r][2] + p[r][3]);                  \
        continue;                                                                                       \
      }                                                                                                 \
      const v16 sg = load16(s + g * 16);                                                                \
      for (int r = 0; r < R; r++) a[r] += sg * ((p[r][0] + p[r][1]) + (p[r][2] + p[r][3]));            \
      if (kind == 4) {                                                                                  \
        const v16 mg = load16(m + g * 16);                                                              \
        for (int r = 0; r < R; r++) a[r] += mg * xs[r * (K / 32) + g];                                  \
      }                                                                                                 \
    }                                                                                                   \
    for (int r = 0; r < R; r++) memcpy(y + r * ldy, &a[r], 64);                                         \
  }
#if defined(__AVX512F__)
ROWS(4)
ROWS(2)
ROWS(1)

/* One tile's 16 outputs for all M rows: blocks of 4 rows (the values decoded once per block), then 2, 1. */
static void tile(int kind, const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s,
                 const float* m, const float* xs, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) rows4(kind, x + r * K, K, q, s, m, xs + r * G, y + r * ldy, ldy);
  if (M - r >= 2) { rows2(kind, x + r * K, K, q, s, m, xs + r * G, y + r * ldy, ldy); r += 2; }
  if (M - r >= 1) rows1(kind, x + r * K, K, q, s, m, xs + r * G, y + r * ldy, ldy);
}
#else
/* AVX2 has 16 registers of 8 floats: the 512-bit vectors of the loop above would live on the stack (measured
   here: 20x slower). `tile` below keeps a row's four chains for both halves of a tile's 16 outputs in 8 registers.
   Per row and output the same operations as above: chains k mod 4 of x q, (c0 + c1) + (c2 + c3), then s t, then
   m xs. `values8`: 8 outputs' values (half h) of input k + c, as floats. */
static inline __m256 values8(int kind, const uint8_t* q, int64_t k, int c, int h) {
  if (kind == 4) {  /* inputs k, k + 1 share pair k / 2; k is a multiple of 4 */
    const __m256i v = u8x8(q + ((k + c) / 2) * 16 + 8 * h);
    return _mm256_cvtepi32_ps(c & 1 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15)));
  }
  if (kind == 16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(q + (k + c) * 32 + 16 * h)));
  return _mm256_cvtepi32_ps(s8x8(q + (k + c) * 16 + 8 * h));
}

/* One tile's 16 outputs for all M rows. Per group of 32 inputs the tile's values are decoded once (into wb, in
   L1), then each row's four chains (k mod 4) run over the group for both halves of 8 outputs: 8 registers of
   sums, one broadcast of x feeding two multiply-adds. The row's results live in y between groups. */
static void tile(int kind, const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s,
                 const float* m, const float* xs, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  float wb[32 * 16] __attribute__((aligned(32)));
  for (int64_t g = 0; g < G; g++) {
    for (int64_t k = g * 32; k < g * 32 + 32; k += 4)
      for (int c = 0; c < 4; c++)
        for (int h = 0; h < 2; h++) _mm256_store_ps(wb + (k - g * 32 + c) * 16 + 8 * h, values8(kind, q, k, c, h));
    const __m256 s0 = kind == 16 ? _mm256_setzero_ps() : _mm256_loadu_ps(s + g * 16);  /* F16: no scale */
    const __m256 s1 = kind == 16 ? _mm256_setzero_ps() : _mm256_loadu_ps(s + g * 16 + 8);
    for (int64_t r = 0; r < M; r++) {
      const float* xr = x + r * K + g * 32;
      __m256 p[4][2];
      for (int c = 0; c < 4; c++) p[c][0] = p[c][1] = _mm256_setzero_ps();
      for (int kk = 0; kk < 32; kk += 4)
        for (int c = 0; c < 4; c++) {
          const __m256 b = _mm256_set1_ps(xr[kk + c]);
          p[c][0] = _mm256_fmadd_ps(b, _mm256_load_ps(wb + (kk + c) * 16), p[c][0]);
          p[c][1] = _mm256_fmadd_ps(b, _mm256_load_ps(wb + (kk + c) * 16 + 8), p[c][1]);
        }
      float* yr = y + r * ldy;
      __m256 a[2];
      for (int h = 0; h < 2; h++) {
        const __m256 t = _mm256_add_ps(_mm256_add_ps(p[0][h], p[1][h]), _mm256_add_ps(p[2][h], p[3][h]));
        const __m256 prev = g ? _mm256_loadu_ps(yr + 8 * h) : _mm256_setzero_ps();
        a[h] = kind == 16 ? _mm256_add_ps(prev, t) : _mm256_fmadd_ps(h ? s1 : s0, t, prev);
        if (kind == 4)
          a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(m + g * 16 + 8 * h), _mm256_set1_ps(xs[r * G + g]), a[h]);
        _mm256_storeu_ps(yr + 8 * h, a[h]);
      }
    }
  }
}
#endif

/* Q4 products on int8 activations (kind 5, KIND_Q4_INT8 in Python; AVX2 instructions, which AVX-512 hosts have
   too). Each row's activations are rounded to int8 per group of 32 (`quantize_row`: dx = max|x| / 127, xq = x / dx
   to nearest even), then _mm256_maddubs_epi16 multiplies a tile's 4 values (q[k..k+3][j]) of 8 outputs by the
   row's 4 inputs (xq[k..k+3]) in pairs: 32 multiply-adds an instruction where the float loops do 8 (as llama.cpp's
   Q4_1 x Q8_1 dot product does). Per group: summed in 16 bits (exact, `group_q4i`), each output's two lanes added
   in 32 bits, then y += (s dx) t + m xs in float32, with xs the float sum of the group's inputs (group_sums, as
   kind 4 uses it). All of it per row: a row's result is the same bits in any batch. */
static void quantize_row(const float* x, int64_t K, float* dx, int8_t* xq) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < K / 32; g++) {
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(x + g * 32 + 8 * i);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
    }
    float t[8];
    _mm256_storeu_ps(t, top);
    float amax = t[0];
    for (int i = 1; i < 8; i++) amax = t[i] > amax ? t[i] : amax;
    dx[g] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i*)(xq + g * 32), _mm256_permutevar8x32_epi32(packed, order));
  }
}

/* 4 int8 inputs at p, repeated over 8 lanes of 32 bits (a broadcast load). */
static inline __m256i quad(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

/* The int8 products of R rows' groups with one tile's group (R a constant where it is inlined; 3 rows keep their
   6 sums and the weights in AVX2's 16 registers, 4 spilled two to the stack). Per 4 inputs u a tile holds 32
   bytes, byte 4j + e holding q[4u + e][j] (low nibble) and q[4u + e][j + 8] (high) (Tiles.q4). One unpacking of
   a quad feeds every row: with a row's 4 inputs broadcast (a load, no shuffle), _mm256_maddubs_epi16 multiplies
   each output's 4 weights by them in pairs, 32 multiply-adds an instruction, summed in 16 bits over the group
   (at most 8 x 2 x 15 x 127 = 30,480: exact). lo[r] holds outputs 0-7, hi[r] outputs 8-15, two lanes each. */
static inline __attribute__((always_inline)) void group_q4i(const int R, const uint8_t* q, const int8_t* xp,
                                                            int64_t ldx, __m256i* lo, __m256i* hi) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
  #pragma GCC unroll 1
  for (int u = 0; u < 8; u++) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + u * 32));
    const __m256i wl = _mm256_and_si256(v, low);
    for (int r = 0; r < R; r++) lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(wl, quad(xp + r * ldx + 4 * u)));
    const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    for (int r = 0; r < R; r++) hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(wh, quad(xp + r * ldx + 4 * u)));
  }
}

/* A group's integer sums into float32: each output's two 16-bit lanes added in 32 bits (exact), then
   acc += (s dx) t + m xs for both halves of 16 outputs. */
static inline void scale_q4i(__m256i lo, __m256i hi, float dx, float xs, const float* s, const float* m,
                             __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 d = _mm256_set1_ps(dx), sum = _mm256_set1_ps(xs);
  const __m256 t0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(lo, ones));
  const __m256 t1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(hi, ones));
  acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(m), sum, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s), d), t0, acc[0]));
  acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(m + 8), sum,
                           _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + 8), d), t1, acc[1]));
}

/* Group g of R rows from row r0 on (R a constant where it is inlined), their sums so far in y. */
static inline __attribute__((always_inline)) void rows_q4i(const int R, int64_t r0, int64_t g, int64_t M, int64_t K,
                                                           const uint8_t* q, const float* s, const float* m,
                                                           const float* xs, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  const float* dx = xs + M * G;
  const int8_t* xq = (const int8_t*)(xs + 2 * M * G);
  __m256i lo[3], hi[3];
  group_q4i(R, q + g * 256, xq + r0 * K + g * 32, K, lo, hi);
  for (int r = 0; r < R; r++) {
    float* yr = y + (r0 + r) * ldy;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if (g) acc[0] = _mm256_loadu_ps(yr), acc[1] = _mm256_loadu_ps(yr + 8);
    scale_q4i(lo[r], hi[r], dx[(r0 + r) * G + g], xs[(r0 + r) * G + g], s + g * 16, m + g * 16, acc);
    _mm256_storeu_ps(yr, acc[0]);
    _mm256_storeu_ps(yr + 8, acc[1]);
  }
}

/* One tile's 16 outputs for all M rows, kind 5: xs holds the rows' group sums [M, K/32], then their scales dx
   [M, K/32], then their int8 values [M, K] (`prepare_row`). One row (a decoding step) keeps its sums in registers
   over the groups; more rows take each group in blocks of up to 3 rows, one unpacking of the weights for a block,
   and leave their sums in y between groups: the same operations per row either way. */
static void tile_q4i(int64_t M, int64_t K, const uint8_t* q, const float* s, const float* m, const float* xs,
                     float* y, int64_t ldy) {
  const int64_t G = K / 32;
  if (M == 1) {
    const float* dx = xs + G;
    const int8_t* xq = (const int8_t*)(xs + 2 * G);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < G; g++) {
      __m256i lo, hi;
      group_q4i(1, q + g * 256, xq + g * 32, K, &lo, &hi);
      scale_q4i(lo, hi, dx[g], xs[g], s + g * 16, m + g * 16, acc);
    }
    _mm256_storeu_ps(y, acc[0]);
    _mm256_storeu_ps(y + 8, acc[1]);
    return;
  }
  for (int64_t g = 0; g < G; g++)
    for (int64_t r0 = 0; r0 < M; r0 += 3) {
      const int64_t n = M - r0;
      if (n >= 3) rows_q4i(3, r0, g, M, K, q, s, m, xs, y, ldy);
      else if (n == 2) rows_q4i(2, r0, g, M, K, q, s, m, xs, y, ldy);
      else rows_q4i(1, r0, g, M, K, q, s, m, xs, y, ldy);
    }
}

/* Q8 products on int8 activations (kind 9, KIND_Q8_INT8): per 4 inputs k..k+3 a tile holds 64 bytes, for each of
   its 16 outputs j the 4 values q[k..k+3][j] side by side. _mm256_maddubs_epi16 multiplies |q| by xq given q's
   sign (llama.cpp's trick: at most 2 x 128 x 127 in 16 bits, exact), _mm256_madd_epi16 adds each output's two
   halves in 32 bits: 32 multiply-adds in five instructions. Summed over the group (exact), then y += (s dx) t. */
static inline void group_q8i(const uint8_t* q, const int8_t* xp, float dx, const float* s, __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
  for (int u = 0; u < 8; u++) {
    const __m256i x = quad(xp + 4 * u);
    const __m256i a = _mm256_loadu_si256((const __m256i*)(q + u * 64));
    const __m256i b = _mm256_loadu_si256((const __m256i*)(q + u * 64 + 32));
    const __m256i pa = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(x, a));
    const __m256i pb = _mm256_maddubs_epi16(_mm256_abs_epi8(b), _mm256_sign_epi8(x, b));
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(pa, ones));
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(pb, ones));
  }
  const __m256 d = _mm256_set1_ps(dx);
  acc[0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s), d), _mm256_cvtepi32_ps(lo), acc[0]);
  acc[1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + 8), d), _mm256_cvtepi32_ps(hi), acc[1]);
}

/* One tile's 16 outputs for all M rows, kind 9 (xs as for kind 5: `prepare_row`): a row's sums kept in registers
   over the groups, the same operations per row for any M. */
static void tile_q8i(int64_t M, int64_t K, const uint8_t* q, const float* s, const float* xs, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  const float* dx = xs + M * G;
  const int8_t* xq = (const int8_t*)(xs + 2 * M * G);
  for (int64_t r = 0; r < M; r++) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < G; g++) group_q8i(q + g * 512, xq + r * K + g * 32, dx[r * G + g], s + g * 16, acc);
    _mm256_storeu_ps(y + r * ldy, acc[0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[1]);
  }
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

/* Bytes of one tile's values over K inputs: Q4 half a byte a weight, Q8 one, F16 two (16 outputs each). */
static inline int64_t tile_bytes(int64_t kind, int64_t K) {
  return kind == 4 || kind == 5 ? K / 2 * 16 : kind == 16 ? K * 32 : K * 16;  /* Q8: kinds 8 and 9 */
}

/* What a Q4 product needs of row r of x [M, K] (every row's, before any tile): its group sums xs [M, K/32] and,
   on int8 activations (kind 5), its scales after them [M, K/32] and its int8 values after those [M, K] bytes. */
static void prepare_row(int kind, const float* x, int64_t M, int64_t K, float* xs, int64_t r) {
  const int64_t G = K / 32;
  if (kind != 9) group_sums(x + r * K, K, xs + r * G);  /* Q4's minimum term */
  if (kind == 5 || kind == 9) quantize_row(x + r * K, K, xs + M * G + r * G, (int8_t*)(xs + 2 * M * G) + r * K);
}

/* One tile's outputs for all M rows, by kind. */
static inline void tile_of(int kind, const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s,
                           const float* m, const float* xs, float* y, int64_t ldy) {
  if (kind == 5) tile_q4i(M, K, q, s, m, xs, y, ldy);
  else if (kind == 9) tile_q8i(M, K, q, s, xs, y, ldy);
  else tile(kind, x, M, K, q, s, m, xs, y, ldy);
}

/* ---- the decoder stack of a Llama model on these weights, in one call (cpu_decoder.py) ---------------- */
#include <float.h>
#include <math.h>
#include <omp.h>
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 splat(float a) { v16 r = {a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; return r; }
static inline void store16(float* p, v16 v) { memcpy(p, &v, 64); }
static inline v16 pick(v16i m, v16 a, v16 b) { return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }

/* The 16 lanes' sum in one fixed order (halves folded 16 -> 8 -> 4 -> 2 -> 1). */
static inline float hsum(v16 v) {
  v8 a, b; memcpy(&a, &v, 32); memcpy(&b, (char*)&v + 32, 32); a += b;
  v4 c, d; memcpy(&c, &a, 16); memcpy(&d, (char*)&a + 16, 16); c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

/* exp of 16 floats (Cephes' range reduction and polynomial, about 1 ulp); 0 below -87.3. */
#if defined(__AVX512F__)
static inline v16 vexp(v16 x) {
  const v16i under = x < splat(-87.3f);
  x = pick(x > splat(88.7f), splat(88.7f), x);
  x = pick(under, splat(-87.3f), x);
  const v16 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v16i n = __builtin_convertvector(fx, v16i);
  n += (v16i)(__builtin_convertvector(n, v16) > fx);  /* truncation to floor: true is -1 */
  const v16 nf = __builtin_convertvector(n, v16);
  v16 r = x - nf * splat(0.693359375f);
  r = r - nf * splat(-2.12194440e-4f);
  v16 y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * (r * r) + r + splat(1.0f);
  y = y * (v16)((n + 127) << 23);
  return pick(under, splat(0.0f), y);
}
#else
/* AVX2: the same steps on 8 lanes in intrinsics (GCC turns the 16-lane integer conversions above into scalar
   inserts without AVX-512: measured as the larger share of a deep prompt chunk's attention). */
static inline __m256 vexp8(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_blendv_ps(x, _mm256_set1_ps(88.7f), _mm256_cmp_ps(x, _mm256_set1_ps(88.7f), _CMP_GT_OQ));
  x = _mm256_blendv_ps(x, _mm256_set1_ps(-87.3f), under);
  const __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  __m256i n = _mm256_cvttps_epi32(fx);
  n = _mm256_add_epi32(n, _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtepi32_ps(n), fx, _CMP_GT_OQ)));
  const __m256 nf = _mm256_cvtepi32_ps(n);
  __m256 r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)));
  return _mm256_blendv_ps(y, _mm256_setzero_ps(), under);
}
#endif

/* The two loops that run exp over whole rows: on AVX2 in 8-lane intrinsics (GCC passes 16-lane vectors through the
   stack there: measured as 40% of a deep chunk's attention), each lane's operations and the order of the sum the
   16-lane code's. */
#if defined(__AVX512F__)
/* row[i] = exp(row[i] - top) for i < n16 (a multiple of 16); returns their sum, 16 lanes folded as hsum folds. */
static float exp_row(float* row, int32_t n16, float top) {
  v16 total = splat(0.0f);
  for (int32_t i = 0; i < n16; i += 16) {
    const v16 p = vexp(load16(row + i) - splat(top));
    store16(row + i, p);
    total += p;
  }
  return hsum(total);
}

/* out[i] = silu(g[i]) u[i] for i < n (a multiple of 16). */
static void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const v16 a = load16(g + i);
    store16(out + i, a / (splat(1.0f) + vexp(-a)) * load16(u + i));
  }
}
#else
static float exp_row(float* row, int32_t n16, float top) {
  const __m256 t = _mm256_set1_ps(top);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int32_t i = 0; i < n16; i += 16) {
    const __m256 a = vexp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), t));
    const __m256 b = vexp8(_mm256_sub_ps(_mm256_loadu_ps(row + i + 8), t));
    _mm256_storeu_ps(row + i, a);
    _mm256_storeu_ps(row + i + 8, b);
    lo = _mm256_add_ps(lo, a);
    hi = _mm256_add_ps(hi, b);
  }
  const __m256 s = _mm256_add_ps(lo, hi);
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  float f[4];
  _mm_storeu_ps(f, c);
  return (f[0] + f[2]) + (f[1] + f[3]);
}

static void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 a = _mm256_loadu_ps(g + i);
    const __m256 e = vexp8(_mm256_xor_ps(a, sign));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
}
#endif

struct weights { const uint8_t* q; const float* s; const float* m; int64_t tiles, K; int32_t kind, unused; };
struct layer { const float* norm1; const float* norm2; struct weights qkv, o, gate_up, down; };
struct dims {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  int64_t qkv_ld, k_off, v_off, gu_ld, u_off, o_ld, down_ld;
  float eps, scale;
  int64_t kv_kind;  /* the cache's keys and values: 0 float32, 1 float16, 2 bfloat16 (put_kv, kv8) */
};

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

/* The threads' share of y = x W (called inside a parallel region): tiles split statically. xs: scratch of
   M * (K/32 * 2 + K/4) floats (`prepare_row`). */
static void gemm_in(const struct weights* w, const float* x, int64_t M, float* xs, float* y) {
  const int64_t qb = tile_bytes(w->kind, w->K), sb = w->K / 32 * 16;
  if (w->kind == 4 || w->kind == 5 || w->kind == 9) {
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++) prepare_row(w->kind, x, M, w->K, xs, r);
  }
  #pragma omp for schedule(static)
  for (int64_t t = 0; t < w->tiles; t++)
    tile_of(w->kind, x, M, w->K, w->q + t * qb, w->s + t * sb, w->m + t * sb, xs, y + t * 16, w->tiles * 16);
}

/* y [M, tiles * 16] = x [M, K] times the tiles' weights: q [tiles][K/2 or K][16] bytes (F16: [tiles][K][16]
   float16; the int8-activation kinds in their own order, Tiles.q4 / q8), s and m [tiles][K/32][16] float32 (m
   unread for Q8, neither for F16). */
void block_gemm(int kind, const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s,
                const float* m, float* xs, float* y, int64_t tiles, int threads) {
  const struct weights w = {q, s, m, tiles, K, kind, 0};
  #pragma omp parallel num_threads(threads)
  gemm_in(&w, x, M, xs, y);
}

/* transformers' RMSNorm in float32: h = (x * rsqrt(mean(x^2) + eps)) * w, the mean summed in one fixed order. */
static void rms_row(const float* x, const float* w, float* h, int64_t n, float eps) {
  v16 acc = splat(0.0f);
  for (int64_t i = 0; i < n; i += 16) { const v16 v = load16(x + i); acc += v * v; }
  const float r = 1.0f / sqrtf(hsum(acc) / (float)n + eps);
  for (int64_t i = 0; i < n; i += 16) store16(h + i, (load16(x + i) * splat(r)) * load16(w + i));
}

/* RoPE in place: v = v * cos + roll(v, d/2) * signed_sin (llama.py's `rotate`). */
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
                         int64_t kind, const int32_t* live, const int32_t* n, const float* const* mrow,
                         int64_t d, float scale, float* sc, float* kb, float* const* part) {
  const int64_t stride = KCHUNK + 16;
  int32_t nmax = 0;
  for (int64_t b = 0; b < B; b++) nmax = part[b] && n[b] > nmax ? n[b] : nmax;
  __m256 top[QBLOCK * 16];
  for (int64_t v = 0; v < B * G; v++) top[v] = _mm256_set1_ps(-INFINITY);
  const __m256 sv = _mm256_set1_ps(scale), lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int32_t i0 = 0; i0 < nmax; i0 += 8) {
    keys8(K, live, i0, nmax, d, kind, kb);
    for (int64_t b = 0; b < B; b++) {
      if (!part[b] || i0 >= n[b]) continue;
      float m[8];
      for (int i = 0; i < 8; i++) m[i] = i0 + i < n[b] ? mrow[b][live[i0 + i]] : 0.0f;
      const __m256 mv = _mm256_loadu_ps(m);
      const __m256 seen = _mm256_cmp_ps(lanes, _mm256_set1_ps((float)(n[b] - i0)), _CMP_LT_OQ);
      for (int64_t h = 0; h < G; h++) {
        const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                          _mm256_fmadd_ps(dots8(q + b * ldq + h * d, kb, d), sv, mv), seen);
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
   D->kv_kind.
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
  const int64_t wide = D->o_ld > D->down_ld ? D->o_ld : D->down_ld;
  float* h = work;
  float* qkv = h + N * H;
  float* att = qkv + N * D->qkv_ld;
  float* o = att + N * qd;
  float* gu = o + N * wide;
  float* act = gu + N * D->gu_ld;
  const int64_t widest = D->inter > qd ? (D->inter > H ? D->inter : H) : (qd > H ? qd : H);
  float* xs = act + N * D->inter;  /* [N, widest / 32 * 2 + widest / 4]: `prepare_row`'s */
  /* per thread: attend_block's sc [QBLOCK][group][KCHUNK + 16] and kb [32][d] */
  float* scores = xs + N * (widest / 32 * 2 + widest / 4);
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
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < N; r++) rms_row(x + r * H, L->norm1, h + r * H, H, D->eps);
      gemm_in(&L->qkv, h, N, xs, qkv);
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < N; t++) {
        float* y = qkv + t * D->qkv_ld;
        for (int64_t i = 0; i < nh; i++) rope(y + i * d, cos + t * d, ssin + t * d, d);
        for (int64_t g = 0; g < nkv; g++) {
          float* k = y + D->k_off + g * d;
          rope(k, cos + t * d, ssin + t * d, d);
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
        int32_t n[QBLOCK];
        const float* mr[QBLOCK];
        float* part[QBLOCK];
        for (int64_t b = 0; b < B; b++) {
          const int64_t t = t0 + b, runs = first[t + 1] - first[t];
          const int64_t left = count[t] - start;
          n[b] = left <= 0 ? 0 : left < KCHUNK ? (int32_t)left : KCHUNK;
          mr[b] = mask + mrow[t] * Lk;
          part[b] = c < runs ? parts + (first[t] * nkv + g * runs + c) * group * (d + 2) : NULL;
        }
        attend_block(qkv + t0 * D->qkv_ld + g * group * d, D->qkv_ld, B, group, (const char*)keys[l] + base,
                     (const char*)values[l] + base, D->kv_kind, live + (t0 + B - 1) * Lk + start, n, mr, d, D->scale,
                     sc, kb, part);
      }
      #pragma omp for schedule(static)
      for (int64_t tg = 0; tg < N * nkv; tg++) {
        const int64_t t = tg / nkv, g = tg % nkv, runs = first[t + 1] - first[t];
        merge(parts + (first[t] * nkv + g * runs) * group * (d + 2), runs, group, d, att + t * qd + g * group * d);
      }
      gemm_in(&L->o, att, N, xs, o);
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < N; r++) {
        for (int64_t i = 0; i < H; i += 16) store16(x + r * H + i, load16(x + r * H + i) + load16(o + r * D->o_ld + i));
        rms_row(x + r * H, L->norm2, h + r * H, H, D->eps);
      }
      gemm_in(&L->gate_up, h, N, xs, gu);
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < N; r++)
        silu_mul(gu + r * D->gu_ld, gu + r * D->gu_ld + D->u_off, act + r * D->inter, D->inter);
      gemm_in(&L->down, act, N, xs, o);
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < N; r++) {
        for (int64_t i = 0; i < H; i += 16)
          store16(x + r * H + i, load16(x + r * H + i) + load16(o + r * D->down_ld + i));
        if (states) memcpy(states + (l * N + r) * H, x + r * H, H * sizeof(float));
        if (final_norm && l == n_layers - 1) rms_row(x + r * H, final_norm, x + r * H, H, D->eps);
      }
    }
  }
}
"""


def _cpu_identity() -> str:
    """This CPU's model and feature flags (a library built with -march=native runs only where they match)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
        return "\n".join(wanted) or platform.processor()
    except OSError:
        return platform.processor()


def _build(directory: Path) -> Path:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C compiler {compiler!r}")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE, compiler, version, *FLAGS, platform.machine(), _cpu_identity()])
                         .encode()).hexdigest()[:16]
    target = directory / f"block_gemm-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as work:
        source = Path(work) / "block_gemm.c"
        source.write_text(SOURCE)
        built = Path(work) / target.name
        done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(source)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"compiling the float kernels failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent build renames the same bytes over it
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.block_gemm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int]
    lib.block_gemm.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.decoder_forward.argtypes = [p, p, i64, p, p, i64, p, i64, p, p, p, p, p, p, i64, p, p, p, p, p, p, p,
                                    ctypes.c_int]
    lib.decoder_forward.restype = None
    return lib


_directory: Path | None = None  # `use_directory`'s
_loaded: str | None = None  # the library `library()` loaded, by name


def build_id() -> str | None:
    """Which kernels this process runs: the loaded library's name (a hash of the source, compiler, flags and CPU),
    or None where none is loaded. Figures timed on the kernels (calibration) are keyed by it, so a changed kernel
    is timed again rather than planned with the old one's costs."""
    return _loaded


def use_directory(path: Path) -> None:
    """Build and find the kernels under `path` (the server's `cache_dir`/kernels; `SPECULA_KERNEL_DIR` wins). Takes
    effect for the first `library()` call: one process loads one library."""
    global _directory
    _directory = path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot run here (see the module doc)."""
    if os.environ.get("SPECULA_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    default = _directory or Path.home() / ".cache" / "specula" / "kernels"
    directory = Path(os.environ.get("SPECULA_KERNEL_DIR") or default)
    try:
        path = _build(directory)
        lib = _load(path)
        if not _probe(lib):
            raise RuntimeError("the float kernels' probe product differs from the reference")
        global _loaded
        _loaded = path.stem
        return lib
    except Exception as e:  # optional machinery: torch's kernel serves instead
        log.warning("float32 block kernels unavailable (%s); quantized layers use torch's int4 kernel", e)
        return None


class Tiles:
    """One layer's (or several fused layers') block weights in the kernel's layout, and the call `x -> y`."""

    def __init__(self, kind: int, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, out: int, lib: ctypes.CDLL,
                 in_features: int | None = None):
        self.kind, self.out, self.lib = kind, out, lib
        self.q, self.s, self.m = q.contiguous(), s.contiguous(), m.contiguous()
        self.tiles, self.in_features = q.shape[0], in_features or s.shape[1] * 32

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds (memory accounting)."""
        return self.q, self.s, self.m

    @classmethod
    def q4(cls, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, lib: ctypes.CDLL, int8: bool | None = None) -> Tiles:
        """q [N, K] values in [0, 15]; s, m [N, K/32]: w = s q + m; on int8 activations where `int8` (None: where
        `int8_activations` says)."""
        n, k = q.shape
        q, s, m = _pad(q, s, m)
        t = q.shape[0] // TILE
        qt = q.to(torch.uint8).view(t, TILE, k).transpose(1, 2)  # [tiles, K, 16]
        if int8_activations() if int8 is None else int8:
            # per 4 inputs 4u..4u+3, 32 bytes: byte 4j + e = input 4u + e of output j (low) and of j + 8 (high)
            quads = qt.reshape(t, k // 4, 4, TILE)  # [tiles, u, e, j]
            packed = (quads[..., :8] | (quads[..., 8:] << 4)).transpose(2, 3).reshape(t, k // 2, TILE)
            return cls(KIND_Q4_INT8, packed, _tiled(s, t), _tiled(m, t), n, lib)
        packed = qt[:, 0::2] | (qt[:, 1::2] << 4)  # [tiles, K/2, 16]: inputs k (low) and k + 1 (high)
        return cls(KIND_Q4, packed, _tiled(s, t), _tiled(m, t), n, lib)

    @classmethod
    def q8(cls, q: torch.Tensor, s: torch.Tensor, lib: ctypes.CDLL, int8: bool | None = None) -> Tiles:
        """q [N, K] int8; s [N, K/32]: w = s q; on int8 activations where `int8` (None: `int8_activations`)."""
        n, k = q.shape
        q, s, _ = _pad(q, s, s[:, :0])
        t = q.shape[0] // TILE
        qt = q.to(torch.int8).view(t, TILE, k).transpose(1, 2).contiguous()  # [tiles, K, 16]
        if int8_activations() if int8 is None else int8:  # per 4 inputs k..k+3: 16 x (q[k][j] .. q[k+3][j])
            quads = qt.view(t, k // 4, 4, TILE).transpose(2, 3).contiguous().view(torch.uint8).view(t, k, TILE)
            return cls(KIND_Q8_INT8, quads, _tiled(s, t), torch.zeros(1), n, lib)
        return cls(KIND_Q8, qt.view(torch.uint8), _tiled(s, t), torch.zeros(1), n, lib)  # m is never read for Q8

    @classmethod
    def f16(cls, w: torch.Tensor, lib: ctypes.CDLL) -> Tiles:
        """w [N, K] float16 values (K a multiple of 32), multiplied as they are: no scale, nothing rounded but the
        float32 sums, which run as the block kinds' do (a row's result the same bits in any batch)."""
        n, k = w.shape
        w = w.to(torch.float16)
        if -n % TILE:
            w = torch.cat([w, w.new_zeros(-n % TILE, k)])
        t = w.shape[0] // TILE
        qt = w.view(t, TILE, k).transpose(1, 2).contiguous().view(torch.uint8)  # [tiles, K, 16] float16 as bytes
        return cls(KIND_F16, qt, torch.zeros(1), torch.zeros(1), n, lib, in_features=k)

    def values(self, ids: torch.Tensor) -> torch.Tensor:
        """The unscaled values of output rows `ids` ([n]) over every input, [n, K] (int8 for Q8, float16 for F16):
        what a table's lookups read once the tiles alone hold it."""
        if self.kind == KIND_F16:
            return tile_rows(self.q.view(torch.float16), ids)
        q = self.q.view(torch.int8)
        if self.kind == KIND_Q8_INT8:  # [T, K/4, 16, 4]: input 4u + e of output lane j at [u, j, e]
            quads = q.view(self.tiles, self.in_features // 4, TILE, 4)
            return tile_rows(quads, ids).reshape(len(ids), self.in_features)
        return tile_rows(q, ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        rows = flat.shape[0]
        y = torch.empty(rows, self.tiles * TILE)
        if rows:
            sums = torch.empty(rows * scratch_per_row(self.in_features))  # Q4: each row's group sums (and int8)
            self.lib.block_gemm(self.kind, flat.data_ptr(), rows, self.in_features, self.q.data_ptr(),
                                self.s.data_ptr(), self.m.data_ptr(), sums.data_ptr(), y.data_ptr(), self.tiles,
                                torch.get_num_threads())
        if self.tiles * TILE != self.out:
            y = y[:, : self.out]
        return y.view(*x.shape[:-1], self.out).to(x.dtype)


def scratch_per_row(k: int) -> int:
    """Floats of scratch a product over k inputs needs per row (`prepare_row`: group sums, int8 scales and values)."""
    return k // 32 * 2 + k // 4


def int8_activations() -> bool:
    """Whether Q4 and Q8 products take int8 activations (`KIND_Q4_INT8`, `KIND_Q8_INT8`): `SPECULA_INT8_ACTIVATIONS`
    (1 / 0) where set, else where the host has no AVX-512 (measured 2x faster there; on the AVX-512 host the float
    loops ran at 94-103 GMAC/s from 8 rows on and keep the activations exact; int8 there is not measured)."""
    setting = os.environ.get("SPECULA_INT8_ACTIVATIONS", "").lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    return " avx512f" not in _cpu_identity()


def activation_error(x: torch.Tensor) -> torch.Tensor:
    """The most each input of x [..., K] is off in an int8-activation product (`KIND_Q4_INT8`): half a step of its
    group's scale, dx / 2 with dx = max |x| / 127 over its row's group of 32 (float64, a hair generous)."""
    groups = x.double().abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    return (groups / 254 * (1 + 1e-6)).expand(*groups.shape[:-1], 32).flatten(-2)


def tile_rows(tiled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` ([n]) of a matrix held in tiles of 16 rows, [T, C, 16, ...] (`Tiles.q` viewed as its values,
    `Tiles.s`): row i is lane i % 16 of tile i // 16, [n, C, ...]."""
    tile, lane = (ids // TILE)[:, None], (ids % TILE)[:, None]
    return tiled[tile, torch.arange(tiled.shape[1], device=tiled.device)[None], lane]


def _pad(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Outputs padded with zero weights to a whole number of tiles (their results are dropped)."""
    extra = -q.shape[0] % TILE
    if not extra:
        return q, s.float(), m.float()
    grow = lambda t: torch.cat([t, t.new_zeros(extra, t.shape[1])])  # noqa: E731
    return grow(q), grow(s.float()), grow(m.float())


def _tiled(v: torch.Tensor, tiles: int) -> torch.Tensor:
    """[N, G] -> [tiles, G, 16]."""
    return v.float().view(tiles, TILE, v.shape[1]).transpose(1, 2).contiguous()


def _probe(lib: ctypes.CDLL) -> bool:
    """One small product of each kind against float64, within float32's rounding (and, on int8 activations, the
    activations' rounding: `activation_error`)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    s = torch.rand(20, 2, generator=g) * 0.1
    q4 = torch.randint(0, 16, (20, 64), generator=g)
    m = -8 * s
    q8 = torch.randint(-128, 128, (20, 64), generator=g)
    f16 = (torch.randn(20, 64, generator=g) * 0.1).half()
    scaled4, scaled8 = s.repeat_interleave(32, 1) * q4, s.repeat_interleave(32, 1) * q8
    w4 = scaled4 + m.repeat_interleave(32, 1)
    for tiles, w, scaled in (*((Tiles.q4(q4, s, m, lib, int8=i8), w4, scaled4) for i8 in (False, True)),
                             *((Tiles.q8(q8, s, lib, int8=i8), scaled8, scaled8) for i8 in (False, True)),
                             (Tiles.f16(f16, lib), f16, None)):
        want = x.double() @ w.double().t()
        rounded = tiles.kind in (KIND_Q4_INT8, KIND_Q8_INT8)
        slack = activation_error(x) @ scaled.double().abs().t() if rounded else 0
        if not ((tiles(x).double() - want).abs() <= slack + 1e-5 * float(want.abs().max())).all():
            return False
    return True
