"""--engine-cpus: the engine thread on its CPUs, every other thread of the worker on the rest; it still serves."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.engine.cpu_layout import other_cpus, parse_cpu_list

from tests.support.fleet import NO_OUTPUT_CHECK, start_service

needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0,2") == {0, 2}
    assert parse_cpu_list("1-3,5") == {1, 2, 3, 5}
    for bad in ("", "a", "1-", "-1", "0;1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_the_engine_may_not_take_every_cpu_or_one_the_process_lacks():
    available = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="leave none"):
        other_cpus(available)
    with pytest.raises(ValueError, match="not all among"):
        other_cpus({max(available) + 1})


def _thread_masks(pid: int) -> list[frozenset[int]]:
    masks = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            masks.append(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:
            pass
    return masks


@needs_two_cpus
def test_a_worker_puts_its_engine_thread_alone_on_the_engine_cpus_and_serves(tiny_checkpoint: Path, tmp_path: Path):
    engine_cpu = min(os.sched_getaffinity(0))
    rest = frozenset(os.sched_getaffinity(0)) - {engine_cpu}
    worker = start_service(tmp_path, "worker", "worker", "--model-dir", str(tiny_checkpoint), "--insecure-internal",
                           "--engine-cpus", str(engine_cpu), *NO_OUTPUT_CHECK,
                           env={"OMP_NUM_THREADS": "1"})  # one engine thread, no torch pool beside it
    try:
        masks = _thread_masks(worker.pid)
        assert masks.count(frozenset({engine_cpu})) == 1, masks  # the engine thread
        assert all(mask == rest for mask in masks if mask != {engine_cpu}), masks  # gRPC, the loop, the rest
        request = pb.GenerateRequest(request_id="r1", model="", prompt_token_ids=[1, 2, 3],
                                     sampling=pb.SamplingParams(max_tokens=4, temperature=0.0))
        with grpc.insecure_channel(worker.address) as channel:
            responses = list(worker_pb2_grpc.WorkerServiceStub(channel).Generate(request, timeout=30))
        tokens = [t for response in responses if response.HasField("chunk") for t in response.chunk.token_ids]
        assert len(tokens) == 4 and responses[-1].HasField("finished")
    finally:
        worker.stop()
