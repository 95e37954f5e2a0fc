"""WorkerService of a shared-pool worker: several models, loaded on demand (model_cache.py).

Each loaded model has its own engine and its own single-model WorkerService (service.py), which runs its
streams unchanged; this service picks the model a request names, pins it for the stream's life (so that it is
never unloaded under the stream) and loads it first when it is not loaded. The router normally asks for the
load beforehand (LoadModel) and places requests only where their model is loaded; a request that arrives for
an unloaded model waits for its load here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.worker.v1 import worker_pb2 as wpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.engine.async_engine import AsyncEngine, EngineDeadError
from flotilla.rpc.convert import error_response
from flotilla.rpc.session_server import serve_session
from flotilla.rpc.tls import peer_identity
from flotilla.worker.model_cache import ModelCache, ModelLoadError
from flotilla.worker.service import WorkerService, caller_role_of, current_load
from flotilla.worker.shared_catalog import CatalogEntry, find_entry

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ServedModel:
    entry: CatalogEntry
    engine: AsyncEngine
    service: WorkerService  # the single-model handlers around `engine`


@dataclass
class RetiredTotals:
    """Token counters of unloaded engines: the reported totals never go backwards (the router's throughput
    meter would read a drop as a restart)."""

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0

    def retire(self, engine: AsyncEngine) -> None:
        stats = engine.stats()
        self.num_prompt_tokens += stats.num_prompt_tokens_total
        self.num_output_tokens += stats.num_output_tokens_total
        self.num_preemptions += stats.num_preemptions


class SharedWorkerService(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, worker_id: str, catalog: dict[str, CatalogEntry], cache: ModelCache[ServedModel],
                 retired: RetiredTotals):
        self.worker_id = worker_id
        self.catalog = catalog
        self.cache = cache
        self.retired = retired

    def qualified(self, name: str) -> str:
        return self.catalog[name].qualified

    async def GenerateSession(self, actions, context: grpc.aio.ServicerContext) -> None:
        # The caller's role is the session's: each stream's sink has no auth context of its own.
        role = caller_role_of(context)
        await serve_session(actions, context, lambda request, sink: self._generate(request, sink, role))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        await self._generate(request, context, caller_role_of(context))

    async def _generate(self, request: pb.GenerateRequest, context, caller_role: str | None) -> None:
        entry = find_entry(self.catalog, request.model)
        if entry is None:
            await context.write(error_response(pb.ERROR_CODE_MODEL_NOT_FOUND,
                                               f"this shared worker does not serve {request.model}", "model",
                                               self.worker_id))
            return
        try:
            model = await self.cache.acquire(entry.name)
        except ModelLoadError as err:
            await context.write(error_response(pb.ERROR_CODE_UNAVAILABLE, str(err), worker_id=self.worker_id))
            return
        try:
            await model.served.service.generate_as(request, context, caller_role)
        finally:
            self.cache.release(model)

    async def LoadModel(self, request: wpb.LoadModelRequest, context: grpc.aio.ServicerContext
                        ) -> wpb.LoadModelResponse:
        entry = find_entry(self.catalog, request.model)
        if entry is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this shared worker does not serve {request.model!r}")
        try:
            result = await self.cache.ensure_loaded(entry.name)
        except ModelLoadError as err:
            await context.abort(grpc.StatusCode.INTERNAL, str(err))
        return wpb.LoadModelResponse(loaded_models=[self.qualified(n) for n in result.loaded],
                                     unloaded_models=[self.qualified(n) for n in result.unloaded],
                                     load_seconds=result.load_seconds, already_loaded=result.already_loaded)

    async def Abort(self, request: wpb.AbortRequest, context: grpc.aio.ServicerContext) -> wpb.AbortResponse:
        for model in self.cache.loaded():
            try:
                if await model.served.engine.abort(request.request_id):
                    return wpb.AbortResponse(found=True)
            except EngineDeadError:
                continue
        return wpb.AbortResponse(found=False)

    async def Health(self, request: wpb.HealthRequest, context: grpc.aio.ServicerContext) -> wpb.HealthResponse:
        # Ready with nothing loaded: loading on demand is what this worker is for.
        return wpb.HealthResponse(ready=True, worker_id=self.worker_id)

    async def GetLoad(self, request: wpb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        load = self.current_load()
        identity = peer_identity(context)
        if identity is not None and identity.role != "router":
            load.ClearField("active_request_ids")
        return load

    def current_load(self) -> pb.LoadReport:
        """The loaded engines' reports summed, with the loaded models (LRU first) and the one loading."""
        total = pb.LoadReport(num_prompt_tokens_total=self.retired.num_prompt_tokens,
                              num_output_tokens_total=self.retired.num_output_tokens,
                              num_preemptions=self.retired.num_preemptions)
        for model in self.cache.loaded():
            if not model.served.engine.is_running:
                continue
            report = current_load(model.served.engine)
            for name in ("num_running", "num_waiting", "num_queued_tokens", "num_free_blocks", "num_total_blocks",
                         "num_preemptions", "num_output_tokens_total", "num_prompt_tokens_total"):
                setattr(total, name, getattr(total, name) + getattr(report, name))
            total.block_size = report.block_size
            total.last_step_num_tokens = max(total.last_step_num_tokens, report.last_step_num_tokens)
            total.active_request_ids.extend(report.active_request_ids)
        total.loaded_models[:] = [self.qualified(n) for n in self.cache.loaded_names()]
        total.loading_model = self.qualified(self.cache.loading) if self.cache.loading else ""
        return total
