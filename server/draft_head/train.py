"""Training a draft head: the EAGLE loss, held-out acceptance, checkpoints that resume.

Loss per draft depth k (k = 1 is EAGLE-1's loss; deeper ones train drafting from the head's own
features, EAGLE-3's "training-time test", see `unroll.py`), averaged over answer positions:

    smooth_l1(f̂, f)  +  w_cls · CE(p_fr, q)

where f is the target's next feature, q = softmax(head logits over the FR vocabulary) and p_fr the
target's distribution restricted to the FR vocabulary and renormalised (the mass outside it, a few
percent, is not trained: the head can never draft those tokens anyway). Depth k is weighted
`depth_decay ** (k-1)`.

Held-out acceptance is greedy and per draft position k = 1..4: the fraction of start positions in
held-out answers where draft k equals the target's argmax given that drafts 1..k-1 did (so position 1
is the first-draft acceptance, and the product of the first k is the chance a K = k chain gets past
k). `tokens_per_pass` = 1 + sum over k of that product: the expected tokens per verify pass at K = 4.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from server.draft_head.data import Sample
from server.draft_head.model import EagleHead
from server.draft_head.options import TrainOptions
from server.draft_head.unroll import target_index, unrolled_features

log = logging.getLogger(__name__)

EVAL_DEPTH = 4


@dataclass
class Acceptance:
    """Greedy held-out acceptance per draft position (conditional on the earlier drafts being right)."""

    per_position: list[float]
    positions: int  # start positions measured
    tokens_per_pass: float  # expected tokens per verify pass at K = len(per_position)
    extra: dict[str, float] = field(default_factory=dict)

    def short(self) -> str:
        return "acc " + "/".join(f"{a:.2f}" for a in self.per_position) + f" tpp {self.tokens_per_pass:.2f}"


def collate(samples: list[Sample], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-pad a batch: hidden [B, T, H] fp32, ids [B, T], lengths [B], prompt_lens [B]."""
    total = max(len(s.ids) for s in samples)
    where = samples[0].hidden.device  # samples may already live on the training device
    hidden = torch.zeros(len(samples), total, samples[0].hidden.shape[-1], device=where)
    ids = torch.zeros(len(samples), total, dtype=torch.long, device=where)
    for b, s in enumerate(samples):
        hidden[b, : len(s.ids)] = s.hidden.float()
        ids[b, : len(s.ids)] = s.ids.long()
    lengths = torch.tensor([len(s.ids) for s in samples], device=where)
    prompt_lens = torch.tensor([s.prompt_len for s in samples], device=where)
    return hidden.to(device), ids.to(device), lengths.to(device), prompt_lens.to(device)


