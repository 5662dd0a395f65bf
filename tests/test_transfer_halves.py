"""The producer and consumer halves of the transfer policy, on fake engine outputs (no engines:
tests/test_disaggregated.py runs them end to end)."""

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY
from test_transfer_handle import LAYOUT, PARAMS

from kv_transfer.connector import Connector
from kv_transfer.connector_config import Role, SideChannel, TransferConfig
from kv_transfer.consumer import TransferConsumer, check_loaded
from kv_transfer.producer import TransferProducer
from messages.errors import HandleExpiredError, InvalidRequestError, PrefillFailedError, TransferFailedError
from messages.requests import GenerateRequest, SamplingConfig
from messages.transfer import TransferBytes, TransferHandle

TRANSFER = TransferConfig(lease_s=30, handle_margin_s=1.0, transfer_timeout_s=0.2)
PROMPT = tuple(range(700))


def request(prompt=PROMPT, **sampling) -> GenerateRequest:
    return GenerateRequest("r0", prompt, SamplingConfig(**sampling))


def output(finish_reason="length", kv_transfer_params=None):
    """What the halves read of a vLLM RequestOutput."""
    completion = SimpleNamespace(finish_reason=finish_reason)
    return SimpleNamespace(kv_transfer_params=kv_transfer_params, outputs=[completion])


def handle(lease_s=30.0, num_tokens=700) -> TransferHandle:
    params = {**PARAMS, "remote_num_tokens": num_tokens}
    return TransferHandle.from_connector_params(params, lease_s=lease_s, transfer_bytes=TransferBytes(4096, 512))


