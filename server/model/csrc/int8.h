/* Products on int8 activations (AVX2 instructions, which AVX-512 hosts have too): kinds KIND_Q4_INT8, the Q8
   kinds (9-11) and the Q5 kinds (12, 13). */
/* Q4 products on int8 activations (kind 5, KIND_Q4_INT8 in Python; AVX2 instructions, which AVX-512 hosts have
   too). Each row's activations are rounded to int8 per group of 32 (`quantize_row`: dx = max|x| / 127, xq = x / dx
   to nearest even), then _mm256_maddubs_epi16 multiplies a tile's 4 values (q[k..k+3][j]) of 8 outputs by the
   row's 4 inputs (xq[k..k+3]) in pairs: 32 multiply-adds an instruction where the float loops do 8 (as llama.cpp's
   Q4_1 x Q8_1 dot product does). Per group: summed in 16 bits (exact, `group_q4i`), each output's two lanes added
   in 32 bits, then y += (s dx) t + m xs in float32, with xs the float sum of the group's inputs (group_sums, as
   kind 4 uses it). All of it per row: a row's result is the same bits in any batch. */
/* Floats of scratch a product over K inputs needs per row (`prepare_row`): group sums and int8 scales [K/32] each,
   int8 values [K] bytes, their integer sums per group [K/32]. */
static inline int64_t scratch_floats(int64_t K) { return K / 32 * 3 + K / 4; }

/* Row x's int8 form per group of 32: scales dx [K/32], values xq [K], and the values' sums sx [K/32] (exact). */
static void quantize_row(const float* x, int64_t K, float* dx, int8_t* xq, int32_t* sx) {
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
    int32_t total = 0;
    for (int i = 0; i < 32; i++) total += xq[g * 32 + i];
    sx[g] = total;
  }
}

/* 4 int8 inputs at p, repeated over 8 lanes of 32 bits (a broadcast load). */
static inline __m256i quad(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

/* Group g's 16 scales of a tile's s (or m), s0 for outputs 0-7 and s1 for 8-15: float32 [G][16] (two 0), or in two
   levels (two SCALES_TWO_LEVEL, specula.h; 2^lg groups a super-block of 256 inputs): d * sub, exact in float32. */
static inline __attribute__((always_inline)) void scales16(int two, int lg, const float* s, int64_t g, __m256* s0,
                                                           __m256* s1) {
  if (!two) {
    *s0 = _mm256_loadu_ps(s + g * 16);
    *s1 = _mm256_loadu_ps(s + g * 16 + 8);
    return;
  }
  const float* d = s + (g >> lg) * (16 + (4 << lg));
  const __m128i sub = _mm_loadu_si128((const __m128i*)(d + 16) + (g & ((1 << lg) - 1)));
  *s0 = _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)));
  *s1 = _mm256_mul_ps(_mm256_loadu_ps(d + 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sub, 8))));
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
static inline void scale_q4i(__m256i lo, __m256i hi, float dx, float xs, const __m256* s, const __m256* m,
                             __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 d = _mm256_set1_ps(dx), sum = _mm256_set1_ps(xs);
  const __m256 t0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(lo, ones));
  const __m256 t1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(hi, ones));
  acc[0] = _mm256_fmadd_ps(m[0], sum, _mm256_fmadd_ps(_mm256_mul_ps(s[0], d), t0, acc[0]));
  acc[1] = _mm256_fmadd_ps(m[1], sum, _mm256_fmadd_ps(_mm256_mul_ps(s[1], d), t1, acc[1]));
}

/* Group g of R rows from row r0 on (R a constant where it is inlined), their sums so far in y; s and m the group's
   scales and minimums (scales16). */
static inline __attribute__((always_inline)) void rows_q4i(const int R, int64_t r0, int64_t g, int64_t M, int64_t K,
                                                           const uint8_t* q, const __m256* s, const __m256* m,
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
    scale_q4i(lo[r], hi[r], dx[(r0 + r) * G + g], xs[(r0 + r) * G + g], s, m, acc);
    _mm256_storeu_ps(yr, acc[0]);
    _mm256_storeu_ps(yr + 8, acc[1]);
  }
}

/* One tile's 16 outputs for all M rows, kind 5: xs holds the rows' group sums [M, K/32], then their scales dx
   [M, K/32], then their int8 values [M, K] (`prepare_row`). One row (a decoding step) keeps its sums in registers
   over the groups; more rows take each group in blocks of up to 3 rows, one unpacking of the weights for a block,
   and leave their sums in y between groups: the same operations per row either way. two: the scales' form
   (scales16). */
