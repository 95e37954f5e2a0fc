"""The fault suites run the real fleet with keys, the usage ledger and idempotency keys in the session's Redis,
and one API key (tests/support/fleet.py); each module starts its own fleet."""

TENANT = "tenant-f"
KEY_ID = "fault-key"
