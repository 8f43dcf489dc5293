/* The AVX-512 parts of the kernels (kernels.c includes this file when built for AVX-512): the float32 tile loops
   over 16-lane registers and exp / SiLU on 16 lanes. */
#ifndef __AVX512F__
#error "arch_avx512.h needs AVX-512 (kernels.c is built with -mavx512f for it)"
#endif
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

/* exp of 16 floats (Cephes' range reduction and polynomial, about 1 ulp); 0 below -87.3. */
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
