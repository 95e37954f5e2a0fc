"""What the gateway's safety stage costs: CPU per token of the rules output screen, and TTFT / ITL of streamed
requests through the real fleet with the stage on and off, in one run. Ends with one JSON line.

    .venv/bin/python loadtest/bench_safety.py                      # both parts
    .venv/bin/python loadtest/bench_safety.py --skip-fleet --tokens 500000

*Screen CPU*: a policy of `--terms` literal terms and `--patterns` regexes (none of which occur), fed a synthetic
answer of ~4-character tokens one token per delta; timed alone (RulesScreen.feed) and through ScreenedEvents (the
per-chunk work the gateway adds: feed, hold, release), as µs per token, best of `--rounds`.

*Fleet*: one LocalFleet (router, worker, gateway on loopback) with a safety config whose default policy is that
rules policy (window `--window-chars`) and a key whose policy is "none"; the same streamed chat workload
(ignore_eos, exact lengths) runs with each key, alternating, `--rounds` times; TTFT and ITL medians per key. The
hold-back shows in TTFT (the first chunk waits until `window_chars` characters follow it); ITL should not move.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flotilla.gateway.safety.config import SafetyConfig  # noqa: E402
from flotilla.gateway.safety.stage import ScreenedEvents  # noqa: E402
from flotilla.rpc.stream_events import Chunk, Finished, Usage  # noqa: E402
from flotilla.engine.request import FinishReason  # noqa: E402

from loadtest.common.checkpoint_cache import ensure_checkpoint  # noqa: E402
from loadtest.serving.client import Endpoint, run_workload  # noqa: E402
from loadtest.serving.stats import SLO, summarize  # noqa: E402
from loadtest.serving.workload import WorkloadConfig, build_workload  # noqa: E402

MODEL = "flotilla-tiny"
SYLLABLES = ["the", " sea", "ing", " of", " light", "house", " a", "nd", " wave", "s", ",", " to", "ward",
             " harb", "our", ".", " It", " was", " cold", " tide"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--terms", type=int, default=50)
    p.add_argument("--patterns", type=int, default=10, help="0: terms alone (the screen's prefix hold)")
    p.add_argument("--window-chars", type=int, default=32)
    p.add_argument("--tokens", type=int, default=200_000, help="screen CPU: tokens fed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-fleet", action="store_true")
    p.add_argument("--size", default="tiny", help="fleet checkpoint size (random weights)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--output-tokens", type=int, nargs=2, default=(64, 128))
    return p.parse_args(argv)


def policy_document(args: argparse.Namespace) -> dict:
    rules = [{"category": f"c{c}", "terms": [f"forbidden phrase {i}" for i in range(c, args.terms, 5)]}
             for c in range(min(5, args.terms))]
    if args.patterns:
        rules.append({"category": "patterns",
                      "patterns": [rf"\bsecret\s+code\s+{i}\d+\b" for i in range(args.patterns)]})
    return {"default": "bench", "policies": {"bench": {"window_chars": args.window_chars, "rules": rules},
                                             "none": {}}}


def synthetic_tokens(n: int) -> list[str]:
    rng = random.Random(0)
    return [rng.choice(SYLLABLES) for _ in range(n)]


async def screen_alone(config: SafetyConfig, tokens: list[str]) -> float:
    screen = config.policy("").output_screen()
    start = time.perf_counter()
    for token in tokens:
        verdict = await screen.feed(token)
        assert verdict.allowed
    assert (await screen.finish()).allowed
    return (time.perf_counter() - start) / len(tokens) * 1e6


class _Upstream:
    """Stands for RouterEvents: the chunks, then Finished."""

    def __init__(self, tokens: list[str]):
        self.num_withheld_tokens = 0
        self._events = iter([Chunk((i,), text) for i, text in enumerate(tokens)]
                            + [Finished(FinishReason.LENGTH, Usage(1, len(tokens), 0))])

    async def __anext__(self):
        return next(self._events)

    async def aclose(self) -> None:
        pass


async def through_screened_events(config: SafetyConfig, tokens: list[str], screened: bool) -> float:
    upstream = _Upstream(tokens)
    events = ScreenedEvents(upstream, config.policy("").output_screen(), lambda v: None, 1) if screened \
        else upstream
    start = time.perf_counter()
    while type(await events.__anext__()) is Chunk:
        pass
    return (time.perf_counter() - start) / len(tokens) * 1e6


def screen_cpu(args: argparse.Namespace, line: dict) -> None:
    config = SafetyConfig.from_json(policy_document(args))
    tokens = synthetic_tokens(args.tokens)
    alone = min(asyncio.run(screen_alone(config, tokens)) for _ in range(args.rounds))
    with_stage = min(asyncio.run(through_screened_events(config, tokens, True)) for _ in range(args.rounds))
    without = min(asyncio.run(through_screened_events(config, tokens, False)) for _ in range(args.rounds))
    line.update(screen_us_per_token=round(alone, 2), stage_us_per_token=round(with_stage - without, 2),
                mean_token_chars=round(sum(map(len, tokens)) / len(tokens), 2))
    print(f"rules screen ({args.terms} terms, {args.patterns} patterns, window {args.window_chars}): "
          f"{alone:.2f} µs/token alone; {with_stage - without:.2f} µs/token added per chunk by ScreenedEvents "
          f"(best of {args.rounds} x {len(tokens)} tokens)")


def fleet_latency(args: argparse.Namespace, line: dict) -> None:
    from flotilla.fleet.local import FleetConfig, LocalFleet
    from flotilla.tenancy.keys import KeyEntry, generate_key, hash_key, write_keys_file

    model_dir = ensure_checkpoint(Path.home() / ".cache" / "flotilla" / "bench", args.size)
    specs = build_workload(WorkloadConfig(num_requests=args.num_prompts, output_tokens=tuple(args.output_tokens)))
    keys = {"on": generate_key(), "off": generate_key()}
    with tempfile.TemporaryDirectory(prefix="bench-safety-") as state:
        state_dir = Path(state)
        (state_dir / "safety.json").write_text(json.dumps(policy_document(args)))
        write_keys_file(state_dir / "keys.json", [KeyEntry("on", hash_key(keys["on"]), "t-on", "paid"),
                                                  KeyEntry("off", hash_key(keys["off"]), "t-off", "paid",
                                                           safety_policy="none")])
        config = FleetConfig(model_dir=model_dir, state_dir=state_dir, model_name=MODEL, keys_file=state_dir / "keys.json",
                             worker_args=["--num-kv-blocks", "4096", "--output-check-interval-s", "0"],
                             gateway_args=["--safety-config", str(state_dir / "safety.json")])
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        with LocalFleet(config) as fleet:
            def run(key: str, subset) -> dict:
                endpoint = Endpoint(key, fleet.gateway_url + "/v1", MODEL, keys[key], ignore_eos=True,
                                    use_tenant_keys=False)
                return summarize(asyncio.run(run_workload(endpoint, subset, args.max_concurrency, progress=False)),
                                 SLO(1.0, 0.1))

            run("on", specs[:4]), run("off", specs[:4])  # warm-up
            for round_index in range(args.rounds):  # alternating, so a slow spell hits both
                for key in (("on", "off") if round_index % 2 == 0 else ("off", "on")):
                    runs[key].append(run(key, specs))
    for key, summaries in runs.items():
        assert all(s["num_errors"] == 0 for s in summaries), [s["errors"] for s in summaries]
        for metric in ("ttft_s", "itl_s", "tpot_s"):
            value = statistics.median(s["latency"][metric]["p50"] for s in summaries)
            line[f"{metric[:-2]}_p50_ms_{key}"] = round(value * 1e3, 2)
        line[f"output_tok_s_{key}"] = round(statistics.median(s["output_tok_s"] for s in summaries), 1)
    print(f"fleet, {args.num_prompts} streamed requests at concurrency {args.max_concurrency}, median of "
          f"{args.rounds} rounds: TTFT p50 {line['ttft_p50_ms_on']} ms on / {line['ttft_p50_ms_off']} ms off; "
          f"ITL p50 {line['itl_p50_ms_on']} ms on / {line['itl_p50_ms_off']} ms off; "
          f"TPOT p50 {line['tpot_p50_ms_on']} ms on / {line['tpot_p50_ms_off']} ms off; "
          f"{line['output_tok_s_on']} / {line['output_tok_s_off']} output tok/s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    line: dict = {"terms": args.terms, "patterns": args.patterns, "window_chars": args.window_chars,
                  "loadavg_1m_start": os.getloadavg()[0]}
    screen_cpu(args, line)
    if not args.skip_fleet:
        fleet_latency(args, line)
    line["loadavg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
