"""Admission policy per tier and class: the longest estimated queue wait a request may face, its default
deadline and its weight in fair queueing. The gateway reads it from its flags and sends each request's budget
and weight to the router, which estimates waits (flotilla.router.wait_estimate) and sheds what is over budget.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionPolicy:
    """Per tier and class: the longest estimated queue wait a request may face at admission (seconds),
    its default deadline (0 = none) and its weight in fair queueing."""

    interactive_paid_s: float = 30.0
    interactive_free_s: float = 5.0
    batch_s: float = 2.0
    paid_deadline_s: float = 0.0
    free_deadline_s: float = 0.0
    paid_weight: int = 4
    free_weight: int = 1

    def __post_init__(self) -> None:
        for name in ("interactive_paid_s", "interactive_free_s", "batch_s", "paid_weight", "free_weight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.paid_deadline_s < 0 or self.free_deadline_s < 0:
            raise ValueError("default deadlines must be >= 0")

    def budget_s(self, tier: str, priority_class: str) -> float:
        if priority_class == "batch":
            return self.batch_s
        return self.interactive_paid_s if tier == "paid" else self.interactive_free_s

    def deadline_s(self, tier: str) -> float:
        return self.paid_deadline_s if tier == "paid" else self.free_deadline_s

    def weight(self, tier: str) -> int:
        return self.paid_weight if tier == "paid" else self.free_weight
