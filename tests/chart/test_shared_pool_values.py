"""The chart's sharedPool block: its own FlotillaPool, whose worker pods (as the operator builds them) start a
shared-pool worker that can load every listed model, in order, with the memory bound asked for; bad values
are refused by the values schema."""

from __future__ import annotations

import argparse

import pytest

from flotilla.cli.serve import _shared_models, register
from tests.chart.rendering import needs_helm, render, rendered_case, worker_deployments

pytestmark = needs_helm


def worker_flags(args: list[str]) -> argparse.Namespace:
    """The pod's `flotilla worker ...` arguments as the real CLI parses them ($(POD_IP) and the like as is)."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(args)


def test_the_shared_pool_renders_its_own_pool_of_workers_that_load_every_model():
    docs = rendered_case("multi-model-gpu")
    pools = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "FlotillaPool"}
    assert pools["flotilla-shared-pool"]["spec"]["replicas"] == {"min": 2, "max": 2, "warm": 0}
    (shared,) = [d for d in worker_deployments(docs) if d["metadata"]["name"] == "flotilla-shared-pool-workers"]
    container = shared["spec"]["template"]["spec"]["containers"][0]
    flags = worker_flags(container["args"])
    assert _shared_models(flags) == [("mistral-7b-instruct", "/models/mistral-7b-instruct"),
                                     ("gemma-2-9b-it", "/models/gemma-2-9b-it"),
                                     ("phi-3-mini-instruct", "/models/phi-3-mini-instruct")]
    assert flags.max_loaded_models == 2 and flags.role == "both"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]


@pytest.mark.parametrize("flags", [
    ["--set", "sharedPool.enabled=true", "--set", "sharedPool.models[0].name=a",
     "--set", "sharedPool.models[0].checkpoint=/m/a"],  # one model: a plain pool, not a shared one
    ["--set", "sharedPool.maxLoadedModels=0"],
    ["--set", "sharedPool.models[0].name=a=b", "--set", "sharedPool.models[0].checkpoint=/m/a"],
])
def test_bad_shared_pool_values_are_refused(flags):
    result = render(None, *flags)
    assert result.returncode != 0 and "schema" in result.stderr, result.stderr
