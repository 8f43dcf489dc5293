"""bench/guidellm_peer.py without guidellm: the scenario it writes and how it reads guidellm's report."""

from __future__ import annotations

from pathlib import Path

from bench.guidellm_peer import markdown, scenario, summarise


def report(tok_s: float, errored: int = 0) -> dict:
    def stat(v: float) -> dict:
        return {"successful": {"mean": v, "median": v - 1}}

    metrics = {
        "request_totals": {"successful": 3, "errored": errored, "incomplete": 0, "total": 3 + errored},
        "time_to_first_token_ms": stat(500.0),
        "inter_token_latency_ms": stat(60.0),
        "time_per_output_token_ms": stat(70.0),
        "output_tokens_per_second": stat(tok_s),
    }
    return {"benchmarks": [{"metrics": metrics}]}


def test_scenario_sends_temperature_0_the_method_and_the_cells_salt_per_request(tmp_path: Path):
    data = {"kind": "synthetic_text", "prompt_tokens": 8, "output_tokens": 4}
    spec = scenario("http://h", "m", tmp_path, data, {"kind": "synchronous"}, 2, "none", 4, tmp_path / "o.json",
                    salt="cell-a")
    backend = spec["spec"]["backend"]
    assert backend["extras"]["body"] == {"temperature": 0, "cache_salt": "cell-a", "speculation": {"method": "none"}}
    assert spec["spec"]["constraints"] == [{"kind": "max_requests", "count": 2}]
    default = scenario("http://h", "m", tmp_path, data, {"kind": "synchronous"}, 2, "default", 4, tmp_path / "o",
                       salt="cell-b")
    assert default["spec"]["backend"]["extras"]["body"] == {"temperature": 0, "cache_salt": "cell-b"}


def test_summary_and_ratio_against_none():
    auto, none = summarise(report(15.0)), summarise(report(10.0, errored=1))
    assert auto["tpot_ms"] == {"mean": 70.0, "median": 69.0} and none["requests"]["errored"] == 1
    cells = [
        {**auto, "data": "random", "profile": "synchronous", "method": "auto"},
        {**none, "data": "random", "profile": "synchronous", "method": "none"},
    ]
    table = markdown({"config": {"note": "n"}, "cells": cells})
    assert "| random | synchronous | auto | 3/0 | 499 | 60.0 | 70.0 | 15.0 | 1.50x |" in table
    assert "| random | synchronous | none | 3/1 |" in table
