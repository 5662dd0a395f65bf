"""Moving a request's state from prefill to decode: attention KV blocks and DeltaNet state.

Nothing here runs a model. vLLM's NixlConnector does the moving (handshake, READ of the
blocks, lease on the producer, load-failure policy); this package configures it per role
and device, describes what moves (`StateLayout`, `TransferHandle`) and accounts for it.
"""
