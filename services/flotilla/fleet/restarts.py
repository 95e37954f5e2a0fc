"""When the launcher restarts a service that died: exponential backoff over its recent restarts, and a bound
that tells a crash loop (give up, stop the fleet) from a service that died once in a while."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts allowed within window_s; one more death in the window is a crash loop
    window_s: float = 60.0
    first_delay_s: float = 0.5  # the delay doubles with each restart still in the window
    max_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.first_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError(f"restart policy needs max_restarts >= 0, window_s > 0 and delays >= 0: {self}")


@dataclass
class RestartHistory:
    """One service's restarts; `after_exit` answers each death with a delay, or None for a crash loop."""

    policy: RestartPolicy
    restarts: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    total: int = 0  # every restart since the launcher started

    def after_exit(self, now: float) -> float | None:
        """Seconds to wait before the restart this death calls for; None when the service keeps crashing."""
        while self.restarts and now - self.restarts[0] > self.policy.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.policy.max_restarts:
            return None
        delay = min(self.policy.first_delay_s * 2 ** len(self.restarts), self.policy.max_delay_s)
        self.restarts.append(now + delay)  # counted from when it restarts
        self.total += 1
        return delay

    @property
    def num_recent(self) -> int:
        return len(self.restarts)
