"""Tokenizer files as a chunk stream and back, and the streams a receiver refuses."""

from __future__ import annotations

import pytest

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.rpc.model_assets import MalformedAssetsError, asset_chunks, receive_assets


async def _stream(chunks):
    for chunk in chunks:
        yield chunk


async def test_files_survive_chunking_whatever_their_size():
    files = {"tokenizer.json": bytes(range(256)) * 41, "empty.json": b"", "config.json": b"{}"}
    chunks = list(asset_chunks("d1", files, chunk_bytes=1000))
    assert max(len(c.data) for c in chunks) == 1000 and len(chunks) == 11 + 1 + 1
    assert await receive_assets(_stream(chunks), max_total_bytes=1 << 20) == ("d1", files)


def _chunk(digest="d1", name="a", data=b"x"):
    return rpb.ModelAssetsChunk(digest=digest, file_name=name, data=data)


@pytest.mark.parametrize("chunks, why", [
    ([], "no chunks"),
    ([_chunk(), _chunk(digest="d2")], "same, non-empty digest"),
    ([_chunk(digest="")], "same, non-empty digest"),
    ([_chunk(name="")], "no file name"),
    ([_chunk(name="a"), _chunk(name="b"), _chunk(name="a")], "not consecutive"),
    ([_chunk(data=b"x" * 600), _chunk(data=b"x" * 600)], "exceed 1000 bytes"),
])
async def test_malformed_streams_are_refused(chunks, why):
    with pytest.raises(MalformedAssetsError, match=why):
        await receive_assets(_stream(chunks), max_total_bytes=1000)
