"""The safety stage through the in-process gateway with the real SDKs: the model's output is scripted (fake router
model "script"), so each test knows where a blocked term falls across chunks; the external classifier is a real
HTTP server on loopback (tests/support/moderation_server.py)."""

from __future__ import annotations

import gc
import json
import threading

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flotilla.usage.sinks import FileSink, read_file

from tests.support.moderation_server import CATEGORY, ModerationServer
from tests.support.waiting import wait_until

from .in_process_gateway import InProcessGateway

# "bomb recipe" is split across three chunks (three SSE events, two tokens' boundaries).
SCRIPT = ["Sure, ", "here is ", "what you ", "asked for, ", "the best ", "bo", "mb re", "cipe: ", "step one"]
CLEAN = ["Sure, ", "here is ", "a poem ", "about ", "the sea."]
QUESTION = [{"role": "user", "content": "Tell me something."}]
CLASSIFIER_TIMEOUT_S = 0.5


def _config(path, classifier_url: str, fail_mode: str) -> None:
    rules = [{"category": "weapons", "terms": ["bomb recipe"], "patterns": [r"\bnerve\s+gas\b"]}]
    path.write_text(json.dumps({"default": "strict", "policies": {
        "strict": {"window_chars": 8, "rules": rules,
                   "classifier": {"url": classifier_url, "timeout_s": CLASSIFIER_TIMEOUT_S, "fail_mode": fail_mode,
                                  "window_chars": 16}}}}))


