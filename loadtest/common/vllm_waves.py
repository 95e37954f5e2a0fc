"""vLLM's CPU build kept loaded in its own interpreter, running a workload's waves one at a time when asked.

Why: on a shared VM a slow spell lasts seconds to minutes. Timed one system after the other, a spell can fall on
either one's run and moves their ratio by 10% or more. When each wave runs first on one system and then on the
other, a spell hits both within the same minute, and each wave gives a ratio of its own (`bench_engine.py
--alternate-waves`).

vLLM's processes do not go quiet when a wave ends: they kept running for a few seconds after it (0.4-0.95 CPU
seconds on 2 cores during the ~3 s that followed a tiny wave, against ~0.1 s when the engine's wave started 5 s
later), which would slow whatever runs next. So `run_wave` returns only once vLLM's process tree has gone quiet
(`wait_until_quiet`); the engine is quiet as soon as its `generate` returns (its OpenMP threads sleep).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time
from pathlib import Path

from loadtest.common.engine_workload import Workload
from loadtest.common.throughput import Throughput, wave_seconds_note
from loadtest.common.vllm_baseline import interpreter_missing, kill_group, last_lines, vllm_env, write_job

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
QUIET_WINDOW_S = 0.5  # vLLM counts as quiet when its processes used less than QUIET_SHARE of a core over this
QUIET_SHARE = 0.05
QUIET_LIMIT_S = 30.0  # and the next wave starts anyway after this long


def process_tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and every descendant alive now (Linux /proc)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:  # gone meanwhile
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(times.get(pid, 0.0) for pid in tree)


class VllmFailed(RuntimeError):
    """The child exited, said something else than expected, or did not answer in time."""


class VllmWaves:
    """Use as a context manager: `start()` loads vLLM (minutes), `run_wave(i)` times wave i there, `throughput()`
    sums the waves run. The child ends when the context exits."""

    def __init__(self, python: str, model_dir: str, workload: Workload, wave_size: int, num_threads: int,
                 kv_cache_gib: int, timeout_s: float) -> None:
        self.python, self.model_dir, self.workload, self.wave_size = python, model_dir, workload, wave_size
        self.num_threads, self.kv_cache_gib, self.timeout_s = num_threads, kv_cache_gib, timeout_s
        self.version = "?"
        self.wave_seconds: list[float] = []
        self.produced: list[int] = []
        self.settle_seconds: list[float] = []  # after each wave, until vLLM's processes went quiet
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-vllm-")
        self._stderr_path = Path(self._tmp.name) / "stderr.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._unread = b""  # stdout read but not yet split into lines

    def __enter__(self) -> VllmWaves:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._process is not None:
            if self._process.stdin:
                self._process.stdin.close()  # EOF: the child's loop ends
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            kill_group(self._process)  # vLLM's engine core and workers too, should any have outlived the child
        self._tmp.cleanup()

    def start(self) -> str | None:
        """Loads vLLM and waits until it is ready. Returns why it cannot run, or None."""
        if (missing := interpreter_missing(self.python)) is not None:
            return missing
        script, spec = write_job(self._tmp.name, self.model_dir, self.workload, None, self.wave_size,
                                  on_command=True)
        with open(self._stderr_path, "w") as stderr:  # a file, not a pipe: vLLM logs a lot and nobody reads it
            self._process = subprocess.Popen(
                [self.python, str(script), str(spec)], env=vllm_env(self.num_threads, self.kv_cache_gib),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, bufsize=0, start_new_session=True)
        try:
            self.version = self._next_message()["vllm_version"]
        except VllmFailed as failure:
            return str(failure)
        return None

    def run_wave(self, index: int) -> float:
        """Wave `index`'s seconds, as timed inside vLLM's process."""
        assert self._process is not None and self._process.stdin is not None, "start() first"
        try:
            self._process.stdin.write(f"{index}\n".encode())
        except BrokenPipeError:
            raise VllmFailed(f"vLLM exited with {self._process.wait()}: {self._stderr_tail()}") from None
        message = self._next_message()
        start = index * self.wave_size
        if message.get("wave") != index or message["produced"] != self.workload.max_tokens[start:start + self.wave_size]:
            raise VllmFailed(f"vLLM answered wave {index} with {str(message)[:200]}")
        self.wave_seconds.append(message["seconds"])
        self.produced += message["produced"]
        self.settle_seconds.append(self.wait_until_quiet())
        return message["seconds"]

    def wait_until_quiet(self) -> float:
        """Waits until vLLM's processes use (almost) no CPU; returns how long that took."""
        assert self._process is not None
        started = time.monotonic()
        used = process_tree_cpu_seconds(self._process.pid)
        while time.monotonic() - started < QUIET_LIMIT_S:
            time.sleep(QUIET_WINDOW_S)
            used, before = process_tree_cpu_seconds(self._process.pid), used
            if used - before < QUIET_SHARE * QUIET_WINDOW_S:
                break
        return time.monotonic() - started

    def throughput(self, num_requests: int) -> Throughput:
        note = (f"vllm {self.version}" + wave_seconds_note(self.wave_seconds)
                + "; quiet after " + ", ".join(f"{s:.1f}" for s in self.settle_seconds) + " s")
        return Throughput("vllm-cpu", sum(self.produced), sum(self.wave_seconds), num_requests, note)

    def _next_message(self) -> dict:
        """The child's next JSON line on stdout (other lines skipped), within the timeout. Reads the pipe itself,
        unbuffered: a buffered reader may hold the next line where select() cannot see it."""
        assert self._process is not None and self._process.stdout is not None
        deadline = time.monotonic() + self.timeout_s
        while True:
            while b"\n" in self._unread:
                line, self._unread = self._unread.split(b"\n", 1)
                if line.startswith(b"{"):
                    return json.loads(line)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._process.stdout], [], [], remaining)[0]:
                raise VllmFailed(f"vLLM did not answer within {self.timeout_s:.0f} s")
            chunk = os.read(self._process.stdout.fileno(), 1 << 16)
            if not chunk:
                raise VllmFailed(f"vLLM exited with {self._process.wait()}: {self._stderr_tail()}")
            self._unread += chunk

    def _stderr_tail(self) -> str:
        return last_lines(self._stderr_path.read_text(errors="replace"))
