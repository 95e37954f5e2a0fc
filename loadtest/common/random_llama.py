"""Random Llama-style checkpoints of real model shapes (~1B, ~8B parameters), written fast: the weights are drawn
on the device (drawing 8B numbers on a CPU takes minutes), then saved as one safetensors file. The tokenizer is the
project's toy one (flotilla.models.toy_tokenizer), smaller than the model's vocabulary as in real checkpoints that
pad theirs; prompts stay inside it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from flotilla.models.atomic_files import write_json, write_text
from flotilla.models.checkpoint import (
    CheckpointSpec,
    ModelShape,
    generation_config,
    model_config,
    num_parameters as spec_parameters,
    tokenizer_config,
    weight_shapes,
)
from flotilla.models.toy_tokenizer import toy_tokenizer_json

# Llama 3.2 1B and Llama 3.1 8B (context cut to 4096: the check never goes further); "tiny" for the CPU dry run.
# (shape, tied embeddings). The 1B is untied, unlike Llama 3.2's: a random model with a tied lm_head mostly
# repeats its input token (its residual stream stays near that token's embedding), which every engine gets right.
SHAPES = {
    "1b": (ModelShape(2048, 16, 32, 8, 8192, 128256, 4096), False),
    "8b": (ModelShape(4096, 32, 32, 8, 14336, 128256, 4096), False),
    "tiny": (ModelShape(128, 2, 4, 2, 256, 8448, 1024), False),
}
TOKENIZER_VOCAB = 8192
INIT_STD = 0.02  # as Llama's initializer_range: keeps activations in range through 32 layers


def write_random_llama(out_dir: Path, size: str, device: torch.device, dtype: str = "bfloat16", seed: int = 0) -> Path:
    shape, tied = SHAPES[size]
    spec = CheckpointSpec(shape, "llama", seed, INIT_STD, tied, None, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "tokenizer.json", toy_tokenizer_json(TOKENIZER_VOCAB))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(spec))
    write_json(out_dir / "config.json", model_config(spec))
    write_json(out_dir / "generation_config.json", generation_config())
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, dims in weight_shapes(spec).items():
        is_norm = name.endswith("norm.weight")
        tensor = torch.randn(dims, generator=generator, device=device, dtype=torch.float32)
        tensor = tensor * 0.05 + 1.0 if is_norm else tensor * INIT_STD
        weights[name] = tensor.to(getattr(torch, dtype)).cpu()
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def num_parameters(size: str) -> int:
    shape, tied = SHAPES[size]
    return spec_parameters(CheckpointSpec(shape, "llama", 0, INIT_STD, tied, None, "bfloat16"))


def decode_bytes_per_token(size: str, element_size: int = 2) -> int:
    """Weight bytes one decode step reads: every matrix but an untied embedding (only its rows are looked up)."""
    shape, tied = SHAPES[size]
    embedding = 0 if tied else shape.vocab_size * shape.hidden_size
    return (num_parameters(size) - embedding) * element_size
