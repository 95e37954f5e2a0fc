"""FixedBatchService.RunBatch over a loaded run_batch, and the WorkerService probes a fixed-batch worker
answers (Health, GetLoad; Generate is UNIMPLEMENTED: the router never sends it one)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.worker.v1 import worker_pb2 as wpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.worker.fixed_batch.contract import ContractError, RunBatch, checked_call

logger = logging.getLogger(__name__)


class FixedBatchService(worker_pb2_grpc.FixedBatchServiceServicer):
    def __init__(self, run_batch: RunBatch, max_batch_size: int):
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        # The accelerator runs one call at a time: one thread, and a lock so a second call waits its turn.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-batch")
        self._lock = asyncio.Lock()
        self.running_batch_id = ""
        self.num_batches = 0
        self.num_inputs = 0

    async def RunBatch(self, request: wpb.RunBatchRequest, context: grpc.aio.ServicerContext) -> wpb.RunBatchResponse:
        inputs = list(request.inputs)
        if not 1 <= len(inputs) <= self.max_batch_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a batch takes 1 to {self.max_batch_size} inputs, got {len(inputs)}")
        async with self._lock:
            self.running_batch_id = request.batch_id
            started = time.perf_counter()
            try:
                outputs = await asyncio.get_running_loop().run_in_executor(
                    self._executor, checked_call, self._run_batch, inputs, self.max_batch_size)
            except ContractError as exc:
                await context.abort(grpc.StatusCode.INTERNAL, f"run_batch broke its contract: {exc}")
            except Exception as exc:  # the backend's own failure: the router may try another worker
                logger.exception("run_batch failed on batch %s", request.batch_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"run_batch raised {type(exc).__name__}: {exc}")
            finally:
                self.running_batch_id = ""
            self.num_batches += 1
            self.num_inputs += len(inputs)
            return wpb.RunBatchResponse(outputs=outputs, run_seconds=time.perf_counter() - started)

    def load(self) -> pb.LoadReport:
        busy = bool(self.running_batch_id)
        return pb.LoadReport(num_running=int(busy), active_request_ids=[self.running_batch_id] if busy else [],
                             num_output_tokens_total=self.num_inputs)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class FixedBatchProbes(worker_pb2_grpc.WorkerServiceServicer):
    """Health and GetLoad, so `flotilla probe worker` and the tests read a fixed-batch worker like any other."""

    def __init__(self, service: FixedBatchService, worker_id: str, model: pb.ModelInfo):
        self._service = service
        self._worker_id = worker_id
        self._model = model

    async def Health(self, request: wpb.HealthRequest, context: grpc.aio.ServicerContext) -> wpb.HealthResponse:
        return wpb.HealthResponse(ready=True, worker_id=self._worker_id, model=self._model)

    async def GetLoad(self, request: wpb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        return self._service.load()
