"""The engine's own CPU matmul (model/panel_gemm.py, csrc/panel_gemm.c on the pool of csrc/spin_pool.h) against
F.linear: row counts that leave partial register tiles and row blocks, widths that leave a partial panel, bias,
one and two threads, the build without AVX-512; the gated gate/up matmul against SiLU(gate) * up; a row's result
bit for bit the same whatever rows share its call and however many threads run it; and two threads calling at
once."""

import os
import select
import signal
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flotilla.engine.model import panel_gemm
from tests.support.kernels import kernel_build_fixture, needs_kernels

pytestmark = [needs_kernels]  # unit (tests/conftest.py), but for the fork test at the end
kernel_build = kernel_build_fixture(panel_gemm)  # "native" and "avx2" (tests/support/kernels.py)


def _linear(in_features, out_features, bias, seed):
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.mul_(4)  # weights of std ~0.25-ish, not nn.Linear's tiny init
    return linear


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 64, 65, 513, 700])  # 513+: several row blocks
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 200), (256, 32), (33, 77), (704, 256)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_matmul_equals_f_linear(rows, in_features, out_features, bias, threads, kernel_build, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    linear = _linear(in_features, out_features, bias, seed=rows + out_features)
    x = torch.randn(rows, in_features) * 3
    with torch.inference_mode():
        expected = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
        got = panel_gemm.PanelLinear(linear)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 8, 64, 600])
@pytest.mark.parametrize("intermediate", [16, 40, 704])  # one panel, a partial one, tiny's 44
@pytest.mark.parametrize("threads", [1, 2])
def test_gated_matmul_equals_silu_of_gate_times_up(rows, intermediate, threads, kernel_build, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    linear = _linear(96, 2 * intermediate, False, seed=rows + intermediate)
    x = torch.randn(rows, 96) * 3
    with torch.inference_mode():
        gate, up = F.linear(x.double(), linear.weight.double()).chunk(2, dim=-1)
        gated = panel_gemm.PanelLinear(linear, gated=True)
        got = gated(x)
    assert gated.out_features == intermediate and got.shape == (rows, intermediate)
    torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=1e-5, atol=1e-4)


def test_a_gated_linear_refuses_a_bias_or_an_odd_width():
    with pytest.raises(ValueError, match="no bias"):
        panel_gemm.PanelLinear(_linear(16, 32, True, seed=5), gated=True)
    with pytest.raises(ValueError, match="even row count"):
        panel_gemm.pack(torch.randn(33, 16), gated=True)


def test_any_leading_shape_and_strided_input():
    linear = _linear(64, 48, True, seed=1)
    x = torch.randn(5, 3, 128)[..., ::2]  # [5, 3, 64], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(panel_gemm.PanelLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)
        assert panel_gemm.PanelLinear(linear)(x[:0]).shape == (0, 3, 48)


def test_the_dense_weight_is_not_kept():
    linear = _linear(64, 40, False, seed=2)
    packed = panel_gemm.PanelLinear(linear)
    assert [name for name, _ in packed.named_parameters()] == []  # only `packed_weight`, not a parameter
    assert packed.packed_weight.numel() == 64 * 64  # 40 columns rounded up to two panels of 32


@pytest.mark.parametrize(("in_features", "out_features"), [(256, 1408), (576, 960), (33, 77)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads(in_features, out_features, monkeypatch,
                                                                            kernel_build):
    """Bit for bit, so a sequence's logits, seeded draws and a resumed stream's tokens do not depend on what shares
    its step, nor on the pool's size."""
    linear = _linear(in_features, out_features, False, seed=out_features)
    x = torch.randn(600, in_features)
    for packed in (panel_gemm.PanelLinear(linear), panel_gemm.PanelLinear(linear, gated=out_features % 2 == 0)):
        with torch.inference_mode():
            everything = packed(x)
            for threads in (1, 2, 3):
                monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
                for rows in (1, 2, 7, 8, 9, 63, 64, 65, 129, 513, 600):
                    assert torch.equal(packed(x[:rows]), everything[:rows]), (threads, rows)
                assert torch.equal(packed(x[300:309]), everything[300:309]), threads  # rows from the middle


def test_two_threads_calling_at_once_both_get_their_own_results(monkeypatch):
    """The pool runs one task at a time; a second caller meanwhile runs its own alone (csrc/spin_pool.h)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    linears = [panel_gemm.PanelLinear(_linear(128, 160 + 32 * i, True, seed=i)) for i in range(2)]
    inputs = [torch.randn(64, 128) for _ in range(2)]
    with torch.inference_mode():
        expected = [linear(x) for linear, x in zip(linears, inputs, strict=True)]
    failures = []

    def hammer(i):
        with torch.inference_mode():
            for _ in range(300):
                if not torch.equal(linears[i](inputs[i]), expected[i]):
                    failures.append(i)
                    return

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []


def test_wrong_input_is_refused_not_misread():
    packed = panel_gemm.PanelLinear(_linear(16, 8, False, seed=3))
    with pytest.raises(ValueError, match="float32 cpu"):
        packed(torch.randn(2, 16, dtype=torch.float64))


@pytest.mark.integration
def test_a_forked_child_starts_its_own_workers(monkeypatch):
    """fork() copies the pool's state but none of its threads: the child must not wait for workers it lacks."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    packed = panel_gemm.PanelLinear(_linear(256, 512, False, seed=4))
    x = torch.randn(64, 256)
    with torch.inference_mode():
        expected = packed(x)  # the parent's pool is running
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            try:
                os.write(write_end, b"1" if torch.equal(packed(x), expected) else b"0")
            finally:
                os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        answer = os.read(read_end, 1) if ready else b"timeout"
    finally:
        os.close(read_end)
        if not ready:
            os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert answer == b"1"
