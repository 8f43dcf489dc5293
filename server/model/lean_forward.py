"""A leaner forward for Llama-family decoders: transformers' computation with fewer operations.

A one-token step of a small model is bound by its weights (the linear layers stream every weight once),
plus a few microseconds of dispatch for every other operation: norms, rotary embedding, reshapes, the
module calls, transformers' output-capturing hooks and keyword plumbing. On the 2-core development
machine that dispatch was about 40% of SmolLM2-135M's one-token step (40 ms against 24 ms for the linear
layers alone), and it is paid again on every verify pass whatever its width. `LeanForward` runs the same
layers over the same weights and the same cache with about half the operations: one fused RMSNorm call
per norm, the rotary embedding applied without the module layers around it, the engine's attention
function (server/model/attention.py) called directly, and no hooks.

It is the same computation, not a different model: the logits agree with transformers' to float
rounding (about 1e-6 relative), the way one GEMM shape agrees with another. Which forward the engine
uses only changes speed; speculation stays lossless against whichever target it runs, because drafts
are verified by that same forward.

On CPU, in float32 or bfloat16, the linear layers multiply through oneDNN with their weights reordered once
into its blocked layout (`PackedLinear`) instead of through `F.linear`'s MKL GEMM. Measured on the 2-core
development machine (SmolLM2-135M, fp32): MKL's path for a few rows costs about one matrix-vector product
per row (a pass of 2 tokens 1.6x one token; the 576 x 49152 LM head 7.2 ms for one token, 15 ms for
nine), where oneDNN's kernel streams the weights once for all rows (the LM head 2.3 ms for one token,
2.8 ms for nine): a one-token step went from 41 to 22 ms, and a 9-token verify pass from 1.6x to 1.2x of
it. The products agree with `F.linear` to float rounding (about 1e-7 relative). A weight is reordered
once (again if it is replaced or changes in place); the dense weights stay for whatever else reads them
(embeddings tied to the LM head, transformers' forward), so on CPU the linear layers' weights are held
twice, unless the engine that runs the model drops them (`LeanForward.release_dense`: `build_engine`
does, for the server and `generate`). Anything else (a GPU, fp16, a torch without oneDNN, a reorder that
does not reproduce `F.linear` on a probe) keeps `F.linear`.

A model whose linear layers are held quantized (quantized.py: a GGUF's Q4_0 / Q4_1 / Q8_0 tensors, or `int8`
weights) multiplies through those layers' own weight-only kernels instead; q, k and v, and gate and up, each
run as one call of the kernel over their weights side by side (`fusion.fused`): the same sums, a third of
the calls. Its LM head (`TableHead`) gives fp32 logits from fp16 weights.

What the layers do is the family's `Spec` (server/model/families/): which norms and where, q/k norms, biases,
SiLU or GELU, each layer's window (the engine's mask cut to each query's last W live keys) and rotary set, score
and logit caps. The server's own tree (decoder.py) serves every family; transformers' own Llama, Mistral and Qwen2
trees (tools that load transformers' modules) run too. Linear layers must be plain `nn.Linear` or quantized, the
attention the engine's grouped-head function; any other model keeps transformers' forward, which is also what
`ModelRunner(lean=False)` asks for (tests compare the two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from server.model import families
from server.model.attention import Packing, gqa_sdpa_attention, packs
from server.model.cpu_decoder import CpuDecoder
from server.model.decoder import Decoder, activate, layer_norms, soft_cap, window_mask
from server.model.decoder import rms_norm as _rms_norm
from server.model.decoder import rotate as _rotate
from server.model.decoder import signed_sin as _signed
from server.model.families.base import Spec
from server.model.fusion import fused
from server.model.memory import drop_file_pages
from server.model.quantized import QuantLinear
from server.model.tables import TableHead

# transformers' decoder classes (by name, so a model type transformers does not ship here needs no import) whose
# modules are the server's tree's (decoder.py) in Llama's shape: the lean forward runs them as their family's `Spec`
# says (tools that load transformers' modules); every family runs on the server's own tree (`Decoder`).
_BASES = {"LlamaModel", "MistralModel", "Qwen2Model"}


def _spec(base: nn.Module) -> Spec | None:
    """What a decoder's layers do: the server's tree carries its `Spec`; transformers' Llama-shaped trees are read
    from their config (None: not a family the lean forward runs)."""
    return base.spec if isinstance(base, Decoder) else families.spec_of(base.config)


@dataclass(frozen=True)
class LeanOutput:
    """What `ModelRunner` reads of transformers' outputs."""

    logits: torch.Tensor | None  # [batch, kept positions, vocab] in the model's dtype; None without an LM head
    hidden_states: tuple[torch.Tensor, ...] | None  # transformers' layout: embeddings, after each layer, final norm
    last_hidden_state: torch.Tensor  # after the final norm