def sample(name, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_hybrid_prefill_samples_the_first_token_with_the_requests_settings():
    leg = TransferProducer(TRANSFER, prefill_backoff=1).leg(request(temperature=0.7))
    assert leg.samples_first
    assert leg.overrides == {
        "max_tokens": 1,
        "extra_args": {"kv_transfer_params": {"do_remote_decode": True, "_p_side_truncated": True}},
    }


@pytest.mark.parametrize("backoff, stop", [(1, ("\n\n",)), (0, ())])
def test_stop_strings_or_an_attention_model_keep_the_connectors_split(backoff, stop):
    leg = TransferProducer(TRANSFER, prefill_backoff=backoff).leg(request(stop=stop, temperature=0.7, logprobs=2))
    assert not leg.samples_first
    assert leg.overrides["extra_args"] == {"kv_transfer_params": {"do_remote_decode": True}}
    assert leg.overrides["temperature"] == 0.0 and leg.overrides["ignore_eos"]
    assert leg.overrides["stop"] == [] and leg.overrides["stop_token_ids"] == [] and leg.overrides["logprobs"] is None


def test_a_leg_without_held_blocks_failed():
    producer = TransferProducer(TRANSFER, prefill_backoff=1)
    with pytest.raises(PrefillFailedError, match=r"r0 produced no transfer handle \(no output\)"):
        producer.held_params("r0", None)
    with pytest.raises(PrefillFailedError, match=r"\(abort\)"):
        producer.held_params("r0", output("abort"))
    assert producer.held_params("r0", output("stop", PARAMS)) == PARAMS


def test_a_grant_is_a_counted_lease_with_every_byte_it_moves():
    granted = sample("pdserve_leases_granted_total")
    granted_handle = TransferProducer(TRANSFER, prefill_backoff=1).grant(PARAMS, LAYOUT)
    assert granted_handle.bytes == LAYOUT.bytes_for(PARAMS["remote_block_ids"])
    assert granted_handle.connector_params == PARAMS
    assert 29 < granted_handle.seconds_left() <= 30
    assert sample("pdserve_leases_granted_total") == granted + 1


@pytest.mark.parametrize(
    "max_tokens, finish_reason, expected", [(64, "length", None), (64, "stop", "stop"), (1, "length", "length")]
)
def test_the_first_token_finishes_the_request_only_where_it_ends_it(max_tokens, finish_reason, expected):
    assert TransferProducer.first_finish_reason(request(max_tokens=max_tokens), finish_reason) == expected


def test_a_handle_that_fits_becomes_the_engines_pull_args():
    consumer = TransferConsumer(TRANSFER, prefill_backoff=1)
    fitting = handle(num_tokens=699)
    assert consumer.pull_args(request(), fitting) == {"kv_transfer_params": fitting.connector_params}


def test_a_handle_for_another_prompt_length_is_refused():
    consumer = TransferConsumer(TRANSFER, prefill_backoff=1)
    with pytest.raises(InvalidRequestError, match="has 700 tokens but the handle holds the state of 700"):
        consumer.pull_args(request(), handle(num_tokens=700))


def test_a_handle_about_to_expire_is_refused():
    with pytest.raises(HandleExpiredError):
        TransferConsumer(TRANSFER, prefill_backoff=0).pull_args(request(), handle(lease_s=0.5))


async def outputs(*items, first_after_s=0.0):
    await asyncio.sleep(first_after_s)
    for item in items:
        yield item


def collect(stream) -> list:
    async def run():
        return [item async for item in stream]

    return asyncio.run(run())


def test_a_pull_counts_its_bytes_and_passes_every_output_through():
    before = sample("pdserve_transfer_state_bytes_total", kind="attention_kv")
    before_state = sample("pdserve_transfer_state_bytes_total", kind="deltanet_state")
    first, second = output(None), output("length")
    pulled = TransferConsumer(TRANSFER, prefill_backoff=0).pulled(handle(), outputs(first, second))
    assert collect(pulled) == [first, second]
    assert sample("pdserve_transfer_state_bytes_total", kind="attention_kv") == before + 4096
    assert sample("pdserve_transfer_state_bytes_total", kind="deltanet_state") == before_state + 512


def test_a_pull_whose_first_output_is_late_fails_and_counts_nothing():
    before = sample("pdserve_transfer_state_bytes_total", kind="attention_kv")
    pulled = TransferConsumer(TRANSFER, prefill_backoff=0).pulled(handle(), outputs(output(), first_after_s=5))
    with pytest.raises(TransferFailedError, match="no KV blocks / DeltaNet state from prefill-p0-127.0.0.2-5601"):
        collect(pulled)
    assert sample("pdserve_transfer_state_bytes_total", kind="attention_kv") == before


def test_an_error_finish_is_a_failed_load():
    check_loaded("r0", "length", handle())
    with pytest.raises(TransferFailedError, match="from prefill-p0-127.0.0.2-5601"):
        check_loaded("r0", "error", handle())
    with pytest.raises(TransferFailedError, match="from its producer"):
        check_loaded("r0", "error", None)


@pytest.mark.parametrize(
    "role, produces, consumes",
    [(Role.PREFILL, True, False), (Role.DECODE, False, True), (Role.EITHER, True, True)],
)
def test_each_role_builds_the_halves_it_runs(role, produces, consumes):
    connector = Connector(role, "e0", TRANSFER, SideChannel("127.0.0.1", 5601))
    producer, consumer = connector.halves(prefill_backoff=1)
    assert isinstance(producer, TransferProducer) is produces and (producer is None) is not produces
    assert isinstance(consumer, TransferConsumer) is consumes and (consumer is None) is not consumes


def test_a_connector_names_its_engine_and_sets_its_processes_up():
    with Connector.for_worker(Role.EITHER, "engine-0", TRANSFER, "127.0.0.1") as connector:
        port = connector.channel.port
        assert connector.engine_id == f"either-engine-0-127.0.0.1-{port}"
        env = connector.process_env()
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(port)
        assert env.items() >= TRANSFER.process_env().items()
        config = connector.kv_transfer_config()
        assert (config.kv_role, config.engine_id) == ("kv_both", connector.engine_id)


def test_the_side_channel_port_is_held_for_the_engines_listener_alone():
    """While a worker's engine starts, its side-channel port goes to no other socket of the
    host, neither one binding it nor one asking for any free port, and vLLM's handshake
    listener (a ZMQ ROUTER, as NixlConnector makes it) binds it and answers there."""
    import errno
    import socket

    import zmq
    from vllm.utils.network_utils import make_zmq_socket

    with Connector.for_worker(Role.PREFILL, "p0", TRANSFER, "127.0.0.1") as connector:
        port = connector.channel.port
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        free = []
        for _ in range(500):  # the kernel's free ports, each kept so the next is another
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            free.append(sock)
        assert port not in {sock.getsockname()[1] for sock in free}
        for sock in free:
            sock.close()
        context = zmq.Context()
        listener = make_zmq_socket(context, f"tcp://127.0.0.1:{port}", zmq.ROUTER, bind=True)
    client = context.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    client.send(b"handshake")
    assert listener.poll(5000) and listener.recv_multipart()[-1] == b"handshake"
    context.destroy(linger=0)


def test_a_producer_worker_without_a_transfer_is_refused_before_its_engine_starts():
    from prefill_worker.worker import PrefillWorker
    from vllm_engine.config import EngineConfig

    with pytest.raises(ValueError, match="prefill worker needs a TransferConfig"):
        PrefillWorker("p0", EngineConfig(), None)
