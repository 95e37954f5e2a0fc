"""Fixed-batch worker process wiring: load run_batch, serve FixedBatchService, register with the router
(worker/registration.py's RouterLinks, WorkerInfo.fixed_batch set), stop on SIGTERM."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from dataclasses import dataclass, field

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.rpc.options import address, aio_server, bind
from flotilla.rpc.serving import announce, stop_on_signals
from flotilla.rpc.tls import InternalTLS
from flotilla.worker.access import WORKER_POLICY
from flotilla.worker.fixed_batch.contract import SIMULATED, BatchOptions, RunBatch, load_run_batch
from flotilla.worker.fixed_batch.service import FixedBatchProbes, FixedBatchService
from flotilla.worker.registration import RouterLinks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FixedBatchConfig:
    model_name: str  # what callers ask for (POST /v1/batch-generate "model")
    run_batch: str = SIMULATED  # import path, MODULE:NAME (contract.py)
    options: BatchOptions = field(default_factory=BatchOptions)
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str | None = None
    advertise_host: str | None = None
    worker_id: str = ""
    routers: tuple[str, ...] = ()  # every router it registers with
    heartbeat_interval_s: float = 0.25
    shutdown_grace_s: float = 5.0  # a batch still running after this is cut; the router re-dispatches it
    tls: InternalTLS | None = None  # mTLS for its server and its router channel; None: insecure

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("a fixed-batch worker needs --model-name")


def model_info(config: FixedBatchConfig, run_batch: RunBatch) -> pb.ModelInfo:
    """Version: the engine backend's weights digest, else a digest of what defines the outputs (import path and
    B; L changes only timing). No tokenizer files: the gateway never tokenizes for a fixed-batch model."""
    version = getattr(run_batch, "model_version", None)
    if not version:
        version = hashlib.sha256(f"{config.run_batch}|{config.options.max_batch_size}".encode()).hexdigest()[:16]
    return pb.ModelInfo(name=config.model_name, version=version)


async def serve(config: FixedBatchConfig, stop: asyncio.Event | None = None) -> None:
    if stop is None:
        stop = asyncio.Event()
        stop_on_signals(stop)
    run_batch = await asyncio.to_thread(load_run_batch, config.run_batch, config.options)  # may load weights
    worker_id = config.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
    model = model_info(config, run_batch)
    service = FixedBatchService(run_batch, config.options.max_batch_size)
    server = aio_server(config.tls, WORKER_POLICY)
    worker_pb2_grpc.add_FixedBatchServiceServicer_to_server(service, server)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(FixedBatchProbes(service, worker_id, model), server)
    port = bind(server, config.host, config.port, config.tls)
    await server.start()
    link = None
    if config.routers:
        info = rpb.WorkerInfo(worker_id=worker_id, address=address(config.advertise_host or config.host, port),
                              role=pb.WORKER_ROLE_BOTH, model=model,
                              fixed_batch=rpb.FixedBatchInfo(max_batch_size=config.options.max_batch_size,
                                                             batch_latency_ms=round(config.options.batch_latency_ms)))
        link = RouterLinks(config.routers, info, service.load, config.heartbeat_interval_s, tls=config.tls)
        link.start()
    announce("worker", config.host, port, config.port_file)
    logger.info("fixed-batch worker %s serving %s (%s, B=%d)", worker_id, model.name, config.run_batch,
                config.options.max_batch_size)
    try:
        await stop.wait()
    finally:
        if link is not None:
            await link.stop()  # no new batches; the one running may finish within the grace
        await server.stop(config.shutdown_grace_s)
        service.close()