def head_loss(head: EagleHead, samples: list[Sample], opts: TrainOptions) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss of one batch and its parts (per-depth feature and classification losses)."""
    device = head.fc.weight.device
    hidden, ids, lengths, prompt_lens = collate(samples, device)
    hidden = hidden.to(head.fc.weight.dtype)
    rows = hidden.shape[1] - 1
    outputs = unrolled_features(head, hidden, ids, lengths, opts.train_depth, opts.feature_noise)
    total = hidden.new_zeros(())
    parts: dict[str, float] = {}
    for k, pred in enumerate(outputs, 1):
        mask = target_index(lengths, prompt_lens, rows, k)  # [B, rows]
        if not mask.any():
            continue
        target = torch.zeros_like(pred)
        target[:, : hidden.shape[1] - k] = hidden[:, k:]  # f_{j+k}
        pred_m, target_m = pred[mask], target[mask]  # [n, H]
        reg = F.smooth_l1_loss(pred_m, target_m)
        with torch.no_grad():
            p = torch.softmax(head.fr_logits(target_m).float(), dim=-1)  # [n, N]
        logq = torch.log_softmax(head.fr_logits(pred_m).float(), dim=-1)
        cls = -(p * logq).sum(-1).mean()
        total = total + opts.depth_decay ** (k - 1) * (reg + opts.cls_weight * cls)
        parts[f"reg{k}"] = float(reg.detach())
        parts[f"cls{k}"] = float(cls.detach())
    return total, parts


@torch.no_grad()
def held_out_acceptance(head: EagleHead, samples: list[Sample], lm_head: torch.Tensor | None = None,
                        batch_size: int = 8, depth: int = EVAL_DEPTH) -> Acceptance:
    """Greedy acceptance per draft position on `samples` (see the module docstring).

    The target's greedy token after feature f_t is argmax(lm_head · f_t) when `lm_head` (the target's
    full LM head weight [V, H]) is given; without it, it is the next token of the sample itself, which
    is exact for greedy answers (how held-out data is made) and saves a full-vocabulary product.
    """
    was_training = head.training
    head.eval()
    device = head.fc.weight.device
    hits = torch.zeros(depth)
    tries = torch.zeros(depth)
    covered = 0.0
    for start in range(0, len(samples), batch_size):
        batch = samples[start: start + batch_size]
        hidden, ids, lengths, prompt_lens = collate(batch, device)
        hidden = hidden.to(head.fc.weight.dtype)
        total = hidden.shape[1]
        rows = total - 1
        outputs = unrolled_features(head, hidden, ids, lengths, depth)
        chain = torch.ones(len(batch), rows, dtype=torch.bool, device=device)  # drafts 1..k-1 all right
        for k, pred in enumerate(outputs, 1):
            valid = target_index(lengths, prompt_lens, rows, k) & target_index(lengths, prompt_lens, rows, 1)
            want = torch.zeros(len(batch), rows, dtype=torch.long, device=device)  # the target's greedy token
            if lm_head is not None:
                want[:, : total - k] = (hidden[:, k:] @ lm_head.T).argmax(-1)  # after f_{j+k}
            else:
                want[:, : total - k - 1] = ids[:, k + 1:]  # x_{j+k+1}, the token the target emitted
                valid &= torch.arange(rows, device=device)[None, :] + k + 1 < lengths[:, None]
            got = head.vocab_ids[head.fr_logits(pred).argmax(-1)]  # [B, rows] the draft
            tries[k - 1] += float((valid & chain).sum())
            chain = chain & (got == want)
            hits[k - 1] += float((valid & chain).sum())
            if k == 1:
                covered += float((valid & torch.isin(want, head.vocab_ids)).sum())
    head.train(was_training)
    per_position = [(hits[k] / tries[k]).item() if tries[k] else 0.0 for k in range(depth)]
    reach = [math.prod(per_position[: k + 1]) for k in range(depth)]
    coverage = covered / float(tries[0]) if tries[0] else 0.0
    return Acceptance(per_position=per_position, positions=int(tries[0]), tokens_per_pass=1 + sum(reach),
                      extra={"fr_coverage": coverage})


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: shuffled with (seed, epoch), then grouped by length within windows of
    16 batches so padding stays small; the same arguments always give the same batches (resume)."""
    order = list(range(len(lengths)))
    rng = random.Random(seed * 100_003 + epoch)
    rng.shuffle(order)
    window = 16 * batch_size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start: start + window], key=lambda i: lengths[i])
        batches.extend(chunk[i: i + batch_size] for i in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


def lr_at(step: int, total: int, opts: TrainOptions) -> float:
    """Linear warm-up, then cosine decay to a tenth of `lr`."""
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    progress = (step - opts.warmup_steps) / max(1, total - opts.warmup_steps)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class TrainState:
    """What a checkpoint restores besides weights and optimiser."""

    step: int = 0
    tokens_seen: int = 0  # answer positions trained on (depth 1), summed over steps
    train_seconds: float = 0.0
    history: list[dict] = field(default_factory=list)


def train_head(
    head: EagleHead,
    train: list[Sample],
    heldout: list[Sample],
    lm_head: torch.Tensor | None,
    opts: TrainOptions,
    checkpoint: Path,
    export: callable,
    resume: bool = False,
    progress: bool = True,
) -> TrainState:
    """Train `head` in place; every `checkpoint_every` steps save `checkpoint` and call `export(head, state)`.

    Held-out acceptance is `held_out_acceptance(head, heldout, lm_head)`, every `eval_every` steps.

    `export` writes the shipped files (the caller knows the metadata). With `resume`, an existing
    checkpoint restores weights, optimiser, step and history, and training continues with the very
    batches it would have seen.
    """
    from tqdm import tqdm

    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay, betas=(0.9, 0.95))
    state = TrainState()
    if resume and checkpoint.exists():
        saved = torch.load(checkpoint, map_location=head.fc.weight.device, weights_only=False)
        head.load_state_dict(saved["head"], strict=False)
        optim.load_state_dict(saved["optim"])
        state = TrainState(**saved["state"])
        log.info("resumed from %s at step %d", checkpoint, state.step)
    lengths = [len(s.ids) for s in train]
    per_epoch = math.ceil(len(train) / opts.batch_size)
    total = opts.steps if opts.steps is not None else math.ceil(opts.epochs * per_epoch)
    torch.manual_seed(opts.seed + state.step)
    head.train()
    bar = tqdm(total=total, initial=state.step, desc="distill", disable=not progress, dynamic_ncols=True)
    epoch_cache: tuple[int, list[list[int]]] = (-1, [])
    loss_ema = None
    acc_text = ""
    started = time.monotonic() - state.train_seconds
    run_start, run_first_step = time.monotonic(), state.step
    while state.step < total:
        done = state.step - run_first_step
        if opts.time_limit is not None and (done == 25 or (done and done % opts.eval_every == 0)):
            total = _steps_within(opts.time_limit, total, state.step, time.monotonic() - run_start, done)
            bar.total = total
        epoch, index = divmod(state.step, per_epoch)
        if epoch_cache[0] != epoch:
            epoch_cache = (epoch, epoch_batches(lengths, opts.batch_size, opts.seed, epoch))
        batch = [train[i] for i in epoch_cache[1][index]]
        for group in optim.param_groups:
            group["lr"] = lr_at(state.step, total, opts)
        loss, parts = head_loss(head, batch, opts)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
        optim.step()
        state.step += 1
        state.tokens_seen += sum(len(s.ids) - s.prompt_len + 1 for s in batch)
        value = float(loss.detach())
        loss_ema = value if loss_ema is None else 0.95 * loss_ema + 0.05 * value
        if state.step % opts.eval_every == 0 or state.step == total:
            acc = held_out_acceptance(head, heldout, lm_head)
            acc_text = acc.short()
            state.history.append({"step": state.step, "loss": loss_ema, **parts, "acceptance": acc.per_position,
                                  "tokens_per_pass": acc.tokens_per_pass, "tokens_seen": state.tokens_seen,
                                  "seconds": round(time.monotonic() - started, 1)})
        bar.set_postfix_str(f"loss {loss_ema:.3f} {acc_text}")
        bar.update(1)
        if state.step % opts.checkpoint_every == 0 or state.step == total:
            state.train_seconds = time.monotonic() - started
            _save_checkpoint(checkpoint, head, optim, state)
            export(head, state)
    bar.close()
    state.train_seconds = time.monotonic() - started
    return state


def _steps_within(limit: float, total: int, step: int, elapsed: float, done: int) -> int:
    """The step count that ends training within `limit` seconds of this run, at the rate measured so
    far (evaluations included); never more than `total`, never fewer than `step` + 1."""
    rate = elapsed / max(1, done)
    return max(step + 1, min(total, step + int((limit - elapsed) / rate)))


def _save_checkpoint(path: Path, head: EagleHead, optim: torch.optim.Optimizer, state: TrainState) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.trainable_state(), "optim": optim.state_dict(), "state": asdict(state)}, tmp)
    tmp.rename(path)  # atomic: an interrupted save never replaces a good checkpoint


def history_json(state: TrainState) -> str:
    return json.dumps(state.history, indent=1)
