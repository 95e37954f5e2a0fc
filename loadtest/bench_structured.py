"""Output tok/s of one batch with and without a JSON-schema constraint, in the same run, and what the grammar
costs per step. Default checkpoint: the trained default model (smollm2-135m-instruct). Ends with one JSON line.

    python loadtest/bench_structured.py --rounds 3
    python loadtest/bench_structured.py --model-dir DIR --batch 64

Each round runs the batch twice, alternating: *constrained* (every request under the schema below, greedy; the
grammar ends each one) and *free* (the same prompts with max_tokens set to the token counts the constrained run
produced and EOS ignored, so both runs make exactly the same number of tokens in the same shapes). The
grammar's own cost is the time spent in the masking call (grammar_backend.mask_logits: llguidance's batched
mask plus applying it), measured inside the constrained run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from flotilla.engine import grammar_backend, model_runner
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.structured_output import StructuredOutput

# A record a model fills sensibly, long enough (~60-100 tokens) that decode dominates.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 3, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
TOPICS = ["a lighthouse keeper", "a ship's cook", "a harbour pilot", "a sailmaker", "a tide-table printer",
          "a ferry captain", "a net mender", "a diver"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="checkpoint (default: smollm2-135m-instruct, pulled if needed)")
    p.add_argument("--state-dir", default=".flotilla", help="where the default model is pulled (default .flotilla)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    return p.parse_args(argv)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class MaskTimer:
    """Wraps the runner's mask call to add up its time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._inner = grammar_backend.mask_logits

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from flotilla.models.catalog import DEFAULT_MODEL, pull

        model_dir = pull(DEFAULT_MODEL, Path(args.state_dir) / "models" / DEFAULT_MODEL, announce=say)
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=4096 // 16 * args.batch // 8 + 64))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content":
                f"Invent a person who works as {TOPICS[i % len(TOPICS)]} (number {i}) and describe them as JSON."}])
               for i in range(args.batch)]
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_output=spec)
    timer = MaskTimer()
    model_runner.mask_logits = timer  # the runner looks the name up in its module at each step
    engine.generate(prompts[:2], constrained)  # warm-up: llguidance's vocabulary, the grammar, the kernel

    rounds: dict[str, list[float]] = {"constrained": [], "free": []}
    mask_ms_per_step: list[float] = []
    valid = 0
    for index in range(args.rounds):
        timer.seconds, timer.calls = 0.0, 0
        started = time.perf_counter()
        results = engine.generate(prompts, constrained)
        constrained_s = time.perf_counter() - started
        lengths = [len(r.token_ids) for r in results]
        valid = sum(_validates(r.text) for r in results)
        mask_ms_per_step.append(timer.seconds / max(timer.calls, 1) * 1e3)
        free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        started = time.perf_counter()
        engine.generate(prompts, free)
        free_s = time.perf_counter() - started
        rounds["constrained"].append(sum(lengths) / constrained_s)
        rounds["free"].append(sum(lengths) / free_s)
        say(f"round {index + 1}: constrained {rounds['constrained'][-1]:.0f} tok/s, free {rounds['free'][-1]:.0f} "
            f"tok/s, mask {mask_ms_per_step[-1]:.2f} ms/step over {timer.calls} steps, {valid}/{args.batch} valid")
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    say(f"median: constrained {medians['constrained']:.0f} tok/s, free {medians['free']:.0f} tok/s "
        f"({medians['constrained'] / medians['free'] - 1:+.1%}); mask {statistics.median(mask_ms_per_step):.2f} ms/step")
    print(json.dumps({
        "model_dir": str(model_dir), "batch": args.batch, "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
        "output_tokens_per_round": sum(lengths),
        "tok_s": {name: round(value, 1) for name, value in medians.items()},
        "tok_s_rounds": {name: [round(v, 1) for v in values] for name, values in rounds.items()},
        "constrained_over_free": round(medians["constrained"] / medians["free"], 3),
        "mask_ms_per_step": round(statistics.median(mask_ms_per_step), 3),
        "valid_outputs": valid,
    }))
    return 0


def _validates(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
