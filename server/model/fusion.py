"""Fused products: several quantized layers that read the same input (q, k and v; gate and up) as one kernel over
their weights side by side (the lean forward's, lean_forward.py): one call instead of several."""

from __future__ import annotations

import torch

from server.model.quantized import Kernel, Q4Linear, Q8Linear, QuantLinear, _packed_from


def fused(layers: list[QuantLinear]) -> Kernel | None:
    """One kernel computing several layers that read the same input (q, k and v; gate and up), their outputs
    side by side: one call instead of several (each call costs ~20 us of dispatch on top of its bytes). The
    same arithmetic per output as each layer's own kernel. None when they cannot share a kernel (kinds, groups or
    minimums differ, biases on some only, another device, no kernel)."""
    first = layers[0]
    if any(type(layer) is not type(first) for layer in layers):
        return None
    if len({layer.bias is None for layer in layers}) > 1:
        return None
    if not isinstance(first, Q4Linear | Q8Linear) or not first.runs_kernel():
        return None
    bias = torch.cat([layer.bias for layer in layers]) if first.bias is not None else None
    if isinstance(first, Q4Linear):
        merged: QuantLinear = Q4Linear(torch.cat([layer.qweight for layer in layers]),
                                       torch.cat([layer.scales_zeros for layer in layers], dim=1), bias)
    else:
        if len({(layer.group, layer.mins is None) for layer in layers}) > 1:
            return None
        mins = torch.cat([layer.mins for layer in layers]) if first.mins is not None else None
        merged = Q8Linear(torch.cat([layer.qweight for layer in layers]), torch.cat([layer.scales for layer in layers]),
                          bias, mins)
    call = merged.kernel()
    _packed_from(*layers)
    for layer in layers:
        layer._int8 = merged._int8
    return call
