"""The real kopf operator against kmock, as every operator suite starts it: on a thread with an event loop of its
own, so that an operator that does not stop fails the test that started it and nothing else. (In the test's own
loop, a task that did not end when cancelled, most likely kopf's, once held the loop's teardown, and with it the
whole suite, forever.)"""

from __future__ import annotations

import asyncio
import threading

import kopf


class RunningOperator:
    """kopf.operator(...) for `namespace`, started at once; `await stop(timeout_s)` when the test is done."""

    def __init__(self, registry: kopf.OperatorRegistry, namespace: str = "ns1"):
        self._registry = registry
        self._namespace = namespace
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise AssertionError("the kopf operator's thread did not start")

    def _run(self) -> None:
        try:
            asyncio.run(self._operate())
        except BaseException as exc:  # reported by stop(), in the test
            self._failure = exc

    async def _operate(self) -> None:
        settings = kopf.OperatorSettings()
        settings.posting.enabled = False
        settings.scanning.disabled = True  # kmock 0.8 cannot list /api/v1/namespaces (cluster-scoped path)
        settings.watching.server_timeout = 5
        self._loop = asyncio.get_running_loop()  # both set before __init__ returns
        self._stop_flag = asyncio.Event()
        self._started.set()
        await kopf.operator(registry=self._registry, settings=settings, namespaces=[self._namespace],
                            standalone=True, stop_flag=self._stop_flag)

    async def stop(self, timeout_s: float = 20.0) -> None:
        """Set the stop flag and wait for the operator to end; AssertionError when it does not within timeout_s
        (its daemon thread is then left behind, holding nothing the next test needs)."""
        try:
            self._loop.call_soon_threadsafe(self._stop_flag.set)
        except RuntimeError:  # its loop is closed: the operator ended already
            pass
        await asyncio.to_thread(self._thread.join, timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"the kopf operator did not stop within {timeout_s} s")
        if self._failure is not None:
            raise AssertionError(f"the kopf operator failed: {self._failure!r}") from self._failure


def start_operator(registry: kopf.OperatorRegistry, namespace: str = "ns1") -> RunningOperator:
    return RunningOperator(registry, namespace)
