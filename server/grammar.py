"""Grammar-constrained decoding: which tokens a request's grammar allows at each verify position.

A constrained request carries a grammar (llguidance's serialized form; the API builds it from
`response_format` or a forced `tool_choice`, see server/api/structured.py). The engine keeps one
`GrammarState` per constrained sequence, and the grammar changes only p (docs/design.md):

* `masks(drafts)`: the allowed tokens at every verify position of a step (position j follows the
  output plus drafts d_1..d_j), walking the matcher through the drafts and rolling it back. The engine
  sets p to 0 outside them, so p at each position is exactly what plain constrained decoding would use
  there, and the rejection rule keeps the output distribution that of constrained decoding.
* `valid_prefix(drafts)`: how many leading drafts the grammar allows. The planner cuts a draft there
  (for a sampled draft with its own q, just after the first forbidden token: see planner.py).
* `forced(limit)`: tokens the grammar forces next (a JSON key after `{"`, a tool-call wrapper), offered
  as drafts that cost nothing to propose.
* `advance(tokens)`: the tokens the step committed; `done` once only EOS may follow.

Masks come from llguidance (Rust): about 0.13 ms per verify position for a JSON schema over SmolLM2's
49k vocabulary on one CPU core, bits unpacked included (docs/api.md, "Structured output").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import llguidance
import numpy as np
import torch

from server.grammar_vocab import token_view


class GrammarError(ValueError):
    """A grammar llguidance cannot build a matcher for, or cannot follow (a lexer or parser limit hit
    mid-way, e.g. the regex `a{99999999}`); a message meant for the client."""


class Grammars:
    """Builds matchers for one tokenizer. llguidance's view of the tokenizer (grammar_vocab.py) costs a fraction
    of a second to build, holding the GIL, so it is made once: at start-up (`warm`) or on the first constrained
    request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Collection[int], *, slicer: bool = True) -> None:
        """`vocab_size`: the width of the target's logits (masks are that wide; ids beyond the
        tokenizer are never allowed). `eos_ids`: the tokens that end a sequence once the grammar is
        complete. `slicer`: llguidance's precomputed token subsets for JSON strings (its default). They make a
        mask ~4x cheaper inside a string (SmolLM2, a JSON schema with a long string field: 13 against 52-62
        microseconds a position on one core) for ~28 MiB resident (41 against 13 for the whole view): worth it
        where many constrained rows share a fast step (a GPU), not on a CPU, whose steps take 10 ms and more."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._slices: list[str] | None = None if slicer else []  # None: llguidance's default slices
        self._ll: llguidance.LLTokenizer | None = None

    def warm(self) -> None:
        """Build the tokenizer view now (the server does at start-up, so no request waits for it)."""
        if self._ll is None:  # ids past the tokenizer's (padded logits) exist for the matcher but never match
            n_vocab = self.vocab_size if self.vocab_size > len(self._tokenizer) else None
            self._ll = token_view(self._tokenizer, n_vocab, self._eos, self._slices)  # grammar_vocab.py

    def state(self, grammar: str) -> GrammarState:
        self.warm()
        matcher = llguidance.LLMatcher(self._ll, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarState(matcher, self.vocab_size, self._eos)


class GrammarState:
    """One sequence's position in its grammar (after its committed output)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: Collection[int] = ()) -> None:
        self._m = matcher
        self._vocab = vocab_size
        self._eos = frozenset(eos_ids)

    @property
    def done(self) -> bool:
        """Only EOS may follow: the output is complete."""
        return self._m.is_stopped()

    def failure(self) -> GrammarError:
        """The error to raise once the matcher has failed (its first line: llguidance appends its state)."""
        return GrammarError(f"the grammar could not be followed: {self._m.get_error().splitlines()[0]}")

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of `drafts`, from the first, the grammar allows after the committed output."""
        return self._m.validate_tokens(list(drafts)) if drafts else 0

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (nothing else is allowed before them)."""
        return self._m.compute_ff_tokens()[:limit] if limit > 0 and not self._m.is_stopped() else []

    def masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """[len(drafts) + 1, vocab] bool: the tokens allowed at each verify position; the matcher is
        left where it was. Positions after the first forbidden draft, or after an EOS draft, allow
        everything: what is drawn there never reaches the output (a forbidden token has p = 0 and is
        rejected; an accepted EOS ends the sequence)."""
        out = torch.ones(len(drafts) + 1, self._vocab, dtype=torch.bool)
        valid = self.valid_prefix(drafts)
        if self._m.is_error():
            raise self.failure()
        consumed = 0
        for j in range(valid + 1):
            out[j] = self._allowed()
            if j == valid or drafts[j] in self._eos:  # llguidance cannot roll back past a consumed EOS
                break
            self._m.consume_token(drafts[j])
            consumed += 1
        if consumed:
            self._m.rollback(consumed)
        return out

    def advance(self, tokens: Sequence[int]) -> bool:
        """Commit `tokens` (sampled under this grammar's masks); False if the matcher refused one."""
        return self._m.consume_tokens(list(tokens)) if tokens else True

    def _allowed(self) -> torch.Tensor:
        """[vocab] bool; the matcher's vocabulary may be wider (a model with fewer logits than the
        tokenizer has tokens, as the tests' tiny models): those ids cannot be sampled anyway."""
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self._vocab].astype(bool))
