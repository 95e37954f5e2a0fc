"""Token logprobs in OpenAI's two shapes, from the router stream's chunks (each token's logprob in order)."""

from __future__ import annotations

from collections.abc import Iterator

from flotilla.engine.scheduler_output import TokenLogprobs
from flotilla.gateway.model_registry import TokenizerLike
from flotilla.rpc.stream_events import Chunk


def chat_logprobs(tokenizer: TokenizerLike, chunks: list[Chunk], text_offset: int = 0) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}"""
    del text_offset  # chat logprobs carry no offsets
    content = []
    for token_id, lp in _logprobs(chunks):
        top = [_chat_entry(tokenizer, t, p) for t, p in lp.top]
        content.append({**_chat_entry(tokenizer, token_id, lp.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: TokenizerLike, chunks: list[Chunk], text_offset: int = 0) -> dict:
    """{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}"""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, lp in _logprobs(chunks):
        token = tokenizer.decode([token_id])
        tokens.append(token)
        token_logprobs.append(lp.logprob)
        top_logprobs.append({tokenizer.decode([t]): p for t, p in lp.top})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _logprobs(chunks: list[Chunk]) -> Iterator[tuple[int, TokenLogprobs]]:
    """(token id, its logprobs) of every token that has them."""
    for chunk in chunks:
        yield from zip(chunk.token_ids, chunk.logprobs)


def _chat_entry(tokenizer: TokenizerLike, token_id: int, logprob: float) -> dict:
    token = tokenizer.decode([token_id])
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
