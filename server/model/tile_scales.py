"""A tile's scales in two levels (csrc/specula.h's SCALES_TWO_LEVEL), as a K-quant file keeps them: per tile and
super-block of 256 inputs a float32 d for each of its 16 outputs, then each group's int8 sub-scales, the kernels
multiplying d * sub per group in float32. The product is exact (an fp16 d times a 6- or 8-bit integer), so the
kernels see the same float32 scales as before, bit for bit, in 2.7x fewer bytes (Q4_K: 0.75 -> 0.59 bytes a
weight). The form is recovered from the float32 scales themselves (`two_level`) and checked exactly; scales that have
none (Q8_0's, Q5_0's, rows not whole super-blocks) stay float32. cpu_kernels.Tiles holds the result."""

from __future__ import annotations

import os

import torch

from server.model.tile_layouts import TILE

SCALES_F32, SCALES_TWO_LEVEL = 0, 1  # csrc/specula.h's enum specula_scales: the form of a tile's scales


def two_level_scales() -> bool:
    """Whether int8-activation tiles keep their scales in two levels where they can (`Tiles`; the same bits, fewer
    bytes): `SPECULA_TWO_LEVEL_SCALES=0` keeps float32 per group (for A/B measurement)."""
    return os.environ.get("SPECULA_TWO_LEVEL_SCALES", "1").lower() not in ("0", "false", "no", "off")


TWO_LEVEL_ROWS = 4096  # tiles `two_level` converts at a time (its temporaries: a few times their scales in int64)


def two_level(s: torch.Tensor, per: int) -> torch.Tensor | None:
    """Tiled scales s [T, G, 16] float32 in two levels (csrc/specula.h's SCALES_TWO_LEVEL): per tile and super-block
    of `per` groups, 16 float32 d then [per][16] int8 sub-scales with d * sub == s exactly in float32; None where
    some super-block has no such form (G not a multiple of `per`, or scales that are not one number's small
    multiples). Exact by construction and checked: d is the gcd of the super-block's scales as dyadic rationals
    (each s = mantissa 2^e), so every s / d is an integer; a K-quant's d sc gives d' = d gcd(sc) and s / d' = sc /
    gcd(sc), within the int8 range its 6- or 8-bit sc had."""
    tiles, groups, lanes = s.shape
    if groups % per or not s.numel():
        return None
    blocks = groups // per
    out = torch.empty(tiles, blocks, 16 + 4 * per)  # floats: 16 d, then per x 16 int8s in 4 x per floats
    for a in range(0, tiles, TWO_LEVEL_ROWS):
        b = min(tiles, a + TWO_LEVEL_ROWS)
        part = s[a:b].view(b - a, blocks, per, lanes).transpose(2, 3).double()  # [t, B, 16, per]
        mantissa, exponent = torch.frexp(part)
        ints = (mantissa * 2.0**24).long()  # exact: a float32's 24-bit significand
        exponent = exponent.long() - 24
        nonzero = ints != 0
        low = torch.where(nonzero, exponent, torch.iinfo(torch.int64).max).amin(-1, keepdim=True)
        low = torch.where(nonzero.any(-1, keepdim=True), low, 0)
        shift = torch.where(nonzero, exponent - low, 0)
        if int(shift.max()) > 30:  # the super-block's scales span more than int8 multiples could
            return None
        ints = ints << shift  # every scale an integer multiple of 2^low
        gcd = ints[..., 0].abs()
        for i in range(1, per):
            gcd = torch.gcd(gcd, ints[..., i])
        sub = ints // gcd.clamp_min(1)[..., None]  # exact: gcd divides each
        if sub.numel() and (int(sub.min()) < -128 or int(sub.max()) > 127):
            return None
        d = torch.ldexp(gcd.double(), low[..., 0]).float()  # [t, B, 16]: an integer below 2^55 times 2^low
        sub8 = sub.to(torch.int8)
        if not torch.equal(d[..., None] * sub8.float(), part.float()):
            return None
        out[a:b, :, :16] = d
        out[a:b, :, 16:] = sub8.transpose(2, 3).contiguous().view(b - a, blocks, per * lanes).view(torch.float32)
    return out.view(tiles, -1)


def group_scales(blocks: torch.Tensor, tiles: int, per: int) -> torch.Tensor:
    """The float32 scales [tiles, G, 16] of two-level scales (`two_level`'s form, `per` groups a super-block)."""
    blocks = blocks.view(tiles, -1, 16 + 4 * per)  # [T, super-blocks, 16 d + per x 16 int8 as floats]
    d = blocks[..., :16]  # [T, B, 16]
    sub = blocks[..., 16:].contiguous().view(torch.int8).view(tiles, -1, per, TILE)
    return (d[:, :, None, :] * sub.float()).view(tiles, -1, TILE)
