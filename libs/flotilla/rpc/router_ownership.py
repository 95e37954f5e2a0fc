"""Which of several routers owns a model: rendezvous hashing of (router address, model name), the same answer in
every process that was given the same addresses (gateways send the model's requests there, the autoscaler reads
the model's queue there). The owner holds the model's queues, so its tenants' fair shares hold across routers."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def rendezvous_score(address: str, model_name: str) -> int:
    """A router's claim on a model: the router with the highest score owns it."""
    return int.from_bytes(hashlib.sha256(f"{address}\n{model_name}".encode()).digest()[:8], "big")


def owner_order(addresses: Sequence[str], model_name: str) -> list[str]:
    """The routers in the order a model's calls try them while all are up: its owner first."""
    return sorted(addresses, key=lambda address: -rendezvous_score(address, model_name))


def split_addresses(addresses: str | Sequence[str]) -> list[str]:
    """host:port addresses from a comma list (FLOTILLA_ROUTER_ADDRESS, spec.routerAddress) or a sequence."""
    parts = addresses.split(",") if isinstance(addresses, str) else addresses
    return list(dict.fromkeys(part.strip() for part in parts if part.strip()))
