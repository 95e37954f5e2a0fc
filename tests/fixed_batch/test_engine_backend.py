"""The engine run_batch behind the real router and gateway: a fixed-batch worker process running the tiny
checkpoint answers concurrent POST /v1/batch-generate calls, each with the engine's own greedy answer."""

from __future__ import annotations

from collections import Counter

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams
from flotilla.worker.fixed_batch.contract import ENGINE

from tests.fixed_batch.fleet import start_batch_fleet
from tests.fixed_batch.test_fixed_batch_fleet import post_all


async def test_the_engine_backend_serves_batches_through_the_fleet(tmp_path, tiny_checkpoint):
    args = ("--run-batch", ENGINE, "--model-dir", str(tiny_checkpoint), "--device", "cpu", "--max-tokens", "5",
            "--max-batch-size", "8", "--batch-latency-ms", "100")
    inputs = [f"prompt number {i}" for i in range(12)]
    with start_batch_fleet(tmp_path, num_workers=1, worker_args=args, model="tiny-batch") as fleet:
        responses = await post_all(fleet.url, [{"model": "tiny-batch", "input": t} for t in inputs],
                                   [fleet.headers("paid")] * len(inputs))
    assert Counter(r.status_code for r in responses) == {200: len(inputs)}
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_checkpoint), device="cpu"))
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    assert [r.json()["output"] for r in responses] == [engine.generate([t], greedy)[0].text for t in inputs]
    assert max(r.json()["batch"]["size"] for r in responses) > 1  # they really shared batches