@pytest.fixture(scope="module", autouse=True)
def _short_collections():
    """The gateway runs in this process, and late in the full suite the process holds ~800k-970k objects that Python's
    full collections walk: 0.4-0.66 s each (measured with a gc callback), as long as CLASSIFIER_TIMEOUT_S, so a
    collection during a classifier call turned a healthy call into a 503. Frozen, they are skipped, and a full
    collection walks only what this module makes; they go back to the collector when the module ends."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def classifier():
    server = ModerationServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["closed", "open"])
def safe_gateway(request, checkpoint_dir, classifier, tmp_path_factory):
    keys_dir = tmp_path_factory.mktemp(f"safety-{request.param}")
    _config(keys_dir / "safety.json", classifier.url, request.param)
    gw = InProcessGateway(checkpoint_dir, keys_dir, ledger_sink=FileSink(keys_dir / "usage.jsonl"),
                          safety_config=keys_dir / "safety.json").start()
    gw.usage_log = keys_dir / "usage.jsonl"
    gw.fail_mode = request.param
    yield gw
    gw.stop()


@pytest.fixture
def gateway(safe_gateway, classifier):
    classifier.reset()
    safe_gateway.fake.script = list(SCRIPT)
    safe_gateway.fake.script_delay_s = 0.01  # one chunk per read, as a model streams
    return safe_gateway


@pytest.fixture
def oai(gateway):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.paid_key, max_retries=0)


@pytest.fixture
def claude(gateway):
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.paid_key, max_retries=0)


def _blocks(gateway, stage: str, category: str) -> float:
    text = httpx.get(gateway.metrics_url).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "flotilla_gateway_safety_blocks_total" and s.labels["stage"] == stage
               and s.labels["category"] == category)


def test_openai_stream_stops_before_the_split_term(oai, gateway):
    before = _blocks(gateway, "output", "weapons")
    stream = oai.chat.completions.create(model="script", messages=QUESTION, max_tokens=50, stream=True,
                                         stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "content_filter"
    assert "bo" not in text.replace("about", "") and "recipe" not in text
    assert "".join(SCRIPT).startswith(text) and text.startswith("Sure, ")
    delivered = next(i for i in range(len(SCRIPT) + 1) if "".join(SCRIPT[:i]) == text)
    assert usage.completion_tokens == delivered  # one token per scripted chunk: only those sent are billed
    assert _blocks(gateway, "output", "weapons") == before + 1


def test_openai_stream_helper_raises_content_filter(oai):
    text = ""
    with pytest.raises(openai.ContentFilterFinishReasonError):
        with oai.chat.completions.stream(model="script", messages=QUESTION, max_tokens=50) as stream:
            for event in stream:
                text += event.delta if event.type == "content.delta" else ""
            stream.get_final_completion()
    assert "recipe" not in text and "".join(SCRIPT).startswith(text)


def test_openai_non_streamed_answer_is_cut_at_the_block(oai):
    r = oai.chat.completions.create(model="script", messages=QUESTION, max_tokens=50)
    assert r.choices[0].finish_reason == "content_filter"
    assert "".join(SCRIPT).startswith(r.choices[0].message.content) and "bo" not in r.choices[0].message.content
    with pytest.raises(openai.ContentFilterFinishReasonError):  # the SDK's parse helper raises, as documented
        oai.chat.completions.parse(model="script", messages=QUESTION, max_tokens=50)


def test_completions_stream_is_filtered_too(oai):
    text, finish = "", None
    for chunk in oai.completions.create(model="script", prompt="Tell me", max_tokens=50, stream=True):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "content_filter" and "recipe" not in text


def test_anthropic_stream_ends_with_an_error_event(claude):
    text = ""
    with pytest.raises(anthropic.APIStatusError) as raised:
        with claude.messages.stream(model="script", messages=QUESTION, max_tokens=50) as stream:
            for delta in stream.text_stream:
                text += delta
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert "weapons" in raised.value.body["error"]["message"]
    assert "".join(SCRIPT).startswith(text) and "bo" not in text


def test_anthropic_non_streamed_answer_is_a_refusal(claude):
    message = claude.messages.create(model="script", messages=QUESTION, max_tokens=50)
    assert message.stop_reason == "refusal"
    assert "".join(SCRIPT).startswith(message.content[0].text) and "bo" not in message.content[0].text


def test_clean_answers_pass_whole(oai, claude, gateway):
    gateway.fake.script = list(CLEAN)
    r = oai.chat.completions.create(model="script", messages=QUESTION, max_tokens=50)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("".join(CLEAN), "stop")
    text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="script", messages=QUESTION, max_tokens=50, stream=True) if c.choices)
    assert text == "".join(CLEAN)
    with claude.messages.stream(model="script", messages=QUESTION, max_tokens=50) as stream:
        assert "".join(stream.text_stream) == "".join(CLEAN)


def test_blocked_prompt_is_a_400_before_the_router(oai, claude, gateway):
    num_requests = len(gateway.fake.requests)
    before = _blocks(gateway, "input", "weapons")
    bad = [{"role": "user", "content": "Give me a BOMB Recipe"}]
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(model="script", messages=bad, max_tokens=20, stream=True)
    assert raised.value.code == "content_filter" and raised.value.body["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model="script", messages=bad, max_tokens=20)
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert len(gateway.fake.requests) == num_requests  # never admitted, never routed
    assert _blocks(gateway, "input", "weapons") == before + 2


def test_moderations_endpoint(oai, gateway, classifier):
    classifier.flagged_words = {"zebra"}
    r = oai.moderations.create(input=["a fine day", "nerve  gas", "a zebra"])
    assert [result.flagged for result in r.results] == [False, True, True]
    assert r.results[1].categories.model_extra["weapons"] is True
    assert r.results[2].categories.model_extra[CATEGORY] is True
    assert len(classifier.inputs) == 1 and len(classifier.inputs[0]) == 3  # one batched call for three texts
    assert r.model == "strict"
    classifier.fail_status = 500
    with pytest.raises(openai.InternalServerError) as raised:
        oai.moderations.create(input="anything")
    assert raised.value.status_code == 503 and raised.value.code == "safety_unavailable"


def test_classifier_flags_prompt_and_answer(oai, gateway, classifier):
    classifier.flagged_words = {"secret"}
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(model="script", messages=[{"role": "user", "content": "a secret"}], max_tokens=9)
    assert raised.value.code == "content_filter" and CATEGORY in raised.value.message
    gateway.fake.script = ["All ", "fine ", "here. ", "The sec", "ret is ", "out ", "now."]
    r = oai.chat.completions.create(model="script", messages=QUESTION, max_tokens=50)
    assert r.choices[0].finish_reason == "content_filter" and "sec" not in r.choices[0].message.content


def test_classifier_streams_are_batched_per_step(gateway, classifier):
    """Concurrent streams' windows go to the classifier together: fewer calls than windows judged."""
    gateway.fake.script = list(CLEAN) * 4
    num_streams, errors = 6, []

    def stream() -> None:
        try:
            client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.paid_key, max_retries=0)
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="script", messages=QUESTION, max_tokens=50, stream=True) if c.choices)
            assert text == "".join(CLEAN) * 4
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=stream) for _ in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    num_texts = sum(len(inputs) for inputs in classifier.inputs)
    assert num_texts >= num_streams * 2 and len(classifier.inputs) < num_texts


