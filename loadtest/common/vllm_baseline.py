"""vLLM's CPU build as a further baseline, run offline in its own interpreter (its own venv) on the same
requests. Only `generate` is timed, inside that process; the result comes back as one JSON line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

from loadtest.common.engine_workload import Workload
from loadtest.common.throughput import Throughput, wave_seconds_note

# Runs under vLLM's interpreter: argv[1] is a JSON file with model_dir, prompts, max_tokens and wave_size. Without
# on_command it runs every wave and prints one JSON line. With on_command it prints {"ready": ...} once loaded, then
# runs wave i (0-based) for each line "i" read from stdin and prints {"wave": i, ...} after each; EOF ends it.
VLLM_SCRIPT = '''
import json, os, sys, time

import vllm
from vllm import LLM, SamplingParams


def timed_wave(llm, prompts, params):
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, [len(o.outputs[0].token_ids) for o in outputs]


def main():
    spec = json.load(open(sys.argv[1]))
    extra = {"max_num_seqs": spec["max_num_seqs"]} if spec.get("max_num_seqs") else {}
    # On CPU this is the share of RAM vLLM checks is free at start-up (0.92 by default): with other processes
    # on the machine that check fails although the KV cache (VLLM_CPU_KVCACHE_SPACE) fits.
    extra["gpu_memory_utilization"] = float(os.environ.get("FLOTILLA_VLLM_MEMORY_UTILIZATION", "0.5"))
    llm = LLM(model=spec["model_dir"], dtype="float32", seed=0, max_model_len=spec["max_model_len"], **extra)
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0) for n in spec["max_tokens"]]
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    llm.generate(prompts[:1], [SamplingParams(max_tokens=2, temperature=0)], use_tqdm=False)  # warm-up
    wave_size = spec.get("wave_size") or len(prompts)  # waves one after another, each submitted at once

    def wave(index):
        start = index * wave_size
        return timed_wave(llm, prompts[start:start + wave_size], params[start:start + wave_size])

    if spec.get("on_command"):
        print(json.dumps({"ready": True, "vllm_version": vllm.__version__}), flush=True)
        for line in sys.stdin:
            seconds, produced = wave(int(line))
            print(json.dumps({"wave": int(line), "seconds": seconds, "produced": produced}), flush=True)
        return
    wave_seconds, produced = [], []
    for index in range(-(-len(prompts) // wave_size)):
        seconds, wave_produced = wave(index)
        wave_seconds.append(seconds)
        produced += wave_produced
    print(json.dumps({"seconds": sum(wave_seconds), "wave_seconds": wave_seconds, "produced": produced,
                      "vllm_version": vllm.__version__}), flush=True)


# vLLM starts its engine core with multiprocessing "spawn", which re-imports this file: guard the entry.
if __name__ == "__main__":
    die_with_parent()
    main()
'''

# Put at the top of the child's script. The vLLM tree (this process, its engine core and its workers) is started
# in a process group of its own (`start_new_session`), and the whole group dies once the benchmark that started it
# is gone, however it went (killed, crashed, interrupted). Without this, vLLM's engine core and workers outlived a
# stopped benchmark and kept a core part-busy for ten minutes, which spoiled the measurements that followed.
DIE_WITH_PARENT = '''
import os as _os, signal as _signal, threading as _threading, time as _time


def die_with_parent():
    parent = _os.getppid()

    def watch():
        while _os.getppid() == parent:
            _time.sleep(0.5)
        _os.killpg(0, _signal.SIGKILL)

    _threading.Thread(target=watch, daemon=True, name="die-with-parent").start()
'''


class VllmOutcome(NamedTuple):
    throughput: Throughput | None
    skipped_reason: str | None  # set when vLLM did not run or failed


def vllm_env(num_threads: int, kv_cache_gib: int) -> dict[str, str]:
    """The CPU build's settings: one OpenMP thread bound per core, like --threads for the other systems,
    and the KV cache size in GiB. Values already in the environment win."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{num_threads - 1}" if num_threads > 1 else "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    return env


def interpreter_missing(python: str) -> str | None:
    if Path(python).is_file() and os.access(python, os.X_OK):
        return None
    return f"interpreter {python} not found or not executable"


def write_job(tmp: str, model_dir: str, workload: Workload, max_num_seqs: int | None, wave_size: int | None,
               on_command: bool = False) -> tuple[Path, Path]:
    """The child's script and its spec file in `tmp`."""
    max_model_len = max(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
    spec = {"model_dir": model_dir, "prompts": workload.prompts, "max_tokens": workload.max_tokens,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "wave_size": wave_size,
            "on_command": on_command}
    script, spec_path = Path(tmp) / "run_vllm.py", Path(tmp) / "spec.json"
    script.write_text(DIE_WITH_PARENT + VLLM_SCRIPT)
    spec_path.write_text(json.dumps(spec))
    return script, spec_path


def run_vllm(
    python: str, model_dir: str, workload: Workload, num_threads: int, kv_cache_gib: int, timeout_s: float,
    max_num_seqs: int | None = None, wave_size: int | None = None,
) -> VllmOutcome:
    """wave_size: submit the workload in consecutive waves of that many requests, each once the last is done
    (None: all at once); the time is the waves' sum."""
    if (missing := interpreter_missing(python)) is not None:
        return VllmOutcome(None, missing)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        script, spec_path = write_job(tmp, model_dir, workload, max_num_seqs, wave_size)
        done = run_group([python, str(script), str(spec_path)], vllm_env(num_threads, kv_cache_gib), timeout_s)
    if done is None:
        return VllmOutcome(None, f"vLLM did not finish within {timeout_s:.0f} s")
    return _parse(done, workload)


def run_group(argv: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str] | None:
    """Runs argv in a process group of its own and returns its output; None when it outlasts timeout_s. Either way
    nothing of the group is left running: vLLM's engine core and workers are the child's children, which a
    timeout's kill of the child alone would leave behind."""
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_group(process)
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to whatever is left of the process group that `process` leads (started with start_new_session),
    then reaps `process`."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone already
    process.wait()


def _parse(done: subprocess.CompletedProcess[str], workload: Workload) -> VllmOutcome:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return VllmOutcome(None, f"vLLM exited with {done.returncode}: {last_lines(done.stderr or done.stdout)}")
    result = json.loads(lines[-1])
    if result["produced"] != workload.max_tokens:
        return VllmOutcome(None, "vLLM produced other lengths than the forced ones")
    note = f"vllm {result['vllm_version']}" + wave_seconds_note(result.get("wave_seconds", []))
    return VllmOutcome(Throughput("vllm-cpu", sum(result["produced"]), result["seconds"],
                                  workload.num_requests, note), None)


def last_lines(text: str, count: int = 5) -> str:
    """The end of a child's output, on one line: what a failure report quotes."""
    return " | ".join(text.strip().splitlines()[-count:])
