"""Training options of a draft head (no torch import: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainOptions:
    """Optimisation settings (all recorded in the shipped config's `training` block)."""

    epochs: float = 4.0
    steps: int | None = None  # overrides epochs when set
    batch_size: int = 8  # sequences per step
    lr: float = 5e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    train_depth: int = 2  # draft depths trained per step (1 = EAGLE-1)
    depth_decay: float = 0.7
    cls_weight: float = 0.1
    eval_every: int = 200
    checkpoint_every: int = 200
    seed: int = 0
    feature_noise: float = 0.0  # std of Gaussian noise on the input features (EAGLE-1 trains with noise)
    time_limit: float | None = None  # seconds of training in this run: fewer steps (and their LR schedule) if needed
    init: str = "random"  # "random", or "last-layer": the decoder layer starts as a copy of the target's last
