"""A worker's link to the router: registers, heartbeats, registers again when forgotten, leaves on stop."""

from __future__ import annotations

import asyncio

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.engine.tokenizer_files import files_digest
from flotilla.router.config import RouterConfig
from flotilla.router.server import serve
from flotilla.rpc.options import aio_channel, read_port_file
from flotilla.worker.registration import RouterLink

from tests.support.waiting import async_wait_until


async def test_worker_registers_again_when_the_router_forgets_it(tmp_path):
    port_file = tmp_path / "router.port"
    stop = asyncio.Event()
    config = RouterConfig(port_file=str(port_file), heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)
    router = asyncio.create_task(serve(config, stop))
    await async_wait_until(lambda: read_port_file(port_file) is not None or router.done(), what="the router to serve")
    address = f"127.0.0.1:{read_port_file(port_file)}"
    channel = aio_channel(address)
    stub = router_pb2_grpc.RouterServiceStub(channel)

    async def registered_ids() -> set[str]:
        return {s.worker.worker_id for s in (await stub.ListWorkers(rpb.ListWorkersRequest())).workers}

    tokenizer_files = {"tokenizer.json": b'{"model": {}}'}
    info = rpb.WorkerInfo(worker_id="w1", address="127.0.0.1:9", role=pb.WORKER_ROLE_BOTH,
                          model=pb.ModelInfo(name="m", version="v1", assets_digest=files_digest(tokenizer_files)))
    link = RouterLink(address, info, lambda: pb.LoadReport(num_total_blocks=8, num_free_blocks=8), 1.0,
                      tokenizer_files)
    num_registrations = 0
    register = link._register

    async def counting_register() -> None:
        nonlocal num_registrations
        await register()
        num_registrations += 1

    link._register = counting_register
    link.start()
    try:
        await async_wait_until(lambda: _contains(registered_ids(), "w1"), what="registration")
        # The link reports its load right after registering (a second call, so ListWorkers may land between).
        await async_wait_until(lambda: _reported(stub, blocks=8), what="the first load report")
        assert (await stub.ListWorkers(rpb.ListWorkersRequest())).workers[0].healthy
        assert await _listed_models(stub) == ["m"]  # its tokenizer files reached the router with it
        await stub.DeregisterWorker(rpb.DeregisterWorkerRequest(worker_id="w1"))
        assert await _listed_models(stub) == []  # and left with it
        # The next heartbeat is answered known=false; the link registers again, files included.
        await async_wait_until(lambda: _registered_again(registered_ids(), lambda: num_registrations),
                          what="re-registration")
        assert await _listed_models(stub) == ["m"]
        await link.stop()
        assert "w1" not in await registered_ids()  # deregistered on stop
    finally:
        stop.set()
        await router
        await channel.close()


async def _listed_models(stub) -> list[str]:
    return [m.name for m in (await stub.ListModels(rpb.ListModelsRequest())).models]


async def _reported(stub, blocks: int) -> bool:
    workers = (await stub.ListWorkers(rpb.ListWorkersRequest())).workers
    return bool(workers) and workers[0].load.num_total_blocks == blocks


async def _contains(ids_coro, worker_id: str) -> bool:
    return worker_id in await ids_coro


async def _registered_again(ids_coro, count) -> bool:
    return "w1" in await ids_coro and count() >= 2
