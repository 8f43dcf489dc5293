"""A step's token budget: what its one target pass may compute, split between decoding and prompts.

Every step runs one target pass of at most `tokens` tokens (the setting `max_num_batched_tokens`). Rows
are served in the batch's order, which is the order they entered it (oldest first):

1. every decoding row feeds its last token;
2. a row whose prompt is still being computed *finishes* it when what is left of the budget holds the
   rest of its prompt and its last token: its pass computes them and it starts decoding (and drafting) in
   this very step, as a decoding row does. A short prompt finishes so even behind a long one: a chat's
   title request never waits for the 7,000-token prompt that came just before it (the long one gets what
   the short ones leave, every step);
3. the first row whose prompt does not fit is *prefilling*: it gets a chunk of its prompt, and the other
   rows that do not fit nothing (a prompt longer than the budget is computed over several steps).
4. drafts come before that chunk: they may take what step 3 would have given it (`room`). A draft then
   displaces a prompt token, which a later pass computes instead: `auto` prices such a draft at a prompt
   token's cost rather than at what it adds to the pass (policy.py `StepCosts`).

A prompt token deep in a long context costs more than one budget token (`StepBudget`): its attention reads
every earlier token, and past the model's `attention_span` (the context length at which a token's attention
costs as much as its linear layers, from the model's shape: SmolLM2-135M 3,072) that is most of its cost. A
prompt token at position c counts 1 + c / span, so a step's pass costs about the same however deep into a
prompt its chunk is: measured on 2 cores, 128-token chunks of an 8,000-token prompt took 0.2 s early and
about 1 s at its end, where the streams beside it waited for each. Decoding rows' tokens count 1 each. A
step where no row decodes counts every token 1: nobody waits for it, and shorter chunks would only make
the prompt slower (each pass reads the whole cache once: an 8,000-token prompt alone took 1.24x longer).

Example: budget 64, three decoding rows, a new 20-token prompt (19 tokens before its last) and an older
1,000-token one ahead of it. The decoding rows take 3 tokens; the old prompt does not fit, so it is
prefilling; the new one fits in the 61 left and finishes (20 tokens). Drafts may take up to the 41 tokens
left (`room`), every one of them displacing a prompt token; if they take 10, the old prompt's chunk is 31.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from server.speculation.plan import IDLE_ROW, RowPlan, StepPlan


@dataclass(frozen=True)
class StepBudget:
    """`tokens`: the most a step's pass computes (`max_num_batched_tokens`), prompt tokens weighted by their
    position over `attention_span` (None: every token counts 1)."""

    tokens: int
    attention_span: int | None = None

    def cost(self, start: int, n: int) -> float:
        """What prompt tokens start .. start + n - 1 (positions in their sequence) take of the budget."""
        if not self.attention_span or n <= 0:
            return float(max(n, 0))
        return n + n * (start + (n - 1) / 2) / self.attention_span

    def within(self, start: int, need: int, left: float) -> int:
        """The most of `need` prompt tokens from position `start` whose cost fits in `left` (at least one
        when `left` holds a token at all: a prompt deeper than the budget's reach still moves)."""
        if need <= 0 or left < 1:
            return 0
        if not self.attention_span:
            return min(need, int(left))
        # n + n (start + (n - 1) / 2) / span <= left: the positive root of the quadratic in n, then checked
        a, b = 1 / (2 * self.attention_span), 1 + (start - 0.5) / self.attention_span
        n = int((-b + math.sqrt(b * b + 4 * a * left)) / (2 * a))
        while n > 0 and self.cost(start, n) > left:
            n -= 1
        while n < need and self.cost(start, n + 1) <= left:
            n += 1
        return max(1, min(n, need))


UNLIMITED = StepBudget(2**31)


def attention_span(config: object) -> int | None:
    """The context length at which one token's attention (a query against every earlier key and value) costs
    as many multiply-adds as its linear layers, from a Llama-like config; None when the config does not say."""
    try:
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        linear = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden \
            + 3 * hidden * config.intermediate_size
        return max(1, round(linear / (2 * heads * head_dim)))
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


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
    budget: StepBudget | None  # None: no limit
    prompt_done: list[int]  # each row's prompt tokens computed before this step (positions)

    def with_drafts(self, drafts: int) -> list[int]:
        """Every row's chunk once the step's drafts take `drafts` tokens of the room: the prefilling row
        (the first whose prompt did not fit) gets what they leave (weighted by depth: `StepBudget`), the
        rows behind it nothing."""
        left = self.room.tokens - drafts
        chunks = list(self.chunks)
        for b, (verify, need) in enumerate(zip(self.verify, self.prompt_left, strict=True)):
            if not verify and need:
                chunks[b] = (self.budget or UNLIMITED).within(self.prompt_done[b], need, left)
                break
        return chunks

    def plan(self, rows: list[RowPlan]) -> StepPlan:
        """The step's plan from each row's drafts (rows that do not verify draft nothing): every row's chunk
        from what the drafts leave."""
        chunks = self.with_drafts(sum(r.k for r, v in zip(rows, self.verify, strict=True) if v))
        return StepPlan([replace(r if v else IDLE_ROW, chunk=c, verify=v)
                         for r, c, v in zip(rows, chunks, self.verify, strict=True)],
                        self.budget.tokens if self.budget else None)


def split(budget: StepBudget | int | None, prompt_left: list[int | None], prompt_done: list[int] | None = None
          ) -> Split:
    """The step's budget (None: no limit) over rows whose prompt tokens not yet computed are `prompt_left` (0: a
    decoding row; None: a row that takes no part this step, e.g. held back after a failure) and computed so far
    `prompt_done` (where their next prompt token sits; none given: at 0)."""
    given = StepBudget(budget) if isinstance(budget, int) else budget
    if given and not any(need == 0 for need in prompt_left):  # no row decodes: no stream to keep moving
        given = StepBudget(given.tokens)
    budget = given or UNLIMITED
    done = prompt_done or [0] * len(prompt_left)
    left: float = budget.tokens - sum(1 for need in prompt_left if need == 0)
    chunks, verify, waiting = [], [], 0.0
    for need, start in zip(prompt_left, done, strict=True):
        if need is None:
            chunks.append(0)
            verify.append(False)
        elif need == 0:
            chunks.append(0)
            verify.append(True)
        elif budget.cost(start, need + 1) <= left:  # its prompt ends this step: it decodes too
            chunks.append(need)
            verify.append(True)
            left -= budget.cost(start, need + 1)
        else:  # prefilling (the first such row) or waiting behind it
            chunks.append(0)
            verify.append(False)
            waiting += budget.cost(start, need)
    room = max(int(left), 0)
    needs = [need or 0 for need in prompt_left]
    return Split(chunks, verify, needs, Room(room, max(0, int(left - waiting))), given, list(done))


def entering(tokens: int, prompt_left: list[int]) -> int:
    """What the budget leaves for rows not in the batch yet, after the batch's decoding rows and the prompts
    that finish (`prompt_left` as in `split`; a prompt that does not fit leaves room to short ones, as in
    `split`): joining rows enter the batch while this is positive (server/engine/admission.py)."""
    return split(tokens, list(prompt_left)).room.tokens  # counted as `split` counts them, by token


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
