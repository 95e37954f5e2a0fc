"""An FlotillaPool's spec, typed: the policy for the control law and what the worker pods run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.autoscaling.policy import PoolPolicy, RoleThroughput

GROUP = "flotilla.dev"
VERSION = "v1alpha1"
PLURAL = "flotillapools"
KIND = "FlotillaPool"
ROLES = {"both": pb.WORKER_ROLE_BOTH, "prefill": pb.WORKER_ROLE_PREFILL, "decode": pb.WORKER_ROLE_DECODE}
# The router's pool labels (router/context_pools.py): "" is every pool of the model and role, as before pools.
POOLS = ("", "default", "long-context")


class InvalidPoolSpec(ValueError):
    """The spec cannot be reconciled (the CRD schema should have caught it; an operator never trusts that)."""


@dataclass(frozen=True)
class ModelRef:
    name: str
    version: str
    checkpoint: str  # path inside the pod (a volume) where the Hugging Face checkpoint lives


@dataclass(frozen=True)
class WorkerTemplate:
    image: str
    resources: dict[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()  # extra `flotilla worker` flags
    env: tuple[dict[str, Any], ...] = ()
    port: int = 50051
    volumes: tuple[dict[str, Any], ...] = ()
    volume_mounts: tuple[dict[str, Any], ...] = ()
    tls_secret: str = ""  # this pool's own worker certificate (its identity); "": the operator's default


@dataclass(frozen=True)
class PoolSpec:
    model: ModelRef
    role: str
    policy: PoolPolicy
    worker: WorkerTemplate
    router_address: str  # "" : the operator's default
    signals_window_s: float
    # Per-replica tokens/s of each role (loadtest figures): weigh the token mix into the prefill:decode ratio.
    throughput: RoleThroughput = RoleThroughput(1.0, 1.0)
    # Its workers' pool label (`flotilla worker --pool`): the pool is scaled on that pool's own signals (its
    # workers, its queue lane) and steers only its workers. "": every worker of the model and role.
    pool: str = ""

    def owns(self, worker: rpb.WorkerInfo) -> bool:
        """Whether a registered worker is one of this pool's (same role and, when the spec names one, pool)."""
        if worker.role != ROLES[self.role]:
            return False
        return not self.pool or (worker.pool or "default") == self.pool


def parse_spec(spec: dict[str, Any]) -> PoolSpec:
    try:
        model = spec["model"]
        replicas = spec.get("replicas", {})
        targets = spec.get("targets", {})
        scaling = spec.get("scaling", {})
        worker = spec["worker"]
        role = spec.get("role", "both")
        if role not in ROLES:
            raise InvalidPoolSpec(f"role must be one of {sorted(ROLES)}, not {role!r}")
        pool = spec.get("pool", "")
        if pool not in POOLS:
            raise InvalidPoolSpec(f"pool must be one of {POOLS[1:]} (or unset), not {pool!r}")
        policy = PoolPolicy(
            min_replicas=int(replicas.get("min", 1)),
            max_replicas=int(replicas.get("max", 4)),
            warm_replicas=int(replicas.get("warm", 0)),
            target_queued_tokens_per_replica=int(targets.get("queuedTokensPerReplica", 2048)),
            target_kv_utilisation=float(targets.get("kvUtilisation", 0.8)),
            ttft_p95_slo_s=float(targets.get("ttftP95Seconds", 2.0)),
            scale_up_cooldown_s=float(scaling.get("scaleUpCooldownSeconds", 0)),
            scale_down_cooldown_s=float(scaling.get("scaleDownCooldownSeconds", 300)),
            hysteresis=float(scaling.get("hysteresis", 0.2)),
            max_scale_down_step=int(scaling.get("maxScaleDownStep", 1)),
            scale_to_zero_idle_s=float(scaling.get("scaleToZeroAfterIdleSeconds", 600)),
        )
        return PoolSpec(
            model=ModelRef(model["name"], model.get("version", ""), model["checkpoint"]),
            role=role,
            policy=policy,
            worker=WorkerTemplate(
                image=worker["image"],
                resources=dict(worker.get("resources", {})),
                args=tuple(str(a) for a in worker.get("args", [])),
                env=tuple(worker.get("env", [])),
                port=int(worker.get("port", 50051)),
                volumes=tuple(worker.get("volumes", [])),
                volume_mounts=tuple(worker.get("volumeMounts", [])),
                tls_secret=str(worker.get("tlsSecret", "")),
            ),
            router_address=spec.get("routerAddress", ""),
            signals_window_s=float(scaling.get("signalsWindowSeconds", 60)),
            throughput=RoleThroughput(float(scaling.get("prefillTokensPerSecond", 1.0)),
                                      float(scaling.get("decodeTokensPerSecond", 1.0))),
            pool=pool,
        )
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, InvalidPoolSpec):
            raise
        raise InvalidPoolSpec(f"bad FlotillaPool spec: {error!r}") from None
