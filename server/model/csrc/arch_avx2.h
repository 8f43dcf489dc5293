/* The AVX2 parts of the kernels (kernels.c includes this file when built without AVX-512): the float32 tile loop
   and exp / SiLU in 8-lane intrinsics (GCC passes 16-lane generic vectors through the stack without AVX-512:
   measured as 40% of a deep chunk's attention), each lane's operations and the order of the sums the 16-lane
   code's. */
#ifndef __AVX2__
#error "arch_avx2.h needs AVX2"
#endif
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
