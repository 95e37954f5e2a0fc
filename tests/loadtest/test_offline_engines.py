"""The fleet benchmark's offline baseline: engines in child processes, each with its share of the prompts."""

from __future__ import annotations

from loadtest.common.engine_workload import Workload
from loadtest.common.offline_engines import OfflineEngines


def test_every_process_generates_its_share_in_every_round(tiny_checkpoint):
    # 5 prompts over 2 processes: shares of 3 and 2
    workload = Workload([[5 + i, 6, 7 + i] for i in range(5)], [3, 4, 5, 6, 7])
    with OfflineEngines(tiny_checkpoint, workload, num_processes=2, threads=1, concurrency=4) as engines:
        for _ in range(2):  # the engines stay up between rounds
            tokens_per_s, num_tokens = engines.round()
            assert num_tokens == workload.num_output_tokens and tokens_per_s > 0  # ignore_eos: both shares, whole
