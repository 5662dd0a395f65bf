"""Router: request validation, actor selection, orchestration, the gRPC server and the CLI."""
