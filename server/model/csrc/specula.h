/* Specula's CPU kernels: the block kinds, the structs Python fills (server/model/cpu_decoder.py mirrors them
   through ctypes; `specula_abi` lets it check their sizes) and the entry points. The only copy of all three:
   cpu_kernels.py reads the kinds from the enum below. */
#ifndef SPECULA_H
#define SPECULA_H
#include <stddef.h>
#include <stdint.h>

/* How a tile of 16 outputs holds its weights and which activations multiply them (cpu_kernels.Tiles). Weight
   groups run along the inputs: 32 inputs a group (16 for KIND_Q8G16_INT8). */
enum specula_kind {
  KIND_Q4 = 4,         /* 4-bit values, w = s q + m per group, float32 activations (Q4_0, Q4_1, Q4_K) */
  KIND_Q4_INT8 = 5,    /* the same weights, activations rounded to int8 per row and group of 32 */
  KIND_Q8 = 8,         /* int8 values, w = s q per group, float32 activations (Q8_0, Q5_0) */
  KIND_Q8_INT8 = 9,    /* the same weights on int8 activations */
  KIND_Q8M_INT8 = 10,  /* int8 values, w = s q + m per group of 32, int8 activations (Q5_1, Q5_K) */
  KIND_Q8G16_INT8 = 11,  /* int8 values, w = s q per group of 16, int8 activations (Q6_K) */
  KIND_Q5M_INT8 = 12,  /* 5-bit values u, w = s u + m per group of 32, int8 activations (Q5_1, Q5_K) */
  KIND_Q5_INT8 = 13,   /* 5-bit values u = q + 16, w = s q per group of 32, int8 activations (Q5_0) */
  KIND_Q6_INT8 = 14,   /* 6-bit values u = q + 32, w = s q per group of 16, int8 activations (Q6_K) */
  KIND_F16 = 16        /* float16 weights as they are (no scale), float32 activations */
};

/* One linear layer's tiles: q the values, s (and m) per tile [K / group][16] float32 (scales SCALES_F32), or in two
   levels (SCALES_TWO_LEVEL, int8 kinds only; K a multiple of 256): per super-block of 256 inputs 16 float32 d, then
   its groups' int8 sub-scales [256 / group][16], a group's scales d * sub (exact in float32: the file's d sc as
   ggml computes it, so the same bits; the K-quants' own form, 2.7x fewer bytes than float32 per group). bias
   [tiles * 16] or NULL. */
enum specula_scales { SCALES_F32 = 0, SCALES_TWO_LEVEL = 1 };
struct weights {
  const uint8_t* q; const float* s; const float* m; const float* bias;
  int64_t tiles, K; int32_t kind, scales;
};
/* Up to 3 layers that read one input (q, k, v; gate, up), their outputs side by side in one row of
   sum(tiles) * 16 floats: one preparation of the input and one split of all their tiles between threads. */
struct product { struct weights part[3]; int64_t parts; };
/* A decoder layer: x += post_attn(o(attn(rope(qk_norm(qkv(attn_in(x))))))), x += post_ffn(down(act(gate) up(
   ffn_in(x)))). The norms are RMSNorm weights with any offset folded in (Gemma's 1 + w); attn_out, ffn_out,
   q_norm and k_norm NULL where the family has none. window: the keys a query sees (0: every key before it;
   W: its last W, itself included); rope: which of decoder_forward's cos / sin sets the layer rotates with. */
struct layer {
  const float* attn_in; const float* attn_out; const float* ffn_in; const float* ffn_out;
  const float* q_norm; const float* k_norm;
  struct product qkv, o, gate_up, down;
  int64_t window, rope;
};
/* The model's shapes and its layers' shared operations; the output leading dimensions (`*_ld`) are the products'
   padded widths. */
struct dims {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  int64_t qkv_ld, k_off, v_off, gu_ld, u_off, o_ld, down_ld;
  float eps, scale;
  int64_t kv_kind;  /* the cache's keys and values: 0 float32, 1 float16, 2 bfloat16 (put_kv, kv8) */
  int64_t rot_dim;  /* the leading dimensions of a head RoPE rotates (head_dim, or fewer: partial rotary) */
  int64_t act;      /* the MLP's activation: 0 SiLU, 1 GELU (tanh approximation) */
  float softcap;    /* attention scores as softcap tanh(score / softcap) (Gemma 2); 0: none */
  float unused;
};

/* The struct sizes this library was built with, in order: weights, product, layer, dims. */
void specula_abi(int64_t* sizes);
void block_gemm(int kind, int scales, const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s,
                const float* m, float* xs, float* y, int64_t tiles, int threads);
void decoder_forward(const struct dims* D, const struct layer* layers, int64_t n_layers, void* const* keys,
                     void* const* values, int64_t cap, float* x, int64_t N, const float* cos, const float* ssin,
                     const int64_t* row, const int64_t* col, const int64_t* mrow, const float* mask, int64_t Lk,
                     float* states, const float* final_norm, float* work, int32_t* live, int64_t* first,
                     int64_t* items, float* parts, int threads);
#endif
