"""`python -m server distill`: make data, pick the FR vocabulary, train a head, export it.

Output directory layout:
    DIR/data/train/ shard-*.safetensors (+ .jsonl texts)   self-distilled training samples
    DIR/data/heldout/ ...                                   held-out prompts' samples (never trained on)
    DIR/data/traffic/ traffic.safetensors                   recorded traffic, when --traffic is given
    DIR/checkpoint.pt                                       weights + optimiser + step (for --resume)
    DIR/head/ model.safetensors + config.json               the head, rewritten at every checkpoint
    DIR/history.json                                        loss and held-out acceptance over training
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from server.draft_head.data import (
    Sample,
    _stop_ids,
    build_from_traffic,
    build_self_distilled,
    read_prompts,
    token_counts,
)
from server.draft_head.model import EagleHead, vocab_rows
from server.draft_head.options import TrainOptions
from server.draft_head.train import TrainState, held_out_acceptance, history_json, train_head

log = logging.getLogger(__name__)


def distill_cli(args: argparse.Namespace) -> int:
    """Run the whole pipeline from parsed `distill` arguments; prints the final held-out acceptance."""
    from server.config import Settings
    from server.model.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if not 1 <= args.train_depth <= 4:
        raise SystemExit("--train-depth must be 1..4")
    if args.gen_workers > 1 and args.device != "cpu":
        raise SystemExit("--gen-workers > 1 forks processes, which CUDA does not survive: use it on cpu only")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings.load(args.config)
    target = load_model(args.target, dtype=args.target_dtype, device=args.device, cache_dir=settings.cache_dir,
                        modules="transformers")  # its forwards are called (data.py, train.py)
    opts = TrainOptions(
        epochs=args.epochs, steps=args.steps, batch_size=args.batch_size, lr=args.lr, train_depth=args.train_depth,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, seed=args.seed,
        feature_noise=args.feature_noise, init=args.init, time_limit=args.train_time_limit,
    )
    if target.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 weights, tensor-core products
    command = "python -m server " + shlex.join(sys.argv[1:]) if sys.argv[0].endswith("__main__.py") else ""
    head, state, meta = distill(
        target.model, target.tokenizer, target.name, out, opts,
        prompts=read_prompts(args.prompts)[: args.num_prompts],
        heldout_prompts=read_prompts(args.heldout_prompts),
        traffic=args.traffic, max_new_tokens=args.max_new_tokens, gen_batch_size=args.gen_batch_size,
        gen_temperature=parse_temperatures(args.gen_temperature), gen_workers=args.gen_workers,
        self_prompts=args.self_prompts, self_prompt_tokens=args.self_prompt_tokens,
        data_time_limit=args.data_time_limit, fr_vocab=args.fr_vocab, resume=args.resume,
        progress=not args.quiet, command=command, data_only=args.data_only,
    )
    print(json.dumps(meta, indent=1))
    return 0


def distill(
    target: torch.nn.Module,
    tokenizer,
    target_name: str,
    out: Path,
    opts: TrainOptions,
    *,
    prompts: list[str],
    heldout_prompts: list[str],
    traffic: str | None = None,
    max_new_tokens: int = 160,
    gen_batch_size: int = 32,
    gen_temperature: float | list[float] = 0.0,
    gen_workers: int = 1,
    self_prompts: int = 0,
    self_prompt_tokens: int = 64,
    data_time_limit: float | None = None,
    fr_vocab: int = 8192,
    resume: bool = False,
    progress: bool = True,
    command: str = "",
    data_only: bool = False,
) -> tuple[EagleHead | None, TrainState | None, dict]:
    """Data -> FR vocabulary -> training -> `out/head/`. Returns the head, its state and the metadata
    written into the head's config (`training` block).

    `self_prompts` > 0 adds that many prompts the target writes itself (`self_prompts.py`), kept in
    `out/data/self_prompts.jsonl` so a resumed run answers the same ones. `data_time_limit` stops
    answering training prompts after that many seconds (the held-out set is answered first, whole;
    writing prompts stops at a quarter of it)."""
    started = time.monotonic()
    previous = target.config._attn_implementation
    if target.device.type == "cpu":
        # Left-padded batched decoding: eager attention was steadier than sdpa on CPU (measured).
        target.set_attn_implementation("eager")
    gen = {"batch_size": gen_batch_size, "max_new_tokens": max_new_tokens, "temperature": gen_temperature,
           "seed": opts.seed, "workers": gen_workers, "progress": progress}
    try:
        heldout = build_self_distilled(out / "data" / "heldout", target, tokenizer, heldout_prompts,
                                       **{**gen, "temperature": 0.0})
        if self_prompts:
            prompts = prompts + _self_prompts(out / "data" / "self_prompts.jsonl", target, tokenizer, self_prompts,
                                              batch_size=gen_batch_size, max_tokens=self_prompt_tokens,
                                              seed=opts.seed, exclude=prompts + heldout_prompts,
                                              time_limit=None if data_time_limit is None else data_time_limit / 4)
        train = build_self_distilled(out / "data" / "train", target, tokenizer, prompts, **gen,
                                     time_limit=data_time_limit)
        if traffic:
            train += build_from_traffic(out / "data" / "traffic", target, tokenizer, traffic, progress)
    finally:
        target.set_attn_implementation(previous)
    data_seconds = time.monotonic() - started
    if not train:
        raise ValueError("no training samples: nothing was answered (raise --data-time-limit) and no --traffic")
    if data_only:
        answers = sum(len(s.ids) - s.prompt_len for s in train)
        return None, None, {"train_samples": len(train), "train_answer_tokens": answers,
                            "heldout_samples": len(heldout), "data_seconds_this_run": round(data_seconds, 1)}
    vocab_size = vocab_rows(target.get_output_embeddings())
    vocab_ids = choose_vocab(train, vocab_size, fr_vocab, _stop_ids(target, tokenizer))
    if target.device.type != "cpu":  # the whole data set fits on an accelerator: batches are made there
        train, heldout = _to_device(train, target.device), _to_device(heldout, target.device)
    head = EagleHead.create(target, vocab_ids, target_name, seed=opts.seed, init=opts.init)
    head.requires_grad_(True)
    lm_head = None  # held-out answers are greedy: their next tokens are the target's argmax
    untrained = held_out_acceptance(head, heldout, lm_head)
    answer_tokens = sum(len(s.ids) - s.prompt_len for s in train)
    base_meta = {
        "command": command,
        "target": target_name,
        "prompts": len(prompts),
        "self_prompts": self_prompts,
        "train_samples": len(train),
        "train_answer_tokens": answer_tokens,
        "heldout_samples": len(heldout),
        "data_seconds_this_run": round(data_seconds, 1),
        "fr_vocab": len(vocab_ids),
        "trainable_parameters": sum(p.numel() for p in head.parameters() if p.requires_grad),
        "untrained_acceptance": untrained.per_position,
        "options": asdict(opts),
    }

    def export(h: EagleHead, state: TrainState) -> None:
        last = state.history[-1] if state.history else {}
        h.config.training = {
            **base_meta, "steps": state.step, "tokens_seen": state.tokens_seen,
            "train_seconds": round(state.train_seconds, 1), "heldout_acceptance": last.get("acceptance"),
            "heldout_tokens_per_pass": last.get("tokens_per_pass"),
        }
        h.save_pretrained(out / "head")
        (out / "history.json").write_text(history_json(state) + "\n")

    state = train_head(head, train, heldout, lm_head, opts, out / "checkpoint.pt", export, resume=resume,
                       progress=progress)
    final = held_out_acceptance(head, heldout, lm_head)
    state.history.append({"step": state.step, "final": True, "acceptance": final.per_position,
                          "tokens_per_pass": final.tokens_per_pass, "fr_coverage": final.extra["fr_coverage"],
                          "tokens_seen": state.tokens_seen})
    export(head, state)
    return head, state, head.config.training


def _to_device(samples: list[Sample], device: torch.device) -> list[Sample]:
    return [Sample(ids=s.ids.to(device), hidden=s.hidden.to(device), prompt_len=s.prompt_len) for s in samples]


def parse_temperatures(text: str | float) -> float | list[float]:
    """`--gen-temperature`: one temperature, or a comma-separated list taken in turn batch by batch."""
    values = [float(v) for v in str(text).split(",") if v.strip()]
    if not values or any(v < 0 for v in values):
        raise SystemExit(f"--gen-temperature: expected temperatures >= 0 (e.g. 0 or 0,0.8), got {text!r}")
    return values[0] if len(values) == 1 else values


def _self_prompts(path: Path, target, tokenizer, count: int, **kwargs) -> list[str]:
    """The prompts the target wrote for this run (made once, then read back on resume)."""
    from server.draft_head.self_prompts import generate_prompts

    if path.exists():
        return read_prompts(path)
    prompts = generate_prompts(target, tokenizer, count, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    tmp.rename(path)
    return prompts


def choose_vocab(samples: list[Sample], vocab_size: int, size: int, must: set[int]) -> list[int]:
    """FR-Spec: the `size` token ids the target emits most often in `samples` (never a token it did not
    emit), stop tokens always included; most frequent first, ties by id."""
    counts = token_counts(samples, vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    chosen = [i for i in order[:size] if counts[i] > 0]
    for stop in sorted(must):
        if stop not in chosen:
            chosen = chosen[: size - 1] + [stop] if len(chosen) >= size else chosen + [stop]
    return chosen
