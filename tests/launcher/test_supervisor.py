"""FleetSupervisor's decisions over a real LocalFleet holding scripted services (no processes): what dies is
restarted after its backoff and announced, a crash loop stops the fleet with the log's last lines, and a
worker the autoscaler stopped on purpose stays stopped. (`flotilla up` itself: tests/cli/test_up_chaos.py.)"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from flotilla.fleet.launcher import FleetLauncher
from flotilla.fleet.local import FleetConfig, LocalFleet
from flotilla.fleet.restarts import RestartPolicy
from flotilla.fleet.supervisor import FleetSupervisor


class ScriptedService:
    """What the supervisor uses of a ServiceProcess; `die()` plays a crash, the port file appears at once."""

    def __init__(self, name: str, log_path: Path):
        self.name, self.log_path = name, log_path
        self.running, self.returncode, self.port = True, None, 1000
        self.pid, self.starts, self.notes = 1, 0, []
        self.serving = True  # its port file is written

    def is_running(self) -> bool:
        return self.running

    def die(self, returncode: int = -9) -> None:
        self.running, self.returncode, self.serving = False, returncode, False

    def start(self) -> None:
        self.running, self.returncode, self.serving = True, None, False
        self.starts += 1
        self.pid += 1

    def stop(self) -> None:
        self.die(0)

    def poll_port(self) -> int | None:
        return self.port if self.serving else None

    def note(self, line: str) -> None:
        self.notes.append(line)

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-num_lines:])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fleet(tmp_path) -> LocalFleet:
    fleet = LocalFleet(FleetConfig(model_dir=tmp_path, state_dir=tmp_path))
    fleet.routers = [ScriptedService("router", tmp_path / "router.log")]
    fleet.gateway = ScriptedService("gateway", tmp_path / "gateway.log")
    fleet.workers = [ScriptedService(f"worker-{i}", tmp_path / f"worker-{i}.log") for i in range(2)]
    return fleet


def supervisor(fleet: LocalFleet, clock: Clock, said: list[str], **policy) -> FleetSupervisor:
    return FleetSupervisor(fleet, RestartPolicy(**policy), said.append, clock)


def test_a_dead_worker_is_restarted_after_its_backoff_and_counted(fleet):
    clock, said = Clock(), []
    keeper = supervisor(fleet, clock, said, first_delay_s=0.5)
    victim = fleet.workers[1]
    assert keeper.check() is None and said == []  # all running: nothing to do
    victim.die(-9)
    keeper.check()
    assert said == ["worker-1 exited (killed by SIGKILL); restarting it in 0.5 s (restart 1 of at most 5 within 60 s)"]
    clock.now += 0.4
    keeper.check()
    assert victim.starts == 0  # not yet
    clock.now += 0.1
    keeper.check()
    assert victim.starts == 1 and victim.notes == ["flotilla up: restart 1 after killed by SIGKILL"]
    assert said[-1] == "worker-1 restarted (pid 2)"
    status = json.loads(keeper.status_path.read_text())
    assert status["services"]["worker-1"] == {"pid": 2, "port": 1000, "state": "starting", "restarts": 1}
    victim.serving = True  # its port file appeared
    keeper.check()
    assert said[-1] == "worker-1 is serving again (pid 2, port 1000); restarts: worker-1 1, fleet 1"
    status = json.loads(keeper.status_path.read_text())
    assert status["restarts"] == 1 and status["services"]["worker-1"]["state"] == "running"
    assert keeper.restarts == {"gateway": 0, "worker-0": 0, "worker-1": 1, "router": 0}


def test_the_second_restart_waits_twice_as_long(fleet):
    clock, said = Clock(), []
    keeper = supervisor(fleet, clock, said, first_delay_s=1)
    router = fleet.router
    for expected_delay in (1, 2):
        router.die(1)
        keeper.check()
        assert f"router exited (exit code 1); restarting it in {expected_delay:.1f} s" in said[-1]
        clock.now += expected_delay
        keeper.check()
        assert router.is_running()
    assert router.starts == 2


def test_a_service_that_keeps_crashing_stops_the_fleet_with_its_last_log_lines(fleet, tmp_path):
    clock, said = Clock(), []
    (tmp_path / "gateway.log").write_text("".join(f"line {i}\n" for i in range(40)) + "OSError: boom\n")
    keeper = supervisor(fleet, clock, said, max_restarts=1, window_s=60, first_delay_s=0)
    fleet.gateway.die(1)
    assert keeper.check() is None
    keeper.check()
    assert fleet.gateway.starts == 1
    fleet.gateway.die(1)
    clock.now += 10
    message = keeper.check()
    assert message.startswith("gateway keeps crashing: it exited (exit code 1) 2 times within 60 s; stopping the fleet. "
                              f"The last lines of {tmp_path / 'gateway.log'}:\n")
    assert message.endswith("line 39\nOSError: boom") and "line 20\n" not in message  # the last 20 lines
    assert fleet.gateway.starts == 1


def test_run_returns_1_on_a_crash_loop_and_0_when_stopped(fleet, tmp_path):
    said = []
    (tmp_path / "worker-0.log").write_text("Traceback ...\n")
    fleet.workers[0].die(1)
    assert FleetSupervisor(fleet, RestartPolicy(max_restarts=0), said.append).run(threading.Event()) == 1
    assert said[-1].startswith("worker-0 keeps crashing") and said[-1].endswith("Traceback ...")
    stop = threading.Event()
    stop.set()
    assert FleetSupervisor(fleet, RestartPolicy(), said.append).run(stop) == 0


def test_a_worker_the_autoscaler_stopped_is_not_restarted(fleet):
    clock, said = Clock(), []
    keeper = supervisor(fleet, clock, said, first_delay_s=0)
    leaving = fleet.workers[0]
    stopper = FleetLauncher(fleet)
    stopper.stop_replica("worker-0")  # as LocalSupervisor does once the worker drained
    for thread in threading.enumerate():
        if thread.name == "stop-worker-0":
            thread.join()
    assert not leaving.is_running()
    for _ in range(3):
        clock.now += 1
        assert keeper.check() is None
    assert leaving.starts == 0 and said == []
    assert "worker-0" not in json.loads(keeper.status_path.read_text())["services"]
