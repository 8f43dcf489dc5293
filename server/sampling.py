"""Turn logits into the distribution a request samples from: penalties, temperature, top-k, top-p.

docs/design.md calls the result p (target) or q (draft); both go through this same function, so the
acceptance rule compares like with like. Greedy rows (temperature 0) become one-hot at the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.types import SamplingParams


@dataclass(frozen=True)
class BatchSampling:
    """Per-row sampling parameters as tensors (index = row of the batch)."""

    temperature: torch.Tensor  # [batch] float; 0 marks greedy rows (treated as 1 before the argmax)
    top_k: torch.Tensor  # [batch] long; 0 = off
    top_p: torch.Tensor  # [batch] float; 1 = off
    presence: torch.Tensor  # [batch] float
    frequency: torch.Tensor  # [batch] float
    greedy: torch.Tensor  # [batch] bool
    any_top_k: bool
    any_top_p: bool
    any_penalty: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device) -> BatchSampling:
        def t(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=t([p.temperature if p.temperature > 0 else 1.0 for p in params]),
            top_k=t([p.top_k for p in params], torch.long),
            top_p=t([p.top_p for p in params]),
            presence=t([p.presence_penalty for p in params]),
            frequency=t([p.frequency_penalty for p in params]),
            greedy=t([p.greedy for p in params], torch.bool),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_penalty=any(p.presence_penalty or p.frequency_penalty for p in params),
        )


def probabilities(
    logits: torch.Tensor, sampling: BatchSampling, token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [batch, W, vocab] -> probabilities [batch, W, vocab] after the request's processing.

    `token_counts` [batch, W, vocab] counts, for each position, the tokens generated before it
    (drafted ones included); needed only when some row has a presence or frequency penalty.
    """
    logits = logits.float()
    if sampling.any_penalty:
        assert token_counts is not None, "penalties need token counts"
        logits = (
            logits
            - sampling.frequency[:, None, None] * token_counts
            - sampling.presence[:, None, None] * (token_counts > 0)
        )
    if bool(sampling.greedy.all()):
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / sampling.temperature[:, None, None]
    if sampling.any_top_k or sampling.any_top_p:
        logits = _top_k_top_p(logits, sampling)
    probs = torch.softmax(logits, dim=-1)
    if bool(sampling.greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(sampling.greedy[:, None, None], one_hot, probs)
    return probs


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
