"""vLLM's CPU use is read from /proc over its whole process tree (its engine core and workers are grandchildren)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from loadtest.common.vllm_waves import process_tree_cpu_seconds

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A child that starts a grandchild; the grandchild burns CPU, then both sleep until killed.
BURNING_GRANDCHILD = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass\\ntime.sleep(60)"])
time.sleep(60)
"""


def test_cpu_seconds_count_grandchildren_and_stop_growing_when_they_idle():
    child = subprocess.Popen([sys.executable, "-c", BURNING_GRANDCHILD], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while process_tree_cpu_seconds(child.pid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        burned = process_tree_cpu_seconds(child.pid)
        assert burned >= 0.6  # the grandchild's busy loop, which the child itself never ran
        time.sleep(0.5)
        assert process_tree_cpu_seconds(child.pid) - burned < 0.1  # asleep now
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the child leads its own group, the grandchild in it
        child.wait()
