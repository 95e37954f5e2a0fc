"""Degradation before refusal through the real SDKs: with the router's backlog past the onset, a free-tier
request is served with max_tokens capped (finish reason length at the cap, usage showing it), its tenant's
token quota tightened, and the response says so in x-flotilla-degraded; a paid request is untouched."""

from __future__ import annotations

import anthropic
import openai
import pytest

from flotilla.gateway.degradation import DegradationPolicy
from flotilla.tenancy.keys import KeyEntry, hash_key, write_keys_file
from flotilla.tenancy.records import Limits

from tests.support.waiting import wait_until

from .in_process_gateway import InProcessGateway

CAP = 3
FREE_TPM = 10_000


@pytest.fixture(scope="module")
def degrading(checkpoint_dir, tmp_path_factory):
    policy = DegradationPolicy(onset_s=1.0, free_max_tokens=CAP, min_free_quota_fraction=0.25,
                               poll_interval_s=0.05)
    gw = InProcessGateway(checkpoint_dir, tmp_path_factory.mktemp("degrade-keys"), degradation=policy)
    write_keys_file(gw.keys_file, [KeyEntry("k-paid", hash_key(gw.paid_key), "acme", "paid"),
                                   KeyEntry("k-free", hash_key(gw.free_key), "hobbyist", "free",
                                            limits=Limits(tokens_per_minute=FREE_TPM))])
    gw.start()
    yield gw
    gw.stop()


def _overloaded(gw: InProcessGateway, wait_s: float | None) -> None:
    """Sets the router's backlog wait and waits until the gateway's poller has read it."""
    gw.fake.queue_wait_s = wait_s
    load = gw.app_state().queue_load
    wait_until(lambda: load.wait_s("tiny") == wait_s, 5.0, f"the gateway to read wait {wait_s}", interval_s=0.02)


def test_a_free_request_is_capped_and_told_while_a_paid_one_is_not(degrading):
    _overloaded(degrading, 3.0)  # half-way from the onset (1 s) to the free budget (5 s)
    free = openai.OpenAI(base_url=f"{degrading.base_url}/v1", api_key=degrading.free_key, max_retries=0)
    raw = free.completions.with_raw_response.create(model="tiny", prompt="hello", max_tokens=50)
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == CAP
    assert raw.headers["x-flotilla-degraded"] == "max_tokens=3; tokens_per_minute=6250"
    assert raw.headers["x-ratelimit-limit-tokens"] == "6250"  # the tightened limit, as the window sees it
    assert degrading.fake.requests[-1].sampling.max_tokens == CAP  # the engine was asked for the cap only
    paid = openai.OpenAI(base_url=f"{degrading.base_url}/v1", api_key=degrading.paid_key, max_retries=0)
    raw = paid.completions.with_raw_response.create(model="tiny", prompt="hello", max_tokens=50)
    assert "x-flotilla-degraded" not in raw.headers and raw.parse().usage.completion_tokens == 6  # its natural end


def test_anthropic_streams_say_it_too(degrading):
    _overloaded(degrading, 9.0)  # past the free budget: the quota at its floor
    client = anthropic.Anthropic(base_url=degrading.base_url, api_key=degrading.free_key, max_retries=0)
    with client.messages.with_streaming_response.create(
            model="tiny", max_tokens=50, stream=True, messages=[{"role": "user", "content": "hi"}]) as response:
        assert response.headers["x-flotilla-degraded"] == f"max_tokens=3; tokens_per_minute={FREE_TPM // 4}"
        body = "".join(response.iter_text())
    assert '"stop_reason":"max_tokens"' in body.replace(" ", "") and '"output_tokens":3' in body.replace(" ", "")


def test_batch_class_requests_are_never_cut_short(degrading):
    _overloaded(degrading, 3.0)
    free = openai.OpenAI(base_url=f"{degrading.base_url}/v1", api_key=degrading.free_key, max_retries=0,
                         default_headers={"x-flotilla-priority": "batch"})
    raw = free.completions.with_raw_response.create(model="tiny", prompt="hello", max_tokens=50)
    assert "x-flotilla-degraded" not in raw.headers and raw.parse().usage.completion_tokens == 6


def test_below_the_onset_or_without_a_signal_nothing_is_degraded(degrading):
    free = openai.OpenAI(base_url=f"{degrading.base_url}/v1", api_key=degrading.free_key, max_retries=0)
    for wait_s in (0.5, None):
        _overloaded(degrading, wait_s)
        raw = free.completions.with_raw_response.create(model="tiny", prompt="hello", max_tokens=50)
        assert "x-flotilla-degraded" not in raw.headers and raw.parse().usage.completion_tokens == 6
        assert raw.headers["x-ratelimit-limit-tokens"] == str(FREE_TPM)
