"""Workload generator: seeded, the requested mix of shapes, tenants and arrival patterns."""

from __future__ import annotations

import math

import pytest

from loadtest.serving.workload import Tenant, WorkloadConfig, build_workload

TENANTS = (Tenant("acme", "paid", weight=3.0), Tenant("hobbyist", "free", weight=1.0))


def test_same_seed_same_requests_other_seed_other_requests():
    config = dict(num_requests=50, rate=5.0, chat_share=0.4, long_share=0.2, tenants=TENANTS)
    first = build_workload(WorkloadConfig(**config, seed=1))
    assert first == build_workload(WorkloadConfig(**config, seed=1))
    assert first != build_workload(WorkloadConfig(**config, seed=2))


def test_mix_of_shapes_and_tenants():
    specs = build_workload(WorkloadConfig(num_requests=400, rate=10.0, chat_share=0.3, long_share=0.1,
                                          tenants=TENANTS, seed=0))
    kinds = {kind: sum(s.kind == kind for s in specs) for kind in ("short", "chat", "long")}
    assert 80 < kinds["chat"] < 160 and 20 < kinds["long"] < 70, kinds
    chats = [s for s in specs if s.kind == "chat"]
    # Chats share a handful of system prompts (prefix-cache food) and alternate user/assistant turns.
    assert len({s.messages[0]["content"] for s in chats}) <= 4
    assert all(s.messages[0]["role"] == "system" and s.messages[-1]["role"] == "user" for s in chats)
    longest_short = max(len(s.messages[0]["content"].split()) for s in specs if s.kind == "short")
    assert min(len(s.messages[0]["content"].split()) for s in specs if s.kind == "long") > longest_short
    paid = sum(s.tier == "paid" for s in specs)
    assert 250 < paid < 350  # weight 3 : 1


def test_poisson_arrivals_have_the_requested_rate():
    specs = build_workload(WorkloadConfig(num_requests=2000, rate=8.0, seed=3))
    times = [s.arrival_s for s in specs]
    assert times == sorted(times)
    assert len(specs) / times[-1] == pytest.approx(8.0, rel=0.1)


def test_bursty_arrivals_triple_the_rate_during_spikes():
    config = WorkloadConfig(num_requests=3000, rate=5.0, arrival="bursty", spike_every_s=10.0, spike_length_s=2.0,
                            seed=4)
    times = [s.arrival_s for s in build_workload(config)]
    in_spike = sum((t % 10.0) < 2.0 for t in times)
    spike_rate = in_spike / (times[-1] * 0.2)
    base_rate = (len(times) - in_spike) / (times[-1] * 0.8)
    assert spike_rate / base_rate == pytest.approx(3.0, rel=0.2)


def test_infinite_rate_and_batch_send_everything_at_once():
    assert {s.arrival_s for s in build_workload(WorkloadConfig(num_requests=5, rate=math.inf))} == {0.0}
    assert {s.arrival_s for s in build_workload(WorkloadConfig(num_requests=5, rate=2.0, arrival="batch"))} == {0.0}


@pytest.mark.parametrize("bad", [dict(num_requests=0), dict(rate=0.0), dict(arrival="zipf"),
                                 dict(chat_share=0.8, long_share=0.5), dict(tenants=())])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError):
        build_workload(WorkloadConfig(**bad))
