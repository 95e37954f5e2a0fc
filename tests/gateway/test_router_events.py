"""RouterEvents (gateway/generation.py): one loop over a request's decoded router stream, its taps (usage meter,
telemetry, quota settlement, usage ledger) each told every event and the end exactly once, however the stream
ends. An in-memory backend stands in for the router."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.engine.request import FinishReason, Priority
from flotilla.engine.sampling_params import SamplingParams
from flotilla.gateway.admission import Admitted, RouteTicket
from flotilla.gateway.auth import Principal
from flotilla.gateway.context import GatewayContext
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.generation import Job, collect, router_events
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.model_registry import ServedModel
from flotilla.gateway.settings import GatewaySettings
from flotilla.rpc.session_client import rpc_error
from flotilla.rpc.stream_events import Chunk, Error, Finished, StreamEvent, Usage
from flotilla.usage.record import UsageRecord

PROMPT = [1, 2, 3, 4]
PRINCIPAL = Principal(key_id="k1", tenant="acme", tier="paid", cache_salt="salt")
MODEL = ServedModel("tiny", "v1", 128, "", (), tokenizer=None)


class ScriptedBackend:
    """generate() plays `script` (events, or an exception to raise) and records the request and its close."""

    def __init__(self, script: Sequence[StreamEvent | BaseException]):
        self.script = list(script)
        self.requests: list[common.GenerateRequest] = []
        self.num_closed = 0

    def generate(self, request: common.GenerateRequest, metadata=()):
        self.requests.append(request)
        return self._Stream(self)

    class _Stream:
        def __init__(self, backend: ScriptedBackend):
            self._backend = backend
            self._items = iter(backend.script)

        def __aiter__(self):
            return self

        async def __anext__(self):
            item = next(self._items, None)
            if item is None:
                raise StopAsyncIteration
            if isinstance(item, BaseException):
                raise item
            return item

        async def aclose(self) -> None:
            self._backend.num_closed += 1


class Ledger:
    """UsageLedger's surface: final records (queued or settled) apart from the checkpoints (status open)."""

    checkpoint_interval_s = 3600.0

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []
        self.checkpoints: list[UsageRecord] = []
        self.num_settled = 0

    def record(self, record: UsageRecord) -> None:
        (self.checkpoints if record.status == "open" else self.records).append(record)

    async def settle(self, record: UsageRecord) -> bool:
        self.num_settled += 1
        self.record(record)
        return True


class Gatekeeper:
    def __init__(self) -> None:
        self.settled: list[int] = []

    def settle_soon(self, reservation, num_used_tokens: int) -> None:
        self.settled.append(num_used_tokens)


def _run(script: Sequence[StreamEvent | BaseException]):
    backend, ledger, gatekeeper, metrics = ScriptedBackend(script), Ledger(), Gatekeeper(), GatewayMetrics()
    ctx = GatewayContext(GatewaySettings(), backend, None, None, metrics, None, ledger)
    ticket = RouteTicket(Priority.BATCH, 123.0, 2.5, 3)
    job = Job.create("req-1", MODEL, PRINCIPAL, PROMPT, SamplingParams(max_tokens=8), 0.0, ticket)
    admitted = Admitted(ticket, object(), gatekeeper, len(PROMPT))
    return router_events(ctx, job, "tiny", admitted), backend, ledger, gatekeeper, metrics


def _completion_tokens(metrics: GatewayMetrics) -> float:
    return metrics.registry.get_sample_value("flotilla_gateway_tokens_total",
                                             {"model": "tiny", "tier": "paid", "kind": "completion"})


FINISHED = Finished(FinishReason.LENGTH, Usage(4, 3, 1), num_attempts=2, model_version="v1")


