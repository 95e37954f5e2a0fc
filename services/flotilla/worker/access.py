"""Who may call which worker method, by the role in the caller's certificate (rpc/tls.py enforces it): the
router, and gateways holding a placement lease (service.py checks it), run requests here; workers hand KV
to each other; the operator and exec probes (which run with
the pod's own certificate) read health and load."""

from __future__ import annotations

_WORKER = "/flotilla.worker.v1.WorkerService/{}"
_BATCH = "/flotilla.worker.v1.FixedBatchService/{}"
_KV = "/flotilla.kvtransfer.v1.KVTransferService/{}"

WORKER_POLICY: dict[str, tuple[str, ...]] = {
    _WORKER.format("Generate"): ("router", "gateway"),
    _WORKER.format("GenerateSession"): ("router", "gateway"),
    _WORKER.format("Abort"): ("router",),
    _WORKER.format("Health"): ("router", "operator", "worker"),
    _WORKER.format("GetLoad"): ("router", "operator"),
    _WORKER.format("LoadModel"): ("router",),  # a shared-pool worker's on-demand load
    _BATCH.format("RunBatch"): ("router",),
    # A peer learns this pool's NIXL metadata only for a hand-off it is part of (kv_service.py checks the
    # transfer id); RemotePrefill and its abort come from the decode worker of the hand-off.
    _KV.format("GetTransferInfo"): ("worker",),
    _KV.format("RemotePrefill"): ("worker",),
    _KV.format("AbortRemotePrefill"): ("worker",),
    _KV.format("GetKVState"): ("operator", "worker"),
}
