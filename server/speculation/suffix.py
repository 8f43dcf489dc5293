"""Suffix-tree drafts (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): match the end of the text
against a per-request index over its own prompt and output, and against a global index over the recent
outputs of earlier requests, then draft the most frequent continuation of the longest match.

The trees are implicit. A node of a suffix tree is a string s; its count is how often s occurs in the
indexed text, and its children are the distinct tokens that follow those occurrences. Here a node is
the array of positions where s ends: one vectorised scan finds the text's last token, and the
candidates are compared backwards with the text's suffix (one token at a time while there are many,
then all at once), which gives the deepest node matching the text's suffix, up to `MATCH_CAP` tokens.
Walking down to the most frequent child is a count over the tokens after those positions (the most
recent `WALK_OCCURRENCES`), narrowed to the occurrences that continue with the chosen token. The counts
and the walk are a suffix tree's; nothing is built per token, so the per-request index is just the
token array (O(n) memory, no build cost), and a lookup costs a few numpy calls (`python -m
bench.lookup_cost` measures it). The global pools, which change only when a request leaves, keep their
positions ordered by token (a token's occurrences are one slice, not a scan of 32k tokens) and
remember each node's walk until they change: a common token's node (a comma, " the") has hundreds of
occurrences to count, and every row of a batch asks for such nodes at every step.

Draft length follows the match: at most `SPEC_FACTOR` x the match length tokens, and the walk stops
where the chosen continuation's frequency among the node's occurrences drops below `MIN_PROB`.

The global index holds the last `GLOBAL_TOKENS` tokens of finished requests' outputs (each with the
last `MATCH_CAP` tokens of its prompt before it, so a new request's prompt end can match and draft from
its first token), evicted whole requests first-in first-out. It is fed when a request leaves (`leave`),
with what `commit` kept; it is shared by every request of this server that uses `suffix` (or `auto`)
and has the same cache salt (`SharedIndex`: none, or the request's `cache_salt`).

Confidence (an index into `LEVEL_PRIORS`) combines the match length with the first draft token's
frequency among the match's continuations: a long match with one dominant continuation is a copy.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from server.speculation.proposer import BuildContext, Proposal, Proposer, SequenceView, Traits

MATCH_CAP = 16  # the deepest node matched (tokens of the text's suffix)
SPEC_FACTOR = 4.0  # drafts per matched token, at most (SuffixDecoding's max_spec_factor)
MIN_PROB = 0.1  # stop the walk where the chosen continuation has a lower frequency than this
GLOBAL_TOKENS = 32768  # tokens the global index keeps (outputs plus their prompt tails), FIFO by request
NARROW_TO = 64  # candidates compared position by position before the rest are compared at once
WALK_OCCURRENCES = 256  # a node's most recent occurrences counted when walking down (bounds a lookup's cost)
MEMO_WALKS = 4096  # walks remembered per global pool between two changes of its hay
FEW_OCCURRENCES = 16  # followed occurrences below which the walk counts in Python (numpy's per-call cost dominates)
SEPARATOR = -1  # between requests in the global index: never equals a token, so no match crosses it

# Confidence levels: (match length bucket, dominant continuation?). Match buckets 1, 2, 3-7, 8+ as
# n-gram's; "dominant" = the first draft token follows at least 3/4 of the match's occurrences.
MATCH_BUCKETS = (1, 2, 3, 8)
DOMINANT = 0.75
# First-draft acceptance per level before any evidence (greedy), measured by replaying SmolLM2-135M's
# greedy answers to the bench workloads through the proposer (`python -m bench.replay`, docs/bench.md).
LEVEL_PRIORS = (0.1, 0.3, 0.15, 0.45, 0.3, 0.65, 0.4, 0.9)


def confidence_level(match_len: int, first_prob: float) -> int:
    """Level of a draft after a `match_len`-token match whose first token has frequency `first_prob`."""
    bucket = max(i for i, start in enumerate(MATCH_BUCKETS) if start <= max(match_len, 1))
    return 2 * bucket + (1 if first_prob >= DOMINANT else 0)


@dataclass(frozen=True)
class Match:
    """A walk down the implicit suffix tree: the drafts, the match length they follow, each draft's
    frequency among the occurrences of the path before it, and where it came from."""

    drafts: list[int]
    length: int = 0
    probs: tuple[float, ...] = ()
    source: str = ""  # "request" or "global"

    @property
    def score(self) -> float:
        """Expected accepted drafts if each is right with its frequency (SuffixDecoding's score)."""
        total, run = 0.0, 1.0
        for p in self.probs:
            run *= p
            total += run
        return total

    @property
    def level(self) -> int:
        return confidence_level(self.length, self.probs[0] if self.probs else 0.0)


NO_MATCH = Match([])


def match_lengths(hay: np.ndarray, ends: np.ndarray, text: np.ndarray, depth: int) -> np.ndarray:
    """Per candidate end position in `hay`, how many tokens ending there agree with the end of `text`
    (compared backwards, up to `depth`; never before the start of `hay`)."""
    back = ends[:, None] - np.arange(depth)  # [candidates, depth]: each candidate's tokens, backwards
    agree = (hay[np.maximum(back, 0)] == text[::-1][:depth]) & (back >= 0)
    return np.cumprod(agree, axis=1).sum(axis=1)  # tokens agreeing before the first disagreement


def deepest_node(hay: np.ndarray, ends: np.ndarray, text: np.ndarray, cap: int = MATCH_CAP) -> tuple[np.ndarray, int]:
    """The occurrences in `hay` of the longest suffix of `text` (at most `cap` tokens) among candidate
    end positions `ends` (where hay holds text's last token), and that suffix's length.

    Returns (end positions, length); (empty, 0) when there are no candidates.
    """
    if ends.size == 0:
        return ends, 0
    depth, length = min(cap, len(text)), 1
    while ends.size > NARROW_TO and length < depth:  # common tokens: narrow one token at a time first
        back = ends - length
        back = back[back >= 0]
        keep = back[hay[back] == text[-1 - length]]
        if keep.size == 0:
            return ends, length
        ends, length = keep + length, length + 1
    lengths = match_lengths(hay, ends, text, depth)
    longest = int(lengths.max())
    return ends[lengths == longest], longest


def walk(hay: np.ndarray, ends: np.ndarray, limit: int, stop: int) -> tuple[list[int], list[float]]:
    """Follow the most frequent child from the node whose occurrences end at `ends`: up to `limit`
    tokens, never reading at or past `stop` nor a separator. Ties go to the most recent occurrence.
    Returns the tokens and each one's frequency among the occurrences still followed.

    The first children of a common token's node are counted over hundreds of occurrences, with numpy;
    once the followed occurrences are few (`FEW_OCCURRENCES`), plain Python counts the rest faster."""
    if limit <= 0:
        return [], []
    ends = ends[-WALK_OCCURRENCES:][::-1]  # the most recent ones (positions ascend), most recent first
    index = ends[:, None] + 1 + np.arange(limit)  # [occurrences, limit]: each occurrence's continuation
    matrix = np.where(index < stop, hay[np.minimum(index, stop - 1)], SEPARATOR)
    drafts: list[int] = []
    probs: list[float] = []
    while len(drafts) < limit and len(matrix) > FEW_OCCURRENCES:
        rest = matrix[:, len(drafts):]
        agreed = (rest == rest[0]).all(axis=0)  # columns every followed occurrence continues alike
        run = len(agreed) if agreed.all() else int(agreed.argmin())
        if run:  # a copied passage: its leading agreed tokens, each with frequency 1
            block = rest[0, :run].tolist()
            cut = block.index(SEPARATOR) if SEPARATOR in block else run
            drafts += block[:cut]
            probs += [1.0] * cut
            if cut < run:
                return drafts, probs
            continue
        col = matrix[:, len(drafts)]
        live = col != SEPARATOR
        if not live.all():
            matrix, col = matrix[live], col[live]
        token, top = _most_frequent(col) if len(col) else (SEPARATOR, 0)
        if not top or top < MIN_PROB * len(col):
            return drafts, probs
        drafts.append(token)
        probs.append(top / len(col))
        matrix = matrix[col == token]
    rows = matrix[:, len(drafts):].tolist()
    for j in range(limit - len(drafts)):
        counts: dict[int, int] = {}  # first seen = in the most recent occurrence
        for row in rows:
            if row[j] != SEPARATOR:
                counts[row[j]] = counts.get(row[j], 0) + 1
        if not counts:
            break
        top = max(counts.values())
        total = sum(counts.values())
        if top < MIN_PROB * total:
            break
        token = next(t for t, n in counts.items() if n == top)  # ties: the most recent occurrence
        drafts.append(token)
        probs.append(top / total)
        rows = [row for row in rows if row[j] == token]
    return drafts, probs


def _most_frequent(col: np.ndarray) -> tuple[int, int]:
    """The most frequent value of `col` (ordered most recent first) and its count; ties go to the one
    seen first."""
    order = np.argsort(col, kind="stable")  # equal values keep their order: each group's first = its most recent
    ordered = col[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    counts = np.diff(np.append(starts, len(ordered)))
    best = int(np.argmax(counts * (len(ordered) + 1) - order[starts]))
    return int(ordered[starts[best]]), int(counts[best])


class RequestIndex:
    """One request's prompt and output as a growing token array (the per-request suffix tree)."""

    def __init__(self, tokens: list[int], prompt_len: int) -> None:
        self.buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.n = 0
        self.prompt_len = prompt_len
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        if self.n + len(tokens) > len(self.buf):
            grown = np.empty(2 * (self.n + len(tokens)), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : self.n + len(tokens)] = tokens
        self.n += len(tokens)

    def sync(self, tokens: list[int]) -> None:
        """Make the index hold exactly `tokens` (the engine's text; a stop may have dropped emitted tokens)."""
        if self.n > len(tokens) or (self.n and self.buf[self.n - 1] != tokens[self.n - 1]):
            self.n = 0
            self.extend(tokens)
        elif self.n < len(tokens):
            self.extend(tokens[self.n :])

    @property
    def text(self) -> np.ndarray:
        return self.buf[: self.n]

    def lookup(self, k: int) -> Match:
        """Drafts from the text's own earlier occurrences of its longest suffix."""
        text = self.text
        n = len(text)
        if k <= 0 or n < 2:
            return NO_MATCH
        ends, length = deepest_node(text, np.flatnonzero(text[: n - 1] == text[-1]), text)
        if not length:
            return NO_MATCH
        drafts, probs = walk(text, ends, min(k, math.ceil(SPEC_FACTOR * length)), n)
        return Match(drafts, length, tuple(probs), "request") if drafts else NO_MATCH

    def tail_for_global(self) -> np.ndarray:
        """What this request adds to the global index: its output, after its prompt's last MATCH_CAP tokens."""
        return self.buf[max(0, self.prompt_len - MATCH_CAP) : self.n].copy()


@dataclass
class GlobalIndex:
    """One pool of finished requests' outputs (with their prompt tails): one array with separators,
    oldest request first. Its bound is `SharedIndex`'s, which holds every pool."""

    parts: deque[np.ndarray] = field(default_factory=deque)
    hay: np.ndarray = field(default_factory=lambda: np.full(1, SEPARATOR, dtype=np.int64))
    tokens: int = 0  # tokens held (separators not counted)
    # hay's positions ordered by token, then position: a token's occurrences are one slice of it (a
    # lookup reads them instead of scanning the whole index; rebuilt when a request joins or leaves)
    by_token: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    sorted_tokens: np.ndarray = field(default_factory=lambda: np.full(1, SEPARATOR, dtype=np.int64))
    # (matched suffix, limit) -> the walk from its node: a node's continuations do not change until the
    # hay does, and common nodes (a comma, " the") are asked for by many rows and steps
    walks: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = field(default_factory=dict)

    def add(self, tokens: np.ndarray) -> None:
        self.parts.append(tokens)
        self.tokens += len(tokens)
        self._rebuild()

    def drop_oldest(self) -> None:
        """Evict the oldest request (`SharedIndex` does, to keep its bound)."""
        self.tokens -= len(self.parts.popleft())
        self._rebuild()

    def _rebuild(self) -> None:
        pieces = [np.full(1, SEPARATOR, dtype=np.int64)]
        for part in self.parts:
            pieces += [part, pieces[0]]
        self.hay = np.concatenate(pieces)  # SEP part SEP part ... SEP
        self.by_token = np.argsort(self.hay, kind="stable")
        self.sorted_tokens = self.hay[self.by_token]
        self.walks.clear()

    def occurrences(self, token: int) -> np.ndarray:
        """Where `token` occurs in the hay, ascending."""
        lo, hi = np.searchsorted(self.sorted_tokens, [token, token + 1])
        return self.by_token[lo:hi]

    def lookup(self, text: np.ndarray, k: int) -> Match:
        """Drafts from earlier requests' continuations of the text's longest suffix."""
        if k <= 0 or len(self.hay) < 3 or not len(text):
            return NO_MATCH
        hay = self.hay
        ends, length = deepest_node(hay, self.occurrences(int(text[-1])), text)  # hay ends with a separator
        if not length:
            return NO_MATCH
        limit = min(k, math.ceil(SPEC_FACTOR * length))
        key = (tuple(text[-length:].tolist()), limit)
        found = self.walks.get(key)
        if found is None:
            if len(self.walks) >= MEMO_WALKS:
                self.walks.clear()
            found = self.walks[key] = walk(hay, ends, limit, len(hay))
        drafts, probs = found
        return Match(list(drafts), length, tuple(probs), "global") if drafts else NO_MATCH


class SharedIndex:
    """The global index, one partition per cache salt (vLLM's `cache_salt`: tenants that must not learn
    from each other's outputs, even through timing, send different salts; requests without one share a
    partition). A request drafts only from its own salt's partition and feeds only that one. One bound
    holds across all partitions: the oldest request is evicted first, whatever its salt, so many salts
    cannot grow memory."""

    def __init__(self, max_tokens: int = GLOBAL_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.partitions: dict[str | None, GlobalIndex] = {}
        self._order: deque[str | None] = deque()  # the salt of every request held, oldest first
        self.tokens = 0  # tokens held in all partitions

    def add(self, tokens: np.ndarray, salt: str | None = None) -> None:
        if len(tokens) < 2:
            return
        tokens = tokens[-self.max_tokens :]
        while self._order and self.tokens + len(tokens) > self.max_tokens:  # room first: the oldest go
            oldest = self._order.popleft()
            victim = self.partitions[oldest]
            self.tokens -= len(victim.parts[0])
            victim.drop_oldest()
            if not victim.parts:
                del self.partitions[oldest]
        self.partitions.setdefault(salt, GlobalIndex()).add(tokens)
        self._order.append(salt)
        self.tokens += len(tokens)

    @property
    def nbytes(self) -> int:
        """Bytes of the partitions' arrays (each request's tokens, the hay and its order by token)."""
        # snapshots (list() of a dict or deque is atomic): the worker thread changes them while /metrics reads
        return sum(sum(a.nbytes for a in list(p.parts)) + p.hay.nbytes + p.by_token.nbytes + p.sorted_tokens.nbytes
                   for p in list(self.partitions.values()))

    def lookup(self, text: np.ndarray, k: int, salt: str | None = None) -> Match:
        part = self.partitions.get(salt)
        return part.lookup(text, k) if part is not None else NO_MATCH


def best_match(request: Match, shared: Match) -> Match:
    """The longer match (a deeper node is more specific); on equal length the higher score, then the request's own."""
    if not shared.drafts:
        return request
    if not request.drafts:
        return shared
    return max((request, shared), key=lambda m: (m.length, m.score, m.source == "request"))


class SuffixProposer(Proposer):
    # A lookup is a few numpy calls, a small fraction of a target step per draft token (`python -m
    # bench.lookup_cost`; docs/bench.md, "Figures behind the code").
    traits = Traits(lookahead=True, draft_token_cost=0.0005, confidence_priors=LEVEL_PRIORS)

    def __init__(self, global_tokens: int = GLOBAL_TOKENS) -> None:
        self.requests: dict[str, RequestIndex] = {}
        self.salts: dict[str, str | None] = {}  # each request's cache salt: the partition it reads and feeds
        self.shared = SharedIndex(global_tokens)

    @classmethod
    def build(cls, ctx: BuildContext) -> SuffixProposer:
        return cls()

    def cache_bytes(self, seen: set[tuple[str, int]]) -> int:
        """The global index and the running requests' own (proposer.py)."""
        return self.shared.nbytes + sum(index.buf.nbytes for index in list(self.requests.values()))

    def join(self, seqs: list[SequenceView], prompt_hidden: object = None) -> None:
        for seq in seqs:
            self._start(seq)

    def _start(self, seq: SequenceView) -> RequestIndex:
        """Index a sequence from its text so far (the prompt), in its cache salt's pool."""
        tokens = seq.tokens
        self.salts[seq.request_id] = seq.cache_salt
        index = self.requests[seq.request_id] = RequestIndex(tokens, len(tokens))
        return index

    def _index(self, seq: SequenceView) -> RequestIndex:
        index = self.requests.get(seq.request_id)
        if index is None:  # not joined through the planner (a direct caller): the text so far is the prompt
            return self._start(seq)
        index.sync(seq.tokens)
        return index

    def match(self, seq: SequenceView, k: int) -> Match:
        """The better of the request's own and the global index's drafts for `seq`, up to k tokens."""
        index = self._index(seq)
        return best_match(index.lookup(k), self.shared.lookup(index.text, k, seq.cache_salt))

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> Proposal:
        found = [self.match(seq, k) for seq, k in zip(seqs, ks, strict=True)]
        return Proposal(drafts=[m.drafts for m in found], confidence=[m.level for m in found])

    def commit(self, seq: SequenceView, drafts: list[int], emitted: list[int], hidden: object) -> None:
        index = self.requests.get(seq.request_id)
        if index is not None:
            index.extend(emitted)  # before the engine appends them (a stop may drop some: `sync` repairs)

    def leave(self, request_ids: set[str]) -> None:
        """Finished or aborted requests' outputs join the global index (oldest evicted first)."""
        for rid in sorted(request_ids):
            index = self.requests.pop(rid, None)
            salt = self.salts.pop(rid, None)
            if index is not None and index.n > index.prompt_len:
                self.shared.add(index.tail_for_global(), salt)
