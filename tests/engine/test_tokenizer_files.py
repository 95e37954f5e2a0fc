"""A checkpoint's tokenizer files as data: read, digested, checked, and turned into the same tokenizer."""

from __future__ import annotations

import pytest

from flotilla.engine.tokenizer import Tokenizer
from flotilla.engine.tokenizer_files import check_file_names, files_digest, read_tokenizer_files


def test_tokenizer_from_files_equals_tokenizer_from_the_directory(tiny_checkpoint):
    files = read_tokenizer_files(tiny_checkpoint)
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(files)
    from_dir, from_files = Tokenizer.from_pretrained(tiny_checkpoint), Tokenizer.from_files(files)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about tides."}]
    assert from_files.encode_chat(messages) == from_dir.encode_chat(messages)
    assert from_files.eos_token_ids == from_dir.eos_token_ids and from_files.special_tokens == from_dir.special_tokens


def test_extra_chat_templates_travel_with_the_files(tiny_checkpoint, tmp_path):
    import shutil

    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    (checkpoint / "additional_chat_templates").mkdir()
    (checkpoint / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools!' }}")
    (checkpoint / "model.safetensors.bak").write_bytes(b"not a tokenizer file")
    files = read_tokenizer_files(checkpoint)
    assert "additional_chat_templates/tool_use.jinja" in files and "model.safetensors.bak" not in files
    tokenizer = Tokenizer.from_files(files)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "f"}]) == "tools!"


def test_digest_names_exact_content_not_order():
    files = {"tokenizer.json": b"{}", "config.json": b"{}"}
    assert files_digest(files) == files_digest(dict(reversed(files.items())))
    assert files_digest(files) != files_digest({**files, "config.json": b"{ }"})
    # A byte moved from one file's end to the next file's start is another set.
    assert files_digest({"a": b"xy", "b": b""}) != files_digest({"a": b"x", "b": b"y"})


@pytest.mark.parametrize("name", ["../tokenizer.json", "/etc/passwd", "model.safetensors",
                                  "additional_chat_templates/../x.jinja", "additional_chat_templates/.x.jinja",
                                  "additional_chat_templates/a/b.jinja"])
def test_only_tokenizer_file_names_are_accepted(name):
    with pytest.raises(ValueError, match="unexpected tokenizer file"):
        check_file_names({"tokenizer.json": b"{}", name: b""})


def test_tokenizer_json_is_required():
    with pytest.raises(ValueError, match="tokenizer.json"):
        check_file_names({"config.json": b"{}"})
