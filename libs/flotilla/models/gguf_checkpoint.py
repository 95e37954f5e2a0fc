"""GGUF files (llama.cpp's format) converted once into a Hugging Face checkpoint directory that the engine serves.

`convert_gguf(path, out_dir)` dequantizes every tensor to float32 (exactly the values the file's blocks encode),
undoes llama.cpp's reordering of the q/k rows (it interleaves the two RoPE halves of each head) and writes
config.json, generation_config.json, model.safetensors, tokenizer.json and tokenizer_config.json (with the
file's chat template), then conversion.json last: a directory with it is complete. Anything the engine could
not serve faithfully (a tensor type, an architecture, a RoPE variant, a tokenizer) raises GGUFError naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flotilla.models.atomic_files import write_json, write_text
from flotilla.models.gguf_tokenizer import GGUFError, build_tokenizer

CONVERTER_VERSION = 1  # bump when the files written for the same GGUF change
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Tensor types read, by name: float types and the block quantizations gguf's dequantizers implement.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QKV_BIASES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
CONVERSION_FILE = "conversion.json"


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 record: Mapping[str, Any] | None = None) -> Path:
    """Write the Hugging Face checkpoint of `gguf_path` into `out_dir` (created if missing) and return it.

    conversion.json gets `record` (default: source_record(gguf_path)), what is_converted compares later.
    """
    gguf_path, out = Path(gguf_path), Path(out_dir)
    try:
        reader = open_reader(gguf_path)
    except (ValueError, OSError) as error:
        raise GGUFError(f"{gguf_path} is not a readable GGUF file: {error}") from None
    metadata = read_metadata(reader)
    architecture = _architecture(metadata)
    config = model_config(metadata, architecture, {tensor.name for tensor in reader.tensors})
    tokenizer = build_tokenizer(metadata)  # before the slow part: an unsupported tokenizer fails at once
    weights = read_weights(reader, config, architecture)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONVERSION_FILE).unlink(missing_ok=True)
    write_text(out / "tokenizer.json", tokenizer.to_str())
    write_json(out / "tokenizer_config.json", tokenizer_config(metadata, config))
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(metadata))
    _write_weights(out / "model.safetensors", weights)
    write_json(out / CONVERSION_FILE, dict(record) if record is not None else source_record(gguf_path))
    return out


def source_record(gguf_path: str | os.PathLike[str]) -> dict[str, Any]:
    """What conversion.json says about a local GGUF file (path, size, modification time; no hashing of a
    multi-GB file at every start): a converted directory is current while this matches."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    return {"source": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "converter_version": CONVERTER_VERSION}


def ensure_converted(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                     announce: Callable[[str], None] | None = None) -> Path:
    """out_dir, converted from gguf_path unless it holds this file's conversion already (`announce` is told
    before a conversion starts)."""
    if is_converted(Path(out_dir), source_record(gguf_path)):
        return Path(out_dir)
    if announce is not None:
        announce(f"converting {gguf_path} into {out_dir} (once per file) ...")
    return convert_gguf(gguf_path, out_dir)


def is_converted(out_dir: Path, record: Mapping[str, Any]) -> bool:
    """Whether out_dir holds a complete conversion of the source `record` describes (source_record's answer)."""
    try:
        return json.loads((Path(out_dir) / CONVERSION_FILE).read_text()) == dict(record)
    except (OSError, ValueError):
        return False


def open_reader(gguf_path: Path) -> Any:
    """gguf's GGUFReader over a plain ndarray view of its memory map: parsing a vocabulary slices the file
    some million times, and each slice of an np.memmap costs a subclass finalizer (2.5 s instead of 7 s for
    SmolLM2's 49k tokens and merges)."""
    from gguf import GGUFReader

    class PlainArrayReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = np.asarray(value)  # a view of the same mapping, no copy

    return PlainArrayReader(gguf_path)


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field of the file, as Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _architecture(metadata: Mapping[str, Any]) -> str:
    architecture = metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return architecture


