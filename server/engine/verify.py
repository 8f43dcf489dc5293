"""One target pass over a step's plan, and the rejection sampler's verdict.

Every verified row feeds `[last token, d_1..d_k]` and is scored at those k + 1 positions (a row whose
prompt ends this step feeds its last chunk first, `[chunk, last, d_1..d_k]`, scored at the same k + 1: the
chunk's logits are never computed); a row whose prompt goes on feeds a chunk of it only, and is not scored
(its features are kept when a proposer reads them: `Chunk`). The logits come back row after row, one per
scored position (never padded), and become p with each position's own controls (penalties over the tokens
before it, the grammar's mask walked through the drafts, min_tokens, temperature, top-k/p): exactly what
plain decoding would use there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from server.engine.sequence import Sequence
from server.model.runner import ModelRunner
from server.sampling import BatchSampling, greedy_tokens, probabilities, raw_logprobs
from server.speculation.plan import RowPlan, Rule, StepPlan, place
from server.speculation.rejection import Verdict, rejection_sample
from server.types import TokenLogprob


@dataclass(frozen=True)
class Chunk:
    """A row whose pass computed only a chunk of its prompt (`tokens` of them; their features when asked)."""

    cache_row: int
    seq: Sequence
    tokens: int
    hidden: torch.Tensor | None  # [tokens, hidden]


@dataclass(frozen=True)
class Verified:
    """A step up to the sampler's verdict, for its verified rows (index i), in the target cache's order."""

    cache_rows: list[int]  # row i's index in the target cache
    seqs: list[Sequence]
    rows: list[RowPlan]  # placed: row i's verify positions in `logits` are `rows[i].positions`
    logits: torch.Tensor  # [positions, vocab]
    hidden: torch.Tensor | None  # [fed positions, hidden] when a proposer reads the target's features
    fed_at: list[int]  # row i's fed positions in `hidden`: fed_at[i]:fed_at[i + 1] (its prompt's last chunk first)
    verdict: Verdict  # per row: accepted drafts, and the emitted tokens (accepted + recovered or bonus)
    computed: int  # tokens the pass computed (packed: the real ones; padded: rows x the widest)
    chunks: list[Chunk]  # the rows whose pass computed a chunk of their prompt only
    prompt_tokens: int  # prompt tokens the pass computed (chunks): then it is no verify pass of its width alone

    def committed_hidden(self, i: int) -> torch.Tensor | None:
        """Row i's features of the fed tokens it commits: its prompt's last chunk's, its last token's, its
        accepted drafts' (a view of the step's hidden tensor)."""
        if self.hidden is None:
            return None
        at = self.fed_at[i]
        return self.hidden[at : at + self.rows[i].chunk + self.verdict.accepted[i] + 1]

    def logprobs(self, i: int, top: int | None) -> list[TokenLogprob] | None:
        """Logprobs of row i's emitted tokens under the target's raw distribution at their positions."""
        if top is None:
            return None
        emitted = self.verdict.tokens[i]
        lp = raw_logprobs(self.logits[self.rows[i].at : self.rows[i].at + len(emitted)])  # [n, vocab]
        chosen = lp.gather(-1, torch.tensor(emitted, device=lp.device)[:, None])[:, 0].tolist()
        best_v, best_i = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
        return [TokenLogprob(token, chosen[j], tuple(zip(best_i[j].tolist(), best_v[j].tolist(), strict=True)))
                for j, token in enumerate(emitted)]


class Verifier:
    """Runs the target's verify pass and the sampler for a planned step."""

    def __init__(self, runner: ModelRunner, vocab_size: int, eos_ids: set[int], device: torch.device) -> None:
        self.runner, self.vocab_size, self.eos_ids, self.device = runner, vocab_size, eos_ids, device

    def __call__(self, seqs: list[Sequence], plan: StepPlan, hold: frozenset[str], hidden: bool) -> Verified:
        """Verify the rows not in `hold` (`hidden`: return the target's features of the fed tokens)."""
        fed, active = [], []  # per row what it feeds; the rows verified
        for b, (seq, row) in enumerate(zip(seqs, plan.rows, strict=True)):
            chunk = seq.prefill[: row.chunk] if seq.request_id not in hold else []
            verify = row.verify and seq.request_id not in hold
            assert not verify or len(chunk) == seq.prompt_left, "a row verifies once its prompt is computed"
            fed.append([*chunk, seq.last_token, *row.drafts] if verify else chunk)
            active += [b] if verify else []
        prompt_tokens = sum(len(f) for b, f in enumerate(fed) if b not in active) + sum(
            plan.rows[b].chunk for b in active)
        scored = [plan.rows[b].k + 1 if b in active else 0 for b in range(len(fed))] if prompt_tokens else None
        out = self.runner.forward(fed, logits=bool(active), hidden=hidden, scored=scored)
        chunks = [Chunk(b, seqs[b], len(f), out.of_rows([b])[1]) for b, f in enumerate(fed) if f and b not in active]
        kept = [seqs[b] for b in active]
        rows = place([plan.rows[b] for b in active])
        if not active:  # every row fed a prompt chunk only: nothing to sample
            return Verified([], [], [], torch.zeros(0, self.vocab_size, device=self.device), None, [0],
                            Verdict([], []), out.computed, chunks, prompt_tokens)
        logits, features = out.of_rows(active)  # [positions, vocab], [fed positions, hidden]
        sampling = BatchSampling.from_params(
            [s.sampling for s in kept], self.device, generated=[len(s.output_ids) for s in kept],
            eos_ids=self.eos_ids, prompts=[s.request.prompt_token_ids for s in kept],
        )  # min_tokens and repetition_penalty need each row's history
        counts = self._token_counts(kept, rows) if sampling.any_penalty else None
        allowed = self._allowed(kept, rows)  # constrained rows' grammars
        at = sampling.at_positions([r.k + 1 for r in rows])
        greedy = list(sampling.greedy_rows)
        gens = [s.generator for s in kept]
        if all(greedy) and all(r.rule is Rule.COMPARE for r in rows):  # p one-hot: its tokens are all it reads
            best = greedy_tokens(logits[:, None], at, _one(counts), _one(allowed))[:, 0].tolist()
            verdict = rejection_sample(rows, None, gens, greedy, best=best)
        else:
            p = probabilities(logits[:, None], at, _one(counts), _one(allowed))[:, 0]  # [positions, vocab]
            verdict = rejection_sample(rows, p, gens, greedy)
        fed_at = list(itertools.accumulate((len(fed[b]) for b in active), initial=0))
        return Verified(active, kept, rows, logits, features, fed_at, verdict, out.computed, chunks, prompt_tokens)

    def _allowed(self, seqs: list[Sequence], rows: list[RowPlan]) -> torch.Tensor | None:
        """[positions, vocab] bool: what each constrained row's grammar allows at each of its verify positions
        (None when no row is constrained)."""
        if all(seq.grammar is None for seq in seqs):
            return None
        allowed = torch.ones(rows[-1].positions.stop, self.vocab_size, dtype=torch.bool)
        for seq, row in zip(seqs, rows, strict=True):
            if seq.grammar is not None:
                allowed[row.at : row.positions.stop] = seq.grammar.masks(row.drafts)
        return allowed.to(self.device)

    def _token_counts(self, seqs: list[Sequence], rows: list[RowPlan]) -> torch.Tensor:
        """[positions, vocab]: the tokens generated before each verify position (the row's drafts before it
        included)."""
        counts = torch.zeros(rows[-1].positions.stop, self.vocab_size, device=self.device)
        for seq, row in zip(seqs, rows, strict=True):
            end = row.positions.stop
            if seq.output_ids:
                counts[row.at : end] += torch.bincount(torch.tensor(seq.output_ids),
                                                       minlength=self.vocab_size).to(self.device)
            for j, token in enumerate(row.drafts):
                counts[row.at + j + 1 : end, token] += 1
        return counts


def _one(x: torch.Tensor | None) -> torch.Tensor | None:
    """[positions, ...] -> [positions, 1, ...]: each verify position a row of width 1 for `probabilities`."""
    return x[:, None] if x is not None else None
