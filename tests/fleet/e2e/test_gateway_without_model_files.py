"""The gateway serves a model it has no files of, as on Kubernetes where only worker pods mount the model: it
lists and tokenizes with the tokenizer files the worker published through the router.

The checkpoint is moved away after the worker has loaded it and before the gateway starts, so nothing on
disk at any path the gateway could have learnt holds the model."""

from __future__ import annotations

import shutil

import openai
import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams
from flotilla.fleet.local import START_TIMEOUT_S

from tests.support.fleet import num_healthy_workers, start_service, wait_gateway_ready
from tests.support.waiting import wait_until

MODEL = "no-files-model"


@pytest.fixture(scope="module")
def fleet_without_gateway_files(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("no-files")
    checkpoint = shutil.copytree(tiny_checkpoint, root / "checkpoint")
    services = [start_service(root, "router", "router", "--model", MODEL)]
    try:
        router = services[0].address
        services.append(start_service(root, "worker", "worker", "--model-dir", str(checkpoint), "--model-name",
                                      MODEL, "--router", router, "--device", "cpu", "--num-kv-blocks", "64"))
        wait_until(lambda: num_healthy_workers(router) == 1, START_TIMEOUT_S, "the worker to register")
        moved = checkpoint.rename(root / "moved-away")
        gateway = start_service(root, "gateway", "gateway", "--host", "127.0.0.1", "--port", "0",
                                "--router", router, "--no-auth")
        services.append(gateway)
        url = f"http://127.0.0.1:{gateway.port}"
        wait_gateway_ready(url)
        yield url, moved
    finally:
        for service in reversed(services):
            service.stop(timeout_s=20.0)


def test_model_is_listed_and_served_from_published_tokenizer_files(fleet_without_gateway_files):
    url, moved_checkpoint = fleet_without_gateway_files
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages = [{"role": "user", "content": "Tell me about ships."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)

    engine = LLMEngine(EngineConfig(model_dir=str(moved_checkpoint), num_kv_blocks=64))
    prompt = engine.tokenizer.encode_chat(messages)
    (expected,) = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    # Same chat template, same prompt tokens, same detokenized text as with the checkpoint's own files.
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].message.content == expected.text
