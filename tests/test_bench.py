"""Fast checks of the benchmark's parts (no model, no server): workloads, cost model, reports."""

from __future__ import annotations

import json
import math

import pytest

from bench.cells import Cell, CellKey, cost_map, summarize
from bench.client import request_body
from bench.report import markdown, plot, rewrite, targets, write_all
from bench.run import parse_args, schedule
from bench.theory import (
    attainable_speedup,
    efficiency,
    expected_tokens_per_step,
    mean_accepted_length,
    theoretical_speedup,
)
from bench.workloads import MIN_PROMPTS, WORKLOADS, load_workloads

# ---- workloads ----------------------------------------------------------------------------------


def test_every_workload_loads_with_enough_chat_prompts() -> None:
    workloads = load_workloads()
    assert [w.name for w in workloads] == list(WORKLOADS)
    for w in workloads:
        assert len(w.prompts) >= MIN_PROMPTS, w.name
        for p in w.prompts:
            assert p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip()
            assert p.task


def test_copy_edit_covers_typos_and_list_reformatting() -> None:
    (copy_edit,) = load_workloads(["copy_edit"])
    tasks = {p.task for p in copy_edit.prompts}
    assert {"fix typos", "reformat list"} <= tasks
    # Interleaved, so a cell that uses only its first few prompts still sees both kinds.
    assert copy_edit.prompts[0].task != copy_edit.prompts[1].task


# ---- the cost model -----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("c", [0.0, 0.1, 0.75])
def test_no_acceptance_costs_only_the_drafts(k: int, c: float) -> None:
    assert theoretical_speedup(0.0, k, c) == pytest.approx(1 / (c * k + 1))


@pytest.mark.parametrize("k", [1, 4, 8])
def test_full_acceptance_is_the_limit_k_plus_one_over_cost(k: int) -> None:
    c = 0.2
    assert theoretical_speedup(1.0, k, c) == pytest.approx((k + 1) / (c * k + 1))
    assert theoretical_speedup(1 - 1e-9, k, c) == pytest.approx((k + 1) / (c * k + 1), rel=1e-6)


def test_known_values() -> None:
    # a = 0.5, K = 2: 1 + 0.5 + 0.25 tokens per step; c = 0: free drafts.
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert theoretical_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    # Leviathan et al. Fig. 3 style: a = 0.8, K = 4, c = 0.05 -> (1 - 0.8^5) / (0.2 * 1.2).
    assert theoretical_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))
    assert theoretical_speedup(0.9, 0, 0.3) == pytest.approx(1.0)  # K = 0: plain decoding


def test_speedup_grows_with_acceptance_and_falls_with_cost() -> None:
    values = [theoretical_speedup(a / 10, 4, 0.1) for a in range(11)]
    assert values == sorted(values)
    assert theoretical_speedup(0.7, 4, 0.5) < theoretical_speedup(0.7, 4, 0.1)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        theoretical_speedup(1.2, 4, 0.1)
    with pytest.raises(ValueError):
        theoretical_speedup(0.5, 4, -0.1)


def test_attainable_speedup() -> None:
    # Free verification and free drafts: the bound is the tokens per step themselves.
    assert attainable_speedup(3.0, 4.0, 0.0, 1.0, 4) == pytest.approx(3.0)
    # Verifying K+1 costs 2 steps; with K drafts per step the bound halves.
    assert attainable_speedup(3.0, 4.0, 0.0, 2.0, 4) == pytest.approx(1.5)
    # Half the drafts: half the extra verify cost; plus drafting at c = 0.5.
    assert attainable_speedup(3.0, 2.0, 0.5, 2.0, 4) == pytest.approx(3.0 / (1.0 + 1.5))


def test_mean_accepted_length_and_efficiency() -> None:
    assert mean_accepted_length(30, 10) == pytest.approx(4.0)
    assert mean_accepted_length(0, 0) == 0.0
    assert efficiency(1.8, 2.0) == pytest.approx(0.9)
    assert efficiency(None, 2.0) is None and efficiency(1.0, None) is None


# ---- cells, reports -----------------------------------------------------------------------------


def _cell(workload: str, method: str, clients: int, temperature: float, tokens: int, wall: float,
          draft: int = 0, accepted: int = 0, steps: int = 0, k: int | None = 4) -> Cell:
    cell = Cell(CellKey(workload, method, clients, temperature), k=k)
    reported = (method,) * 2 if not method.startswith("hf-") else ()
    cell.add(2, tokens, wall, draft, accepted, steps, reported)
    return cell


