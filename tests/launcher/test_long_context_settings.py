"""The long-context pool's settings as the commands parse them: `flotilla up`'s flags (and their checks), the
router's --long-context-threshold, the worker's --pool."""

from __future__ import annotations

import pytest

from flotilla.cli import build_parser
from flotilla.cli.serve import _context_thresholds
from flotilla.cli.up import resolve_settings


def up_settings(*argv: str) -> dict:
    return resolve_settings(build_parser().parse_args(["up", *argv]), environ={})


def test_up_starts_no_long_context_pool_unless_asked():
    settings = up_settings()
    assert settings["long_context_workers"] == 0 and settings["long_context_threshold"] == 4096


def test_up_long_context_flags():
    settings = up_settings("--long-context-workers", "2", "--long-context-threshold", "1024",
                           "--long-context-worker-arg=--max-num-batched-tokens=4096")
    assert (settings["long_context_workers"], settings["long_context_threshold"]) == (2, 1024)
    assert settings["long_context_worker_args"] == ["--max-num-batched-tokens=4096"]


@pytest.mark.parametrize("argv", [("--long-context-workers", "-1"), ("--long-context-threshold", "0"),
                                  ("--long-context-workers", "1", "--autoscale")])
def test_up_refuses_bad_long_context_settings(argv):
    with pytest.raises(SystemExit):
        up_settings(*argv)


def test_router_threshold_flag():
    args = build_parser().parse_args(["router", "--long-context-threshold", "tiny=64",
                                      "--long-context-threshold", "8192"])
    thresholds = _context_thresholds(args.long_context_threshold)
    assert (thresholds.for_model("tiny"), thresholds.for_model("other")) == (64, 8192)
    with pytest.raises(SystemExit, match="--long-context-threshold: expected MODEL=TOKENS"):
        _context_thresholds(["tiny=lots"])


def test_worker_pool_flag():
    assert build_parser().parse_args(["worker", "--pool", "long-context"]).pool == "long-context"
    assert build_parser().parse_args(["worker"]).pool == "default"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--pool", "huge"])
