"""Nothing of vLLM's process tree outlives the benchmark that started it: its engine core and workers are the
child's children, so killing the child alone (a timeout) or the benchmark (Ctrl-C, a kill) used to leave them
running, busy on a core."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loadtest.common.vllm_baseline import DIE_WITH_PARENT, run_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")

# The child as the benchmark writes it (the watchdog first), with a grandchild standing in for vLLM's engine core;
# both pids go to argv[1] once the grandchild runs.
CHILD = DIE_WITH_PARENT + textwrap.dedent("""
    import subprocess, sys, time
    if __name__ == "__main__":
        die_with_parent()
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open(sys.argv[1], "w") as pids:
            pids.write(f"{_os.getpid()} {grandchild.pid}")
        time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_for_pids(path: Path) -> list[int]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count(" ") == 1:
            return [int(pid) for pid in path.read_text().split()]
        time.sleep(0.05)
    raise AssertionError("the child never wrote its pids")


def _gone_soon(pids: list[int], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_the_tree_dies_when_the_benchmark_is_killed(tmp_path):
    script, pids_file = tmp_path / "child.py", tmp_path / "pids"
    script.write_text(CHILD)
    # The benchmark stand-in starts the child as the benchmark does, then is killed without any chance to clean up.
    benchmark = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, {str(script)!r}, {str(pids_file)!r}], start_new_session=True)
        time.sleep(120)
    """)])
    pids = _wait_for_pids(pids_file)
    try:
        assert all(_alive(pid) for pid in pids)
        benchmark.send_signal(signal.SIGKILL)
        benchmark.wait()
        assert _gone_soon(pids), "the child or its child outlived the benchmark"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_timeout_kills_the_whole_group(tmp_path):
    script, pids_file = tmp_path / "child.py", tmp_path / "pids"
    script.write_text(CHILD)
    started = time.monotonic()
    assert run_group([sys.executable, str(script), str(pids_file)], dict(os.environ), timeout_s=3) is None
    assert time.monotonic() - started < 30
    pids = [int(pid) for pid in pids_file.read_text().split()]
    assert _gone_soon(pids, seconds=2), "the grandchild outlived the timeout"


def test_a_finished_child_gives_its_output():
    done = run_group([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                     dict(os.environ), timeout_s=30)
    assert done is not None and (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
