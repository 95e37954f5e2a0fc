"""How safe a fault test's streams are from float32 noise when they resume on another worker.

A stream resumed elsewhere re-prefills its prompt plus the tokens it delivered, and those logits differ from the
decode steps' that produced the reference by float32 rounding (~1e-4 on the tiny checkpoint, both paths that far
from float64). A token lying closer to the edge of its choice than that can come out differently, and then the
resumed stream no longer equals the run without a failure:

- a seeded draw picks the token whose CDF interval holds the draw's uniform number (engine/sampler.py); its
  margin is the uniform's distance from the nearer end of that interval, its shift how far the two ends moved;
- a greedy token is the argmax; its margin is the gap between the two highest logits, its shift how much that
  gap changed (--greedy).

This script measures both sides on the engine itself (CPU, float32). The reference runs all the streams in one
batch; with --search N it tries N seed bases (base + stream index, as the tests seed) and keeps the one whose
closest draw lies farthest out. Then every stream is resumed at each of --resume-points (default: every token):
the shifts of its draws against the reference's, and which resumed streams came out different (flips).
The prompts are the fault tests' (fault_test_prompts: random.Random(prompt seed), 4-15 token ids each). Ends with
one JSON line.

    python loadtest/resume_margins.py --top-k 8 --seed-base 44000      # tests/fleet/faults/test_worker_failure.py
    python loadtest/resume_margins.py --greedy                         # its greedy streams
    python loadtest/resume_margins.py --prompt-seed 6 --seed-base 10000 --resume-points 4    # its flake (6: its
                                                                       # prompts until 2026-12-07)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from flotilla.engine import model_runner
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampler import _probabilities, _token_uniform
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.structured_output import StructuredOutput
from flotilla.models import write_checkpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the tests' tiny checkpoint, seed 0)")
    p.add_argument("--prompt-seed", type=int, default=10, help="random.Random seed of the prompts (default: "
                                                               "test_worker_failure.py's)")
    p.add_argument("--num-streams", type=int, default=64)
    p.add_argument("--prompt-text", nargs="+", help="these prompts (tokenized by the model's tokenizer) instead")
    p.add_argument("--stride", type=int, default=2, help="measure streams 0, stride, 2 stride... (1, 1 + stride... "
                                                         "with --greedy: the tests' greedy streams are the odd ones)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--greedy", action="store_true", help="greedy streams instead of seeded ones")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--json-schema", help="constrain every stream to this JSON Schema (JSON text)")
    p.add_argument("--seed-base", type=int, default=10_000)
    p.add_argument("--search", type=int, default=1, help="try this many bases, --seed-base + 1000 k, keep the best")
    p.add_argument("--resume-points", type=int, nargs="*", help="output indices to resume at (default: all)")
    return p.parse_args(argv)


def fault_test_prompts(seed: int, count: int) -> list[list[int]]:
    """The fault tests' prompts (tests/fleet/faults): 4-15 token ids each, under one KV block, drawn from
    random.Random(seed). One function, so that the margins measured here are the tests' own."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 16))] for _ in range(count)]


class DrawRecorder:
    """Wraps model_runner.sample_ids. Per (request id, output index): for a sampled row, the normalised CDF its
    draw searched (after temperature, top-k, top-p and any grammar mask) and its uniform number; for a greedy row,
    its logits (masked too)."""

    def __init__(self) -> None:
        self.draws: dict[tuple[str, int], tuple[torch.Tensor, float] | torch.Tensor] = {}

    @contextmanager
    def installed(self):
        original = model_runner.sample_ids

        def recording(logits, requests, default_seed):
            for row, request in enumerate(requests):
                index = request.num_previous_output_tokens + request.num_output_tokens
                if request.sampling_params.is_greedy:
                    self.draws[request.request_id, index] = logits[row].clone()
                else:
                    cdf = torch.cumsum(_probabilities(logits, [request], [row])[0], dim=-1)
                    self.draws[request.request_id, index] = (cdf / cdf[-1], _token_uniform(request, default_seed))
            return original(logits, requests, default_seed)

        model_runner.sample_ids = recording
        try:
            yield self
        finally:
            model_runner.sample_ids = original


def margin(draw) -> float:
    """A seeded draw's distance from the nearer end of its CDF interval; a greedy token's lead over the next."""
    if isinstance(draw, torch.Tensor):
        top_two = draw.topk(2).values
        return float(top_two[0] - top_two[1])
    cdf, uniform = draw
    token = _drawn(cdf, uniform)
    low = float(cdf[token - 1]) if token > 0 else 0.0
    return min(uniform - low, float(cdf[token]) - uniform)


