"""The router's copy of each model's tokenizer files: only what a registered worker announced, only exact
content, dropped when no worker announces it any more."""

from __future__ import annotations

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.engine.tokenizer_files import files_digest
from flotilla.router.model_assets import ModelAssetStore, RejectedAssetsError
from flotilla.router.registry import WorkerRegistry

FILES = {"tokenizer.json": b'{"model": {}}', "config.json": b"{}"}
DIGEST = files_digest(FILES)


def test_a_set_is_stored_once_for_an_announced_digest():
    store = ModelAssetStore()
    assert store.put(DIGEST, FILES, announced={DIGEST}) is True
    assert store.put(DIGEST, FILES, announced={DIGEST}) is False  # a second worker of the same model
    assert store.get(DIGEST) == FILES


@pytest.mark.parametrize("digest, files, announced, why", [
    (DIGEST, FILES, set(), "no registered worker"),
    (DIGEST, {**FILES, "config.json": b"{ }"}, {DIGEST}, "hash to"),
    (DIGEST, {**FILES, "weights.bin": b""}, {DIGEST}, "unexpected tokenizer file"),
])
def test_refused_sets(digest, files, announced, why):
    store = ModelAssetStore()
    with pytest.raises(RejectedAssetsError, match=why):
        store.put(digest, files, announced)
    assert not store.has(digest)


def _worker(worker_id: str, digest: str) -> rpb.WorkerInfo:
    return rpb.WorkerInfo(worker_id=worker_id, address=f"127.0.0.1:{len(worker_id)}",
                          model=pb.ModelInfo(name="m", version="v", assets_digest=digest))


async def test_the_registry_drops_a_set_when_its_last_worker_leaves_or_changes_model():
    # A channel connects lazily: nothing is dialled in this test.
    registry = WorkerRegistry(channel_factory=lambda address: grpc.aio.insecure_channel(address))
    registry.register(_worker("w1", DIGEST))
    registry.register(_worker("w2", DIGEST))
    assert registry.assets.put(DIGEST, FILES, registry.announced_assets())
    registry.deregister("w1")
    assert registry.assets.has(DIGEST)  # w2 still serves it
    registry.register(_worker("w2", "sha256:other"))  # w2 restarted with other tokenizer files
    assert not registry.assets.has(DIGEST)
    await registry.close()
