"""Per-token origins on responses (opt-in): which tokens were accepted drafts, recovered, bonus or plain.

A client asks with `stream_options: {"include_speculation": true}` (streaming) or
`speculation: {"include_tokens": true}` (either mode). Each choice then carries

    "speculation": {"tokens": [{"text", "origin", "proposer", "step"}, ...],
                    "draft_tokens": D, "accepted_tokens": A, "decode_steps": S}

with one entry per generated token, in order (`origin`/`proposer`/`step` as in
`server.types.TokenSource`) and the choice's cumulative speculation figures so far. In a stream,
each content chunk lists the tokens whose text it completes; the non-streaming choice lists them all.

`OriginTracker` follows one choice. The engine gives one `TokenSource` per token but the text in
increments that need not split at token boundaries (a multi-byte character waits for its last token;
text that may begin a stop string is held back). So each token's text is cut from the choice's own
content, at boundaries found by decoding the tokens the way the engine's detokenizer does: joined
over the response, the entries' `text` equals the content exactly, whatever the boundaries.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from server.api.schemas import _GenerationBody
from server.types import RequestOutput, TokenSource

_CONTEXT = 6  # prompt tokens decoded alongside, as the engine's detokenizer does (leading-space rules)


def wants_origins(body: _GenerationBody) -> bool:
    """Whether the request asked for per-token origins."""
    streamed = bool(body.stream_options and body.stream_options.include_speculation)
    return streamed or bool(body.speculation and body.speculation.include_tokens)


class TokenTexts:
    """How many characters each generated token adds to a choice's text, decoding the tokens the way the
    engine's detokenizer does (a few prompt tokens as context for leading-space rules; a token that ends
    in half a character adds nothing until the character is complete)."""

    def __init__(self, tokenizer: Any, prompt_ids: tuple[int, ...] | list[int]) -> None:
        self._decode = tokenizer.decode
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0  # start of the window decoded for context
        self._read = len(self._ids)  # first token whose text is not yet counted

    def add(self, token_id: int) -> int:
        """Characters `token_id` adds to the text (0 while it ends in half a character)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = self._decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return 0
        self._prefix, self._read = self._read, len(self._ids)
        return len(after) - len(before)


def tokens_for(tokenizer: Any, prompt_ids: tuple[int, ...] | list[int], token_ids: list[int], chars: int) -> int:
    """How many of `token_ids` (a choice's tokens, after `prompt_ids`) it takes to write its first `chars`
    characters: where a reply the API ended early (a repeated tool call) stops counting tokens."""
    texts, written = TokenTexts(tokenizer, prompt_ids), 0
    for n, token_id in enumerate(token_ids):
        if written >= chars:
            return n
        written += texts.add(token_id)
    return len(token_ids)


class OriginTracker:
    """One choice's per-token origin entries, built from its engine outputs in order."""

    def __init__(self, tokenizer: Any, prompt_ids: tuple[int, ...] | list[int]) -> None:
        self._texts = TokenTexts(tokenizer, prompt_ids)
        self._pending: deque[tuple[TokenSource, int]] = deque()  # (source, text length) not yet emitted
        self._released = ""  # content received but not yet given to a token
        self.entries: list[dict[str, Any]] = []  # every entry so far
        self._stats: dict[str, int] = {"draft_tokens": 0, "accepted_tokens": 0, "decode_steps": 0}

    def feed(self, out: RequestOutput) -> dict[str, Any]:
        """Take one engine output; returns the `speculation` object for the chunk that carries it:
        the tokens whose text is now complete, and the cumulative figures."""
        if len(out.sources) != len(out.token_ids):
            raise ValueError(f"{len(out.sources)} token sources for {len(out.token_ids)} tokens")
        for source, token_id in zip(out.sources, out.token_ids, strict=True):
            self._pending.append((source, self._texts.add(token_id)))
        self._released += out.text
        new: list[dict[str, Any]] = []
        while self._pending and (self._pending[0][1] <= len(self._released) or out.finished):
            source, length = self._pending.popleft()
            if out.finished and not self._pending:
                length = len(self._released)  # the last token takes what is left (a final flush)
            text, self._released = self._released[:length], self._released[length:]
            new.append({"text": text, "origin": source.origin, "proposer": source.proposer, "step": source.step})
        self.entries.extend(new)
        st = out.stats
        self._stats = {
            "draft_tokens": st.draft_tokens,
            "accepted_tokens": st.accepted_tokens,
            "decode_steps": st.decode_steps,
        }
        return {"tokens": new, **self._stats}

    def summary(self, tokens: int | None = None) -> dict[str, Any]:
        """The non-streaming choice's `speculation` object: every token (its first `tokens` when the API
        ended the choice early)."""
        return {"tokens": self.entries[:tokens], **self._stats}


def origin_trackers(
    tokenizer: Any, body: _GenerationBody, prompts: list[tuple[int, ...]]
) -> list[OriginTracker] | None:
    """One tracker per choice (`prompts`: each choice's prompt ids) when the request asked; else None."""
    return [OriginTracker(tokenizer, p) for p in prompts] if wants_origins(body) else None


def attach(
    choices: list[dict[str, Any]], trackers: list[OriginTracker] | None, tokens: list[int] | None = None
) -> None:
    """Add each non-streaming choice's `speculation` object (when the request asked for it); `tokens`: each
    choice's number of tokens, when some were ended early."""
    for choice in choices if trackers else ():
        i = choice["index"]
        choice["speculation"] = trackers[i].summary(tokens[i] if tokens else None)
