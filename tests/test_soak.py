"""A short soak (`bench/soak.py`) against a real `serve` process on the tiny model that copies itself: its first
requests, then mixed traffic with aborts, oversized inputs, bad fields and copy chats asking for every method it
lists (a bf16 self-draft included); no 5xx, no lost request, the server drains and stays healthy, its peak RSS
stays within its memory plan, and every method drafts, has drafts accepted and keeps `none`'s greedy text. The
CPU hogs (`--hogs`) run for the soak only: gone when it ends, whatever ends it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.soak import (
    FRESH_CHATS,
    FRESH_CLIENTS,
    MAX_RSS_RATIO,
    MIX,
    Copied,
    Outcome,
    check_methods,
    cpu_hogs,
    format_report,
    memory_parts,
    soak,
)
from server.model.runner import ModelRunner


@pytest.mark.slow
def test_short_soak_serves_everything_and_refuses_only_with_4xx(cycling_target, tmp_path: Path, monkeypatch):
    # A KV budget of 1500 tokens: two long prompts (300-512 words) fill it, so admission waits at times.
    per_token = ModelRunner.kv_shape(cycling_target.model).bytes_per_token
    monkeypatch.setenv("SPECULA_KV_CACHE_MEMORY", str(1500 * per_token))  # the server process reads it
    model_dir = tmp_path / "tiny"
    cycling_target.model.save_pretrained(model_dir)
    cycling_target.tokenizer.save_pretrained(model_dir)
    args = ["--target", str(model_dir), "--served-model-name", "tiny", "--draft", "target", "--draft-dtype",
            "bfloat16"]
    report = soak(args, seconds=30, clients=3, idle_s=2, warmup_s=3, seed=1, log_path=tmp_path / "server.log",
                  context=cycling_target.max_context, body_mb=1.0, progress=lambda _: None)
    text = format_report(report)
    assert not report.problems, text
    assert report.drained, text
    assert report.statuses["first_request"] == {"200": 1}, text
    assert report.statuses["fresh_burst"] == {"200": FRESH_CLIENTS * FRESH_CHATS}, text
    assert set(report.statuses) == set(MIX) | {"first_request", "fresh_burst", "method_check"}, text  # every kind
    # every method the server lists was asked for, drafted, had drafts accepted, and kept none's greedy text
    assert set(report.methods) == {"none", "ngram", "suffix", "draft", "auto"}, text
    for method, tally in report.methods.items():
        assert tally["fallbacks"] == tally["unlike_none"] == 0, text
        assert method == "none" or tally["accepted_tokens"] > 0, text
    # the memory plan: every part exported, and the peak RSS within it
    assert set(report.memory_parts_mb) == {"weights", "kv_cache", "prefix_cache", "proposers", "activations",
                                           "runtime"}, text
    assert report.rss_ratio is not None and report.rss_ratio <= MAX_RSS_RATIO, text
    for kind in ("oversized_prompt", "oversized_body"):
        assert set(report.statuses[kind]) <= {"400", "413"}, text
    assert all(s in ("200", "400", "404", "413", "422") for s in report.statuses["bad_field"]), text
    assert set(report.statuses["stream_abort"]) == {"aborted"}, text
    for kind in ("chat", "long_prompt", "completion", "stream", "n2_seeded", "copy", "method_check"):
        assert set(report.statuses[kind]) == {"200"}, text
    assert report.served > 0 and report.rss_peak_mb > 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.slow
def test_hogs_keep_a_core_busy_and_stop_with_the_soak():
    with pytest.raises(KeyboardInterrupt), cpu_hogs(2) as procs:  # Ctrl-C in the middle of a soak
        pids = [p.pid for p in procs]
        time.sleep(0.5)
        assert all(p.poll() is None for p in procs)
        ticks = [int(open(f"/proc/{pid}/stat").read().split(")")[-1].split()[11]) for pid in pids]  # utime
        assert all(t > 0 for t in ticks)
        raise KeyboardInterrupt
    assert not any(alive(pid) for pid in pids)


def test_hogs_stop_by_themselves_when_the_soak_is_killed(tmp_path):
    """A soak killed outright (SIGKILL: no cleanup runs) leaves no hog spinning."""
    script = "import sys, os, time\nfrom bench.soak import cpu_hogs\nwith cpu_hogs(1) as p:\n" \
             "    print(p[0].pid, flush=True)\n    time.sleep(60)\n"
    soak_proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                 cwd=Path(__file__).resolve().parent.parent)
    hog = int(soak_proc.stdout.readline())
    assert alive(hog)
    soak_proc.kill()
    soak_proc.wait()
    deadline = time.monotonic() + 10
    while alive(hog) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(hog)


def test_memory_parts_are_read_from_the_metrics_text():
    text = ('# HELP specula_memory_bytes x\n'
            'specula_memory_bytes{model="m",part="weights"} 1048576.0\n'
            'specula_memory_bytes{model="m",part="kv_cache"} 2.097152e+06\n'
            'specula_requests_running{model="m"} 0.0\n')
    assert memory_parts(text) == {"weights": 1.0, "kv_cache": 2.0}
    assert memory_parts(text, peak=True) == {}
    text += 'specula_memory_peak_bytes{model="m",part="kv_cache"} 4194304.0\n'
    assert memory_parts(text) == {"weights": 1.0, "kv_cache": 2.0}
    assert memory_parts(text, peak=True) == {"kv_cache": 4.0}


def copy_chat(method: str, prompt: int, text: str, drafted: int, accepted: int, fallbacks=(), kind="copy"):
    return Outcome(kind, 200, 0.1, Copied(method, prompt, text, drafted, accepted, tuple(fallbacks)))


def test_the_soak_fails_a_method_that_did_not_run():
    """`check_methods`: a method that never drafted, one whose drafts were never accepted, one the fail-safe turned
    off, and a greedy text unlike `none`'s are each a problem; methods that ran are not."""
    plain = [copy_chat("none", i, f"text {i}", 0, 0, kind="method_check") for i in range(2)]
    ran = [copy_chat("ngram", 0, "text 0", 9, 5), copy_chat("ngram", 1, "text 1", 0, 0, kind="method_check")]
    tally, problems = check_methods(plain + ran)
    assert problems == [] and tally["ngram"] == {"requests": 2, "draft_tokens": 9, "accepted_tokens": 5,
                                                 "fallbacks": 0, "unlike_none": 0}
    dead = [copy_chat("draft", 0, "text 0", 0, 0, ["draft:error"]), copy_chat("draft", 1, "text 1", 0, 0)]
    rejected = [copy_chat("eagle", 0, "text 0", 12, 0)]
    differs = [copy_chat("suffix", 1, "other text", 4, 2)]
    _, problems = check_methods(plain + ran + dead + rejected + differs)
    assert problems == [
        "method draft never drafted in 2 copy chats",
        "method draft fell back 1 times (usage.speculation.fallbacks: draft:error)",
        "method eagle drafted 12 tokens in 1 copy chats and none was accepted",
        "method suffix: 1 of 1 greedy copy chats differ from none's text for the same prompt",
    ]
