"""The byte layouts of the narrow tiles on int8 activations (csrc/int8.h reads them): values of 5 and 6 bits in five
eighths and three quarters of a byte, each group of 32 inputs of a tile's 16 outputs as the low 4 bits in the Q4
tiles' order (`nibble_quads`, 256 bytes) and then the bits above them in planes:

* 5 bits (Q5_0, Q5_1, Q5_K; 320 bytes a group): 32 bytes for outputs 0-7 and 32 for outputs 8-15, bit u of byte
  4j + e being the fifth bit of input 4u + e of output j;
* 6 bits (Q6_K; 384 bytes a group): four planes of 32 bytes, [outputs 0-7, 8-15][quads 0-3, 4-7], bits 2i and 2i + 1
  of byte 4j + e being the top 2 bits of input 4(4h + i) + e of output j.

The packers take unsigned values u [tiles, K, 16] (a tile's outputs last) and give [tiles, K/32, bytes a group]; the
readers take some rows' groups [n, K/32, bytes a group] and their row ids and give u [n, K/32, 8 quads, 4 inputs].
cpu_kernels.Tiles holds the results (`q4`, `q5`, `q6`, `values`)."""

from __future__ import annotations

import torch

TILE = 16  # outputs a tile holds (one 512-bit vector of float32; cpu_kernels and tile_scales import it)


def nibble_quads(u: torch.Tensor) -> torch.Tensor:
    """The low 4 bits of u [tiles, K, 16] in the Q4 tiles' order, [tiles, K/2, 16] bytes: per 4 inputs 4u..4u+3, 32
    bytes, byte 4j + e holding input 4u + e of output j (low nibble) and of output j + 8 (high)."""
    t, k = u.shape[0], u.shape[1]
    quads = (u & 15).reshape(t, k // 4, 4, TILE)  # [tiles, u, e, j]
    return (quads[..., :8] | (quads[..., 8:] << 4)).transpose(2, 3).reshape(t, k // 2, TILE)


def five_bits(u: torch.Tensor) -> torch.Tensor:
    """u [tiles, K, 16] in [0, 31] as 5-bit groups [tiles, K/32, 320]."""
    t, g = u.shape[0], u.shape[1] // 32
    fifth = (u >> 4).reshape(t, g, 8, 4, TILE).permute(0, 1, 4, 3, 2)  # [tiles, group, j, e, quad]
    bits = fifth[..., 0].clone()
    for quad in range(1, 8):
        bits |= fifth[..., quad] << quad
    return torch.cat([nibble_quads(u).reshape(t, g, 256), bits.reshape(t, g, 64)], dim=2)


def six_bits(u: torch.Tensor) -> torch.Tensor:
    """u [tiles, K, 16] in [0, 63] as 6-bit groups [tiles, K/32, 384]."""
    t, g = u.shape[0], u.shape[1] // 32
    top = (u >> 4).reshape(t, g, 2, 4, 4, 2, 8)  # [tiles, group, h, i, e, outputs 0-7 | 8-15, j]
    top = top.permute(0, 1, 5, 2, 6, 4, 3)  # [tiles, group, half of the outputs, h, j, e, i]
    planes = top[..., 0] | (top[..., 1] << 2) | (top[..., 2] << 4) | (top[..., 3] << 6)
    return torch.cat([nibble_quads(u).reshape(t, g, 256), planes.reshape(t, g, 128)], dim=2)


def _lanes(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's lane in its tile [n, 1, 1, 1] and the bytes of its 4 inputs in a quad's 32 [n, 1, 1, 4]."""
    lane = (ids % TILE)[:, None, None, None]
    return lane, 4 * (lane % 8) + torch.arange(4)


def _nibbles_read(groups: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The low 4 bits of rows `ids` from their groups' first 256 bytes, [n, G, 8 quads, 4 inputs]."""
    lane, byte = _lanes(ids)
    nib = groups[:, :, :256].reshape(len(ids), -1, 8, 32).long()  # [n, G, u, 32]
    nib = torch.take_along_dim(nib, byte.expand(-1, nib.shape[1], 8, -1), dim=3)
    return torch.where(lane >= 8, nib >> 4, nib & 15)


def five_bits_read(groups: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """u of rows `ids` from their 5-bit groups [n, G, 320], [n, G, 8, 4]."""
    lane, byte = _lanes(ids)
    bits = groups[:, :, 256:].reshape(len(ids), -1, 2, 32).long()  # [n, G, half, 32]
    bits = torch.take_along_dim(bits, (lane >= 8).long().expand(-1, bits.shape[1], 1, 32), dim=2)  # [n, G, 1, 32]
    bits = torch.take_along_dim(bits, byte.expand(-1, bits.shape[1], -1, -1), dim=3)  # [n, G, 1, 4]
    return _nibbles_read(groups, ids) + 16 * ((bits >> torch.arange(8)[None, None, :, None]) & 1)


def six_bits_read(groups: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """u of rows `ids` from their 6-bit groups [n, G, 384], [n, G, 8, 4]."""
    lane, byte = _lanes(ids)
    planes = groups[:, :, 256:].reshape(len(ids), -1, 2, 2, 32).long()  # [n, G, half, h, 32]
    half = (lane >= 8).long()[..., None].expand(-1, planes.shape[1], 1, 2, 32)
    planes = torch.take_along_dim(planes, half, dim=2)[:, :, 0]  # [n, G, h, 32]
    planes = torch.take_along_dim(planes, byte.expand(-1, planes.shape[1], 2, -1), dim=3)  # [n, G, h, 4]
    top = (planes[:, :, :, None, :] >> (2 * torch.arange(4))[None, None, None, :, None]) & 3  # [n, G, h, i, 4]
    return _nibbles_read(groups, ids) + 16 * top.reshape(len(ids), -1, 8, 4)
