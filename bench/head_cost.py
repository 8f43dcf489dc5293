"""Cost of one draft-head forward against one target decode step (1 token, batch 1, with a KV cache).

    .venv/bin/python -m bench.head_cost [--head DIR] [--context 256] [--iters 200] [--threads 2]

Both run with a cache holding `context` earlier positions, as in decoding; the target step includes its
full LM head (what the engine runs per verify of one token), the head step its FR-vocabulary logits.
The two are timed interleaved, so load from other processes hits both alike; medians are reported.
Without `--head` the shipped head for the built-in target is used (an untrained head costs the same).
The run goes to the ledger (bench/ledger.py) as suite `head_cost` (its ratio: head step / target step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from bench import ledger


def _trim(cache: DynamicCache, length: int) -> None:
    """Drop what the last timed step appended, back to `length` positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default=None, help="draft head directory (default: the shipped one)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from server.config import Settings
    from server.draft_head import BUILTIN_HEAD
    from server.draft_head.model import EagleHead
    from server.model.loading import load_model

    target = load_model(None, device="cpu", cache_dir=Settings.load().cache_dir, modules="transformers").model
    head = EagleHead.from_pretrained(args.head or BUILTIN_HEAD, target)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, args.context + 1), generator=gen)
    with torch.inference_mode():
        t_cache = DynamicCache()
        out = target.model(input_ids=ids[:, :-1], cache=t_cache, use_cache=True)
        feats = out.last_hidden_state  # [1, context, H]
        h_cache = DynamicCache()
        head(feats[:, :-1], ids[:, 1:-1], position_ids=torch.arange(1, args.context)[None], cache=h_cache,
             use_cache=True)
        t_len, h_len = t_cache.get_seq_length(), h_cache.get_seq_length()

        def target_step() -> None:
            _trim(t_cache, t_len)  # keep the context fixed across iterations
            h = target.model(input_ids=ids[:, -1:], position_ids=torch.tensor([[args.context]]), cache=t_cache,
                             use_cache=True).last_hidden_state
            target.lm_head(h)

        def head_step() -> None:
            _trim(h_cache, h_len)
            f, _ = head(feats[:, -1:], ids[:, -1:], position_ids=torch.tensor([[args.context]]), cache=h_cache,
                        use_cache=True)
            head.fr_logits(f)

        times: dict[str, list[float]] = {"target": [], "head": []}
        for i in range(args.iters + 10):
            for name, fn in (("target", target_step), ("head", head_step)):
                start = time.perf_counter()
                fn()
                if i >= 10:  # warm-up
                    times[name].append(time.perf_counter() - start)
    target_ms = statistics.median(times["target"]) * 1e3
    head_ms = statistics.median(times["head"]) * 1e3
    params = sum(p.numel() for n, p in head.named_parameters() if not n.startswith("decoder.embed_tokens"))
    figures = {
        "threads": args.threads, "context": args.context, "target_step_ms": round(target_ms, 2),
        "head_step_ms": round(head_ms, 2), "ratio": round(head_ms / target_ms, 3),
        "head_trainable_parameters": params, "fr_vocab": head.num_vocab,
    }
    print(json.dumps(figures))
    if not args.no_record:
        ledger.record("head_cost", [ledger.Cell("one token", "head step", head_ms / target_ms,
                                                baseline="target step")], figures=figures)


if __name__ == "__main__":
    main()
