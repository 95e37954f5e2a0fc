"""The usage ledger's tap on the router stream: one record per request that reached the router, written
when its stream ends however it ends (finished, error, caller gone), off the hot path (UsageLedger).

Billed output tokens are the tokens relayed to the handler (for a stream: sent to the client); the prompt
and cached counts come from the router's Finished event (the caller's prompt even after a resume), the
attempts and model version from the router's last event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.gateway.router_client import RouterBackend
from flotilla.usage.ledger import UsageLedger
from flotilla.usage.record import STATUS_CANCELLED, STATUS_ERROR, STATUS_OK, UsageRecord


@dataclass
class _Meter:
    request: common.GenerateRequest
    started_at: float = field(default_factory=time.time)
    num_output_tokens: int = 0
    status: str = STATUS_CANCELLED
    error_code: str = ""
    last: common.GenerateResponse | None = None  # the terminal event

    def on_response(self, response: common.GenerateResponse) -> None:
        kind = response.WhichOneof("event")
        if kind == "chunk":
            self.num_output_tokens += len(response.chunk.token_ids)
        elif kind == "finished":
            self.last = response
            aborted = response.finished.reason == common.FINISH_REASON_ABORT
            self.status, self.error_code = (STATUS_ERROR, "aborted") if aborted else (STATUS_OK, "")
        elif kind == "error":
            self.last = response
            self.status, self.error_code = STATUS_ERROR, common.ErrorCode.Name(response.error.code)

    def on_call_error(self, err: grpc.RpcError) -> None:
        code = err.code() if hasattr(err, "code") else None
        self.status, self.error_code = STATUS_ERROR, f"RPC_{code.name if code else 'UNKNOWN'}"

    def record(self) -> UsageRecord:
        last, request = self.last, self.request
        usage = last.finished.usage if last is not None and last.HasField("finished") else common.Usage()
        version = last.model_version if last is not None else ""
        attempts = last.num_attempts if last is not None else int(self.num_output_tokens > 0)
        name = request.model.partition("@")[0]
        return UsageRecord(
            request_id=request.request_id, tenant=request.tenant_id, key_id=request.key_id,
            model=f"{name}@{version}" if version else request.model, model_version=version,
            input_tokens=usage.prompt_tokens or len(request.prompt_token_ids),
            cached_input_tokens=usage.cached_prompt_tokens, output_tokens=self.num_output_tokens,
            status=self.status, error_code=self.error_code, attempts=attempts,
            started_at=self.started_at, finished_at=time.time())


class MeteredBackend:
    """A RouterBackend that writes one usage record per generate() stream."""

    def __init__(self, backend: RouterBackend, ledger: UsageLedger):
        self._backend = backend
        self.ledger = ledger

    async def generate(self, request: common.GenerateRequest,
                       metadata: Sequence[tuple[str, str]] = ()) -> AsyncIterator[common.GenerateResponse]:
        meter = _Meter(request)
        stream = self._backend.generate(request, metadata)
        try:
            async for response in stream:
                meter.on_response(response)
                yield response
        except grpc.RpcError as err:
            meter.on_call_error(err)
            raise
        finally:
            await stream.aclose()
            self.ledger.record(meter.record())

    async def list_models(self) -> list[common.ModelInfo]:
        return await self._backend.list_models()

    async def close(self) -> None:
        await self._backend.close()
