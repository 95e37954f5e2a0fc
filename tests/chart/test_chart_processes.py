"""The chart serves: rendered by the real helm (default values, and the disaggregated example), every rendered
container runs as a local process with its own command, args and env (tests/chart/local_kubelet.py: pod IPs
on loopback, Service names rewritten to them, volumes as temporary directories, Secrets and ConfigMaps as files
and env), the worker pods as the operator builds them from the rendered FlotillaPools, the model volume holding
a tiny random checkpoint (default values: also a shared pool of two models on it). Then the real `openai` and `anthropic` SDKs call the gateway through its Service,
streamed and not, at the Service and port the rendered Ingress (default values) or HTTPRoute (the
disaggregated example) forwards to, and every container's probes must pass. Redis (disaggregated example) is Debian's
redis-server running the rendered StatefulSet's command and ConfigMap.

The operator's own pod is not run here: it needs an API server (tests/operator runs it against kmock)."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flotilla.api.router.v1 import router_pb2, router_pb2_grpc
from flotilla.operator.manifests import service
from flotilla.operator.pool_spec import KIND, parse_spec
from flotilla.rpc.options import sync_channel
from flotilla.rpc.tls import InternalTLS
from flotilla.tenancy.keys import KeyEntry, generate_key, hash_key, write_keys_file
from tests.chart.local_kubelet import LocalKubelet, Pod
from tests.chart.rendering import CASES, NAMESPACE, documents, needs_helm, render, worker_deployments

pytestmark = needs_helm
READY_TIMEOUT_S = 60.0
# Start order: what the others connect to first (Kubernetes starts them together and relies on retries; the
# order only keeps a 2-core machine from loading every model while the router is not up yet).
ORDER = ("redis", "router", "prefill", "decode", "both", "gateway")
PROMPT = ("Flotilla serves large language models behind an HTTP API and keeps scarce accelerators busy: it "
          "queues requests, batches them onto workers step by step and streams tokens back.")


@dataclass
class Release:
    case: str
    kubelet: LocalKubelet
    pods: list[Pod]
    models: list[str]  # every model the release serves; the first is the one most tests use
    api_key: str

    route: tuple[str, int | str]  # the Service and port the release's Ingress or HTTPRoute sends clients to
    certs: Path  # `flotilla certs --out` of this release: DIR/<role> holds each role's certificate

    @property
    def gateway_url(self) -> str:
        """Where the Ingress controller or Gateway would forward a client's request."""
        return f"http://{self.kubelet.endpoint(*self.route)}"


def _rendered(case: str, tmp: Path) -> list[dict]:
    """Default values need two things from any install: a model volume and API keys (a Secret the chart
    writes from keys.keysJson). The default case serves two models (the `models` list, each with its own
    pool), the second from its own volume. The disaggregated example names its volume and keeps keys in Redis.
    Both get the mTLS certificates `flotilla certs` makes, as chart values (the chart writes their Secrets)."""
    certs = tmp / "certs"
    subprocess.run([sys.executable, "-m", "flotilla.cli", "certs", "--out", str(certs)], check=True,
                   capture_output=True, timeout=60)
    tls = ["-f", str(certs / "helm-values.yaml")]
    extra: list[str] = []
    if case == "default":
        keys_file = tmp / "keys.json"
        write_keys_file(keys_file, [KeyEntry("k1", hash_key(_KEYS[case]), "acme", "paid")])
        models = [{"name": "flotilla-tiny", "checkpoint": "/models/flotilla-tiny",
                   "volume": {"persistentVolumeClaim": {"claimName": "flotilla-models"}}},
                  {"name": "Tiny.Chat/v2", "checkpoint": "/weights/chat",
                   "volume": {"persistentVolumeClaim": {"claimName": "chat-weights"}}, "mountPath": "/weights"}]
        extra = ["--set-json", f"models={json.dumps(models)}", "--set-json", f"sharedPool={json.dumps(SHARED_POOL)}",
                 "--set-file", f"keys.keysJson={keys_file}"]
    if case == "disaggregated-gpu":  # its RDMA device (mlx5_0:1) is not on this machine: TCP on loopback
        extra = ["--set", "kvTransfer.ucx.netDevices=lo", "--set", "kvTransfer.ucx.transports=tcp"]
    result = render(CASES[case], *extra, *tls)
    assert result.returncode == 0, result.stderr
    return documents(result.stdout)


