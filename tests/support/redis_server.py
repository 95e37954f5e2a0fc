"""A real Redis server (Debian's redis-server) for tests: free 127.0.0.1 port, started and stopped by
the fixture, restartable on the same port with its data (saved on a clean stop)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import redis

from tests.support.waiting import wait_until

START_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    def __init__(self, data_dir: Path, port: int | None = None):
        self.data_dir = data_dir
        self.port = port or free_port()
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it: `make redis-server`)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
                "--save", "3600 1", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
                "--logfile", str(self.data_dir / "redis.log")]
        self.popen = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)

        def answers() -> bool:
            if self.popen.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.popen.returncode}: {self.log_tail()}")
            return client.ping()

        try:
            wait_until(answers, START_TIMEOUT_S, lambda: f"redis-server to answer PING: {self.log_tail()}",
                       interval_s=0.02, ignore=(redis.exceptions.ConnectionError,))
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM: Redis saves its data (a save point is configured) and exits."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def is_running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def flush(self) -> None:
        with redis.Redis(port=self.port) as client:
            client.flushall()

    def log_tail(self) -> str:
        try:
            return (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
        except FileNotFoundError:
            return "(no log)"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> RedisServer:
    """One Redis for the session; tests that need a clean one call `flush()` (see `redis_url`)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session Redis, emptied for this test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def redis_server_factory(tmp_path_factory):
    """Own servers for tests that stop and restart them; all stopped at the end."""
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        servers.append(RedisServer(tmp_path_factory.mktemp("redis-own")).start())
        return servers[-1]

    yield make
    for server in servers:
        server.stop()
