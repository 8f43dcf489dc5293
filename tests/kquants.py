"""K-quant encoders for test fixtures (gguf-py decodes Q4_K, Q5_K and Q6_K but cannot write them): plain min/max
rounding per sub-block, not llama.cpp's search for the best scales, so a tiny model's file is a valid K-quant file
whose weights are close to the model's. gguf-py's own dequantization is the reference the tests read them with.

`quantize(values, kind)` takes float32 rows whose length is a multiple of 256 and returns the raw blocks, row
after row, as `gguf.quants.quantize` does for the types it knows (and defers to it for those)."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8).reshape(x.shape[0], -1)


def _scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block into its 12 bytes (the inverse of ggml's get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 15) | ((mn[:, j + 4] & 15) << 4)
    return out


def _k_with_min(blocks: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's fields for blocks [n, 256]: d, dmin (fp16), 6-bit scales and mins [n, 8], values [n, 256]."""
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / top
    d = np.maximum(scale.max(-1), 1e-12) / 63
    dmin = np.maximum((-lo).max(-1), 1e-12) / 63
    d16, dmin16 = _f16(d), _f16(dmin)
    sc = np.clip(np.rint(scale / d16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    s = d16.astype(np.float32)[:, None] * sc
    m = dmin16.astype(np.float32)[:, None] * mn
    q = np.clip(np.rint((sub + m[..., None]) / np.maximum(s, 1e-12)[..., None]), 0, top).astype(np.uint8)
    return d16, dmin16, sc, mn, q.reshape(-1, QK_K)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_with_min(blocks, 15)
    qs = (q.reshape(-1, 4, 2, 32)[:, :, 0] | (q.reshape(-1, 4, 2, 32)[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_bytes(d[:, None]), _bytes(dmin[:, None]), _scales_mins(sc, mn), qs], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_with_min(blocks, 31)
    low = q & 15
    qs = (low.reshape(-1, 4, 2, 32)[:, :, 0] | (low.reshape(-1, 4, 2, 32)[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 8, 32)  # bit k of qh[l]: sub-block k's value l
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for k in range(8):
        qh |= (high[:, k] << k).astype(np.uint8)
    return np.concatenate([_bytes(d[:, None]), _bytes(dmin[:, None]), _scales_mins(sc, mn), qh, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 32
    d16 = _f16(np.maximum(scale.max(-1), 1e-12) / 127)
    sc = np.clip(np.rint(scale / d16.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
    s = d16.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(sub / s[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [h, a, l]
    ql = np.zeros((q.shape[0], 2, 64), dtype=np.uint8)
    qh = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for a in range(4):
        ql[:, :, (a % 2) * 32:(a % 2) * 32 + 32] |= (q[:, :, a] & 15) << (4 * (a // 2))
        qh |= (q[:, :, a] >> 4) << (2 * a)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _bytes(d16[:, None])], axis=1)


ENCODERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize(values: np.ndarray, kind: str) -> np.ndarray:
    """Rows of float32 values as `kind`'s raw blocks [rows, bytes per row]."""
    import gguf
    from gguf.quants import quantize as reference

    if kind not in ENCODERS:
        return reference(values, gguf.GGMLQuantizationType[kind])
    rows = values.shape[0]
    return ENCODERS[kind](values.astype(np.float32).reshape(-1, QK_K)).reshape(rows, -1)
