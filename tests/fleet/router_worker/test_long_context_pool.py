"""The long-context pool with real processes (`flotilla up --long-context-workers 1`'s LocalFleet): a router with a
threshold, one default worker and one long-context worker of the same tiny checkpoint. Long prompts land on the
long-context worker, short ones on the default worker while the long-context one runs a long prompt (a short one
waits for the default worker then), and borrow it once it is idle; greedy output is the default worker's own (a
single-pool run); the router's metrics count placements and waiters by pool."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from flotilla.rpc.convert import new_request_to_proto
from flotilla.rpc.leases import LeaseSigner, read_secret

from tests.support.fleet import fleet_config, start_fleet
from tests.support.tls import channel
from tests.support.waiting import wait_until

THRESHOLD = 48
LONG_PROMPT = [(7 * i + 3) % 200 + 5 for i in range(100)]
SHORT_PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
DEFAULT_WORKER, LONG_WORKER = "worker-0", "worker-1"  # LocalFleet starts default workers first
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
HOLD = SamplingParams(max_tokens=1800, temperature=0.0, ignore_eos=True)  # runs until cancelled


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint, tmp_path_factory):
    config = fleet_config(
        tiny_checkpoint, tmp_path_factory.mktemp("long-context"), num_workers=1, num_long_context_workers=1,
        long_context_threshold=THRESHOLD,
        # One request per worker: a busy worker is full, which is what makes lending (or not) observable.
        router_args=["--max-requests-per-worker", "1", "--idle-tenant-extra-slots", "0", "--max-queue-wait-s", "60"],
        worker_args=["--device", "cpu", "--num-kv-blocks", "320", "--block-size", "16"],
        long_context_worker_args=["--max-num-batched-tokens", "32"],  # its prefill of a long prompt: chunked
    )
    with start_fleet(config) as running:
        yield running


def request(request_id: str, prompt: list[int], params: SamplingParams) -> pb.GenerateRequest:
    return new_request_to_proto(NewRequest(request_id, tuple(prompt), params), "flotilla-tiny")


def run(stub, generate_request) -> tuple[list[int], str]:
    """(tokens, worker id) of a whole generation."""
    events = list(stub.Generate(generate_request, timeout=120))
    assert events[-1].HasField("finished"), events[-1]
    return [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids], events[-1].worker_id


class Held:
    """A generation kept running (its first token read) until release()."""

    def __init__(self, stub, generate_request):
        self.call = stub.Generate(generate_request, timeout=120)
        self.worker_id = next(self.call).worker_id

    def release(self) -> None:
        self.call.cancel()


def router(fleet):
    return router_pb2_grpc.RouterServiceStub(channel(fleet.fleet.router_address, client_role="gateway"))


def sample(fleet, name: str, **labels: str) -> float:
    return sum(s.value for s in fleet.metric_samples("router")
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_workers_register_in_their_pools_and_an_unknown_pool_is_refused(fleet):
    pools = {worker_id: status.worker.pool for worker_id, status in fleet.router_workers().items()}
    assert pools == {DEFAULT_WORKER: "", LONG_WORKER: "long-context"}
    as_worker = router_pb2_grpc.RouterServiceStub(channel(fleet.fleet.router_address, client_role="worker"))
    info = rpb.WorkerInfo(worker_id="w-odd", address="127.0.0.1:9", pool="huge",
                          model=pb.ModelInfo(name="flotilla-tiny", version="v1"))
    with pytest.raises(grpc.RpcError) as err:
        as_worker.RegisterWorker(rpb.RegisterWorkerRequest(worker=info), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown pool 'huge'" in err.value.details()


def test_long_and_short_prompts_land_in_their_pools_with_single_pool_output(fleet):
    stub = router(fleet)
    worker = fleet.fleet.workers[0]
    secret = read_secret(Path(fleet.state_dir) / "lease-secret")  # the worker serves only leased streams

    def leased(generate_request: pb.GenerateRequest) -> pb.GenerateRequest:
        generate_request.lease.CopyFrom(LeaseSigner(secret, 30.0).grant(generate_request.request_id, DEFAULT_WORKER,
                                                                         worker.address, generate_request.model))
        return generate_request

    with channel(worker.address, "worker") as worker_channel:  # the default worker alone
        direct = worker_pb2_grpc.WorkerServiceStub(worker_channel)
        expected_long, _ = run(direct, leased(request("ref-long", LONG_PROMPT, GREEDY)))
        expected_short, _ = run(direct, leased(request("ref-short", SHORT_PROMPT, GREEDY)))
    wait_until(lambda: all(s.load.num_running + s.load.num_waiting == 0 for s in fleet.router_workers().values()),
               10, "the router to see both workers idle (a full default worker would lend the short prompt out)")
    # One at a time, on an idle fleet: each goes to its own pool (the default worker's prefix cache makes the
    # long-context worker the one with more free blocks: without pools the short prompt would go there).
    for i in range(2):
        assert run(stub, request(f"short-{i}", SHORT_PROMPT, GREEDY)) == (expected_short, DEFAULT_WORKER)
        assert run(stub, request(f"long-{i}", LONG_PROMPT, GREEDY)) == (expected_long, LONG_WORKER)
    assert sample(fleet, "flotilla_router_placements_total", pool="long-context", prompt="long") >= 1


def test_short_prompts_wait_for_the_default_pool_while_the_long_pool_runs_a_long_prompt(fleet):
    stub = router(fleet)
    long_one = Held(stub, request("held-long", LONG_PROMPT, HOLD))
    short_one = Held(stub, request("held-short", SHORT_PROMPT, HOLD))
    assert (long_one.worker_id, short_one.worker_id) == (LONG_WORKER, DEFAULT_WORKER)
    result: dict[str, tuple[list[int], str]] = {}
    waiting = threading.Thread(target=lambda: result.setdefault("short", run(stub, request("s2", SHORT_PROMPT,
                                                                                         GREEDY))))
    try:
        waiting.start()
        # Both workers are full; the long-context one is not lent while it runs a long prompt: the short one waits.
        wait_until(lambda: sample(fleet, "flotilla_router_pool_queue_depth", pool="default") == 1, 30,
                   "the short request to wait for the default pool", interval_s=0.05)
        assert not result
        long_one.release()  # the long-context worker is idle now: the waiting short prompt borrows it
        waiting.join(60)
        assert result["short"][1] == LONG_WORKER
    finally:
        long_one.release()
        short_one.release()
        waiting.join(60)
    assert sample(fleet, "flotilla_router_placements_total", pool="long-context", prompt="short") >= 1


def test_a_long_prompt_never_lands_on_the_default_pool_even_when_it_is_idle(fleet):
    stub = router(fleet)
    long_one = Held(stub, request("held-long-2", LONG_PROMPT, HOLD))
    result: dict[str, tuple[list[int], str]] = {}
    waiting = threading.Thread(target=lambda: result.setdefault("long", run(stub, request("l2", LONG_PROMPT,
                                                                                        GREEDY))))
    try:
        assert long_one.worker_id == LONG_WORKER
        waiting.start()
        wait_until(lambda: sample(fleet, "flotilla_router_pool_queue_depth", pool="long-context") == 1, 30,
                   "the second long request to wait for the long-context pool", interval_s=0.05)
        assert run(stub, request("s3", SHORT_PROMPT, GREEDY))[1] == DEFAULT_WORKER  # not held up behind it
        assert not result
        long_one.release()
        waiting.join(60)
        assert result["long"][1] == LONG_WORKER
    finally:
        long_one.release()
        waiting.join(60)


def test_cancelled_streams_do_not_leak_into_the_pool_counts(fleet):
    wait_until(lambda: sample(fleet, "flotilla_router_pool_inflight_requests") == 0, 30,
               "every placement released", interval_s=0.05)
    held = Held(router(fleet), request("cancel-me", LONG_PROMPT, HOLD))
    assert sample(fleet, "flotilla_router_pool_inflight_requests", pool="long-context", prompt="long") == 1
    held.release()
    wait_until(lambda: sample(fleet, "flotilla_router_pool_inflight_requests") == 0, 30,
               "the cancelled long request released", interval_s=0.05)
