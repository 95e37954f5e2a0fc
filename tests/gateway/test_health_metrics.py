"""Probes, metrics, request ids, model-list refresh, and a router that cannot be reached."""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.engine.tokenizer_files import files_digest, read_tokenizer_files
from flotilla.gateway.app import create_app
from flotilla.gateway.router_client import RouterClient
from flotilla.gateway.settings import GatewaySettings

CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}


def test_healthz_and_readyz(gateway):
    assert httpx.get(gateway.base_url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(gateway.base_url + "/readyz")
    assert ready.status_code == 200 and "tiny" in ready.json()["models"]


def test_request_id_is_sent_to_the_router_and_returned(gateway):
    response = httpx.post(gateway.base_url + "/v1/chat/completions", json=CHAT_BODY,
                          headers={"authorization": f"Bearer {gateway.free_key}"})
    request_id = response.headers["x-request-id"]
    assert response.headers["request-id"] == request_id and request_id.startswith("req_")
    sent = gateway.fake.request_by_id(request_id)
    assert sent.tenant_id == "hobbyist"
    assert httpx.get(gateway.base_url + "/healthz").headers["x-request-id"] != request_id


def test_metrics_count_requests_and_ttft(gateway):
    headers = {"x-api-key": gateway.free_key}
    httpx.post(gateway.base_url + "/v1/chat/completions", json=CHAT_BODY, headers=headers)
    httpx.post(gateway.base_url + "/v1/chat/completions", json={**CHAT_BODY, "model": "nope"}, headers=headers)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(httpx.get(gateway.metrics_url).text)
               for s in family.samples}

    ok = ("flotilla_gateway_requests_total",
          (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200")))
    not_found = (ok[0], (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "404")))
    assert samples[ok] >= 1 and samples[not_found] >= 1
    assert samples[("flotilla_gateway_ttft_seconds_count", (("model", "tiny"), ("tier", "free")))] >= 1
    assert samples[("flotilla_gateway_tokens_total", (("kind", "completion"), ("model", "tiny"), ("tier", "free")))] > 0
    assert samples[("flotilla_gateway_rejections_total", (("reason", "model_not_found"),))] >= 1


def test_tokenizer_files_are_fetched_once_for_every_model_that_shares_them(gateway):
    response = httpx.post(gateway.base_url + "/v1/chat/completions", json=CHAT_BODY,
                          headers={"x-api-key": gateway.paid_key})
    assert response.status_code == 200
    assert len(gateway.fake.models) > 1 and gateway.fake.num_asset_fetches == 1


def test_new_model_is_found_without_waiting_for_the_refresh_period(gateway, checkpoint_dir):
    gateway.fake.add_model(common.ModelInfo(name="tiny-new", version="v2", max_model_len=64,
                                            assets_digest=gateway.fake.assets_digest))
    response = httpx.post(gateway.base_url + "/v1/chat/completions", json={**CHAT_BODY, "model": "tiny-new"},
                          headers={"x-api-key": gateway.paid_key})
    assert response.status_code == 200 and response.json()["model"] == "tiny-new"


@pytest.fixture
def dead_address():
    # A port that was free a moment ago and has nothing listening now.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


class _ModelsButNoRouter(RouterClient):
    """Knows a model (as if listed before the router went away); every Generate goes to a dead address."""

    def __init__(self, address: str, checkpoint_path: str):
        super().__init__(address, list_timeout_s=0.5)
        self.tokenizer_files = read_tokenizer_files(checkpoint_path)

    async def list_models(self) -> list[common.ModelInfo]:
        return [common.ModelInfo(name="tiny", version="v1", max_model_len=128,
                                 assets_digest=files_digest(self.tokenizer_files))]

    async def get_model_assets(self, digest: str) -> dict[str, bytes]:
        return dict(self.tokenizer_files)


async def test_unreachable_router(dead_address, checkpoint_dir):
    settings = GatewaySettings(router_addresses=(dead_address,), retry_after_s=3)
    client = RouterClient(dead_address, list_timeout_s=0.5)
    app = create_app(settings, client, key_store=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as http:
        assert (await http.get("/readyz")).status_code == 503
        response = await http.post("/v1/messages", json=CHAT_BODY)
        assert response.status_code == 503 and response.headers["retry-after"] == "3"
        assert response.json()["error"]["type"] == "api_error"
    await client.close()

    backend = _ModelsButNoRouter(dead_address, str(checkpoint_dir))
    app = create_app(settings, backend, key_store=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as http:
        response = await http.post("/v1/chat/completions", json=CHAT_BODY)
        assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"
        assert response.headers["retry-after"] == "3"
    await backend.close()


def test_the_public_port_does_not_serve_metrics(gateway):
    response = httpx.get(gateway.base_url + "/metrics")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"
