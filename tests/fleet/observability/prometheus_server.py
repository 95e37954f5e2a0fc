"""A real Prometheus server (the Debian `prometheus` binary) for tests: a generated config that scrapes
the given targets every second, a fresh TSDB directory, a free loopback port; stopped after the test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import yaml

from flotilla.rpc.options import free_port

from tests.support.waiting import wait_until

READY_TIMEOUT_S = 60.0


class PrometheusServer:
    def __init__(self, directory: Path, targets: dict[str, str], scrape_interval_s: int = 1):
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("the prometheus binary is missing: `make prometheus` installs Debian's package")
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": f"{scrape_interval_s}s", "scrape_timeout": f"{scrape_interval_s}s"},
            "scrape_configs": [{"job_name": name, "static_configs": [{"targets": [target]}]}
                               for name, target in sorted(targets.items())],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._args = [
            binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
        ]  # fmt: skip
        self._process: subprocess.Popen | None = None

    def start(self) -> PrometheusServer:
        self._log = open(self.directory / "prometheus.log", "wb")
        self._process = subprocess.Popen(self._args, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        try:
            wait_until(self._ready, READY_TIMEOUT_S, lambda: f"prometheus to be ready:\n{self.log_tail()}",
                       interval_s=0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        if self._process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self._process.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()

    def query(self, promql: str) -> list[dict]:
        """The result vector of an instant query."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5.0)
        response.raise_for_status()
        body = response.json()
        if body["status"] != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        return body["data"]["result"]

    def scalar(self, promql: str) -> float | None:
        """The single value of a query that yields at most one series (None while it yields none)."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_for_value(self, promql: str, expected: float, timeout_s: float = 30.0) -> float:
        """Polls until the query yields `expected` and returns it; the timeout names the last value and the
        health of every target."""
        wait_until(lambda: self.scalar(promql) == expected, timeout_s,
                   lambda: f"{promql} = {expected} (now {self.scalar(promql)}; targets {self.targets_up()})",
                   interval_s=0.25)
        return expected

    def targets_up(self) -> dict[str, str]:
        response = httpx.get(f"{self.url}/api/v1/targets", timeout=5.0).json()
        return {t["labels"]["job"]: t["health"] for t in response["data"]["activeTargets"]}

    def log_tail(self) -> str:
        path = self.directory / "prometheus.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
