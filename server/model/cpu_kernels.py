"""CPU kernels for GGUF block weights, compiled on the host at first use (quantized.py and tables.py call them).

torch's int4 kernel (the other way quantized.py multiplies) rounds activations and outputs to bfloat16, so a model
on it must attend in float64 to keep greedy text independent of a pass's width (attention.py). The kernels here give
float32: with w = s q + m per group of inputs, each output sums s times the group's sum of x q plus m times the
group's sum of x, group after group: the scale and minimum applied once per group, not once per weight. The same
operations in the same order whatever rows share the call and however many threads split the outputs, so a row's
result is the same bits alone or in any batch (tests check it). Kinds (csrc/specula.h): Q4 (4-bit values: Q4_0,
Q4_1, Q4_K), Q8 (int8 values: Q8_0, Q5_0), Q8 with a minimum (Q5_1, Q5_K), Q8 with scales per 16 inputs (Q6_K),
Q5 (5-bit values with or without a minimum, on int8 activations: Q5_0, Q5_1, Q5_K in five eighths of a byte a
weight, the same products as the Q8 kinds' for the same values), float16 weights (`Tiles.f16`, an fp16 table as
the LM head).

Where the host lacks AVX-512 a product is bound by float arithmetic, not bytes, and Q4 and Q8 blocks take int8
activations (`int8_activations`; `SPECULA_INT8_ACTIVATIONS=0` / `1` decides; the minimum and per-16 kinds always
do, as llama.cpp's K-quants): each row's inputs rounded per group of 32 to int8 with the scale max|x| / 127
(llama.cpp's Q8_0 / Q8_1), multiplied by the weights' values in integers (exact, `maddubs`), each group's sum scaled
once, the minimum's term on the float sum of the inputs. Per row, so a row's result is still the same bits in any
batch; each input is off by at most half its group's step (`activation_error`). The figures per kind and host are
in docs/bench-journal.md.

`decoder_forward` runs a whole decoder stack on these kernels in one call (cpu_decoder.py says how).

The C lives in `csrc/` beside this module: `specula.h` (the block kinds, the structs cpu_decoder.py fills, the entry
points: their only copy; this module reads the kinds from it), `kernels.c` (one translation unit: the products, the
decoder stack), `int8.h` (the int8-activation products), `arch_avx2.h` and `arch_avx512.h` (what differs between
instruction sets). `kernels.c` is built once per instruction set (`ISA_FLAGS`: `avx2`, `avx512`), and the host's
best (`host_isa`) is loaded; tests build and run a named one (`library("avx2")`). `make lint` compiles both with
warnings as errors.

Built and cached by kernel_build.py (keyed by sources, compiler, flags and CPU; checked against its digest;
damaged files built again). The library is checked against a reference product once when loaded. Any failure
(no compiler, no AVX2, a wrong probe) leaves `library()` None and quantized.py on torch's kernel, and `problem()`
says why (`/health` lists `kernels` under `degraded`); `SPECULA_CPU_KERNELS=0` asks for that on purpose.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import re
from pathlib import Path

import torch

from server.model import tile_layouts
from server.model.kernel_build import CSRC, ISA_FLAGS, build_library, cpu_identity, host_isa, lint
from server.model.tile_layouts import TILE  # outputs a tile holds (callers read cpu_kernels.TILE)
from server.model.tile_scales import SCALES_F32, SCALES_TWO_LEVEL, group_scales, two_level, two_level_scales

log = logging.getLogger(__name__)


def _kinds() -> dict[str, int]:
    """The block kinds of csrc/specula.h's enum (its only copy), by name."""
    return {name: int(value) for name, value in re.findall(r"\b(KIND_\w+) = (\d+)", (CSRC / "specula.h").read_text())}


_KINDS = _kinds()
_NAMES = ("KIND_Q4", "KIND_Q4_INT8", "KIND_Q8", "KIND_Q8_INT8", "KIND_Q8M_INT8", "KIND_Q8G16_INT8", "KIND_Q5M_INT8",
          "KIND_Q5_INT8", "KIND_Q6_INT8", "KIND_F16")
(KIND_Q4, KIND_Q4_INT8, KIND_Q8, KIND_Q8_INT8, KIND_Q8M_INT8, KIND_Q8G16_INT8, KIND_Q5M_INT8, KIND_Q5_INT8,
 KIND_Q6_INT8, KIND_F16) = (_KINDS[k] for k in _NAMES)
