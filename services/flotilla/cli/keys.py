"""`flotilla keys create|list|revoke|set-limits`: API keys in Redis (--redis-url or $FLOTILLA_REDIS_URL)
or in a JSON keys file (--keys-file, default .flotilla/keys.json). A new key is printed once; only its
SHA-256 digest is stored."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
from dataclasses import replace

DEFAULT_KEYS_FILE = ".flotilla/keys.json"
_LIMIT_FLAGS = (("--tokens-per-minute", "tokens_per_minute"), ("--requests-per-minute", "requests_per_minute"),
                ("--max-concurrent", "max_concurrent"))


def register(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="manage API keys: tenants, tiers, limits")
    actions = keys.add_subparsers(dest="keys_command", required=True)
    create = actions.add_parser("create", help="make a key and print it (once)")
    create.add_argument("--key-id", default=None, help="default: key-<random>")
    create.add_argument("--tenant", required=True)
    create.add_argument("--tier", choices=("paid", "free"), default="paid")
    create.add_argument("--priority-class", choices=("interactive", "batch"), default="interactive")
    create.add_argument("--cache-salt", default="", help="prefix-cache salt (default: the tenant name)")
    create.add_argument("--safety-policy", default="",
                        help="a policy of the gateways' --safety-config (default: its default policy)")
    _add_limit_flags(create, default=0)
    create.set_defaults(func=_create)
    listing = actions.add_parser("list", help="list keys (never the keys themselves)")
    listing.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    listing.set_defaults(func=_list)
    revoke = actions.add_parser("revoke", help="delete a key; every gateway refuses it from the next request")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_revoke)
    limits = actions.add_parser("set-limits", help="change a key's limits (0 = unlimited)")
    limits.add_argument("key_id")
    _add_limit_flags(limits, default=None)
    limits.set_defaults(func=_set_limits)
    for parser in (create, listing, revoke, limits):
        parser.add_argument("--redis-url", default=os.environ.get("FLOTILLA_REDIS_URL") or None,
                            help="Redis holding the keys (default $FLOTILLA_REDIS_URL)")
        parser.add_argument("--keys-file", default=DEFAULT_KEYS_FILE, help="used when no Redis URL is given")


def _add_limit_flags(parser: argparse.ArgumentParser, default: int | None) -> None:
    for flag, dest in _LIMIT_FLAGS:
        parser.add_argument(flag, dest=dest, type=int, default=default, help="0 = unlimited")


def _store(args: argparse.Namespace):
    if args.redis_url:
        from flotilla.tenancy.redis_conn import connect
        from flotilla.tenancy.redis_keys import RedisKeyStore

        return RedisKeyStore(connect(args.redis_url), owns_client=True)
    from flotilla.tenancy.file_keys import FileKeyStore

    return FileKeyStore(args.keys_file)


def _run(args: argparse.Namespace, action) -> int:
    async def main() -> int:
        store = _store(args)
        try:
            return await action(store)
        finally:
            await store.close()

    from flotilla.tenancy.errors import BackendUnavailable

    try:
        return asyncio.run(main())
    except (BackendUnavailable, LookupError, ValueError) as err:
        print(f"flotilla keys: {err}", file=sys.stderr)
        return 1


def _create(args: argparse.Namespace) -> int:
    from flotilla.tenancy.key_hashing import generate_key, hash_key
    from flotilla.tenancy.records import Limits, TenantKey

    key = generate_key()
    entry = TenantKey(args.key_id or f"key-{secrets.token_hex(4)}", hash_key(key), args.tenant, args.tier,
                      args.priority_class, Limits(args.tokens_per_minute, args.requests_per_minute,
                                                  args.max_concurrent), args.cache_salt, args.safety_policy)

    async def action(store) -> int:
        await store.create(entry)
        print(f"created key {entry.key_id} for tenant {entry.tenant} ({entry.tier}, {entry.priority_class}); "
              "it is shown only now:", file=sys.stderr)
        sys.stdout.write(key + "\n")
        return 0

    return _run(args, action)


def _list(args: argparse.Namespace) -> int:
    from flotilla.tenancy.key_store import entry_to_json

    async def action(store) -> int:
        rows = [entry_to_json(e) for e in await store.list()]
        for row in rows:
            del row["sha256"]  # a digest is no secret, but nobody needs it on a screen
        if args.json:
            print(json.dumps(rows))
            return 0
        for row in rows:
            limits = " ".join(f"{k}={v}" for k, v in row["limits"].items())
            print(f"{row['key_id']}\ttenant={row['tenant']}\ttier={row['tier']}\t"
                  f"class={row['priority_class']}\t{limits}\tsafety={row['safety_policy'] or 'default'}")
        return 0

    return _run(args, action)


def _revoke(args: argparse.Namespace) -> int:
    async def action(store) -> int:
        if await store.revoke(args.key_id):
            print(f"revoked {args.key_id}")
            return 0
        print(f"flotilla keys: no key with id {args.key_id!r}", file=sys.stderr)
        return 1

    return _run(args, action)


def _set_limits(args: argparse.Namespace) -> int:
    async def action(store) -> int:
        current = next((e for e in await store.list() if e.key_id == args.key_id), None)
        if current is None:
            print(f"flotilla keys: no key with id {args.key_id!r}", file=sys.stderr)
            return 1
        changes = {dest: getattr(args, dest) for _, dest in _LIMIT_FLAGS if getattr(args, dest) is not None}
        updated = await store.set_limits(args.key_id, replace(current.limits, **changes))
        print(f"{updated.key_id}: {updated.limits}")
        return 0

    return _run(args, action)
