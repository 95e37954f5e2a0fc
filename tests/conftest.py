"""Suite-wide settings, shared fixtures and the unit tier.

One torch thread per process: the suite runs several processes at once (workers, router, gateway, transformers
as the reference) on a 2-core machine, where OpenMP threads that spin while waiting for a busy core make every
process several times slower.

Triton kernels (flotilla/engine/model/triton_attention.py) run under Triton's interpreter (TRITON_INTERPRET=1).

The unit tier (`make test-unit`, `pytest -m unit`, under a minute): the tests under UNIT_PATHS (less SLOW_PATHS)
start no process and open no socket, and while one runs, connecting or binding a socket, starting a process or a
gRPC server raises. A test there that needs one is marked `@pytest.mark.integration`; every other test is marked
`integration` here.
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the service processes the tests start
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run under Triton's CPU interpreter here. It must be set before anything imports triton (torch and
# transformers may): triton.language's own helpers are wrapped for the interpreter at import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import grpc  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Shared checkpoint fixtures: `tiny_checkpoint` (one tiny llama, seed 0, read-only) and `checkpoint_factory`.
from tests.support.checkpoints import checkpoint_factory, tiny_checkpoint  # noqa: E402,F401
# The trained default model (SmolLM2-135M-Instruct), converted once, and transformers' greedy answers on it.
from tests.support.trained_model import trained_checkpoint, trained_reference  # noqa: E402,F401
from tests.support.redis_server import redis_server, redis_server_factory, redis_url  # noqa: E402,F401  (real Redis)

TESTS = Path(__file__).resolve().parent
# Folders and modules of the unit tier, relative to tests/.
UNIT_PATHS = (
    "autoscaler",
    "autoscaling",
    "engine",
    "gateway/test_conversation_key.py",
    "gateway/test_degradation.py",
    "gateway/test_error_mapping.py",
    "gateway/test_field_support.py",
    "gateway/test_model_registry.py",
    "gateway/test_safety_rules.py",
    "gateway/test_sse.py",
    "gateway/test_tool_parsers.py",
    "kv_transfer/test_affinity_and_arrivals.py",
    "kv_transfer/test_cancel_safety.py",
    "kv_transfer/test_quarantine.py",
    "kv_transfer/test_write_checks.py",
    "launcher",
    "loadtest/test_workload.py",
    "models",
    "observability",
    "operator/test_manifests.py",
    "operator/test_model_route_plan.py",
    "operator/test_pod_policy.py",
    "operator/test_ratio.py",
    "operator/test_scaler.py",
    "router",
    "rpc/test_convert.py",
    "rpc/test_tls.py",
    "usage",
    "worker/test_kv_handoff_peer_checks.py",
    "worker/test_model_cache.py",
    "worker/test_shared_catalog.py",
)
# ... but not these: whole generations (and transformers' reference for them) take minutes on a CPU.
SLOW_PATHS = ("engine/test_exactness.py", "engine/test_requests.py", "engine/test_resume.py",
              "engine/test_trained_model.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") is None:
            is_unit = _under(item.path, UNIT_PATHS) and not _under(item.path, SLOW_PATHS)
            item.add_marker(pytest.mark.unit if is_unit else pytest.mark.integration)


def _under(path: Path, paths: tuple[str, ...]) -> bool:
    relative = path.resolve().relative_to(TESTS)
    return any(relative == Path(p) or Path(p) in relative.parents for p in paths)


class UnitTierViolation(RuntimeError):
    """A unit test opened a socket or started a process: mark it `integration` (or keep it from doing that)."""


@pytest.fixture(autouse=True)
def _unit_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a unit test, every way the suite has of reaching the network or another process raises."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(what: str):
        def refused(*args, **kwargs):
            raise UnitTierViolation(f"a unit test may not {what} (tests/conftest.py, UNIT_PATHS)")

        return refused

    for method in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, method, refuse(f"{method} a socket"))
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("start a process"))
    monkeypatch.setattr(os, "fork", refuse("fork"))
    monkeypatch.setattr(os, "posix_spawn", refuse("start a process"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("start a process"))
    monkeypatch.setattr(grpc, "server", refuse("start a gRPC server"))
    monkeypatch.setattr(grpc.aio, "server", refuse("start a gRPC server"))
