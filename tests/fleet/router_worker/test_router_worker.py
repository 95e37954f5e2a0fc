"""Router and worker as separate processes over real gRPC: registration, generation, cancellation, errors,
failure detection and graceful stop."""

from __future__ import annotations

import time

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.api.worker.v1 import worker_pb2 as wpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.tokenizer_files import files_digest, read_tokenizer_files
from flotilla.fleet.local import START_TIMEOUT_S
from flotilla.rpc.convert import new_request_to_proto
from flotilla.rpc.model_assets import asset_chunks

from flotilla.fleet.process import ServiceProcess

from tests.support.engines import BLOCK_SIZE, NUM_KV_BLOCKS, greedy_reference
from tests.support.fleet import NO_OUTPUT_CHECK, healthy_worker_ids, start_service
from tests.support.tls import channel
from tests.support.waiting import wait_until

MODEL = "tiny-test"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def generate_request(request_id: str, model: str, prompt: list[int], params: SamplingParams,
                     deadline_unix_s: float = 0.0) -> pb.GenerateRequest:
    return new_request_to_proto(NewRequest(request_id, tuple(prompt), params, deadline_unix_s=deadline_unix_s), model)


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint, tmp_path_factory) -> dict[str, ServiceProcess]:
    """The router, a worker serving MODEL and a spare serving the same weights as another model, by name."""
    state_dir = tmp_path_factory.mktemp("fleet")
    services = {"router": start_service(state_dir, "router", "router", "--alias", f"default={MODEL}",
                                        "--heartbeat-timeout-s", "1.0", "--max-queue-wait-s", "5")}
    try:
        engine_flags = [*NO_OUTPUT_CHECK, "--model-dir", str(tiny_checkpoint), "--router", services["router"].address,
                        "--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE)]
        for name, worker_id, model in (("worker", "w-main", MODEL), ("spare", "w-spare", "spare")):
            services[name] = start_service(state_dir, name, "worker", *engine_flags, "--worker-id", worker_id,
                                           "--model-name", model, wait=False)
        for service in services.values():
            service.wait_port(START_TIMEOUT_S)
        wait_until(lambda: healthy_worker_ids(services["router"].address) == {"w-main", "w-spare"}, 20,
                   "both workers to register")
        yield services
    finally:
        for service in reversed(services.values()):
            service.stop(timeout_s=20.0)


def router_stub(fleet: dict[str, ServiceProcess]) -> router_pb2_grpc.RouterServiceStub:
    return router_pb2_grpc.RouterServiceStub(channel(fleet["router"].address))


def worker_stub(fleet: dict[str, ServiceProcess]) -> worker_pb2_grpc.WorkerServiceStub:
    return worker_pb2_grpc.WorkerServiceStub(channel(fleet["worker"].address, "worker"))


def run(stub, request) -> tuple[list[int], list[pb.GenerateResponse]]:
    events = list(stub.Generate(request, timeout=60))
    tokens = [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]
    return tokens, events


def test_models_are_listed_with_version_and_aliases(fleet, tiny_engine):
    models = {m.name: m for m in router_stub(fleet).ListModels(rpb.ListModelsRequest(), timeout=5).models}
    assert set(models) == {MODEL, "spare"}
    assert models[MODEL].version == tiny_engine.model_version == models["spare"].version
    assert list(models[MODEL].aliases) == ["default"] and list(models["spare"].aliases) == []
    assert models[MODEL].max_model_len == tiny_engine.max_model_len
    health = worker_stub(fleet).Health(wpb.HealthRequest(), timeout=5)
    assert health.ready and health.worker_id == "w-main" and health.model.name == MODEL


def test_workers_publish_their_tokenizer_files_once_for_gateways(fleet, tiny_checkpoint):
    stub = router_stub(fleet)
    models = {m.name: m for m in stub.ListModels(rpb.ListModelsRequest(), timeout=5).models}
    files = read_tokenizer_files(tiny_checkpoint)
    # Same checkpoint, same digest: the two workers' models share one set of files at the router.
    assert models[MODEL].assets_digest == models["spare"].assets_digest == files_digest(files)
    chunks = list(stub.GetModelAssets(rpb.GetModelAssetsRequest(digest=models[MODEL].assets_digest), timeout=5))
    received: dict[str, bytes] = {}
    for chunk in chunks:
        received[chunk.file_name] = received.get(chunk.file_name, b"") + chunk.data
    assert received == files


def test_the_router_refuses_tokenizer_files_nobody_announced_or_that_do_not_match(fleet, tiny_checkpoint):
    stub = router_stub(fleet)
    as_worker = router_pb2_grpc.RouterServiceStub(channel(fleet["router"].address, client_role="worker"))
    announced = stub.ListModels(rpb.ListModelsRequest(), timeout=5).models[0].assets_digest
    files = read_tokenizer_files(tiny_checkpoint)
    tampered = {**files, "chat_template.jinja": b"{{ 'owned' }}"}
    for digest, sent, why in (
        (files_digest(tampered), tampered, "no registered worker serves"),  # not announced by any worker
        (announced, tampered, "hash to"),  # announced digest, other content
        (announced, {**files, "../../etc/passwd": b"x"}, "unexpected tokenizer file"),
    ):
        with pytest.raises(grpc.RpcError) as err:  # sent as a worker: only workers may publish them
            as_worker.PublishModelAssets(asset_chunks(digest, sent), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.GetModelAssets(rpb.GetModelAssetsRequest(digest=files_digest(tampered)), timeout=5))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_generate_through_the_router_equals_the_offline_engine(fleet, tiny_engine):
    prompts = [[5, 6, 7, 8], list(range(300, 333))]
    expected = greedy_reference(tiny_engine, prompts, GREEDY.max_tokens)
    stub = router_stub(fleet)
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        tokens, events = run(stub, generate_request(f"g{i}", "default", prompt, GREEDY))
        assert tokens == want
        assert all(e.worker_id == "w-main" for e in events)  # never the spare: other model name
        last = events[-1]
        assert last.HasField("finished") and last.finished.reason == pb.FINISH_REASON_LENGTH
        assert (last.finished.usage.prompt_tokens, last.finished.usage.completion_tokens) == (len(prompt), 6)


def test_cancel_mid_stream_aborts_in_the_worker(fleet):
    request = generate_request("cancel-me", MODEL, list(range(1, 40)), SamplingParams(max_tokens=900, ignore_eos=True))
    worker = worker_stub(fleet)
    num_tokens_before = worker.GetLoad(wpb.GetLoadRequest(), timeout=5).num_output_tokens_total
    call = router_stub(fleet).Generate(request, timeout=60)
    first = next(call)
    assert first.HasField("chunk")
    assert "cancel-me" in worker.GetLoad(wpb.GetLoadRequest(), timeout=5).active_request_ids
    call.cancel()

    def all_blocks_back() -> bool:
        load = worker.GetLoad(wpb.GetLoadRequest(), timeout=5)
        return not load.active_request_ids and load.num_free_blocks == load.num_total_blocks == NUM_KV_BLOCKS

    wait_until(all_blocks_back, 15, "the worker to abort the cancelled request")
    num_tokens = worker.GetLoad(wpb.GetLoadRequest(), timeout=5).num_output_tokens_total - num_tokens_before
    assert num_tokens < 900  # aborted, not run to its end


def test_errors_are_events(fleet):
    stub = router_stub(fleet)
    _, events = run(stub, generate_request("e1", "no-such-model", [1, 2], GREEDY))
    assert [e.error.code for e in events] == [pb.ERROR_CODE_MODEL_NOT_FOUND]
    _, events = run(stub, generate_request("e2", MODEL, [1, 2], SamplingParams(max_tokens=6, top_p=1.5)))
    assert [(e.error.code, e.error.field) for e in events] == [(pb.ERROR_CODE_INVALID_REQUEST, "top_p")]
    _, events = run(stub, generate_request("e3", MODEL, [1] * 2000, SamplingParams(max_tokens=100)))
    assert [e.error.code for e in events] == [pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED]
    # Straight to the worker: a version it does not hold is refused (its address may hold other weights now).
    events = list(worker_stub(fleet).Generate(generate_request("e4", f"{MODEL}@other", [1], GREEDY), timeout=10))
    assert [e.error.code for e in events] == [pb.ERROR_CODE_MODEL_NOT_FOUND]


def test_killed_worker_is_marked_unhealthy(fleet):
    stub = router_stub(fleet)
    fleet["spare"].kill()
    wait_until(lambda: "w-spare" not in healthy_worker_ids(fleet["router"].address), 3.0, "the router to notice the dead worker")
    assert "w-main" in healthy_worker_ids(fleet["router"].address)
    request = generate_request("to-the-dead", "spare", [1, 2], GREEDY, deadline_unix_s=time.time() + 0.3)
    _, events = run(stub, request)
    assert [e.error.code for e in events] == [pb.ERROR_CODE_UNAVAILABLE]


def test_sigterm_drains_deregisters_and_exits_cleanly(fleet):
    stub = router_stub(fleet)
    call = stub.Generate(generate_request("drain", MODEL, [9, 8, 7], GREEDY), timeout=60)
    first = next(call)
    assert first.HasField("chunk")
    fleet["worker"].stop(timeout_s=20.0)  # SIGTERM
    assert fleet["worker"].popen.returncode == 0
    rest = list(call)  # the running stream finished within the grace period instead of being cut
    assert rest[-1].HasField("finished") and rest[-1].finished.reason == pb.FINISH_REASON_LENGTH
    assert len(first.chunk.token_ids) + sum(len(e.chunk.token_ids) for e in rest) == GREEDY.max_tokens
    workers = {s.worker.worker_id for s in stub.ListWorkers(rpb.ListWorkersRequest(), timeout=5).workers}
    assert "w-main" not in workers
    fleet["router"].stop(timeout_s=20.0)
    assert fleet["router"].popen.returncode == 0
