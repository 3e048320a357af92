"""The libucp ctypes binding: struct layouts pinned to the UCX 1.22 headers, and the backend's
own checks (payloads, options, missing wheel). Cross-process writes live in tests/conformance.
"""

from __future__ import annotations

import ctypes

import msgpack
import pytest
import torch

from tests.markers import requires_module
from weight_transfer.backends.base import (
    RegionRole,
    TransportConfig,
    TransportUnavailableError,
    WriteOp,
)
from weight_transfer.backends.ucx_native import _libucp as L

# sizeof / offsetof as gcc reports them for libucx-cu13 1.22.0's headers on x86_64
# (include/ucp/api/ucp.h, ucp_def.h). A drift here means the binding corrupts memory.
LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "ucp_params_t": (
        88,
        {
            "features": 8,
            "request_size": 16,
            "mt_workers_shared": 48,
            "estimated_num_eps": 56,
            "name": 72,
            "node_local_id": 80,
        },
    ),
    "ucp_worker_params_t": (
        200,
        {
            "thread_mode": 8,
            "cpu_mask": 16,
            "events": 144,
            "user_data": 152,
            "event_fd": 160,
            "flags": 168,
            "name": 176,
            "am_alignment": 184,
            "client_id": 192,
        },
    ),
    "ucp_ep_params_t": (
        104,
        {
            "address": 8,
            "err_mode": 16,
            "err_handler": 24,
            "user_data": 40,
            "flags": 48,
            "sockaddr": 56,
            "conn_request": 72,
            "name": 80,
            "local_sockaddr": 88,
        },
    ),
    "ucp_mem_map_params_t": (
        48,
        {
            "address": 8,
            "length": 16,
            "flags": 24,
            "prot": 28,
            "memory_type": 32,
            "exported_memh_buffer": 40,
        },
    ),
    "ucp_request_param_t": (
        96,
        {
            "flags": 4,
            "request": 8,
            "cb": 16,
            "datatype": 24,
            "user_data": 32,
            "reply_buffer": 40,
            "memory_type": 48,
            "recv_info": 56,
            "memh": 64,
            "remote_datatype": 72,
            "remote": 80,
            "remote_count": 88,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_struct_layout_matches_headers(name: str) -> None:
    struct = L.STRUCTS[name]
    size, offsets = LAYOUTS[name]
    assert ctypes.sizeof(struct) == size
    for field, offset in offsets.items():
        assert getattr(struct, field).offset == offset, f"{name}.{field}"


def test_every_bound_struct_is_pinned() -> None:
    assert set(L.STRUCTS) == set(LAYOUTS)


def test_status_pointer_decoding() -> None:
    assert not L.ptr_is_err(None) and L.ptr_status(None) == L.UCS_OK
    err = ctypes.c_uint64(L.UCS_ERR_NO_RESOURCE).value  # (void*)-2
    assert L.ptr_is_err(err) and L.ptr_status(err) == L.UCS_ERR_NO_RESOURCE
    assert not L.ptr_is_err(0x7F00_0000_1000)


def test_payload_codec_rejects_garbage() -> None:
    from weight_transfer.backends.ucx import _decode_payload, _encode_payload

    assert _decode_payload(_encode_payload(b"t" * 16, 4096, 100, b"rk")) == (
        b"t" * 16,
        4096,
        100,
        b"rk",
    )
    for bad in (b"", b"\xc1", msgpack.packb([b"t", 1, 2]), msgpack.packb([b"t", -1, 2, b"r"])):
        with pytest.raises(ValueError):
            _decode_payload(bad)


def test_missing_wheel_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from weight_transfer.backends import ucx

    def no_wheel() -> None:
        raise ImportError("No module named 'libucx'")

    monkeypatch.setattr(ucx.ucx_native.L, "load", no_wheel)
    with pytest.raises(TransportUnavailableError, match=r"pip install 'libucx-cu13>=1\.22,<1\.23'"):
        ucx.UcxTransport(TransportConfig(name="ucx"))


@requires_module("libucx")
def test_loaded_library_is_the_bound_version() -> None:
    assert L.load().version()[:2] == (L.UCP_API_MAJOR, L.UCP_API_MINOR)


@requires_module("libucx")
def test_bad_ucx_option_is_refused_by_name() -> None:
    from weight_transfer.backends.ucx import UcxTransport

    with pytest.raises(TransportUnavailableError, match="NO_SUCH_KNOB"):
        UcxTransport(TransportConfig(name="ucx", options=(("UCX_NO_SUCH_KNOB", "1"),)))


@requires_module("libucx")
def test_defaults_that_ucx_lacks_are_skipped_but_options_are_not() -> None:
    from weight_transfer.backends import ucx_native

    worker = ucx_native.UcxWorker([], name="t", defaults=[("NO_SUCH_KNOB", "1")])
    worker.destroy()
    with pytest.raises(ucx_native.UcxError, match="NO_SUCH_KNOB"):
        ucx_native.UcxWorker([("NO_SUCH_KNOB", "1")], name="t")


@requires_module("libucx")
def test_many_small_puts_complete_on_the_flush_bit_exact() -> None:
    """2048 puts of 4 KiB through the fast path (`UcxWorker.put_many`, requests settled after
    the flush): every byte lands, and no request is left behind."""
    from weight_transfer.backends.ucx import UcxTransport

    rx = UcxTransport(TransportConfig(name="ucx"))
    tx = UcxTransport(TransportConfig(name="ucx", options=(("lanes", "1"),)))  # one worker
    try:
        assert tx.progress_driven
        gen = torch.Generator().manual_seed(12)
        n, k = 4096, 2048
        target = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=gen)
        source = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=gen)
        desc = rx.register(target, role=RegionRole.TARGET).descriptor
        assert desc is not None
        tx.connect("rx", rx.endpoint())
        src = tx.register(source, role=RegionRole.SOURCE)
        # reversed order: target block i gets source block k-1-i
        ops = [WriteOp(src, (k - 1 - i) * n, desc, i * n, n) for i in range(k)]
        handle = tx.post_writes("rx", ops)
        tx.wait(handle, timeout_s=30)
        assert torch.equal(target.view(k, n), source.view(k, n).flip(0))
        assert handle.state.puts == [] and handle.state.flush is None
    finally:
        tx.close()
        rx.close()


