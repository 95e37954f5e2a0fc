"""Time until the decode side holds every layer of a long prompt's KV (and the first token exists): writes
layer by layer during the forward pass vs one write per layer after it, and prefill alone as the floor."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import NamedTuple

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.model.kv_cache import kv_pool_tensor
from flotilla.engine.new_request import NewRequest
from flotilla.engine.remote_prefill import KVSender, RemoteTarget
from flotilla.engine.sampling_params import SamplingParams
from flotilla.kv_transfer.nixl_transport import NixlTransport
from loadtest.kv_transfer.sink import Sink


class TTFT(NamedTuple):
    prefill_only_s: float
    layerwise_s: float
    after_prefill_s: float
    num_bytes: int
    # Transfer time left after the last layer was computed (until the receiver saw every write): what the
    # hand-off adds to TTFT, free of the run-to-run noise of the prefill itself.
    layerwise_exposed_s: float = 0.0
    after_prefill_exposed_s: float = 0.0

    @property
    def hidden_fraction(self) -> float:
        """Share of the one-write-after-prefill transfer time that layer-by-layer writes hide."""
        if self.after_prefill_exposed_s <= 0:
            return float("nan")
        return 1.0 - self.layerwise_exposed_s / self.after_prefill_exposed_s


class _TimedSender(KVSender):
    """Notes when the last layer of a forward pass finished computing."""

    last_layer_done_s = 0.0

    def on_layer(self, layer_index: int) -> None:
        if layer_index == self._num_layers - 1:
            self.last_layer_done_s = time.monotonic()
        super().on_layer(layer_index)


def measure(model_dir: Path, prompt_len: int, chunk: int, reps: int) -> TTFT:
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=prompt_len // 16 + 8,
                                    max_num_batched_tokens=chunk, enable_prefix_caching=False))  # fmt: skip
    pool = kv_pool_tensor(engine.runner.kv_caches)
    sink = Sink(tuple(pool.shape))
    transport = NixlTransport(pool, "bench-prefill")
    transport.connect(sink.info)
    rng = random.Random(0)
    runs: dict[str, list[float]] = {"none": [], "layerwise": [], "after": []}
    exposed: dict[str, list[float]] = {"none": [], "layerwise": [], "after": []}
    num_bytes = 0
    try:
        for rep in range(reps + 1):  # the first round warms up
            for mode in runs:
                prompt = [rng.randrange(3, engine.model_config.vocab_size) for _ in range(prompt_len)]
                seconds, num_bytes, exposed_s = _one(engine, transport, sink, mode, prompt, f"{mode}{rep}")
                if rep:
                    runs[mode].append(seconds)
                    exposed[mode].append(exposed_s)
    finally:
        transport.close()
        sink.close()
    median = {mode: statistics.median(times) for mode, times in runs.items()}
    return TTFT(median["none"], median["layerwise"], median["after"], num_bytes,
                statistics.median(exposed["layerwise"]), statistics.median(exposed["after"]))


def _one(engine: LLMEngine, transport, sink: Sink, mode: str, prompt: list[int], transfer_id: str):
    sender = None
    if mode != "none":
        sender = _TimedSender(transport, engine.block_size, layerwise=mode == "layerwise")
        num_blocks = -(-len(prompt) // engine.block_size)
        sender.add_target(transfer_id, RemoteTarget(transfer_id, sink.info.agent_name, list(range(num_blocks)), 0))
    engine.runner.kv_hook = sender
    started = time.monotonic()
    engine.add_request(NewRequest(transfer_id, tuple(prompt), SamplingParams(max_tokens=1, temperature=0.0)))
    while engine.has_unfinished_requests():
        engine.step()
    done = time.monotonic()
    engine.runner.kv_hook = None
    if sender is None:
        return done - started, 0, 0.0
    target = sender.pop_target(transfer_id)
    if target.error:
        raise RuntimeError(target.error)
    arrived = sink.wait_notifs(transfer_id + ":", target.num_writes)
    return max(done, arrived) - started, target.num_bytes, arrived - sender.last_layer_done_s
