"""Writing the results: `results.md` (tables, targets), `results.json` (everything), `speedup.png`; and
LATEST.md with README.md's current-figures table, from the ledger (bench/ledger.py).

    python -m bench.report --readme          # LATEST.md from bench/results/ledger.jsonl, and README's table
    python -m bench.report RESULTS.json      # rewrite a bench.run's results.md, .json, .png from its raw counts
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.cells import PROPOSERS, SPEC_METHODS
from bench.ledger import latest as ledger_latest
from bench.peer import PEER_METHODS
from bench.workloads import WORKLOADS

METHOD_ORDER = (*SPEC_METHODS, *PEER_METHODS)
TARGETS = {  # issue 5's targets (greedy, one client unless said)
    "auto_copy": 2.5,
    "auto_open": 1.0,
    "auto_floor": 0.97,
    "ngram_vs_hf": 1.3,
    "efficiency": 0.85,
    "auto_8_clients": 1.0,
}
HEAD_TARGETS = {  # issue 10's targets: the draft head (`eagle`) on open chat unless said
    "head_cost": 0.10,  # c of one head token at batch 1 (at most)
    "first_position": 0.7,  # greedy acceptance of the first draft position
    "acceptance": 0.6,  # greedy per-token acceptance
    "tokens_per_pass": 2.2,  # mean tokens per verify pass at K = 4
    "eagle_greedy": 1.3,
    "eagle_sampled": 1.15,  # T = 0.8
    "eagle_8_clients": 1.0,
    "auto_chat": 1.25,
    "auto_vs_best": 0.95,  # auto within 5% of the best fixed method
}


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _sort_key(row: dict[str, Any]) -> tuple:
    w = WORKLOADS.index(row["workload"]) if row["workload"] in WORKLOADS else len(WORKLOADS)
    m = METHOD_ORDER.index(row["method"]) if row["method"] in METHOD_ORDER else len(METHOD_ORDER)
    return (w, row["workload"], row["temperature"], row["clients"], m)


def _find(rows: Iterable[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def _mix(row: dict[str, Any]) -> str:
    """`auto`'s drafts by proposer: "eagle 80% (a 0.71), ngram 20% (a 0.90)"; "" for one proposer."""
    figs = {n: f for n, f in (row.get("by_proposer") or {}).items() if f.get("draft_tokens")}
    total = sum(f["draft_tokens"] for f in figs.values())
    if row["method"] != "auto" or not total:
        return ""
    est = "~" if any(f.get("estimated") for f in figs.values()) else ""
    return ", ".join(f"{n} {est}{100 * f['draft_tokens'] / total:.0f}% (a {_fmt(f['acceptance_rate'])})"
                     for n, f in sorted(figs.items(), key=lambda kv: -kv[1]["draft_tokens"]))


