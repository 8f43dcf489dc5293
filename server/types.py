"""Plain data passed between the scheduler and the engine: requests in, per-step outputs out.

Nothing here imports torch; the API and scheduler layers depend only on these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]
Origin = Literal["accepted", "recovered", "bonus", "plain"]  # where an emitted token came from
DEFAULT_METHOD = "auto"  # the method of a request that names none (`Settings.speculation`'s default too)
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (logits / T would overflow fp32 near 1e-38)
DEFAULT_NUM_TOKENS = 8  # K: the most draft tokens per step (`Settings.num_speculative_tokens`'s default)
# `auto`'s own ceiling (`Settings.auto_max_speculative_tokens`'s default): it picks K per row and step from
# measured acceptance and pass costs, so a long confident match may draft a long run; a fixed method drafts
# its K every step, where 8 is the safer default.
DEFAULT_AUTO_MAX_TOKENS = 16


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence samples. temperature == 0 means greedy.

    `p` in docs/design.md is the target distribution after penalties, `logit_bias`, the `min_tokens` mask,
    `temperature`, `min_p`, `top_k` and `top_p` (see server/sampling.py for the order).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; no part of one reaches the output
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (1 = off)
    min_p: float = 0.0  # drop tokens whose probability is below min_p * the top token's (0 = off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    logprobs: int | None = None  # None: off; N >= 0: the chosen token's logprob plus the top N
    # Detokenization (what text the tokens become); they never change which tokens are sampled.
    include_stop_str_in_output: bool = False  # keep the stop string / stop token's text in the output
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # with skip_special_tokens=False: " " around them

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("top_logprobs must be in [0, 20]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that dividing fp32 logits by it would overflow to inf (the
        limit of sampling as T -> 0 is the argmax)."""
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SpeculationParams:
    """Which proposer drafts for a sequence and the most tokens it drafts per step (K).

    `method`: "none", a proposer's name (server/speculation/registry.py), or "auto", which lets the engine
    pick the proposer and k <= K every step from measured acceptance and costs, down to plain decoding
    when speculation does not pay. Whether the server can run it is `ServingLimits.check`'s question.
    """

    method: str = DEFAULT_METHOD
    num_tokens: int = DEFAULT_NUM_TOKENS  # K

    def __post_init__(self) -> None:
        if not 1 <= self.num_tokens <= 32:
            raise ValueError("speculation.num_tokens must be in [1, 32]")

    @classmethod
    def resolve(
        cls,
        method: str | None,
        num_tokens: int | None,
        *,
        default_method: str,
        num_speculative_tokens: int,
        auto_max_speculative_tokens: int,
    ) -> SpeculationParams:
        """What a request asks for, with the server's defaults where it names nothing (the settings of the
        same names): its method, else `default_method`; its K, else `auto`'s ceiling for `auto` and
        `num_speculative_tokens` for any other method.

        >>> SpeculationParams.resolve("auto", None, default_method="none", num_speculative_tokens=8,
        ...                           auto_max_speculative_tokens=16)
        SpeculationParams(method='auto', num_tokens=16)
        """
        method = method or default_method
        default = auto_max_speculative_tokens if method == "auto" else num_speculative_tokens
        return cls(method=method, num_tokens=num_tokens or default)


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate. `n > 1` in the API becomes n of these."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    # Constrained decoding: the grammar the output must follow, in llguidance's serialized form (the API
    # builds it from response_format or a forced tool_choice: server/api/structured.py); None: free text.
    grammar: str | None = None
    # Cross-request state (suffix's global index of earlier outputs) is shared only between requests with
    # the same salt (vLLM's `cache_salt`); None: the shared default.
    cache_salt: str | None = None
    # The scheduler admits waiting requests in ascending priority, first come first served within one
    # (vLLM's `priority`: lower is earlier); running requests are never preempted for it.
    priority: int = 0


