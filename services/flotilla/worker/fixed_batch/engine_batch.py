"""run_batch over the engine's model: every input of a call runs as one batch in the engine, greedy, with
max_tokens from the flags. Not a fixed latency (it depends on the batch and the outputs), but the same
contract as the simulated accelerator: one call at a time, one output per input, in order."""

from __future__ import annotations

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams
from flotilla.worker.fixed_batch.contract import BatchOptions, ContractError


class EngineBatch:
    def __init__(self, engine: LLMEngine, max_batch_size: int, max_tokens: int):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    @classmethod
    def from_options(cls, options: BatchOptions) -> EngineBatch:
        if not options.model_dir:
            raise ValueError("the engine run_batch needs --model-dir")
        config = EngineConfig(model_dir=options.model_dir, device=options.device,
                              max_num_seqs=max(options.max_batch_size, 1))
        return cls(LLMEngine(config), options.max_batch_size, options.max_tokens)

    @property
    def model_version(self) -> str:
        return self.engine.model_version

    def __call__(self, inputs: list[str]) -> list[str]:
        if not 1 <= len(inputs) <= self.max_batch_size:
            raise ContractError(f"a batch takes 1 to {self.max_batch_size} inputs, got {len(inputs)}")
        return [result.text for result in self.engine.generate(inputs, self.sampling)]
