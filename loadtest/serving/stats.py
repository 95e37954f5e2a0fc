"""Summaries of a run: percentiles of TTFT / TPOT / ITL / e2e (overall and by tier), throughput, goodput
under an SLO, and failures by reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.serving.client import RequestResult, RunResult

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class SLO:
    ttft_p95_s: float = 1.0
    tpot_p95_s: float = 0.1

    def met_by(self, result: RequestResult) -> bool:
        """Per request: its own TTFT and TPOT within the SLO's bounds (goodput counts these)."""
        tpot = result.tpot_s
        return (result.ok and result.ttft_s is not None and result.ttft_s <= self.ttft_p95_s
                and (tpot is None or tpot <= self.tpot_p95_s))


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    data = np.asarray([v for v in values if v is not None], dtype=float)
    return {f"p{p}": (float(np.percentile(data, p)) if data.size else None) for p in PERCENTILES} | {
        "mean": float(data.mean()) if data.size else None}


def latency_summary(results: Sequence[RequestResult]) -> dict[str, dict[str, float | None]]:
    ok = [r for r in results if r.ok]
    return {
        "ttft_s": percentiles(r.ttft_s for r in ok),
        "tpot_s": percentiles(r.tpot_s for r in ok),
        "itl_s": percentiles(gap for r in ok for gap in r.itl_s),
        "e2e_s": percentiles(r.e2e_s for r in ok),
    }


def summarize(run: RunResult, slo: SLO) -> dict:
    results = run.results
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if slo.met_by(r)]
    return {
        "endpoint": run.endpoint,
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": run.duration_s,
        "request_throughput": len(ok) / run.duration_s if run.duration_s else 0.0,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tok_s": output_tokens / run.duration_s if run.duration_s else 0.0,
        # > 1 when a server sends several tokens in one streamed event (coalescing)
        "tokens_per_event": output_tokens / max(1, sum(len(r.chunk_times_s) for r in ok)),
        "goodput_req_s": len(good) / run.duration_s if run.duration_s else 0.0,
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "latency": latency_summary(results),
        "by_tier": {tier: latency_summary([r for r in results if r.tier == tier])
                    for tier in sorted({r.tier for r in results})},
    }


def time_series(run: RunResult, bucket_s: float = 1.0) -> dict[str, list[float]]:
    """Output chunks per second and requests in flight (client view), per `bucket_s` bucket."""
    num_buckets = max(1, int(np.ceil(run.duration_s / bucket_s)))
    chunks = np.zeros(num_buckets)
    in_flight = np.zeros(num_buckets)
    for r in run.results:
        for t in r.chunk_times_s:
            chunks[min(num_buckets - 1, int(t / bucket_s))] += 1
        end = r.sent_s + (r.e2e_s or 0.0)
        first, last = int(r.sent_s / bucket_s), min(num_buckets - 1, int(end / bucket_s))
        in_flight[first:last + 1] += 1
    return {"t_s": [i * bucket_s for i in range(num_buckets)], "chunks_per_s": list(chunks / bucket_s),
            "in_flight": list(in_flight)}
