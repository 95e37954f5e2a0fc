"""A model's tokenizer files (name -> bytes) as a stream of ModelAssetsChunk messages and back.

Chunks stay well under gRPC's message limit whatever the tokenizer's size; checking the digest and the file
names is the receiver's job (flotilla.engine.tokenizer_files), since only it knows what it will trust.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterator, Mapping

from flotilla.api.router.v1 import router_pb2 as rpb

CHUNK_BYTES = 1024 * 1024


class MalformedAssetsError(ValueError):
    pass


def asset_chunks(digest: str, files: Mapping[str, bytes], chunk_bytes: int = CHUNK_BYTES) -> Iterator[rpb.ModelAssetsChunk]:
    for name in sorted(files):
        content = files[name]
        for start in range(0, max(len(content), 1), chunk_bytes):
            yield rpb.ModelAssetsChunk(digest=digest, file_name=name, data=content[start:start + chunk_bytes])


async def receive_assets(chunks: AsyncIterable[rpb.ModelAssetsChunk], max_total_bytes: int) -> tuple[str, dict[str, bytes]]:
    """(digest, files) from a stream of chunks; MalformedAssetsError when the stream breaks the rules above
    or grows past max_total_bytes (checked as it arrives, so a hostile sender cannot exhaust memory)."""
    digest: str | None = None
    parts: dict[str, list[bytes]] = {}
    current: str | None = None
    total = 0
    async for chunk in chunks:
        if digest is None:
            digest = chunk.digest
        if not chunk.digest or chunk.digest != digest:
            raise MalformedAssetsError("every chunk must carry the same, non-empty digest")
        if not chunk.file_name:
            raise MalformedAssetsError("a chunk has no file name")
        if chunk.file_name != current:
            if chunk.file_name in parts:
                raise MalformedAssetsError(f"the pieces of {chunk.file_name!r} are not consecutive")
            current = chunk.file_name
            parts[current] = []
        total += len(chunk.data)
        if total > max_total_bytes:
            raise MalformedAssetsError(f"model assets exceed {max_total_bytes} bytes")
        parts[current].append(chunk.data)
    if digest is None:
        raise MalformedAssetsError("no chunks")
    return digest, {name: b"".join(pieces) for name, pieces in parts.items()}