def _pooled(rows: list[dict[str, Any]]) -> float | None:
    wall = sum(r["wall_s"] for r in rows)
    return sum(r["completion_tokens"] for r in rows) / wall if wall else None


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of issue 5 with its figure from this run, pass/fail, and where it came from."""
    out: list[dict[str, Any]] = []

    def add(name: str, figure: float | None, goal: float, source: str) -> None:
        ok = None if figure is None else figure >= goal
        out.append({"target": name, "figure": figure, "goal": goal, "pass": ok, "source": source})

    def ratio(workload: str, method: str, clients: int = 1, temperature: float = 0.0) -> float | None:
        found = _find(rows, workload=workload, method=method, clients=clients, temperature=temperature)
        return found[0]["ratio_to_none"] if found else None

    for w in ("copy_edit", "code"):
        add(f"auto on copy-heavy ({w}), x none", ratio(w, "auto"), TARGETS["auto_copy"], "greedy, 1 client")
    add("auto on open-ended (chat), x none", ratio("chat", "auto"), TARGETS["auto_open"], "greedy, 1 client")
    auto_chat = [r["ratio_to_none"] for r in _find(rows, workload="chat", method="auto") if r["ratio_to_none"]]
    add("auto on open-ended, worst cell, x none", min(auto_chat, default=None), TARGETS["auto_floor"],
        "chat, every clients/temperature cell")
    auto_all = [r["ratio_to_none"] for r in _find(rows, method="auto") if r["ratio_to_none"]]
    add("auto, worst cell of any workload, x none", min(auto_all, default=None), TARGETS["auto_floor"],
        "every auto cell (not an issue target: context)")
    ours = _find(rows, method="ngram", clients=1, temperature=0.0)
    hf = _find(rows, method="hf-prompt-lookup", clients=1, temperature=0.0)
    workloads = sorted({r["workload"] for r in hf} & {r["workload"] for r in ours}, key=_sort_key_w)
    for w in workloads:
        a, b = _pooled(_find(ours, workload=w)), _pooled(_find(hf, workload=w))
        add(f"ngram over HTTP / HF prompt lookup ({w})", a / b if a and b else None, TARGETS["ngram_vs_hf"],
            "greedy, 1 client, same prompts")
    if workloads:
        a = _pooled([r for r in ours if r["workload"] in workloads])
        b = _pooled([r for r in hf if r["workload"] in workloads])
        add("ngram over HTTP / HF prompt lookup (all)", a / b if a and b else None, TARGETS["ngram_vs_hf"],
            "greedy, 1 client, pooled tokens / pooled time")
    for method in ("ngram", "draft"):
        eff = [r["efficiency"] for r in _find(rows, method=method, clients=1, temperature=0.0) if r["efficiency"]]
        add(f"efficiency of {method}, worst workload", min(eff, default=None), TARGETS["efficiency"],
            "greedy, 1 client: measured / theoretical")
    eight = [r["ratio_to_none"] for r in _find(rows, method="auto", clients=8) if r["ratio_to_none"]]
    add("auto with 8 clients, total tok/s x none, worst", min(eight, default=None), TARGETS["auto_8_clients"],
        "8 clients, every workload and temperature")
    return out


def head_targets(rows: list[dict[str, Any]], costs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of issue 10 (the draft head, method `eagle`) with its figure from this run.

    `pass` is None when the run has no figure for it; the head's cost is an upper bound (figure <=
    goal), every other target a lower bound.
    """
    out: list[dict[str, Any]] = []

    def add(name: str, figure: float | None, goal: float, source: str, at_most: bool = False) -> None:
        ok = None if figure is None else (figure <= goal if at_most else figure >= goal)
        out.append({"target": name, "figure": figure, "goal": goal, "pass": ok, "source": source,
                    "at_most": at_most})

    def cell(workload: str, method: str, clients: int = 1, temperature: float = 0.0) -> dict[str, Any] | None:
        found = _find(rows, workload=workload, method=method, clients=clients, temperature=temperature)
        return found[0] if found else None

    def field(row: dict[str, Any] | None, name: str) -> float | None:
        return row.get(name) if row else None

    batch1 = next((c for c in costs if c["batch"] == 1), None)
    add("eagle head: one draft token / target step (c), batch 1", batch1.get("c_eagle") if batch1 else None,
        HEAD_TARGETS["head_cost"], "costs table", at_most=True)
    eagle = cell("chat", "eagle")
    k = eagle["k"] if eagle else None
    add("eagle first-position acceptance (chat)", field(eagle, "first_position_acceptance"),
        HEAD_TARGETS["first_position"], "greedy, 1 client: passes whose first draft was accepted")
    add("eagle per-token acceptance (chat)", field(eagle, "acceptance_rate"), HEAD_TARGETS["acceptance"],
        "greedy, 1 client: accepted / draft tokens")
    add("eagle tokens per verify pass (chat)", field(eagle, "mean_accepted_length"), HEAD_TARGETS["tokens_per_pass"],
        f"greedy, 1 client, K = {k if k is not None else '?'} (the target is at K = 4)")
    add("eagle on open chat, x none", field(eagle, "ratio_to_none"), HEAD_TARGETS["eagle_greedy"], "greedy, 1 client")
    add("eagle on open chat at T = 0.8, x none", field(cell("chat", "eagle", 1, 0.8), "ratio_to_none"),
        HEAD_TARGETS["eagle_sampled"], "T = 0.8, 1 client")
    eight = [r["ratio_to_none"] for r in _find(rows, workload="chat", method="eagle", clients=8) if r["ratio_to_none"]]
    add("eagle on open chat, 8 clients, x none, worst", min(eight, default=None), HEAD_TARGETS["eagle_8_clients"],
        "8 clients, every temperature")
    add("auto on open chat, x none", field(cell("chat", "auto"), "ratio_to_none"), HEAD_TARGETS["auto_chat"],
        "greedy, 1 client")
    for w in sorted({r["workload"] for r in rows}, key=_sort_key_w):
        worst, where = None, ""
        for auto in _find(rows, workload=w, method="auto"):
            block = _find(rows, workload=w, clients=auto["clients"], temperature=auto["temperature"])
            fixed = [r["ratio_to_none"] for r in block if r["method"] in ("none", *PROPOSERS) and r["ratio_to_none"]]
            if auto["ratio_to_none"] and fixed:
                share = auto["ratio_to_none"] / max(fixed)
                if worst is None or share < worst:
                    worst, where = share, f"T = {auto['temperature']:g}, {auto['clients']} client(s)"
        add(f"auto / best fixed method ({w}), worst cell", worst, HEAD_TARGETS["auto_vs_best"],
            f"every clients/temperature cell; worst at {where}" if where else "every clients/temperature cell")
    return out


