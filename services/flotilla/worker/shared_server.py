"""Process wiring of a shared-pool worker (`flotilla worker --shared-models ...`): the catalog, the model cache,
gRPC, and a router registration that advertises every model it can load and reports loads and unloads at once.

Role both only (no KV hand-off) and no golden-output check: both assume one model per worker.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import replace

import torch
from prometheus_client import Counter

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.config import resolve_device
from flotilla.engine.engine import LLMEngine
from flotilla.engine.model.loader import check_checkpoint
from flotilla.observability.exposition import serve_metrics
from flotilla.rpc.leases import LeaseVerifier, read_secret
from flotilla.rpc.options import address, aio_server, bind
from flotilla.rpc.serving import announce, stop_on_signals
from flotilla.worker.access import WORKER_POLICY
from flotilla.worker.config import WorkerConfig
from flotilla.worker.model_cache import ModelCache
from flotilla.worker.registration import RouterLinks
from flotilla.worker.service import WorkerService
from flotilla.worker.shared_catalog import CatalogEntry, read_catalog
from flotilla.worker.shared_memory import checkpoint_bytes, slot_kv_budget
from flotilla.worker.shared_service import RetiredTotals, ServedModel, SharedWorkerService
from flotilla.worker.telemetry import WorkerMetrics

logger = logging.getLogger(__name__)


async def serve_shared(config: WorkerConfig, stop: asyncio.Event | None = None) -> None:
    if stop is None:
        stop = asyncio.Event()
        stop_on_signals(stop)
    catalog = read_catalog(config.shared_models, config.engine.max_model_len)
    worker_id = config.resolved_worker_id()
    metrics = WorkerMetrics()
    changes = Counter("flotilla_worker_shared_model_changes", "Shared-pool loads and unloads by model",
                      ["model", "change"], registry=metrics.registry)
    retired = RetiredTotals()
    link: RouterLinks | None = None

    kv_budget = _kv_budget(config)

    async def start(name: str) -> ServedModel:
        entry = catalog[name]
        engine_config = replace(config.engine, model_dir=entry.model_dir,
                                kv_cache_memory_bytes=kv_budget(entry.model_dir))
        engine = AsyncEngine(lambda: LLMEngine(engine_config), stream_interval_s=config.stream_interval_s)
        await engine.start()
        changes.labels(name, "load").inc()
        service = WorkerService(engine, worker_id, entry.info, metrics)
        if config.lease_secret_file:  # gateways stream here under the router's leases, as on any worker
            service.leases = LeaseVerifier(read_secret(config.lease_secret_file), worker_id)
        return ServedModel(entry, engine, service)

    async def unload(model: ServedModel) -> None:
        retired.retire(model.engine)
        await model.engine.shutdown()
        changes.labels(model.entry.name, "unload").inc()

    def report_change() -> None:
        if link is not None:
            link.report_now()

    def check(name: str) -> None:
        check_checkpoint(catalog[name].model_dir)
        kv_budget(catalog[name].model_dir)  # raises when it does not fit a slot

    cache: ModelCache[ServedModel] = ModelCache(config.max_loaded_models, start, unload, report_change,
                                                check=check, free_memory=_free_memory)
    service = SharedWorkerService(worker_id, catalog, cache, retired)
    server = aio_server(config.tls, WORKER_POLICY)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(service, server)
    port = bind(server, config.host, config.port, config.tls)
    await server.start()
    if config.routers:
        link = _router_link(config, worker_id, catalog, port, service)
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port, config.metrics_port_file)
    announce("worker", config.host, port, config.port_file)
    logger.info("shared worker %s: %d models (%s), at most %d loaded", worker_id, len(catalog),
                ", ".join(catalog), config.max_loaded_models)
    try:
        await stop.wait()
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        if link is not None:
            await link.stop()
        await server.stop(config.shutdown_grace_s)
        await cache.close()


def _free_memory() -> None:
    gc.collect()  # the unloaded engine's tensors, then the allocator's cached blocks
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _kv_budget(config: WorkerConfig):
    """model dir -> its KV budget in bytes (shared_memory.py); the configured budget where one was set."""
    engine = config.engine
    device = resolve_device(engine.device)
    if engine.num_kv_blocks or engine.kv_cache_memory_bytes or device.type != "cuda":
        return lambda model_dir: engine.kv_cache_memory_bytes
    free_bytes, _ = torch.cuda.mem_get_info(device)
    graphs = engine.cuda_graph_memory_bytes if engine.cuda_graphs else 0
    return lambda model_dir: slot_kv_budget(free_bytes, config.max_loaded_models, checkpoint_bytes(model_dir), graphs)


def _router_link(config: WorkerConfig, worker_id: str, catalog: dict[str, CatalogEntry], port: int,
                 service: SharedWorkerService) -> RouterLinks:
    info = rpb.WorkerInfo(worker_id=worker_id, address=address(config.advertise_host or config.host, port),
                          role=pb.WORKER_ROLE_BOTH,
                          shared=rpb.SharedModels(models=[e.info for e in catalog.values()],
                                                  max_loaded_models=config.max_loaded_models))
    assets = {e.info.assets_digest: e.tokenizer_files for e in catalog.values()}
    link = RouterLinks(config.routers, info, service.current_load, config.heartbeat_interval_s,
                      tls=config.tls, shared_assets=assets)
    link.start()
    return link
