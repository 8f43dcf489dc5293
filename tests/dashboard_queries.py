"""Read the Grafana dashboard's PromQL and find the metric names each query uses."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARDS = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards"
DASHBOARD = DASHBOARDS / "specula.json"
VLLM_DASHBOARD = DASHBOARDS / "vllm.json"  # vLLM's dashboard, provisioned beside ours

# PromQL words that are not metric names: functions, aggregations, operators and modifiers.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values",
    "group", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "scalar",
    "vector", "abs", "clamp_min", "clamp_max", "clamp", "label_replace", "label_join", "sort", "sort_desc",
    "time", "timestamp", "absent", "changes", "resets", "avg_over_time", "max_over_time", "min_over_time",
    "sum_over_time", "count_over_time", "last_over_time", "round", "ceil", "floor", "ln", "log2", "exp",
    "label_values", "inf", "nan",
}  # fmt: skip


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, including those nested in collapsed rows."""
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression: panel targets and query-type template variables."""
    exprs = [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (label matchers, ranges, grouping lists and strings removed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", "", s)
    s = re.sub(r"\[[^\]]*\]", "", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    # label_values(metric, label): the second argument is a label name; label_values(label) names no metric.
    s = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", s)
    s = re.sub(r"label_values\(\s*\w+\s*\)", " ", s)
    words = re.findall(r"(?<![\w$.])[a-zA-Z_:][\w:]*", s)
    return {w for w in words if w.lower() not in PROMQL_WORDS}


def for_prometheus(expr: str, rate_window: str = "1m") -> str:
    """Substitute Grafana's variables so Prometheus itself can evaluate the expression."""
    expr = expr.replace("$__rate_interval", rate_window).replace("$__interval", rate_window)
    return re.sub(r"\$\w+", ".*", expr)