def _projections(layer: nn.Module) -> tuple[nn.Linear, ...]:
    """A decoder layer's linear layers in the order the lean forward applies them: q, k, v, o, gate, up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _made_for(model: nn.Module, base: nn.Module) -> tuple[object, ...]:
    """What a lean forward's kernels depend on: the weights' dtype and device, the LM head (None for a
    base model) and every layer's projections (as objects: a module replaced since makes a new forward)."""
    weight = next(model.parameters())
    lm_head = model.get_output_embeddings() if model is not base else None
    return weight.dtype, weight.device, lm_head, *(p for layer in base.layers for p in _projections(layer))


class _Shared(dict):
    """A model's lean forwards by kernel choice (`LeanForward.of`), kept on the model. A deep copy of the
    model has weights of its own, so it starts without them."""

    def __deepcopy__(self, memo: dict[int, object]) -> _Shared:
        return _Shared()


def _plain_linear(module: object) -> bool:
    """A linear layer the lean forward can run: `nn.Linear` itself (not a subclass that changes its
    forward) or a weight-only quantized layer with its own kernel."""
    return type(module) is nn.Linear or isinstance(module, QuantLinear)


def _dense(owner: nn.Module, weight: str, bias: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.linear(x, getattr(owner, weight), getattr(owner, bias) if bias else None)


class PackedLinear:
    """`x @ W.T + b` through oneDNN's fp32/bf16 kernel, W reordered once (see the module doc).

    W is `owner.<weight>` (an `nn.Linear`'s weight, or a head's output matrix) and b `owner.<bias>`, read
    at every call, so a weight that is replaced, changed in place or given new storage (`Module.to`
    keeps the parameter and its version, not its data) is reordered again."""

    __slots__ = ("owner", "weight_name", "bias_name", "source", "version", "pointer", "packed", "released")

    def __init__(self, owner: nn.Module, weight: str = "weight", bias: str | None = "bias") -> None:
        self.owner, self.weight_name, self.bias_name = owner, weight, bias
        self.released = False
        self._pack()

    def _pack(self) -> None:
        self.source = getattr(self.owner, self.weight_name)
        self.version = self.source._version
        self.pointer = self.source.data_ptr()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.source.detach(), None)

    def _follow(self) -> None:
        """Reorder again if the weight was replaced or changed (loading, training, a dtype) since."""
        weight = getattr(self.owner, self.weight_name)
        if weight is not self.source or weight._version != self.version or weight.data_ptr() != self.pointer:
            self._pack()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.released:
            self._follow()
        bias = getattr(self.owner, self.bias_name) if self.bias_name else None
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def release(self) -> torch.Tensor | None:
        """Drop the dense weight this kernel multiplies a reordered copy of, for a model only this kernel
        runs (a server's): the owner's parameter becomes an empty tensor, so whatever still multiplies by it
        raises (a `meta` tensor would not: `F.linear` of a CPU input by one returns uninitialised
        numbers). Returns the dropped weight (None if it was dropped before)."""
        if self.released:
            return None
        self._follow()
        weight = getattr(self.owner, self.weight_name)
        empty = torch.empty(0, dtype=weight.dtype, device=weight.device)
        setattr(self.owner, self.weight_name, nn.Parameter(empty, requires_grad=False))
        self.source, self.released = getattr(self.owner, self.weight_name), True
        return weight