async def test_a_finished_stream_reaches_every_tap_once():
    events, backend, ledger, gatekeeper, metrics = _run([Chunk((100, 101), "a b "), Chunk((102,), "c"), FINISHED])
    generation = await collect(events)
    assert generation.text == "a b c" and generation.finished == FINISHED
    await events.aclose()
    await events.aclose()  # closing twice ends nothing twice
    (request,) = backend.requests
    assert list(request.prompt_token_ids) == PROMPT and request.model == "tiny"
    assert (request.cache_salt, request.tenant_id, request.key_id) == ("salt", "acme", "k1")
    assert (request.priority, request.deadline_unix_s) == (common.PRIORITY_CLASS_BATCH, 123.0)
    assert (request.max_queue_wait_s, request.tenant_weight) == (2.5, 3)
    assert backend.num_closed == 1 and gatekeeper.settled == [4 + 3] and _completion_tokens(metrics) == 3
    (record,) = ledger.records
    assert (record.status, record.output_tokens, record.input_tokens, record.cached_input_tokens) == ("ok", 3, 4, 1)
    assert (record.model, record.attempts, record.tenant, record.key_id) == ("tiny@v1", 2, "acme", "k1")
    assert ledger.num_settled == 1  # written before the Finished event reached the handler
    (opened,) = ledger.checkpoints  # at admission; not streamed: no checkpoint bills output
    assert (opened.status, opened.output_tokens, opened.request_id) == ("open", 0, record.request_id)


async def test_usage_the_router_left_out_is_counted_here():
    events, *_ = _run([Chunk((100, 101), "ab"), Finished(FinishReason.STOP, Usage(0, 0, 0), stop_sequence="x")])
    generation = await collect(events)
    assert generation.finished.usage == Usage(len(PROMPT), 2, 0) and generation.finished.stop_sequence == "x"


async def test_an_error_event_ends_the_stream_as_a_gateway_error():
    overloaded = Error(common.ERROR_CODE_OVERLOADED, "queue full", retry_after_s=2.0, num_attempts=1)
    events, backend, ledger, gatekeeper, _ = _run([overloaded])
    with pytest.raises(GatewayError) as err:
        await collect(events)
    assert err.value.code == "overloaded" and err.value.retry_after_s == 2.0
    assert backend.num_closed == 1 and gatekeeper.settled == [0]  # produced nothing: keeps nothing
    (record,) = ledger.records
    assert (record.status, record.error_code, record.attempts) == ("error", "ERROR_CODE_OVERLOADED", 1)


async def test_an_aborted_generation_is_an_error_that_keeps_what_was_produced():
    events, _, ledger, gatekeeper, _ = _run([Chunk((100,), "a"), Finished(FinishReason.ABORT, Usage(4, 1, 0))])
    with pytest.raises(GatewayError) as err:
        await collect(events)
    assert err.value.code == "aborted" and gatekeeper.settled == [4 + 1]
    assert (ledger.records[0].status, ledger.records[0].error_code) == ("error", "aborted")


async def test_a_failed_router_call_is_recorded_with_its_status():
    events, _, ledger, gatekeeper, _ = _run([Chunk((100,), "a"), rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")])
    with pytest.raises(GatewayError) as err:
        await collect(events)
    assert err.value.code == "unavailable" and gatekeeper.settled == [4 + 1]
    record = ledger.records[0]
    assert (record.status, record.error_code, record.output_tokens, record.attempts) == ("error", "RPC_UNAVAILABLE",
                                                                                           1, 1)


async def test_a_stream_closed_before_it_was_read_only_settles_the_quota():
    events, backend, ledger, gatekeeper, _ = _run([FINISHED])
    await events.aclose()
    assert gatekeeper.settled == [0] and backend.requests == [] and ledger.records == []
    with pytest.raises(StopAsyncIteration):
        await anext(events)


async def test_a_stream_closed_mid_way_is_recorded_as_cancelled():
    events, backend, ledger, gatekeeper, _ = _run([Chunk((100,), "a"), Chunk((101,), "b"), FINISHED])
    assert type(await anext(events)) is Chunk
    await events.aclose()
    assert backend.num_closed == 1 and gatekeeper.settled == [4 + 1]
    assert (ledger.records[0].status, ledger.records[0].output_tokens) == ("cancelled", 1)


async def test_a_stream_that_ends_without_a_result_is_an_internal_error():
    events, _, ledger, gatekeeper, _ = _run([Chunk((100,), "a")])
    with pytest.raises(GatewayError) as err:
        await collect(events)
    assert err.value.kind.status == 500 and gatekeeper.settled == [4 + 1]
    assert ledger.records[0].status == "cancelled"  # as the router's stream said nothing about its end