_KEYS = {"default": generate_key()}
# The default case also runs a shared pool: one worker that loads either model on demand, one at a time.
SHARED_POOL = {"enabled": True, "replicas": 1, "maxLoadedModels": 1,
               "models": [{"name": "rare-x", "checkpoint": "/models/rare-x"},
                          {"name": "rare-y", "checkpoint": "/models/rare-y"}],
               "volume": {"persistentVolumeClaim": {"claimName": "flotilla-models"}}}


def _component(pod: Pod) -> str:
    labels = pod.labels
    return labels.get("flotilla.dev/role") or labels.get("app.kubernetes.io/component", "")


@pytest.fixture(scope="module", params=["default", "disaggregated-gpu"])
def release(request, tmp_path_factory, tiny_checkpoint) -> Release:
    case = request.param
    tmp = tmp_path_factory.mktemp(f"release-{case}")
    docs = _rendered(case, tmp)
    if any(d["kind"] == "StatefulSet" for d in docs) and not shutil.which("redis-server"):
        pytest.skip("redis-server not installed: `make redis-server`")
    pools = [doc for doc in docs if doc["kind"] == KIND]
    models = list(dict.fromkeys(pool["spec"]["model"]["name"] for pool in pools))
    shared = SHARED_POOL["models"] if case == "default" else []
    models += [m["name"] for m in shared if m["name"] not in models]
    # The model volume: a claim holding the checkpoint at spec.model.checkpoint below the mount path.
    claims = {}
    for pool in pools:
        mount = pool["spec"]["worker"]["volumeMounts"][0]["mountPath"]
        (volume,) = pool["spec"]["worker"]["volumes"]
        claim = tmp / "claims" / volume["persistentVolumeClaim"]["claimName"]
        target = claim / Path(pool["spec"]["model"]["checkpoint"]).relative_to(mount)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(tiny_checkpoint)
        claims[volume["persistentVolumeClaim"]["claimName"]] = claim
    for model in shared:  # the shared pool's other checkpoints, on the same claim
        target = claims["flotilla-models"] / Path(model["checkpoint"]).relative_to("/models")
        if not target.exists():
            target.symlink_to(tiny_checkpoint)
    redis_password = secrets.token_hex(16)
    worker_services = []
    for pool in pools:
        body = {"metadata": {**pool["metadata"], "namespace": NAMESPACE, "uid": "0000"}}
        worker_services.append(service(body, parse_spec(pool["spec"])))
    kubelet = LocalKubelet(tmp / "node", [*docs, *worker_services], NAMESPACE,
                           secrets={"flotilla-redis": {"password": redis_password}}, claims=claims)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                 and not d["metadata"]["name"].endswith("-operator")] + worker_deployments(docs)
    pods = [kubelet.add_pod(w) for w in workloads]
    pods.sort(key=lambda p: ORDER.index(_component(p)))
    api_key = _KEYS.get(case, "")
    try:
        for pod in pods:
            kubelet.start(pod)
            kubelet.wait_ready(pod, READY_TIMEOUT_S)
            if _component(pod) == "redis":
                api_key = _create_redis_key(kubelet, redis_password)
        yield Release(case, kubelet, pods, models, api_key, _route(docs), tmp / "certs")
    finally:
        kubelet.stop_all()


