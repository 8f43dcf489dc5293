"""In-process measurement of the draft-to-target cost ratio c (and the verify cost) per batch size.

c is what the cost model calls the price of one draft token in target steps:
  * draft: one draft-model forward of one token per row / one target forward of one token per row,
    both through the engine's own `ModelRunner` at the same context (the workload prompts);
  * eagle: one draft-head step of one token per row, as `server/speculation/eagle.py` drafts it (the
    pair input fc([embed(x); f]), the head's decoder layer through its own `ModelRunner` fed
    embeddings, and the FR-vocabulary logits scattered over the full vocabulary) / one target forward;
    the head's cache holds the prompt's pairs built from the target's real features;
  * ngram: the engine's `ngram_lookup` for every row of the batch / one target forward (about 0).
`verify` = a target forward over K+1 tokens per row / one over 1 token: the cost model assumes 1.
Measurements of the kinds alternate within each repeat, and the median is kept, so drift on a
shared machine hits all of them alike.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from server.draft_head import resolve_head
from server.draft_head.model import EagleHead
from server.model.attention import use_gqa_attention
from server.model.loading import LoadedModel
from server.model.runner import ModelRunner
from server.speculation.ngram import ngram_lookup


@dataclass(frozen=True)
class BatchCosts:
    batch: int
    context: int  # mean tokens per row before the timed forward
    target_step_ms: float  # one target forward, one new token per row
    draft_step_ms: float | None  # same for the draft model
    head_step_ms: float | None  # one draft-head step, one token per row (None: no head measured)
    verify_ms: float  # one target forward, K+1 new tokens per row
    ngram_ms: float  # n-gram lookup for every row
    k: int

    @property
    def c_draft(self) -> float | None:
        return self.draft_step_ms / self.target_step_ms if self.draft_step_ms is not None else None

    @property
    def c_eagle(self) -> float | None:
        return self.head_step_ms / self.target_step_ms if self.head_step_ms is not None else None

    @property
    def c_ngram(self) -> float:
        return self.ngram_ms / self.target_step_ms

    @property
    def verify_ratio(self) -> float:
        return self.verify_ms / self.target_step_ms

    def to_json(self) -> dict[str, float | int | None]:
        return {**asdict(self), "c_draft": self.c_draft, "c_eagle": self.c_eagle, "c_ngram": self.c_ngram,
                "verify_ratio": self.verify_ratio}


UNTRAINED_FR_VOCAB = 8192  # `python -m server distill --fr-vocab` default: the untrained stand-in's N


def load_head(draft_head: str | None, target_setting: str | None, target: LoadedModel) -> tuple[EagleHead | None, str]:
    """The draft head the server would load (`resolve_head` + `EagleHead.from_pretrained`), and
    a line saying which. When the setting names no head that exists (none has shipped yet), a freshly
    created untrained head of the same shape (FR vocabulary of the distill default) stands in: its
    cost per token is the same, its drafts are not. `draft_head` None (the setting's "none"): no head."""
    if draft_head is None:
        return None, "no draft head (draft_head: none)"
    path = resolve_head(draft_head, target_setting)
    if path is not None and (Path(path) / "config.json").is_file():
        return EagleHead.from_pretrained(path, target.model), f"the head at {path}"
    head = EagleHead.create(target.model, list(range(UNTRAINED_FR_VOCAB)), target.name)
    where = "no head has shipped" if path is None else f"nothing at {path}"
    return head.eval(), (f"an untrained head ({where}; `EagleHead.create`, FR vocabulary {UNTRAINED_FR_VOCAB}): "
                         "same shapes and cost as a trained one")


@contextlib.contextmanager
def engine_attention(*models: torch.nn.Module | None) -> Iterator[None]:
    """Run `models` with the attention the engine gives them (`use_gqa_attention`), then restore
    theirs (the transformers peer must run stock)."""
    saved = [(m, m.config._attn_implementation) for m in models if m is not None]
    for m, _ in saved:
        use_gqa_attention(m)
    try:
        yield
    finally:
        for m, impl in saved:
            if hasattr(m, "set_attn_implementation"):  # transformers' modules (decoder.py's attend one way)
                m.set_attn_implementation(impl)


def _prefilled(model: LoadedModel, rows: list[list[int]]) -> ModelRunner:
    runner = ModelRunner(model.model)
    runner.join([f"row{b}" for b in range(len(rows))], rows)
    return runner


class HeadStep:
    """One draft-head step per row, as `EagleProposer.propose` runs it, over a cache of real pairs.

    The head's cache is prefilled with the pairs (f_t, x_{t+1}) of each row's prompt, built from the
    target's final-norm hidden states; a timed step feeds one pair per row (the last feature and the
    last token), runs the decoder, scores the FR vocabulary and scatters it over the full vocabulary,
    then rolls the step back.
    """

    def __init__(self, head: EagleHead, target: LoadedModel, rows: list[list[int]]) -> None:
        self.head = head
        ids = [f"row{b}" for b in range(len(rows))]
        hidden = ModelRunner(target.model).join(ids, rows, hidden=True)  # per row [n_b, H]
        assert hidden is not None
        self.runner = ModelRunner(head.decoder)
        self.runner.join(ids, [self._pairs(h[:-1], r[1:]) for h, r in zip(hidden, rows, strict=True)])
        self.last = [(h[-1:], r[-1:]) for h, r in zip(hidden, rows, strict=True)]  # ([1, H], [token]) per row

    def _pairs(self, features: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """fc([embed(x_{t+1}) ; f_t]) [n, H], as `EagleProposer._pairs`."""
        head = self.head
        embeds = head.embed(torch.tensor(tokens, device=head.embed_weight.device))
        return head.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))

    def __call__(self) -> float:
        started = time.perf_counter()
        feed = [self._pairs(f, t) for f, t in self.last]
        out = self.runner.forward(feed, logits=False, hidden=True).hidden  # [rows, 1, H]
        self.head.full_logits(self.head.fr_logits(out[:, -1]))  # [rows, vocab]
        elapsed = time.perf_counter() - started
        for b in range(len(self.last)):
            self.runner.rollback(b, 1)
        return elapsed


