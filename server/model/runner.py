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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from server.model.attention import Packing, packs
from server.model.kv_cache import BatchKV, KVShape
from server.model.lean_forward import LeanForward

Inputs = Sequence[Sequence[int]] | Sequence[torch.Tensor]  # per row: token ids, or embeddings [n_b, hidden]


@dataclass(frozen=True)
class ForwardOutput:
    """What one forward computed for the fed positions (row b's position j >= n_b is padding)."""

    logits: torch.Tensor | None  # [batch, W, vocab] float32; None when not asked for
    hidden: torch.Tensor | None = None  # [batch, W, hidden]: after the final norm (what the LM head reads)
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # chosen layer index -> [batch, W, hidden]
    computed: int = 0  # positions the model computed: rows x W padded, the real tokens only when packed


class ModelRunner:
    """Runs one model over the rows of its batch cache. Single-threaded, like the engine.

    `model` is a causal LM (logits and hidden states), or a base model without an LM head (a draft
    head's decoder: hidden states only, its final output as `hidden`).
    """

    def __init__(self, model: PreTrainedModel, kv_slots: int | None = None, *, lean: bool = True) -> None:
        """`kv_slots`: the cache's budget in tokens (rows x columns), allocated now; None: grown as needed.
        `lean`: run Llama-family models through `LeanForward` (lean_forward.py; others always run
        transformers' forward); False runs transformers' forward for every model."""
        self.model = model
        self.device = model.device
        self.has_lm_head = model.get_output_embeddings() is not None
        self.packs = packs(model)  # rows feeding different numbers of tokens are packed (attention.py)
        self.call = (LeanForward.of(model) if lean else None) or model  # the forward, with transformers' keywords
        shape = self.kv_shape(model) if kv_slots is not None else None
        self.kv = BatchKV(model.config.num_hidden_layers, model.device, kv_slots, shape)

    @staticmethod
    def kv_shape(model: PreTrainedModel) -> KVShape:
        """What one token of this model's cache holds."""
        return KVShape.of(model.config, model.dtype)

    @property
    def rows(self) -> list[str]:
        return self.kv.rows

    # ---- the forward pass ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, inputs: Inputs, *, logits: bool = True, hidden: bool = False, layers: tuple[int, ...] = ()
    ) -> ForwardOutput:
        """Append `inputs[b]` to row b for every row; return what was asked for every fed position.

        `logits=False` runs the LM head on one position only (prefill) and returns no logits. Rows that
        feed different numbers of tokens are packed when the model's attention allows it (see
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
        # a prefill (logits=False with an LM head) keeps only the last position's logits: never packed
        packable = self.packs and (logits or not self.has_lm_head) and min(counts) < width
        pack = Packing.of(counts, self.device) if packable else None
        want_states = bool(layers) or (hidden and self.has_lm_head)
        extra = {"logits_to_keep": 0 if logits else 1} if self.has_lm_head else {}
        if pack is not None:
            extra["packing"] = pack
            feed = self._feed_packed(inputs, pack)
            position_ids = (torch.tensor(kv.positions, device=self.device)[pack.rows] + pack.steps)[None]  # [1, N]
        else:
            feed = self._feed(inputs, width)
            steps = torch.arange(width, device=self.device)
            position_ids = torch.tensor(kv.positions, device=self.device)[:, None] + steps[None, :]  # [batch, W]
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
        final = (states[-1] if self.has_lm_head else out.last_hidden_state) if hidden else None
        unpack = (lambda x: x) if pack is None else (lambda x: _unpack(x, pack))
        return ForwardOutput(
            logits=unpack(out.logits.float()) if logits else None,
            hidden=unpack(final) if final is not None else None,
            layers={i: unpack(states[i]) for i in layers} if states is not None else {},
            computed=pack.tokens if pack is not None else batch * width,
        )

    def _feed(self, inputs: Inputs, width: int) -> dict[str, torch.Tensor]:
        """Token ids [batch, W] or input embeddings [batch, W, hidden], zero-padded past each row's inputs."""
        if inputs and isinstance(inputs[0], torch.Tensor):
            first = inputs[0]
            embeds = first.new_zeros(len(inputs), width, first.shape[-1])
            for b, x in enumerate(inputs):
                embeds[b, : len(x)] = x
            return {"inputs_embeds": embeds.to(self.device, self.model.dtype)}
        ids = torch.zeros(len(inputs), width, dtype=torch.long)
        for b, row in enumerate(inputs):
            ids[b, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        return {"input_ids": ids.to(self.device)}

    def _feed_packed(self, inputs: Inputs, pack: Packing) -> dict[str, torch.Tensor]:
        """Every row's inputs in the packed order (`Packing`): token ids [1, N] or input embeddings [1, N, hidden]."""
        if inputs and isinstance(inputs[0], torch.Tensor):
            embeds = torch.cat(pack.pieces(inputs))  # type: ignore[arg-type]
            return {"inputs_embeds": embeds[None].to(self.device, self.model.dtype)}
        ids = [int(t) for piece in pack.pieces(inputs) for t in piece]
        return {"input_ids": torch.tensor([ids], dtype=torch.long, device=self.device)}

    def _attention_mask(self, counts: list[int], width: int) -> torch.Tensor:
        """Additive mask [batch, 1, W, length + W]: live old columns, causal new ones, and self.

        A padding query attends to its own column too, so no softmax row is empty (no NaNs anywhere,
        even in hole columns that are never read).
        """
        kv = self.kv
        batch, length = len(kv.rows), kv.length
        steps = torch.arange(width, device=self.device)
        old = kv.keep[:, None, :length].expand(batch, width, length)  # [batch, W, length]
        causal = steps[None, :] <= steps[:, None]  # [W, W]: key j visible to query i
        real = steps[None, None, :] < torch.tensor(counts, device=self.device)[:, None, None]  # [batch, 1, W]
        new = (causal[None] & real) | torch.eye(width, dtype=torch.bool, device=self.device)[None]
        allowed = torch.cat([old, new], dim=-1)[:, None]  # [batch, 1, W, length + W]
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)

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
        fresh.kv = self.kv.new_rows(request_ids)
        if prefixes is not None:
            fresh.kv.load_prefixes(list(prefixes))
            inputs = [x[p:] for x, p in zip(inputs, fresh.kv.positions, strict=True)]
        states: list[list[torch.Tensor]] = [[] for _ in request_ids]
        longest = max((len(x) for x in inputs), default=0)
        for start in range(0, longest, chunk):
            part = [x[start : start + chunk] for x in inputs]
            out = fresh.forward(part, logits=False, hidden=hidden)
            if hidden:
                for b, x in enumerate(part):
                    states[b].append(out.hidden[b, : len(x)])
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


def _unpack(packed: torch.Tensor, pack: Packing) -> torch.Tensor:
    """A packed forward's output [1, N, ...] in the batch's padded layout [rows, W, ...] (zeros past
    each row's tokens)."""
    out = packed.new_zeros(len(pack.counts), pack.width, *packed.shape[2:])
    out[pack.rows, pack.steps] = packed[0]
    return out
