"""The networks NIXL moves KV and state over, one record each: which NIXL backends, and
what environment NIXL, UCX or libfabric read in every engine process.

Settings follow NIXL's, UCX's and AWS's own documentation; only "auto" and "tcp" have run here
(CPU engines, across network namespaces: tests/test_multi_host.py). The RDMA ones are
configured and checked offline (the backends are plugins of the installed NIXL), never run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True, slots=True)
class Fabric:
    name: str
    backends: tuple[str, ...]  # NIXL backends, in order of preference
    env: Mapping[str, str] = field(default_factory=dict)


# UCX's RC verbs transport with GPUDirect RDMA (InfiniBand and RoCE); cuda_copy/cuda_ipc for
# GPU memory on the node.
UCX_VERBS = {"UCX_TLS": "rc,cuda_copy,cuda_ipc", "UCX_IB_GPU_DIRECT_RDMA": "yes"}

FABRICS: dict[str, Fabric] = {
    f.name: f
    for f in (
        # UCX picks: shared memory or cma on one host; between hosts RDMA where it finds a
        # device, else TCP.
        Fabric("auto", ("UCX",)),
        Fabric("tcp", ("UCX",), {"UCX_TLS": "tcp"}),
        # AWS p4d/p5: EFA's SRD through NIXL's libfabric backend; FI_EFA_USE_DEVICE_RDMA turns
        # on GPUDirect RDMA; the nodes need the EFA interfaces and a cluster placement group
        # (deploy/aws-h100.yaml).
        Fabric(
            "efa",
            ("LIBFABRIC",),
            {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_HMEM_CUDA_USE_GDRCOPY": "1"},
        ),
        # Name the HCAs with --ucx-net-devices (e.g. mlx5_0:1,mlx5_1:1).
        Fabric("infiniband", ("UCX",), UCX_VERBS),
        # RoCE v2 needs the GID of the RoCE v2 address: index 3 on a default Mellanox setup
        # (`show_gids` lists them); a lossless (PFC/ECN) fabric is the network's job.
        Fabric("roce", ("UCX",), {**UCX_VERBS, "UCX_IB_GID_INDEX": "3"}),
    )
}