def _synthetic() -> tuple[list[dict], list[dict]]:
    cells = []
    for w, copy in (("copy_edit", True), ("chat", False)):
        for n in (1, 8):
            for t in (0.0, 0.8):
                cells.append(_cell(w, "none", n, t, 96, 12.0, steps=96, k=None))
                cells.append(_cell(w, "ngram", n, t, 96, 4.0 if copy else 12.5, 80, 64 if copy else 8, 30))
                cells.append(_cell(w, "draft", n, t, 96, 10.0, 80, 70, 20))
                cells.append(_cell(w, "auto", n, t, 96, 4.0 if copy else 11.9, 60, 50, 25, k=None))
        cells.append(_cell(w, "hf-prompt-lookup", 1, 0.0, 96, 6.0, k=None))
        cells.append(_cell(w, "hf-none", 1, 0.0, 96, 13.0, k=None))
    costs = [
        {"batch": 1, "context": 100, "target_step_ms": 60.0, "draft_step_ms": 45.0, "verify_ms": 84.0,
         "ngram_ms": 0.06, "k": 4, "c_draft": 0.75, "c_ngram": 0.001, "verify_ratio": 1.4},
        {"batch": 8, "context": 100, "target_step_ms": 120.0, "draft_step_ms": 90.0, "verify_ms": 300.0,
         "ngram_ms": 0.5, "k": 4, "c_draft": 0.75, "c_ngram": 0.004, "verify_ratio": 2.5},
    ]
    return summarize(cells, cost_map(costs)), costs


def test_summarize_derives_ratio_theory_and_efficiency() -> None:
    rows, _ = _synthetic()
    row = next(r for r in rows if (r["workload"], r["method"], r["clients"], r["temperature"])
               == ("copy_edit", "ngram", 1, 0.0))
    assert row["tokens_per_s"] == pytest.approx(24.0)
    assert row["ratio_to_none"] == pytest.approx(3.0)
    assert row["acceptance_rate"] == pytest.approx(0.8)
    assert row["mean_accepted_length"] == pytest.approx(1 + 64 / 30)
    assert row["c"] == pytest.approx(0.001)
    theory = theoretical_speedup(0.8, 4, 0.001)
    assert row["theoretical_speedup"] == pytest.approx(theory)
    assert row["efficiency"] == pytest.approx(3.0 / theory)
    # 80 drafts over 30 steps at K = 4: verify costs 1 + 0.4 * (8/3) / 4 steps, drafting 0.001 * 8/3.
    bound = (1 + 64 / 30) / (0.001 * 80 / 30 + 1 + 0.4 * (80 / 30) / 4)
    assert row["attainable_speedup"] == pytest.approx(bound)
    assert row["overhead_efficiency"] == pytest.approx(3.0 / bound)
    draft8 = next(r for r in rows if (r["workload"], r["method"], r["clients"]) == ("chat", "draft", 8))
    assert draft8["c"] == pytest.approx(0.75)
    none = next(r for r in rows if r["method"] == "none")
    assert none["ratio_to_none"] == pytest.approx(1.0) and none["theoretical_speedup"] == 1.0
    assert none["efficiency"] is None and none["acceptance_rate"] is None
    auto = next(r for r in rows if r["method"] == "auto")
    assert auto["c"] is None and auto["theoretical_speedup"] is None  # auto reports itself, not a proposer
    peer = next(r for r in rows if r["method"] == "hf-prompt-lookup")
    assert peer["ratio_to_none"] == pytest.approx(16.0 / 8.0) and peer["acceptance_rate"] is None


def test_auto_that_names_its_proposer_gets_a_theory() -> None:
    cell = Cell(CellKey("chat", "auto", 1, 0.0), k=None)
    cell.add(1, 48, 6.0, 40, 20, 10, ("ngram",))
    none = _cell("chat", "none", 1, 0.0, 48, 8.0, k=None)
    (row, _) = summarize([cell, none], {1: {"ngram": 0.0, "draft": 0.7}})
    assert row["c"] == 0.0 and row["theoretical_speedup"] == pytest.approx(theoretical_speedup(0.5, 4, 0.0))


def test_targets_read_the_right_cells() -> None:
    rows, _ = _synthetic()
    by_name = {t["target"]: t for t in targets(rows)}
    assert by_name["auto on copy-heavy (copy_edit), x none"]["figure"] == pytest.approx(3.0)
    assert by_name["auto on copy-heavy (copy_edit), x none"]["pass"] is True
    assert by_name["auto on copy-heavy (code), x none"]["figure"] is None  # no code cells: unknown, not fail
    assert by_name["auto on open-ended (chat), x none"]["figure"] == pytest.approx(12.0 / 11.9)
    assert by_name["ngram over HTTP / HF prompt lookup (copy_edit)"]["figure"] == pytest.approx(24.0 / 16.0)
    assert by_name["ngram over HTTP / HF prompt lookup (chat)"]["pass"] is False
    assert by_name["auto with 8 clients, total tok/s x none, worst"]["figure"] == pytest.approx(12.0 / 11.9)


