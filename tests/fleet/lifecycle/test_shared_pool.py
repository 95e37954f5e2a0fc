"""The shared pool for rarely used models, as real processes: one shared-pool worker that can load three
distinct tiny checkpoints but holds at most two, next to a dedicated worker of one of them, behind the real
gateway and the real openai SDK. Every model answers; the least recently used one is unloaded for the third
(checked in the worker's own report); a model answers the same on the shared pool as on its dedicated worker
and after being unloaded and loaded again; the load (the cold start) is measured and shows in the router's
metrics and in the first request's latency."""

from __future__ import annotations

import shutil
import time

import httpx
import openai
import pytest

from flotilla.api.router.v1 import router_pb2, router_pb2_grpc

from tests.support.fleet import fleet_config, metric_samples, router_workers, start_fleet, worker_load
from tests.support.tls import channel
from tests.support.waiting import wait_until

CHECKPOINTS = {"rare-a": dict(seed=11, architecture="llama"), "rare-b": dict(seed=12, architecture="qwen2"),
               "rare-c": dict(seed=13, architecture="llama")}
PROMPT = "the tide comes in and"


@pytest.fixture(scope="module")
def fleet(checkpoint_factory, tmp_path_factory):
    dirs = {name: checkpoint_factory(size="tiny", **kwargs) for name, kwargs in CHECKPOINTS.items()}
    # A fourth model whose weights go bad after the worker read its catalog: its loads fail.
    dirs["rare-broken"] = shutil.copytree(dirs["rare-a"], tmp_path_factory.mktemp("broken") / "rare-broken")
    config = fleet_config(dirs["rare-c"], tmp_path_factory.mktemp("shared-pool"), model_name="rare-c-dedicated",
                          shared_pool_models=tuple(f"{name}={path}" for name, path in dirs.items()),
                          shared_pool_workers=1, shared_pool_max_loaded=2,
                          worker_args=["--device", "cpu", "--num-kv-blocks", "64"],
                          router_args=["--cold-start-wait-s", "60"])
    with start_fleet(config, keys={"k": ("acme", "paid")}) as running:
        wait_until(lambda: "shared-0" in router_workers(running.fleet.router_address), 60, "the shared worker")
        (dirs["rare-broken"] / "model.safetensors").write_bytes(b"not weights")
        yield running


def complete(client: openai.OpenAI, model: str) -> tuple[str, float]:
    started = time.monotonic()
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert response.usage.completion_tokens >= 1
    return response.choices[0].text, time.monotonic() - started


def loaded_models(fleet) -> list[str]:
    """The shared worker's own view (GetLoad), LRU first, as bare names."""
    return [q.partition("@")[0] for q in worker_load(fleet.fleet.shared_workers[0]).loaded_models]


def router_view(fleet) -> list[str]:
    return [q.partition("@")[0] for q in router_workers(fleet.fleet.router_address)["shared-0"].load.loaded_models]


def shared_metric(fleet, name: str, model: str) -> float:
    return sum(s.value for s in metric_samples(fleet.fleet.metrics_targets()["router"])
               if s.name == name and s.labels.get("model") == model)


def test_three_models_with_room_for_two(fleet):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0)
    wanted = {"rare-a", "rare-b", "rare-c", "rare-c-dedicated"}
    wait_until(lambda: wanted <= {m.id for m in client.models.list().data}, 60, "every model listed")
    assert loaded_models(fleet) == []  # nothing loaded before a request needs it

    text_a, first_a_s = complete(client, "rare-a")
    assert loaded_models(fleet) == ["rare-a"]
    load_a_s = shared_metric(fleet, "flotilla_router_shared_model_load_seconds_sum", "rare-a")
    assert load_a_s > 0 and first_a_s >= load_a_s  # the cold start is measured and inside the first request
    print(f"\nshared pool: rare-a loaded in {load_a_s:.2f} s, its first request took {first_a_s:.2f} s")

    text_b, _ = complete(client, "rare-b")
    assert loaded_models(fleet) == ["rare-a", "rare-b"]
    again_a, warm_a_s = complete(client, "rare-a")  # loaded: no new load, and it becomes the most recent
    assert again_a == text_a and loaded_models(fleet) == ["rare-b", "rare-a"]
    assert shared_metric(fleet, "flotilla_router_shared_model_loads_total", "rare-a") == 1

    text_c, _ = complete(client, "rare-c")  # no room: rare-b, the least recently used, goes
    assert loaded_models(fleet) == ["rare-a", "rare-c"]
    wait_until(lambda: router_view(fleet) == ["rare-a", "rare-c"], 10, "the router to see the unload")
    assert shared_metric(fleet, "flotilla_router_shared_model_unloads_total", "rare-b") == 1
    dedicated_c, _ = complete(client, "rare-c-dedicated")
    assert text_c == dedicated_c  # the same checkpoint answers the same on the shared pool and on its own worker
    assert len({text_a, text_b, text_c}) == 3  # three distinct models, each request ran on its own

    reloaded_b, _ = complete(client, "rare-b")  # rare-a (used before rare-c) is the least recently used now
    assert reloaded_b == text_b and loaded_models(fleet) == ["rare-c", "rare-b"]
    assert shared_metric(fleet, "flotilla_router_shared_model_unloads_total", "rare-a") == 1
    with channel(fleet.fleet.router_address) as router:  # `flotilla models list`: servable by 1, placeable if loaded
        routes = router_pb2_grpc.RouterServiceStub(router).ListModelRoutes(router_pb2.ListModelRoutesRequest(),
                                                                           timeout=5)
    versions = {route.name: route.versions for route in routes.routes}
    assert [(v.num_workers, v.num_healthy_active) for v in versions["rare-b"]] == [(1, 1)]
    assert [(v.num_workers, v.num_healthy_active) for v in versions["rare-a"]] == [(1, 0)]


def test_a_model_that_cannot_load_says_it_is_starting_once_its_deadline_passes(fleet):
    before = loaded_models(fleet)
    response = httpx.post(f"{fleet.url}/v1/completions", headers={**fleet.headers, "x-flotilla-deadline-ms": "3000"},
                          json={"model": "rare-broken", "prompt": PROMPT, "max_tokens": 4}, timeout=30)
    assert response.status_code == 503, response.text
    assert "starting" in response.json()["error"]["message"] and int(response.headers["retry-after"]) >= 1
    assert shared_metric(fleet, "flotilla_router_shared_model_loads_total", "rare-broken") == 1  # it was tried
    assert loaded_models(fleet) == before  # checked before anything is unloaded for it: nothing was
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0)
    complete(client, before[-1])