def model_config(metadata: Mapping[str, Any], architecture: str, tensor_names: set[str]) -> dict[str, Any]:
    """config.json for the file: LlamaForCausalLM / Qwen2ForCausalLM with the file's shape and numerics."""
    def key(name: str, default: Any = None, required: bool = False) -> Any:
        if required and f"{architecture}.{name}" not in metadata:
            raise GGUFError(f"GGUF file lacks the metadata key {architecture}.{name}")
        return metadata.get(f"{architecture}.{name}", default)

    _check_supported(metadata, architecture, tensor_names)
    hidden, num_heads = int(key("embedding_length", required=True)), int(key("attention.head_count", required=True))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"partial rotary embeddings (rope.dimension_count {key('rope.dimension_count')} of head "
                        f"size {head_dim}) are not supported")
    config = {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture,
        "vocab_size": int(key("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", required=True)),
        "rms_norm_eps": _float32(key("attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": _float32(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(key("rope.scaling.type"), key("rope.scaling.factor")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if architecture == "llama":
        config.update({"attention_bias": False, "mlp_bias": False})
    else:
        layers = config["num_hidden_layers"]
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers})
    return config


def _check_supported(metadata: Mapping[str, Any], architecture: str, tensor_names: set[str]) -> None:
    if int(metadata.get(f"{architecture}.expert_count", 0) or 0) > 0:
        raise GGUFError("mixture-of-experts GGUF files are not supported")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError("GGUF tensor 'rope_freqs.weight' (per-frequency RoPE factors, as in Llama 3.1 and later) "
                        "is not supported")


def _rope_scaling(scaling_type: str | None, factor: float | None) -> dict[str, Any] | None:
    if scaling_type in (None, "", "none"):
        return None
    if scaling_type == "linear" and factor:
        return {"rope_type": "linear", "factor": _float32(factor)}
    raise GGUFError(f"GGUF RoPE scaling {scaling_type!r} is not supported; supported: none, linear")


def _float32(value: float) -> float:
    """The shortest decimal that is the same float32 (the file stores 1e-5 as 9.99999974738e-06)."""
    return float(str(np.float32(value)))


def generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """EOS first, then the end-of-turn tokens the file names, so that generation stops at any of them."""
    eos = [metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(token_id) for token_id in eos if token_id is not None))
    generation: dict[str, Any] = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        generation["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    return generation


def tokenizer_config(metadata: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(name: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[int(token_id)] if token_id is not None else None

    tokenizer = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if metadata.get("tokenizer.chat_template"):
        tokenizer["chat_template"] = metadata["tokenizer.chat_template"]
    return tokenizer


def read_weights(reader: Any, config: Mapping[str, Any], architecture: str) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its Hugging Face name, q/k rows back in Hugging Face order."""
    names = _hf_names(config, architecture)
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if tensor.name not in names:
            raise GGUFError(f"GGUF tensor {tensor.name!r} has no place in a {architecture} checkpoint")
        hf_name = names[tensor.name]
        values = dequantize(tensor)
        if architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
            values = unpermute_rope_rows(values, heads)
        weights[hf_name] = np.ascontiguousarray(values, dtype=np.float32)
    expected = set(names.values()) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    missing = sorted(expected - set(weights))
    if missing:
        raise GGUFError(f"GGUF file lacks tensors for {missing}")
    return weights


def _hf_names(config: Mapping[str, Any], architecture: str) -> dict[str, str]:
    names = dict(_GLOBAL_TENSORS)
    per_layer = {**_LAYER_TENSORS, **(_QKV_BIASES if architecture == "qwen2" else {})}
    for layer in range(config["num_hidden_layers"]):
        names.update({f"blk.{layer}.{gguf}": f"model.layers.{layer}.{hf}" for gguf, hf in per_layer.items()})
    return names


def dequantize(tensor: Any) -> np.ndarray:
    """A reader tensor's values as float32, in Hugging Face's dimension order (GGUF lists the fastest first)."""
    from gguf import dequantize as gguf_dequantize

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(f"GGUF tensor {tensor.name!r} has type {type_name}, which is not supported; "
                        f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")
    values = gguf_dequantize(tensor.data, tensor.tensor_type)
    return values.reshape(tuple(int(dim) for dim in reversed(tensor.shape))).astype(np.float32, copy=False)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf permute: per head it stores the rows of the two RoPE halves
    interleaved (0, d/2, 1, d/2+1, ...); Hugging Face keeps them as two halves."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_weights(path: Path, weights: Mapping[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save_file(dict(weights), str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
