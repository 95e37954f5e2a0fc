"""Small GGUF files for the converter's tests, written with the gguf package's GGUFWriter the way llama.cpp's
convert_hf_to_gguf writes them: a random Hugging Face checkpoint's tensors under GGUF names, q/k rows permuted
for llama, each tensor quantized to the type asked for, the tokenizer as `tokenizer.ggml.*` metadata."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
# (data, type) of a 2-D weight for the type asked for: by default gguf's quantizer; a test may substitute
# random block bytes (types gguf cannot quantize) or another type (rows that a type's blocks do not divide).
Encoder = Callable[[np.ndarray, GGMLQuantizationType], tuple[np.ndarray, GGMLQuantizationType]]


def quantized(weight: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    return quantize(weight, qtype), qtype


# Byte offsets of the float16 scales in one block (ggml-common.h); the other bytes are quants and packed scales.
_F16_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                      "IQ4_NL": (0,), "Q8_1": (0, 2)}


def random_blocks(seed: int = 0) -> Encoder:
    """An encoder writing random blocks of the type (random quants, small finite float16 scales); rows its
    blocks do not divide stay F32."""
    rng = np.random.default_rng(seed)

    def encode(weight: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if weight.shape[1] % block_size:
            return weight, GGMLQuantizationType.F32
        num_blocks = weight.shape[0] * weight.shape[1] // block_size
        blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
        for offset in _F16_SCALE_OFFSETS[qtype.name]:
            scales = rng.uniform(-0.05, 0.05, size=num_blocks).astype(np.float16)
            blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
        return blocks.reshape(weight.shape[0], -1), qtype

    return encode


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute: per head, the rows of the two RoPE halves interleaved."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    path: Path,
    checkpoint: Path,
    tensor_type: str = "F32",
    pre_tokenizer: str = "qwen2",
    tokenizer_model: str = "gpt2",
    metadata: Mapping[str, Any] | None = None,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    encode: Encoder | None = None,
    architecture: str | None = None,
) -> Path:
    """GGUF file of a write_checkpoint directory; 2-D weights in `tensor_type`, norms and biases in F32."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = architecture or config["model_type"]
    writer = GGUFWriter(path, arch)
    _write_metadata(writer, config, checkpoint, tokenizer_model, pre_tokenizer)
    for key, value in (metadata or {}).items():
        _add_field(writer, key, value)
    qtype = GGMLQuantizationType[tensor_type]
    for name, weight in load_file(str(checkpoint / "model.safetensors")).items():
        weight = weight.astype(np.float32)
        if config["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            weight = permute_rope_rows(weight, heads)
        _add_tensor(writer, gguf_name(name), weight, qtype if weight.ndim == 2 else GGMLQuantizationType.F32, encode)
    for name, tensor in (extra_tensors or {}).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer: GGUFWriter, name: str, weight: np.ndarray, qtype: GGMLQuantizationType,
                encode: Encoder | None) -> None:
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, weight)
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        data, used = (encode or quantized)(weight, qtype)
        writer.add_tensor(name, data, raw_dtype=used if used != GGMLQuantizationType.F32 else None)


def _write_metadata(writer: GGUFWriter, config: dict[str, Any], checkpoint: Path, tokenizer_model: str,
                    pre_tokenizer: str) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {added["content"] for added in tokenizer["added_tokens"] if added["special"]}
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if token in special else TokenType.NORMAL for token in tokens])
    writer.add_token_merges([merge if isinstance(merge, str) else " ".join(merge)
                             for merge in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(vocab[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])


def _add_field(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, int(value))
