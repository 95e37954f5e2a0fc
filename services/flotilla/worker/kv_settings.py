"""Disaggregation settings of a worker (flags of `flotilla worker`)."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class DisaggSettings:
    role: str = "both"  # both: colocated (no KV transfer); prefill / decode: one side of a hand-off
    min_remote_prefill_tokens: int = 32  # decode side: a shorter uncached remainder is prefilled here
    lease_s: float = 30.0  # longest a hand-off may take: a write to land, a reservation to be filled
    layerwise: bool = True  # False: one write per layer after the whole forward pass (benchmark baseline)

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.min_remote_prefill_tokens < 1 or self.lease_s <= 0:
            raise ValueError("min_remote_prefill_tokens must be >= 1 and lease_s > 0")

    @property
    def transfers_kv(self) -> bool:
        return self.role != "both"