def _sort_key_w(workload: str) -> int:
    return WORKLOADS.index(workload) if workload in WORKLOADS else len(WORKLOADS)


def write_json(path: Path, meta: dict[str, Any], rows: list[dict[str, Any]], costs: list[dict[str, Any]]) -> None:
    data = {"meta": meta, "head_targets": head_targets(rows, costs), "targets": targets(rows), "costs": costs,
            "cells": sorted(rows, key=_sort_key)}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], costs: list[dict[str, Any]]) -> str:
    lines = ["# Specula benchmark results", ""]
    lines += [f"Command: `{meta.get('command', 'python -m bench.run')}`  ", f"Date: {meta.get('date', '?')}, "
              f"commit {meta.get('commit', '?')}, {meta.get('duration_s', 0) / 60:.1f} min, "
              f"machine: {meta.get('machine', '?')}.  "]
    ks = meta.get("k") or {}
    k_text = ", ".join(f"{m} {k}" for m, k in ks.items()) if isinstance(ks, dict) else str(ks)
    lines += [f"Model: {meta.get('model', '?')}; max_tokens {meta.get('max_tokens')}; K: {k_text} (auto chooses "
              f"its own, up to the server's auto ceiling); torch threads {meta.get('threads') or 'default'}; "
              f"requests per cell at 1 client: {meta.get('requests_per_cell')}; "
              f"rounds per cell at least: {meta.get('min_rounds', meta.get('min_waves', 1))}; "
              f"requests per client per round at N > 1 clients (closed loops; 1 = synchronised waves): "
              f"{meta.get('per_client', 1)}.  "]
    for note in meta.get("notes", []):
        lines.append(f"Note: {note}  ")
    for title, found in (("Targets of issue 10 (the draft head, `eagle`)", head_targets(rows, costs)),
                         ("Targets of issue 5", targets(rows))):
        lines += ["", f"## {title}", "", "| target | figure | goal | pass | measured on |", "|---|---:|---:|:---:|---|"]
        for t in found:
            mark = "—" if t["pass"] is None else ("yes" if t["pass"] else "**no**")
            goal = f"{'<=' if t.get('at_most') else '>='} {t['goal']:.2f}"
            lines.append(f"| {t['target']} | {_fmt(t['figure'])} | {goal} | {mark} | {t['source']} |")

    peer = [r for r in rows if r["method"].startswith("hf-")]
    if peer:
        lines += ["", "## Peer: transformers `generate()` vs Specula over HTTP (greedy, 1 client)", ""]
        present = {r["method"] for r in rows}
        methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in peer) or (m in present and m != "auto")]
        lines += ["| workload | " + " | ".join(f"{m} tok/s" for m in methods) + " | ngram / hf-prompt-lookup |",
                  "|---|" + "---:|" * (len(methods) + 1)]
        for w in sorted({r["workload"] for r in peer}, key=_sort_key_w):
            cells = {m: _find(rows, workload=w, method=m, clients=1, temperature=0.0) for m in methods}
            tps = {m: (c[0]["tokens_per_s"] if c else None) for m, c in cells.items()}
            ratio = tps["ngram"] / tps["hf-prompt-lookup"] if tps.get("ngram") and tps.get("hf-prompt-lookup") else None
            lines.append(f"| {w} | " + " | ".join(_fmt(tps[m], ".1f") for m in methods) + f" | {_fmt(ratio)} |")

    if costs:
        lines += ["", "## Measured costs (in-process, the engine's ModelRunner, same context)", "",
                  "c = one draft token per row / one target step at that batch size. draft = the bf16 copy of the "
                  "target; eagle = one draft-head step as the eagle proposer runs it (pair input, the head's "
                  "decoder layer, FR-vocabulary logits).", "",
                  "| batch | context | target step ms | draft step ms | c draft | eagle step ms | c eagle | c ngram "
                  "| verify K+1 / step |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in costs:
            lines.append(f"| {c['batch']} | {c['context']} | {c['target_step_ms']:.1f} "
                         f"| {_fmt(c['draft_step_ms'], '.1f')} | {_fmt(c['c_draft'], '.3f')} "
                         f"| {_fmt(c.get('head_step_ms'), '.2f')} | {_fmt(c.get('c_eagle'), '.3f')} "
                         f"| {c['c_ngram']:.4f} | {c['verify_ratio']:.2f} |")

    lines += ["", "## All cells", "",
              "tok/s = completion tokens / wall time of the cell's rounds; x none = ratio to `none` in the same "
              "run, same workload, clients and temperature (interleaved); rounds = the lowest and highest "
              "ratio of a single round (each round runs the methods back to back on the same prompts): how "
              "far this machine's drift moves one round, and ± the standard error of the rounds' mean ratio (a cell "
              "within two of them of 1.00 is not told apart from `none` by this run); "
              "accept = accepted / draft tokens; first = passes whose first draft token was accepted / passes "
              "that drafted; "
              "len = mean accepted length (1 + accepted / steps); mix = each proposer's share of the draft tokens "
              "and its own acceptance (auto); c = the proposers' measured cost per draft token (draft-weighted); "
              "theory = (1 - a^(K+1)) / ((1 - a)(cK + 1)) per proposer with its own a and c, weighted by its passes "
              "(plain passes count 1 token for 1 step); eff = x none / theory; bound = tokens per pass / (drafting "
              "cost + verify cost of the drafts per pass + 1 tokens), the speedup the measured tokens per step allow "
              "at the measured forward costs; x bound = x none / bound (what per-step overhead leaves of it).", ""]
    lines += ["| workload | T | clients | method | tok/s | x none | rounds | accept | first | len | drafts/step | mix "
              "| c | theory | eff | bound | x bound |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=_sort_key):
        lines.append(
            f"| {r['workload']} | {r['temperature']:g} | {r['clients']} | {r['method']} | {r['tokens_per_s']:.1f} "
            f"| {_fmt(r['ratio_to_none'])} | {_spread(r)} | {_fmt(r['acceptance_rate'])} "
            f"| {_fmt(r.get('first_position_acceptance'))} "
            f"| {_fmt(r['mean_accepted_length'])} | {_fmt(r['drafts_per_step'], '.1f')} | {_mix(r)} "
            f"| {_fmt(r['c'], '.3f')} | {_fmt(r['theoretical_speedup'])} "
            f"| {_fmt(r['efficiency'])} | {_fmt(r.get('attainable_speedup'))} | {_fmt(r.get('overhead_efficiency'))} |")
    return "\n".join(lines) + "\n"


def _spread(row: dict[str, Any]) -> str:
    """'lowest-highest ±se' of a cell's per-round ratios to `none` (two rounds or more), else a dash; se
    is the standard error of their mean (standard deviation / sqrt(rounds))."""
    ratios = row.get("round_ratios") or []
    if len(ratios) < 2:
        return "—"
    se = statistics.stdev(ratios) / math.sqrt(len(ratios))
    return f"{min(ratios):.2f}-{max(ratios):.2f} ±{se:.2f}"


def plot(path: Path, rows: list[dict[str, Any]], costs: list[dict[str, Any]], ks: dict[str, int]) -> None:
    """Speedup (x none) against acceptance rate: one panel per client count, colour = workload,
    marker = method (every proposer of the registry, and auto), filled = greedy, hollow = temperature
    0.8; grey curves = the cost model of each proposer at its measured c and K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from bench.theory import theoretical_speedup

    speculative = (*PROPOSERS, "auto")
    points = [r for r in rows if r["method"] in speculative and r["acceptance_rate"] is not None
              and r["ratio_to_none"] is not None]
    clients = sorted({r["clients"] for r in rows if r["method"] in speculative}) or [1]
    workloads = sorted({r["workload"] for r in rows}, key=_sort_key_w)
    colours = dict(zip(workloads, plt.get_cmap("tab10").colors, strict=False))
    markers = dict(zip(speculative, "osDvP<>*", strict=False))
    styles = dict(zip(PROPOSERS, ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))), strict=False))
    cost_by_batch = {c["batch"]: c for c in costs}
    top = max([r["ratio_to_none"] for r in points] + [2.0]) * 1.15
    fig, axes = plt.subplots(1, len(clients), figsize=(5.2 * len(clients), 4.6), sharey=True, squeeze=False)
    grid = [i / 100 for i in range(101)]
    for ax, n in zip(axes[0], clients, strict=True):
        cost = cost_by_batch.get(n)
        if cost:
            for name in PROPOSERS:
                c, k = cost.get(f"c_{name}"), ks.get(name)
                if c is not None and k:
                    ax.plot(grid, [theoretical_speedup(a, k, c) for a in grid], ls=styles.get(name, "-"),
                            color="grey", lw=1.2, label=f"theory {name} (c={c:.2f}, K={k})")
        ax.axhline(1.0, color="black", lw=0.8, label="none (= 1)")
        for r in points:
            if r["clients"] != n:
                continue
            colour = colours[r["workload"]]
            greedy = r["temperature"] == 0
            ax.scatter(r["acceptance_rate"], r["ratio_to_none"], s=70, marker=markers[r["method"]],
                       facecolors=colour if greedy else "none", edgecolors=colour, linewidths=1.6)
        ax.set_title(f"{n} client{'s' if n > 1 else ''}")
        ax.set_xlabel("acceptance rate (accepted / draft tokens)")
        ax.set_xlim(0, 1.02)
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
        if cost:
            ax.legend(loc="upper left", fontsize=8)
    axes[0][0].set_ylabel("speedup: tokens/s ÷ none (same run)")
    handles = [Line2D([], [], marker="o", ls="", color=colours[w], markersize=8, label=w) for w in workloads]
    handles += [Line2D([], [], marker=m, ls="", color="black", markerfacecolor="none", markersize=8, label=name)
                for name, m in markers.items()]
    handles += [Line2D([], [], marker="o", ls="", color="grey", markersize=8, label="greedy (filled)"),
                Line2D([], [], marker="o", ls="", color="grey", markerfacecolor="none", markersize=8,
                       label="T = 0.8 (hollow)")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    fig.suptitle("Speculation speedup vs acceptance rate (Specula over HTTP, SmolLM2-135M)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(out_dir: Path, meta: dict[str, Any], rows: list[dict[str, Any]], costs: list[dict[str, Any]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "results.json", meta, rows, costs)
    (out_dir / "results.md").write_text(markdown(meta, rows, costs))
    ks = meta.get("k") if isinstance(meta.get("k"), dict) else {}
    plot(out_dir / "speedup.png", rows, costs, ks)


def rewrite(json_path: Path) -> None:
    """Recompute derived figures and rewrite all three outputs from a results.json's raw counts."""
    from bench.cells import Cell, CellKey, cost_map, proposers_from_rows, summarize

    data = json.loads(json_path.read_text())
    cells = []
    for r in data["cells"]:
        cell = Cell(CellKey(r["workload"], r["method"], r["clients"], r["temperature"]), k=r["k"])
        cell.add(r["requests"], r["completion_tokens"], r["wall_s"], r["draft_tokens"] or 0,
                 r["accepted_tokens"] or 0, r["decode_steps"] or 0, tuple(r["reported_methods"]),
                 proposers_from_rows(r.get("by_proposer") or {}))
        cell.rounds = {int(i): (int(t), float(w)) for i, (t, w) in (r.get("rounds") or {}).items()}
        cells.append(cell)
    costs = data["costs"]
    write_all(json_path.parent, data["meta"], summarize(cells, cost_map(costs)), costs)


FIGURES_START = "<!-- current figures: rendered by `python -m bench.report --readme` from the ledger -->"
FIGURES_END = "<!-- end of current figures -->"


def _machine_short(entry: dict[str, Any]) -> str:
    """"2 CPUs, load 5.8" (and the GPU, where there was one) from a ledger line's machine summary."""
    text = entry.get("machine", "?")
    cpus = re.match(r"(\d+ CPUs)", text)
    width = re.match(r"\d+ CPUs \([^)]*\b(AVX-512|AVX2)\)", text)
    load = re.search(r"load average ([\d.]+)", text)
    gpu = text.split("; ", 1)[1] if "; " in text else ""
    first = (cpus.group(1) + (f" {width.group(1)}" if width else "")) if cpus else text
    parts = [first, *([gpu] if gpu else []), *([f"load {load.group(1)}"] if load else [])]
    return ", ".join(parts)


def _module(entry: dict[str, Any]) -> str:
    """"bench.run" from a ledger line's command (`[ENV=...] python -m bench.run ...`), else its suite."""
    words = entry.get("command", "").split()
    return next((b for a, b in zip(words, words[1:], strict=False) if a == "-m"), entry["suite"])


def _newest(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest run of each suite per device: suites in order of first appearance, CPU runs first."""
    runs = list(ledger_latest(entries).values())
    return sorted(runs, key=lambda e: e.get("device", "cpu") != "cpu")


def _ratio_text(cell: dict[str, Any]) -> str:
    if cell.get("ratio") is None:
        return "—"
    spread = cell.get("spread")
    se = f" ±{spread['se']:.2f}" if spread and spread.get("se") is not None else ""
    return f"{cell['ratio']:.2f}{se}"


def _figure_label(cell: dict[str, Any]) -> str:
    t = cell.get("temperature", 0.0)
    return f"`{cell['method']}` / `{cell['baseline']}`, " + ("greedy" if not t else f"T = {t:g}")


def readme_table(entries: list[dict[str, Any]]) -> str:
    """The headline cells of the newest run of each suite (per device) as one table: a row per bench,
    workload and figure, a column per client count, and the run each figure comes from."""
    runs = [e for e in _newest(entries) if any(c.get("headline") for c in e["cells"])]
    clients = sorted({c["clients"] for e in runs for c in e["cells"] if c.get("headline")})
    lines = ["| bench | workload | figure (tokens/s ratio, same run) | "
             + " | ".join(f"{n} client{'s' if n > 1 else ''}" for n in clients) + " | measured |",
             "|---|---|---|" + "---:|" * len(clients) + "---|"]
    for e in runs:
        rows: dict[tuple, dict[int, dict[str, Any]]] = {}
        for c in e["cells"]:
            if c.get("headline"):
                rows.setdefault((c["workload"], c.get("temperature", 0.0), c["method"], c["baseline"]), {})[
                    c["clients"]] = c
        bench = f"`{_module(e)}`" + (" on a GPU" if e.get("device") == "cuda" else "")
        when = f"{e['date'][:10]}, `{e['commit']}`, {_machine_short(e)}"
        for (workload, _, _, _), by_clients in rows.items():
            first = next(iter(by_clients.values()))
            cols = " | ".join(_ratio_text(by_clients[n]) if n in by_clients else "—" for n in clients)
            lines.append(f"| {bench} | {workload} | {_figure_label(first)} | {cols} | {when} |")
    return "\n".join(lines) + "\n"


def _values_text(values: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}") if isinstance(v, float) else str(v)

    return ", ".join(f"{k} {fmt(v)}" for k, v in values.items())


def latest_markdown(entries: list[dict[str, Any]]) -> str:
    """LATEST.md: README's table, then every figure of the newest run of each suite (per device)."""
    out = ["# Latest benchmark figures", "",
           f"Rendered by `python -m bench.report --readme` from `bench/results/ledger.jsonl` ({len(entries)} runs): "
           "the newest run of each bench per device, every figure a ratio to its baseline from the same run "
           "(spread: ± the standard error over the run's rounds or prompts). Do not edit by hand; "
           "[docs/bench.md](../../docs/bench.md) says how to run and read each bench.", "",
           "## Current figures (README.md shows this table)", "", FIGURES_START, readme_table(entries).rstrip(),
           FIGURES_END]
    for e in _newest(entries):
        out += ["", f"## {e['suite']} (`{_module(e)}`, {e.get('device', 'cpu')})", "",
                f"Run of {e['date']}, commit `{e['commit']}`{' (with uncommitted changes)' if e.get('dirty') else ''}, "
                f"{e['machine']}.  ", f"Command: `{e['command']}`  "]
        if e.get("files"):
            files = e["files"]
            out.append(f"Files: `{files['path']}`" + (f" at commit `{files['commit']}`" if files.get("commit") else "")
                       + "  ")
        if e.get("note"):
            out.append(f"Note: {e['note']}  ")
        if e.get("figures"):
            out += ["", "Figures: " + _values_text(e["figures"])]
        if e["cells"]:
            out += ["", "| workload | T | clients | method / baseline | ratio | spread (low-high, n) | values |",
                    "|---|---:|---:|---|---:|---|---|"]
            for c in e["cells"]:
                s = c.get("spread")
                spread = f"{s['low']:.2f}-{s['high']:.2f}, {s['n']}" if s else "—"
                out.append(f"| {c['workload']} | {c.get('temperature', 0.0):g} | {c['clients']} "
                           f"| {c['method']} / {c['baseline']} | {_ratio_text(c)} | {spread} "
                           f"| {_values_text(c.get('values') or {})} |")
    return "\n".join(out) + "\n"


def between(text: str, start: str = FIGURES_START, end: str = FIGURES_END) -> str:
    """What lies between the figures markers of a document (ValueError without them)."""
    head, sep, rest = text.partition(start)
    body, sep2, _ = rest.partition(end)
    if not sep or not sep2:
        raise ValueError("no current-figures markers")
    return body.strip("\n") + "\n"


def replace_between(text: str, body: str, start: str = FIGURES_START, end: str = FIGURES_END) -> str:
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    return f"{head}{start}\n{body.rstrip()}\n{end}{tail}"


def write_readme(results: Path | None = None, readme: Path | None = None) -> None:
    """LATEST.md from the ledger, and README.md's current-figures table from LATEST.md."""
    from bench.ledger import REPO, write_latest

    text = write_latest(results)
    path = readme or REPO / "README.md"
    path.write_text(replace_between(path.read_text(encoding="utf-8"), between(text)), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    p.add_argument("results_json", nargs="?", type=Path, help="a bench.run results.json to rewrite its reports from")
    p.add_argument("--readme", action="store_true",
                   help="render bench/results/LATEST.md from the ledger and README.md's current-figures table")
    args = p.parse_args(argv)
    if args.readme:
        write_readme()
    if args.results_json is not None:
        rewrite(args.results_json)
    if not args.readme and args.results_json is None:
        p.error("give --readme, a results.json, or both")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
