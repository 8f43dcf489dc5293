"""A step's token budget: what its one target pass may compute, split between decoding and prompts.

Every step runs one target pass of at most `tokens` tokens (the setting `max_num_batched_tokens`). Rows
are served in the batch's order, which is the order they entered it (oldest first):

1. every decoding row feeds its last token;
2. a row whose prompt is still being computed *finishes* it when what is left of the budget holds the
   rest of its prompt and its last token: its pass computes them and it starts decoding (and drafting) in
   this very step, as a decoding row does;
3. the first row whose prompt does not fit is *prefilling*: it gets a chunk of its prompt, and the rows
   after it nothing (a prompt longer than the budget is computed over several steps);
4. drafts come before that chunk: they may take what step 3 would have given it (`room`). A draft then
   displaces a prompt token, which a later pass computes instead: `auto` prices such a draft at a prompt
   token's cost rather than at what it adds to the pass (policy.py `StepCosts`).

Example: budget 64, three decoding rows, a new 20-token prompt (19 tokens before its last) and an older
1,000-token one ahead of it. The decoding rows take 3 tokens; the old prompt does not fit, so it is
prefilling and the new one waits behind it. Drafts may take up to the 61 tokens left (`room`), every one
of them displacing a prompt token; if they take 10, the old prompt's chunk is 51 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from server.speculation.plan import IDLE_ROW, RowPlan, StepPlan


@dataclass(frozen=True)
class Room:
    """What drafts may take of a step's budget: `tokens` in all, of which the first `free` displace no
    prompt token (the rest each push one to a later step)."""

    tokens: int
    free: int

    @property
    def displacing(self) -> bool:
        return self.free < self.tokens


@dataclass(frozen=True)
class Split:
    """A step's budget over its rows (the batch's order) before drafts are known.

    `chunks[b]`: prompt tokens row b computes this step (a finishing row's whole rest); `verify[b]`: whether
    its last token is verified (it decodes this step); `prompt_left[b]`: its prompt tokens not computed yet
    (before this step); `room`: what drafts may take."""

    chunks: list[int]
    verify: list[bool]
    prompt_left: list[int]
    room: Room

    def with_drafts(self, drafts: int) -> list[int]:
        """Every row's chunk once the step's drafts take `drafts` tokens of the room: the prefilling row
        (the first whose prompt did not fit) gets what they leave, the rows behind it nothing."""
        left = self.room.tokens - drafts
        chunks = list(self.chunks)
        for b, (verify, need) in enumerate(zip(self.verify, self.prompt_left, strict=True)):
            if not verify and need and left > 0:
                chunks[b] = min(need, left)
                left -= chunks[b]
        return chunks

    def plan(self, rows: list[RowPlan], budget: int | None) -> StepPlan:
        """The step's plan from each row's drafts (rows that do not verify draft nothing): every row's chunk
        from what the drafts leave."""
        chunks = self.with_drafts(sum(r.k for r, v in zip(rows, self.verify, strict=True) if v))
        return StepPlan([replace(r if v else IDLE_ROW, chunk=c, verify=v)
                         for r, c, v in zip(rows, chunks, self.verify, strict=True)], budget)


def split(tokens: int, prompt_left: list[int | None]) -> Split:
    """The step's budget of `tokens` over rows whose prompt tokens not yet computed are `prompt_left` (0: a
    decoding row; None: a row that takes no part this step, e.g. held back after a failure)."""
    left = tokens - sum(1 for need in prompt_left if need == 0)
    chunks, verify, waiting = [], [], 0
    for need in prompt_left:
        if need is None:
            chunks.append(0)
            verify.append(False)
        elif need == 0:
            chunks.append(0)
            verify.append(True)
        elif not waiting and need + 1 <= left:  # its prompt ends this step: it decodes as well
            chunks.append(need)
            verify.append(True)
            left -= need + 1
        else:  # prefilling (the first such row) or waiting behind it
            chunks.append(0)
            verify.append(False)
            waiting += need
    left = max(left, 0)
    needs = [need or 0 for need in prompt_left]
    return Split(chunks, verify, needs, Room(left, max(0, left - waiting)))


def entering(tokens: int, prompt_left: list[int]) -> int:
    """What the budget leaves for rows not in the batch yet, after the batch's rows (`prompt_left` as in
    `split`): joining rows enter the batch while this is positive (server/engine/admission.py)."""
    left = tokens - sum(1 if need == 0 else need + 1 for need in prompt_left)
    return max(left, 0)


def fit(ks: list[int], room: int) -> list[int]:
    """Draft counts cut to `room` tokens in all, the longest first: each row keeps at least an equal share
    of the room, or all it asked for.

    >>> fit([8, 2, 5], 9)
    [3, 2, 4]
    """
    ks = list(ks)
    while sum(ks) > room:
        widest = max(range(len(ks)), key=lambda b: ks[b])
        ks[widest] -= 1
    return ks
