"""The Markdown report and its PNG plots: latency CDFs, throughput and requests in flight over time; one
column or curve per endpoint, so that an A/B run reads side by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.serving.client import RunResult  # noqa: E402
from loadtest.serving.stats import SLO, summarize, time_series  # noqa: E402

METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))


def write_report(directory: Path, runs: Sequence[RunResult], slo: SLO, title: str, workload: str) -> Path:
    """Writes report.md and the plots into `directory`; returns the Markdown file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(run, slo) for run in runs]
    plots = [plot_cdfs(directory / "latency_cdf.png", runs), plot_over_time(directory / "over_time.png", runs)]
    lines = [f"# {title}", "", f"Workload: {workload}", "",
             f"SLO: TTFT <= {slo.ttft_p95_s * 1000:.0f} ms and TPOT <= {slo.tpot_p95_s * 1000:.0f} ms per request "
             "(goodput counts the requests that meet both).", ""]
    lines += _overview_table(summaries) + [""]
    for summary in summaries:
        lines += [f"## {summary['endpoint']}", "", "| tier | metric | p50 ms | p95 ms | p99 ms |",
                  "| --- | --- | ---: | ---: | ---: |"]
        for tier, latency in {"all": summary["latency"], **summary["by_tier"]}.items():
            for key, label in METRICS:
                row = latency[key]
                lines.append(f"| {tier} | {label} | " + " | ".join(_ms(row[f"p{p}"]) for p in (50, 95, 99)) + " |")
        errors = ", ".join(f"{reason}: {n}" for reason, n in sorted(summary["errors"].items())) or "none"
        lines += ["", f"Failures by reason: {errors}", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    path = directory / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _overview_table(summaries: list[dict]) -> list[str]:
    rows = ["| endpoint | requests | ok | errors | req/s | output tok/s | goodput req/s | SLO met | TTFT p95 ms "
            "| TPOT p95 ms |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summaries:
        rows.append(f"| {s['endpoint']} | {s['num_requests']} | {s['num_ok']} | {s['num_errors']} "
                    f"| {s['request_throughput']:.2f} | {s['output_tok_s']:.1f} | {s['goodput_req_s']:.2f} "
                    f"| {s['slo_attainment']:.0%} | {_ms(s['latency']['ttft_s']['p95'])} "
                    f"| {_ms(s['latency']['tpot_s']['p95'])} |")
    return rows


def plot_cdfs(path: Path, runs: Sequence[RunResult]) -> Path:
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.2))
    for ax, (key, label) in zip(axes, METRICS):
        for run in runs:
            values = _values(run, key)
            if values.size:
                ax.plot(np.sort(values) * 1000, np.linspace(0, 1, values.size), label=run.endpoint)
        ax.set(title=f"{label} CDF", xlabel="ms", ylabel="share of requests" if key == "ttft_s" else None)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_over_time(path: Path, runs: Sequence[RunResult]) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    for run in runs:
        series = time_series(run)
        top.plot(series["t_s"], series["chunks_per_s"], label=run.endpoint)
        bottom.plot(series["t_s"], series["in_flight"], label=run.endpoint)
    top.set(ylabel="output chunks / s", title="Throughput and requests in flight over time")
    bottom.set(ylabel="requests in flight", xlabel="seconds since start")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _values(run: RunResult, key: str) -> np.ndarray:
    ok = [r for r in run.results if r.ok]
    if key == "itl_s":
        return np.asarray([g for r in ok for g in r.itl_s], dtype=float)
    return np.asarray([v for r in ok if (v := getattr(r, key)) is not None], dtype=float)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"