@dataclass(frozen=True)
class ServingLimits:
    """What the loaded engine can serve. `check` is the one place a request is validated against it,
    before it reaches the engine (the API turns its ValueError into a 400, the scheduler into a
    rejected request)."""

    max_context: int  # prompt + max_tokens, in tokens
    vocab_size: int  # token ids must be in [0, vocab_size): the target's logits width
    methods: tuple[str, ...]  # speculation methods this server runs

    def check(self, request: GenerationRequest) -> None:
        """Raise ValueError (a message meant for the client) if the engine cannot run `request`."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        total = len(prompt) + request.sampling.max_tokens
        if total > self.max_context:
            raise ValueError(
                f"this model's maximum context length is {self.max_context} tokens, but the request asks "
                f"for {total} ({len(prompt)} in the prompt + {request.sampling.max_tokens} max_tokens)"
            )
        self.check_method(request.speculation.method)

    def check_method(self, method: str) -> None:
        if method not in self.methods:
            raise ValueError(
                f"speculation method {method!r} is not available on this server (available: "
                f"{', '.join(self.methods)})"
            )


@dataclass
class ProposerTally:
    """Draft and accepted tokens of one proposer within one request."""

    draft_tokens: int = 0
    accepted_tokens: int = 0


FallbackReason = Literal["error", "switched_off"]


@dataclass(frozen=True)
class Fallback:
    """A proposer a request's speculation lost because the proposer failed (server/failsafe.py): the request went
    on without it (plain decoding for a fixed method; `auto` choosing among the others). `reason` "error": the
    proposer raised in a call for this request; "switched_off": it had failed too often (in any request's calls)
    and was switched off until restart, before or while this request ran. `error`: the exception's type name
    (its message, which can hold internals, goes to the server's log only)."""

    proposer: str
    reason: FallbackReason
    error: str | None = None


@dataclass
class RequestStats:
    """Cumulative speculation figures for one request; feeds `usage.speculation`."""

    method: str  # the request's method ("auto", "ngram", ...)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache (not computed)
    completion_tokens: int = 0
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # draft tokens the target kept
    recovered_tokens: int = 0  # tokens sampled from the residual at a rejection
    bonus_tokens: int = 0  # extra target tokens after all drafts were accepted
    decode_steps: int = 0  # verify passes (target forwards after prefill)
    accepted_per_position: list[int] = field(default_factory=list)  # index j: accepted at draft pos j
    by_proposer: dict[str, ProposerTally] = field(default_factory=dict)  # who drafted what (auto mixes them)
    fallbacks: list[Fallback] = field(default_factory=list)  # proposers it lost to their failure, in order, one each

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.decode_steps if self.decode_steps else 0.0


def total_stats(stats: list[RequestStats], method: str, prompt_tokens: int, completion_tokens: int) -> RequestStats:
    """One API request's figures: its choices' `RequestStats` summed (draft, accepted, recovered and bonus
    tokens, passes, per position and per proposer), its prompt counted once, and the prompt tokens every
    choice found cached (the choices join together, so they find the same)."""
    total = RequestStats(method=method, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         cached_tokens=min((s.cached_tokens for s in stats), default=0))
    for s in stats:
        total.draft_tokens += s.draft_tokens
        total.accepted_tokens += s.accepted_tokens
        total.recovered_tokens += s.recovered_tokens
        total.bonus_tokens += s.bonus_tokens
        total.decode_steps += s.decode_steps
        for j, n in enumerate(s.accepted_per_position):
            if j == len(total.accepted_per_position):
                total.accepted_per_position.append(0)
            total.accepted_per_position[j] += n
        for name, tally in s.by_proposer.items():
            mine = total.by_proposer.setdefault(name, ProposerTally())
            mine.draft_tokens += tally.draft_tokens
            mine.accepted_tokens += tally.accepted_tokens
        for fallback in s.fallbacks:  # a proposer lost by several choices is said once
            if all(f.proposer != fallback.proposer for f in total.fallbacks):
                total.fallbacks.append(fallback)
    return total


@dataclass(frozen=True)
class FinishedSequence:
    """One sequence that left the scheduler (any finish reason), as the metrics read it: its figures and
    when (monotonic seconds) it passed each stage. `scheduled`, `first_token`, `last_token` are None when it
    never got there (aborted while waiting, or before its first token)."""

    stats: RequestStats
    finish_reason: str
    max_tokens: int  # the request's max_tokens (resolved)
    arrival: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float
    # Set on the last sequence of its API request to leave: the most tokens any of its sequences generated
    # (vLLM's "max generation tokens" of a request); None on the others.
    request_max_generated: int | None = None

    @property
    def queue_s(self) -> float:
        """Arrival to first scheduled (to the end, for a sequence that never was)."""
        return (self.finished if self.scheduled is None else self.scheduled) - self.arrival

    @property
    def e2e_s(self) -> float:
        return self.finished - self.arrival

    @property
    def prefill_s(self) -> float:
        """Scheduled to first token (vLLM's prefill phase); 0 without a first token."""
        return 0.0 if self.first_token is None or self.scheduled is None else self.first_token - self.scheduled

    @property
    def decode_s(self) -> float:
        """First token to last token (vLLM's decode phase)."""
        return 0.0 if self.first_token is None or self.last_token is None else self.last_token - self.first_token

    @property
    def inference_s(self) -> float:
        """Scheduled to last token (vLLM's running phase)."""
        return 0.0 if self.scheduled is None or self.last_token is None else self.last_token - self.scheduled

    @property
    def time_per_output_token_s(self) -> float:
        """(e2e - time to first token) / (tokens - 1), vLLM's per-request TPOT; 0 for one token or none."""
        n = self.stats.completion_tokens
        if n <= 1 or self.first_token is None:
            return 0.0
        return (self.finished - self.first_token) / (n - 1)


@dataclass(frozen=True)
class SeqStepStats:
    """What one verify pass did for one sequence (per-step input to the metrics)."""

    request_id: str
    method: str  # the request's method ("auto", "ngram", ...)
    proposer: str  # who drafted in this step: a proposer's name, or "none" for a plain step
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int  # tokens appended this step before stop truncation: accepted + 1
    bonus: bool  # True when all drafts were accepted and a bonus token was sampled


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a generated token under the target's raw distribution (no sampling transforms)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class TokenSource:
    """Where one emitted token came from (opt-in per-token origins on the stream).

    `origin`: an accepted draft token, the recovered token at a rejection, the bonus token after a fully
    accepted draft, or a plain step's token. `proposer`: who drafted in that step (None for plain).
    `step`: the request's verify pass (0-based), so tokens of one target pass share it.
    """

    origin: Origin
    proposer: str | None
    step: int


@dataclass
class RequestOutput:
    """What one `Engine.step()` produced for one request.

    `text` is the new text since the previous output (incremental detokenization: never ends in a
    broken multi-byte character; text that might begin a stop string is held back).
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None
    stats: RequestStats
    sources: list[TokenSource] = field(default_factory=list)  # one per token in `token_ids`


@dataclass
class StepResult:
    """Everything one engine step produced."""

    outputs: list[RequestOutput]
    seq_stats: list[SeqStepStats]
    prefill_tokens: int = 0  # prompt tokens the step's pass computed (chunks of prompts)
    duration_s: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why: rows whose step raised (they left)
    # request id -> why: rows whose step raised because of their own input (a grammar llguidance cannot
    # follow); they left too, and their clients get a 400
    rejected: dict[str, str] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens read from the prefix cache this step (not computed)
    degraded: list[str] = field(default_factory=list)  # optional parts that failed since the last step, per failure
    # proposers requests lost to their failure this step: (the request's method, what it lost), once per choice
    fallbacks: list[tuple[str, Fallback]] = field(default_factory=list)
    prompt_tokens_waiting: int = 0  # prompt tokens of the running requests not computed yet, after the step
