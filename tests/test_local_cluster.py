"""The private local cluster: only a holder of its token gets in, a node that misses Ray's
fixed 30-s registration wait (a machine busy with other engines) is started again, and the
temp dirs of stopped clusters do not pile up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import RAY_TOKEN_FILE, RAY_TOKEN_FILE_BEFORE

from cluster.ray_cluster import KEPT_STOPPED_TEMP_DIRS, TEMP_DIR_GRACE_S, TEMP_PREFIX, remove_stopped_temp_dirs

# The child: the raylet's registration lookup fails for the first node only, and Ray's wait
# clock jumps past its 30 s there, so Ray raises its own startup timeout at once. The second
# node starts unpatched.
CHILD = textwrap.dedent(
    """
    import json, time
    import psutil, ray
    import ray._private.node as node
    import ray._private.services as services
    from cluster import ray_cluster

    first = {"failing": True, "temp_dir": None}
    real_get_node, real_mkdtemp, real_stop = (
        services.get_node, ray_cluster.tempfile.mkdtemp, ray_cluster.stop_processes_of)

    def get_node(*args, **kwargs):
        if first["failing"]:
            raise RuntimeError("not registered (this test)")
        return real_get_node(*args, **kwargs)

    def mkdtemp(*args, **kwargs):
        path = real_mkdtemp(*args, **kwargs)
        first["temp_dir"] = first["temp_dir"] or path
        return path

    def stop(temp_dir):
        stopped = real_stop(temp_dir)
        first["failing"] = False
        return stopped

    class Clock:
        # node.py's `time`: while the first node fails, every reading after the first is
        # 100 s late, so Ray's wait (elapsed since its start > 30 s) gives up at once.
        read = False
        def __getattr__(self, name):
            return getattr(time, name)
        def monotonic(self):
            late = 100.0 if first["failing"] and self.read else 0.0
            self.read = True
            return time.monotonic() + late

    services.get_node, node.time = get_node, Clock()
    ray_cluster.tempfile.mkdtemp, ray_cluster.stop_processes_of = mkdtemp, stop

    second = ray_cluster.start_local()
    left = [p.pid for p in psutil.Process().children(recursive=True)
            if any(first["temp_dir"] in part for part in p.cmdline())]

    @ray.remote
    def square(x):
        return x * x

    print(json.dumps({"first": first["temp_dir"], "second": second, "left": left,
                      "task": ray.get(square.remote(7), timeout=120)}))
    ray.shutdown()
    """
)


@pytest.mark.engines
def test_a_node_that_misses_rays_startup_wait_is_started_again():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "did not register in time" in done.stderr and "timed out during startup" in done.stderr
    assert result["first"] != result["second"]  # a fresh node, in a temp dir of its own
    assert result["left"] == []  # the half-started node's GCS, raylet and helpers are gone
    assert result["task"] == 49


def test_only_a_holder_of_the_clusters_token_is_answered(ray_cluster):
    """Ray's GCS and raylet listen on every interface (Ray 2.60 binds them so whatever the
    node address): a call without the session cluster's token, or with another, is refused;
    with it, answered. No token file is written (a user's own stays as it was)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc

    token = os.environ["RAY_AUTH_TOKEN"]
    (node,) = ray_cluster.nodes()

    def cluster_id(channel: grpc.Channel, **kwargs: object) -> object:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        return stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), **kwargs)

    def resource_load(channel: grpc.Channel, **kwargs: object) -> object:
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        return stub.GetResourceLoad(node_manager_pb2.GetResourceLoadRequest(), **kwargs)

    services = {
        ray_cluster.get_runtime_context().gcs_address: cluster_id,
        f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}": resource_load,
    }
    for address, call in services.items():
        with grpc.insecure_channel(address) as channel:
            for stranger in ((), (("authorization", "Bearer " + "0" * 64),)):
                with pytest.raises(grpc.RpcError) as refused:
                    call(channel, metadata=stranger, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (address, refused.value)
            assert call(channel, metadata=(("authorization", f"Bearer {token}"),), timeout=10) is not None
    assert len(token) == 64
    assert (RAY_TOKEN_FILE.read_bytes() if RAY_TOKEN_FILE.is_file() else None) == RAY_TOKEN_FILE_BEFORE


def test_a_start_removes_stopped_clusters_temp_dirs_beyond_the_newest_few(tmp_path: Path):
    """Stopped, old enough and beyond the newest KEPT_STOPPED_TEMP_DIRS: removed. A dir a
    running process names (its cluster is up), a young one (its cluster may be starting) and
    anything not a cluster's dir stay."""
    old = time.time() - TEMP_DIR_GRACE_S - 60

    def temp_dir(name: str, age_s: float) -> Path:
        path = tmp_path / f"{TEMP_PREFIX}{name}"
        (path / "session_latest" / "logs").mkdir(parents=True)
        (path / "session_latest" / "logs" / "raylet.out").write_text("log")
        os.utime(path, (old - age_s, old - age_s))
        return path

    stopped = [temp_dir(f"stopped{i:02d}", age_s=i) for i in range(KEPT_STOPPED_TEMP_DIRS + 4)]
    running, young = temp_dir("running", age_s=100), tmp_path / f"{TEMP_PREFIX}young"
    young.mkdir()
    stranger = tmp_path / "ray"
    stranger.mkdir()
    os.utime(stranger, (old - 100, old - 100))
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--temp-dir={running}"])
    try:
        removed = remove_stopped_temp_dirs(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(removed) == sorted(stopped[KEPT_STOPPED_TEMP_DIRS:])
    assert [p for p in stopped if p.exists()] == stopped[:KEPT_STOPPED_TEMP_DIRS]
    assert running.exists() and young.exists() and stranger.exists()
