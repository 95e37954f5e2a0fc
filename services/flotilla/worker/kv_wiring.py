"""Worker wiring for disaggregation: the KV hand-off (roles prefill and decode: the KVTransferService, and the
decode side WorkerService.Generate uses for a request that names a prefill worker), the role announced to the
router, and what is added to every load report: the prefix-cache hashes (all roles) and the hand-offs in
flight (roles prefill and decode)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2_grpc
from flotilla.engine.async_engine import AsyncEngine
from flotilla.rpc.options import address
from flotilla.rpc.tls import InternalTLS
from flotilla.worker.decode_side import DecodeSide
from flotilla.worker.kv_handoff import KVHandoff
from flotilla.worker.kv_service import KVTransferServicer
from flotilla.worker.kv_settings import DisaggSettings
from flotilla.worker.prefix_report import PrefixReporter
from flotilla.worker.service import WorkerService

_ROLES = {"both": pb.WORKER_ROLE_BOTH, "prefill": pb.WORKER_ROLE_PREFILL, "decode": pb.WORKER_ROLE_DECODE}


def role_proto(settings: DisaggSettings) -> int:
    return _ROLES[settings.role]


@dataclass
class KVWiring:
    handoff: KVHandoff | None
    reporter: PrefixReporter

    def decorate(self, report: pb.LoadReport) -> pb.LoadReport:
        if self.handoff is not None:  # a draining worker is stopped only once none is in flight
            report.num_kv_handoffs = len(self.handoff.incoming) + len(self.handoff.outgoing)
        return self.reporter.decorate(report)

    async def close(self) -> None:
        await self.reporter.stop()
        if self.handoff is not None:
            await self.handoff.close()


async def attach_kv_transfer(
    settings: DisaggSettings, engine: AsyncEngine, server: grpc.aio.Server, worker: WorkerService, host: str, port: int,
    tls: InternalTLS | None = None,
) -> KVWiring:
    """Call after bind() and before server.start()."""
    settings.validate()
    handoff = None
    if settings.transfers_kv:
        handoff = await KVHandoff.start(engine, settings, worker.worker_id, tls)
        worker.decode_side = DecodeSide(handoff, address(host, port), worker.metrics.kv_transfer, worker.model.name)
        kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server(KVTransferServicer(handoff, worker), server)
    reporter = PrefixReporter(engine)
    reporter.start()
    return KVWiring(handoff, reporter)
