"""Histogram buckets shared by every service, so that the same latency means the same bucket everywhere."""

from __future__ import annotations

# Request-scale latencies: TTFT, end-to-end, queue wait (5 ms .. 2 min).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Token-scale latencies: TPOT, inter-token (1 ms .. 5 s).
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
# Bytes moved per KV transfer (4 KiB .. 4 GiB).
BYTES_BUCKETS = tuple(float(4 << (10 + 2 * i)) for i in range(11))
