/* Specula's CPU kernels: the block kinds, the structs Python fills (server/model/cpu_decoder.py mirrors them
   through ctypes; `specula_abi` lets it check their sizes) and the entry points. The only copy of all three:
   cpu_kernels.py reads the kinds from the enum below. */
#ifndef SPECULA_H
#define SPECULA_H
#include <stddef.h>
#include <stdint.h>

/* How a tile of 16 outputs holds its weights and which activations multiply them (cpu_kernels.Tiles). */
enum specula_kind {
  KIND_Q4 = 4,       /* 4-bit values, w = s q + m per group of 32 inputs, float32 activations */
  KIND_Q4_INT8 = 5,  /* the same weights, activations rounded to int8 per row and group of 32 */
  KIND_Q8 = 8,       /* int8 values, w = s q per group of 32, float32 activations */
  KIND_Q8_INT8 = 9,  /* the same weights on int8 activations */
  KIND_F16 = 16      /* float16 weights as they are (no scale), float32 activations */
};

/* One (or several fused) linear layers' tiles: q the values, s and m [tiles][K/32][16] float32. */
struct weights { const uint8_t* q; const float* s; const float* m; int64_t tiles, K; int32_t kind, unused; };
/* A decoder layer: its two RMSNorm weights and four products (q/k/v fused, o, gate/up fused, down). */
struct layer { const float* norm1; const float* norm2; struct weights qkv, o, gate_up, down; };
/* The model's shapes; the output leading dimensions (`*_ld`) are the fused products' padded widths. */
struct dims {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  int64_t qkv_ld, k_off, v_off, gu_ld, u_off, o_ld, down_ld;
  float eps, scale;
  int64_t kv_kind;  /* the cache's keys and values: 0 float32, 1 float16, 2 bfloat16 (put_kv, kv8) */
};

/* The struct sizes this library was built with, in order: weights, layer, dims. */
void specula_abi(int64_t* sizes);
void block_gemm(int kind, const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s,
                const float* m, float* xs, float* y, int64_t tiles, int threads);
void decoder_forward(const struct dims* D, const struct layer* layers, int64_t n_layers, void* const* keys,
                     void* const* values, int64_t cap, float* x, int64_t N, const float* cos, const float* ssin,
                     const int64_t* row, const int64_t* col, const int64_t* mrow, const float* mask, int64_t Lk,
                     float* states, const float* final_norm, float* work, int32_t* live, int64_t* first,
                     int64_t* items, float* parts, int threads);
#endif