def test_writers_produce_table_json_and_png(tmp_path) -> None:
    rows, costs = _synthetic()
    meta = {"command": "python -m bench.run --synthetic", "k": {"ngram": 4, "draft": 4}, "max_tokens": 48,
            "notes": ["synthetic"]}
    write_all(tmp_path, meta, rows, costs)
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["cells"]) == len(rows) and data["costs"] == costs and data["meta"]["k"]["ngram"] == 4
    assert all(not (isinstance(v, float) and math.isnan(v)) for r in data["cells"] for v in r.values())
    md = (tmp_path / "results.md").read_text()
    assert "| copy_edit | 0 | 1 | ngram | 24.0 | 3.00 | 0.80 |" in md
    assert "## Targets" in md and "## Peer" in md and "Note: synthetic" in md
    png = (tmp_path / "speedup.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_markdown_without_costs_or_peer() -> None:
    rows, _ = _synthetic()
    rows = [r for r in rows if not r["method"].startswith("hf-")]
    md = markdown({"k": {"ngram": 4}}, rows, [])
    assert "## Peer" not in md and "## Measured costs" not in md


def test_plot_copes_with_no_speculative_points(tmp_path) -> None:
    rows = summarize([_cell("chat", "none", 1, 0.0, 10, 1.0, k=None)], {})
    plot(tmp_path / "p.png", rows, [], {"ngram": 4})
    assert (tmp_path / "p.png").stat().st_size > 0


# ---- planning and requests ----------------------------------------------------------------------


def test_schedule_interleaves_and_alternates() -> None:
    workloads = load_workloads(["copy_edit", "chat"])
    plan = schedule(workloads, [0.0, 0.8], [1, 4], ["none", "ngram", "draft"], ["hf-prompt-lookup"], 4)
    first = [order for w, t, n, r, order in plan if w.name == "copy_edit" and t == 0.0 and n == 1]
    assert len(first) == 4  # 4 requests at 1 client: 4 rounds
    assert first[0] == ["none", "ngram", "draft", "hf-prompt-lookup"] and first[1] == first[0][::-1]
    four = [order for w, t, n, r, order in plan if w.name == "copy_edit" and t == 0.0 and n == 4]
    assert len(four) == 1 and "hf-prompt-lookup" not in four[0]  # the peer runs at 1 client, greedy only
    at_least = schedule(workloads, [0.0], [8], ["none", "auto"], [], 4, min_waves=2)
    assert len(at_least) == 2 * len(workloads)  # 4 requests fit one wave of 8, but a cell gets 2
    hot = [order for w, t, n, r, order in plan if t == 0.8 and n == 1]
    assert all("hf-prompt-lookup" not in o for o in hot)
    starts = {order[0] for *_, r, order in plan if r == 0}
    assert len(starts) > 1  # the first method rotates between blocks


def test_request_body_sends_k_only_where_it_means_something() -> None:
    (chat,) = load_workloads(["chat"])
    p = chat.prompts[0]
    assert request_body("m", p, "ngram", 6, 48, 0.0, None)["speculation"] == {"method": "ngram", "num_tokens": 6}
    assert request_body("m", p, "auto", 6, 48, 0.8, 7)["speculation"] == {"method": "auto"}
    body = request_body("m", p, "none", 6, 48, 0.8, 7)
    assert body["seed"] == 7 and body["temperature"] == 0.8 and body["max_tokens"] == 48
    assert "seed" not in request_body("m", p, "draft", 6, 48, 0.0, None)


def test_quick_defaults_are_small() -> None:
    quick, full = parse_args(["--quick"]), parse_args([])
    assert quick.max_tokens < full.max_tokens and quick.requests < full.requests
    assert full.clients == [1, 4, 8] and full.temperatures == [0.0, 0.8]
    assert parse_args(["--methods", "none,ngram", "--clients", "1"]).methods == ["none", "ngram"]
    with pytest.raises(SystemExit):
        parse_args(["--methods", "bogus"])
    assert full.k == {"ngram": 8, "draft": 8}
    assert parse_args(["--k", "6"]).k == {"ngram": 6, "draft": 6}
    assert parse_args(["--k", "ngram=10,draft=3"]).k == {"ngram": 10, "draft": 3}
    for bad in ("auto=4", "0", "x"):
        with pytest.raises(SystemExit):
            parse_args(["--k", bad])


def test_rewrite_recomputes_the_same_figures_from_json(tmp_path) -> None:
    rows, costs = _synthetic()
    write_all(tmp_path, {"k": {"ngram": 4, "draft": 4}}, rows, costs)
    before = json.loads((tmp_path / "results.json").read_text())
    (tmp_path / "results.md").unlink()
    rewrite(tmp_path / "results.json")
    assert json.loads((tmp_path / "results.json").read_text())["cells"] == before["cells"]
    assert (tmp_path / "results.md").is_file()
