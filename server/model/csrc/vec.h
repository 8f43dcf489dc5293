/* Vector types and helpers every instruction set's code shares: 16 float32 lanes (`v16`, GCC's generic vectors,
   lowered to one AVX-512 register or two AVX2 ones) and the fixed orders their lanes are summed in. */
#ifndef SPECULA_VEC_H
#define SPECULA_VEC_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float* p) { v16 r; memcpy(&r, p, 64); return r; }
static inline v16 splat(float a) { v16 r = {a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; return r; }
static inline void store16(float* p, v16 v) { memcpy(p, &v, 64); }
static inline v16 pick(v16i m, v16 a, v16 b) { return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }

/* The 16 lanes' sum in one fixed order (halves folded 16 -> 8 -> 4 -> 2 -> 1). */
static inline float hsum(v16 v) {
  v8 a, b; memcpy(&a, &v, 32); memcpy(&b, (char*)&v + 32, 32); a += b;
  v4 c, d; memcpy(&c, &a, 16); memcpy(&d, (char*)&a + 16, 16); c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

/* 8 bytes at p widened to 32-bit lanes: unsigned, signed. */
static inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256i s8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

/* exp of 8 floats (Cephes' range reduction and polynomial, about 1 ulp; the same steps as arch_avx512.h's 16-lane
   vexp); 0 below -87.3. */
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

/* tanh of 8 floats as 1 - 2 / (exp(2z) + 1) (exact limits +-1 where exp saturates). */
static inline __m256 tanh8(__m256 z) {
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  return _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(vexp8(_mm256_mul_ps(two, z)), one)));
}
#endif
