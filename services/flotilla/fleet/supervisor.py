"""`flotilla up` keeps its fleet up: a service that dies is started again after a backoff, until one keeps crashing.

A dead worker's streams resume on the other workers (the router's failover); its restart registers with the
router again under the same worker id. A restarted router binds its old port and forgets every worker, which
register again at their next heartbeat (the router answers "unknown"); a restarted gateway binds its old port
and its clients retry. A worker the autoscaler stopped on purpose has left `fleet.workers` first
(`LocalFleet.retire_worker`), so it is never restarted. Every change is written to <state dir>/status.json
(pid, port, state and restarts per service) and said in one line on the launcher's stderr.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flotilla.fleet.local import LocalFleet
from flotilla.fleet.process import ServiceProcess
from flotilla.fleet.restarts import RestartHistory, RestartPolicy

CHECK_INTERVAL_S = 0.2
LOG_LINES = 20  # of a crash-looping service's log, in the launcher's last words


@dataclass
class _Watched:
    history: RestartHistory
    restart_at: float | None = None  # dead, restarting then
    starting: bool = False  # restarted, its port file not written yet


def say_on_stderr(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


class FleetSupervisor:
    def __init__(self, fleet: LocalFleet, policy: RestartPolicy = RestartPolicy(),
                 say: Callable[[str], None] = say_on_stderr, clock: Callable[[], float] = time.monotonic):
        self._fleet = fleet
        self._policy = policy
        self._say = say
        self._clock = clock
        self._watched: dict[str, _Watched] = {}
        self._written: dict | None = None  # the status last written
        self.status_path = Path(fleet.config.state_dir) / "status.json"

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, by service name (services the autoscaler retired included)."""
        return {name: watched.history.total for name, watched in self._watched.items()}

    def run(self, stop: threading.Event) -> int:
        """Until `stop` is set (0) or a service keeps crashing (1, said with the tail of its log)."""
        self._write_status()
        while not stop.wait(CHECK_INTERVAL_S):
            crash_loop = self.check()
            if crash_loop is not None:
                self._say(crash_loop)
                return 1
        return 0

    def check(self) -> str | None:
        """One pass: restart the dead services that are due. Returns why the fleet must stop, or None."""
        now = self._clock()
        with self._fleet.lock:  # the autoscaler neither adds nor retires a worker meanwhile
            for service in self._fleet.services():
                watched = self._watched.setdefault(service.name, _Watched(RestartHistory(self._policy)))
                if service.is_running():
                    self._check_started(service, watched)
                elif watched.restart_at is None:
                    if not self._schedule_restart(service, watched, now):
                        return self._crash_loop(service)
                elif now >= watched.restart_at:
                    self._restart(service, watched)
        self._write_status()
        return None

    def _schedule_restart(self, service: ServiceProcess, watched: _Watched, now: float) -> bool:
        """False when the service keeps crashing."""
        watched.starting = False
        delay = watched.history.after_exit(now)
        if delay is None:
            return False
        watched.restart_at = now + delay
        self._say(f"{service.name} exited ({_exit_reason(service.returncode)}); restarting it in {delay:.1f} s "
                  f"(restart {watched.history.num_recent} of at most {self._policy.max_restarts} within "
                  f"{self._policy.window_s:g} s)")
        return True

    def _check_started(self, service: ServiceProcess, watched: _Watched) -> None:
        if not watched.starting or service.poll_port() is None:
            return
        watched.starting = False
        total = sum(self.restarts.values())
        self._say(f"{service.name} is serving again (pid {service.pid}, port {service.port}); restarts: "
                  f"{service.name} {watched.history.total}, fleet {total}")

    def _restart(self, service: ServiceProcess, watched: _Watched) -> None:
        service.note(f"flotilla up: restart {watched.history.total} after {_exit_reason(service.returncode)}")
        service.start()
        watched.restart_at, watched.starting = None, True
        self._say(f"{service.name} restarted (pid {service.pid})")

    def _crash_loop(self, service: ServiceProcess) -> str:
        return (f"{service.name} keeps crashing: it exited ({_exit_reason(service.returncode)}) "
                f"{self._policy.max_restarts + 1} times within {self._policy.window_s:g} s; stopping the fleet. "
                f"The last lines of {service.log_path}:\n{service.log_tail(LOG_LINES)}")

    def _write_status(self) -> None:
        """<state dir>/status.json, when anything in it changed (a restart, a worker added or retired)."""
        services = {}
        for service in self._fleet.services():
            watched = self._watched.get(service.name)
            state = "running" if service.is_running() else "restarting"
            if watched is not None and watched.starting:
                state = "starting"
            services[service.name] = {"pid": service.pid, "port": service.port, "state": state,
                                      "restarts": watched.history.total if watched else 0}
        status = {"services": services, "restarts": sum(self.restarts.values())}
        if status == self._written:
            return
        self._written = status
        temporary = self.status_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(status, indent=2) + "\n")
        temporary.replace(self.status_path)  # readers never see half a file


def _exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "not started"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