def packs_linears(model: nn.Module) -> bool:
    """Whether `model`'s linear layers run through `PackedLinear`: on CPU, fp32 or bf16, with oneDNN."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


def linear_kernel(
    owner: nn.Module, pack: bool, weight: str = "weight", bias: str | None = "bias"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x @ owner.<weight>.T + owner.<bias>` as the lean forward runs it: `PackedLinear` when `pack` and
    when a probe through it reproduces `F.linear` (a torch whose private oneDNN ops behave otherwise
    keeps F.linear), else `F.linear`. A quantized layer or LM head (quantized.py) runs its own kernel."""
    if isinstance(owner, QuantLinear | TableHead) and weight == "weight":
        return owner.kernel()
    if not pack:
        return _dense(owner, weight, bias)
    try:
        packed = PackedLinear(owner, weight, bias)
        w = getattr(owner, weight)
        probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        with torch.no_grad():
            got = packed(probe).float()
            want = F.linear(probe, w, getattr(owner, bias) if bias else None).float()
        tolerance = 1e-4 if w.dtype == torch.float32 else 3e-2
        if torch.allclose(got, want, rtol=tolerance, atol=tolerance * float(want.abs().max())):
            return packed
    except (RuntimeError, AttributeError):
        pass
    return _dense(owner, weight, bias)


_FUSED = (0, 1, 2, 4, 5)  # the projections (`_projections` order) a `_Fused` layer runs as two calls


@dataclass(frozen=True)
class _Fused:
    """A quantized layer's q, k, v and gate, up projections, each set as one kernel (`fusion.fused`)."""

    qkv: Callable[[torch.Tensor], torch.Tensor]  # [..., hidden] -> [..., q + k + v]
    qkv_sizes: tuple[int, int, int]
    gate_up: Callable[[torch.Tensor], torch.Tensor]  # [..., hidden] -> [..., 2 x intermediate]


def _fused(layer: nn.Module) -> _Fused | None:
    attn, mlp = layer.self_attn, layer.mlp
    qkv_layers = [attn.q_proj, attn.k_proj, attn.v_proj]
    if not all(isinstance(p, QuantLinear) for p in (*qkv_layers, mlp.gate_proj, mlp.up_proj)):
        return None
    qkv, gate_up = fused(qkv_layers), fused([mlp.gate_proj, mlp.up_proj])
    if qkv is None or gate_up is None:
        return None
    sizes = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
    return _Fused(qkv, sizes, gate_up)


