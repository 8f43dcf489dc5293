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
#endif
