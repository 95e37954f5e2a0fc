"""NIXL/UCX settings as chart values: kvTransfer.ucx reaches both disaggregated pools' worker containers (as the
operator builds them) as UCX_NET_DEVICES / UCX_TLS, never a colocated pool's, and Flotilla's one-machine default
(`lo`) never applies in a cluster. test_chart_processes.py runs the disaggregated example's workers with these
variables set to TCP on loopback and checks KV moved; a transport this machine lacks (rc) stops the worker."""

from __future__ import annotations

from tests.chart.rendering import needs_helm, render, rendered_case, worker_deployments

pytestmark = needs_helm


def ucx_env(docs) -> dict[str, dict[str, str]]:
    """pool role label -> the worker container's UCX_* variables."""
    found = {}
    for deployment in worker_deployments(docs):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        role = deployment["metadata"]["labels"]["flotilla.dev/role"]
        found[role] = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("UCX_")}
    return found


def test_rdma_example_passes_devices_and_transports_to_both_pools():
    env = {"UCX_NET_DEVICES": "mlx5_0:1", "UCX_TLS": "rc,cuda_copy,cuda_ipc"}
    assert ucx_env(rendered_case("disaggregated-gpu")) == {"prefill": env, "decode": env}


def test_tcp_cluster_and_the_default_of_every_device():
    tcp = rendered_case("disaggregated-gpu", "--set", "kvTransfer.ucx.netDevices=eth0",
                        "--set", "kvTransfer.ucx.transports=tcp\\,cuda_copy")
    assert ucx_env(tcp)["decode"] == {"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp,cuda_copy"}
    default = rendered_case("default", "--set", "prefill.enabled=true")
    assert ucx_env(default) == {"prefill": {"UCX_NET_DEVICES": "all"}, "decode": {"UCX_NET_DEVICES": "all"}}


def test_colocated_pools_get_no_ucx_settings_and_bad_values_are_refused():
    assert ucx_env(rendered_case("default")) == {"both": {}}
    for bad in ("kvTransfer.ucx.netDevices=mlx5_0:1;rm", "kvTransfer.ucx.transports=RC SELF"):
        result = render(None, "--set", bad)
        assert result.returncode != 0 and "schema" in result.stderr, bad
