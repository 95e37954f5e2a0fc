"""The usage ledger's tap on the router stream (generation.RouterEvents): one final record per request that reached
the router, however its stream ends (finished, error, caller gone). A finished request's record is settled (in the
sink) before the handler sends its last byte; other endings are queued (UsageLedger). While it runs the request
leaves checkpoint records (status open: at admission, then, streamed, every `checkpoint_interval_s` of output), so a
gateway killed mid-stream still bills what it had delivered up to its last checkpoint, once (summary.unique); a
request that had delivered nothing bills nothing.

Billed output tokens are the tokens relayed to the handler (for a stream: sent to the client; an answer the
safety stage stopped, status `filtered`, bills those sent before the block); the prompt
and cached counts come from the router's Finished event (the caller's prompt even after a resume), the
attempts and model version from the router's last event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.engine.new_request import NewRequest
from flotilla.engine.request import FinishReason
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.safety.filtered import Filtered, Withheld
from flotilla.rpc.stream_events import Chunk, Error, Finished, StreamEvent
from flotilla.usage.ledger import UsageLedger
from flotilla.usage.record import (STATUS_CANCELLED, STATUS_ERROR, STATUS_FILTERED, STATUS_OK, STATUS_OPEN,
                                    UsageRecord)


class UsageLedgerTap:
    __slots__ = ("_ledger", "_request", "_model", "_key_id", "_started_at", "_num_output_tokens", "_status",
                 "_error_code", "_last", "_next_checkpoint", "_settled", "_streamed", "_batch_item", "_withheld",
                 "_price_factor")

    def __init__(self, ledger: UsageLedger, request: NewRequest, requested_model: str, key_id: str,
                 streamed: bool = False, batch_item: tuple[str, int] | None = None,
                 withheld: Callable[[], int] | None = None, price_factor: float = 1.0):
        self._ledger = ledger
        self._withheld = withheld  # relayed tokens not (yet) sent to the client: a checkpoint does not bill them
        self._streamed = streamed  # else nothing reaches the caller before the end: no checkpoint bills output
        self._request = request
        self._model = requested_model
        self._key_id = key_id
        self._started_at = time.time()
        self._num_output_tokens = 0
        self._status = STATUS_CANCELLED
        self._error_code = ""
        self._last: Finished | Error | None = None  # the terminal event
        self._batch_item = batch_item  # (job id, index) of a batch-job item
        self._price_factor = price_factor  # its batch rate; 1 for interactive traffic
        self._settled = False
        self._next_checkpoint = time.monotonic() + ledger.checkpoint_interval_s
        ledger.record(self.record(STATUS_OPEN))  # admitted: the request exists in the ledger from here on

    def on_event(self, event: StreamEvent) -> None:
        if type(event) is Chunk:
            self._num_output_tokens += len(event.token_ids)
            if self._streamed and time.monotonic() >= self._next_checkpoint:
                self._next_checkpoint = time.monotonic() + self._ledger.checkpoint_interval_s
                withheld = self._withheld() if self._withheld is not None else 0
                self._ledger.record(self.record(STATUS_OPEN, withheld))
        elif type(event) is Finished:
            self._last = event
            aborted = event.reason is FinishReason.ABORT
            self._status, self._error_code = (STATUS_ERROR, "aborted") if aborted else (STATUS_OK, "")
        elif type(event) is Withheld:
            self._num_output_tokens -= event.num_tokens
        elif type(event) is Filtered:  # held-back chunks were relayed here but never sent: not billed
            self._num_output_tokens = event.usage.completion_tokens
            self._status, self._error_code = STATUS_FILTERED, event.verdict.category
        else:
            self._last = event
            self._status, self._error_code = STATUS_ERROR, common.ErrorCode.Name(event.code)

    def on_end(self, error: GatewayError | None) -> None:
        cause = error.__cause__ if error is not None else None
        if isinstance(cause, grpc.RpcError):  # the router call itself failed
            code = cause.code() if hasattr(cause, "code") else None
            self._status, self._error_code = STATUS_ERROR, f"RPC_{code.name if code else 'UNKNOWN'}"
        if not self._settled:
            self._ledger.record(self.record())

    async def settle(self) -> None:
        """After the Finished event, before the handler answers: the final record, in the sink."""
        self._settled = True
        # shielded: a client gone during the write cancels the handler, not the write (which queues on failure)
        await asyncio.shield(self._ledger.settle(self.record()))

    def record(self, status: str | None = None, num_withheld_tokens: int = 0) -> UsageRecord:
        last, request = self._last, self._request
        usage = last.usage if type(last) is Finished else None
        version = last.model_version if last is not None else ""
        attempts = last.num_attempts if last is not None else int(self._num_output_tokens > 0)
        name = self._model.partition("@")[0]
        batch_id, batch_item = self._batch_item or ("", -1)
        return UsageRecord(
            request_id=request.request_id, tenant=request.tenant_id, key_id=self._key_id,
            model=f"{name}@{version}" if version else self._model, model_version=version,
            input_tokens=(usage.prompt_tokens if usage is not None else 0) or request.num_prompt_tokens,
            cached_input_tokens=usage.cached_prompt_tokens if usage is not None else 0,
            output_tokens=self._num_output_tokens - num_withheld_tokens, status=status or self._status,
            error_code=self._error_code, attempts=attempts, started_at=self._started_at, finished_at=time.time(),
            batch_id=batch_id, batch_item=batch_item, price_factor=self._price_factor)
