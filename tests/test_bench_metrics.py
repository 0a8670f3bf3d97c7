"""Bench metric arithmetic on synthetic timings, checked by hand; arrivals; the compare table."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from bench.compare import compare_table
from bench.metrics import RequestRecord, compute_metrics, is_good, parse_slos, peak_concurrency
from bench.serve import arrival_offsets


def records() -> list[RequestRecord]:
    return [
        # TPOT (1.0 - 0.1) / (10 - 1) = 0.1 s
        RequestRecord(True, prompt_len=5, output_len=10, start=0.0, ttft=0.1, itl=[0.05] * 4 + [0.14] * 5,
                      latency=1.0),
        # TPOT (0.5 - 0.3) / (3 - 1) = 0.1 s
        RequestRecord(True, prompt_len=6, output_len=3, start=0.5, ttft=0.3, itl=[0.1, 0.1], latency=0.5),
        # one output token: no TPOT, no ITL
        RequestRecord(True, prompt_len=7, output_len=1, start=1.0, ttft=0.2, itl=[], latency=0.2),
        RequestRecord(False, prompt_len=100, output_len=0, start=0.0, error="HTTP 500"),
    ]


def test_counts_and_throughputs():
    m = compute_metrics(records(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 18  # the failed request's prompt does not count
    assert m["total_output_tokens"] == 14
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(7.0)
    assert m["total_token_throughput"] == pytest.approx(16.0)
    assert "goodput" not in m


def test_latency_statistics_in_ms():
    m = compute_metrics(records(), duration_s=2.0)
    # TTFT 100, 300, 200 ms
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # linear: 200 + 0.8 * 100
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    assert m["std_ttft_ms"] == pytest.approx(statistics.pstdev([100, 200, 300]))
    # TPOT: two requests, both 100 ms; the one-token request has none
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["p99_tpot_ms"] == pytest.approx(100.0)
    # ITL: every gap of every request: 4 x 50, 7 x 100/140 ...
    gaps = [50] * 4 + [140] * 5 + [100, 100]
    assert m["mean_itl_ms"] == pytest.approx(sum(gaps) / len(gaps))
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99_itl_ms"] == pytest.approx(140.0)
    # E2EL 1000, 500, 200
    assert m["mean_e2el_ms"] == pytest.approx(1700 / 3)
    assert m["median_e2el_ms"] == pytest.approx(500.0)


def test_goodput_counts_requests_meeting_every_slo():
    rs = records()
    # TTFT <= 250 ms: the first and the third
    assert compute_metrics(rs, 2.0, {"ttft": 250})["goodput"] == pytest.approx(1.0)
    # and TPOT <= 50 ms: only the third (no TPOT counts as 0)
    assert compute_metrics(rs, 2.0, {"ttft": 250, "tpot": 50})["goodput"] == pytest.approx(0.5)
    assert not is_good(rs[3], {})  # a failed request is never good
    assert compute_metrics(rs, 2.0, {"e2el": 600})["goodput"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        compute_metrics(rs, 2.0, {"itl": 5})


def test_peak_concurrency_ends_before_starts_at_the_same_time():
    rs = records()[:3]  # [0, 1.0], [0.5, 1.0], [1.0, 1.2]
    assert peak_concurrency(rs) == 2
    assert compute_metrics(rs, 2.0)["max_concurrent_requests"] == 2
    assert peak_concurrency([RequestRecord(True, start=0.0, latency=1.0) for _ in range(5)]) == 5


def test_empty_and_all_failed_runs_report_zeros():
    m = compute_metrics([RequestRecord(False, error="x")], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["output_throughput"] == 0.0


def test_parse_slos():
    assert parse_slos(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_slos(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_record_round_trips_through_a_dict():
    r = records()[0]
    assert RequestRecord.from_dict(r.to_dict()) == r
    assert r.tpot == pytest.approx(0.1)


def test_arrivals_all_at_once_and_poisson():
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    t = arrival_offsets(4000, 20.0, 1.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(t)]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.05, rel=0.06)
    # Exponential gaps: the coefficient of variation is 1; a gamma of shape 4 has 1/2.
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.08)
    t4 = arrival_offsets(4000, 20.0, 4.0, seed=1)
    g4 = [b - a for a, b in itertools.pairwise(t4)]
    assert statistics.fmean(g4) == pytest.approx(0.05, rel=0.06)
    assert statistics.pstdev(g4) / statistics.fmean(g4) == pytest.approx(0.5, abs=0.05)
    assert arrival_offsets(10, 20.0, 1.0, seed=3) == arrival_offsets(10, 20.0, 1.0, seed=3)


def _serve_result(system: str, tput: float, ttft: float) -> dict:
    metrics = {"output_throughput": tput, "median_ttft_ms": ttft, "failed": 0}
    return {"kind": "serve", "system": system, "workload": {"name": "fixed"}, "machine": {},
            "runs": [{"max_concurrency": 8, "request_rate": "inf", "metrics": metrics}]}


def test_compare_table_ratios_to_the_first():
    table = compare_table([_serve_result("ours", 100.0, 50.0), _serve_result("peer", 250.0, 25.0)])
    assert "fixed | conc 8 | rate inf" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("output tok/s"))
    assert " 100 " in line and "250 (2.50x)" in line
    line = next(ln for ln in table.splitlines() if ln.startswith("TTFT p50"))
    assert "(0.50x)" in line
    with pytest.raises(ValueError):
        compare_table([{"kind": "other"}])


def test_compare_table_merges_results_of_one_name_and_shows_sizes():
    def result(system: str, conc: int, n: int, tput: float) -> dict:
        r = _serve_result(system, tput, 10.0)
        r["workload"] = {"name": "fixed", "num_prompts": n, "output_len": 128}
        r["runs"][0]["max_concurrency"] = conc
        return r

    # Concurrency 1 with 8 requests and concurrency 8 with 32, one file each, per side.
    files = [result("a", 1, 8, 10.0), result("a", 8, 32, 80.0), result("b", 1, 8, 20.0), result("b", 8, 32, 40.0)]
    table = compare_table(files, ["a", "a", "b", "b"])
    header = [ln for ln in table.splitlines() if ln.startswith("metric")]
    assert len(header) == 2 and all(ln.split() == ["metric", "a", "b"] for ln in header)
    blocks = table.split("\n\n")
    assert blocks[0].startswith("fixed | conc 1 | rate inf | 8 requests x 128 tokens")
    assert blocks[1].startswith("fixed | conc 8 | rate inf | 32 requests x 128 tokens")
    tput = [ln for ln in table.splitlines() if ln.startswith("output tok/s")]
    assert "20 (2.00x)" in tput[0] and "40 (0.50x)" in tput[1]
    with pytest.raises(ValueError, match="two results"):
        compare_table([files[0], files[0]], ["a", "a"])
