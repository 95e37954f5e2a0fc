"""KV-cache transfer between workers: a transport interface, the NIXL transport, an in-process copy
transport (for comparison and tests), and the bookkeeping of per-layer arrivals on the receiving side."""