static void tile_q4i(int64_t M, int64_t K, const uint8_t* q, const float* s, const float* m, int two,
                     const float* xs, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  if (M == 1) {
    const float* dx = xs + G;
    const int8_t* xq = (const int8_t*)(xs + 2 * G);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < G; g++) {
      __m256i lo, hi;
      __m256 sg[2], mg[2];
      group_q4i(1, q + g * 256, xq + g * 32, K, &lo, &hi);
      scales16(two, 3, s, g, sg, sg + 1);
      scales16(two, 3, m, g, mg, mg + 1);
      scale_q4i(lo, hi, dx[g], xs[g], sg, mg, acc);
    }
    _mm256_storeu_ps(y, acc[0]);
    _mm256_storeu_ps(y + 8, acc[1]);
    return;
  }
  for (int64_t g = 0; g < G; g++) {
    __m256 sg[2], mg[2];
    scales16(two, 3, s, g, sg, sg + 1);
    scales16(two, 3, m, g, mg, mg + 1);
    for (int64_t r0 = 0; r0 < M; r0 += 3) {
      const int64_t n = M - r0;
      if (n >= 3) rows_q4i(3, r0, g, M, K, q, sg, mg, xs, y, ldy);
      else if (n == 2) rows_q4i(2, r0, g, M, K, q, sg, mg, xs, y, ldy);
      else rows_q4i(1, r0, g, M, K, q, sg, mg, xs, y, ldy);
    }
  }
}

/* Q8 products on int8 activations (kind 9, KIND_Q8_INT8): per 4 inputs k..k+3 a tile holds 64 bytes, for each of
   its 16 outputs j the 4 values q[k..k+3][j] side by side. _mm256_maddubs_epi16 multiplies |q| by xq given q's
   sign (llama.cpp's trick: at most 2 x 128 x 127 in 16 bits, exact), _mm256_madd_epi16 adds each output's two
   halves in 32 bits. Summed over the group (exact), then y += (s dx) t. */
#define Q8_ROWS 4 /* rows a block: one load and |q| of the weights for up to 4 rows (1.1-1.2x 1 row at a time) */

/* Quad u's signed weights a (outputs 0-7) and b (8-15) times R rows' 4 inputs, added to their 32-bit sums lo[r] and
   hi[r] (R a constant where it is inlined): |a| and |b| taken once for the R rows. */
static inline __attribute__((always_inline)) void quad_q8i(const int R, __m256i a, __m256i b, const int8_t* xp,
                                                           int64_t ldx, int u, __m256i* lo, __m256i* hi) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i aa = _mm256_abs_epi8(a), ab = _mm256_abs_epi8(b);
  for (int r = 0; r < R; r++) {
    const __m256i x = quad(xp + r * ldx + 4 * u);
    lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aa, _mm256_sign_epi8(x, a)), ones));
    hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(x, b)), ones));
  }
}

/* R rows' 32-bit sums over quads u0..u1-1 of one tile's group q (lo[r]: outputs 0-7, hi[r]: 8-15), R a constant
   where it is inlined: the weights loaded once for the R rows. */
static inline __attribute__((always_inline)) void quads_q8i(const int R, const uint8_t* q, const int8_t* xp,
                                                            int64_t ldx, int u0, int u1, __m256i* lo, __m256i* hi) {
  for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
  for (int u = u0; u < u1; u++)
    quad_q8i(R, _mm256_loadu_si256((const __m256i*)(q + u * 64)), _mm256_loadu_si256((const __m256i*)(q + u * 64 + 32)),
             xp, ldx, u, lo, hi);
}

/* acc += (s dx) t for both halves of 16 outputs. */
static inline void scale_q8i(__m256i lo, __m256i hi, float dx, const __m256* s, __m256* acc) {
  const __m256 d = _mm256_set1_ps(dx);
  acc[0] = _mm256_fmadd_ps(_mm256_mul_ps(s[0], d), _mm256_cvtepi32_ps(lo), acc[0]);
  acc[1] = _mm256_fmadd_ps(_mm256_mul_ps(s[1], d), _mm256_cvtepi32_ps(hi), acc[1]);
}

/* Q6 tiles (kind 14, KIND_Q6_INT8): 6-bit values u = q + 32 in [0, 63], three quarters of a byte a weight where the
   Q8 tiles spend one. Per group of 32 inputs a tile holds 384 bytes: the low 4 bits of each value as a Q4 tile holds
   them (256 bytes), then the top 2 bits in four planes of 32 bytes, [outputs 0-7, 8-15][quads 0-3, 4-7]: bits 2i and
   2i + 1 of byte 4j + e of a plane are the top bits of input 4u + e (u = 4 h + i) of its output j (Tiles.q6). A quad's
   32 bytes of q = u - 32 per half of the outputs, rebuilt in registers, then multiplied as quads_q8i multiplies the
   Q8 tiles' (|q| by xq given q's sign): the same integers, so the same bits as kind 11 for the same weights. */

