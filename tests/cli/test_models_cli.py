"""`flotilla models` finds the router (flag, environment, `flotilla up`'s port file) and says why it cannot."""

from __future__ import annotations

import socket

from flotilla.cli import main


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_without_a_router_it_says_how_to_name_one(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FLOTILLA_ROUTER_ADDRESS", raising=False)
    assert main(["models", "--state-dir", str(tmp_path), "list"]) == 2
    assert "--router HOST:PORT" in capsys.readouterr().err


def test_the_port_file_of_flotilla_up_names_the_router(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FLOTILLA_ROUTER_ADDRESS", raising=False)
    (tmp_path / "ports").mkdir()
    port = closed_port()
    (tmp_path / "ports" / "router.port").write_text(str(port))
    assert main(["models", "--state-dir", str(tmp_path), "--insecure-internal", "--timeout-s", "1", "rollback", "tiny"]) == 1
    assert "flotilla models rollback: UNAVAILABLE" in capsys.readouterr().err


def test_alias_needs_a_target_or_delete(capsys):
    assert main(["models", "--router", "127.0.0.1:1", "alias", "chat"]) == 2
    assert "TARGET or --delete" in capsys.readouterr().err
