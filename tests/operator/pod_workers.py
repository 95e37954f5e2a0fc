"""A pool's worker pods in kmock, each one a real `flotilla worker` process, and the ReplicaSet that removes
them: kmock stores objects and runs no controllers, so this plays the ReplicaSet and the kubelet for one
Deployment. A pod's name is its worker's id, as the Deployment's `--worker-id $(POD_NAME)` makes it.

When the Deployment's replicas drop below its pods, the pods with the lowest
`controller.kubernetes.io/pod-deletion-cost` go first (a ReplicaSet's order among running, ready pods; ties by
name here) and their workers get SIGTERM at once. The workers run with `--shutdown-grace-s 0`: a stream still
on one when it goes is cut and moves to another worker or fails, which the streams' records show."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import kmock

from flotilla.fleet.local import START_TIMEOUT_S
from flotilla.fleet.process import ServiceProcess
from flotilla.operator.manifests import DELETION_COST_ANNOTATION, POOL_LABEL

from tests.support.fleet import NO_OUTPUT_CHECK, start_service

PODS = kmock.resource("v1/pods")
DEPLOYMENTS = kmock.resource("apps/v1/deployments")


@dataclass(frozen=True)
class Deletion:
    pod: str
    cost: str | None  # its deletion-cost annotation when it went; None: none
    replicas: int  # the Deployment's replicas that removed it


def start_worker(state_dir: Path, router_address: str, checkpoint: Path, pod: str, model: str) -> ServiceProcess:
    return start_service(
        state_dir, pod, "worker", *NO_OUTPUT_CHECK, "--router", router_address, "--model-dir", str(checkpoint),
        "--model-name", model, "--worker-id", pod, "--device", "cpu", "--num-kv-blocks", "1024",
        "--shutdown-grace-s", "0", wait=False)


@dataclass
class PodReplicaSet:
    kube: kmock.KubernetesEmulator
    namespace: str
    pool: str  # the FlotillaPool; its Deployment is <pool>-workers
    workers: dict[str, ServiceProcess]  # pod name -> the worker process standing for it
    deletions: list[Deletion] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _task: asyncio.Task | None = None

    async def start(self) -> None:
        for process in self.workers.values():
            await asyncio.to_thread(process.wait_port, START_TIMEOUT_S)
        for pod in self.workers:
            body = {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": pod, "namespace": self.namespace, "labels": {POOL_LABEL: self.pool}},
                    "status": {"phase": "Running"}}
            async with self.kube.post(f"/api/v1/namespaces/{self.namespace}/pods", json=body) as response:
                assert response.status < 300, await response.text()
        self._task = asyncio.create_task(self._run())

    def pod(self, name: str) -> dict | None:
        key = (PODS, self.namespace, name)
        if key not in self.kube.objects or self.kube.objects[key].deleted:
            return None
        return self.kube.objects[key].raw

    def cost(self, name: str) -> str | None:
        pod = self.pod(name) or {}
        return (pod.get("metadata", {}).get("annotations") or {}).get(DELETION_COST_ANNOTATION)

    @property
    def replicas(self) -> int:
        return self.kube.objects[DEPLOYMENTS, self.namespace, f"{self.pool}-workers"].raw["spec"]["replicas"]

    @property
    def pods(self) -> list[str]:
        return [name for name in self.workers if self.pod(name) is not None]

    async def _run(self) -> None:
        while True:  # a controller's watch, polled: 20 ms between a replicas change and the pods going
            pods = self.pods
            replicas = self.replicas
            if replicas > len(pods):
                self.errors.append(f"replicas raised to {replicas} with {len(pods)} pods: this test scales down")
            for pod in sorted(pods, key=lambda name: (_cost_value(self.cost(name)), name))[: len(pods) - replicas]:
                self.deletions.append(Deletion(pod, self.cost(pod), replicas))
                async with self.kube.delete(f"/api/v1/namespaces/{self.namespace}/pods/{pod}") as response:
                    assert response.status < 300, await response.text()
                asyncio.create_task(asyncio.to_thread(self.workers[pod].stop, 10.0))  # the kubelet's SIGTERM
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(process.stop, 10.0) for process in self.workers.values()))


def _cost_value(annotation: str | None) -> int:
    return int(annotation) if annotation else 0