# kinds on int8 activations
INT8_KINDS = (KIND_Q4_INT8, KIND_Q8_INT8, KIND_Q8M_INT8, KIND_Q8G16_INT8, KIND_Q5M_INT8, KIND_Q5_INT8, KIND_Q6_INT8)
GROUP16 = (KIND_Q8G16_INT8, KIND_Q6_INT8)  # kinds with a scale per 16 inputs (Q6_K)
Q5_LAYOUT = (KIND_Q5M_INT8, KIND_Q5_INT8)  # 5-bit values: Q4's nibbles and a plane of fifth bits per group
Q5_TILES_AT_ONCE = 256  # tiles `Tiles.q5` lays out at a time (4,096 outputs)
Q8_LAYOUT = (KIND_Q8_INT8, KIND_Q8M_INT8, KIND_Q8G16_INT8)  # kinds whose tiles hold 4 inputs' values side by side


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.block_gemm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_int]
    lib.block_gemm.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.decoder_forward.argtypes = [p, p, i64, p, p, i64, p, i64, p, p, p, p, p, p, i64, p, p, p, p, p, p, p,
                                    ctypes.c_int]
    lib.decoder_forward.restype = None
    lib.specula_abi.argtypes, lib.specula_abi.restype = [p], None
    return lib


def abi(lib: ctypes.CDLL) -> tuple[int, ...]:
    """The sizes of the library's `struct weights`, `struct product`, `struct layer` and `struct dims` (cpu_decoder.py
    checks its ctypes mirrors against them)."""
    sizes = (ctypes.c_int64 * 4)()
    lib.specula_abi(sizes)
    return tuple(sizes)


_directory: Path | None = None  # `use_directory`'s
_loaded: dict[str, str] = {}  # instruction set -> the library `library()` loaded for it, by name
_problems: dict[str, str] = {}  # instruction set -> why its library is unavailable (`problem`)


def build_id() -> str | None:
    """Which kernels this process runs: the loaded library's name (a hash of the sources, compiler, flags and CPU,
    then of its bytes), or None where none is loaded. Figures timed on the kernels (calibration) are keyed by it,
    so a changed kernel is timed again rather than planned with the old one's costs."""
    isa = host_isa()
    return _loaded.get(isa) if isa else None


def problem() -> str | None:
    """Why the host's kernels are unavailable after `library()` tried and failed (None: they loaded, were switched
    off, or were never asked for): the server lists it in `/health`'s `degraded`."""
    isa = host_isa()
    return _problems.get(isa) if isa else None


def use_directory(path: Path) -> None:
    """Build and find the kernels under `path` (the server's `cache_dir`/kernels; `SPECULA_KERNEL_DIR` wins). Takes
    effect for the first `library()` call: one process loads one library per instruction set."""
    global _directory
    _directory = path


def _switched_off() -> bool:
    return os.environ.get("SPECULA_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off")


