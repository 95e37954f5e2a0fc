"""What the gateway tells the router about a request's conversation (GenerateRequest.affinity_key), through the
real SDKs: the client's user id when given, else the same hash for every turn of a chat."""

from __future__ import annotations

import anthropic
import openai


def test_openai_turns_of_one_chat_share_a_key_and_user_wins(gateway):
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.paid_key, max_retries=0)
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    client.chat.completions.create(model="tiny", messages=opening, max_tokens=2)
    first = gateway.fake.requests[-1].affinity_key
    client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        *opening, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Tell me more"}])
    assert gateway.fake.requests[-1].affinity_key == first and first.startswith("conv:")
    client.chat.completions.create(model="tiny", messages=opening, max_tokens=2, user="user-42")
    assert gateway.fake.requests[-1].affinity_key.startswith("user:") and "user-42" in \
        gateway.fake.requests[-1].affinity_key


def test_anthropic_metadata_user_id_is_the_key(gateway):
    client = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.paid_key, max_retries=0)
    messages = [{"role": "user", "content": "Hello there"}]
    client.messages.create(model="tiny", max_tokens=2, messages=messages, metadata={"user_id": "u-7"})
    assert gateway.fake.requests[-1].affinity_key.endswith(":u-7")
    client.messages.create(model="tiny", max_tokens=2, messages=messages, system="Be brief.")
    assert gateway.fake.requests[-1].affinity_key.startswith("conv:")


def test_a_model_that_left_the_list_still_reaches_the_router_and_keeps_the_gateway_ready(gateway):
    """Scale to zero: the router stops listing a model it can cold-start; the gateway passes its requests on."""
    import httpx

    from flotilla.api.common.v1 import common_pb2 as common

    listed = list(gateway.fake.models)
    gateway.fake.models = [common.ModelInfo(name="tiny-cold", version="v1", max_model_len=64,
                                            assets_digest=gateway.fake.assets_digest)]
    headers = {"x-api-key": gateway.paid_key}
    body = {"model": "tiny-cold", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        assert httpx.post(gateway.base_url + "/v1/chat/completions", json=body, headers=headers).status_code == 200
        gateway.fake.models = []
        models = httpx.get(gateway.base_url + "/v1/models", headers=headers).json()["data"]
        assert models == []  # not listed any more ...
        response = httpx.post(gateway.base_url + "/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200 and gateway.fake.requests[-1].model == "tiny-cold"  # ... still served
        assert httpx.get(gateway.base_url + "/readyz").status_code == 200
    finally:
        gateway.fake.models = listed
