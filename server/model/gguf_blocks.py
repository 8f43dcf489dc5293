"""GGUF block types read into the kernels' form: integer values, a float32 scale per group, a minimum where the type
has one, exactly the weights ggml's own dequantization gives (w = s q + m with s and m in float32 as ggml computes
them: a K-quant's super-block scale times its 6- or 8-bit sub-block scale).

| type | per weight | read as | group | values | served by |
|---|---|---|---|---|---|
| Q4_0 | 4.5 bits | d (q - 8) | 32 | q in [0, 15] | `Q4Linear` |
| Q4_1 | 5 bits | d q + m | 32 | q in [0, 15] | `Q4Linear` |
| Q4_K | 4.5 bits | (d sc) q - (dmin mn) | 32 | q in [0, 15] | `Q4Linear` |
| Q5_0 | 5.5 bits | d (q - 16) | 32 | q - 16 in [-16, 15] | `Q8Linear` |
| Q5_1 | 6 bits | d q + m | 32 | q in [0, 31] | `Q8Linear` with mins |
| Q5_K | 5.5 bits | (d sc) q - (dmin mn) | 32 | q in [0, 31] | `Q8Linear` with mins |
| Q6_K | 6.6 bits | (d sc) (q - 32) | 16 | q - 32 in [-32, 31] | `Q8Linear`, groups of 16 |
| Q8_0 | 8.5 bits | d q | 32 | q in [-128, 127] | `Q8Linear` |

Row-major: a tensor of `rows` rows holds each row's blocks one after another along its inputs. `decode` returns
`Blocks` whose `dequantize()` equals gguf-py's reference dequantization bit for bit (tests check it per type).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK_K = 256  # weights per K-quant super-block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_SIZE = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}
SERVED = tuple(BLOCK_BYTES)  # the block types kept as blocks; other types are dequantized


@dataclass
class Blocks:
    """A tensor's weights as w = scales q + mins per group of `group` inputs (mins per 32 inputs, or None)."""

    q: torch.Tensor  # [rows, in] int32
    scales: torch.Tensor  # [rows, in / group] float32
    mins: torch.Tensor | None  # [rows, in / 32] float32
    group: int
    four_bit: bool  # q fits 4 bits unsigned (Q4Linear), else int8 (Q8Linear)

    def dequantize(self) -> torch.Tensor:
        rows, inputs = self.q.shape
        w = (self.q.float().view(rows, -1, self.group) * self.scales[..., None]).view(rows, inputs)
        if self.mins is not None:
            w = w + self.mins.repeat_interleave(32, dim=1)
        return w

    def take(self, rows: slice | torch.Tensor) -> Blocks:
        """The blocks of some output rows (a permutation, or a fused tensor's share)."""
        mins = self.mins[rows] if self.mins is not None else None
        return Blocks(self.q[rows], self.scales[rows], mins, self.group, self.four_bit)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 8 six-bit scales and mins per super-block from its 12 bytes (ggml's get_scale_min_k4)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _t(a: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, -1)


def decode(kind: str, data: np.ndarray, rows: int) -> Blocks:
    """A tensor of `kind` (one of `SERVED`) with `rows` rows, from its raw bytes."""
    b = np.ascontiguousarray(data).view(np.uint8).reshape(-1, BLOCK_BYTES[kind])
    n = b.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        head = 4 if kind == "Q4_1" else 2
        d = _f16(b[:, 0:2])[:, 0]
        qs = b[:, head:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)
        m = _f16(b[:, 2:4])[:, 0] if kind == "Q4_1" else -8 * d  # Q4_0: d (q - 8), -8 d exact
        return Blocks(_t(q, rows), _t(d, rows), _t(m, rows), 32, True)
    if kind == "Q8_0":
        return Blocks(_t(b[:, 2:].view(np.int8).astype(np.int32), rows), _t(_f16(b[:, 0:2])[:, 0], rows), None, 32,
                      False)
    if kind in ("Q5_0", "Q5_1"):
        head = 4 if kind == "Q5_1" else 2
        d = _f16(b[:, 0:2])[:, 0]
        qh = b[:, head:head + 4].copy().view(np.uint32)[:, 0]
        qs = b[:, head + 4:]
        high = ((qh[:, None] >> np.arange(32, dtype=np.uint32)[None]) & 1).astype(np.uint8)
        q = (np.concatenate([qs & 15, qs >> 4], axis=-1) | (high << 4)).astype(np.int32)
        if kind == "Q5_1":
            return Blocks(_t(q, rows), _t(d, rows), _t(_f16(b[:, 2:4])[:, 0], rows), 32, False)
        return Blocks(_t(q - 16, rows), _t(d, rows), None, 32, False)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # [n, 1]
        sc, mn = _scale_min_k4(b[:, 4:16])
        scales = (d * sc).astype(np.float32)  # [n, 8]: per 32 weights, as ggml's d * sc
        mins = -(dmin * mn).astype(np.float32)
        if kind == "Q4_K":
            qs = b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            q = (qs & 15).reshape(n, QK_K).astype(np.int32)
            return Blocks(_t(q, rows), _t(scales, rows), _t(mins, rows), 32, True)
        qh, qs = b[:, 16:48], b[:, 48:]
        low = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = (low.reshape(n, 8, 32) | (high << 4)).reshape(n, QK_K).astype(np.int32)
        return Blocks(_t(q, rows), _t(scales, rows), _t(mins, rows), 32, False)
    if kind == "Q6_K":
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8).astype(np.float32), _f16(b[:, 208:210])
        low = ((ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15)
        high = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
        q = (low.reshape(n, 2, 4, 32) | (high << 4)).astype(np.int32) - 32
        return Blocks(_t(q.reshape(n, QK_K), rows), _t((d * sc).astype(np.float32), rows), None, 16, False)
    raise ValueError(f"block type {kind} is not read as blocks")