class LeanForward:
    """A callable with the keyword interface `ModelRunner` gives transformers' causal LMs and base models."""

    def __init__(self, model: nn.Module, base: nn.Module, *, pack: bool | None = None) -> None:
        """`pack`: multiply through `PackedLinear` (None: where `packs_linears` says it can)."""
        self.base = base
        self.packed = packs_linears(model) if pack is None else pack
        lm_head = model.get_output_embeddings() if model is not base else None
        self.lm_head = linear_kernel(lm_head, self.packed) if lm_head is not None else None
        # quantized layers: q, k, v and gate, up as one kernel call each (None: called one by one)
        self.fused = [_fused(layer) for layer in base.layers]
        self.linears = [
            tuple(None if both is not None and j in _FUSED else linear_kernel(p, self.packed)
                  for j, p in enumerate(_projections(layer)))
            for layer, both in zip(base.layers, self.fused, strict=True)
        ]
        self.spec = _spec(base)
        assert self.spec is not None, "LeanForward.of checks the family"
        # every layer in one C call for steps and verify passes, where the layers allow it (cpu_decoder.py)
        self.decoder = CpuDecoder.of(base, self.spec, self.fused, self.linears)
        self.made_for = _made_for(model, base)  # `of` shares this forward while the model still matches it
        # an LM head tied to the input embeddings keeps its dense weight: the embedding lookup reads it
        embeddings = base.get_input_embeddings() if lm_head is not None else None
        self.head_tied = embeddings is not None and (
            lm_head.table is embeddings if isinstance(lm_head, TableHead) else lm_head.weight is embeddings.weight)
        # the final norm: RMSNorm, or whatever module stands there (a draft head's decoder has an identity)
        rms = hasattr(base.norm, "variance_epsilon")
        self.final_norm = (lambda x: _rms_norm(x, base.norm)) if rms else base.norm

    @classmethod
    def of(cls, model: nn.Module, *, pack: bool | None = None) -> LeanForward | None:
        """The lean forward of `model`, or None when its layers are not exactly Llama's (see the module doc).

        One per model and kernel choice, shared by every runner over the model (the engine's, calibration's
        scratch runners): reordering the weights takes ~0.3 s and their size again (SmolLM2-135M). Made anew
        when the model's linear layers were replaced since."""
        base = model if model.get_output_embeddings() is None else getattr(model, "model", None)
        if base is None or not (type(base).__name__ in _BASES or isinstance(base, Decoder)) or not packs(model):
            return None
        if _spec(base) is None:
            return None
        lm_head = model.get_output_embeddings()
        if lm_head is not None and not (_plain_linear(lm_head) or isinstance(lm_head, TableHead)):
            return None
        for layer in base.layers:
            attn = layer.self_attn
            norms = [n for n in layer_norms(layer) if n is not None]
            if not all(_plain_linear(p) for p in _projections(layer)):
                return None
            if not all(hasattr(n, "variance_epsilon") for n in norms):
                return None
            if hasattr(attn, "sinks") or (hasattr(attn, "q_norm") and not isinstance(base, Decoder)):
                return None
        packed = packs_linears(model) if pack is None else pack
        shared: _Shared = model.__dict__.setdefault("_lean_forwards", _Shared())
        found = shared.get(packed)
        if found is None or found.made_for != _made_for(model, base):
            found = shared[packed] = cls(model, base, pack=packed)
        return found

    def packed_weights(self) -> list[torch.Tensor]:
        """The copies its kernels multiply: oneDNN's reordered weights (none when it runs `F.linear`) and the
        quantized kernels' own layouts (`tensors` of a quantized.py kernel; a server's model holds nothing else
        of those layers once `release_dense` ran)."""
        kernels = [k for layer in self.linears for k in layer] + [self.lm_head]
        kernels += [k for both in self.fused if both is not None for k in (both.qkv, both.gate_up)]
        packed = [k.packed for k in kernels if isinstance(k, PackedLinear)]
        return packed + [t for k in kernels for t in getattr(k, "tensors", ())]

    def release_dense(self) -> int:
        """Drop the dense weights the packed kernels were reordered from (`PackedLinear.release`): on CPU
        a model's linear layers are otherwise held twice (SmolLM2-135M: 418 MiB of its 513 MiB again). For a
        server, whose target runs only through this forward; transformers' forward of the model fails
        afterwards. Returns the bytes dropped (0 when nothing is packed)."""
        kernels = [k for layer in self.linears for k in layer]
        if not self.head_tied:
            kernels.append(self.lm_head)
        dropped = [w for w in (k.release() for k in kernels if isinstance(k, PackedLinear)) if w is not None]
        # a table tied to its head (Q8_0 blocks or fp16 values): lookups read the head kernel's tiles from here on
        table = getattr(self.base.get_input_embeddings(), "release", None)
        if self.head_tied and table is not None:
            dropped.extend(table())
        # quantized layers multiply copies in their kernels' layout: their own buffers are read no more
        for layer in self.base.layers:
            for p in _projections(layer):
                if isinstance(p, QuantLinear):
                    dropped.extend(p.release())
        drop_file_pages(dropped)  # weights read zero-copy from a file: their pages leave the RSS now
        return sum(w.numel() * w.element_size() for w in dropped)

    @torch.no_grad()
    def __call__(
        self,
        *,
        attention_mask: torch.Tensor,  # [batch, 1, W, length + W] additive (runner.py)
        position_ids: torch.Tensor,  # [batch, W], or [1, N] packed
        cache: Cache,
        input_ids: torch.Tensor | None = None,  # [batch, W] or [1, N]
        inputs_embeds: torch.Tensor | None = None,  # [batch, W, hidden] or [1, N, hidden]
        packing: Packing | None = None,
        logits_to_keep: int | None = 0,  # transformers' meaning (0: every position, n: the last n); None: no LM head
        logits_index: torch.Tensor | None = None,  # or the LM head on these flat positions only: logits [1, M, vocab]
        output_hidden_states: bool = False,
        use_cache: bool = True,  # the runner always writes the cache: accepted for transformers' keywords
    ) -> LeanOutput:
        base, spec = self.base, self.spec
        if inputs_embeds is not None:
            x = inputs_embeds
        else:
            x = base.embed(input_ids) if isinstance(base, Decoder) else base.embed_tokens(input_ids)
        rotations = base.rotations(x, position_ids) if isinstance(base, Decoder) else \
            [base.rotary_emb(x, position_ids)]  # [batch, W, rotary dim] each
        states = [x] if output_hidden_states else None
        if self.decoder is not None and self.decoder.takes(x):
            x, after = self.decoder(x, rotations, attention_mask, cache, packing, output_hidden_states)
            if states is not None:
                states += after[:-1]
            if self.decoder.final is None:
                x = self.final_norm(x)
        else:
            rotations = [(cos[:, :, None], _signed(sin[:, :, None])) for cos, sin in rotations]  # over heads
            x = self.final_norm(self._layers(x, rotations, attention_mask, cache, packing, states))
        if states is not None:
            states.append(x)
        logits = None
        if self.lm_head is not None and logits_index is not None:
            logits = self.lm_head(x.reshape(-1, x.shape[-1]).index_select(0, logits_index))[None]
        elif self.lm_head is not None and logits_to_keep is not None:
            logits = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        if logits is not None and spec.final_softcap:
            logits = soft_cap(logits, spec.final_softcap)
        return LeanOutput(logits, tuple(states) if states is not None else None, x)

    def _layers(
        self, x: torch.Tensor, rotations: list[tuple[torch.Tensor, torch.Tensor]], attention_mask: torch.Tensor,
        cache: Cache, packing: Packing | None, states: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """The decoder layers one torch operation at a time, as the family's `Spec` describes them; appends each
        layer's output to `states` (all but the last's). `rotations`: (cos, signed sin) per rotary set."""
        base, spec = self.base, self.spec
        batch, width = x.shape[:2]
        masks = {0: attention_mask}  # per window: the mask cut to each query's last W keys
        for w in set(spec.windows) - {0}:
            masks[w] = window_mask(attention_mask, w)
        for i, (layer, (q_proj, k_proj, v_proj, o_proj, gate, up, down), both) in enumerate(
            zip(base.layers, self.linears, self.fused, strict=True)
        ):
            attn = layer.self_attn
            before_attn, after_attn, before_mlp, after_mlp = layer_norms(layer)
            cos, sin = rotations[spec.rope_sets[i]]
            h = _rms_norm(x, before_attn)
            shape = (batch, width, -1, attn.head_dim)  # heads as the projection gives them (transformers' view)
            if both is not None:
                q_size, k_size, v_size = both.qkv_sizes
                q, k, v = both.qkv(h).split((q_size, k_size, v_size), dim=-1)
            else:
                q, k, v = q_proj(h), k_proj(h), v_proj(h)
            q, k = q.reshape(shape), k.reshape(shape)
            if spec.qk_norm:
                q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.reshape(shape).transpose(1, 2)  # [batch, heads, W, d]
            k, v = cache.update(k, v, i)
            o, _ = gqa_sdpa_attention(attn, q, k, v, masks[spec.windows[i]], scaling=attn.scaling, packing=packing,
                                      softcap=spec.attn_softcap)
            o = o_proj(o.reshape(batch, width, -1))
            x = x + (_rms_norm(o, after_attn) if after_attn is not None else o)
            h = _rms_norm(x, before_mlp)
            if both is not None:
                g, u = both.gate_up(h).chunk(2, dim=-1)
            else:
                g, u = gate(h), up(h)
            m = down(activate(g, spec.activation) * u)
            x = x + (_rms_norm(m, after_mlp) if after_mlp is not None else m)
            if states is not None and i < len(base.layers) - 1:
                states.append(x)
        return x
