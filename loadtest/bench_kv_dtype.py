"""How much a narrower KV cache costs in accuracy, on a trained model: for each cache format (fp8 e4m3 and e5m2,
with calibrated and with unit scales, model/kv_scales.py; bf16 and fp16) the greedy agreement with a cache in the
model's own dtype, the largest and mean |log-probability| error of the tokens both runs chose, and how many
sequences came out the same. Default checkpoint: the trained default model (smollm2-135m-instruct, as
`flotilla model pull` makes it). Ends with one JSON line.

    python loadtest/bench_kv_dtype.py
    python loadtest/bench_kv_dtype.py --kv-range-factor 64           # keys and values 64x larger
    python loadtest/bench_kv_dtype.py --kv-range-factor 0.00390625   # 256x smaller
    python loadtest/bench_kv_dtype.py --transformers-round-trip      # the format's own loss, without the engine

--kv-range-factor F runs a copy of the checkpoint with k_proj and v_proj multiplied by F and q_proj and o_proj
divided by it: the same model in exact arithmetic (F a power of two), whose keys and values sit elsewhere in the
format's range, as some models' do. --transformers-round-trip also runs transformers with each layer's K and V
projections rounded through each fp8 format (before RoPE, so not the engine's bits): greedy agreement with plain
transformers, which says how much of the loss is the format's rather than the engine's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from safetensors.torch import load_file, save_file

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.tokenizer import Tokenizer
from loadtest.bench_decode import resolve_model_dir, say
from loadtest.common.greedy_compare import Run, agreement, greedy_with_logprobs, logprob_errors, transformers_greedy

QUESTIONS = [
    "Tell me a long story about a lighthouse keeper and the sea.", "Explain how a refrigerator works.",
    "Write a Python function that reverses a linked list.", "What are the causes of the French Revolution?",
    "Give me a recipe for pancakes.", "Describe the water cycle to a child.", "Summarise the plot of Hamlet.",
    "Why is the sky blue?", "List five tips for a job interview.", "How do vaccines train the immune system?",
    "Write a haiku about autumn leaves.", "What is the difference between TCP and UDP?",
    "Translate 'good morning, how are you' into French and explain.", "Explain recursion with an example.",
    "What should I pack for a week of hiking?", "Compare cats and dogs as pets.",
]
FORMATS = {  # name: (kv_cache_dtype, kv_cache_scales)
    "float8_e4m3fn calibrated": ("float8_e4m3fn", "calibrate"),
    "float8_e4m3fn unit": ("float8_e4m3fn", "unit"),
    "float8_e5m2 calibrated": ("float8_e5m2", "calibrate"),
    "float8_e5m2 unit": ("float8_e5m2", "unit"),
    "bfloat16": ("bfloat16", "calibrate"),
    "float16": ("float16", "calibrate"),
}
PROJECTIONS = {".k_proj.": 1, ".v_proj.": 1, ".q_proj.": -1, ".o_proj.": -1}  # which way each is scaled


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="checkpoint (default: smollm2-135m-instruct, pulled if needed)")
    p.add_argument("--state-dir", default=".flotilla", help="where the default model is pulled (default .flotilla)")
    p.add_argument("--prompts", type=int, default=len(QUESTIONS), help=f"how many of the {len(QUESTIONS)} questions")
    p.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per prompt (EOS ends a sequence)")
    p.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=list(FORMATS))
    p.add_argument("--kv-range-factor", type=float, default=1.0,
                   help="run a copy with K/V this many times larger (q_proj, o_proj divided by it); a power of two")
    p.add_argument("--transformers-round-trip", action="store_true")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= len(QUESTIONS) or args.new_tokens < 1:
        p.error(f"--prompts must be in 1..{len(QUESTIONS)} and --new-tokens >= 1")
    if args.kv_range_factor <= 0 or torch.tensor(args.kv_range_factor).frexp().mantissa.item() != 0.5:
        p.error("--kv-range-factor must be a power of two (so that the copy is the same model)")
    return args


def rescaled_copy(model_dir: Path, factor: float, out: Path) -> Path:
    """The checkpoint with K/V projections times `factor` and q/o projections divided by it."""
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    scaled = 0
    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            sign = next((sign for part, sign in PROJECTIONS.items() if part in name), 0)
            if sign:
                tensor.mul_(factor ** sign)
                scaled += 1
        save_file(tensors, out / path.name, metadata={"format": "pt"})
    if not scaled:
        raise SystemExit(f"{model_dir} has no separate q/k/v/o projections to rescale")
    return out


def engine_run(model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: str = "auto",
               scales: str = "calibrate") -> tuple[Run, str]:
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), kv_cache_dtype=dtype, kv_cache_scales=scales,
                                    max_num_seqs=len(prompts)))
    return greedy_with_logprobs(engine, prompts, new_tokens), engine.kv_cache_format


def compare(run: Run, reference: Run) -> dict:
    errors = logprob_errors(run, reference)
    return {
        "agreement": round(agreement(run[0], reference[0]), 4),
        "max_logprob_error": round(max(errors, default=0.0), 4),
        "mean_logprob_error": round(statistics.mean(errors), 5) if errors else 0.0,
        "sequences_equal": sum(a == b for a, b in zip(run[0], reference[0])),
    }


def transformers_round_trip(model_dir: Path, prompts: list[list[int]], new_tokens: int, eos: list[int]) -> dict:
    from loadtest.common.gpu_runs import hf_model

    model = hf_model(model_dir, torch.device("cpu"), torch.float32)
    reference = transformers_greedy(model, prompts, new_tokens, eos)
    results = {}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        hooks = [projection.register_forward_hook(lambda module, inputs, out, dtype=dtype: out.to(dtype).to(out.dtype))
                 for layer in model.model.layers for projection in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        rounded = transformers_greedy(model, prompts, new_tokens, eos)
        for hook in hooks:
            hook.remove()
        results[str(dtype).removeprefix("torch.")] = {
            "agreement": round(agreement(rounded, reference), 4),
            "sequences_equal": sum(a == b for a, b in zip(rounded, reference)),
        }
    return results


def run(args: argparse.Namespace) -> dict:
    model_dir = resolve_model_dir(args)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[: args.prompts]]
    with tempfile.TemporaryDirectory(prefix="kv-range-") as scratch:
        if args.kv_range_factor != 1.0:
            model_dir = rescaled_copy(model_dir, args.kv_range_factor, Path(scratch) / "model")
        reference, reference_format = engine_run(model_dir, prompts, args.new_tokens)
        formats = {}
        for name in args.formats:
            result, kv_format = engine_run(model_dir, prompts, args.new_tokens, *FORMATS[name])
            formats[name] = compare(result, reference) | {"kv_cache_format": kv_format}
            say(f"{name}: " + ", ".join(f"{key} {value}" for key, value in formats[name].items()
                                         if key != "kv_cache_format"))
        report = {
            "model_dir": str(resolve_model_dir(args)),
            "kv_range_factor": args.kv_range_factor,
            "prompts": len(prompts),
            "new_tokens": args.new_tokens,
            "reference": reference_format,
            "reference_tokens": sum(len(tokens) for tokens in reference[0]),
            "formats": formats,
        }
        if args.transformers_round_trip:
            report["transformers_round_trip"] = transformers_round_trip(model_dir, prompts, args.new_tokens,
                                                                        sorted(tokenizer.eos_token_ids))
            say(f"transformers, K/V projections rounded: {report['transformers_round_trip']}")
    return report


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
