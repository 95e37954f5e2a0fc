from __future__ import annotations

import pytest

from flotilla.gateway.model_registry import load_engine_tokenizer

from .in_process_gateway import InProcessGateway

write_checkpoint = pytest.importorskip("flotilla.models.checkpoint").write_checkpoint
pytest.importorskip("flotilla.engine.tokenizer")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gateway-ckpt"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def tokenizer(checkpoint_dir):
    return load_engine_tokenizer(str(checkpoint_dir))


@pytest.fixture(scope="session")
def gateway(checkpoint_dir, tmp_path_factory):
    gw = InProcessGateway(checkpoint_dir, tmp_path_factory.mktemp("gateway-keys")).start()
    yield gw
    gw.stop()
