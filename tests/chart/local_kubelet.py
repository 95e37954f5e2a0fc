"""A kubelet for one machine: runs rendered pods' containers as local processes, the way a kubelet would run
them, so that the chart's wiring (commands, flags, ports, env, mounts, probes) is exercised for real.

Where it stands in for the cluster:
- **Network.** Each pod gets its own loopback address (127.a.b.n) as its pod IP. A container's `0.0.0.0`,
  `127.0.0.1` and `localhost` are that address (its network namespace), and a Service's DNS name (`name`,
  `name.ns`, `name.ns.svc`, `name.ns.svc.cluster.local`) followed by one of the Service's ports is rewritten to
  the selected pod's IP and target port (cluster DNS plus kube-proxy, one replica). The rewriting applies to
  args, env values and mounted ConfigMap files, after `$(VAR)` expansion; nothing else is changed. Redis binds
  every interface when its config names none: a mounted `redis.conf` gets `bind <pod IP>` appended.
- **Filesystem.** Every volume is a temporary directory: emptyDir and StatefulSet volume claims fresh, Secret
  and ConfigMap volumes one file per key, persistentVolumeClaim and hostPath volumes from the directories the
  test provides (`claims`, `host_paths`). A mount path in args, env or ConfigMap files is rewritten to its
  directory (longest first, at path boundaries).
- **Environment.** The image's (the Dockerfile's runtime ENV; PATH starts with `flotilla` and `kopf` commands
  that run this checkout), then the container's env in order, `$(VAR)` expanded from the variables before it
  as the kubelet does, `valueFrom` Secret, ConfigMap and field references (`metadata.name`,
  `metadata.namespace`, `status.podIP`). OMP_NUM_THREADS from the test process: the node is 2 shared cores.
- **Probes.** httpGet, tcpSocket and exec, with the probe's own timeout; a probe counts as failed only after
  `failureThreshold` consecutive failures, as the kubelet counts them.

Not emulated: security contexts (user, read-only root filesystem, capabilities), resources, init containers,
restarts, and more than one replica per workload.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.packaging.dockerfile import stages
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = [ROOT / "libs", ROOT / "services", ROOT / "operators"]
# What the image puts on PATH (/opt/flotilla/bin): the console scripts, here running this checkout.
IMAGE_COMMANDS = {"flotilla": "flotilla.cli", "kopf": "kopf"}
LOCAL_ADDRESSES = re.compile(r"(?<![\w.])(0\.0\.0\.0|127\.0\.0\.1|localhost)(?![\w.])")


@dataclass
class Container:
    pod: Pod
    spec: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    popen: subprocess.Popen | None = None

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def log_path(self) -> Path:
        return self.pod.root / f"{self.name}.log"

    def port(self, ref: int | str) -> int:
        """A probe's or Service's port: a number, or the name of one of this container's ports."""
        if isinstance(ref, int) or str(ref).isdigit():
            return int(ref)
        return next(p["containerPort"] for p in self.spec.get("ports", []) if p.get("name") == ref)

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except FileNotFoundError:
            return "(no log)"


@dataclass
class Pod:
    name: str
    ip: str
    labels: dict[str, str]
    spec: dict[str, Any]
    root: Path
    mounts: dict[str, dict[str, Path]] = field(default_factory=dict)  # container -> mount path -> directory
    containers: list[Container] = field(default_factory=list)

    def container(self, name: str) -> Container:
        return next(c for c in self.containers if c.name == name)


@dataclass(frozen=True)
class ServicePort:
    name: str
    port: int
    target: int | str


