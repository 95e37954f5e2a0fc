"""The operator's scale-down path end to end: the real kopf operator against kmock, a real router, and three
real worker processes (tiny random model) standing for the pool's pods, holding streams. The pool goes
3 -> 1 (its minimum lowered to 0: the light load fits one replica) and then 1 -> 0 (no new request for its
idle time), with streams started before each step that outlast the step's decision. Every stream finishes on
the worker it started on; the victims are drained in the router first, get the lowest pod-deletion-cost, and
the Deployment's replicas drop only once the workers hold nothing: the pods then go at once and their workers
stop with no shutdown grace, so a stream still on one would be cut (and show as moved to another worker or
failed). A victim may go before the streams' last tokens reach the client: they left the worker already and
are on their way through the router."""

from __future__ import annotations

import asyncio
import copy

import kmock
import kopf

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from flotilla.operator.config import OperatorConfig
from flotilla.operator.handlers import register_handlers
from flotilla.operator.manifests import DRAINED_DELETION_COST
from flotilla.rpc.convert import new_request_to_proto

from tests.support.tls import aio_test_channel
from tests.support.waiting import async_wait_until
from .conftest import MODEL
from .kopf_run import start_operator
from .pod_workers import PodReplicaSet, start_worker
from .test_operator_kmock import OPERATOR_TLS, POOL, _get

POOL_NAME = "tiny-pool"
PODS = [f"{POOL_NAME}-workers-5d8c7-{suffix}" for suffix in ("a", "b", "c")]
POOL_KEY = (kmock.resource("flotilla.dev/v1alpha1/flotillapools"), "ns1", POOL_NAME)
# The streams must outlast the operator's reactions, whatever the engine's speed: the first ones its reaction to the
# patch (about 1-1.4 s), the second ones the rest of the first plus the idle time and the reaction. On the tiny
# model (2,048 positions) 800 and 1,900 tokens took ~4 and ~9 s on one VM, and on a faster one with the oneDNN
# linears ~1.5 s: one worker's first streams all ended before its drain under the full suite's load. The small
# model's steps are bound by reading its 380 MB of weights, not by per-step overhead, so their time varies less
# between machines: ~12 ms a token at two sequences here, so ~4 s and ~9 s again, with 4,096 positions to spare.
FIRST_TOKENS, SECOND_TOKENS = 300, 700
TIMEOUT_S = 90.0


def pool_body() -> dict:
    body = copy.deepcopy(POOL)
    body["metadata"].update(name=POOL_NAME, uid=f"uid-{POOL_NAME}")
    body["spec"].update(role="both", replicas={"min": 3, "max": 3, "warm": 0})
    # Only the light load decides: no TTFT or queue pressure; short cooldown and idle time for the test.
    body["spec"]["targets"] = {"queuedTokensPerReplica": 100_000, "kvUtilisation": 0.8, "ttftP95Seconds": 120}
    body["spec"]["scaling"] = {"scaleDownCooldownSeconds": 1, "maxScaleDownStep": 2, "signalsWindowSeconds": 10,
                               "scaleToZeroAfterIdleSeconds": 1.5}
    return body


