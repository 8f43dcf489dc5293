"""`python -m server generate`: run one prompt through the engine, stream the text, print its stats."""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from server.config import Settings
from server.engine.engine import build_engine
from server.types import GenerationRequest, SamplingParams, SpeculationParams


def generate_cli(settings: Settings, args: argparse.Namespace) -> int:
    engine = build_engine(settings)
    tokenizer = engine.tokenizer
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    request = GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=tuple(prompt_ids),
        sampling=SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed),
        speculation=SpeculationParams.resolve(
            None, None, default_method=settings.speculation, num_speculative_tokens=settings.num_speculative_tokens,
            auto_max_speculative_tokens=settings.auto_max_speculative_tokens,
        ),
    )
    try:
        engine.limits.check(request)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    started = time.perf_counter()  # the prompt's prefill counts, as it does for a server's request
    engine.add_requests([request])
    final = None
    while engine.has_unfinished():
        for out in engine.step().outputs:
            print(out.text, end="", flush=True)
            if out.finished:
                final = out
    elapsed = time.perf_counter() - started
    assert final is not None
    st = final.stats
    k = 0 if st.method == "none" else request.speculation.num_tokens
    print(
        f"\n\n[{st.method} K={k}] {st.completion_tokens} tokens in {elapsed:.2f} s "
        f"({st.completion_tokens / elapsed:.1f} tok/s), finish_reason={final.finish_reason}\n"
        f"draft_tokens={st.draft_tokens} accepted_tokens={st.accepted_tokens} "
        f"acceptance_rate={st.acceptance_rate:.3f} mean_accepted_length={st.mean_accepted_length:.2f} "
        f"decode_steps={st.decode_steps} accepted_per_position={st.accepted_per_position}",
        file=sys.stderr,
    )
    return 0
