"""Fast checks of the benchmark's parts (no model, no server): workloads, cost model, reports."""

from __future__ import annotations

import json
import math

import pytest

from bench.cells import Cell, CellKey, cost_map, summarize
from bench.client import request_body
from bench.report import markdown, plot, rewrite, targets, write_all
from bench.run import parse_args, round_size, schedule
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


@pytest.mark.slow
def test_writers_produce_table_json_and_png(tmp_path) -> None:
    rows, costs = _synthetic()
    meta = {"command": "python -m bench.run --synthetic", "k": {"ngram": 4, "draft": 4}, "max_tokens": 48,
            "notes": ["synthetic"]}
    write_all(tmp_path, meta, rows, costs)
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["cells"]) == len(rows) and data["costs"] == costs and data["meta"]["k"]["ngram"] == 4
    assert all(not (isinstance(v, float) and math.isnan(v)) for r in data["cells"] for v in r.values())
    md = (tmp_path / "results.md").read_text()
    assert "| copy_edit | 0 | 1 | ngram | 24.0 | 3.00 | — | 0.80 |" in md  # no rounds recorded: no spread
    assert "## Targets" in md and "## Peer" in md and "Note: synthetic" in md
    png = (tmp_path / "speedup.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.slow
def test_each_round_is_paired_with_nones_and_the_spread_survives_a_rewrite(tmp_path) -> None:
    """A cell's ratio to `none` is also given round by round (the same prompts, back to back), so a
    reader sees how far one round strays and how far the cell's ratio is from 1.00 in standard errors
    (here 10/11, 10/9, 1: standard deviation 0.101 over sqrt(3) rounds, 0.06); results.json keeps the
    rounds for `rewrite`."""
    plain, auto = Cell(CellKey("chat", "none", 4, 0.0), k=None), Cell(CellKey("chat", "auto", 4, 0.0), k=None)
    for r, (none_wall, auto_wall) in enumerate([(10.0, 11.0), (10.0, 9.0), (12.0, 12.0)]):
        plain.add(12, 480, none_wall, round_index=r)
        auto.add(12, 480, auto_wall, round_index=r)
    rows = summarize([plain, auto], {})
    row = next(r for r in rows if r["method"] == "auto")
    assert row["round_ratios"] == [pytest.approx(10 / 11, abs=1e-3), pytest.approx(10 / 9, abs=1e-3), 1.0]
    assert row["ratio_to_none"] == pytest.approx(32 / 32)
    write_all(tmp_path, {"k": {}}, rows, [])
    assert "| chat | 0 | 4 | auto | 45.0 | 1.00 | 0.91-1.11 ±0.06 |" in (tmp_path / "results.md").read_text()
    (tmp_path / "results.md").unlink()
    rewrite(tmp_path / "results.json")
    assert "| 1.00 | 0.91-1.11 ±0.06 |" in (tmp_path / "results.md").read_text()


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
    at_least = schedule(workloads, [0.0], [8], ["none", "auto"], [], 4, min_rounds=2)
    assert len(at_least) == 2 * len(workloads)  # 4 requests fit one round of 8, but a cell gets 2
    # Rounds of closed loops: 3 requests per client, so 4 clients send 12 a round; one client one.
    assert round_size(4, 3) == 12 and round_size(1, 3) == 1
    loops = schedule(workloads[:1], [0.0], [1, 4], ["none", "auto"], [], 24, min_rounds=2, per_client=3)
    assert [n for _, _, n, _, _ in loops].count(4) == 2 and [n for _, _, n, _, _ in loops].count(1) == 24
    hot = [order for w, t, n, r, order in plan if t == 0.8 and n == 1]
    assert all("hf-prompt-lookup" not in o for o in hot)
    starts = {order[0] for *_, r, order in plan if r == 0}
    assert len(starts) > 1  # the first method rotates between blocks


def test_request_body_sends_k_only_where_it_means_something() -> None:
    (chat,) = load_workloads(["chat"])
    p = chat.prompts[0]
    assert request_body("m", p, "ngram", 6, 48, 0.0, None)["speculation"] == {
        "method": "ngram", "num_tokens": 6, "include_tokens": True}
    assert request_body("m", p, "eagle", 4, 48, 0.0, None)["speculation"]["num_tokens"] == 4
    assert request_body("m", p, "auto", 6, 48, 0.8, 7)["speculation"] == {"method": "auto", "include_tokens": True}
    assert request_body("m", p, "none", 6, 4, 0.0, None, origins=False)["speculation"] == {"method": "none"}
    body = request_body("m", p, "none", 6, 48, 0.8, 7)
    assert body["seed"] == 7 and body["temperature"] == 0.8 and body["max_tokens"] == 48
    assert "seed" not in request_body("m", p, "draft", 6, 48, 0.0, None)


def test_clients_run_closed_loops() -> None:
    """At N clients each client sends its next request when its answer arrives: never more than N in
    flight, every body sent once, answers kept in the bodies' order."""
    import asyncio

    import httpx

    from bench.client import run_round

    in_flight, most, order = 0, 0, []

    async def reply(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        body = json.loads(request.content)
        order.append(body["seed"])
        await asyncio.sleep(0.01 * (body["seed"] % 3))  # uneven answers: the free client takes the next
        in_flight -= 1
        spec = {"method": "none", "draft_tokens": 0, "accepted_tokens": 0, "decode_steps": body["seed"]}
        return httpx.Response(200, json={"choices": [{"index": 0}],
                                         "usage": {"completion_tokens": body["seed"], "speculation": spec}})

    (chat,) = load_workloads(["chat"])
    bodies = [request_body("m", chat.prompts[0], "none", None, 8, 0.8, seed) for seed in range(1, 8)]

    async def go(clients):
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            return await run_round(client, "http://x", bodies, clients)

    result = asyncio.run(go(2))
    assert most == 2 and sorted(order) == list(range(1, 8)) and order[:2] == [1, 2]
    assert (result.requests, result.completion_tokens, result.decode_steps) == (7, 28, 28)
    in_flight, most, order = 0, 0, []
    asyncio.run(go(None))  # a synchronised wave: everything at once
    assert most == 7


def test_quick_defaults_are_small() -> None:
    quick, full = parse_args(["--quick"]), parse_args([])
    assert full.per_client == 3 and quick.per_client == 1 and parse_args(["--min-waves", "3"]).min_rounds == 3
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit):
            parse_args(["--per-client", bad])
    assert quick.max_tokens < full.max_tokens and quick.requests < full.requests
    assert full.clients == [1, 4, 8] and full.temperatures == [0.0, 0.8]
    assert parse_args(["--methods", "none,ngram", "--clients", "1"]).methods == ["none", "ngram"]
    with pytest.raises(SystemExit):
        parse_args(["--methods", "bogus"])
    assert full.k == {"ngram": 8, "suffix": 8, "draft": 8, "eagle": 4}
    assert parse_args(["--k", "6"]).k == {"ngram": 6, "suffix": 6, "draft": 6, "eagle": 6}
    assert parse_args(["--k", "ngram=10,draft=3"]).k == {"ngram": 10, "suffix": 8, "draft": 3, "eagle": 4}
    assert parse_args(["--k", "ngram=8,draft=4,eagle=5"]).k == {"ngram": 8, "suffix": 8, "draft": 4, "eagle": 5}
    assert parse_args(["--k", "8,eagle=2"]).k == {"ngram": 8, "suffix": 8, "draft": 8, "eagle": 2}
    assert parse_args(["--methods", "none,eagle,auto"]).methods == ["none", "eagle", "auto"]
    for bad in ("auto=4", "none=4", "bogus=4", "0", "eagle=33", "x"):
        with pytest.raises(SystemExit):
            parse_args(["--k", bad])


@pytest.mark.slow
def test_rewrite_recomputes_the_same_figures_from_json(tmp_path) -> None:
    rows, costs = _synthetic()
    write_all(tmp_path, {"k": {"ngram": 4, "draft": 4}}, rows, costs)
    before = json.loads((tmp_path / "results.json").read_text())
    (tmp_path / "results.md").unlink()
    rewrite(tmp_path / "results.json")
    assert json.loads((tmp_path / "results.json").read_text())["cells"] == before["cells"]
    assert (tmp_path / "results.md").is_file()


# ---- every method of the server's registry ------------------------------------------------------


def test_methods_and_k_come_from_the_registry() -> None:
    from bench.cells import PROPOSERS, SPEC_METHODS
    from bench.report import METHOD_ORDER
    from bench.run import DEFAULT_K
    from server.speculation.registry import BUILTIN

    assert SPEC_METHODS == BUILTIN.methods and "eagle" in SPEC_METHODS
    assert PROPOSERS == BUILTIN.proposers and set(DEFAULT_K) == set(BUILTIN.proposers)
    assert METHOD_ORDER[: len(SPEC_METHODS)] == SPEC_METHODS
    assert parse_args([]).methods is None  # default: every method; warm-up drops the refused ones


def test_eagle_gets_cells_in_every_block() -> None:
    workloads = load_workloads(["copy_edit", "chat"])
    plan = schedule(workloads, [0.0, 0.8], [1, 4, 8], ["none", "ngram", "eagle", "auto"], [], 2, min_rounds=2)
    blocks = {(w.name, t, n) for w, t, n, _, order in plan if "eagle" in order}
    assert blocks == {(w, t, n) for w in ("copy_edit", "chat") for t in (0.0, 0.8) for n in (1, 4, 8)}


def test_supports_method_is_false_only_for_a_400() -> None:
    import asyncio

    import httpx

    from bench.client import supports_method

    def reply(request: httpx.Request) -> httpx.Response:
        method = json.loads(request.content)["speculation"]["method"]
        if method == "eagle":
            return httpx.Response(400, json={"error": {"message": "no draft head", "type": "invalid_request_error",
                                                       "param": "speculation.method", "code": None}})
        usage = {"completion_tokens": 4, "speculation": {"method": method, "draft_tokens": 0, "accepted_tokens": 0,
                                                         "decode_steps": 4}}
        return httpx.Response(200, json={"choices": [{"index": 0}], "usage": usage})

    (chat,) = load_workloads(["chat"])

    async def probe(method: str) -> bool:
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            return await supports_method(client, "http://x", "m", chat.prompts[0], method)

    assert asyncio.run(probe("ngram")) is True
    assert asyncio.run(probe("eagle")) is False


# ---- per-proposer figures from usage and per-token origins ---------------------------------------


def _tokens(*passes: tuple[str | None, str]) -> list[dict]:
    """Origin entries: one pass per (proposer, origins), e.g. ("eagle", "AAR") = 2 accepted + recovered;
    B = bonus, P = plain."""
    names = {"A": "accepted", "R": "recovered", "B": "bonus", "P": "plain"}
    return [{"text": "x", "origin": names[o], "proposer": who, "step": step}
            for step, (who, origins) in enumerate(passes) for o in origins]


def test_response_figures_from_origins_with_one_proposer() -> None:
    from bench.cells import response_figures

    tokens = _tokens(("eagle", "AAR"), ("eagle", "R"), ("eagle", "AAAAB"), (None, "P"))
    spec = {"method": "eagle", "draft_tokens": 12, "accepted_tokens": 6, "decode_steps": 4}
    figs = response_figures(spec, [{"index": 0, "speculation": {"tokens": tokens}}])
    eagle, plain = figs["eagle"], figs["none"]
    assert (eagle.steps, eagle.first_accepted, eagle.rejections, eagle.emitted_tokens) == (3, 2, 2, 9)
    assert (eagle.draft_tokens, eagle.accepted_tokens, eagle.estimated) == (12, 6, False)
    assert eagle.acceptance_rate == pytest.approx(0.5) and eagle.first_position_acceptance == pytest.approx(2 / 3)
    assert eagle.tokens_per_step == pytest.approx(3.0)
    assert (plain.steps, plain.draft_tokens, plain.emitted_tokens) == (1, 0, 1)
    assert response_figures(spec, [{"index": 0}]) == {}  # no origins: nothing per proposer


def test_response_figures_use_by_proposer_when_reported_else_estimate() -> None:
    from bench.cells import response_figures

    tokens = _tokens(("eagle", "AR"), ("ngram", "AAAB"), ("eagle", "R"))
    choices = [{"index": 0, "speculation": {"tokens": tokens}}]
    reported = {"method": "auto", "draft_tokens": 11, "accepted_tokens": 4, "decode_steps": 3,
                "by_proposer": {"eagle": {"draft_tokens": 8, "accepted_tokens": 1},
                                "ngram": {"draft_tokens": 3, "accepted_tokens": 3}}}
    figs = response_figures(reported, choices)
    assert (figs["eagle"].draft_tokens, figs["eagle"].accepted_tokens, figs["eagle"].steps) == (8, 1, 2)
    assert (figs["ngram"].draft_tokens, figs["ngram"].first_accepted) == (3, 1)
    assert not figs["eagle"].estimated
    # Totals only: each proposer gets its examined drafts (eagle 1 + 2 rejected, ngram 3), and the 5 never
    # examined (after eagle's rejections) go to the proposer that was rejected.
    totals = {k: v for k, v in reported.items() if k != "by_proposer"}
    est = response_figures(totals, choices)
    assert (est["eagle"].draft_tokens, est["ngram"].draft_tokens) == (8, 3)
    assert est["eagle"].estimated and est["ngram"].estimated


def test_mixed_theory_and_bound_reduce_to_the_single_proposer_formulas() -> None:
    from bench.theory import attainable_mixed_speedup, mixed_speedup

    assert mixed_speedup([(10, 0.7, 4, 0.05)]) == pytest.approx(theoretical_speedup(0.7, 4, 0.05))
    assert mixed_speedup([(5, 0.0, 0, 0.0)]) == pytest.approx(1.0)
    # 10 eagle passes and 10 plain ones: tokens and costs add.
    e = expected_tokens_per_step(0.7, 4)
    assert mixed_speedup([(10, 0.7, 4, 0.05), (10, 0.0, 0, 0.0)]) == pytest.approx((10 * e + 10) / (10 * 1.2 + 10))
    assert attainable_mixed_speedup(40, 10, [(30, 0.1)], 2.0, 4) == pytest.approx(
        attainable_speedup(4.0, 3.0, 0.1, 2.0, 4))
    assert attainable_mixed_speedup(40, 10, [(20, 0.1), (10, 0.0)], 2.0, 4) == pytest.approx(
        4.0 / (0.2 + 1 + 0.25 * 3))
    with pytest.raises(ValueError):
        mixed_speedup([])


def test_summarize_uses_each_proposers_own_acceptance_and_cost() -> None:
    from bench.cells import ProposerFigures

    costs = {1: {"ngram": 0.001, "draft": 0.9, "eagle": 0.08, "verify": 1.8, "k": 8}}
    auto = Cell(CellKey("chat", "auto", 1, 0.0), k=None)
    figs = {"eagle": ProposerFigures(40, 28, steps=10, first_accepted=8, rejections=6, emitted_tokens=38),
            "ngram": ProposerFigures(12, 3, steps=4, first_accepted=1, rejections=3, emitted_tokens=7),
            "none": ProposerFigures(steps=6, emitted_tokens=6)}
    auto.add(2, 51, 10.0, 52, 31, 20, ("auto", "auto"), figs)
    none = _cell("chat", "none", 1, 0.0, 51, 12.0, steps=51, k=None)
    row = next(r for r in summarize([auto, none], costs) if r["method"] == "auto")
    # K per proposer = its drafts per pass (auto sends no K): eagle 40/10 = 4, ngram 12/4 = 3; plain passes 1/1.
    theory = (10 * expected_tokens_per_step(0.7, 4) + 4 * expected_tokens_per_step(0.25, 3) + 6) / (
        10 * (0.08 * 4 + 1) + 4 * (0.001 * 3 + 1) + 6)
    assert row["theoretical_speedup"] == pytest.approx(theory)
    assert row["efficiency"] == pytest.approx(row["ratio_to_none"] / theory)
    assert row["first_position_acceptance"] == pytest.approx(9 / 14)
    assert row["c"] == pytest.approx((40 * 0.08 + 12 * 0.001) / 52)
    bound = (51 / 20) / ((40 * 0.08 + 12 * 0.001) / 20 + 1 + 0.8 * (52 / 20) / 8)
    assert row["attainable_speedup"] == pytest.approx(bound)
    assert row["by_proposer"]["eagle"]["acceptance_rate"] == pytest.approx(0.7)
    assert row["by_proposer"]["eagle"]["c"] == pytest.approx(0.08)
    # Without origins, a fixed eagle cell falls back to its totals under its own name and c.
    eagle = _cell("chat", "eagle", 1, 0.0, 48, 6.0, 40, 28, 12)
    (erow,) = [r for r in summarize([eagle, none], costs) if r["method"] == "eagle"]
    assert erow["theoretical_speedup"] == pytest.approx(theoretical_speedup(0.7, 4, 0.08))
    assert erow["c"] == pytest.approx(0.08) and erow["first_position_acceptance"] is None


def _head_rows() -> tuple[list[dict], list[dict]]:
    from bench.cells import ProposerFigures

    cells = []
    for t in (0.0, 0.8):
        for n in (1, 8):
            cells.append(_cell("chat", "none", n, t, 96, 12.0, steps=96, k=None))
            eagle = Cell(CellKey("chat", "eagle", n, t), k=4)
            eagle.add(2, 96, 8.0 if t == 0 else 11.0, 120, 84, 40, ("eagle", "eagle"),
                      {"eagle": ProposerFigures(120, 84, steps=40, first_accepted=30, rejections=20,
                                                emitted_tokens=96)})
            cells.append(eagle)
            cells.append(_cell("chat", "ngram", n, t, 96, 12.5, 40, 8, 40, k=8))
            cells.append(_cell("chat", "auto", n, t, 96, 9.0, 100, 70, 40, k=None))
    costs = [{"batch": 1, "context": 100, "target_step_ms": 60.0, "draft_step_ms": 70.0, "head_step_ms": 4.8,
              "verify_ms": 110.0, "ngram_ms": 0.06, "k": 8, "c_draft": 70 / 60, "c_eagle": 0.08,
              "c_ngram": 0.001, "verify_ratio": 110 / 60}]
    return summarize(cells, cost_map(costs)), costs


def test_head_targets_read_the_right_cells() -> None:
    from bench.report import head_targets

    rows, costs = _head_rows()
    by_name = {t["target"]: t for t in head_targets(rows, costs)}
    cost = by_name["eagle head: one draft token / target step (c), batch 1"]
    assert cost["figure"] == pytest.approx(0.08) and cost["pass"] is True and cost["at_most"]
    assert by_name["eagle first-position acceptance (chat)"]["figure"] == pytest.approx(0.75)
    assert by_name["eagle per-token acceptance (chat)"]["figure"] == pytest.approx(0.7)
    assert by_name["eagle tokens per verify pass (chat)"]["figure"] == pytest.approx(1 + 84 / 40)
    assert "K = 4" in by_name["eagle tokens per verify pass (chat)"]["source"]
    assert by_name["eagle on open chat, x none"]["figure"] == pytest.approx(1.5)
    assert by_name["eagle on open chat at T = 0.8, x none"]["pass"] is False  # 12 / 11 < 1.15
    assert by_name["eagle on open chat, 8 clients, x none, worst"]["figure"] == pytest.approx(12 / 11)
    assert by_name["auto on open chat, x none"]["figure"] == pytest.approx(12 / 9)
    best = by_name["auto / best fixed method (chat), worst cell"]
    assert best["figure"] == pytest.approx((12 / 9) / 1.5) and best["pass"] is False
    none = head_targets([r for r in rows if r["method"] != "eagle"], [])
    assert all(t["pass"] is None for t in none if "eagle" in t["target"])


@pytest.mark.slow
def test_report_with_eagle_writes_rows_targets_costs_and_rewrites(tmp_path) -> None:
    rows, costs = _head_rows()
    write_all(tmp_path, {"k": {"ngram": 8, "draft": 8, "eagle": 4}, "notes": ["untrained head"]}, rows, costs)
    md = (tmp_path / "results.md").read_text()
    assert "## Targets of issue 10" in md and "| chat | 0 | 1 | eagle |" in md
    assert "| 4.80 | 0.080 |" in md  # the eagle columns of the costs table
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    before = json.loads((tmp_path / "results.json").read_text())
    rewrite(tmp_path / "results.json")
    after = json.loads((tmp_path / "results.json").read_text())
    assert after["cells"] == before["cells"] and after["head_targets"] == before["head_targets"]
    assert any(c["by_proposer"] for c in after["cells"])


# ---- the draft head's cost ------------------------------------------------------------------------


def test_head_cost_is_measured_through_its_own_runner(tiny_target, prompt_ids, tmp_path) -> None:
    import torch

    from bench.costs import HeadStep, engine_attention, load_head, measure_costs
    from server.draft_head.model import EagleHead

    head, note = load_head(str(tmp_path / "missing"), None, tiny_target)
    assert head is not None and "untrained" in note
    assert load_head(None, None, tiny_target) == (None, "no draft head (draft_head: none)")
    saved = EagleHead.create(tiny_target.model, list(range(64)), "tiny-target", seed=1)
    saved.save_pretrained(tmp_path / "head", dtype=torch.float32)
    loaded, note = load_head(str(tmp_path / "head"), None, tiny_target)
    assert loaded is not None and loaded.num_vocab == 64 and str(tmp_path / "head") in note

    rows = [prompt_ids[0], prompt_ids[1]]
    step = HeadStep(loaded, tiny_target, rows)
    held = lambda: [step.runner.cached(rid) for rid in step.runner.rows]  # noqa: E731
    assert held() == [len(r) - 1 for r in rows]  # the prompt's pairs
    step()
    assert held() == [len(r) - 1 for r in rows]  # a timed step is rolled back
    before = tiny_target.model.config._attn_implementation
    with engine_attention(tiny_target.model, loaded.decoder):
        costs = measure_costs(tiny_target, None, rows, [1, 2], k=4, repeats=1, head=loaded)
    assert tiny_target.model.config._attn_implementation == before
    for batch, c in costs.items():
        assert c.batch == batch and c.head_step_ms is not None and c.draft_step_ms is None
        row = c.to_json()
        assert row["c_eagle"] == pytest.approx(c.head_step_ms / c.target_step_ms) and row["c_draft"] is None
    assert cost_map([c.to_json() for c in costs.values()])[2]["eagle"] == costs[2].c_eagle


def test_run_round_sums_each_proposers_figures_from_the_origins() -> None:
    import asyncio

    import httpx

    from bench.client import run_round

    def reply(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["speculation"]["include_tokens"] is True
        tokens = _tokens(("eagle", "AAB"), ("eagle", "R"), (None, "P"))
        spec = {"method": "eagle", "draft_tokens": 4, "accepted_tokens": 2, "decode_steps": 3}
        return httpx.Response(200, json={"choices": [{"index": 0, "speculation": {"tokens": tokens}}],
                                         "usage": {"completion_tokens": 5, "speculation": spec}})

    (chat,) = load_workloads(["chat"])
    bodies = [request_body("m", p, "eagle", 4, 8, 0.0, None) for p in chat.prompts[:3]]

    async def wave():
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            return await run_round(client, "http://x", bodies)

    result = asyncio.run(wave())
    eagle = result.proposers["eagle"]
    assert (result.draft_tokens, result.completion_tokens) == (12, 15)
    assert (eagle.draft_tokens, eagle.accepted_tokens, eagle.steps, eagle.first_accepted) == (12, 6, 6, 3)
    assert result.proposers["none"].steps == 3
    cell = Cell(CellKey("chat", "eagle", 3, 0.0), k=4)
    cell.add(result.requests, result.completion_tokens, result.wall_s, result.draft_tokens, result.accepted_tokens,
             result.decode_steps, result.reported_methods, result.proposers)
    (row,) = summarize([cell], {})
    assert row["first_position_acceptance"] == pytest.approx(0.5)
