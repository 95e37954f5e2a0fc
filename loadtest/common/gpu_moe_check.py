"""The device check's look at the MoE experts' grouped way (engine/model/moe.py), which only CUDA bf16 on sm90+ takes:
random experts of Qwen3-30B-A3B's shape (128 experts, top 8, hidden 2,048, 768 each), random routing, and
- whether the engine picks the grouped way there (grouped_mm_fits), and whether its start-up probe keeps it;
- the grouped way against the Python loop on the same inputs (largest difference over the largest output);
- whether the grouped way synchronises with the host: run under torch.cuda.set_sync_debug_mode("error"), where any
  synchronising call raises;
- ms a call of each way for a decode step's tokens and a prefill step's (CUDA events, median of the rounds).
--dry-run (CPU, float32) runs the same comparison at tiny shapes, without the sync check; loadtest/bench_moe_experts.py
runs it at any shape on the CPU."""

from __future__ import annotations

import statistics

import torch

from loadtest.common.device_floors import timed_seconds

FULL_SHAPE = dict(experts=128, top_k=8, hidden=2048, intermediate=768, tokens=(64, 2048), rounds=5)
DRY_SHAPE = dict(experts=8, top_k=2, hidden=32, intermediate=48, tokens=(4, 64), rounds=2)


def _ms_a_call(call, device: torch.device, rounds: int) -> float:
    return statistics.median(timed_seconds(call, device, rounds)) * 1e3


def moe_grouped_check(device: torch.device) -> dict:
    """The device check's section: Qwen3-30B-A3B's experts in bf16 on CUDA, tiny ones in float32 with --dry-run."""
    shape = FULL_SHAPE if device.type == "cuda" else DRY_SHAPE
    return compare_ways(device, torch.bfloat16 if device.type == "cuda" else torch.float32, shape)


def compare_ways(device: torch.device, dtype: torch.dtype, shape: dict) -> dict:
    """The grouped way against the loop on random experts of `shape`: their difference, the host-sync check (CUDA),
    and ms a call of each way at each of shape["tokens"]."""
    from flotilla.engine.model.config import MoEConfig
    from flotilla.engine.model.moe import Experts, grouped_mm_fits, random_routing, settle_experts_way

    moe = MoEConfig(num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                    intermediate_size=shape["intermediate"], norm_topk_prob=True, sparse_layers=(0,))
    torch.manual_seed(0)
    experts = Experts(shape["hidden"], moe)
    for weight in experts.parameters():
        torch.nn.init.normal_(weight, std=0.02)
    experts = experts.to(device=device, dtype=dtype)
    result: dict = {"shape": {k: v for k, v in shape.items() if k != "rounds"}, "dtype": str(dtype)}

    def routing(num_tokens: int, seed: int):
        return random_routing(num_tokens, shape["hidden"], shape["experts"], shape["top_k"], device, dtype, seed)

    with torch.no_grad():
        x, expert_ids, weights = routing(max(shape["tokens"]), seed=1)
        result["engine_picks_grouped"] = grouped_mm_fits(device, dtype, shape["hidden"], shape["intermediate"])
        result["start_up_probe_keeps_grouped"] = settle_experts_way(experts)  # the engine's check at start-up
        grouped = experts._grouped(x, expert_ids, weights)
        loop = experts._loop(x, expert_ids, weights)
        result["grouped_equals_loop"] = torch.equal(grouped, loop)
        result["grouped_vs_loop_max_error_relative"] = float((grouped - loop).abs().max() / loop.abs().max())
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                experts._grouped(x, expert_ids, weights)
                result["grouped_host_syncs"] = "none"
            except RuntimeError as error:
                result["grouped_host_syncs"] = str(error)[:300]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for num_tokens in shape["tokens"]:
            inputs = routing(num_tokens, seed=num_tokens)
            for way in ("grouped", "loop"):
                forward = getattr(experts, f"_{way}")
                result[f"{way}_ms_{num_tokens}_tokens"] = _ms_a_call(lambda: forward(*inputs), device,
                                                                      shape["rounds"])
    return result
