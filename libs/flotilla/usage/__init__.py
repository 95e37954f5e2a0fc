"""The usage ledger: exactly one record per request that reached the router (tenant, key, model version,
input/cached/output tokens delivered, status, attempts, timestamps), written off the hot path to a Redis
stream or an append-only JSON-lines file, and summed per tenant by `flotilla usage`."""
