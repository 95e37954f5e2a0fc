"""A flood of completions from a process of its own (so that the flooding client's work does not delay
the measuring client): `python flood.py URL KEY N OUT`; appends "<unix time> <status>" per answer to OUT."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx

PROMPT = list(range(30, 44))


async def main(url: str, key: str, n: int, out_path: str) -> None:
    with open(out_path, "a", buffering=1) as out:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n)) as client:

            async def one() -> None:
                response = await client.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                                             json={"model": "flotilla-tiny", "prompt": PROMPT, "max_tokens": 4,
                                                   "temperature": 0})
                out.write(f"{time.time()} {response.status_code}\n")

            await asyncio.gather(*(one() for _ in range(n)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
