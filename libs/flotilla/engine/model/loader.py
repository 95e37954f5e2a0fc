"""Loads a Hugging Face safetensors checkpoint into LlamaForCausalLM or GemmaForCausalLM (fusing q/k/v and gate/up)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.gemma import GemmaForCausalLM
from flotilla.engine.model.kv_scales import CHECKPOINT_SCALE_NAME, KVScales, checkpoint_scales
from flotilla.engine.model.llama import LlamaForCausalLM

# Checkpoint tensors that carry nothing the model needs (old checkpoints saved rope buffers).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# HF sub-name -> (our fused parameter name, shard name)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
# Checkpoints that already store qkv_proj and gate_up_proj fused, in our row order (q, k, v; gate, up).
PREFUSED_ARCHITECTURES = ("Phi3ForCausalLM",)
_LAYER_NAME = re.compile(
    r"^(model\.layers\.\d+\.)(self_attn\.[qkv]_proj|mlp\.gate_proj|mlp\.up_proj)\.(weight|bias)$"
)
# One expert's matrix -> its rows of the layer's stacked experts.gate_up_proj / experts.down_proj
_EXPERT_NAME = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Target(NamedTuple):
    """Where one checkpoint tensor goes: rows [row_start, row_start + num_rows) of parameter `name`."""

    name: str
    row_start: int
    num_rows: int


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Builds the model from `model_dir` (config.json + *.safetensors) in eval mode on `device`.

    Ties lm_head to the embeddings when the config says so or the checkpoint has no lm_head.weight.
    Raises ValueError for a missing, unexpected or wrongly shaped tensor.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    files = _safetensors_files(model_dir)
    names = _tensor_names(files)
    tie = config.tie_word_embeddings or "lm_head.weight" not in names
    model = _empty_model(config, dtype, device, tie)
    params = dict(model.named_parameters())
    expected = _expected_targets(model, config, tie)
    loaded: set[Target] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _target(name, config, tie)
                if target is None:
                    continue
                if target not in expected:
                    raise ValueError(f"unexpected tensor {name!r} in {path.name}")
                _copy(params[target.name], target, f.get_tensor(name), name)
                loaded.add(target)
    missing = sorted(target.name for target in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors for {missing}")
    return model.eval().requires_grad_(False)


def checkpoint_kv_scale_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's KV-cache scale tensors (kv_scales.CHECKPOINT_SCALE_NAME) by name; {} if it has none."""
    tensors = {}
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys() if CHECKPOINT_SCALE_NAME.match(name)})
    return tensors


def checkpoint_kv_scales(model_dir: str | Path, num_layers: int) -> list[KVScales] | None:
    """The checkpoint's own fp8-cache scales per layer; None if it has none (ValueError if they are broken)."""
    return checkpoint_scales(checkpoint_kv_scale_tensors(model_dir), num_layers)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module for the config's architecture (Gemma's names its tensors as Llama's do, plus four norms)."""
    return GemmaForCausalLM if config.is_gemma else LlamaForCausalLM


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {model_dir}")
    return files


def _tensor_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, tie: bool) -> LlamaForCausalLM:
    """Allocates uninitialised weights directly in `dtype` on `device` (no random init, no extra copy)."""
    with torch.device("meta"):
        model = model_class(config)(config)
    model.to(dtype).to_empty(device=device)
    if tie:
        model.tie_embeddings()  # to_empty gives each use of a shared parameter its own tensor
    return model


def _target(name: str, config: ModelConfig, tie: bool) -> Target | None:
    """The parameter rows a checkpoint tensor fills; None for tensors deliberately skipped."""
    if _IGNORED.match(name) or (tie and name == "lm_head.weight") or CHECKPOINT_SCALE_NAME.match(name):
        return None  # KV-cache scales are read apart (checkpoint_kv_scale_tensors), and only for an fp8 cache
    expert = _EXPERT_NAME.match(name)
    if expert is not None:
        prefix, index, kind = expert.groups()
        return _expert_target(config, prefix, int(index), kind)
    match = _LAYER_NAME.match(name)
    if match is None:
        return Target(name, 0, -1)  # whole parameter, same name as in HF
    prefix, sub, kind = match.groups()
    fused, shard = _FUSED[sub]
    row_start, num_rows = _shard_rows(config, shard)
    return Target(f"{prefix}{fused}.{kind}", row_start, num_rows)


