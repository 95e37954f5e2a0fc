"""What a request's tokens are charged: its tokens times its price factor (1 for interactive traffic; a batch job's
items get the batch rate, `flotilla gateway --batch-price-factor-*`), rounded up. The same rule for the tenant's
token quota (the gateway's admission) and for the ledger's billable figure (`flotilla usage`)."""

from __future__ import annotations

import math

INTERACTIVE = 1.0


def charged_tokens(num_tokens: int, price_factor: float) -> int:
    """Rounded up, so a non-zero request is never free unless its factor is 0; rounded to 1e-9 first, so that
    float noise (100 * 0.07 = 7.000000000000001) does not charge a token more."""
    return math.ceil(round(num_tokens * price_factor, 9))