class Stream:
    def __init__(self, stub, name: str, max_tokens: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.request = new_request_to_proto(NewRequest(name, (1, 2, 3, 4), params), MODEL)
        self.max_tokens = max_tokens
        self.worker_ids: set[str] = set()
        self.first_chunk = asyncio.Event()
        self.last: pb.GenerateResponse | None = None
        self.task = asyncio.create_task(self._run(stub))

    async def _run(self, stub) -> None:
        async for response in stub.Generate(self.request, timeout=TIMEOUT_S):
            if response.HasField("chunk"):
                self.worker_ids.add(response.worker_id)
                self.first_chunk.set()
            else:
                self.last = response

    @property
    def done(self) -> bool:
        return self.task.done()

    def check(self) -> None:
        """Finished whole, on one worker, at the first attempt."""
        assert self.last is not None and self.last.HasField("finished"), (self.request.request_id, self.last)
        assert self.last.finished.usage.completion_tokens == self.max_tokens
        assert len(self.worker_ids) == 1 and self.last.num_attempts == 1, (self.worker_ids, self.last.num_attempts)


async def test_pool_scales_3_to_1_to_0_under_streams_without_failing_one(kube, router, checkpoint_factory,
                                                                         tmp_path):
    checkpoint = checkpoint_factory(size="small", seed=0, architecture="llama")
    channel = aio_test_channel(router.address)
    stub = router_pb2_grpc.RouterServiceStub(channel)

    async def router_states() -> dict[str, int]:
        listed = await stub.ListWorkers(rpb.ListWorkersRequest(), timeout=5)
        return {w.worker.worker_id: w.state for w in listed.workers}

    async def draining() -> set[str]:
        return {w for w, state in (await router_states()).items() if state == rpb.WORKER_STATE_DRAINING}

    registry = kopf.OperatorRegistry()
    register_handlers(registry, OperatorConfig(router_address=router.address, interval_s=0.2,
                                               kube_host=str(kube.url).rstrip("/"), tls_dir=OPERATOR_TLS,
                                               worker_tls_secret="flotilla-tls-worker"))
    operator = start_operator(registry)
    replica_set = PodReplicaSet(kube, "ns1", POOL_NAME,
                                {pod: start_worker(tmp_path, router.address, checkpoint, pod, MODEL)
                                 for pod in PODS})
    streams: list[Stream] = []
    try:
        await kube.post("/apis/flotilla.dev/v1alpha1/namespaces/ns1/flotillapools", json=pool_body())
        await async_wait_until(lambda: _get(kube, replica_set_key(), "spec", "replicas") == 3, 20, "3 replicas")
        await replica_set.start()  # the three pods, each a worker process
        await async_wait_until(lambda: _all_active(router_states), TIMEOUT_S, "three workers in rotation")

        # Step 1, 3 -> 1: streams on every worker, started close together (the least busy workers are the
        # victims: one whose streams ended would be drained with nothing on it), then the minimum goes to 0.
        # One replica fits the load.
        while len(streams) < 12 and min(_per_worker(streams).values()) < 2:
            batch = [Stream(stub, f"first-{len(streams) + i}", FIRST_TOKENS) for i in range(3)]
            await asyncio.gather(*(s.first_chunk.wait() for s in batch))
            streams += batch
        await kube.patch(f"/apis/flotilla.dev/v1alpha1/namespaces/ns1/flotillapools/{POOL_NAME}",
                         json={"spec": {"replicas": {"min": 0, "max": 3, "warm": 0}}})
        victims = await async_wait_until(lambda: _two(draining), 20, "two workers draining")
        (survivor,) = set(PODS) - victims
        for victim in victims:  # the drain began under streams on each
            assert any(not s.done for s in streams if victim in s.worker_ids), (victim, _per_worker(streams))
        assert replica_set.replicas == 3 and replica_set.deletions == []

        # Step 2's streams start now, on the only worker in rotation; they reset the idle clock.
        second = [Stream(stub, f"second-{i}", SECOND_TOKENS) for i in range(2)]
        streams += second
        await asyncio.gather(*(s.first_chunk.wait() for s in second))
        assert all(s.worker_ids == {survivor} for s in second)

        await async_wait_until(lambda: len(replica_set.deletions) == 2, TIMEOUT_S, "the two victims' pods gone")
        # The victims, marked cheapest, each once it held nothing (one may go before the other: 3, 2, 1).
        assert replica_set.deletions[-1].replicas == 1
        for deletion in replica_set.deletions:
            assert deletion.pod in victims and deletion.replicas in (1, 2), deletion
            assert deletion.cost == DRAINED_DELETION_COST, deletion
        assert replica_set.cost(survivor) is None

        # Step 2, 1 -> 0: idle (no new request for 1.5 s), the last worker drains under the second streams.
        await async_wait_until(lambda: _is(draining, {survivor}), TIMEOUT_S, "the last worker draining")
        assert not any(s.done for s in second), "the second streams ended before the scale to zero began"
        assert replica_set.replicas == 1
        await async_wait_until(lambda: len(replica_set.deletions) == 3, TIMEOUT_S, "the last pod gone")
        last = replica_set.deletions[-1]
        assert (last.pod, last.cost, last.replicas) == (survivor, DRAINED_DELETION_COST, 0)

        await asyncio.gather(*(s.task for s in streams))
        for stream in streams:
            stream.check()
        assert replica_set.errors == []
        await async_wait_until(lambda: _get(kube, POOL_KEY, "status", "desiredReplicas") == 0, 20, "status at 0")
    finally:
        for stream in streams:
            stream.task.cancel()
        await replica_set.stop()
        await operator.stop(20)
        await channel.close()


def _per_worker(streams: list[Stream]) -> dict[str, int]:
    counts = dict.fromkeys(PODS, 0)
    for stream in streams:
        for worker_id in stream.worker_ids:
            counts[worker_id] += 1
    return counts


def replica_set_key():
    return (kmock.resource("apps/v1/deployments"), "ns1", f"{POOL_NAME}-workers")


async def _all_active(router_states) -> bool:
    found = await router_states()
    return set(found) == set(PODS) and set(found.values()) == {rpb.WORKER_STATE_ACTIVE}


async def _two(draining) -> set[str] | None:
    found = await draining()
    return found if len(found) == 2 else None


async def _is(draining, expected: set[str]) -> bool:
    return await draining() == expected

