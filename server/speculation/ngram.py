"""Prompt-lookup proposer: find the latest earlier occurrence of the text's longest recent n-gram and
propose the tokens that followed it. No model, no probabilities (q is one-hot).

Each proposal also reports its match length: how many tokens before the end of the text agree with
the tokens before the copied source (at least the n-gram, extended backwards up to `MATCH_CAP`). A
long match means the text is copying a passage, and its continuation is usually accepted whole; a
one-token match is a guess. `auto` keeps its acceptance statistics per confidence level (match-length bucket).
"""

from __future__ import annotations

import numpy as np

from server.speculation.proposer import BuildContext, Proposal, Proposer, SequenceView, Traits
from server.speculation.suffix import match_lengths

MATCH_CAP = 16  # match lengths are measured up to this many tokens
# Confidence levels: match lengths 1, 2, 3-7 and 8+ tokens: a one-token match rarely keeps a draft, a long
# one usually keeps most (docs/bench.md, "Figures behind the code").
LEVEL_STARTS = (1, 2, 3, 8)
LEVEL_PRIORS = (0.2, 0.35, 0.55, 0.7)  # first-draft acceptance per level before any evidence


def confidence_level(match_len: int) -> int:
    """The confidence level of a match of `match_len` tokens (an index into LEVEL_STARTS)."""
    return max(i for i, start in enumerate(LEVEL_STARTS) if start <= max(match_len, 1))


def ngram_match(tokens: list[int], k: int, n_max: int, n_min: int) -> tuple[list[int], int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram, and
    the length of that match (0 and no tokens when nothing matches).

    One vectorised pass: every earlier position holding the text's last token is a candidate, and how
    far back each agrees with the text (up to `MATCH_CAP`) gives both the longest n-gram that occurs
    (n <= n_max) and, for the latest candidate with it, the match length."""
    if k <= 0 or len(tokens) < n_min + 1:
        return [], 0
    arr = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # where an earlier occurrence of the last token ends
    if ends.size == 0:
        return [], 0
    lengths = match_lengths(arr, ends, arr, min(MATCH_CAP, len(arr) - 1))
    n = min(int(lengths.max()), n_max)
    if n < n_min:
        return [], 0
    latest = int(np.flatnonzero(lengths >= n)[-1])
    start = int(ends[latest]) + 1
    return arr[start : start + k].tolist(), int(lengths[latest])


def ngram_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    return ngram_match(tokens, k, n_max, n_min)[0]


class NgramProposer(Proposer):
    # A lookup is numpy over the sequence's tokens: a small fraction of a target step per draft token.
    traits = Traits(lookahead=True, draft_token_cost=0.002, confidence_priors=LEVEL_PRIORS)

    def __init__(self, n_max: int = 4, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min

    @classmethod
    def build(cls, ctx: BuildContext) -> NgramProposer:
        return cls(ctx.settings.ngram_max, ctx.settings.ngram_min)

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> Proposal:
        found = [ngram_match(seq.tokens, k, self.n_max, self.n_min) for seq, k in zip(seqs, ks, strict=True)]
        return Proposal(drafts=[d for d, _ in found], confidence=[confidence_level(n) for _, n in found])
