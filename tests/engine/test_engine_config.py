"""Start-up choices of EngineConfig: the attention backend, the KV pool's element type and block size per device."""

import pytest
import torch

from flotilla.engine.config import (
    EngineConfig,
    resolve_attention_backend,
    resolve_block_size,
    resolve_dtype,
    resolve_kv_cache_dtype,
)

CPU = torch.device("cpu")


def test_cpu_keeps_fp32_and_the_torch_path():
    assert resolve_dtype("auto", CPU, torch.bfloat16) == torch.float32
    assert resolve_attention_backend("auto", CPU) == "torch"
    assert resolve_kv_cache_dtype("auto", torch.float32, CPU) == torch.float32


def test_cuda_defaults_to_16_bit_weights():
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda, torch.float32) == torch.bfloat16
    assert resolve_dtype("auto", cuda, torch.float16) == torch.float16
    assert resolve_dtype("float32", cuda, torch.bfloat16) == torch.float32


def test_block_size_defaults_to_128_tokens_on_cpu_and_16_on_cuda():
    """A CPU's decode kernel reads each KV head's run of a block in order; long runs are what make it fast."""
    assert resolve_block_size(None, CPU) == 128
    assert resolve_block_size(None, torch.device("cuda")) == 16
    assert resolve_block_size(32, CPU) == 32
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model_dir="unused", block_size=0).validate()


def test_kv_cache_dtype_can_be_narrower_than_the_model():
    assert resolve_kv_cache_dtype("float8_e4m3fn", torch.float32, CPU) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("float8_e5m2", torch.bfloat16, CPU) == torch.float8_e5m2


def test_fp8_kv_cache_is_refused_on_gpus_without_fp8_conversions(monkeypatch):
    """An A100 (8.0) has no fp8 conversions: refused at start-up; an L4 (8.9) and an H100 (9.0) take it."""
    cuda = torch.device("cuda")
    for capability, refused in (((8, 0), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        if refused:
            with pytest.raises(ValueError, match=r"float8_e4m3fn needs a GPU of compute capability 8\.9 or later"):
                resolve_kv_cache_dtype("float8_e4m3fn", torch.bfloat16, cuda)
        else:
            assert resolve_kv_cache_dtype("float8_e4m3fn", torch.bfloat16, cuda) == torch.float8_e4m3fn
        assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16


def test_triton_off_cuda_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", CPU) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="runs on cuda"):
        resolve_attention_backend("triton", CPU)
    assert resolve_attention_backend("torch", CPU) == "torch"
