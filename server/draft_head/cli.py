"""The `distill` subcommand's flags (kept free of torch imports so `--help` stays instant)."""

from __future__ import annotations

import argparse
from pathlib import Path

from server.draft_head.options import TrainOptions

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
TRAIN_PROMPTS = PROMPTS_DIR / "train.jsonl"
HELDOUT_PROMPTS = PROMPTS_DIR / "heldout.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `distill` subcommand's flags."""
    p.add_argument("--out", required=True, help="output directory (data cache, checkpoint, head/)")
    p.add_argument("--target", default=None, help="target model: directory, hub id or .gguf (default: SmolLM2)")
    p.add_argument("--config", default=None, help="YAML settings file (for cache_dir)")
    p.add_argument("--prompts", default=str(TRAIN_PROMPTS), help="training prompts, JSONL of {\"prompt\": ...}")
    p.add_argument("--heldout-prompts", default=str(HELDOUT_PROMPTS), help="held-out prompts (measured, never trained)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--traffic", default=None, help="directory of recorded traffic JSONL to train on as well")
    p.add_argument("--max-new-tokens", type=int, default=160, help="answer length cap for self-distillation")
    p.add_argument("--gen-batch-size", type=int, default=32, help="prompts answered per batch")
    p.add_argument("--gen-workers", type=int, default=1,
                   help="single-threaded processes answering prompts in parallel (fork; CPU)")
    p.add_argument("--gen-temperature", default="0",
                   help="answer temperature; 0 = greedy (default); a list such as 0,0.8 is taken in turn per batch")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="also answer N prompts the target writes itself from its chat template (Magpie)")
    p.add_argument("--self-prompt-tokens", type=int, default=64, help="length cap of a self-written prompt")
    p.add_argument("--data-time-limit", type=float, default=None,
                   help="stop answering training prompts after this many seconds and train on what is there")
    p.add_argument("--fr-vocab", type=int, default=8192, help="FR-Spec vocabulary size N (most frequent tokens)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1")
    p.add_argument("--target-dtype", default="auto",
                   help="the target's dtype while making data: auto = float32 on cpu, bfloat16 on cuda "
                        "(the server's defaults); match the dtype the head will be served with")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    p.add_argument("--epochs", type=float, default=TrainOptions.epochs)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--train-time-limit", type=float, default=None,
                   help="seconds of training: fewer steps (with their LR schedule) when the measured rate needs it")
    p.add_argument("--batch-size", type=int, default=TrainOptions.batch_size)
    p.add_argument("--lr", type=float, default=TrainOptions.lr)
    p.add_argument("--train-depth", type=int, default=TrainOptions.train_depth, help="draft depths trained (1..4)")
    p.add_argument("--feature-noise", type=float, default=TrainOptions.feature_noise,
                   help="std of Gaussian noise added to input features while training")
    p.add_argument("--init", choices=["random", "last-layer"], default=TrainOptions.init,
                   help="decoder layer start: random, or a copy of the target's last layer")
    p.add_argument("--eval-every", type=int, default=TrainOptions.eval_every)
    p.add_argument("--checkpoint-every", type=int, default=TrainOptions.checkpoint_every)
    p.add_argument("--data-only", action="store_true", help="make (or finish) the data cache, then stop")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