class LocalKubelet:
    """Runs pods from rendered workloads. `objects`: every rendered object (Services, Secrets, ConfigMaps are
    read from it); `secrets`: Secrets that exist before the install (`kubectl create secret`), name -> data;
    `claims` / `host_paths`: claim name / host path -> a directory."""

    def __init__(self, root: Path, objects: list[dict], namespace: str, secrets: dict[str, dict[str, str]] = {},
                 claims: dict[str, Path] = {}, host_paths: dict[str, Path] = {}):
        self.root, self.namespace = root, namespace
        self.claims, self.host_paths = dict(claims), dict(host_paths)
        self.secrets = {**{o["metadata"]["name"]: _secret_data(o) for o in objects if o["kind"] == "Secret"},
                        **secrets}
        self.config_maps = {o["metadata"]["name"]: dict(o.get("data", {})) for o in objects if o["kind"] == "ConfigMap"}
        self.services = [o for o in objects if o["kind"] == "Service"]
        self.pods: list[Pod] = []
        self._subnet = f"127.{random.randint(64, 250)}.{random.randint(1, 250)}"
        self._bin = root / "image-bin"
        self._write_image_commands()

    # -- pods --------------------------------------------------------------------------------------------

    def add_pod(self, workload: dict) -> Pod:
        """The pod of a Deployment or StatefulSet (one replica), its volumes made; nothing started yet."""
        template = workload["spec"]["template"]
        name = workload["metadata"]["name"] + ("-0" if workload["kind"] == "StatefulSet" else "-5d8f7c9b4-x2k7q")
        pod = Pod(name, f"{self._subnet}.{len(self.pods) + 1}", dict(template["metadata"].get("labels", {})),
                  template["spec"], self.root / name)
        pod.root.mkdir(parents=True)
        volumes, config_maps = self._volumes(pod, workload)
        for spec in pod.spec["containers"]:
            pod.mounts[spec["name"]] = {m["mountPath"]: volumes[m["name"]] for m in spec.get("volumeMounts", [])}
            pod.containers.append(Container(pod, spec))
        for volume, config_map in config_maps.items():
            self._write_config_map(pod, volume, config_map, volumes[volume])
        self.pods.append(pod)
        return pod

    def start(self, pod: Pod) -> None:
        for container in pod.containers:
            self._check_ports_free(pod, container)
            container.env = self._env(container)
            command = [*container.spec.get("command", []), *container.spec.get("args", [])]
            container.argv = [self.rewrite(container, expand(arg, container.env)) for arg in command]
            with open(container.log_path, "ab") as log:
                container.popen = subprocess.Popen(
                    container.argv, env=container.env, cwd=pod.root, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, pod: Pod, timeout_s: float) -> None:
        """Until every container's startup and readiness probes pass (each process still running)."""
        for container in pod.containers:
            for kind in ("startupProbe", "readinessProbe"):
                if kind in container.spec:
                    wait_until(lambda: self._alive(container) and self.probe_once(container, kind), timeout_s,
                               lambda: f"{pod.name}/{container.name} {kind}:\n{container.log_tail()}",
                               interval_s=0.1)

    def probe(self, container: Container, kind: str) -> bool:
        """The kubelet's verdict: fails only after failureThreshold consecutive failures, periodSeconds apart
        (here at most 1 s apart)."""
        spec = container.spec[kind]
        for attempt in range(int(spec.get("failureThreshold", 3))):
            if self.probe_once(container, kind):
                return True
            time.sleep(min(1.0, float(spec.get("periodSeconds", 10))))  # the kubelet's period, shortened
        return False

    def probe_once(self, container: Container, kind: str) -> bool:
        spec, ip = container.spec[kind], container.pod.ip
        timeout_s = float(spec.get("timeoutSeconds", 1))
        if "httpGet" in spec:
            url = f"http://{ip}:{container.port(spec['httpGet']['port'])}{spec['httpGet'].get('path', '/')}"
            try:
                return 200 <= httpx.get(url, timeout=timeout_s).status_code < 400
            except httpx.HTTPError:
                return False
        if "tcpSocket" in spec:
            try:
                socket.create_connection((ip, container.port(spec["tcpSocket"]["port"])), timeout_s).close()
                return True
            except OSError:
                return False
        command = [self.rewrite(container, expand(arg, container.env)) for arg in spec["exec"]["command"]]
        try:
            return subprocess.run(command, env=container.env, cwd=container.pod.root, capture_output=True,
                                  timeout=timeout_s).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every container (newest pod first), SIGKILL after the grace period."""
        running = [c for pod in reversed(self.pods) for c in pod.containers if c.popen and c.popen.poll() is None]
        for container in running:
            os.killpg(container.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for container in running:
            try:
                container.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(container.popen.pid, signal.SIGKILL)
                container.popen.wait()

    def endpoint(self, service_name: str, port: int | str) -> str:
        """host:port where a Service's port (its number or name) reaches its pod."""
        service = next(s for s in self.services if s["metadata"]["name"] == service_name)
        spec = next(p for p in service["spec"]["ports"] if port in (p["port"], p.get("name")))
        return self._service_address(service, spec["port"])

    def endpoint_of(self, pod: Pod, container: str, port_name: str) -> str:
        """host:port of a pod's named container port (what a scrape or a port-forward reaches)."""
        return f"{pod.ip}:{pod.container(container).port(port_name)}"

    # -- the cluster's names and paths ---------------------------------------------------------------------

    def rewrite(self, container: Container, text: str) -> str:
        """Service names, the pod's own addresses and mount paths, as seen from inside `container`."""
        for service in self.services:
            name = re.escape(service["metadata"]["name"])
            pattern = rf"(?<![\w.-]){name}(?:\.{self.namespace}(?:\.svc(?:\.cluster\.local)?)?)?:(\d+)(?!\d)"
            text = re.sub(pattern, lambda m, s=service: self._service_address(s, int(m.group(1))) or m.group(0),
                          text)
        text = LOCAL_ADDRESSES.sub(container.pod.ip, text)
        mounts = container.pod.mounts.get(container.name, {})
        if mounts:
            paths = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
            text = re.sub(rf"(?<![\w/.-])({paths})(?=/|$|[\s'\":;,])", lambda m: str(mounts[m.group(1)]), text)
        return text

    def _service_address(self, service: dict, port: int) -> str | None:
        spec_port = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
        if spec_port is None:
            return None
        target = spec_port.get("targetPort", port)
        backend = self._backend(service, ServicePort(spec_port.get("name", ""), port, target))
        return f"{backend.pod.ip}:{backend.port(target)}" if backend else None

    def _backend(self, service: dict, port: ServicePort) -> Container | None:
        selector = service["spec"].get("selector") or {}
        for pod in self.pods:
            if selector and all(pod.labels.get(k) == v for k, v in selector.items()):
                for container in pod.containers:
                    try:
                        container.port(port.target)
                        return container
                    except StopIteration:
                        continue
        return None

    # -- what the kubelet prepares ------------------------------------------------------------------------

    def _volumes(self, pod: Pod, workload: dict) -> tuple[dict[str, Path], dict[str, str]]:
        """-> (volume name -> directory, volume name -> ConfigMap name: written once the mounts are known)."""
        made, config_maps = {}, {}
        claims = [c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])]
        for volume in [*pod.spec.get("volumes", []), *({"name": c, "claimTemplate": {}} for c in claims)]:
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                made[name] = self.claims[volume["persistentVolumeClaim"]["claimName"]]
                continue
            if "hostPath" in volume:
                made[name] = self.host_paths[volume["hostPath"]["path"]]
                continue
            made[name] = pod.root / "volumes" / name
            made[name].mkdir(parents=True)
            if "secret" in volume:
                _write_files(made[name], self.secrets[volume["secret"]["secretName"]])
            elif "configMap" in volume:
                config_maps[name] = volume["configMap"]["name"]
            elif not ({"emptyDir", "claimTemplate"} & volume.keys()):
                raise NotImplementedError(f"volume {volume} of {pod.name}")
        return made, config_maps

    def _write_config_map(self, pod: Pod, volume: str, config_map: str, folder: Path) -> None:
        """One file per key, with addresses and paths as the (first) container that mounts it sees them."""
        reader = next(c for c in pod.containers if folder in pod.mounts[c.name].values())
        data = {}
        for key, text in self.config_maps[config_map].items():
            text = self.rewrite(reader, text)
            if key == "redis.conf" and not re.search(r"^bind ", text, re.MULTILINE):
                text += f"\nbind {pod.ip}\n"
            data[key] = text
        _write_files(folder, data)

    def _env(self, container: Container) -> dict[str, str]:
        pod = container.pod
        env = {k: self.rewrite(container, v) for k, v in _image_env(container.spec["image"]).items()}
        env["PATH"] = f"{self._bin}:/usr/local/bin:/usr/bin:/bin"
        env["HOME"] = str(pod.root)
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
        for var in container.spec.get("env", []):
            if "value" in var:
                value = expand(str(var["value"]), env)
            else:
                value = self._value_from(pod, var["valueFrom"])
            env[var["name"]] = self.rewrite(container, value)
        return env

    def _value_from(self, pod: Pod, source: dict) -> str:
        if "secretKeyRef" in source:
            return self.secrets[source["secretKeyRef"]["name"]][source["secretKeyRef"]["key"]]
        if "configMapKeyRef" in source:
            return self.config_maps[source["configMapKeyRef"]["name"]][source["configMapKeyRef"]["key"]]
        fields = {"metadata.name": pod.name, "metadata.namespace": self.namespace, "status.podIP": pod.ip}
        return fields[source["fieldRef"]["fieldPath"]]

    def _write_image_commands(self) -> None:
        self._bin.mkdir(parents=True)
        pythonpath = ":".join(map(str, SOURCE_ROOTS))
        for command, module in IMAGE_COMMANDS.items():
            script = self._bin / command
            script.write_text(f'#!/bin/sh\nPYTHONPATH="{pythonpath}" exec "{sys.executable}" -m {module} "$@"\n')
            script.chmod(0o755)
        for tool in ("redis-server", "redis-cli", "sh"):  # what the Redis image has on its PATH
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed (make redis-server)")

    def _check_ports_free(self, pod: Pod, container: Container) -> None:
        for port in container.spec.get("ports", []):
            with socket.socket() as sock:
                try:
                    sock.bind((pod.ip, port["containerPort"]))
                except OSError as error:
                    raise RuntimeError(f"{pod.ip}:{port['containerPort']} ({pod.name}) is taken: {error}") from None

    def _alive(self, container: Container) -> bool:
        if container.popen.poll() is not None:
            raise AssertionError(f"{container.pod.name}/{container.name} exited with {container.popen.returncode}:\n"
                                 f"{' '.join(container.argv)}\n{container.log_tail()}")
        return True


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: known variables are replaced, `$$` is a literal `$`, others stay."""
    return re.sub(r"\$\$|\$\((\w+)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def _image_env(image: str) -> dict[str, str]:
    """The Dockerfile's runtime ENV for Flotilla's image (PATH is the caller's); nothing for other images."""
    if "/flotilla:" not in image:
        return {}
    return {k: v for k, v in stages()["runtime"].env().items() if k != "PATH"}


def _secret_data(secret: dict) -> dict[str, str]:
    import base64

    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**data, **(secret.get("stringData") or {})}


def _write_files(folder: Path, data: dict[str, str]) -> None:
    for key, text in data.items():
        (folder / key).write_text(text)
