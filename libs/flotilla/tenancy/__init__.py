"""Tenancy: API keys (stored hashed) that map to a tenant, tier, priority class, limits and cache salt;
token quotas (Redis Lua scripts, or in-process), concurrency limits, the Redis-down policy, and the fleet
wait estimates that decide 529s.

Backends: a JSON keys file with in-process quotas (one gateway, `flotilla up`), or Redis for both keys
and quotas (several gateways share limits exactly).
"""
