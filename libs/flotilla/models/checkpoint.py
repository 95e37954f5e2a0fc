"""Random-weight Hugging Face checkpoints for tests and local runs (`flotilla model init`).

A checkpoint directory holds config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with a
ChatML chat template) and generation_config.json, loadable by transformers' AutoModelForCausalLM and
AutoTokenizer. Same arguments give byte-identical files.

Weights are normal(0, init_std) with a deliberately large std (0.25): at the usual 0.02 a random model
repeats one token whatever the context, and a greedy-exactness test would then pass with broken attention.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flotilla.models.atomic_files import write_json, write_text
from flotilla.models.toy_tokenizer import ENDOFTEXT, IM_END, IM_START, SPECIAL_TOKENS, toy_tokenizer_json

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
DTYPES = ("float32", "bfloat16", "float16")
# Spread of the norm weights around 1, so that a loader that ignores them is caught.
NORM_STD = 0.1

BOS_TOKEN_ID = SPECIAL_TOKENS.index(ENDOFTEXT)
EOS_TOKEN_ID = SPECIAL_TOKENS.index(IM_END)

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'system' and not loop.first %}\n"
    "{{- raise_exception('The system message must be the first message.') }}\n"
    "{%- endif %}\n"
    "{{- '" + IM_START + "' + message['role'] + '\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- else %}\n"
    "{%- for part in message['content'] %}\n"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '" + IM_END + "\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '" + IM_START + "assistant\\n' }}\n"
    "{%- endif %}\n"
)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


SIZES = {
    # ~0.1M parameters: a forward pass costs next to nothing, so what is measured is everything around the
    # model (scheduler, streaming path). For benchmarks of the serving path, not for text.
    "micro": ModelShape(64, 1, 2, 1, 128, 1024, 2048),
    # ~5.0M parameters (tied): a few MB, loads and runs in milliseconds on a CPU.
    "tiny": ModelShape(256, 4, 8, 4, 704, 8192, 2048),
    # ~95M parameters tied (~108M untied): big enough to measure batching and paging on a GPU.
    "small": ModelShape(768, 12, 12, 4, 2304, 16384, 4096),
}


@dataclass(frozen=True)
class CheckpointSpec:
    """Everything that determines a checkpoint's bytes."""

    shape: ModelShape
    architecture: str
    seed: int
    init_std: float
    tie_word_embeddings: bool
    rope_scaling: Mapping[str, Any] | None
    dtype: str


def write_checkpoint(
    out_dir: str | os.PathLike[str],
    size: str = "tiny",
    seed: int = 0,
    architecture: str = "llama",
    init_std: float = 0.25,
    tie_word_embeddings: bool = True,
    rope_scaling: Mapping[str, Any] | None = None,
    dtype: str = "float32",
) -> Path:
    """Write a random-weight checkpoint into out_dir (created if missing; our files replaced) and return it."""
    spec = make_spec(size, seed, architecture, init_std, tie_word_embeddings, rope_scaling, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = toy_tokenizer_json(spec.shape.vocab_size)
    write_text(out / "tokenizer.json", tokenizer_json)
    write_json(out / "tokenizer_config.json", tokenizer_config(spec))
    write_json(out / "config.json", model_config(spec))
    write_json(out / "generation_config.json", generation_config())
    _write_weights(out / "model.safetensors", spec)
    return out


def make_spec(
    size: str,
    seed: int,
    architecture: str,
    init_std: float,
    tie_word_embeddings: bool,
    rope_scaling: Mapping[str, Any] | None,
    dtype: str,
) -> CheckpointSpec:
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {architecture!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not init_std > 0:
        raise ValueError(f"init_std must be positive, got {init_std!r}")
    if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling must be a mapping or None, got {type(rope_scaling).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rope = dict(rope_scaling) if rope_scaling is not None else None
    return CheckpointSpec(SIZES[size], architecture, seed, float(init_std), bool(tie_word_embeddings), rope, dtype)


def model_config(spec: CheckpointSpec) -> dict[str, Any]:
    shape = spec.shape
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[spec.architecture]],
        "model_type": spec.architecture,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6 if spec.architecture == "qwen2" else 1e-5,
        "rope_theta": 10000.0 if spec.architecture == "llama" else 1000000.0,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.dtype,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "initializer_range": spec.init_std,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    config.update(_architecture_config(spec))
    return config


def _architecture_config(spec: CheckpointSpec) -> dict[str, Any]:
    if spec.architecture == "llama":
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    if spec.architecture == "qwen2":
        # Qwen2 always has q/k/v biases; sliding window is off, as in the released Qwen2/2.5 models.
        layers = spec.shape.num_hidden_layers
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers}
    return {"sliding_window": None}  # mistral: full attention, as in Mistral-7B v0.2 and later


def generation_config() -> dict[str, Any]:
    return {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID]}


def tokenizer_config(spec: CheckpointSpec) -> dict[str, Any]:
    # PreTrainedTokenizerFast loads tokenizer.json verbatim; a model-specific class could rebuild it.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.shape.max_position_embeddings,
        "chat_template": CHATML_TEMPLATE,
    }


def weight_shapes(spec: CheckpointSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by its Hugging Face name."""
    shape = spec.shape
    hidden, kv_dim = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    q_dim = shape.num_attention_heads * shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, hidden)}
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes.update({
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.mlp.gate_proj.weight": (shape.intermediate_size, hidden),
            f"{prefix}.mlp.up_proj.weight": (shape.intermediate_size, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, shape.intermediate_size),
        })
        if spec.architecture == "qwen2":
            shapes.update({
                f"{prefix}.self_attn.q_proj.bias": (q_dim,),
                f"{prefix}.self_attn.k_proj.bias": (kv_dim,),
                f"{prefix}.self_attn.v_proj.bias": (kv_dim,),
            })
    shapes["model.norm.weight"] = (hidden,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, hidden)
    return shapes


def num_parameters(spec: CheckpointSpec) -> int:
    total = 0
    for dims in weight_shapes(spec).values():
        count = 1
        for dim in dims:
            count *= dim
        total += count
    return total


def _tensor_seed(seed: int, name: str) -> int:
    # One generator per tensor, seeded from (seed, name): a tensor's values do not depend on which other
    # tensors exist, so e.g. llama and qwen2 checkpoints of one seed share all their matrices.
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def random_weights(spec: CheckpointSpec) -> dict[str, Any]:
    import torch  # heavy import; only needed when writing weights

    weights = {}
    for name, dims in weight_shapes(spec).items():
        # A CPU generator: the same seed gives the same numbers on every machine, whatever the accelerator.
        generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(spec.seed, name))
        tensor = torch.empty(dims, dtype=torch.float32)
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            tensor.normal_(1.0, NORM_STD, generator=generator)
        else:
            tensor.normal_(0.0, spec.init_std, generator=generator)
        weights[name] = tensor.to(getattr(torch, spec.dtype)).contiguous()
    return weights


def _write_weights(path: Path, spec: CheckpointSpec) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save_file(random_weights(spec), str(tmp), metadata={"format": "pt"})
    # save_file creates the file private (0600); give it the same mode as the JSON files next to it.
    os.chmod(tmp, (path.parent / "config.json").stat().st_mode & 0o777)
    os.replace(tmp, path)
