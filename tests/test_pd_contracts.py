"""The KV handoff's three contracts without a model: metadata, payload encoding, readiness."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.kv_transfer import (
    KVLayout,
    KVPayload,
    TransferError,
    TransferMeta,
    check_ready,
)

LAYOUT = KVLayout(num_layers=2, page_size=4, num_kv_heads=3, head_dim=8, dtype="float32")


def _payload(num_pages: int = 2, layout: KVLayout = LAYOUT) -> KVPayload:
    rng = np.random.default_rng(0)
    meta = TransferMeta("t1", "req-1", tuple(range(num_pages * layout.page_size)), tuple(range(5, 5 + num_pages)),
                        layout, "m", "http://127.0.0.1:1", None, 9, 42, 123.0)
    k = rng.standard_normal(layout.page_shape(num_pages)).astype(np.float32)  # [L, pages, page_size, Hkv, D]
    v = rng.standard_normal(layout.page_shape(num_pages)).astype(np.float32)
    return KVPayload.build(meta, k, v)


def test_payload_round_trips_with_metadata_and_checksum():
    p = _payload()
    q = KVPayload.decode(p.encode())
    assert q.meta == p.meta and q.checksum == p.checksum
    np.testing.assert_array_equal(q.k, p.k)
    np.testing.assert_array_equal(q.v, p.v)
    assert check_ready(q.meta, q, LAYOUT).ok
    assert TransferMeta.from_json(p.meta.to_json()) == p.meta


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_narrow_kv_payloads_round_trip(dtype):
    """A `--kv-cache-dtype fp8` pool hands its pages over as they are: one byte an element on the wire."""
    import ml_dtypes

    layout = KVLayout(2, 4, 3, 8, dtype)
    base = _payload(layout=layout)
    narrow = np.dtype(getattr(ml_dtypes, dtype))
    p = KVPayload.build(base.meta, base.k.astype(narrow), base.v.astype(narrow))
    data = p.encode()
    assert len(data) - 2 * p.k.size * narrow.itemsize < 1024  # the header and the pages, nothing widened
    q = KVPayload.decode(data)
    assert q.k.dtype == narrow and q.checksum == p.checksum
    np.testing.assert_array_equal(q.k.astype(np.float32), p.k.astype(np.float32))
    np.testing.assert_array_equal(q.v.astype(np.float32), p.v.astype(np.float32))
    assert check_ready(q.meta, q, layout).ok
    assert "layout" in check_ready(q.meta, q, LAYOUT).reason  # a float32 pool refuses float8 pages


def test_pages_stored_with_other_float8_scales_are_refused():
    """Float8 pages hold K / k_scale: a receiver whose scales differ would read them wrongly, so it refuses."""
    import ml_dtypes

    layout = KVLayout(2, 4, 3, 8, "float8_e4m3fn", scales="0123abcd0123abcd")
    base = _payload(layout=layout)
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    q = KVPayload.decode(KVPayload.build(base.meta, base.k.astype(fp8), base.v.astype(fp8)).encode())
    assert q.meta.layout.scales == "0123abcd0123abcd" and check_ready(q.meta, q, layout).ok
    for other in ("", "ffff000011112222"):
        reason = check_ready(q.meta, q, KVLayout(2, 4, 3, 8, "float8_e4m3fn", scales=other)).reason
        assert "layout" in reason and "scales=" in reason


@pytest.mark.parametrize("cut", [3, 20, -1, -500])
def test_a_cut_transfer_is_refused(cut):
    data = _payload().encode()
    with pytest.raises(TransferError):
        KVPayload.decode(data[:cut])


def test_readiness_catches_corruption_layout_and_missing_pages():
    p = _payload()
    data = bytearray(p.encode())
    data[-1] ^= 0xFF  # one flipped bit in the last value
    corrupt = KVPayload.decode(bytes(data))
    assert check_ready(corrupt.meta, corrupt, LAYOUT).reason == "checksum mismatch"
    other = KVLayout(2, 4, 3, 8, "bfloat16")
    assert "layout" in check_ready(p.meta, p, other).reason
    short = KVPayload.build(p.meta, p.k[:, :1], p.v[:, :1])  # one page of the two announced
    assert "shape" in check_ready(p.meta, short, LAYOUT).reason
    foreign = _payload()
    wrong = TransferMeta(**{**foreign.meta.__dict__, "transfer_id": "t2"})
    assert "transfer" in check_ready(wrong, foreign, LAYOUT).reason


def test_malformed_metadata_is_a_transfer_error():
    with pytest.raises(TransferError):
        TransferMeta.from_json({"transfer_id": "x"})


def test_an_unreachable_sender_is_a_transfer_error():
    import asyncio

    from server.pd import HttpKVTransport

    with pytest.raises(TransferError):
        asyncio.run(HttpKVTransport().fetch("http://127.0.0.1:9/v1/pd/kv/x", 1.0))
