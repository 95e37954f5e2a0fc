"""overlap_output_processing (engine.py, step): the host makes a step's text while the next step runs. On a CPU
nothing runs beside the host, but the order is the GPU's: collect the step launched last, apply its tokens and the
finishes that need no text, schedule and launch the next step, then detokenize and match stop strings. Every
request must stream exactly what the synchronous order streams, a stop string's extra launched row must vanish,
and no block may be left behind."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import pytest

from flotilla.engine import engine as engine_module
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.structured_output import StructuredOutput


def _engine(model_dir: str, overlap: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=96, block_size=16, max_num_batched_tokens=256,
                                  overlap_output_processing=overlap))


def _stream(engine: LLMEngine, requests: list[tuple[str, tuple[int, ...], SamplingParams]],
            abort: tuple[str, int] | None = None) -> dict[str, list[tuple]]:
    """Each request's outputs, as the engine's callers see them, over a step loop; abort=(id, n): abort that
    request once it has streamed n outputs."""
    for request_id, prompt, params in requests:
        engine.add_request(NewRequest(request_id, prompt, params))
    streams: dict[str, list[tuple]] = {request_id: [] for request_id, _, _ in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams[out.request_id].append(
                (tuple(out.new_token_ids), out.text_delta, out.finished, out.finish_reason, out.stop_reason,
                 out.num_output_tokens, [(lp.logprob, lp.top) for lp in out.logprobs]))
        if abort is not None and len(streams[abort[0]]) >= abort[1]:
            engine.abort(abort[0])
            abort = None
    return streams


def _text(stream: list[tuple]) -> str:
    return "".join(item[1] for item in stream)


@pytest.fixture(scope="module")
def engines(reference):
    return _engine(reference.model_dir, overlap=False), _engine(reference.model_dir, overlap=True)


def _mixed_requests(reference, stops: dict[int, str]) -> list[tuple[str, tuple[int, ...], SamplingParams]]:
    """Greedy and sampled, logprobs, stop strings, a stop token id, EOS left on, and a JSON grammar."""
    prompts = reference.prompts
    requests = []
    for i in range(10):
        params = SamplingParams(max_tokens=10 + 3 * i, temperature=0.0 if i % 2 else 0.9, seed=i, top_k=50 * (i % 3),
                                logprobs=2 if i % 4 == 1 else None, ignore_eos=i != 3,
                                stop=[stops[i]] if i in stops else [])
        requests.append((f"r{i}", tuple(prompts[i]), params))
    first = reference.expected[10][3]
    requests.append(("stop-id", tuple(reference.prompts[10]), SamplingParams(max_tokens=20, temperature=0.0,
                                                                            stop_token_ids=[first])))
    grammar = StructuredOutput("json", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                   "required": ["ok"], "additionalProperties": False}))
    requests.append(("json", tuple(prompts[11]), SamplingParams(max_tokens=60, temperature=0.0,
                                                               structured_output=grammar)))
    return requests


def test_overlap_streams_what_the_synchronous_order_streams(engines, reference):
    sync, overlap = engines
    # Stop strings taken from the middle of what each request writes without them: they end it part way.
    plain = _stream(sync, _mixed_requests(reference, {}))
    stops = {i: _text(plain[f"r{i}"])[len(_text(plain[f"r{i}"])) // 2:][:3] for i in (0, 2, 5)}
    assert all(stops.values())
    requests = _mixed_requests(reference, stops)
    expected = _stream(sync, requests)
    assert _stream(overlap, requests) == expected
    for i in stops:  # the stop strings did cut those requests short
        assert expected[f"r{i}"][-1][4] == stops[i]
        assert len(expected[f"r{i}"]) < len(plain[f"r{i}"])
    assert expected["stop-id"][-1][4] == reference.expected[10][3]  # ended by the stop token id
    json.loads(_text(expected["json"]))
    for engine in engines:
        assert engine.check_integrity()
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_overlap_delivers_a_step_one_call_later(engines, reference):
    _, overlap = engines
    overlap.add_request(NewRequest("late", tuple(reference.prompts[0]), SamplingParams(max_tokens=3, temperature=0.0)))
    assert overlap.step() == []  # launched; its token comes back with the next call
    outputs = overlap.step()
    assert [out.new_token_ids for out in outputs] == [[reference.expected[0][0]]]
    while overlap.has_unfinished_requests():
        outputs += overlap.step()
    assert [t for out in outputs for t in out.new_token_ids] == reference.expected[0][:3]


def test_abort_with_a_step_in_flight(engines, reference):
    sync, overlap = engines
    requests = [(f"a{i}", tuple(reference.prompts[i]), SamplingParams(max_tokens=16, temperature=0.0))
                for i in range(4)]
    expected = _stream(sync, requests, abort=("a1", 5))
    streamed = _stream(overlap, requests, abort=("a1", 5))
    # The aborted request streams what it had (its launched step's token is dropped); the others are untouched.
    assert streamed["a1"] == expected["a1"][:5] and not streamed["a1"][-1][2]
    assert {k: v for k, v in streamed.items() if k != "a1"} == {k: v for k, v in expected.items() if k != "a1"}
    assert overlap.check_integrity()
    assert overlap.stats().num_free_blocks == overlap.stats().num_total_blocks


def test_next_step_is_launched_before_the_running_one_is_read(reference):
    """Without grammars the next step goes out while the last one's tokens are still placeholders, its decode rows
    reading them on the device; the streams still equal the synchronous order's."""
    sync = _engine(reference.model_dir, overlap=False)
    overlap = _engine(reference.model_dir, overlap=True)
    rows = {}
    for name, engine in (("sync", sync), ("overlap", overlap)):
        launch = engine.runner.launch
        engine.runner.launch = lambda so, *rest, _name=name, _launch=launch, **options: (
            rows.__setitem__(_name, rows.get(_name, 0) + len(so.chunks)) or _launch(so, *rest, **options))
    requests = [(f"p{i}", tuple(reference.prompts[i]), SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8,
                                                                     seed=i, ignore_eos=True)) for i in range(6)]
    for request_id, prompt, params in requests:
        overlap.add_request(NewRequest(request_id, prompt, params))
    awaiting, streams = 0, {request_id: [] for request_id, _, _ in requests}
    while overlap.has_unfinished_requests():
        for out in overlap.step():
            streams[out.request_id] += out.new_token_ids
        awaiting = max(awaiting, sum(r.awaits_token for r in overlap.scheduler.requests.values()))
    assert awaiting == len(requests)  # every decoding request had a token on the device between calls
    assert streams == {k: [t for item in v for t in item[0]] for k, v in _stream(sync, requests).items()}
    assert rows["overlap"] == rows["sync"]  # no row past a request's last token (max_tokens known ahead)
    assert overlap.check_integrity()
    assert overlap.stats().num_free_blocks == overlap.stats().num_total_blocks


