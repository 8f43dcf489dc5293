"""The model runner: one model's batched forward over its `BatchKV` (masks, positions, outputs).

Every forward appends ragged new inputs to every row of the running batch: token ids, or input
embeddings (a draft head feeds the target's features, not tokens). It returns the logits of the fed
positions and, when asked, their hidden states: the output of the base model after its final norm,
which is what the LM head reads (index -1 of transformers' `hidden_states`), and optionally other
layers by index (0 = the embeddings, i = after decoder layer i). Proposers that read the target's
features (EAGLE-style heads) get them from here through the engine.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from server.model.attention import Packing, attends_wide, packs
from server.model.kv_cache import BatchKV
from server.model.kv_shape import KVShape
from server.model.lean_forward import LeanForward
from server.model.memory import tensor_bytes
from server.model.quantized import block_kernels
from server.model.static_step import StaticStep

Inputs = Sequence[Sequence[int]] | Sequence[torch.Tensor]  # per row: token ids, or embeddings [n_b, hidden]


@dataclass
class ForwardOutput:
    """What one forward computed for the fed positions.

    `flat_logits` and `flat_hidden` hold every position the model computed once, [N, ...], in the
    order it computed them (packed: `Packing`; else row after row, W each, padding included); row b's
    fed position j is flat row `index[b][j]`. `logits`, `hidden` and `layers` are the batch's padded
    layout [batch, W, ...] (zeros past each row's inputs when packed), built on first read. The verify
    step reads `of_rows`, so what follows its forward is paid per computed token, not per padded one.
    """

    flat_logits: torch.Tensor | None  # [N, vocab] float32; None when not asked for
    flat_hidden: torch.Tensor | None  # [N, hidden]: after the final norm (what the LM head reads)
    flat_layers: dict[int, torch.Tensor]  # chosen layer index -> [N, hidden]
    index: tuple[tuple[int, ...], ...]  # per row, the flat rows of its fed positions
    width: int  # the widest row
    pack: Packing | None  # how the tokens were packed; None when every row was padded to `width`
    # per row, the flat rows of `flat_logits` for its scored positions, when a forward scored only each
    # row's last positions (`ModelRunner.forward(scored=...)`); None: logits share `index`
    logit_index: tuple[tuple[int, ...], ...] | None = None

    @property
    def computed(self) -> int:
        """Positions the model computed: rows x W padded, the real tokens only when packed."""
        return self.pack.tokens if self.pack is not None else len(self.index) * self.width

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat output [N, ...] in the batch's padded layout [batch, W, ...]."""
        if self.pack is None:
            return flat.view(len(self.index), self.width, *flat.shape[1:])
        return _unpack(flat, self.pack)

    @cached_property
    def logits(self) -> torch.Tensor | None:
        assert self.logit_index is None, "a forward that scored some positions only: read `of_rows`"
        return self.padded(self.flat_logits) if self.flat_logits is not None else None

    @cached_property
    def hidden(self) -> torch.Tensor | None:
        return self.padded(self.flat_hidden) if self.flat_hidden is not None else None

    @cached_property
    def layers(self) -> dict[int, torch.Tensor]:
        return {i: self.padded(x) for i, x in self.flat_layers.items()}

    def of_rows(self, rows: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, hidden) of `rows`' fed positions, row after row ([sum of their inputs, ...]; logits of
        the scored positions only when the forward scored some): the flat tensors themselves when that is
        their order already (every row fed W tokens), else one gather."""
        order = [i for b in rows for i in self.index[b]]
        scored = order if self.logit_index is None else [i for b in rows for i in self.logit_index[b]]
        return _take(self.flat_logits, scored), _take(self.flat_hidden, order)


class ModelRunner:
    """Runs one model over the rows of its batch cache. Single-threaded, like the engine.

    `model` is a causal LM (logits and hidden states), or a base model without an LM head (a draft
    head's decoder: hidden states only, its final output as `hidden`).
    """

    def __init__(self, model: nn.Module, kv_slots: int | None = None, *, lean: bool = True,
                 kv_dtype: torch.dtype | None = None, kv_columns: int | None = None) -> None:
        """`kv_slots`: the cache's budget in tokens (rows x columns), allocated now; None: grown as needed;
        `kv_columns`: every row's columns, pinned (kv_cache.py; what static-shape passes need).
        `lean`: run Llama-family models through `LeanForward` (lean_forward.py; others always run
        transformers' forward); False runs transformers' forward for every model. `kv_dtype`: what its cache
        holds keys and values in (kv_shape.py `kv_precision`: narrower than the model, rounded when written;
        None: the model's dtype)."""
        self.model = model
        self.device = model.device
        # what its hidden states are in: its masks, fed embeddings and (by default) cache are made in it
        self.dtype = compute_dtype(model)
        self.has_lm_head = model.get_output_embeddings() is not None
        self.packs = packs(model)  # rows feeding different numbers of tokens are packed (attention.py)
        self.call = (LeanForward.of(model) if lean else None) or model  # the forward, with transformers' keywords
        # which forward runs (part of the calibration's key: each prices passes differently)
        lean_call = isinstance(self.call, LeanForward)
        self.forward_kind = "transformers" if not lean_call else "lean-onednn" if self.call.packed else "lean"
        kernels = block_kernels(model)  # which quantized kernels
        if kernels is not None:
            self.forward_kind += {"bf16": "+bf16-kernels", "float32": "+f32-blocks", "int8": "+q8-act-blocks"}[kernels]
        if lean_call and self.call.decoder is not None:
            self.forward_kind += "+c-decoder"  # every pass as one C call (cpu_decoder.py)
        self.kv_dtype = kv_dtype or self.dtype
        if self.kv_dtype != self.dtype:  # keys and values rounded when written, read back widened: priced apart
            self.forward_kind += "+kv-" + str(self.kv_dtype).removeprefix("torch.")
        shape = self.kv_shape(model, self.kv_dtype) if kv_slots is not None else None
        self.kv = BatchKV(model.config.num_hidden_layers, model.device, kv_slots, shape, dtype=self.kv_dtype,
                          columns=kv_columns)
        self.static: StaticStep | None = None  # static-shape passes (`use_static`), where the `compile` setting asks
        # the last join's working memory (`join`): its scratch cache and loaded prefixes in bytes, and the most
        # tokens one of its forwards computed
        self.join_bytes = self.join_tokens = 0

    def use_static(self, max_rows: int, max_width: int) -> StaticStep | None:
        """Run passes of up to `max_rows` rows x `max_width` tokens as static-shape passes (static_step.py) where
        this runner's forward and pinned cache allow it; the step, or None (logged why not)."""
        self.static = StaticStep.build(self.call, self.kv, self.mask_dtype, self.mask_fill, max_rows, max_width,
                                       self.device)
        if self.static is not None:
            self.forward_kind += "+static"
        return self.static

    def release_dense(self) -> int:
        """Drop the dense copies of the weights the lean forward multiplies reordered copies of (see
        `LeanForward.release_dense`); bytes dropped."""
        return self.call.release_dense() if isinstance(self.call, LeanForward) else 0

    def weight_tensors(self) -> list[torch.Tensor]:
        """The model's parameters and buffers, and the reordered copies the lean forward multiplies."""
        packed = self.call.packed_weights() if isinstance(self.call, LeanForward) else []
        return [*self.model.parameters(), *self.model.buffers(), *packed]

    @staticmethod
    def kv_shape(model: nn.Module, dtype: torch.dtype | None = None) -> KVShape:
        """What one token of this model's cache holds (in `dtype`; None: the dtype it computes in)."""
        return KVShape.of(model.config, dtype or compute_dtype(model))

    @property
    def rows(self) -> list[str]:
        return self.kv.rows

    # ---- the forward pass ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        inputs: Inputs,
        *,
        logits: bool = True,
        hidden: bool = False,
        layers: tuple[int, ...] = (),
        scored: Sequence[int] | None = None,
    ) -> ForwardOutput:
        """Append `inputs[b]` to row b for every row; return what was asked for every fed position.

        `logits=False` runs no LM head (prefill) and returns no logits. `scored[b]`: the LM head runs on
        row b's last `scored[b]` positions only (a verify pass whose rows also feed prompt tokens: their
        logits are never read); `of_rows` then gives those positions' logits. Rows that feed different
        numbers of tokens are packed when the model's attention allows it (see
        `server/model/attention.py`): only real tokens are computed; the outputs come back padded.
        """
        kv = self.kv
        assert len(inputs) == len(kv.rows), "one input list per row"
        batch = len(kv.rows)
        counts = [len(x) for x in inputs]
        width = max(counts, default=0)
        if batch == 0 or width == 0:
            raise ValueError("forward needs at least one new input")
        if not self.has_lm_head and logits:
            raise ValueError("this model has no LM head: ask for hidden states, not logits")
        kv.reserve(width)  # here, so every cache (target and drafts) keeps its holes bounded
        if self.static is not None and self.static.serves(inputs, counts, layers):
            return self._static_forward(inputs, counts, width, logits, hidden, scored)
        pack = Packing.of(counts, self.device) if self.packs and min(counts) < width else None
        # the final hidden states: the lean forward returns them as `last_hidden_state`; transformers' causal LM
        # only among every layer's (which a step would then hold: 30 layers' worth per token)
        lean = isinstance(self.call, LeanForward)
        want_states = bool(layers) or (hidden and self.has_lm_head and not lean)
        if pack is not None:
            feed = self._feed_packed(inputs, pack)
            position_ids = (torch.tensor(kv.positions, device=self.device)[pack.rows] + pack.steps)[None]  # [1, N]
        else:
            feed = self._feed(inputs, width)
            steps = torch.arange(width, device=self.device)
            position_ids = torch.tensor(kv.positions, device=self.device)[:, None] + steps[None, :]  # [batch, W]
        if pack is not None:
            index = pack.index()
        else:
            index = tuple(tuple(range(b * width, b * width + n)) for b, n in enumerate(counts))
        take, logit_index = self._scored(index, scored) if logits and scored is not None else (None, None)
        extra = self._head_keywords(logits, take)
        if pack is not None:
            extra["packing"] = pack
        kv.packing = pack
        try:
            out = self.call(
                **feed,
                attention_mask=self._attention_mask(counts, width),
                position_ids=position_ids,
                cache=kv.cache,
                use_cache=True,
                output_hidden_states=want_states,
                **extra,
            )
        finally:
            kv.packing = None
        kv.advance(counts, width)
        states = out.hidden_states if want_states else None
        final = (states[-1] if self.has_lm_head and not lean else out.last_hidden_state) if hidden else None
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731  [batch, W, ...] or [1, N, ...] -> [N, ...]
        flat_logits = flat(out.logits.float()) if logits else None
        if logit_index is not None and not isinstance(self.call, LeanForward):  # transformers' scored every position
            flat_logits = flat_logits.index_select(0, take)
        return ForwardOutput(
            flat_logits=flat_logits,
            flat_hidden=flat(final) if final is not None else None,
            flat_layers={i: flat(states[i]) for i in layers} if states is not None else {},
            index=index,
            width=width,
            pack=pack,
            logit_index=logit_index,
        )

    def _static_forward(self, inputs: Inputs, counts: list[int], width: int, logits: bool, hidden: bool,
                        scored: Sequence[int] | None) -> ForwardOutput:
        """`forward` as a static-shape pass (static_step.py): every row padded to `width`, the outputs of the
        real rows, as an eager padded pass gives them."""
        kv = self.kv
        out = self.static.forward(inputs, counts, width)
        kv.advance(counts, width)
        index = tuple(tuple(range(b * width, b * width + n)) for b, n in enumerate(counts))
        flat_logits = out.logits.reshape(-1, out.logits.shape[-1]).float() if logits else None
        logit_index = None
        if logits and scored is not None:
            take, logit_index = self._scored(index, scored)
            flat_logits = flat_logits.index_select(0, take)
        return ForwardOutput(
            flat_logits=flat_logits,
            flat_hidden=out.hidden.reshape(-1, out.hidden.shape[-1]) if hidden else None,
            flat_layers={}, index=index, width=width, pack=None, logit_index=logit_index,
        )

    def _scored(self, index: tuple[tuple[int, ...], ...], scored: Sequence[int]
                ) -> tuple[torch.Tensor, tuple[tuple[int, ...], ...]]:
        """Row b's last `scored[b]` fed positions: their flat indices in `index` (the LM head's rows, `take`), and
        each row's of them as the head gives them back, in row order (`ForwardOutput.logit_index`)."""
        chosen = [rows[len(rows) - s:] if s else () for rows, s in zip(index, scored, strict=True)]
        take = torch.tensor([i for r in chosen for i in r], dtype=torch.long, device=self.device)
        starts = list(itertools.accumulate((len(r) for r in chosen), initial=0))
        return take, tuple(tuple(range(a, b)) for a, b in itertools.pairwise(starts))

    def _head_keywords(self, logits: bool, take: torch.Tensor | None) -> dict:
        """The forward's keywords for its LM head: none at all without logits (`LeanForward`; transformers'
        forward scores its last position), the flat positions `take` only when given."""
        if not self.has_lm_head:
            return {}
        if isinstance(self.call, LeanForward):
            if not logits:
                return {"logits_to_keep": None}
            return {"logits_index": take} if take is not None else {}
        return {"logits_to_keep": 0 if logits else 1}

    def _feed(self, inputs: Inputs, width: int) -> dict[str, torch.Tensor]:
        """Token ids [batch, W] or input embeddings [batch, W, hidden], zero-padded past each row's inputs."""
        if inputs and isinstance(inputs[0], torch.Tensor):
            first = inputs[0]
            embeds = first.new_zeros(len(inputs), width, first.shape[-1])
            for b, x in enumerate(inputs):
                embeds[b, : len(x)] = x
            return {"inputs_embeds": embeds.to(self.device, self.dtype)}
        ids = torch.zeros(len(inputs), width, dtype=torch.long)
        for b, row in enumerate(inputs):
            ids[b, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        return {"input_ids": ids.to(self.device)}

    def _feed_packed(self, inputs: Inputs, pack: Packing) -> dict[str, torch.Tensor]:
        """Every row's inputs in the packed order (`Packing`): token ids [1, N] or input embeddings [1, N, hidden]."""
        if inputs and isinstance(inputs[0], torch.Tensor):
            embeds = torch.cat(pack.pieces(inputs))  # type: ignore[arg-type]
            return {"inputs_embeds": embeds[None].to(self.device, self.dtype)}
        ids = [int(t) for piece in pack.pieces(inputs) for t in piece]
        return {"input_ids": torch.tensor([ids], dtype=torch.long, device=self.device)}

    def _attention_mask(self, counts: list[int], width: int) -> torch.Tensor:
        """Additive mask [batch, 1, W, length + W]: live old columns, causal new ones, and self (`BatchKV.visible`)."""
        # a model attending in float64 (attention.py) gets its mask in float64 here, once per forward, rather
        # than converted in every layer; the same values (`mask_fill`)
        allowed = self.kv.visible(counts, width)[:, None]
        mask = torch.zeros(allowed.shape, dtype=self.mask_dtype, device=self.device)
        return mask.masked_fill_(~allowed, self.mask_fill)

    @property
    def mask_dtype(self) -> torch.dtype:
        """What additive masks are made in: float64 for a model that attends in it (attention.py), else its dtype."""
        return torch.float64 if attends_wide(self.model) else self.dtype

    @property
    def mask_fill(self) -> float:
        """What a masked column gets in an additive mask: the model dtype's most negative value."""
        return torch.finfo(self.dtype).min

    # ---- batch membership ------------------------------------------------------------------------
    def join(
        self,
        request_ids: list[str],
        inputs: Inputs,
        *,
        hidden: bool = False,
        chunk: int = 512,
        prefixes: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> list[torch.Tensor] | None:
        """Prefill new rows on their own (in chunks of `chunk` positions, so the mask and activations of
        a long prompt stay bounded) and add them to the batch. `prefixes[b]`, when given, holds the keys
        and values of row b's first p_b inputs ([layers, kv_heads, p_b, head_dim] each, computed before:
        server/model/prefix_cache.py): they are loaded, not computed. Returns, when `hidden`, each row's
        hidden states (after the final norm) of the inputs it computed, [len(inputs[b]) - p_b, hidden],
        else None."""
        fresh = copy.copy(self)  # the same model over an empty cache of the new rows
        fresh.static = None  # an unpinned scratch cache: its chunks run eagerly
        loaded = [kv[0].shape[2] for kv in prefixes or () if kv is not None]
        fresh.kv = self.kv.new_rows(request_ids, max([len(x) for x in inputs] + loaded, default=0))
        if prefixes is not None:
            fresh.kv.load_prefixes(list(prefixes))
            inputs = [x[p:] for x, p in zip(inputs, fresh.kv.positions, strict=True)]
        states: list[list[torch.Tensor]] = [[] for _ in request_ids]
        longest = max((len(x) for x in inputs), default=0)
        self.join_tokens = 0
        for start in range(0, longest, chunk):
            part = [x[start : start + chunk] for x in inputs]
            out = fresh.forward(part, logits=False, hidden=hidden)
            self.join_tokens = max(self.join_tokens, out.computed)
            if hidden:
                for b, x in enumerate(part):
                    states[b].append(out.hidden[b, : len(x)])
        self.join_bytes = fresh.kv.nbytes + tensor_bytes(t for kv in prefixes or () if kv is not None for t in kv)
        self.kv.add_rows(fresh.kv)
        if not hidden:
            return None
        empty = torch.zeros(0, self.model.config.hidden_size, device=self.device)
        return [torch.cat(s) if s else empty for s in states]

    def leave(self, request_ids: set[str]) -> None:
        self.kv.remove_rows(request_ids)

    def rollback(self, row: int, num_tokens: int) -> None:
        """Forget row `row`'s last `num_tokens` tokens (see `BatchKV.rollback`)."""
        self.kv.rollback(row, num_tokens)

    # ---- what the cache holds (read-only) ---------------------------------------------------------
    def cached(self, request_id: str) -> int:
        """How many positions the row holds in the cache (its tokens fed and kept)."""
        return self.kv.positions[self.kv.index(request_id)]

    def live(self, request_id: str) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """A reader of the row's keys and values between two of its positions (`BatchKV.live`)."""
        return self.kv.live(self.kv.index(request_id))

    @property
    def allocated_slots(self) -> int:
        """Token slots (rows x columns) the cache's storage holds now; 0 before it is allocated."""
        layer = self.kv.cache.layers[0]
        return layer.slots if layer.is_initialized else 0


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model` computes its hidden states in, and so what its attention's queries are in: the one place
    a runner reads it (its additive masks, the embeddings it is fed and, unless told otherwise, its KV cache are
    made in it). That is what its input embeddings give, not its first parameter's dtype: a quantized table
    (quantized.py) gives float32 rows whatever it holds, and quantized layers give back their input's dtype, so
    a model whose norms were cast to bfloat16 around float32 kernels still computes in float32. A model without
    lookup table computes in its parameters' dtype."""
    table = model.get_input_embeddings()
    if table is None:
        return model.dtype
    with torch.no_grad():
        return table(torch.zeros(1, dtype=torch.long, device=model.device)).dtype


def _take(flat: torch.Tensor | None, order: list[int]) -> torch.Tensor | None:
    """`flat`'s rows in `order` (`flat` itself when that is its order already)."""
    if flat is None:
        return None
    if order == list(range(len(flat))):
        return flat
    return flat.index_select(0, torch.tensor(order, dtype=torch.long, device=flat.device))


def _unpack(flat: torch.Tensor, pack: Packing) -> torch.Tensor:
    """A packed forward's output [N, ...] in the batch's padded layout [rows, W, ...] (zeros past each
    row's tokens)."""
    out = flat.new_zeros(len(pack.counts), pack.width, *flat.shape[1:])
    out[pack.rows, pack.steps] = flat
    return out