def shift(reference, resumed) -> float:
    """How far the reference draw's edges moved in the resumed one: its interval's two ends, or its top-two gap."""
    if isinstance(reference, torch.Tensor):
        first, second = reference.topk(2).indices
        if torch.isinf(reference[second]):  # a grammar allows one token: nothing to flip
            return 0.0
        return float(abs((reference[first] - reference[second]) - (resumed[first] - resumed[second])))
    cdf, uniform = reference
    token = _drawn(cdf, uniform)
    ends = slice(max(token - 1, 0), token + 1)
    return float((cdf[ends] - resumed[0][ends]).abs().max())


def _drawn(cdf: torch.Tensor, uniform: float) -> int:
    return int(torch.searchsorted(cdf, torch.tensor([uniform], dtype=cdf.dtype), right=True))


def run(engine: LLMEngine, requests: list[NewRequest]) -> dict[str, list[int]]:
    """Every request to completion in one engine, batched as the scheduler likes; token ids per request id."""
    outputs: dict[str, list[int]] = {}
    for new in requests:
        engine.add_request(new)
        outputs[new.request_id] = []
    pending = set(outputs)
    while pending:
        for output in engine.step():
            outputs[output.request_id] += output.new_token_ids
            if output.finished:
                pending.discard(output.request_id)
    return outputs


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = args.model or write_checkpoint(Path(tempfile.mkdtemp(prefix="margins-")), size="tiny", seed=0)
    engine = LLMEngine(EngineConfig(model_dir=str(model), device="cpu", num_kv_blocks=512))
    prompts = fault_test_prompts(args.prompt_seed, args.num_streams)
    if args.prompt_text:
        prompts = [engine.tokenizer.encode(text) for text in args.prompt_text]
    streams = range(1 if args.greedy and not args.prompt_text else 0, len(prompts), args.stride)
    structured = StructuredOutput("json", args.json_schema) if args.json_schema else None

    def params(stream: int, base: int, max_tokens: int) -> SamplingParams:
        if args.greedy:
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=structured)
        return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k,
                              seed=base + stream, structured_output=structured)

    recorder = DrawRecorder()
    with recorder.installed():
        best = None  # (closest draw, stream, index), base, reference tokens, reference draws
        for base in range(args.seed_base, args.seed_base + 1000 * args.search, 1000):
            recorder.draws.clear()
            tokens = run(engine, [NewRequest(f"ref-{i}", tuple(prompts[i]), params(i, base, args.max_tokens))
                                  for i in streams])
            closest = min((margin(recorder.draws[f"ref-{i}", j]), i, j)
                          for i in streams for j in range(len(tokens[f"ref-{i}"])))
            print(f"base {base}: closest draw {closest[0]:.2e} (stream {closest[1]}, token {closest[2]})", flush=True)
            if best is None or closest[0] > best[0][0]:
                best = (closest, base, tokens, dict(recorder.draws))
        (closest, base, reference, reference_draws) = best

        recorder.draws.clear()
        shifts, flips = [], []
        points = args.resume_points or range(1, args.max_tokens)
        for point in points:
            resumed = run(engine, [NewRequest(f"at{point}-{i}", tuple(prompts[i]),
                                              params(i, base, args.max_tokens - point),
                                              delivered_token_ids=tuple(reference[f"ref-{i}"][:point]))
                                   for i in streams if point < len(reference[f"ref-{i}"])])
            for request_id, tokens in resumed.items():
                stream = int(request_id.split("-")[1])
                expected = reference[f"ref-{stream}"][point:]
                same = next((k for k, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(expected))
                if same < len(expected) or len(tokens) != len(expected):
                    flips.append({"stream": stream, "resumed_at": point, "differs_at": point + same})
                for index in range(point, point + same):  # draws after a flip have other prefixes
                    shifts.append(shift(reference_draws[f"ref-{stream}", index], recorder.draws[request_id, index]))
            recorder.draws.clear()

    report = {"bench": "resume_margins", "greedy": args.greedy, "seed_base": base, "temperature": args.temperature,
              "top_k": args.top_k, "num_draws": sum(len(t) for t in reference.values()),
              "closest_draw": closest[0], "closest_draw_at": {"stream": closest[1], "token": closest[2]},
              "num_resumed_draws": len(shifts), "flips": flips}
    if shifts:
        shifts.sort()
        report.update(shift_median=statistics.median(shifts), shift_p99=shifts[int(0.99 * (len(shifts) - 1))],
                      shift_max=shifts[-1], closest_over_max_shift=closest[0] / shifts[-1] if shifts[-1] else None)
        print(f"resumed at {len(points)} points: {len(flips)} flips; shift over {len(shifts)} draws: "
              f"median {report['shift_median']:.1e}, p99 {report['shift_p99']:.1e}, max {report['shift_max']:.1e}")
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
