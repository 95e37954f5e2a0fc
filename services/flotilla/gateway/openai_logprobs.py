"""Token logprobs in OpenAI's two shapes, from the router's TokenLogprob messages."""

from __future__ import annotations

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.gateway.model_registry import TokenizerLike


def chat_logprobs(tokenizer: TokenizerLike, chunks: list[common.TokenChunk], text_offset: int = 0) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}"""
    del text_offset  # chat logprobs carry no offsets
    content = []
    for lp in _logprobs(chunks):
        top = [_chat_entry(tokenizer, t, p) for t, p in zip(lp.top_token_ids, lp.top_logprobs)]
        content.append({**_chat_entry(tokenizer, lp.token_id, lp.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: TokenizerLike, chunks: list[common.TokenChunk], text_offset: int = 0) -> dict:
    """{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}"""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for lp in _logprobs(chunks):
        token = tokenizer.decode([lp.token_id])
        tokens.append(token)
        token_logprobs.append(lp.logprob)
        top_logprobs.append({tokenizer.decode([t]): p for t, p in zip(lp.top_token_ids, lp.top_logprobs)})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _logprobs(chunks: list[common.TokenChunk]) -> list[common.TokenLogprob]:
    return [lp for chunk in chunks for lp in chunk.logprobs]


def _chat_entry(tokenizer: TokenizerLike, token_id: int, logprob: float) -> dict:
    token = tokenizer.decode([token_id])
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