/* The top bits of quad 4h + i from plane p at bits 4 and 5, i a constant where it is inlined. */
static inline __attribute__((always_inline)) __m256i top_bits(__m256i p, int i) {
  const __m256i v = i < 2 ? _mm256_slli_epi16(p, 4 - 2 * i) : i > 2 ? _mm256_srli_epi16(p, 2 * i - 4) : p;
  return _mm256_and_si256(v, _mm256_set1_epi8(0x30));
}

/* R rows' 32-bit sums over quads 4h..4h+3 (the first or second 16 inputs of group qg) of one Q6 tile's 16 outputs
   (lo[r]: outputs 0-7, hi[r]: 8-15), rebuilt and then summed as the Q8 tiles' (quad_q8i). */
static inline __attribute__((always_inline)) void quads_q6i(const int R, const uint8_t* qg, int h, const int8_t* xp,
                                                            int64_t ldx, __m256i* lo, __m256i* hi) {
  const __m256i low = _mm256_set1_epi8(15), off = _mm256_set1_epi8(32);
  const __m256i pl = _mm256_loadu_si256((const __m256i*)(qg + 256 + h * 32));
  const __m256i ph = _mm256_loadu_si256((const __m256i*)(qg + 320 + h * 32));
  for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
  #pragma GCC unroll 4
  for (int i = 0; i < 4; i++) {
    const int u = 4 * h + i;
    const __m256i v = _mm256_loadu_si256((const __m256i*)(qg + u * 32));
    const __m256i a = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(v, low), top_bits(pl, i)), off);
    const __m256i b = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                      top_bits(ph, i)), off);
    quad_q8i(R, a, b, xp, ldx, u, lo, hi);
  }
}

/* R rows from row r0 on (R a constant where it is inlined), every group, by kind: 9 (w = s q per group of 32), 10
   (w = s q + m per group of 32: y += (s dx) t + m xs, as kind 5), 11 and 14 (w = s q per group of 16: each half's
   sum scaled by its own s, y += (s_0 dx) t_0 + (s_1 dx) t_1; s [K/16][16]). Each row's sums in registers over the
   groups: the same operations per row for any R and M. two: the scales' form (scales16). */
