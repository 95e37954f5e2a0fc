"""The batch rate: what a request's tokens are charged (usage/pricing.py), a ledger record's billable tokens, and
the gateway's per-tier setting."""

from __future__ import annotations

import pytest

from flotilla.gateway.batch_jobs.settings import BatchSettings
from flotilla.usage.pricing import charged_tokens
from flotilla.usage.record import UsageRecord


def test_charged_tokens_round_up_without_float_noise():
    assert charged_tokens(10, 1.0) == 10 and charged_tokens(10, 0.5) == 5 and charged_tokens(11, 0.5) == 6
    assert charged_tokens(1, 0.25) == 1  # a request that used a token is charged one
    assert charged_tokens(100, 0.07) == 7  # 100 * 0.07 is 7.000000000000001 in floats
    assert charged_tokens(0, 0.5) == 0 and charged_tokens(9, 0.0) == 0


def test_a_records_billable_tokens_are_at_its_price_factor_and_old_records_are_interactive():
    record = UsageRecord("r", "t", "k", "m@v", "v", 9, 4, 4, "ok", "", 1, 1.0, 2.0, "batch_1", 0, 0.5)
    assert record.billable_tokens == 7  # (9 + 4) * 0.5, rounded up; cached input tokens are input tokens
    assert UsageRecord.from_fields(record.to_fields()) == record
    old = {k: v for k, v in record.to_fields().items() if k != "price_factor"}  # written before the batch rate
    assert UsageRecord.from_fields(old).billable_tokens == 13


def test_the_batch_rate_is_per_tier_half_by_default():
    assert BatchSettings().price_factor("paid") == BatchSettings().price_factor("free") == 0.5
    settings = BatchSettings(price_factor_paid=0.4, price_factor_free=1.0)
    assert settings.price_factor("paid") == 0.4 and settings.price_factor("free") == 1.0
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="price_factor_free"):
            BatchSettings(price_factor_free=bad)
