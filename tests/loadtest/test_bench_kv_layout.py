"""The block-size benchmark gives the decode kernel one context per sequence at every block size: the outputs must
agree (so its timings compare like with like), with key tails that fill no whole tile or block."""

import json

import pytest
import torch

from flotilla.engine.model.kv_cache import token_major
from loadtest import bench_kv_layout
from tests.support.kernels import needs_kernels

pytestmark = needs_kernels


def test_every_block_size_gives_the_same_attention(capsys):
    assert bench_kv_layout.main(["--size", "tiny", "small", "--block-sizes", "16", "5", "128", "--layers", "2",
                                 "--seqs", "5", "--context", "37", "--rounds", "1", "--threads", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["block_size"] for r in report["results"]] == [16, 5, 128] * 2
    for result in report["results"]:
        assert result["max_abs_difference"] <= 1e-5, result
        assert result["ms_per_layer"] > 0


def test_paged_puts_each_token_where_its_table_says():
    context = torch.randn(2, 3, 11, 2, 8)
    cache, tables = bench_kv_layout.paged(context, 4, torch.Generator().manual_seed(0))
    by_token = token_major(cache)
    for seq in range(3):
        for t in range(11):
            assert torch.equal(by_token[:, tables[seq, t // 4], t % 4], context[:, seq, t])
