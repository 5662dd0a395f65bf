"""gRPC API definitions; Python code is generated from the `.proto` by `python -m proto.build`."""
