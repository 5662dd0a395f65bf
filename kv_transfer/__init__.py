"""Moving a request's state from prefill to decode: attention KV blocks and DeltaNet state.

Nothing here runs a model. vLLM's NixlConnector does the moving (handshake, READ of the
blocks, lease on the producer, load-failure policy); this package configures it per role
and device, describes what moves (`StateLayout`, `TransferHandle`), accounts for it, and
holds the transfer policy as two halves, built once per engine from its `Role` by
`Connector.halves` (kv_transfer.connector); the workers only run the engine and call them.

    Producer half (`TransferProducer`, kv_transfer.producer): runs in engines that prefill
    for remote decode (PREFILL, EITHER).
        leg() - the sampling settings a prefill leg gets, and whether the token it
            samples is the request's first output.
        held_params() - the connector params of the blocks held for decode after the
            leg's last output, or why there are none.
        grant() - those params as a leased `TransferHandle`, with its bytes (counted).
        first_finish_reason() - the sampled first token's finish reason.

    Consumer half (`TransferConsumer`, kv_transfer.consumer): runs in engines that decode
    pulled state (DECODE, EITHER).
        pull_args() - refuses a handle about to expire or not fitting the prompt, else
            what the engine is given to pull its state.
        pulled() - the engine's outputs, failing a pull whose first output is late and
            counting the bytes pulled.
        check_loaded() - an "error" finish reason is a failed load.
"""
