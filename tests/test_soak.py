"""A short soak (`bench/soak.py`) against a real `serve` process on the tiny model: mixed traffic with
aborts, oversized inputs and bad fields; no 5xx, no lost request, the server drains and stays healthy."""

from __future__ import annotations

from pathlib import Path

from bench.soak import MIX, format_report, soak
from server.model.runner import ModelRunner


def test_short_soak_serves_everything_and_refuses_only_with_4xx(tiny_target, tmp_path: Path, monkeypatch):
    # A KV budget of 1500 tokens: two long prompts (300-512 words) fill it, so admission waits at times.
    per_token = ModelRunner.kv_shape(tiny_target.model).bytes_per_token
    monkeypatch.setenv("SPECULA_KV_CACHE_MEMORY", str(1500 * per_token))  # the server process reads it
    model_dir = tmp_path / "tiny"
    tiny_target.model.save_pretrained(model_dir)
    tiny_target.tokenizer.save_pretrained(model_dir)
    args = ["--target", str(model_dir), "--served-model-name", "tiny"]
    report = soak(args, seconds=30, clients=3, idle_s=2, warmup_s=3, seed=1, log_path=tmp_path / "server.log",
                  context=tiny_target.max_context, body_mb=1.0, progress=lambda _: None)
    text = format_report(report)
    assert not report.problems, text
    assert report.drained, text
    assert set(report.statuses) == set(MIX), text  # every kind of traffic was sent
    for kind in ("oversized_prompt", "oversized_body"):
        assert set(report.statuses[kind]) <= {"400", "413"}, text
    assert all(s in ("200", "400", "404", "413", "422") for s in report.statuses["bad_field"]), text
    assert set(report.statuses["stream_abort"]) == {"aborted"}, text
    for kind in ("chat", "long_prompt", "completion", "stream", "n2_seeded"):
        assert set(report.statuses[kind]) == {"200"}, text
    assert report.served > 0 and report.rss_peak_mb > 0
