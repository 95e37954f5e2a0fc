"""The conversation key the gateway sends for a rollout's sticky split: the same for every turn of a chat."""

from __future__ import annotations

from flotilla.gateway.anthropic_schema import InputMessage
from flotilla.gateway.conversation_key import conversation_key
from flotilla.gateway.openai_schema import ChatMessage


def chat(*turns: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in turns]


def test_every_turn_of_a_chat_has_the_first_turns_key():
    opening = [("system", "be brief"), ("user", "hi")]
    first = conversation_key("acme", None, messages=chat(*opening))
    later = conversation_key("acme", None, messages=chat(*opening, ("assistant", "hello"), ("user", "more"),
                                                         ("assistant", "sure"), ("user", "and more")))
    assert first == later and first.startswith("conv:acme:")
    assert conversation_key("acme", None, messages=chat(("system", "be brief"), ("user", "bye"))) != first
    assert conversation_key("other", None, messages=chat(*opening)) != first  # tenants never share one


def test_the_client_user_id_wins_and_is_scoped_by_tenant():
    assert conversation_key("acme", "u-7", messages=chat(("user", "a"))) == "user:acme:u-7"
    assert conversation_key("acme", "u-7", messages=chat(("user", "b"))) == "user:acme:u-7"
    assert conversation_key("beta", "u-7") != conversation_key("acme", "u-7")


def test_anthropic_system_prompt_is_part_of_the_opening():
    messages = [InputMessage(role="user", content="hi")]
    assert conversation_key("t", None, "sys A", messages) != conversation_key("t", None, "sys B", messages)
    longer = [*messages, InputMessage(role="assistant", content="yo"), InputMessage(role="user", content="?")]
    assert conversation_key("t", None, "sys A", messages) == conversation_key("t", None, "sys A", longer)


def test_no_messages_and_no_user_is_no_key():
    assert conversation_key("t", None) == ""
