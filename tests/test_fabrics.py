"""The networks NIXL moves state over (kv_transfer/fabrics.py), checked offline: each names
backends the installed NIXL ships, and sets the environment its documentation gives."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kv_transfer.connector_config import Role, TransferConfig
from kv_transfer.fabrics import FABRICS


def test_every_fabric_names_backends_the_installed_nixl_ships():
    # In a process of its own: no NIXL agent outlives this test in the test process.
    listing = (
        "from nixl._api import nixl_agent, nixl_agent_config as c; "
        "print(*nixl_agent('x', c(backends=[])).get_plugin_list())"
    )
    run = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, timeout=60, check=True)
    plugins = set(run.stdout.split())
    assert "UCX" in plugins, run.stdout
    for fabric in FABRICS.values():
        assert set(fabric.backends) <= plugins, (fabric.name, plugins)


def test_a_fabric_sets_its_backends_and_environment_and_flags_override_them():
    efa = TransferConfig(fabric="efa")
    assert efa.kv_transfer_config(Role.PREFILL, "p").kv_connector_extra_config["backends"] == ["LIBFABRIC"]
    assert efa.process_env()["FI_PROVIDER"] == "efa" and efa.process_env()["FI_EFA_USE_DEVICE_RDMA"] == "1"
    roce = TransferConfig(fabric="roce", ucx_net_devices="mlx5_0:1")
    assert roce.process_env()["UCX_NET_DEVICES"] == "mlx5_0:1" and roce.process_env()["UCX_IB_GID_INDEX"] == "3"
    assert TransferConfig(fabric="tcp").process_env()["UCX_TLS"] == "tcp"
    assert TransferConfig(fabric="infiniband", ucx_transports="rc").process_env()["UCX_TLS"] == "rc"
    assert TransferConfig(backends=("UCX", "POSIX")).nixl_backends == ("UCX", "POSIX")
    assert "UCX_TLS" not in TransferConfig().process_env()  # auto: UCX chooses


def test_gpu_engines_on_tcp_get_a_warning_that_names_the_fix():
    assert "--fabric efa" in TransferConfig(fabric="tcp").fabric_warning("cuda")
    assert TransferConfig(ucx_transports="tcp").fabric_warning("cuda") is not None
    assert TransferConfig(fabric="tcp").fabric_warning("cpu") is None
    assert TransferConfig(fabric="infiniband").fabric_warning("cuda") is None


def test_an_unknown_fabric_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="infiniband"):
        TransferConfig(fabric="myrinet")  # type: ignore[arg-type]