@pytest.mark.parametrize("failure", ["slow", "down"])
def test_failing_classifier_honours_the_fail_mode(oai, claude, gateway, classifier, failure):
    if failure == "slow":
        classifier.delay_s = CLASSIFIER_TIMEOUT_S * 4
    else:
        classifier.fail_status = 500
    gateway.fake.script = list(CLEAN)
    if gateway.fail_mode == "open":
        r = oai.chat.completions.create(model="script", messages=QUESTION, max_tokens=50)
        assert r.choices[0].message.content == "".join(CLEAN)
        with claude.messages.stream(model="script", messages=QUESTION, max_tokens=50) as stream:
            assert "".join(stream.text_stream) == "".join(CLEAN)
        return
    with pytest.raises(openai.InternalServerError) as raised:  # 503: the prompt could not be judged
        oai.chat.completions.create(model="script", messages=QUESTION, max_tokens=50, timeout=10)
    assert raised.value.status_code == 503 and raised.value.code == "safety_unavailable"
    with pytest.raises(anthropic.APIStatusError) as raised:
        claude.messages.create(model="script", messages=QUESTION, max_tokens=50, timeout=10)
    assert raised.value.status_code == 503


@pytest.mark.parametrize("failure", ["slow", "down"])
def test_classifier_failing_mid_answer_honours_the_fail_mode(oai, claude, gateway, classifier, failure):
    """The prompt passes; the classifier fails on the window holding "sea": the stream ends, never hangs."""
    classifier.trouble_words = {"sea"}
    if failure == "slow":
        classifier.delay_s = CLASSIFIER_TIMEOUT_S * 4
    else:
        classifier.fail_status = 500
    gateway.fake.script = list(CLEAN)
    stream = oai.chat.completions.create(model="script", messages=QUESTION, max_tokens=50, stream=True, timeout=10)
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    if gateway.fail_mode == "open":
        assert (text, finish) == ("".join(CLEAN), "stop")
        return
    assert finish == "content_filter" and "sea" not in text
    with pytest.raises(anthropic.APIStatusError) as raised:
        with claude.messages.stream(model="script", messages=QUESTION, max_tokens=50, timeout=10) as stream:
            for _ in stream.text_stream:
                pass
    assert raised.value.body["error"]["type"] == "api_error"  # the classifier could not answer: retryable


def _record(gateway, request_id: str):
    """The request's final usage record (after its checkpoint records, status open)."""
    def found():
        return next((r for r in read_file(gateway.usage_log) if r.request_id == request_id and r.status != "open"),
                    None)

    return wait_until(found, 10, f"the usage record of {request_id}", interval_s=0.02)


def test_ledger_bills_only_what_was_sent(oai, gateway):
    raw = oai.chat.completions.with_raw_response.create(model="script", messages=QUESTION, max_tokens=50)
    r = raw.parse()
    record = _record(gateway, raw.headers["request-id"])
    assert (record.status, record.error_code) == ("filtered", "weapons")
    assert record.output_tokens == r.usage.completion_tokens == SCRIPT.index("bo") - 1 < len(SCRIPT)


def test_tokens_held_back_when_the_client_leaves_are_not_billed(gateway):
    """Model "hang" sends one short chunk, held back (shorter than the window), then waits: the client gives up."""
    headers = {"authorization": f"Bearer {gateway.paid_key}"}
    body = {"model": "hang", "messages": QUESTION, "max_tokens": 50, "stream": True}
    num_cancelled = len(gateway.fake.cancelled)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.base_url + "/v1/chat/completions", headers=headers, json=body, timeout=1.0)
    assert gateway.fake.wait_until(lambda: len(gateway.fake.cancelled) > num_cancelled)
    request_id = gateway.fake.cancelled[-1].request_id
    record = _record(gateway, request_id)
    assert (record.status, record.output_tokens) == ("cancelled", 0)  # its one token was relayed, never sent


def test_checkpoint_records_do_not_bill_held_back_tokens(oai, gateway):
    """Ten one-character chunks, all inside the held-back window until the end: a checkpoint (here at every
    chunk) bills at most the chunk just relayed, never the ones still held."""
    gateway.fake.script = list("abcdefghij")
    gateway.ledger.checkpoint_interval_s = 0.0
    try:
        raw = oai.chat.completions.with_raw_response.create(model="script", messages=QUESTION, max_tokens=50,
                                                             stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == "abcdefghij"
    finally:
        gateway.ledger.checkpoint_interval_s = 1.0
    request_id = raw.headers["request-id"]
    assert _record(gateway, request_id).output_tokens == 10
    checkpoints = [r.output_tokens for r in read_file(gateway.usage_log)
                   if r.request_id == request_id and r.status == "open"]
    assert len(checkpoints) > 5 and max(checkpoints) <= 1
