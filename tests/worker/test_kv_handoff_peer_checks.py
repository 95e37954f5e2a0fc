"""Before a prefill worker writes into a decode worker's pool it checks what that worker says of itself
(GetTransferInfo): the same agent, the same model version and the same KV cache format (dtype and an fp8
cache's scales). A mismatch connects nothing; the prefill side then answers UNAVAILABLE (prefill_side.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.worker.kv_handoff import KVHandoff

OURS = SimpleNamespace(model_version="v1", kv_cache_format="float8_e4m3fn scales 0.25/0.0625")


class _Transport:
    def __init__(self):
        self.connected = []

    def is_connected(self, agent_name):
        return agent_name in self.connected

    def connect(self, peer):
        self.connected.append(peer.agent_name)


def _handoff(info: kpb.TransferInfo):
    async def get_transfer_info(request, timeout):
        return info

    return SimpleNamespace(transport=_Transport(), _peer_locks={}, engine=SimpleNamespace(engine=OURS),
                           peer_stub=lambda address: SimpleNamespace(GetTransferInfo=get_transfer_info))


def _info(**overrides) -> kpb.TransferInfo:
    fields = {"agent_name": "decode-a", "model_version": "v1", "kv_cache_format": OURS.kv_cache_format}
    fields.update(overrides)
    return kpb.TransferInfo(layout=kpb.KVPoolLayout(num_layers=2, num_blocks=8, block_bytes=64), **fields)


def _ensure_peer(handoff):
    return asyncio.run(KVHandoff.ensure_peer(handoff, "decode-a", "127.0.0.1:1", "t-1", 5))


def test_a_peer_of_the_same_model_and_format_is_connected():
    handoff = _handoff(_info())
    _ensure_peer(handoff)
    assert handoff.transport.connected == ["decode-a"]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"agent_name": "decode-b"}, "restarted"),
    ({"model_version": "v2"}, "model version v2"),
    ({"kv_cache_format": "float8_e4m3fn scales 0.5/0.0625"}, "caches KV as 'float8_e4m3fn scales 0.5/0.0625'"),
    ({"kv_cache_format": "float8_e4m3fn"}, "caches KV as 'float8_e4m3fn'"),
    ({"kv_cache_format": ""}, "caches KV as ''"),  # a worker from before the field: its format is unknown
])
def test_a_peer_that_differs_is_refused_before_anything_connects(overrides, message):
    handoff = _handoff(_info(**overrides))
    with pytest.raises(ValueError, match=message):
        _ensure_peer(handoff)
    assert handoff.transport.connected == []
