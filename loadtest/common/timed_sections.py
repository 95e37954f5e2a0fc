"""A one-shot check's parts run within one time budget, its report kept on disk as it grows (loadtest/gpu_check.py).

A lent device runs the check once, under a wall-clock limit that kills it: a check still running then would
report nothing. So the budget is enforced here, inside the process: when it is spent, the part running is stopped
(an alarm raises OutOfTime in it) and recorded as out of time, every later part is recorded as skipped, and the
check still prints what it measured. After each part the report so far is written to `report_path` (if given), so
even a kill from outside leaves every finished part behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


class OutOfTime(BaseException):
    """The budget is spent. A BaseException, so that no `except Exception` in the code being measured swallows it."""


class TimedSections:
    """Runs named parts into `report`; a part that raises is reported in its place and the rest still run."""

    def __init__(self, report: dict, budget_s: float, report_path: Path | None = None,
                 on_failure: Callable[[], None] = lambda: None):
        self.report, self.budget_s, self.report_path, self.on_failure = report, budget_s, report_path, on_failure
        self.started = time.perf_counter()
        self.out_of_time = False
        self._in_part = False
        report.setdefault("section_seconds", {})

    def __enter__(self) -> TimedSections:
        self._previous = signal.signal(signal.SIGALRM, self._alarm)
        signal.setitimer(signal.ITIMER_REAL, max(self.budget_s, 1e-3))
        return self

    def __exit__(self, error_type, error, tb) -> bool:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._previous)
        if error_type is OutOfTime:  # raised in the instant a part ended: the parts after it go unrecorded
            self.report["out_of_time"] = f"the {self.budget_s:.0f} s budget was spent as a part ended"
            self.save()
            return True
        return False

    def _alarm(self, signum, frame) -> None:
        self.out_of_time = True  # the next part is skipped
        if self._in_part:  # stop this one; between parts (a checkpoint written or removed) it runs to its end
            self._in_part = False
            raise OutOfTime

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def run(self, name: str, part: Callable[[], dict], into: dict | None = None) -> dict:
        """report[name] (or into[name]) = part(), or {"error": ...}, {"out_of_time": ...} or {"skipped": ...}."""
        into = self.report if into is None else into
        if self.out_of_time:
            into[name] = {"skipped": f"the {self.budget_s:.0f} s budget was spent before this part"}
            self.save()
            return into[name]
        began = time.perf_counter()
        print(f"[{self.elapsed():.0f} s] {name}", file=sys.stderr, flush=True)
        self._in_part = True
        try:
            into[name] = part()
            self._in_part = False
        except OutOfTime:
            into[name] = {"out_of_time": f"stopped {time.perf_counter() - began:.0f} s in: the {self.budget_s:.0f} s "
                                         "budget was spent"}
            self._clean_up()
        except Exception as error:  # noqa: BLE001 - one device run has to report everything it can
            self._in_part = False
            into[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            self._clean_up()
        self.report["section_seconds"][name] = round(time.perf_counter() - began, 1)
        self.save()
        return into[name]

    def _clean_up(self) -> None:
        """on_failure (freeing device memory), which a part stopped halfway (say, inside a CUDA graph capture) can
        make fail too: that is printed, not raised, so that the later parts still run or are recorded skipped."""
        try:
            self.on_failure()
        except Exception:  # noqa: BLE001 - see the docstring
            print(traceback.format_exc(), file=sys.stderr, flush=True)

    def save(self) -> None:
        """The report so far, written whole (a temporary file renamed over the last one)."""
        if self.report_path is None:
            return
        partial = self.report_path.with_name(self.report_path.name + ".partial")
        partial.write_text(json.dumps(self.report) + "\n")
        os.replace(partial, self.report_path)
