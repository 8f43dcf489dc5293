"""The benchmark ledger (bench/ledger.py): what a run's line holds, latest/, LATEST.md and README's table."""

from __future__ import annotations

import json

import pytest

from bench import ledger
from bench.report import FIGURES_END, FIGURES_START, between, latest_markdown, readme_table, write_readme


def _cells() -> list[ledger.Cell]:
    return [ledger.Cell("copy_edit", "auto", 2.0, clients=1, spread=ledger.Spread.of([1.8, 2.2]), headline=True,
                        values={"tokens_per_s": 20.0}),
            ledger.Cell("copy_edit", "auto", 1.4, clients=4, headline=True),
            ledger.Cell("chat", "ngram", 0.9, clients=1)]


def test_spread_of_rounds() -> None:
    assert ledger.Spread.of([1.0]) is None
    s = ledger.Spread.of([1.1, 0.9, 1.0])
    assert (s.low, s.high, s.n) == (0.9, 1.1, 3) and s.se == pytest.approx(0.0577, abs=1e-4)


def test_record_appends_one_line_and_keeps_the_newest_files(tmp_path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text("{}")
    entry = ledger.record("grid", _cells(), files=[out / "results.json"], figures={"minutes": 1.0},
                          command="python -m bench.run --quick", results=tmp_path / "results")
    lines = (tmp_path / "results" / "ledger.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == entry
    for key in ("date", "commit", "machine", "device", "command", "suite", "cells", "files"):
        assert key in entry, key
    assert entry["command"] == "python -m bench.run --quick" and entry["suite"] == "grid"
    first = entry["cells"][0]
    assert {k: first[k] for k in ("workload", "method", "baseline", "clients", "temperature", "ratio")} == {
        "workload": "copy_edit", "method": "auto", "baseline": "none", "clients": 1, "temperature": 0.0, "ratio": 2.0}
    assert first["spread"]["n"] == 2 and "spread" not in entry["cells"][2] and "headline" not in entry["cells"][2]
    assert (tmp_path / "results" / "latest" / "grid" / "results.json").read_text() == "{}"
    assert (tmp_path / "results" / "LATEST.md").read_text() == latest_markdown(ledger.read(tmp_path / "results"))

    (out / "results.md").write_text("# newer")
    ledger.record("grid", _cells()[:1], files=[out / "results.md"], results=tmp_path / "results")
    assert [p.name for p in (tmp_path / "results" / "latest" / "grid").iterdir()] == ["results.md"]
    assert len(ledger.read(tmp_path / "results")) == 2


def test_record_defaults_to_the_environment_s_results_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECULA_BENCH_RESULTS", str(tmp_path))
    ledger.record("lookup_cost", [ledger.Cell("256 tokens", "ngram", values={"us_per_call": 3.0})])
    (line,) = ledger.read()
    assert line["suite"] == "lookup_cost" and line["command"].startswith("python -m")
    assert "files" not in line and (tmp_path / "LATEST.md").is_file()


def _entry(suite: str, date: str, ratio: float, **extra) -> dict:
    cells = [ledger.Cell("chat", "auto", ratio, clients=c, headline=True).to_json() for c in (1, 8)]
    return {"date": date, "commit": "abc1234", "machine": "2 CPUs (X), x86_64, load average 1.5", "device": "cpu",
            "command": f"python -m bench.{suite} --x", "suite": suite, "cells": cells, **extra}


def test_latest_is_the_newest_run_per_suite_and_device_never_a_baseline() -> None:
    entries = [_entry("grid", "2026-12-01T00:00:00", 1.1), _entry("grid", "2026-12-03T00:00:00", 1.3),
               _entry("grid", "2026-12-04T00:00:00", 0.7, baseline=True),
               _entry("grid", "2026-12-02T00:00:00", 1.5, device="cuda"), _entry("fresh", "2026-12-02T00:00:00", 2.0)]
    newest = ledger.latest(entries)
    assert set(newest) == {("grid", "cpu"), ("grid", "cuda"), ("fresh", "cpu")}
    assert newest["grid", "cpu"]["cells"][0]["ratio"] == 1.3
    table = readme_table(entries)
    row = "| `bench.grid` | chat | `auto` / `none`, greedy | 1.30 | 1.30 | 2026-12-03, `abc1234`, 2 CPUs, load 1.5 |"
    assert row in table
    assert "| `bench.grid` on a GPU | chat |" in table and "0.70" not in table
    assert table.index("`bench.fresh`") < table.index("on a GPU")  # CPU runs first


def test_readme_gets_latest_md_s_table(tmp_path) -> None:
    results = tmp_path / "results"
    for e in (_entry("grid", "2026-12-01T00:00:00", 1.25), _entry("fresh", "2026-12-02T00:00:00", 2.0)):
        ledger.append(e, results)
    readme = tmp_path / "README.md"
    readme.write_text(f"# X\n\nbefore\n\n{FIGURES_START}\nold table\n{FIGURES_END}\n\nafter\n")
    write_readme(results, readme)
    text = readme.read_text()
    assert between(text) == between((results / "LATEST.md").read_text()) == readme_table(ledger.read(results))
    assert "old table" not in text and text.startswith("# X\n\nbefore\n") and text.endswith("\n\nafter\n")
    assert "1.25" in text


def test_grid_cells_from_a_run() -> None:
    from bench.run import ledger_cells

    rows = [
        {"workload": "copy_edit", "method": "none", "clients": 1, "temperature": 0.0, "ratio_to_none": 1.0,
         "tokens_per_s": 10.0},
        {"workload": "copy_edit", "method": "auto", "clients": 1, "temperature": 0.0, "ratio_to_none": 2.0,
         "tokens_per_s": 20.0, "acceptance_rate": 0.5, "mean_accepted_length": 2.5, "round_ratios": [1.9, 2.1]},
        {"workload": "code", "method": "auto", "clients": 1, "temperature": 0.0, "ratio_to_none": 1.5,
         "tokens_per_s": 15.0},
        {"workload": "chat", "method": "ngram", "clients": 4, "temperature": 0.8, "ratio_to_none": None,
         "tokens_per_s": 9.0},
    ]
    cells = ledger_cells(rows)
    assert [(c.workload, c.method, c.headline) for c in cells] == [("code", "auto", False),
                                                                    ("copy_edit", "auto", True)]
    assert cells[1].spread.n == 2 and cells[1].values == {"tokens_per_s": 20.0, "acceptance": 0.5,
                                                          "tokens_per_pass": 2.5}


def test_fresh_cells_pool_tokens_over_time_and_agent_from_its_third_request() -> None:
    from bench.fresh import ledger_cells

    measured = {"none": {"copy-0": (10, 1.0), "copy-1": (30, 1.0), "agent-0": (10, 10.0), "agent-1": (10, 10.0),
                         "agent-2": (10, 1.0), "agent-3": (10, 1.0)},
                "default": {"copy-0": (10, 0.5), "copy-1": (30, 1.5), "agent-0": (10, 1.0), "agent-1": (10, 1.0),
                            "agent-2": (10, 0.5), "agent-3": (10, 0.25)}}
    copy, agent = ledger_cells(measured)
    assert copy.workload == "copy" and copy.ratio == pytest.approx((40 / 2.0) / (40 / 2.0))
    assert (copy.spread.low, copy.spread.high) == (pytest.approx(2 / 3, abs=1e-4), 2.0)
    assert agent.values["prompts"] == 2 and agent.ratio == pytest.approx((20 / 0.75) / (20 / 2.0))


def test_llamacpp_cells_compare_with_the_fastest_llama_arm() -> None:
    from bench.llamacpp import ledger_cells

    results = {"one_client": {"llama-plain-1t": {"tokens": 100, "seconds": 2.0},
                              "llama-plain-2t": {"tokens": 100, "seconds": 10.0},
                              "specula-none": {"tokens": 100, "seconds": 10.0},
                              "specula-default": {"tokens": 100, "seconds": 5.0}},
               "many_clients": {}, "peak_rss_mib": {"specula-default": 1000.0}}
    cells = {(c.method, c.baseline): c for c in ledger_cells(results)}
    assert cells["specula-default", "llama-plain-1t"].ratio == pytest.approx(0.4)
    assert cells["specula-default", "llama-plain-1t"].headline
    assert cells["specula-default", "specula-none"].ratio == pytest.approx(2.0)
    assert not cells["specula-none", "llama-plain-1t"].headline
    assert cells["specula-default", "llama-plain-1t"].values["peak_rss_mib"] == 1000


def test_guidellm_cells_are_default_over_none_per_profile() -> None:
    from bench.guidellm_peer import ledger_cells

    def cell(data, profile, method, tps):
        return {"data": data, "profile": profile, "method": method, "output_tok_s": {"mean": tps},
                "ttft_ms": {"median": 100.0}, "requests": {"successful": 3, "errored": 0}}

    results = {"cells": [cell("random", "synchronous", "auto", 30.0), cell("random", "synchronous", "none", 20.0),
                         cell("random", "concurrent-4", "auto", 44.0), cell("random", "concurrent-4", "none", 40.0)]}
    cells = ledger_cells(results)
    assert [(c.clients, round(c.ratio, 2)) for c in cells] == [(1, 1.5), (4, 1.1)]


def test_the_machine_line_names_the_cpus_vector_width_and_readme_shows_it() -> None:
    """A CPU run on the block kernels is bound by bytes with AVX-512 and by arithmetic with AVX2 only (the same
    bench read 1.30x and 0.87x llama-server's tokens/s on the two): the line says which, and README's column too."""
    from pathlib import Path

    from bench.report import _machine_short

    summary, _ = ledger.machine()
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    width = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else None
    if width:
        assert f", {width})" in summary
        assert _machine_short({"machine": summary}).startswith(f"{summary.split()[0]} CPUs {width}, load")
    wide = "2 CPUs (AMD EPYC, AVX-512), x86_64, load average 1.5"
    assert _machine_short({"machine": wide}) == "2 CPUs AVX-512, load 1.5"
    older = "2 CPUs (AMD EPYC), x86_64, load average 1.6"  # lines recorded before the width was
    assert _machine_short({"machine": older}) == "2 CPUs, load 1.6"
