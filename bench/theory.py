"""The speculative-decoding cost model the benchmark compares measurements against (docs/design.md).

With per-position acceptance probability a (i.i.d.), K draft tokens per step, and a draft costing c
target steps per token, one step emits (1 - a^(K+1)) / (1 - a) tokens on average and costs cK + 1
target steps (verifying K+1 positions is assumed to cost one step). Leviathan et al. 2023, eq. 1.
"""

from __future__ import annotations

import math

from server.speculation.acceptance import expected_tokens, speedup


def expected_tokens_per_step(a: float, k: int) -> float:
    """Mean tokens one verify pass emits: 1 + a + a^2 + ... + a^K = (1 - a^(K+1)) / (1 - a)."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"K must be >= 0, got {k}")
    return expected_tokens(1.0 if math.isclose(a, 1.0) else a, k)  # the policy's own formula


def theoretical_speedup(a: float, k: int, c: float) -> float:
    """Expected speedup over plain decoding: (1 - a^(K+1)) / ((1 - a)(cK + 1))."""
    if c < 0:
        raise ValueError(f"cost ratio must be >= 0, got {c}")
    expected_tokens_per_step(a, k)  # validates a and k
    return speedup(1.0 if math.isclose(a, 1.0) else a, k, c)


def mean_accepted_length(accepted_tokens: int, decode_steps: int) -> float:
    """Tokens emitted per verify pass: 1 + accepted / steps (docs/design.md); 0 with no steps."""
    return 1.0 + accepted_tokens / decode_steps if decode_steps else 0.0


def efficiency(measured_speedup: float | None, theoretical: float | None) -> float | None:
    """Measured / theoretical speedup; None when either is unknown."""
    if measured_speedup is None or not theoretical:
        return None
    return measured_speedup / theoretical


def attainable_speedup(mean_length: float, drafts_per_step: float, c: float, verify_ratio: float, k: int) -> float:
    """Speedup the *measured* tokens per step allow at the *measured* step costs, no overhead.

    A step emits `mean_length` tokens and costs `c * drafts_per_step` for drafting plus a verify
    pass over drafts_per_step + 1 tokens, which costs `verify_ratio` target steps at K + 1 tokens
    (interpolated linearly from 1 at one token). Measured / this = what the engine loses per step.
    """
    if k <= 0:
        return mean_length
    verify = 1.0 + (verify_ratio - 1.0) * min(drafts_per_step, k) / k
    return mean_length / (c * drafts_per_step + verify)


def mixed_speedup(passes: list[tuple[int, float, int, float]]) -> float:
    """Expected speedup of a mix of verify passes: Σ n·E(a, K) / Σ n·(cK + 1).

    `passes` holds (n, a, K, c) per proposer: n passes drafting K tokens each at per-token acceptance
    a and cost c per draft token; plain passes are (n, 0, 0, 0) (one token for one step). With one
    proposer this is `theoretical_speedup(a, K, c)`.
    """
    tokens = cost = 0.0
    for n, a, k, c in passes:
        if n < 0 or c < 0:
            raise ValueError(f"pass count and cost must be >= 0, got n={n}, c={c}")
        tokens += n * expected_tokens_per_step(a, k)
        cost += n * (c * k + 1)
    if cost <= 0:
        raise ValueError("no passes")
    return tokens / cost


def attainable_mixed_speedup(emitted: int, steps: int, drafts: list[tuple[int, float]], verify_ratio: float,
                             k: int) -> float:
    """`attainable_speedup` when several proposers drafted: `emitted` tokens over `steps` verify passes,
    `drafts` = (draft tokens, c) per proposer. Each pass costs one step plus its extra verify width
    ((verify_ratio - 1) / k per draft token, mean drafts per pass capped at k), and each draft token its
    proposer's c. With one proposer this equals `attainable_speedup`."""
    if steps <= 0:
        raise ValueError("no passes")
    total = sum(d for d, _ in drafts)
    per_pass = total / steps
    verify = 1.0 + ((verify_ratio - 1.0) * min(per_pass, k) / k if k > 0 else 0.0)
    drafting = sum(d * c for d, c in drafts) / steps
    return (emitted / steps) / (drafting + verify)
