"""The tokenizer files of the models registered workers serve, one copy per digest, for gateways to fetch.

A set is accepted only for a digest some registered worker announced, only when its content hashes to that
digest, and only with the file names a tokenizer reads: the router holds nothing nobody serves, and what a
gateway receives is exactly what the worker read from its checkpoint. Sets nobody references any more are
dropped (WorkerRegistry calls retain() when workers leave or change models).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from flotilla.engine.tokenizer_files import check_file_names, files_digest

logger = logging.getLogger(__name__)


class RejectedAssetsError(ValueError):
    pass


class ModelAssetStore:
    def __init__(self) -> None:
        self._files: dict[str, dict[str, bytes]] = {}

    def has(self, digest: str) -> bool:
        return digest in self._files

    def get(self, digest: str) -> Mapping[str, bytes] | None:
        return self._files.get(digest)

    def put(self, digest: str, files: Mapping[str, bytes], announced: Collection[str]) -> bool:
        """Store a set; False when it was already held. RejectedAssetsError says why a set is refused."""
        if digest not in announced:
            raise RejectedAssetsError(f"no registered worker serves assets {digest}")
        try:
            check_file_names(files)
        except ValueError as err:
            raise RejectedAssetsError(str(err)) from err
        actual = files_digest(files)
        if actual != digest:
            raise RejectedAssetsError(f"assets hash to {actual}, not {digest}")
        if digest in self._files:
            return False
        self._files[digest] = dict(files)
        logger.info("stored model assets %s (%d files, %d bytes)", digest, len(files),
                    sum(len(content) for content in files.values()))
        return True

    def retain(self, referenced: Collection[str]) -> None:
        for digest in [d for d in self._files if d not in referenced]:
            del self._files[digest]
            logger.info("dropped model assets %s: no registered worker serves them", digest)