def _timed_step(runner: ModelRunner, width: int, token: int) -> float:
    """Seconds for one forward of `width` tokens per row; rolled back afterwards (bookkeeping only)."""
    started = time.perf_counter()
    runner.forward([[token] * width for _ in runner.rows])
    elapsed = time.perf_counter() - started
    for b in range(len(runner.rows)):
        runner.rollback(b, width)
    return elapsed


def measure_costs(
    target: LoadedModel,
    draft: LoadedModel | None,
    contexts: list[list[int]],
    batch_sizes: list[int],
    k: int,
    repeats: int = 7,
    ngram_max: int = 4,
    ngram_min: int = 1,
    head: EagleHead | None = None,
) -> dict[int, BatchCosts]:
    """Per batch size: medians of alternating target / draft / head / verify / n-gram timings
    (draft and head only when given)."""
    results = {}
    token = int(contexts[0][-1])
    for batch in batch_sizes:
        rows = [contexts[b % len(contexts)] for b in range(batch)]
        target_kv = _prefilled(target, rows)
        draft_kv = _prefilled(draft, rows) if draft is not None else None
        samples: dict[str, list[float]] = {"target": [], "draft": [], "head": [], "verify": [], "ngram": []}
        kinds: list[tuple[str, Callable[[], float]]] = [
            ("target", lambda kv=target_kv: _timed_step(kv, 1, token)),
            ("verify", lambda kv=target_kv: _timed_step(kv, k + 1, token)),
            ("ngram", lambda rows=rows: _time_ngram(rows, k, ngram_max, ngram_min)),
        ]
        if draft_kv is not None:
            kinds.append(("draft", lambda kv=draft_kv: _timed_step(kv, 1, token)))
        with torch.no_grad():
            if head is not None:
                kinds.append(("head", HeadStep(head, target, rows)))
            for _, run in kinds:  # warm-up: first calls allocate
                run()
            for r in range(repeats):
                for name, run in kinds if r % 2 == 0 else reversed(kinds):
                    samples[name].append(run())
        ms = {name: statistics.median(v) * 1e3 if v else None for name, v in samples.items()}
        results[batch] = BatchCosts(
            batch=batch,
            context=round(sum(len(r) for r in rows) / batch),
            target_step_ms=ms["target"],
            draft_step_ms=ms["draft"],
            head_step_ms=ms["head"],
            verify_ms=ms["verify"],
            ngram_ms=ms["ngram"],
            k=k,
        )
    return results


def _time_ngram(rows: list[list[int]], k: int, n_max: int, n_min: int) -> float:
    started = time.perf_counter()
    for tokens in rows:
        ngram_lookup(tokens, k, n_max, n_min)
    return time.perf_counter() - started
