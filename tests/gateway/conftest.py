from __future__ import annotations

import pytest


from .in_process_gateway import InProcessGateway

write_checkpoint = pytest.importorskip("flotilla.models.checkpoint").write_checkpoint
pytest.importorskip("flotilla.engine.tokenizer")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gateway-ckpt"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def tokenizer(checkpoint_dir):
    from flotilla.engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(checkpoint_dir)


@pytest.fixture(scope="session")
def gateway(checkpoint_dir, tmp_path_factory):
    gw = InProcessGateway(checkpoint_dir, tmp_path_factory.mktemp("gateway-keys")).start()
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def tool_checkpoint_dir(checkpoint_dir, tmp_path_factory):
    """The gateway's tiny checkpoint with a chat template that renders tools (Hermes / Qwen2.5 style)."""
    from tests.support.tool_templates import with_chat_template

    return with_chat_template(checkpoint_dir, tmp_path_factory.mktemp("tool-ckpt") / "ckpt")


@pytest.fixture(scope="session")
def tool_gateway(tool_checkpoint_dir, tmp_path_factory):
    gw = InProcessGateway(tool_checkpoint_dir, tmp_path_factory.mktemp("tool-gateway-keys")).start()
    yield gw
    gw.stop()
