"""`flotilla model init` run as a user would, in a subprocess."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import flotilla.models

from flotilla.engine.tokenizer import Tokenizer


LIBS_DIR = Path(flotilla.models.__file__).resolve().parents[2]


def run_cli(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIBS_DIR), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "flotilla.cli", "model", "init", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_init_writes_the_same_checkpoint_as_the_library(tmp_path, checkpoint_factory):
    result = run_cli(tmp_path / "ckpt", "--size", "tiny", "--seed", "0", "--arch", "qwen2")
    assert result.returncode == 0, result.stderr
    expected = checkpoint_factory(architecture="qwen2", seed=0)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        produced = hashlib.sha256((tmp_path / "ckpt" / name).read_bytes()).hexdigest()
        assert produced == hashlib.sha256((expected / name).read_bytes()).hexdigest(), name
    assert Tokenizer.from_pretrained(tmp_path / "ckpt").vocab_size == 8192


def test_init_refuses_a_non_empty_directory_without_force(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    refused = run_cli(tmp_path)
    assert refused.returncode == 2
    assert "not empty" in refused.stderr and "--force" in refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    forced = run_cli(tmp_path, "--force", "--seed", "3")
    assert forced.returncode == 0, forced.stderr
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "notes.txt").read_text() == "keep me"


def test_init_rejects_unknown_size(tmp_path):
    result = run_cli(tmp_path / "x", "--size", "gigantic")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    assert not (tmp_path / "x").exists()
