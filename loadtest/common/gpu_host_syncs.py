"""The device check's host-synchronisation part: engine steps run under torch.cuda.set_sync_debug_mode("error").

The issue asks for no host synchronisation inside a step: sampling on the device, token ids copied back
asynchronously, the next step's metadata built while the current one runs. With overlap scheduling (the CUDA
default) engine.step() launches a step and then waits for the one before through a CUDA event (not a
synchronising call in torch's sense), so a whole step() should run in "error" mode. Anything that does block (an
.item(), a .tolist() of a device tensor, a copy to pageable host memory, a nonzero) raises there; the check
reports where, innermost project frames first. Both ways a decode step can run are checked: replayed from a CUDA
graph (the default) and eagerly (`cuda_graphs` off: the Triton kernel's own launch), each for
- decode steps of a batch of greedy, seeded (temperature 0.8, top-p 0.9) and logprobs requests, after every
  request has its first token;
- then steps where new prompts (one of them in JSON mode) are prefilled beside those decodes.
Reported, never asserted. --dry-run: the same steps on a CPU without the debug mode (which needs CUDA).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from loadtest.common.gpu_runs import Plan, free, random_prompts, start_engine, sync
from loadtest.common.gpu_throughput import JSON_OBJECT

DECODE_STEPS = 12
STEPS_WITH_PREFILLS = 6
_KINDS = (SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=64, temperature=0.0, logprobs=2, ignore_eos=True))


def host_sync_check(model_dir: Path, device: torch.device, plan: Plan, seed: int) -> dict:
    result: dict = {"checked": device.type == "cuda"}
    for way, graphs in (("graphs", True), ("eager", False)):
        engine = start_engine(model_dir, device, plan, cuda_graphs=graphs)
        engine.overlap_output_processing = True  # the CUDA default, set so that a dry run takes this path too
        result[f"{way}_overlap"] = engine.overlap_output_processing
        result[way] = _steps_without_syncs(engine, device, seed)
        del engine
        free()
    return result


def _steps_without_syncs(engine: LLMEngine, device: torch.device, seed: int) -> dict:
    prompts = random_prompts(9, 48, seed + 31)
    for i, prompt in enumerate(prompts):
        engine.add_request(NewRequest(f"sync-{i}-{time.monotonic_ns()}", tuple(prompt), _KINDS[i % len(_KINDS)]))
    started: set[str] = set()
    while len(started) < len(prompts):  # prefills, unchecked (and the kernels compiled)
        started.update(output.request_id for output in engine.step())
    sync(device)
    report = {"decode_steps": _checked(engine, device, DECODE_STEPS)}
    for i, prompt in enumerate(random_prompts(3, 40, seed + 32)):
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                structured_output=JSON_OBJECT if i == 0 else None)
        engine.add_request(NewRequest(f"sync-new-{i}-{time.monotonic_ns()}", tuple(prompt), params))
    report["steps_with_prefills"] = _checked(engine, device, STEPS_WITH_PREFILLS)
    return report


def _checked(engine: LLMEngine, device: torch.device, steps: int) -> dict:
    """Runs `steps` engine steps under the "error" debug mode (on CUDA): how many ran, and the first sync's place."""
    done = 0
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            engine.step()
            done += 1
    except RuntimeError as error:
        if "synchronizing" not in str(error):
            raise
        return {"steps": done, "host_sync": f"{str(error)[:200]} at {_where(error)}"}
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    return {"steps": done, "host_sync": "none"}


def _where(error: BaseException) -> list[str]:
    """The innermost frames in the project (flotilla/), or the last three frames if none is."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in frames if "flotilla" in frame.filename]
    return [f"{Path(frame.filename).name}:{frame.lineno} {frame.name}" for frame in (ours or frames)[-3:][::-1]]
