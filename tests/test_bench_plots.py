"""Charts of serve results (skipped when matplotlib, an optional dependency, is not installed)."""

from __future__ import annotations

import pytest

from bench.metrics import RequestRecord, compute_metrics


def _result(system: str, concs: list[int]) -> dict:
    runs = []
    for c in concs:
        reqs = [RequestRecord(True, 10, 4, start=0.01 * i, ttft=0.05 * c, itl=[0.01, 0.02, 0.03], latency=0.2 * c)
                for i in range(5)]
        runs.append({"max_concurrency": c, "request_rate": "inf", "metrics": compute_metrics(reqs, 1.0),
                     "requests": [r.to_dict() for r in reqs]})
    return {"kind": "serve", "system": system, "workload": {"name": "fixed"}, "runs": runs}


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plots import plot_results

    files = plot_results([_result("a", [1, 8]), _result("b", [1, 8])], tmp_path)
    assert sorted(f.name for f in files) == ["fixed-itl-cdf.png", "fixed-ttft-cdf.png", "fixed-vs-concurrency.png"]
    assert all(f.stat().st_size > 1000 and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)