def _shard_rows(config: ModelConfig, shard: str) -> tuple[int, int]:
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    rows = {
        "q": (0, q_size),
        "k": (q_size, kv_size),
        "v": (q_size + kv_size, kv_size),
        "gate": (0, inter),
        "up": (inter, inter),
    }
    return rows[shard]


def _expert_target(config: ModelConfig, prefix: str, expert: int, kind: str) -> Target:
    """Rows of the stacked expert tensors seen as 2-D ([E * 2I, H] and [E * H, I])."""
    inter = config.moe.intermediate_size if config.moe is not None else 0
    if kind == "down_proj":
        return Target(f"{prefix}down_proj", expert * config.hidden_size, config.hidden_size)
    return Target(f"{prefix}gate_up_proj", expert * 2 * inter + (inter if kind == "up_proj" else 0), inter)


def _expected_targets(model: LlamaForCausalLM, config: ModelConfig, tie: bool) -> set[Target]:
    expected: set[Target] = set()
    prefused = config.architecture in PREFUSED_ARCHITECTURES
    for name, _ in model.named_parameters(remove_duplicate=False):
        if tie and name == "lm_head.weight":
            continue
        if prefused and (".qkv_proj." in name or ".gate_up_proj." in name):
            expected.add(Target(name, 0, -1))
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            prefix = name.rsplit(".", 1)[0] + "."
            kinds = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            num_experts = config.moe.num_experts if config.moe is not None else 0
            expected.update(_expert_target(config, prefix, e, kind) for e in range(num_experts) for kind in kinds)
        elif ".qkv_proj." in name:
            expected.update(Target(name, *_shard_rows(config, shard)) for shard in "qkv")
        elif ".gate_up_proj." in name:
            expected.update(Target(name, *_shard_rows(config, shard)) for shard in ("gate", "up"))
        else:
            expected.add(Target(name, 0, -1))
    return expected


def _copy(param: torch.Tensor, target: Target, tensor: torch.Tensor, name: str) -> None:
    matrix = param.flatten(0, -2) if param.dim() > 2 else param  # stacked experts: rows of all experts
    rows = param if target.num_rows < 0 else matrix.narrow(0, target.row_start, target.num_rows)
    if rows.shape != tensor.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
    with torch.no_grad():
        rows.copy_(tensor)


def check_checkpoint(model_dir: str | Path) -> ModelConfig:
    """What load_model would reject, found from config.json and the tensor names alone (no weight is read).

    Raises ValueError with one line: the directory, the checkpoint's architecture and what is unsupported
    or missing. Services call it at start-up so that a bad checkpoint never ends in a traceback later."""
    model_dir = Path(model_dir)
    try:
        config = ModelConfig.from_pretrained(model_dir)
        names = _tensor_names(_safetensors_files(model_dir))
    except ValueError as error:
        raise ValueError(f"{model_dir}: {_declared_architecture(model_dir)}: {error}") from None
    tie = config.tie_word_embeddings or "lm_head.weight" not in names
    with torch.device("meta"):
        expected = _expected_targets(model_class(config)(config), config, tie)
    targets = {name: _target(name, config, tie) for name in names}
    unexpected = sorted(name for name, target in targets.items() if target is not None and target not in expected)
    missing = sorted({target.name for target in expected - set(targets.values())})
    problems = [f"lacks tensors for {_few(missing)}"] if missing else []
    problems += [f"has tensors it cannot place: {_few(unexpected)}"] if unexpected else []
    if any(CHECKPOINT_SCALE_NAME.match(name) for name in names):
        try:
            checkpoint_kv_scales(model_dir, config.num_layers)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError(f"{model_dir}: {config.architecture}: checkpoint {'; '.join(problems)}")
    return config


def _declared_architecture(model_dir: Path) -> str:
    try:
        return "/".join(json.loads((model_dir / "config.json").read_text()).get("architectures") or ["?"])
    except (OSError, ValueError):
        return "?"


def _few(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
