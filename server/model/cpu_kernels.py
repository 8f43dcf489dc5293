"""Float32 CPU kernels for GGUF block weights, compiled on the host at first use (quantized.py calls them).

torch's int4 kernel (the other way quantized.py multiplies) rounds activations and outputs to bfloat16, so a
model on it must attend in float64 to keep greedy text independent of a pass's width (attention.py), and it
dequantizes the weights again for every block of 4 rows. The kernel here takes and gives float32: per weight
w = s * q + m in float32 (Q4_0 / Q4_1: q in [0, 15], Q8_0: q in [-128, 127], m = 0), and each output is one
float32 sum over its row of activations, in four interleaved chains (k mod 4) combined as (c0 + c1) +
(c2 + c3): the same operations in the same order whatever rows share the call and however many threads
split the outputs, so a row's result is the same bits alone or in any batch (tests check it). The weights
are dequantized once per tile of 16 outputs and applied to 6 rows at a time (then 4, 2, 1).

Measured on the 2-core development machine (AVX-512, 2 threads, us a call for 576 x 960 / 576 x 3072 /
1536 x 576; docs/bench-journal.md): 1 row 14-20 / 41-49 / 22-28 against torch's int4 kernel's 29 / 64 / 40,
2 rows 22 / 56 / 31, 5 rows 39-45 / 116-126 / 59-67 against 68 / 185 / 99, 64 rows 390-408 / 1205-1223 /
608-613 against 440 / 1380 / 686.

Built with the host's C compiler (`CC`, default `cc`; `-O3 -march=native -fopenmp`, AVX2 or AVX-512 needed)
into `~/.cache/specula/kernels/` (or `SPECULA_KERNEL_DIR`) under a name hashed from the source, the compiler,
the flags and this CPU's model and flags (a library built for another CPU is never loaded), written to a
temporary file and renamed into place. OpenMP resolves to the libgomp torch already loaded, so both share one
thread pool; a call uses torch's current thread count. The library is checked against a reference product
once when loaded. Any failure (no compiler, no AVX2, a wrong probe) leaves `library()` None and quantized.py on
torch's kernel; `SPECULA_CPU_KERNELS=0` asks for that.
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
#else
#error "the float kernels need AVX2 or AVX-512"
#endif

static inline v16 load16(const float* p) { v16 r; memcpy(&r, p, 64); return r; }

/* The weights of 4 consecutive inputs k..k+3 of a tile's 16 outputs. Q4: byte j of the 16 at pair (k, k+1)
   holds q[k][j] in its low nibble and q[k+1][j] in its high one; Q8: 16 signed bytes per input. */
#define WEIGHTS4(kind, q, k, s, m, w)                                                                   \
  if (kind == 4) {                                                                                      \
    const uint8_t* p = q + ((k) / 2) * 16;                                                              \
    w[0] = s * nib_lo(p) + m; w[1] = s * nib_hi(p) + m; w[2] = s * nib_lo(p + 16) + m; w[3] = s * nib_hi(p + 16) + m; \
  } else {                                                                                              \
    const uint8_t* p = q + (k) * 16;                                                                    \
    w[0] = s * sbyte(p) + m; w[1] = s * sbyte(p + 16) + m; w[2] = s * sbyte(p + 32) + m; w[3] = s * sbyte(p + 48) + m; \
  }

/* R rows of x [R, K] against one tile: each row's 4 chains over k, combined as (c0 + c1) + (c2 + c3). The
   same operations per row for every R, so a row's result does not depend on the block it falls in. */
#define ROWS(R)                                                                                         \
  static void rows##R(int kind, const float* x0, int64_t K, const uint8_t* q, const float* s,          \
                      const float* m, float* y, int64_t ldy) {                                          \
    v16 a[R][4];                                                                                        \
    memset(a, 0, sizeof a);                                                                             \
    for (int64_t g = 0; g < K / 32; g++) {                                                              \
      const v16 sg = load16(s + g * 16), mg = load16(m + g * 16);                                       \
      for (int64_t k = g * 32; k < g * 32 + 32; k += 4) {                                               \
        v16 w[4];                                                                                       \
        WEIGHTS4(kind, q, k, sg, mg, w)                                                                 \
        for (int r = 0; r < R; r++)                                                                     \
          for (int c = 0; c < 4; c++) a[r][c] += x0[r * K + k + c] * w[c];                              \
      }                                                                                                 \
    }                                                                                                   \
    for (int r = 0; r < R; r++) {                                                                       \
      v16 o = (a[r][0] + a[r][1]) + (a[r][2] + a[r][3]);                                                \
      memcpy(y + r * ldy, &o, 64);                                                                      \
    }                                                                                                   \
  }
ROWS(6)
ROWS(4)
ROWS(2)
ROWS(1)

/* One tile's 16 outputs for all M rows: blocks of 6 rows (the weights dequantized once per block), then 4, 2, 1. */
static void tile(int kind, const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s,
                 const float* m, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + 6 <= M; r += 6) rows6(kind, x + r * K, K, q, s, m, y + r * ldy, ldy);
  if (M - r >= 4) { rows4(kind, x + r * K, K, q, s, m, y + r * ldy, ldy); r += 4; }
  if (M - r >= 2) { rows2(kind, x + r * K, K, q, s, m, y + r * ldy, ldy); r += 2; }
  if (M - r >= 1) rows1(kind, x + r * K, K, q, s, m, y + r * ldy, ldy);
}

/* y [M, tiles * 16] = x [M, K] times the tiles' weights: q [tiles][K/2 or K][16] bytes, s and m
   [tiles][K/32][16] float32. */
void block_gemm(int kind, const float* x, int64_t M, int64_t K, const uint8_t* q, const float* s,
                const float* m, float* y, int64_t tiles, int threads) {
  const int64_t qb = kind == 4 ? K / 2 * 16 : K * 16, sb = K / 32 * 16;
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tiles; t++) tile(kind, x, M, K, q + t * qb, s + t * sb, m + t * sb, y + t * 16, tiles * 16);
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
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.block_gemm.restype = None
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot run here (see the module doc)."""
    if os.environ.get("SPECULA_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    directory = Path(os.environ.get("SPECULA_KERNEL_DIR") or Path.home() / ".cache" / "specula" / "kernels")
    try:
        lib = _load(_build(directory))
        if not _probe(lib):
            raise RuntimeError("the float kernels' probe product differs from the reference")
        return lib
    except Exception as e:  # optional machinery: torch's kernel serves instead
        log.warning("float32 block kernels unavailable (%s); quantized layers use torch's int4 kernel", e)
        return None


class Tiles:
    """One layer's (or several fused layers') block weights in the kernel's layout, and the call `x -> y`."""

    def __init__(self, kind: int, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, out: int, lib: ctypes.CDLL):
        self.kind, self.out, self.lib = kind, out, lib
        self.q, self.s, self.m = q.contiguous(), s.contiguous(), m.contiguous()
        self.tiles, self.in_features = q.shape[0], s.shape[1] * 32

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds (memory accounting)."""
        return self.q, self.s, self.m

    @classmethod
    def q4(cls, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, lib: ctypes.CDLL) -> Tiles:
        """q [N, K] values in [0, 15]; s, m [N, K/32]: w = s q + m."""
        n, k = q.shape
        q, s, m = _pad(q, s, m)
        t = q.shape[0] // TILE
        qt = q.to(torch.uint8).view(t, TILE, k).transpose(1, 2)  # [tiles, K, 16]
        packed = qt[:, 0::2] | (qt[:, 1::2] << 4)  # [tiles, K/2, 16]: inputs k (low) and k + 1 (high)
        return cls(4, packed, _tiled(s, t), _tiled(m, t), n, lib)

    @classmethod
    def q8(cls, q: torch.Tensor, s: torch.Tensor, lib: ctypes.CDLL) -> Tiles:
        """q [N, K] int8; s [N, K/32]: w = s q."""
        n, k = q.shape
        q, s, m = _pad(q, s, torch.zeros_like(s))
        t = q.shape[0] // TILE
        qt = q.to(torch.int8).view(t, TILE, k).transpose(1, 2).contiguous().view(torch.uint8)  # [tiles, K, 16]
        return cls(8, qt, _tiled(s, t), _tiled(m, t), n, lib)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        rows = flat.shape[0]
        y = torch.empty(rows, self.tiles * TILE)
        if rows:
            self.lib.block_gemm(self.kind, flat.data_ptr(), rows, self.in_features, self.q.data_ptr(),
                                self.s.data_ptr(), self.m.data_ptr(), y.data_ptr(), self.tiles,
                                torch.get_num_threads())
        if self.tiles * TILE != self.out:
            y = y[:, : self.out]
        return y.view(*x.shape[:-1], self.out).to(x.dtype)


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
    """One small product of each kind against float64, within float32's rounding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    s = torch.rand(20, 2, generator=g) * 0.1
    q4 = torch.randint(0, 16, (20, 64), generator=g)
    m = -8 * s
    q8 = torch.randint(-128, 128, (20, 64), generator=g)
    for tiles, w in ((Tiles.q4(q4, s, m, lib), s.repeat_interleave(32, 1) * q4 + m.repeat_interleave(32, 1)),
                     (Tiles.q8(q8, s, lib), s.repeat_interleave(32, 1) * q8)):
        want = x.double() @ w.double().t()
        if not torch.allclose(tiles(x).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
            return False
    return True