@functools.cache
def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels for `isa` (None: the host's best, `host_isa`), built on first use; None where they
    cannot run here (see the module doc). Tests name an instruction set to build and run one on purpose."""
    if _switched_off() or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    isa = isa or host_isa()
    if isa is None:
        return None
    default = _directory or Path.home() / ".cache" / "specula" / "kernels"
    directory = Path(os.environ.get("SPECULA_KERNEL_DIR") or default)
    try:
        path = build_library(directory, isa)
        lib = _load(path)
        if not _probe(lib):
            raise RuntimeError("the kernels' probe product differs from the reference")
        _loaded[isa] = path.stem
        _problems.pop(isa, None)
        return lib
    except Exception as e:  # optional machinery: torch's kernel serves instead
        _problems[isa] = f"{type(e).__name__}: {e}"
        log.warning("CPU block kernels (%s) unavailable (%s); quantized layers use torch's int4 kernel", isa, e)
        return None


class Tiles:
    """One layer's (or several fused layers') block weights in the kernel's layout, and the call `x -> y`."""

    def __init__(self, kind: int, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, out: int, lib: ctypes.CDLL,
                 in_features: int | None = None):
        self.kind, self.out, self.lib = kind, out, lib
        self.q = q.contiguous()
        self.tiles = q.shape[0]
        self.in_features = in_features or s.shape[1] * (16 if kind in GROUP16 else 32)
        self.scales = SCALES_F32  # the form of s and m (csrc/specula.h): float32 per group, or in two levels
        self.s, self.m = s.contiguous(), m.contiguous()
        if kind in INT8_KINDS and two_level_scales():
            self._in_two_levels()
        self.bias: torch.Tensor | None = None  # [tiles * 16] float32, added to the outputs (`with_bias`)

    @property
    def _per_block(self) -> int:
        """Scale groups a super-block of 256 inputs holds: 16 of 16 inputs (Q6_K's), else 8 of 32."""
        return 16 if self.kind in GROUP16 else 8

    def _in_two_levels(self) -> None:
        """s (and m) in two levels where every super-block's scales are one float32 d times int8s, exactly
        (tile_scales.py): a K-quant's own form (d sc), 2.7x fewer bytes than float32 per group; else as they are."""
        s = two_level(self.s, self._per_block)
        m = two_level(self.m, 8) if self.m.dim() == 3 else self.m
        if s is not None and m is not None:
            self.s, self.m, self.scales = s, m, SCALES_TWO_LEVEL

    def group_scales(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 scales of output rows `ids` ([n]) per group, [n, K / group]: what the kernels multiply by."""
        s = group_scales(self.s, self.tiles, self._per_block) if self.scales == SCALES_TWO_LEVEL else self.s
        return tile_rows(s, ids)

    def with_bias(self, bias: torch.Tensor | None) -> Tiles:
        """These tiles adding `bias` [out] to their outputs (here and in the C decoder's products)."""
        if bias is not None:
            self.bias = torch.cat([bias.detach().float(), bias.new_zeros(self.tiles * TILE - self.out).float()])
        return self

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds (memory accounting)."""
        return (self.q, self.s, self.m) + ((self.bias,) if self.bias is not None else ())

    @classmethod
    def q4(cls, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, lib: ctypes.CDLL, int8: bool | None = None) -> Tiles:
        """q [N, K] values in [0, 15]; s, m [N, K/32]: w = s q + m; on int8 activations where `int8` (None: where
        `int8_activations` says)."""
        n, k = q.shape
        q, s, m = _pad(q, s, m)
        t = q.shape[0] // TILE
        qt = q.to(torch.uint8).view(t, TILE, k).transpose(1, 2)  # [tiles, K, 16]
        if int8_activations() if int8 is None else int8:
            return cls(KIND_Q4_INT8, tile_layouts.nibble_quads(qt), _tiled(s, t), _tiled(m, t), n, lib, in_features=k)
        packed = qt[:, 0::2] | (qt[:, 1::2] << 4)  # [tiles, K/2, 16]: inputs k (low) and k + 1 (high)
        return cls(KIND_Q4, packed, _tiled(s, t), _tiled(m, t), n, lib, in_features=k)

    @classmethod
    def q8(cls, q: torch.Tensor, s: torch.Tensor, lib: ctypes.CDLL, int8: bool | None = None,
           m: torch.Tensor | None = None, six_bits: bool = True) -> Tiles:
        """q [N, K] int8; s [N, K/32] (w = s q) or [N, K/16] (w = s q per 16 inputs: Q6_K); m [N, K/32] or None:
        w = s q + m (Q5_1, Q5_K). On int8 activations where `int8` (None: `int8_activations`); the per-16 scales and
        the minimum exist only there (`KIND_Q8G16_INT8`, `KIND_Q8M_INT8`: llama.cpp runs its K-quants on int8
        activations everywhere). Per-16 scales with values in [-32, 31] (Q6_K's) take the 6-bit tiles (`q6`), the
        same products in three quarters of the bytes, unless `six_bits` is False (tests compare the two)."""
        n, k = q.shape
        group16 = s.shape[1] == k // 16
        q, s, m_padded = _pad(q, s, m if m is not None else s[:, :0])
        if group16 and six_bits and (not q.numel() or (-32 <= int(q.min()) and int(q.max()) <= 31)):
            return cls.q6(q, s, n, k, lib)
        t = q.shape[0] // TILE
        qt = q.to(torch.int8).view(t, TILE, k).transpose(1, 2).contiguous()  # [tiles, K, 16]
        if group16 or m is not None or (int8_activations() if int8 is None else int8):
            # per 4 inputs k..k+3: 16 x (q[k][j] .. q[k+3][j])
            quads = qt.view(t, k // 4, 4, TILE).transpose(2, 3).contiguous().view(torch.uint8).view(t, k, TILE)
            kind = KIND_Q8G16_INT8 if group16 else KIND_Q8M_INT8 if m is not None else KIND_Q8_INT8
            mins = _tiled(m_padded, t) if m is not None else torch.zeros(1)
            return cls(kind, quads, _tiled(s, t), mins, n, lib, in_features=k)
        return cls(KIND_Q8, qt.view(torch.uint8), _tiled(s, t), torch.zeros(1), n, lib)  # m is never read for Q8

    @classmethod
    def q5(cls, q: torch.Tensor, s: torch.Tensor, lib: ctypes.CDLL, m: torch.Tensor | None = None) -> Tiles:
        """5-bit values on int8 activations, five eighths of a byte a weight: q [N, K] in [0, 31] with m [N, K/32],
        w = s q + m (Q5_1, Q5_K: `KIND_Q5M_INT8`), or q in [-16, 15] without, w = s q (Q5_0: `KIND_Q5_INT8`, held
        as q + 16); s [N, K/32]. The same products, bit for bit, as `q8` of the same values (csrc/int8.h)."""
        n, k = q.shape
        low, high = (0, 31) if m is not None else (-16, 15)
        if q.numel() and not (low <= int(q.min()) and int(q.max()) <= high):
            raise ValueError(f"5-bit tiles take values in [{low}, {high}], not [{int(q.min())}, {int(q.max())}]")
        q, s, m_padded = _pad(q, s, m if m is not None else s[:, :0])
        t, g = q.shape[0] // TILE, k // 32
        packed = torch.empty(t, g, 320, dtype=torch.uint8)
        for a in range(0, t, Q5_TILES_AT_ONCE):  # a slice of tiles at a time: the temporaries stay small
            b = min(t, a + Q5_TILES_AT_ONCE)
            u = q[a * TILE : b * TILE].to(torch.int8).view(torch.uint8)  # Q5_0's q + 16 wraps to [0, 31]
            u = (u + 16 if m is None else u).view(b - a, TILE, k).transpose(1, 2)
            packed[a:b] = tile_layouts.five_bits(u)
        packed = packed.view(t, g * 320)
        kind, mins = (KIND_Q5M_INT8, _tiled(m_padded, t)) if m is not None else (KIND_Q5_INT8, torch.zeros(1))
        return cls(kind, packed, _tiled(s, t), mins, n, lib, in_features=k)

    @classmethod
    def q6(cls, q: torch.Tensor, s: torch.Tensor, n: int, k: int, lib: ctypes.CDLL) -> Tiles:
        """6-bit values q [tiles * 16, K] in [-32, 31] (padded), held as u = q + 32, with scales s [tiles * 16, K/16]:
        w = s q per 16 inputs (Q6_K, `KIND_Q6_INT8`), three quarters of a byte a weight (tile_layouts.six_bits); the
        same products, bit for bit, as the Q8 tiles' of the same values (csrc/int8.h)."""
        t, g = q.shape[0] // TILE, k // 32
        packed = torch.empty(t, g, 384, dtype=torch.uint8)
        for a in range(0, t, Q5_TILES_AT_ONCE):  # a slice of tiles at a time: the temporaries stay small
            b = min(t, a + Q5_TILES_AT_ONCE)
            u = (q[a * TILE : b * TILE].to(torch.int16) + 32).to(torch.uint8).view(b - a, TILE, k).transpose(1, 2)
            packed[a:b] = tile_layouts.six_bits(u)
        return cls(KIND_Q6_INT8, packed.view(t, g * 384), _tiled(s, t), torch.zeros(1), n, lib, in_features=k)

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
        if self.kind in Q5_LAYOUT:
            u = tile_layouts.five_bits_read(self.q.view(self.tiles, -1, 320)[ids // TILE], ids)
            return (u - (16 if self.kind == KIND_Q5_INT8 else 0)).to(torch.int8).reshape(len(ids), self.in_features)
        if self.kind == KIND_Q6_INT8:
            u = tile_layouts.six_bits_read(self.q.view(self.tiles, -1, 384)[ids // TILE], ids)
            return (u - 32).to(torch.int8).reshape(len(ids), self.in_features)
        q = self.q.view(torch.int8)
        if self.kind in Q8_LAYOUT:  # [T, K/4, 16, 4]: input 4u + e of output lane j at [u, j, e]
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
            self.lib.block_gemm(self.kind, self.scales, flat.data_ptr(), rows, self.in_features, self.q.data_ptr(),
                                self.s.data_ptr(), self.m.data_ptr(), sums.data_ptr(), y.data_ptr(), self.tiles,
                                torch.get_num_threads())
        if self.bias is not None:
            y += self.bias
        if self.tiles * TILE != self.out:
            y = y[:, : self.out]
        return y.view(*x.shape[:-1], self.out).to(x.dtype)


def scratch_per_row(k: int) -> int:
    """Floats of scratch a product over k inputs needs per row (`prepare_row`: group sums, int8 scales, values and
    their sums; csrc/int8.h's `scratch_floats`)."""
    return k // 32 * 3 + k // 4


def int8_activations() -> bool:
    """Whether Q4 and Q8 products take int8 activations (`KIND_Q4_INT8`, `KIND_Q8_INT8`): `SPECULA_INT8_ACTIVATIONS`
    (1 / 0) where set, else where the host has no AVX-512 (measured 2x faster there; on the AVX-512 host the float
    loops ran at 94-103 GMAC/s from 8 rows on and keep the activations exact; int8 there is not measured)."""
    setting = os.environ.get("SPECULA_INT8_ACTIVATIONS", "").lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    return " avx512f" not in cpu_identity()


def activation_error(x: torch.Tensor) -> torch.Tensor:
    """The most each input of x [..., K] is off in an int8-activation product (`KIND_Q4_INT8`): half a step of its
    group's scale, dx / 2 with dx = max |x| / 127 over its row's group of 32 (float64, a hair generous)."""
    groups = x.double().abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    return (groups / 254 * (1 + 1e-6)).expand(*groups.shape[:-1], 32).flatten(-2)


FEW_ROWS = 8  # rows `tile_rows` reads one view at a time


def tile_rows(tiled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` ([n]) of a matrix held in tiles of 16 rows, [T, C, 16, ...] (`Tiles.q` viewed as its values,
    `Tiles.s`): row i is lane i % 16 of tile i // 16, [n, C, ...]."""
    if 0 < len(ids) <= FEW_ROWS:  # a step's lookups: a strided view per row, stacked (a third of the gather's time)
        return torch.stack([tiled[i // TILE, :, i % TILE] for i in ids.tolist()])
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
    s16 = torch.rand(20, 4, generator=g) * 0.1
    q4 = torch.randint(0, 16, (20, 64), generator=g)
    m = -8 * s
    q8 = torch.randint(-128, 128, (20, 64), generator=g)
    q5 = torch.randint(0, 32, (20, 64), generator=g)
    f16 = (torch.randn(20, 64, generator=g) * 0.1).half()
    scaled4, scaled8 = s.repeat_interleave(32, 1) * q4, s.repeat_interleave(32, 1) * q8
    scaled5, scaled16 = s.repeat_interleave(32, 1) * q5, s16.repeat_interleave(16, 1) * q8
    w4, w5 = scaled4 + m.repeat_interleave(32, 1), scaled5 + m.repeat_interleave(32, 1)
    scaled50 = s.repeat_interleave(32, 1) * (q5 - 16)  # Q5_0's
    # K-quant-like scales (a float16 d per 256 inputs times small integers), which the tiles keep in two levels
    x2 = torch.randn(3, 256, generator=g)
    d2 = (torch.rand(20, 1, generator=g) * 0.01).half().float()
    s2, m2 = d2 * torch.randint(0, 64, (20, 8), generator=g), -d2 * torch.randint(0, 64, (20, 8), generator=g)
    s6 = d2 * torch.randint(-128, 128, (20, 16), generator=g)
    q42, q62 = torch.randint(0, 16, (20, 256), generator=g), torch.randint(-32, 32, (20, 256), generator=g)
    w42 = s2.repeat_interleave(32, 1) * q42
    w62 = s6.repeat_interleave(16, 1) * q62
    two = [(Tiles.q4(q42, s2, m2, lib, int8=True), w42 + m2.repeat_interleave(32, 1), w42, x2),
           (Tiles.q8(q62, s6, lib), w62, w62, x2)]
    if two_level_scales() and any(tiles.scales != SCALES_TWO_LEVEL for tiles, *_ in two):
        return False
    one = [*((Tiles.q4(q4, s, m, lib, int8=i8), w4, scaled4) for i8 in (False, True)),
           *((Tiles.q8(q8, s, lib, int8=i8), scaled8, scaled8) for i8 in (False, True)),
           (Tiles.q8(q5, s, lib, m=m), w5, scaled5), (Tiles.q8(q8, s16, lib), scaled16, scaled16),
           (Tiles.q5(q5, s, lib, m=m), w5, scaled5), (Tiles.q5(q5 - 16, s, lib), scaled50, scaled50),
           (Tiles.f16(f16, lib), f16, None)]
    for tiles, w, scaled, xin in [(*case, x) for case in one] + two:
        want = xin.double() @ w.double().t()
        rounded = tiles.kind in INT8_KINDS
        slack = activation_error(xin) @ scaled.double().abs().t() if rounded else 0
        if not ((tiles(xin).double() - want).abs() <= slack + 1e-5 * float(want.abs().max())).all():
            return False
    return True


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--lint"]:
        sys.exit("usage: python -m server.model.cpu_kernels --lint")
    problems = lint()
    print("\n\n".join(problems) or f"csrc/kernels.c compiles warning-free for {', '.join(ISA_FLAGS)}")
    sys.exit(1 if problems else 0)
