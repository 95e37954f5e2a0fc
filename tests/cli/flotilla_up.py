"""`flotilla up` as a user runs it: a subprocess with a YAML config and an API key in the environment, whose
stdout says where the gateway is and whose <state dir>/status.json says each service's pid and port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openai
import yaml

import flotilla.models
from flotilla.fleet.certs import FleetCerts
from flotilla.rpc.options import sync_channel

from tests.support.fleet import NO_OUTPUT_CHECK, router_workers
from tests.support.waiting import wait_until

LIBS_DIR = Path(flotilla.models.__file__).resolve().parents[2]
SERVICES_DIR = LIBS_DIR.parent / "services"
START_TIMEOUT_S = 120.0
API_KEY = "sk-flotilla-up-test"


@dataclass
class FlotillaUp:
    popen: subprocess.Popen
    state_dir: Path
    stdout_path: Path
    stderr_path: Path
    url: str = ""

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def status(self) -> dict:
        return json.loads((self.state_dir / "status.json").read_text())

    def pid(self, service: str) -> int:
        return self.status()["services"][service]["pid"]

    @property
    def router_address(self) -> str:
        return self.address_of("router")

    def address_of(self, service: str) -> str:
        return f"127.0.0.1:{self.status()['services'][service]['port']}"

    def router_workers(self, router: str = "router") -> dict:
        # `flotilla up` made its own CA in its state dir: speak to its router as an operator of that CA
        tls = FleetCerts(self.state_dir).client("operator", "chaos-test")
        address = self.address_of(router)
        return router_workers(address, sync_channel(address, tls, "router"))

    def kill(self, service: str) -> int:
        """kill -9 of one service; returns the pid killed."""
        pid = self.pid(service)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_said(self, text: str, timeout_s: float = 60.0) -> None:
        wait_until(lambda: text in self.stderr, timeout_s, lambda: f"{text!r} on stderr; it has:\n{self.stderr}",
                   interval_s=0.05)

    def child_pids(self) -> list[int]:
        return [service["pid"] for service in self.status()["services"].values()]

    def child_ports(self) -> list[int]:
        """Every port a service of the fleet wrote to its port files (gRPC, HTTP and /metrics)."""
        return [int(path.read_text()) for path in (self.state_dir / "ports").glob("*.port")]

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(60)


def start_flotilla_up(checkpoint: Path, state_dir: Path, *flags: str, **settings) -> FlotillaUp:
    """`flotilla up --model-dir checkpoint --port 0 ...` with `settings` in a --config YAML file; returns once
    it says the fleet is up. The workers' golden-output check is off (tests/support/fleet.py says why)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    settings["worker_args"] = [*NO_OUTPUT_CHECK, *settings.get("worker_args", [])]
    config = state_dir / "up.yaml"
    config.write_text(yaml.safe_dump(settings))
    env = dict(os.environ, FLOTILLA_API_KEY=API_KEY)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIBS_DIR), str(SERVICES_DIR), env.get("PYTHONPATH")]))
    stdout_path, stderr_path = state_dir / "up.stdout", state_dir / "up.stderr"
    with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
        popen = subprocess.Popen(
            [sys.executable, "-m", "flotilla.cli", "up", "--model-dir", str(checkpoint), "--state-dir",
             str(state_dir), "--port", "0", "--config", str(config), *flags],
            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env, cwd=state_dir,
        )  # fmt: skip
    up = FlotillaUp(popen, state_dir, stdout_path, stderr_path)

    def started() -> str | None:
        if popen.poll() is not None:
            raise AssertionError(f"flotilla up exited with {popen.returncode}:\n{up.stderr}")
        match = re.search(r"Flotilla is up: gateway (http://\S+),", stdout_path.read_text())
        return match and match.group(1)

    try:
        up.url = wait_until(started, START_TIMEOUT_S, lambda: f"flotilla up to start:\n{up.stderr}", interval_s=0.1)
    except BaseException:
        up.stop()
        raise
    return up


def is_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def is_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def openai_client(up: FlotillaUp) -> openai.AsyncOpenAI:
    """The real openai SDK against the fleet's gateway, as a user holds it (no retries of its own)."""
    return openai.AsyncOpenAI(base_url=f"{up.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


async def chat_stream(oai: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, on_chunk=None) -> str:
    """One greedy streamed chat's text; `on_chunk(n)` after the n-th chunk with content."""
    stream = await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0, stream=True)
    text, chunks = "", 0
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                chunks += 1
                if on_chunk is not None:
                    on_chunk(chunks)
    return text
