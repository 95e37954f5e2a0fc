"""The chart's Redis: pinned at >= 7.4.6, AUTH from a Secret, noeviction, append-only persistence, or an
external URL from a Secret. The rendered StatefulSet's own command and ConfigMap run here against Debian's
redis-server (paths mapped to temporary directories), and the gateway's rendered --redis-url, expanded as the
kubelet expands $(VAR), reaches it with the password."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import redis

from tests.chart.rendering import CASES, needs_helm, render, rendered_case
from tests.support.redis_server import free_port
from tests.support.waiting import wait_until

pytestmark = needs_helm
ENABLED = ("--set", "redis.enabled=true", "--set", "redis.auth.existingSecret=redis-auth")


def kind(docs, kind_name: str, suffix: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind_name and d["metadata"]["name"].endswith(suffix)]
    return found


def kubelet_expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def gateway_container(docs) -> dict:
    return kind(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]


def test_default_image_is_at_least_7_4_6_and_older_tags_are_refused():
    docs = rendered_case("default", *ENABLED)
    image = kind(docs, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "docker.io/library/redis:7.4.6"
    for tag in ("7.4.1", "7.4.5", "7.2.4", "6.2.16"):
        result = render(None, *ENABLED, "--set", f"redis.image.tag={tag}")
        assert result.returncode != 0 and "schema" in result.stderr, tag
    for tag in ("7.4.6", "7.4.10", "8.0.2", "8.2.1-alpine"):
        assert render(None, *ENABLED, "--set", f"redis.image.tag={tag}").returncode == 0, tag


def test_enabled_without_a_password_secret_is_refused():
    result = render(None, "--set", "redis.enabled=true")
    assert result.returncode != 0 and "redis.auth.existingSecret" in result.stderr


def test_credentials_in_a_plain_url_are_refused_and_a_url_secret_is_used():
    result = render(None, "--set", "redis.url=redis://:hunter2@redis.example:6379/0")
    assert result.returncode != 0 and "schema" in result.stderr
    docs = rendered_case("default", "--set", "redis.urlSecret=managed-redis")
    gateway = gateway_container(docs)
    assert "--redis-url=$(FLOTILLA_REDIS_URL)" in gateway["args"]
    assert {"name": "FLOTILLA_REDIS_URL",
            "valueFrom": {"secretKeyRef": {"name": "managed-redis", "key": "url"}}} in gateway["env"]
    assert not any(a.startswith("--keys-file") for a in gateway["args"])


def test_persistence_is_a_claim_and_can_be_turned_off():
    on = kind(rendered_case("default", *ENABLED), "StatefulSet", "-redis")["spec"]
    assert on["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    off = kind(rendered_case("default", *ENABLED, "--set", "redis.persistence.enabled=false"), "StatefulSet",
               "-redis")["spec"]
    assert "volumeClaimTemplates" not in off
    assert {"name": "data", "emptyDir": {}} in off["template"]["spec"]["volumes"]


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server not installed: `make redis-server`")
def test_rendered_redis_runs_with_auth_noeviction_and_append_only(tmp_path):
    assert CASES["disaggregated-gpu"] is not None
    docs = rendered_case("disaggregated-gpu")
    config = kind(docs, "ConfigMap", "-redis")["data"]["redis.conf"]
    container = kind(docs, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"][0]
    port, password = free_port(), "0123456789abcdef"
    paths = {"/etc/redis": tmp_path / "etc", "/data": tmp_path / "data", "/tmp": tmp_path / "tmp"}
    for folder in paths.values():
        folder.mkdir()

    def local(text: str) -> str:  # one pass: the temporary folders themselves live under /tmp
        text = re.sub(r"(?<![\w/])(/etc/redis|/data|/tmp)(?=[/\s]|$)", lambda m: str(paths[m.group(1)]), text)
        return text.replace("port 6379", f"port {port}\nbind 127.0.0.1")

    (paths["/etc/redis"] / "redis.conf").write_text(local(config))
    env = {"PATH": "/usr/bin:/bin", "REDIS_PASSWORD": password}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = kubelet_expand(var["value"], env)
    server = subprocess.Popen([*container["command"], *map(local, container["args"])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = kubelet_expand(next(a for a in gateway_container(docs)["args"] if a.startswith("--redis-url=")),
                             {"REDIS_PASSWORD": password}).removeprefix("--redis-url=")
        url = url.replace("flotilla-redis:6379", f"127.0.0.1:{port}")
        client = redis.Redis.from_url(url, socket_timeout=2)

        def answers() -> bool:
            if server.poll() is not None:
                raise AssertionError(f"redis exited {server.returncode}: {server.stdout.read().decode()}")
            return client.ping()

        wait_until(answers, 20, "redis to answer", interval_s=0.05, ignore=(redis.exceptions.ConnectionError,))
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port).ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory") == {"maxmemory": str(400 * 1024 * 1024)}
        probe = container["readinessProbe"]["exec"]["command"]
        probe = [*probe[:2], probe[2].replace("-h 127.0.0.1", f"-h 127.0.0.1 -p {port}")]
        assert subprocess.run(probe, env=env, timeout=10).returncode == 0
        assert subprocess.run(probe, env={**env, "REDISCLI_AUTH": "wrong"}, timeout=10).returncode != 0
        assert "requirepass" not in " ".join(container["args"]) or "$REDIS_PASSWORD" in container["args"][0]
    finally:
        server.terminate()
        server.wait(10)
