"""A worker whose weights go wrong while it runs is taken out of rotation by its own output check: a real
router process, and a real worker (gRPC server, engine thread, router link) in this process so that the test
can corrupt a weight of its running engine the way a failing device would, with no back door in the worker."""

from __future__ import annotations

import asyncio

import grpc
import torch

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.api.worker.v1 import worker_pb2 as wpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.engine.engine import LLMEngine
from flotilla.rpc.options import read_port_file
from flotilla.worker.check_settings import CheckSettings
from flotilla.worker.config import WorkerConfig
from flotilla.worker.server import serve

from tests.support.engines import engine_config
from tests.support.fleet import start_service
from tests.support.tls import aio_test_channel, client_tls
from tests.support.waiting import async_wait_until


async def test_corrupted_weight_marks_the_worker_unhealthy_at_the_router(tiny_checkpoint, tmp_path):
    router = start_service(tmp_path, "router", "router", "--model", "tiny", "--heartbeat-timeout-s", "2")
    engines: list[LLMEngine] = []

    def engine_factory() -> LLMEngine:
        engines.append(LLMEngine(engine_config(tiny_checkpoint)))
        return engines[0]

    config = WorkerConfig(engine=engine_config(tiny_checkpoint), worker_id="w-check", model_name="tiny",
                          routers=(router.address,), port_file=str(tmp_path / "worker.port"),
                          heartbeat_interval_s=0.1, output_check=CheckSettings(interval_s=0.2, busy_interval_s=0.2),
                          tls=client_tls("worker", "w-check"))
    stop = asyncio.Event()
    worker = asyncio.create_task(serve(config, stop, engine_factory))
    channel = aio_test_channel(router.address)
    stub = router_pb2_grpc.RouterServiceStub(channel)

    async def status() -> rpb.WorkerStatus | None:
        workers = (await stub.ListWorkers(rpb.ListWorkersRequest(), timeout=5)).workers
        return workers[0] if workers else None

    async def healthy() -> bool:
        current = await status()
        return current is not None and current.healthy

    async def unhealthy() -> bool:
        current = await status()
        return current is not None and not current.healthy

    try:
        await async_wait_until(healthy, timeout_s=60, what="the worker to register healthy")
        await asyncio.sleep(1.0)  # several checks pass on the weights it loaded
        assert await healthy()

        # Between steps, as a bit flip would land (no request is running); a norm's weight, dense where the
        # linears' are packed for oneDNN.
        with torch.no_grad():
            engines[0].runner.model.model.layers[0].post_attention_layernorm.weight.mul_(-1.0)
        await async_wait_until(unhealthy, timeout_s=10, what="the router to see the failed check")
        current = await status()
        assert current.load.output_check_failure.startswith("output check failed: token")
        models = (await stub.ListModels(rpb.ListModelsRequest(), timeout=5)).models
        assert [m.name for m in models] == ["tiny"]  # still listed: the model is fine, this worker is not

        port = read_port_file(tmp_path / "worker.port")
        async with aio_test_channel(f"127.0.0.1:{port}", "worker") as worker_channel:
            health = await worker_pb2_grpc.WorkerServiceStub(worker_channel).Health(wpb.HealthRequest(), timeout=5)
        assert not health.ready and health.problem == current.load.output_check_failure
    finally:
        stop.set()
        await worker
        await channel.close()
        router.stop(timeout_s=20.0)
