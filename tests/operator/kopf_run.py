"""The real kopf operator in this event loop against kmock, as every operator suite starts it."""

from __future__ import annotations

import asyncio

import kopf


def start_operator(registry: kopf.OperatorRegistry, namespace: str = "ns1") -> tuple[asyncio.Task, asyncio.Event]:
    """(the operator's task, the event that stops it): set the event, then await the task."""
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    settings.scanning.disabled = True  # kmock 0.8 cannot list /api/v1/namespaces (cluster-scoped path)
    settings.watching.server_timeout = 5
    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(registry=registry, settings=settings, namespaces=[namespace],
                                             standalone=True, stop_flag=stop))
    return task, stop
