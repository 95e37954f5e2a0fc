"""ReplicaLauncher over a LocalFleet: worker processes started and stopped without blocking the tick."""

from __future__ import annotations

import threading

from flotilla.fleet.local import LocalFleet


class FleetLauncher:
    def __init__(self, fleet: LocalFleet):
        self._fleet = fleet

    def next_replica_id(self) -> str:
        return self._fleet.next_worker_id()

    def start_replica(self, replica_id: str) -> None:
        if replica_id != self._fleet.next_worker_id():
            raise ValueError(f"{replica_id} is not the fleet's next worker id")
        self._fleet.start_worker(wait=False)

    def stop_replica(self, replica_id: str) -> None:
        worker = self._fleet.retire_worker(replica_id)
        if worker is not None:
            # SIGTERM: it deregisters, then finishes what it holds; a thread waits so the tick does not.
            threading.Thread(target=worker.stop, name=f"stop-{replica_id}", daemon=True).start()

    def is_running(self, replica_id: str) -> bool:
        return any(w.name == replica_id and w.is_running() for w in self._fleet.workers)
