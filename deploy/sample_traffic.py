"""Send a short run of real prompts with each speculation method, to watch the dashboard fill.

    python deploy/sample_traffic.py --url http://localhost:8000 [--methods ngram draft none] [--rounds 1]

Standard library only. Prints each request's `usage.speculation` and a per-method summary
(acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / steps).
"""

from __future__ import annotations

import argparse
import json
import urllib.request

PROMPTS = [
    # Copy-heavy: the answer repeats the prompt (n-gram lookup shines).
    "Fix the typos and return the corrected sentence only: 'Teh quick brown fox jumpd over teh lazy dog "
    "while teh farmer wacthed from teh porch.'",
    "Add a docstring to this function and return the whole function:\n\ndef area(width, height):\n"
    "    return width * height\n",
    # Open-ended.
    "Write a short poem about the sea.",
    "Explain in three sentences why the sky is blue.",
]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft", "none"])
    parser.add_argument("--num-tokens", type=int, default=4, help="K draft tokens per step")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    with urllib.request.urlopen(f"{args.url}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    totals: dict[str, list[int]] = {m: [0, 0, 0] for m in args.methods}  # draft, accepted, steps
    for _ in range(args.rounds):
        for method in args.methods:
            for prompt in PROMPTS:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "speculation": {"method": method, "num_tokens": args.num_tokens},
                }
                spec = post(f"{args.url}/v1/chat/completions", body)["usage"]["speculation"]
                print(json.dumps(spec))
                t = totals[method]
                t[0] += spec["draft_tokens"]
                t[1] += spec["accepted_tokens"]
                t[2] += spec["decode_steps"]
    for method, (draft, accepted, steps) in totals.items():
        rate = accepted / draft if draft else float("nan")
        length = 1 + accepted / steps if steps else float("nan")
        print(f"{method:>6}: acceptance rate {rate:.3f}, mean accepted length {length:.2f} ({steps} steps)")


if __name__ == "__main__":
    main()
