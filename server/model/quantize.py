"""A dense model's linear layers quantized in place: the `int8` weights setting (any checkpoint) and, for tests and
tiny files, Q4_1 / Q8_0 blocks; its LM head becomes a table of fp16 values (tables.py)."""

from __future__ import annotations

from torch import nn

from server.model.quantized import GROUP, QUANT_KINDS, Int8Linear
from server.model.tables import model_head_as_table


def quantize_linears(model: nn.Module, kind: str = "int8") -> int:
    """Replace every plain `nn.Linear` of `model` (the LM head included) by a quantized layer of `kind`
    ("int8": per-channel, the `int8` setting; "q4" / "q8": Q4_1 / Q8_0 blocks, for tests); the layers
    replaced. Layers whose input size is not a multiple of 32 stay dense for the block kinds."""
    count = 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear or child is head:
                continue
            if kind != "int8" and child.in_features % GROUP:
                continue
            w = child.weight.detach()
            layer = Int8Linear.quantize(w, child.bias) if kind == "int8" else QUANT_KINDS[kind].quantize(w)
            if kind != "int8" and child.bias is not None:
                layer.bias = nn.Parameter(child.bias.detach().float(), requires_grad=False)
            setattr(module, child_name, layer)
            count += 1
    if type(head) is nn.Linear and head.bias is None:
        model_head_as_table(model)
    return count
