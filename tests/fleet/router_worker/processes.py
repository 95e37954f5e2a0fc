"""Router and workers as real subprocesses (`python -m flotilla.cli ...`) on loopback, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.rpc.options import read_port_file


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    port_file: Path
    log_file: Path
    port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")[-4000:]

    def wait_serving(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (port := read_port_file(self.port_file)) is None:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not serving after {timeout_s}s:\n{self.log()}")
            time.sleep(0.02)
        self.port = port

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@dataclass
class Fleet:
    directory: Path
    services: dict[str, Service] = field(default_factory=dict)

    def start(self, name: str, *args: str) -> Service:
        port_file = self.directory / f"{name}.port"
        log_file = self.directory / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(log_file, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "flotilla.cli", *args, "--port-file", str(port_file)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        service = Service(name, process, port_file, log_file)
        self.services[name] = service
        return service

    def stop_all(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()
