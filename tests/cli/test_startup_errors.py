"""A checkpoint the engine cannot load stops `flotilla up` and `flotilla worker` at start-up with one line
that names the architecture and what is missing: no traceback, a non-zero exit, nothing started."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import flotilla.models

LIBS_DIR = Path(flotilla.models.__file__).resolve().parents[2]
SERVICES_DIR = LIBS_DIR.parent / "services"


def run_cli(*args, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIBS_DIR), str(SERVICES_DIR), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "flotilla.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=cwd)


@pytest.fixture
def broken(tmp_path, tiny_checkpoint):
    def make(kind: str) -> Path:
        directory = tmp_path / kind
        shutil.copytree(tiny_checkpoint, directory)
        if kind == "architecture":
            config = json.loads((directory / "config.json").read_text())
            (directory / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
        elif kind == "kv scale":  # an fp8 cache's scales, one of them zero
            tensors = load_file(directory / "model.safetensors")
            num_layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
            scales = {f"model.layers.{layer}.self_attn.{part}_scale": torch.tensor(0.5)
                      for layer in range(num_layers) for part in ("k", "v")}
            scales["model.layers.1.self_attn.k_scale"] = torch.tensor(0.0)
            save_file({**tensors, **scales}, directory / "model.safetensors")
        else:
            tensors = load_file(directory / "model.safetensors")
            del tensors["model.layers.0.mlp.down_proj.weight"]
            save_file(tensors, directory / "model.safetensors")
        return directory

    return make


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("architecture", "GPT2LMHeadModel: unsupported architecture ['GPT2LMHeadModel']; supported: LlamaForCausalLM"),
        ("tensor", "LlamaForCausalLM: checkpoint lacks tensors for model.layers.0.mlp.down_proj.weight"),
        ("kv scale", "LlamaForCausalLM: checkpoint KV-cache scale model.layers.1.self_attn.k_scale is 0.0"),
    ],
)
@pytest.mark.parametrize("command", ["up", "worker"])
def test_unsupported_checkpoint_fails_in_one_line(broken, tmp_path, kind, expected, command):
    model_dir = broken(kind)
    state = ("--state-dir", tmp_path / "state") if command == "up" else ()
    result = run_cli(command, "--model-dir", model_dir, *state, cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"flotilla {command}: cannot serve {model_dir}: ") and expected in lines[0]
    assert not (tmp_path / "state" / "logs").exists()  # nothing was started


def test_a_negative_onednn_cache_capacity_fails_in_one_line(tiny_checkpoint, tmp_path):
    result = run_cli("worker", "--model-dir", tiny_checkpoint, "--insecure-internal",
                     "--onednn-primitive-cache-capacity", "-1", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("flotilla worker: --onednn-primitive-cache-capacity must be >= 0 (0: oneDNN's "
                                     "default), got -1")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--kv-cache-dtype", "bogus"], "flotilla worker: kv_cache_dtype must be auto or one of"),
        (["--kv-cache-dtype", "float8_e4m3fn", "--kv-cache-scales", "checkpoint"],
         "flotilla worker: kv_cache_scales 'checkpoint': {model_dir} has no KV-cache scale tensors"),
    ],
)
def test_engine_settings_it_would_refuse_fail_in_one_line(tiny_checkpoint, tmp_path, flags, expected):
    """Refused by the engine before it loads the weights (EngineConfig.validate, the checkpoint's scales)."""
    result = run_cli("worker", "--model-dir", tiny_checkpoint, "--insecure-internal", *flags, cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(expected.format(model_dir=tiny_checkpoint))


@pytest.mark.parametrize("engine_process", [False, True])
def test_an_engine_that_refuses_after_loading_fails_in_one_line(tiny_checkpoint, tmp_path, engine_process):
    """Refusals only the engine can make once the model is loaded (here a KV budget smaller than one block; on a
    GPU an fp8 cache without fp8, a failed graph capture) end in one line too, whether the engine runs in the
    worker's process or its own."""
    flags = ["--engine-process"] if engine_process else []
    result = run_cli("worker", "--model-dir", tiny_checkpoint, "--insecure-internal", "--kv-cache-memory-bytes", "100",
                     *flags, cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("flotilla worker: a KV budget of 100 bytes holds no block")