static inline __attribute__((always_inline)) void rows_q8i(const int R, int kind, int64_t r0, int64_t M, int64_t K,
                                                           const uint8_t* q, const float* s, const float* m, int two,
                                                           const float* xs, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  const float* dx = xs + M * G;
  const int8_t* xq = (const int8_t*)(xs + 2 * M * G);
  __m256 acc[Q8_ROWS][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* qg = q + g * (kind == KIND_Q6_INT8 ? 384 : 512);
    const int8_t* xp = xq + r0 * K + g * 32;
    __m256i lo[Q8_ROWS], hi[Q8_ROWS];
    __m256 sg[2], mg[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  /* mg: read by kind 10 only */
    if (kind == KIND_Q8G16_INT8 || kind == KIND_Q6_INT8) {
      for (int h = 0; h < 2; h++) {
        if (kind == KIND_Q6_INT8) quads_q6i(R, qg, h, xp, K, lo, hi);
        else quads_q8i(R, qg, xp, K, 4 * h, 4 * h + 4, lo, hi);
        scales16(two, 4, s, 2 * g + h, sg, sg + 1);
        for (int r = 0; r < R; r++) scale_q8i(lo[r], hi[r], dx[(r0 + r) * G + g], sg, acc[r]);
      }
      continue;
    }
    quads_q8i(R, qg, xp, K, 0, 8, lo, hi);
    scales16(two, 3, s, g, sg, sg + 1);
    if (kind == KIND_Q8M_INT8) scales16(two, 3, m, g, mg, mg + 1);
    for (int r = 0; r < R; r++) {
      scale_q8i(lo[r], hi[r], dx[(r0 + r) * G + g], sg, acc[r]);
      if (kind == KIND_Q8M_INT8) {
        const __m256 sum = _mm256_set1_ps(xs[(r0 + r) * G + g]);
        acc[r][0] = _mm256_fmadd_ps(mg[0], sum, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(mg[1], sum, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    _mm256_storeu_ps(y + (r0 + r) * ldy, acc[r][0]);
    _mm256_storeu_ps(y + (r0 + r) * ldy + 8, acc[r][1]);
  }
}

/* A tile's scales (or minimums) in two levels as float32 [groups][16], each d * sub as scales16 makes it. */
static void expand_scales(int lg, const float* s, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; g++) {
    __m256 s0, s1;
    scales16(SCALES_TWO_LEVEL, lg, s, g, &s0, &s1);
    _mm256_storeu_ps(out + g * 16, s0);
    _mm256_storeu_ps(out + g * 16 + 8, s1);
  }
}

/* One tile's 16 outputs for all M rows on int8 activations (xs as for kind 5: `prepare_row`), kinds 9-11 and 14, in
   blocks of up to Q8_ROWS rows (the blocks of 4, 3, 2 and 1 below). Scales in two levels are made float32 once for
   the tile when more than one block reads them (the same floats: the same bits; rows longer than 32,768 inputs
   keep making them per block). */
_Static_assert(Q8_ROWS == 4, "tile_q8i calls rows_q8i for 4, 3, 2 and 1 rows");
static void tile_q8i(int kind, int64_t M, int64_t K, const uint8_t* q, const float* s, const float* m, int two,
                     const float* xs, float* y, int64_t ldy) {
  if (two && M > Q8_ROWS && K <= 32768) {  /* on the stack: at most 128 KiB */
    const int g16 = kind == KIND_Q8G16_INT8 || kind == KIND_Q6_INT8;
    float sf[g16 ? K : K / 2], mf[kind == KIND_Q8M_INT8 ? K / 2 : 1];  /* [groups][16]: 64 KiB at K = 16,384 */
    expand_scales(g16 ? 4 : 3, s, g16 ? K / 16 : K / 32, sf);
    if (kind == KIND_Q8M_INT8) expand_scales(3, m, K / 32, mf);
    tile_q8i(kind, M, K, q, sf, mf, SCALES_F32, xs, y, ldy);
    return;
  }
  for (int64_t r0 = 0; r0 < M; r0 += Q8_ROWS) {
    const int64_t n = M - r0;
    if (n >= Q8_ROWS) rows_q8i(Q8_ROWS, kind, r0, M, K, q, s, m, two, xs, y, ldy);
    else if (n == 3) rows_q8i(3, kind, r0, M, K, q, s, m, two, xs, y, ldy);
    else if (n == 2) rows_q8i(2, kind, r0, M, K, q, s, m, two, xs, y, ldy);
    else rows_q8i(1, kind, r0, M, K, q, s, m, two, xs, y, ldy);
  }
}

/* Q5 products on int8 activations (kinds 12 and 13, KIND_Q5M_INT8 and KIND_Q5_INT8): 5-bit values u in [0, 31],
   five eighths of a byte a weight where the Q8 tiles spend one. Per group of 32 inputs a tile holds 320 bytes: the
   low 4 bits of each value as a Q4 tile holds them (256 bytes: per 4 inputs u, byte 4j + e holding input 4u + e of
   output j in its low nibble and of output j + 8 in its high), then the fifth bits, 32 bytes for outputs 0-7 and 32
   for outputs 8-15, bit u of byte 4j + e being the fifth bit of input 4u + e (Tiles.q5). Kind 12 is w = s u + m
   (Q5_1, Q5_K), kind 13 w = s (u - 16) (Q5_0). _mm256_maddubs_epi16 multiplies u by a row's int8 inputs, summed in
   16 bits over 4 quads (at most 4 x 2 x 31 x 127 = 31,496: exact) and then in 32 bits, so t = sum u xq exactly;
   kind 13 takes 16 times the group's sum of xq off it (`quantize_row`'s sx), which leaves sum (u - 16) xq: the
   integers and then the float steps of the Q8 tiles' kinds 10 and 9 for the same weights, the same bits. */

/* The fifth bits of quad u (bit u of each byte of b) at bit 4, u a constant where it is inlined. */
static inline __attribute__((always_inline)) __m256i fifth_bit(__m256i b, int u) {
  const __m256i v = u < 4 ? _mm256_slli_epi16(b, 4 - u) : u > 4 ? _mm256_srli_epi16(b, u - 4) : b;
  return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* R rows' 32-bit sums t = sum u xq over one tile's group qg for its 16 outputs (lo[r]: 0-7, hi[r]: 8-15). */
static inline __attribute__((always_inline)) void group_q5i(const int R, const uint8_t* qg, const int8_t* xp,
                                                            int64_t ldx, __m256i* lo, __m256i* hi) {
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i bl = _mm256_loadu_si256((const __m256i*)(qg + 256));
  const __m256i bh = _mm256_loadu_si256((const __m256i*)(qg + 288));
  for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
  #pragma GCC unroll 2
  for (int half = 0; half < 2; half++) {
    __m256i l16[3], h16[3];
    #pragma GCC unroll 4
    for (int e = 0; e < 4; e++) {
      const int u = 4 * half + e;
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qg + u * 32));
      const __m256i wl = _mm256_or_si256(_mm256_and_si256(v, low), fifth_bit(bl, u));
      const __m256i wh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), fifth_bit(bh, u));
      for (int r = 0; r < R; r++) {
        const __m256i x = quad(xp + r * ldx + 4 * u);
        const __m256i pl = _mm256_maddubs_epi16(wl, x), ph = _mm256_maddubs_epi16(wh, x);
        l16[r] = e ? _mm256_add_epi16(l16[r], pl) : pl;
        h16[r] = e ? _mm256_add_epi16(h16[r], ph) : ph;
      }
    }
    for (int r = 0; r < R; r++) {
      lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(l16[r], ones));
      hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(h16[r], ones));
    }
  }
}

