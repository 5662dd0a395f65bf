"""Generate Python gRPC code from the `.proto` files under this folder.

A build step (run by deploy/install.sh), never edited by hand: the generated modules are
git-ignored, and a test regenerates them and fails if they disagree with the `.proto`.
"""

from __future__ import annotations

from pathlib import Path

PROTO_ROOT = Path(__file__).parent
REPO_ROOT = PROTO_ROOT.parent


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def build(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Write `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` beside each `.proto` (under out_dir)."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    sources = [str(p.relative_to(REPO_ROOT)) for p in proto_files()]
    if not sources:
        return []
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {sources}")
    return [out_dir / s for s in sources]


if __name__ == "__main__":
    for path in build():
        print(f"generated gRPC code for {path.relative_to(REPO_ROOT)}")
