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
