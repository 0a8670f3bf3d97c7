"""`jaxserve bench compare a.json b.json ...`: result files side by side, with ratios to the first."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

# (key in a serve run's metrics, label, higher is better)
SERVE_METRICS = (
    ("output_throughput", "output tok/s", True),
    ("request_throughput", "req/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_itl_ms", "ITL p50 ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("median_e2el_ms", "E2EL p50 ms", False),
    ("failed", "failed", False),
)
OFFLINE_METRICS = (
    ("output_tok_s", "output tok/s", True),
    ("decode_step_s", "decode step s", False),
    ("host_share", "host share", False),
)


def load_result(path: str | Path) -> dict:
    with open(path) as f:
        return json.load(f)


def entries(result: dict) -> dict[str, dict[str, float]]:
    """The comparable rows of one result: a key naming the conditions -> metric values."""
    out: dict[str, dict[str, float]] = {}
    if result.get("kind") == "serve":
        wl = result["workload"]["name"]
        size = _workload_size(result["workload"])
        for run in result["runs"]:
            key = f"{wl} | conc {run['max_concurrency'] or 'inf'} | rate {run['request_rate']}{size}"
            out[key] = {k: run["metrics"].get(k) for k, _, _ in SERVE_METRICS}
    elif result.get("kind") == "offline":
        if result.get("batch1"):
            out["offline | batch 1"] = {k: result["batch1"].get(k) for k, _, _ in OFFLINE_METRICS}
        for run in result["runs"]:
            out[f"offline | conc {run['concurrency']}"] = {k: run.get(k) for k, _, _ in OFFLINE_METRICS}
    else:
        raise ValueError(f"not a bench result (kind {result.get('kind')!r})")
    return out


def _workload_size(wl: dict) -> str:
    """' | N requests x M tokens' when the workload says so: runs of different sizes never share a row."""
    n = wl.get("num_prompts")
    if wl.get("name") == "shared-prefix" and "gsp_num_groups" in wl:
        n = wl["gsp_num_groups"] * wl["gsp_prompts_per_group"]
    if n is None or wl.get("output_len") is None:
        return ""
    return f" | {n} requests x {wl['output_len']} tokens"


def merged_entries(results: Sequence[dict], names: Sequence[str]) -> tuple[list[str], list[dict]]:
    """Entries per distinct name, in first-seen order: results that share a name form one column (for
    example one concurrency per file). Two results of one name with the same condition are refused."""
    cols: list[str] = []
    per: dict[str, dict[str, dict[str, float]]] = {}
    for name, result in zip(names, results, strict=True):
        if name not in per:
            cols.append(name)
            per[name] = {}
        for key, row in entries(result).items():
            if key in per[name]:
                raise ValueError(f"{name}: two results for {key!r}; give them different --names")
            per[name][key] = row
    return cols, [per[c] for c in cols]


def _fmt(v: float | None) -> str:
    if v is None or v != v:
        return "-"
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 1:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 1 else f"{v:,.1f}"


def compare_table(results: Sequence[dict], names: Sequence[str] | None = None) -> str:
    """A text table: one block per condition, one row per metric, one column per name (results that
    share a name are merged) with its ratio to the first column (>1 means more of the metric; the better
    direction is marked per metric)."""
    names = list(names or [r.get("system") or f"#{i}" for i, r in enumerate(results)])
    first_result = {}
    for n, r in zip(names, results, strict=True):
        first_result.setdefault(n, r)
    names, per = merged_entries(results, names)
    keys: list[str] = []
    for e in per:
        keys += [k for k in e if k not in keys]
    metric_defs = {k: (label, hi) for k, label, hi in SERVE_METRICS + OFFLINE_METRICS}
    width = max(14, *(len(n) + 10 for n in names))
    lines = []
    for key in keys:
        if lines:
            lines.append("")
        lines.append(key)
        lines.append(f"{'metric':<16}" + "".join(f"{n:>{width}}" for n in names))
        metric_keys: list[str] = []
        for e in per:
            metric_keys += [m for m in e.get(key, {}) if m not in metric_keys]
        for m in metric_keys:
            label, higher = metric_defs[m]
            base = per[0].get(key, {}).get(m)
            cells = []
            for i, e in enumerate(per):
                v = e.get(key, {}).get(m)
                cell = _fmt(v)
                if i and v is not None and base not in (None, 0) and v == v and base == base:
                    cell += f" ({v / base:.2f}x)"
                cells.append(f"{cell:>{width}}")
            arrow = "^" if higher else "v"
            lines.append(f"{label + ' ' + arrow:<16}" + "".join(cells))
    settings = []
    for n in names:
        r = first_result[n]
        mach = r.get("machine", {})
        load = mach.get("load_average")
        load = " ".join(f"{x:.1f}" for x in load) if load else load
        settings.append(f"{n}: {mach.get('usable_cores')} cores, threads env {mach.get('threads_env') or {}}, "
                        f"load avg (1/5/15 min) {load}")
    return "\n".join(lines) + "\n\n" + "\n".join(settings)
