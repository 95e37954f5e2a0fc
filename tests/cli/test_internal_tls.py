"""The services' internal-transport flags as processes: mTLS or an explicit, loudly logged --insecure-internal,
never plaintext by default; `flotilla probe` calls with the pod's own certificate (--tls-dir)."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.rpc.tls import INSECURE_WARNING

from tests.support.fleet import start_service
from tests.support.tls import identity_dir


def test_a_service_without_certificates_or_the_insecure_flag_does_not_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FLOTILLA_TLS_DIR"}
    for service in ("router", "gateway --router 127.0.0.1:1 --no-auth"):
        result = subprocess.run([sys.executable, "-m", "flotilla.cli", *service.split(), "--port", "0"],
                                capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode != 0
        assert "needs mTLS certificates: --tls-dir DIR" in result.stderr and "--insecure-internal" in result.stderr
    result = subprocess.run([sys.executable, "-m", "flotilla.cli", "router", "--tls-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0 and "ca.crt" in result.stderr  # one line naming the missing file


def test_insecure_internal_serves_plaintext_and_warns(tmp_path):
    router = start_service(tmp_path, "router", "router", "--insecure-internal")
    try:
        with grpc.insecure_channel(router.address) as channel:  # anyone, no certificate: what the flag means
            router_pb2_grpc.RouterServiceStub(channel).ListWorkers(rpb.ListWorkersRequest(), timeout=5)
        assert INSECURE_WARNING in router.log_tail()
    finally:
        router.stop()


def test_probe_calls_with_the_pods_own_certificate(tmp_path):
    router = start_service(tmp_path, "router", "router")
    try:
        probe = [sys.executable, "-m", "flotilla.cli", "probe", "router", router.address, "--timeout-s", "5"]
        with_cert = subprocess.run([*probe, "--tls-dir", str(identity_dir("router", "router"))],
                                   capture_output=True, text=True, timeout=60)
        assert with_cert.returncode == 0, with_cert.stderr
        env = {k: v for k, v in os.environ.items() if k != "FLOTILLA_TLS_DIR"}
        without = subprocess.run(probe, capture_output=True, text=True, timeout=60, env=env)
        assert without.returncode == 1 and "unreachable" in without.stderr
    finally:
        router.stop()