/* Group g of R rows from row r0 on (R a constant where it is inlined): acc = y so far (0 at g = 0), then
   acc += (s dx) t (+ m xs for kind 12), as tile_q8i does it for kinds 9 and 10; s and m the group's (scales16). */
static inline __attribute__((always_inline)) void rows_q5i(const int R, int kind, int64_t r0, int64_t g, int64_t M,
                                                           int64_t K, const uint8_t* q, const __m256* s,
                                                           const __m256* m, const float* xs, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  const float* dx = xs + M * G;
  const int8_t* xq = (const int8_t*)(xs + 2 * M * G);
  const int32_t* sx = (const int32_t*)(xs + 2 * M * G + M * K / 4);
  __m256i lo[3], hi[3];
  group_q5i(R, q + g * 320, xq + r0 * K + g * 32, K, lo, hi);
  for (int r = 0; r < R; r++) {
    const int64_t row = r0 + r;
    float* yr = y + row * ldy;
    if (kind == KIND_Q5_INT8) {
      const __m256i c = _mm256_set1_epi32(16 * sx[row * G + g]);
      lo[r] = _mm256_sub_epi32(lo[r], c);
      hi[r] = _mm256_sub_epi32(hi[r], c);
    }
    __m256 acc0 = g ? _mm256_loadu_ps(yr) : _mm256_setzero_ps(), acc1 = g ? _mm256_loadu_ps(yr + 8) : _mm256_setzero_ps();
    const __m256 d = _mm256_set1_ps(dx[row * G + g]);
    acc0 = _mm256_fmadd_ps(_mm256_mul_ps(s[0], d), _mm256_cvtepi32_ps(lo[r]), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_mul_ps(s[1], d), _mm256_cvtepi32_ps(hi[r]), acc1);
    if (kind == KIND_Q5M_INT8) {
      const __m256 sum = _mm256_set1_ps(xs[row * G + g]);
      acc0 = _mm256_fmadd_ps(m[0], sum, acc0);
      acc1 = _mm256_fmadd_ps(m[1], sum, acc1);
    }
    _mm256_storeu_ps(yr, acc0);
    _mm256_storeu_ps(yr + 8, acc1);
  }
}

/* One tile's 16 outputs for all M rows, kinds 12 and 13 (xs as `prepare_row` leaves it): each group in blocks of up
   to 3 rows, one unpacking of the weights for a block, the sums left in y between groups (exact float32 stores:
   the same operations per row for any M). */
static void tile_q5i(int kind, int64_t M, int64_t K, const uint8_t* q, const float* s, const float* m, int two,
                     const float* xs, float* y, int64_t ldy) {
  for (int64_t g = 0; g < K / 32; g++) {
    __m256 sg[2], mg[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  /* mg: read by kind 12 only */
    scales16(two, 3, s, g, sg, sg + 1);
    if (kind == KIND_Q5M_INT8) scales16(two, 3, m, g, mg, mg + 1);
    for (int64_t r0 = 0; r0 < M; r0 += 3) {
      const int64_t n = M - r0;
      if (n >= 3) rows_q5i(3, kind, r0, g, M, K, q, sg, mg, xs, y, ldy);
      else if (n == 2) rows_q5i(2, kind, r0, g, M, K, q, sg, mg, xs, y, ldy);
      else rows_q5i(1, kind, r0, g, M, K, q, sg, mg, xs, y, ldy);
    }
  }
}