def _route(docs: list[dict]) -> tuple[str, int | str]:
    """The backend of the rendered Ingress (default values) or HTTPRoute (the disaggregated example)."""
    (route,) = [d for d in docs if d["kind"] in ("Ingress", "HTTPRoute")]
    if route["kind"] == "Ingress":
        backend = route["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
        return backend["name"], backend["port"].get("name") or backend["port"]["number"]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    return backend["name"], backend["port"]


def _create_redis_key(kubelet: LocalKubelet, password: str) -> str:
    """`flotilla keys create` against the release's Redis, as an admin would (through a port-forward)."""
    url = f"redis://:{password}@{kubelet.endpoint(f'{NAMESPACE}-redis', 'redis')}/0"
    out = subprocess.run([sys.executable, "-m", "flotilla.cli", "keys", "create", "--redis-url", url,
                          "--tenant", "acme"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_every_rendered_workload_runs_and_its_probes_pass(release):
    components = sorted(_component(p) for p in release.pods)
    expected = {"default": ["both", "both", "both", "gateway", "router"],  # two models' pools, the shared pool
                "disaggregated-gpu": ["decode", "gateway", "prefill", "redis", "router"]}[release.case]
    assert components == expected
    for pod in release.pods:
        for container in pod.containers:
            probes = [k for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container.spec]
            assert "readinessProbe" in probes and "livenessProbe" in probes, (pod.name, container.name)
            for kind in probes:
                assert release.kubelet.probe(container, kind), f"{pod.name}/{container.name} {kind}"


def test_models_are_listed(release):
    response = httpx.get(f"{release.gateway_url}/v1/models", headers={"authorization": f"Bearer {release.api_key}"})
    assert response.status_code == 200, response.text
    assert set(release.models) <= {m["id"] for m in response.json()["data"]}


def test_every_model_is_served_by_its_own_pool(release):
    """Each entry of `models` gets its own pool: a request for either model is answered (by that pool's worker;
    the router places a model's requests only on workers that registered it). The default case's shared pool
    answers for both its models, loading each on demand (one at a time: the second unloads the first)."""
    client = openai.OpenAI(base_url=f"{release.gateway_url}/v1", api_key=release.api_key, max_retries=0)
    for model in release.models:
        answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.model == model and answer.usage.completion_tokens == 2


def test_openai_sdk_streamed_and_not(release):
    client = openai.OpenAI(base_url=f"{release.gateway_url}/v1", api_key=release.api_key, max_retries=0)
    kwargs = dict(model=release.models[0], max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                  messages=[{"role": "user", "content": PROMPT}])
    answer = client.chat.completions.create(**kwargs)
    assert answer.usage.completion_tokens == 8 and answer.choices[0].finish_reason == "length"
    streamed, usage = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        streamed += "".join(choice.delta.content or "" for choice in chunk.choices)
    assert streamed == answer.choices[0].message.content  # greedy: the same text either way
    assert usage.completion_tokens == 8
    completion = client.completions.create(model=release.models[0], prompt=PROMPT, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4


def test_anthropic_sdk_streamed_and_not(release):
    client = anthropic.Anthropic(base_url=release.gateway_url, api_key=release.api_key, max_retries=0)
    kwargs = dict(model=release.models[0], max_tokens=8, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": f"{PROMPT} (anthropic)"}])
    message = client.messages.create(**kwargs)
    assert message.stop_reason in ("max_tokens", "end_turn") and 0 < message.usage.output_tokens <= 8
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text
    assert final.usage.output_tokens == message.usage.output_tokens


def test_the_router_grants_placement_leases(release):
    """The chart's lease Secret reaches the router (and, through the operator, the workers): the router says it
    signs leases, so the gateway (--stream-path auto) streams from the workers, not through the router; the
    streamed tests here then ran on that path (workers with --lease-secret-file refuse streams without one)."""
    tls = InternalTLS.from_dir(release.certs / "gateway", reload=False)
    with sync_channel(release.kubelet.endpoint("flotilla-router", "grpc"), tls, "router") as channel:
        answer = router_pb2_grpc.RouterServiceStub(channel).ListModels(router_pb2.ListModelsRequest(), timeout=10)
    assert answer.grants_leases
    workers = [c for p in release.pods for c in p.containers if c.name == "worker"]
    assert workers and all("--lease-secret-file" in c.spec["args"] for c in workers)


def test_disaggregated_requests_move_kv_from_the_prefill_pod(release):
    if release.case != "disaggregated-gpu":
        pytest.skip("colocated workers (role both)")
    sent = {}
    for pod in release.pods:
        if _component(pod) in ("prefill", "decode"):
            page = httpx.get(f"http://{release.kubelet.endpoint_of(pod, 'worker', 'metrics')}/metrics").text
            sent[_component(pod)] = sum(s.value for f in text_string_to_metric_families(page)
                                        if f.name == "flotilla_kv_transfer_bytes" for s in f.samples
                                        if s.name.endswith("_total"))
    assert sent["prefill"] > 0 and sent["decode"] == sent["prefill"], sent


def test_requests_are_billed_in_the_usage_ledger(release):
    """Default values have no Redis: each gateway pod bills into <usageLedger.mountPath>/<pod>.jsonl on its
    volume. (The disaggregated example bills into Redis's stream; tests/usage covers that sink.)"""
    if release.case != "default":
        pytest.skip("the ledger is Redis's stream")
    from flotilla.usage.sinks import read_file
    from flotilla.usage.summary import unique

    client = openai.OpenAI(base_url=f"{release.gateway_url}/v1", api_key=release.api_key, max_retries=0)
    client.completions.create(model=release.models[0], prompt=PROMPT, max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    gateways = [pod for pod in release.pods if _component(pod) == "gateway"]
    files = [path for pod in gateways for path in (pod.root / "volumes" / "usage").glob("*.jsonl")]
    assert {path.stem for path in files} <= {pod.name for pod in gateways} and files
    records = unique(record for path in files for record in read_file(path))
    assert records and {r.tenant for r in records} == {"acme"} and any(r.output_tokens == 3 for r in records)
