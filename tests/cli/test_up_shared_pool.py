"""`flotilla up`'s shared-pool settings: flags and the YAML file reach the fleet config; bad counts are refused."""

from __future__ import annotations

import argparse

import pytest

from flotilla.cli.up import register, resolve_settings


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["up", *flags])


def test_shared_pool_flags():
    settings = resolve_settings(parse("--shared-pool-models", "a=/m/a, b=/m/b,/m/c", "--shared-pool-workers", "2",
                                      "--shared-pool-max-loaded", "2"), environ={})
    assert settings["shared_pool_models"] == ("a=/m/a", "b=/m/b", "/m/c")
    assert settings["shared_pool_workers"] == 2 and settings["shared_pool_max_loaded"] == 2
    assert resolve_settings(parse(), environ={})["shared_pool_models"] == ()


def test_shared_pool_from_a_config_file(tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text("shared_pool_models: [a=/m/a, b=/m/b]\nshared_pool_max_loaded: 1\n")
    settings = resolve_settings(parse("--config", str(config)), environ={})
    assert settings["shared_pool_models"] == ("a=/m/a", "b=/m/b") and settings["shared_pool_workers"] == 1


def test_bad_shared_pool_counts_are_refused():
    with pytest.raises(SystemExit, match="shared-pool"):
        resolve_settings(parse("--shared-pool-models", "a=/m/a", "--shared-pool-max-loaded", "0"), environ={})
