"""A checkpoint whose greedy answer is known: it writes one Hermes-style tool call, whatever it is asked.

The fleet tests of tool calling need a real model that calls a tool; a random one never does. Here every layer's
output projections (attention o_proj, MLP down_proj) are zero, so each position's hidden state is its token's
embedding and the next token depends on the current one only; the embeddings of a few tokens are one-hot and the
(untied) LM head maps each to its successor: the generation prompt's last token -> `<tool_call>` -> the call's JSON
-> `</tool_call>` -> eos. The tool call's pieces are added tokens (as Qwen's tokenizer has `<tool_call>`), so the
chain has no repeated token (the vocabulary grows to hold them). The template is HERMES_TEMPLATE (tool_templates.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer as BackendTokenizer

from tests.support.tool_templates import with_chat_template

CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWER = f"<tool_call>{CALL_JSON}</tool_call>"
SCALE = 8.0


def write_scripted_checkpoint(base: Path, destination: Path) -> Path:
    with_chat_template(base, destination)
    backend = BackendTokenizer.from_file(str(destination / "tokenizer.json"))
    pieces = ["<tool_call>", CALL_JSON, "</tool_call>"]
    backend.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in pieces])
    backend.save(str(destination / "tokenizer.json"))
    config = json.loads((destination / "config.json").read_text())
    from flotilla.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(destination)
    piece_ids = [tokenizer.token_to_id(piece) for piece in pieces]
    eos = config["eos_token_id"]
    prompt_end = tokenizer.encode_chat([{"role": "user", "content": "hi"}])[-1]
    if prompt_end in piece_ids:
        raise ValueError(f"cannot script this tokenizer: the prompt ends in {prompt_end}")
    config["vocab_size"] = max(config["vocab_size"], tokenizer.vocab_size + 64 - tokenizer.vocab_size % 64)
    _write_weights(destination, config, [prompt_end, *piece_ids, eos])
    config["tie_word_embeddings"] = False
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    return destination


def _write_weights(destination: Path, config: dict, chain: list[int]) -> None:
    path = destination / "model.safetensors"
    weights = load_file(str(path))
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    embed = weights["model.embed_tokens.weight"]
    embed = torch.cat([embed, torch.zeros(config["vocab_size"] - embed.shape[0], embed.shape[1], dtype=embed.dtype)])
    lm_head = torch.zeros_like(embed)
    for slot, (token, successor) in enumerate(zip(chain, chain[1:])):
        embed[token] = 0.0
        embed[token, slot] = SCALE
        lm_head[successor, slot] = 1.0
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = lm_head
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, str(path), metadata={"format": "pt"})
