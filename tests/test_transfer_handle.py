"""Transfer handle and byte accounting, without engines."""

import time

import pytest

from kv_transfer.layout import CacheGroup, GroupKind, StateLayout
from messages.errors import HandleExpiredError
from messages.transfer import TransferBytes, TransferHandle

PARAMS = {
    "do_remote_prefill": True,
    "remote_block_ids": ([1], [2], [3], [4, 5, 6]),
    "remote_engine_id": "prefill-p0-127.0.0.2-5601",
    "remote_request_id": "r0-abc",
    "remote_host": "127.0.0.2",
    "remote_port": 5601,
    "remote_num_tokens": 700,
}

LAYOUT = StateLayout(
    groups=(
        CacheGroup(GroupKind.DELTANET, 2, 68608, 0),
        CacheGroup(GroupKind.DELTANET, 2, 68608, 0),
        CacheGroup(GroupKind.DELTANET, 2, 68608, 0),
        CacheGroup(GroupKind.ATTENTION, 2, 256 * 1024, 256),
    ),
    num_blocks=100,
)


def test_bytes_follow_block_ids():
    moved = LAYOUT.bytes_for(PARAMS["remote_block_ids"])
    assert moved == TransferBytes(attention_kv=3 * 2 * 256 * 1024, deltanet_state=6 * 68608)
    assert LAYOUT.attention_kv_bytes_per_token == 2 * 1024
    assert LAYOUT.deltanet_state_bytes_per_request == 6 * 68608
    with pytest.raises(ValueError, match="4 KV-cache groups"):
        LAYOUT.bytes_for(([1], [2]))


def test_handle_round_trips_and_keeps_connector_params():
    handle = TransferHandle.from_connector_params(
        PARAMS, lease_s=30, transfer_bytes=LAYOUT.bytes_for(PARAMS["remote_block_ids"])
    )
    again = TransferHandle.from_dict(handle.to_dict())
    assert again == handle
    assert again.connector_params == PARAMS
    assert again.block_ids == ((1,), (2,), (3,), (4, 5, 6))
    assert 29 < again.seconds_left() <= 30


def test_expired_or_nearly_expired_handle_is_refused():
    handle = TransferHandle.from_connector_params(PARAMS, lease_s=0.5, transfer_bytes=TransferBytes(0, 0))
    with pytest.raises(HandleExpiredError, match="expires"):
        handle.check_usable(margin_s=1.0)
    time.sleep(0.6)
    with pytest.raises(HandleExpiredError, match="expired"):
        handle.check_usable(margin_s=0.0)


def test_a_sliding_window_group_counts_only_its_window_per_request():
    """Capacity per max-length request: 1 state slot per DeltaNet group, every block of a
    full-attention group, and a sliding-window group's window (vLLM's own bound, kept in the
    layout) rather than the whole length."""
    sliding = StateLayout(
        groups=(CacheGroup(GroupKind.ATTENTION, 2, 1024, 128), CacheGroup(GroupKind.ATTENTION, 4, 1024, 128, 3)),
        num_blocks=701,
    )
    capacity = sliding.capacity(max_model_len=8192, max_num_seqs=64, prefix_caching=True)
    assert capacity.blocks_per_max_length_request == 64 + 3
    assert capacity.max_concurrent_max_length_requests == 700 // 67
    assert LAYOUT.capacity(1000, 8, False).blocks_per_max_length_request == 3 + 4
    assert StateLayout.from_dict(sliding.to_dict()) == sliding