def test_grammar_steps_are_launched_before_the_running_one_is_read(reference):
    """Grammar requests (a JSON schema, a regex, choices; greedy and sampled) beside plain ones. Each step is
    launched up to its logits while the one before is still unread; its grammar rows are sampled once that step's
    tokens reached their matchers. Choices complete within a few tokens, with the next step in flight: their rows
    there are dropped. The streams equal the synchronous order's and every output follows its grammar."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"type": "string", "maxLength": 6}},
              "required": ["n", "tag"], "additionalProperties": False}
    grammars = [StructuredOutput("json", json.dumps(schema)), StructuredOutput("regex", r"[a-z]{2,6}( [a-z]{2,6}){2}"),
                StructuredOutput("choice", json.dumps(["yes", "no", "maybe later"]))]
    requests = [(f"g{i}", tuple(reference.prompts[i]),
                 SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.8, seed=i,
                                structured_output=grammars[i % 3])) for i in range(6)]
    requests += [(f"p{i}", tuple(reference.prompts[6 + i]), SamplingParams(max_tokens=20, temperature=0.0))
                 for i in range(3)]
    sync, overlap = _engine(reference.model_dir, overlap=False), _engine(reference.model_dir, overlap=True)
    launches = []
    launch = overlap.runner.launch
    overlap.runner.launch = lambda so, previous=None, **options: (
        launches.append((any(c.request.grammar is not None for c in so.chunks), previous is not None))
        or launch(so, previous, **options))
    expected = _stream(sync, requests)
    assert _stream(overlap, requests) == expected
    # Steps with grammar rows went out while the step before was unread (before this, such steps waited for it).
    assert sum(grammar and ahead for grammar, ahead in launches) >= 10
    json.loads(_text(expected["g0"]))
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){2}", _text(expected["g1"]))
    assert _text(expected["g2"]) in ("yes", "no", "maybe later")
    assert overlap.check_integrity()
    assert overlap.stats().num_free_blocks == overlap.stats().num_total_blocks


def test_blocks_filled_by_a_placeholder_reach_the_prefix_cache(reference):
    """A block whose last token was a placeholder when its step was scheduled is published once the id is read, under
    the real token's hash: the next turn of the conversation hits it as with the synchronous order."""
    hits = []
    for overlap in (False, True):
        engine = _engine(reference.model_dir, overlap=overlap)
        prompt = tuple(reference.prompts[2][:40])
        [first] = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        [second] = engine.generate([prompt + tuple(first.token_ids) + (7, 8)],
                                   SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        hits.append(second.num_cached_prompt_tokens)
    assert hits[0] == hits[1] >= 64  # blocks past the 40-token prompt, filled with outputs, were hits


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_a_step_in_flight(reference, mode):
    """A pool too small for the batch: requests are preempted (some while their token is on the device) and resume;
    every stream equals the synchronous order's."""
    def small(overlap: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(model_dir=reference.model_dir, num_kv_blocks=14, block_size=16,
                                      max_num_batched_tokens=256, preemption_mode=mode,
                                      num_host_kv_blocks=64 if mode == "swap" else 0,
                                      overlap_output_processing=overlap))

    requests = [(f"q{i}", tuple(reference.prompts[i][:60]), SamplingParams(max_tokens=40, temperature=0.0,
                                                                           ignore_eos=True)) for i in range(1, 7)]
    sync, overlap = small(False), small(True)
    expected = _stream(sync, requests)
    assert _stream(overlap, requests) == expected
    assert sync.stats().num_preemptions > 0 and overlap.stats().num_preemptions > 0
    assert overlap.check_integrity()


def test_overlap_defaults_on_for_cuda_only(reference):
    engine = LLMEngine(EngineConfig(model_dir=reference.model_dir, num_kv_blocks=8, block_size=16))
    assert engine.overlap_output_processing is False  # a CPU: nothing would run beside the host


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_batch_bound_gets_the_time_of_the_step_the_call_waited_for(reference, monkeypatch, overlap):
    """Each step() call's time goes to the batch bound with the sequences of the step that call waited for: with
    overlap, the one the call before launched. A fake clock moves only while a step is collected, by that step's
    number of sequences, so every observation must pair n seconds with n sequences while the batch shrinks."""
    engine = _engine(reference.model_dir, overlap)
    clock = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(
        perf_counter=lambda: clock[0], monotonic=time.monotonic, monotonic_ns=time.monotonic_ns))
    launch = engine.runner.launch

    def launch_with_a_clocked_collect(scheduler_output, *rest, **options):
        pending = launch(scheduler_output, *rest, **options)  # no grammar rows: never a DeferredSampling
        collect = pending.collect

        def clocked_collect():
            clock[0] += len(scheduler_output.chunks)
            return collect()
        pending.collect = clocked_collect
        return pending
    engine.runner.launch = launch_with_a_clocked_collect
    observed = []
    engine.scheduler.observe_step = lambda step_s, num_seqs: observed.append((step_s, num_seqs))
    requests = [(f"b{i}", tuple(reference.prompts[i]), SamplingParams(max_tokens=2 + 2 * i, temperature=0.0,
                                                                     ignore_eos=True)) for i in range(6)]
    _stream(engine, requests)
    assert len({num_seqs for _, num_seqs in observed}) >= 4  # the batch did shrink as requests ended
    assert observed == [(float(num_seqs), num_seqs) for _, num_seqs in observed]
