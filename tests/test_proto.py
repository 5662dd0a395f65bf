"""The generated gRPC code matches the `.proto` (it is produced by the build, never edited)."""

import filecmp

from proto.build import PROTO_ROOT, build, proto_files


def test_generated_code_matches_proto(tmp_path):
    generated = build(tmp_path)
    assert generated, "no .proto files found"
    for proto in proto_files():
        relative = proto.relative_to(PROTO_ROOT.parent)
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            fresh = tmp_path / relative.with_name(proto.stem + suffix)
            in_tree = proto.with_name(proto.stem + suffix)
            assert in_tree.exists(), f"{in_tree} missing: run `python -m proto.build`"
            assert filecmp.cmp(fresh, in_tree, shallow=False), f"{in_tree} is stale: run `python -m proto.build`"


def test_service_is_versioned():
    from proto.pdserve.v1 import generate_pb2

    assert generate_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert "Generation" in generate_pb2.DESCRIPTOR.services_by_name
