"""Prompt-lookup proposer: find the latest earlier occurrence of the text's longest recent n-gram and
propose the tokens that followed it. No model, no probabilities (q is one-hot)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from server.engine.sequence import Sequence
from server.spec.proposer import Proposal, Proposer


def ngram_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    if k <= 0 or len(tokens) < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        suffix = arr[-n:]
        windows = sliding_window_view(arr[:-1], n)  # every n-gram that starts before the suffix does
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        drafts = [ngram_lookup(seq.tokens, k, self.n_max, self.n_min) for seq, k in zip(seqs, ks, strict=True)]
        return Proposal(drafts=drafts, probs=None)
