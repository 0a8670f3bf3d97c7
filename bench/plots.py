"""PNG charts of bench results with matplotlib, when it is installed (it is optional)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def _conc(run: dict) -> str:
    return str(run["max_concurrency"] or "inf")


def plot_results(results: Sequence[dict], outdir: str | Path, names: Sequence[str] | None = None) -> list[Path]:
    """TTFT and ITL distributions (one curve per system and concurrency) and output throughput, TTFT p50
    and ITL p50 against concurrency, for serve results; returns the files written."""
    plt = _pyplot()
    import numpy as np

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    names = list(names or [r.get("system") or f"#{i}" for i, r in enumerate(results)])
    serve = [(n, r) for n, r in zip(names, results, strict=True) if r.get("kind") == "serve"]
    written: list[Path] = []
    workloads = sorted({r["workload"]["name"] for _, r in serve})
    for wl in workloads:
        mine = [(n, r) for n, r in serve if r["workload"]["name"] == wl]
        for key, title in (("ttft", "time to first token"), ("itl", "inter-token latency")):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for n, r in mine:
                for run in r["runs"]:
                    reqs = [q for q in run.get("requests", []) if q["success"]]
                    vals = [q["ttft"] for q in reqs] if key == "ttft" else [g for q in reqs for g in q["itl"]]
                    if not vals:
                        continue
                    v = np.sort(np.asarray(vals) * 1000.0)
                    ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{n}, conc {_conc(run)}")
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
            ax.set_xlabel(f"{key.upper()} (ms, log scale)")
            ax.set_ylabel("fraction of " + ("requests" if key == "ttft" else "gaps"))
            ax.set_title(f"{title}: CDF ({wl})")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            path = outdir / f"{wl}-{key}-cdf.png"
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for n, r in mine:
            runs = sorted(r["runs"], key=lambda x: x["max_concurrency"] or 1 << 30)
            xs = [x["max_concurrency"] or x["metrics"]["max_concurrent_requests"] for x in runs]
            for ax, (k, label) in zip(axes, (("output_throughput", "output tokens/s"),
                                             ("median_ttft_ms", "TTFT p50 (ms)"), ("median_itl_ms", "ITL p50 (ms)")), strict=True):
                ax.plot(xs, [x["metrics"][k] for x in runs], marker="o", label=n)
                ax.set_xlabel("max concurrency")
                ax.set_ylabel(label)
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs, [str(x) for x in xs])
                ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"against concurrency ({wl})")
        fig.tight_layout()
        path = outdir / f"{wl}-vs-concurrency.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
