"""Turn logits into the distribution a request samples from: penalties, logit bias, the min_tokens
mask, temperature, min-p, top-k, top-p.

docs/design.md calls the result p (target) or q (draft); both go through this same function, so the
acceptance rule compares like with like. Greedy rows (temperature 0) become one-hot at the argmax.

Every transform is applied per verify position: position j of a row scores the token that follows
the row's output plus its first j drafts, so what depends on the history (penalties, min_tokens) is
computed for that history. p at every position is then exactly what plain decoding would use there,
which keeps speculation lossless whatever the request asks for.

Order (vLLM's): repetition, frequency and presence penalties on the raw logits -> logit_bias -> the
grammar's mask (constrained decoding: server/grammar.py) -> EOS/stop tokens masked while fewer than
min_tokens tokens precede the position (unless the grammar allows nothing else there) -> (greedy:
argmax) -> temperature -> min_p -> top_k and top_p -> softmax.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import torch

from server.types import SamplingParams


@dataclass(frozen=True)
class BatchSampling:
    """Per-row sampling parameters as tensors (index = row of the batch)."""

    temperature: torch.Tensor  # [batch] float; 0 marks greedy rows (treated as 1 before the argmax)
    top_k: torch.Tensor  # [batch] long; 0 = off
    top_p: torch.Tensor  # [batch] float; 1 = off
    min_p: torch.Tensor  # [batch] float; 0 = off
    presence: torch.Tensor  # [batch] float
    frequency: torch.Tensor  # [batch] float
    repetition: torch.Tensor  # [batch] float; 1 = off
    greedy: torch.Tensor  # [batch] bool
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, biases) [n] each
    # min_tokens: (rows, token ids) [n] each of the tokens to mask, and per row how many tokens are
    # generated before position 0 and the minimum; None when no row needs the mask this step.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    generated: torch.Tensor  # [batch] long
    min_tokens: torch.Tensor  # [batch] long
    prompts: tuple[torch.Tensor, ...] | None  # per row its prompt ids (repetition penalty only)
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool  # presence, frequency or repetition: `probabilities` needs token counts
    # `greedy` as the host knows it (the decisions below read this, not the tensor: on a GPU reading a tensor
    # back waits for the device, and a step should read back only its verdict)
    greedy_rows: tuple[bool, ...]

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        device: torch.device,
        *,
        generated: list[int] | None = None,
        eos_ids: Collection[int] = (),
        prompts: list[tuple[int, ...]] | None = None,
    ) -> BatchSampling:
        """`generated[b]`: tokens row b has output before this step (needed for `min_tokens`; None
        means the caller does not apply it, e.g. a draft model's q). `eos_ids`: the tokens `min_tokens`
        masks besides each row's stop_token_ids (unless the row has ignore_eos). `prompts`: each row's
        prompt (needed when a row has a repetition penalty)."""

        def t(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        bias_rows, bias_ids, bias_values = [], [], []
        for b, p in enumerate(params):
            merged: dict[int, float] = {}
            for token, value in p.logit_bias:  # one entry per (row, token): the in-place add below needs it
                merged[token] = merged.get(token, 0.0) + value
            for token, value in merged.items():
                bias_rows.append(b)
                bias_ids.append(token)
                bias_values.append(value)
        gen = generated if generated is not None else [0] * len(params)
        ban_rows, ban_ids = [], []
        for b, p in enumerate(params):
            if generated is not None and gen[b] < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
                ban_rows += [b] * len(stops)
                ban_ids += sorted(stops)
        any_repetition = any(p.repetition_penalty != 1.0 for p in params)
        if any_repetition and prompts is None:
            raise ValueError("a repetition penalty needs the rows' prompts")
        return cls(
            temperature=t([p.temperature if not p.greedy else 1.0 for p in params]),
            top_k=t([p.top_k for p in params], torch.long),
            top_p=t([p.top_p for p in params]),
            min_p=t([p.min_p for p in params]),
            presence=t([p.presence_penalty for p in params]),
            frequency=t([p.frequency_penalty for p in params]),
            repetition=t([p.repetition_penalty for p in params]),
            greedy=t([p.greedy for p in params], torch.bool),
            bias=(t(bias_rows, torch.long), t(bias_ids, torch.long), t(bias_values)) if bias_rows else None,
            banned=(t(ban_rows, torch.long), t(ban_ids, torch.long)) if ban_rows else None,
            generated=t(gen, torch.long),
            min_tokens=t([p.min_tokens for p in params], torch.long),
            prompts=tuple(t(list(pr), torch.long) for pr in prompts) if any_repetition and prompts else None,
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            any_penalty=any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params),
            greedy_rows=tuple(p.greedy for p in params),
        )

    def at_positions(self, lengths: Sequence[int]) -> BatchSampling:
        """These parameters with one row per verify position: row b's `lengths[b]` positions in turn (a
        verify pass's outputs row after row, as the engine reads them). Position j of row b follows
        `generated[b] + j` tokens (its drafts before j), which is what `min_tokens` reads."""
        if all(n == 1 for n in lengths):
            return self
        device = self.temperature.device
        counts = torch.tensor(list(lengths), device=device)
        row_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)  # [positions]
        starts = counts.cumsum(0) - counts
        step = torch.arange(len(row_of), device=device) - starts[row_of]

        def spread(rows: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
            """Per-row entries (rows [n] with their values) as per-position entries: one per position."""
            reps = counts[rows]
            first = torch.repeat_interleave(reps.cumsum(0) - reps, reps)
            at = torch.repeat_interleave(starts[rows], reps) + torch.arange(int(reps.sum()), device=device) - first
            return (at, *(torch.repeat_interleave(v, reps) for v in values))

        take = lambda t: t.index_select(0, row_of)  # noqa: E731
        return replace(
            self,
            temperature=take(self.temperature), top_k=take(self.top_k), top_p=take(self.top_p),
            min_p=take(self.min_p), presence=take(self.presence), frequency=take(self.frequency),
            repetition=take(self.repetition), greedy=take(self.greedy),
            greedy_rows=tuple(g for g, n in zip(self.greedy_rows, lengths, strict=True) for _ in range(n)),
            bias=spread(*self.bias) if self.bias is not None else None,  # type: ignore[arg-type]
            banned=spread(*self.banned) if self.banned is not None else None,  # type: ignore[arg-type]
            generated=take(self.generated) + step, min_tokens=take(self.min_tokens),
            prompts=tuple(self.prompts[b] for b in row_of.tolist()) if self.prompts is not None else None,
        )


def probabilities(
    logits: torch.Tensor,
    sampling: BatchSampling,
    token_counts: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [batch, W, vocab] -> probabilities [batch, W, vocab] after the request's processing.

    `token_counts` [batch, W, vocab] counts, for each position, the tokens generated before it
    (drafted ones included); needed only when some row has a presence, frequency or repetition penalty.
    `allowed` [batch, W, vocab] bool: the tokens each position's grammar allows (constrained rows;
    True everywhere for the others); p is 0 elsewhere.
    """
    logits = _controlled(logits, sampling, token_counts, allowed)
    if all(sampling.greedy_rows):
        return torch.zeros_like(logits).scatter_(-1, _argmax(logits), 1.0)
    greedy_ids = _argmax(logits) if any(sampling.greedy_rows) else None
    logits = logits / sampling.temperature[:, None, None]
    if sampling.any_min_p:
        logits = _min_p(logits, sampling)
    if sampling.any_top_k or sampling.any_top_p:
        logits = _top_k_top_p(logits, sampling)
    probs = torch.softmax(logits, dim=-1)
    if greedy_ids is not None:
        one_hot = torch.zeros_like(probs).scatter_(-1, greedy_ids, 1.0)
        probs = torch.where(sampling.greedy[:, None, None], one_hot, probs)
    return probs


def greedy_tokens(
    logits: torch.Tensor,
    sampling: BatchSampling,
    token_counts: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [batch, W, vocab] of rows that all decode greedily -> [batch, W]: the token `probabilities` puts all
    of its mass on at each position (the same controls first), without building that one-hot p."""
    assert all(sampling.greedy_rows), "every row must be greedy"
    return _argmax(_controlled(logits, sampling, token_counts, allowed))[..., 0]


def _controlled(
    logits: torch.Tensor,
    sampling: BatchSampling,
    token_counts: torch.Tensor | None,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """The logits after the controls every row gets before temperature: penalties, logit_bias, the grammar's
    mask, the min_tokens mask (float32)."""
    logits = logits.float()
    if sampling.any_penalty:
        assert token_counts is not None, "penalties need token counts"
        logits = _penalised(logits, sampling, token_counts)
    if sampling.bias is not None:
        rows, ids, values = sampling.bias
        logits = logits.clone() if not sampling.any_penalty else logits
        logits[rows, :, ids] += values[:, None]  # (row, token) pairs are unique: no accumulation needed
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if sampling.banned is not None:
        logits = _mask_early_stops(logits, sampling)
    return logits


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first maximal index along the vocabulary, [..., 1] (as `argmax`: both return the first of
    tied maxima). `max(dim).indices` is about twice as fast as `argmax` on CPU, and a verify pass's
    post-processing takes it over every position (docs/bench.md, "Figures behind the code")."""
    return logits.max(dim=-1, keepdim=True).indices


def _penalised(logits: torch.Tensor, sampling: BatchSampling, counts: torch.Tensor) -> torch.Tensor:
    """Repetition (HF/vLLM: divide a positive logit, multiply a negative one, for every token seen in
    the prompt or output), then OpenAI's frequency and presence penalties (output tokens only)."""
    if sampling.prompts is not None:
        seen = counts > 0  # [batch, W, vocab]
        for b, prompt in enumerate(sampling.prompts):
            if len(prompt):
                seen[b, :, prompt] = True
        rep = sampling.repetition[:, None, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - sampling.frequency[:, None, None] * counts - sampling.presence[:, None, None] * (counts > 0)


def _mask_early_stops(logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """-inf for EOS/stop tokens at each position preceded by fewer than min_tokens output tokens,
    except where that would leave no token at all (a grammar that allows only EOS: it wins).

    Position j of row b follows generated[b] + j tokens (its output plus the drafts before j)."""
    assert sampling.banned is not None
    rows, ids = sampling.banned
    width = logits.shape[1]
    before = sampling.generated[:, None] + torch.arange(width, device=logits.device)  # [batch, W]
    early = before < sampling.min_tokens[:, None]  # [batch, W]
    masked = logits.clone()
    current = masked[rows, :, ids]  # [n, W]
    masked[rows, :, ids] = current.masked_fill(early[rows], float("-inf"))
    nothing_left = torch.isneginf(masked).all(dim=-1, keepdim=True)  # [batch, W, 1]
    return torch.where(nothing_left, logits, masked)


def _min_p(logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the most likely token's (it always stays)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * sampling.min_p[:, None, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p nucleus (the best token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [batch, W, vocab]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if sampling.any_top_k:
        k = torch.where(sampling.top_k > 0, sampling.top_k, vocab)[:, None, None]
        drop |= ranks >= k
    if sampling.any_top_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        drop |= before >= sampling.top_p[:, None, None]
    drop[..., 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the model's raw distribution (what OpenAI's `logprobs` report)."""
    return torch.log_softmax(logits.float(), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [vocab] by inverse CDF: a single uniform draw from the row's generator.

    (torch.multinomial costs milliseconds per call over a 50k vocabulary on CPU; this costs one
    cumulative sum.) Tokens with probability 0 are never chosen.
    """
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(1, generator=generator, device=generator.device).to(cdf.device)
    index = torch.searchsorted(cdf, u * cdf[-1], right=True)
    return min(int(index), probs.shape[-1] - 1)
