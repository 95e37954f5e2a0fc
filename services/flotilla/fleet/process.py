"""One service as a child process: started with a port file, waited for, stopped politely then firmly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.fleet import lifeline
from flotilla.rpc.options import read_port_file


class ProcessFailed(RuntimeError):
    """A child exited while we waited for it; the message carries the tail of its log."""


@dataclass
class ServiceProcess:
    name: str
    args: list[str]  # arguments of `python -m flotilla.cli`
    log_path: Path
    port_file: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    port: int | None = None  # known once wait_port (or poll_port) saw the port file
    # A restart binds the port the first start got: for services others dial (router, gateway). Without
    # it a restart takes any free port (a worker registers its new address with the router).
    keep_port: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port_file.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        same_port = ["--port", str(self.port)] if self.keep_port and self.port else []  # the last --port wins
        if not self.keep_port:
            self.port = None
        log = open(self.log_path, "ab")
        lifeline_fd = lifeline.child_fd()  # it exits when this process does, even on SIGKILL
        # Own session: a Ctrl-C in the terminal reaches only the launcher, which stops children in order.
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "flotilla.cli", *self.args, *same_port, "--port-file", str(self.port_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env, lifeline.ENV_VAR: str(lifeline_fd)},
            start_new_session=True,
            pass_fds=(lifeline_fd,),
        )
        log.close()

    def note(self, line: str) -> None:
        """Append one line of the launcher's to the service's log (why it was restarted)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"--- {line} ---\n")

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen else -1

    def is_running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def poll_port(self) -> int | None:
        """The port once the service wrote its port file (it serves), else None; never waits."""
        port = read_port_file(self.port_file)
        if port is not None:
            self.port = port
        return port

    def wait_port(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self.poll_port()
            if port is not None:
                return port
            if not self.is_running():
                raise ProcessFailed(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        raise ProcessFailed(f"{self.name} did not start within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (graceful), then SIGKILL after timeout_s."""
        if not self.is_running():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def kill(self) -> None:
        """SIGKILL at once (failure tests)."""
        if self.is_running():
            self.popen.kill()
            self.popen.wait()

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except FileNotFoundError:
            return "(no log)"