@requires_module("libucx")
def test_repeated_batches_reuse_rkeys_and_write_new_bytes() -> None:
    """Same layout twice (as every update does), new bytes each time; the rkey is unpacked once."""
    from weight_transfer.backends.ucx import UcxTransport

    opts = (("TLS", "sm,cma,tcp"),)
    rx = UcxTransport(TransportConfig(name="ucx", options=opts))
    tx = UcxTransport(TransportConfig(name="ucx", options=opts))
    try:
        gen = torch.Generator().manual_seed(7)
        target = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen)
        desc = rx.register(target, role=RegionRole.TARGET).descriptor
        assert desc is not None
        tx.connect("rx", rx.endpoint())
        source = torch.empty(1 << 15, dtype=torch.uint8)
        src = tx.register(source, role=RegionRole.SOURCE)
        for step in range(2):
            source.copy_(torch.randint(0, 256, source.shape, dtype=torch.uint8, generator=gen))
            ops = [WriteOp(src, 0, desc, 1001, 5000), WriteOp(src, 5000, desc, 30000, 27768)]
            tx.wait(tx.post_writes("rx", ops), timeout_s=10)
            assert torch.equal(target[1001:6001], source[:5000]), step
            assert torch.equal(target[30000:57768], source[5000:]), step
        assert len(tx._by_peer["rx"].targets) == 1
    finally:
        tx.close()
        rx.close()
