"""Single-stream greedy decode latency (ms per output token) of the engine, and of transformers in the same run,
next to the machine's memory floor: the fp32 weight bytes every decode step reads, over the best memory
bandwidth measured (loadtest/common/memory_bandwidth.py). Default checkpoint: the trained default model (smollm2-135m-instruct, as `flotilla model pull`
makes it). Ends with one JSON line.

    python loadtest/bench_decode.py --rounds 5
    python loadtest/bench_decode.py --model-dir DIR --output-len 64 --threads 1

Per round and system: T(1) = the time to the first token (prefill), T(n) = n forced greedy tokens (EOS
ignored); decode ms/token = (T(n) - T(1)) / (n - 1). Rounds alternate the systems; figures are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from flotilla.engine.config import CPU_LINEAR_BACKENDS, EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.tokenizer import Tokenizer
from loadtest.common import hf_baseline
from loadtest.common.checkpoint_cache import count_parameters
from loadtest.common.memory_bandwidth import measure_bandwidth

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="checkpoint to time (default: smollm2-135m-instruct, pulled if needed)")
    p.add_argument("--state-dir", default=".flotilla", help="where the default model is pulled (default .flotilla)")
    p.add_argument("--output-len", type=int, default=128, help="forced output tokens per timed request")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size of the bandwidth measurement")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--cpu-linear-backend", choices=CPU_LINEAR_BACKENDS, default="auto",
                   help="the engine's linears on a cpu (EngineConfig.cpu_linear_backend), for A/B runs")
    args = p.parse_args(argv)
    if args.output_len < 2 or args.rounds < 1:
        p.error("--output-len must be >= 2 and --rounds >= 1")
    return args


def resolve_model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    from flotilla.models.catalog import DEFAULT_MODEL, pull

    return pull(DEFAULT_MODEL, Path(args.state_dir) / "models" / DEFAULT_MODEL, announce=say)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def decode_ms(generate: Callable[[int], None], output_len: int) -> float:
    """(T(n) - T(1)) / (n - 1) in ms for one round."""
    started = time.perf_counter()
    generate(1)
    first = time.perf_counter() - started
    started = time.perf_counter()
    generate(output_len)
    total = time.perf_counter() - started
    return (total - first) / (output_len - 1) * 1e3


def engine_generator(model_dir: Path, prompt: list[int], cpu_linear_backend: str) -> Callable[[int], None]:
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=64, cpu_linear_backend=cpu_linear_backend))

    def generate(num_tokens: int) -> None:
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        (result,) = engine.generate([prompt], params)
        if len(result.token_ids) != num_tokens:
            raise RuntimeError(f"the engine made {len(result.token_ids)} tokens, not {num_tokens}")

    return generate


def transformers_generator(model_dir: Path, prompt: list[int], pad_id: int) -> Callable[[int], None]:
    model = hf_baseline.load_hf_model(str(model_dir), torch.device("cpu"))
    input_ids = torch.tensor([prompt])

    def generate(num_tokens: int) -> None:
        with torch.inference_mode():
            out = hf_baseline._generate(model, input_ids, torch.ones_like(input_ids), num_tokens, pad_id)
        hf_baseline._check_length(out.shape[1] - len(prompt), num_tokens)

    return generate


def run(args: argparse.Namespace) -> dict:
    model_dir = resolve_model_dir(args)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompt = tokenizer.encode_chat(PROMPT)
    systems = {"engine": engine_generator(model_dir, prompt, args.cpu_linear_backend)}
    if not args.skip_transformers:
        pad_id = min(tokenizer.eos_token_ids)
        systems["transformers"] = transformers_generator(model_dir, prompt, pad_id)
    for generate in systems.values():
        generate(4)  # warm-up: first-call allocations, the decode kernel's build
    rounds: dict[str, list[float]] = {name: [] for name in systems}
    for index in range(args.rounds):
        for name, generate in systems.items():
            rounds[name].append(decode_ms(generate, args.output_len))
        say(f"round {index + 1}: " + ", ".join(f"{name} {v[-1]:.1f} ms/token" for name, v in rounds.items()))
    bandwidths = [measure_bandwidth(args.bandwidth_mib) for _ in range(args.rounds)]
    best_gb_s = statistics.median(b.best_gb_s for b in bandwidths)
    num_parameters = count_parameters(model_dir)
    weight_bytes = num_parameters * 4
    floor_ms = weight_bytes / (best_gb_s * 1e9) * 1e3
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    for name, value in medians.items():
        say(f"{name}: median {value:.1f} ms/token ({1e3 / value:.1f} tok/s), {floor_ms / value:.0%} of the floor's "
            "rate")
    say(f"memory floor: {weight_bytes / 1e6:.0f} MB of fp32 weights / {best_gb_s:.1f} GB/s = "
        f"{floor_ms:.1f} ms/token")
    return {
        "model_dir": str(model_dir),
        "prompt_tokens": len(prompt),
        "output_len": args.output_len,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "cpu_linear_backend": args.cpu_linear_backend,
        "load_average": os.getloadavg()[0],
        "decode_ms_per_token": {name: round(value, 2) for name, value in medians.items()},
        "decode_ms_per_token_rounds": {name: [round(v, 2) for v in values] for name, values in rounds.items()},
        "num_parameters": num_parameters,
        "weight_bytes_fp32": weight_bytes,
        **{f"{name}": round(statistics.median(getattr(b, name) for b in bandwidths), 2)
           for name in ("torch_read_gb_s", "torch_copy_gb_s", "numpy_read_gb_s", "numpy_copy_gb_s")},
        "floor_bandwidth_gb_s": round(best_gb_s, 2),
        "memory_floor_ms_per_token": round(floor_ms, 2),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
