"""overlap_output_processing (engine.py, step): the host makes a step's text while the next step runs. On a CPU
nothing runs beside the host, but the order is the GPU's: collect the step launched last, apply its tokens and the
finishes that need no text, schedule and launch the next step, then detokenize and match stop strings. Every
request must stream exactly what the synchronous order streams, a stop string's extra launched row must vanish,
and no block may be left behind."""

from __future__ import annotations

import json

import pytest

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


def test_overlap_defaults_on_for_cuda_only(reference):
    engine = LLMEngine(EngineConfig(model_dir=reference.model_dir, num_kv_blocks=8, block_size=16))
    assert engine.overlap_output_processing is False  # a CPU: nothing would run beside the host
