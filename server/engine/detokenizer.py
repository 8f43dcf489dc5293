"""Incremental detokenization with stop strings.

Text is produced token by token without ever emitting half of a multi-byte character (a decode that
ends in U+FFFD waits for the next token), and text that could still turn into a stop string is held
back until it either does (then it is cut, and no part of the stop string is emitted unless
`include_stop`) or cannot.

Per-request options (vLLM's): `skip_special_tokens` (default on: special tokens have no text),
`spaces_between_special_tokens` (with special tokens kept: a space between a special token and its
neighbours, as slow tokenizers write them), `min_tokens` (stop strings are looked for only once that
many tokens were generated: a stop string completed earlier does not end the sequence).

Stop strings are followed as the text grows (`_StopString`, a Knuth-Morris-Pratt automaton per string):
each new character costs O(1) amortised whatever the stop strings' lengths, so a client's 100k-character
stop strings cost its own request a table built once, not every neighbour a rescan of the text per token.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from server.types import SamplingParams

_CONTEXT = 6  # prompt tokens decoded alongside, so leading-space and merge rules see their left side


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        stop: tuple[str, ...] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._stops = [_StopString(s) for s in self.stop]
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        spaced = not skip_special_tokens and spaces_between_special_tokens
        self._special = set(tokenizer.all_special_ids) if spaced else None  # None: decode in one call
        self.min_tokens = min_tokens
        self._added = 0  # generated tokens seen
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0  # start of the window decoded for context
        self._read = len(self._ids)  # first token whose text is not yet in `text`
        self.text = ""  # all output text so far (cut at a stop string)
        self._sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found

    @classmethod
    def for_request(
        cls, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], sampling: SamplingParams
    ) -> IncrementalDetokenizer:
        """The detokenizer a request's sampling parameters ask for."""
        return cls(
            tokenizer,
            prompt_ids,
            sampling.stop,
            include_stop=sampling.include_stop_str_in_output,
            skip_special_tokens=sampling.skip_special_tokens,
            spaces_between_special_tokens=sampling.spaces_between_special_tokens,
            min_tokens=sampling.min_tokens,
        )

    def add(self, token_id: int) -> None:
        """Append one generated token; sets `stopped` when a stop string completes."""
        if self.stopped:
            return
        self._ids.append(token_id)
        self._added += 1
        self._decode_new(complete_only=True)

    def _decode(self, ids: list[int]) -> str:
        if self._special is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        # Fast tokenizers ignore `spaces_between_special_tokens`: join the runs of ordinary tokens and
        # each special token with a space, as slow tokenizers (and vLLM) do.
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in self._special:
                if run:
                    parts.append(self.tokenizer.decode(run))
                    run = []
                parts.append(self.tokenizer.decode([t]))
            else:
                run.append(t)
        if run:
            parts.append(self.tokenizer.decode(run))
        return " ".join(parts)

    def _decode_new(self, complete_only: bool) -> None:
        """Move the text of tokens not yet read into `text`. With `complete_only`, wait while the
        text would end in a broken character (U+FFFD) or the new tokens have no text yet."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (complete_only and after.endswith("\ufffd")):
            return
        start = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._stops:
            self._check_stop(start)

    def _check_stop(self, new_from: int) -> None:
        """Feed the text from `new_from` to every stop string; cut at the first (in the request's order)
        that completes in it, when stop strings count yet (`min_tokens`)."""
        new = self.text[new_from:]
        ends = [stop.feed(new) for stop in self._stops]  # every automaton sees every character
        if self._added < self.min_tokens:
            return
        for stop, end in zip(self.stop, ends, strict=True):
            if end >= 0:
                at = new_from + end + 1 - len(stop)
                self.text = self.text[: at + len(stop) if self.include_stop else at]
                self.stopped = True
                return

    def take(self, final: bool = False) -> str:
        """New text since the last call; unless `final`, withhold a tail that may begin a stop string.

        `final`: the sequence ended, so whatever its last tokens decode to is released, even half a
        character (as U+FFFD, exactly what decoding the output tokens gives).
        """
        if final and not self.stopped and self._read < len(self._ids):
            self._decode_new(complete_only=False)
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        end = max(end, self._sent)
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        return max((stop.matched for stop in self._stops), default=0)


class _StopString:
    """One stop string followed through a growing text: `matched` is the length of the longest prefix
    of it that the text seen so far ends with (a proper prefix between calls)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        self._fail: list[int] | None = None  # KMP failure function, built at the first character fed

    def feed(self, text: str) -> int:
        """Follow `text`; the index in it where the first complete occurrence ends, or -1. The automaton
        goes on past a match, as if it had not ended the text (a match before `min_tokens` does not count)."""
        stop, fail, m, first = self.stop, self._table(), self.matched, -1
        for i, ch in enumerate(text):
            while m and stop[m] != ch:
                m = fail[m - 1]
            if stop[m] == ch:
                m += 1
            if m == len(stop):
                first = i if first < 0 else first
                m = fail[m - 1]
        self.matched = m
        return first

    def _table(self) -> list[int]:
        if self._fail is None:
            stop, fail, k = self.stop, [0] * len(self.stop), 0
            for i in range(1, len(stop)):
                while k and stop[i] != stop[k]:
                    k = fail[k - 1]
                if stop[i] == stop[k]:
                    k += 1
                fail[i] = k
            self._fail = fail
        return self._fail
