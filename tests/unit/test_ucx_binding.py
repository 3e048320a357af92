"""The libucp ctypes binding: struct layouts pinned to UCX 1.22's headers and checked against
1.13's, and the backend's own checks (payloads, options, missing wheel). Cross-process writes
live in tests/conformance; which build loads, and the UCX_TLS refusals, in test_ucx_library.py.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import msgpack
import pytest
import torch

from tests.markers import requires_module
from weight_transfer.backends import availability
from weight_transfer.backends.base import (
    RegionRole,
    TransportConfig,
    TransportUnavailableError,
    WriteOp,
)
from weight_transfer.backends.ucx_native import _builds, _uct
from weight_transfer.backends.ucx_native import _libucp as L


def process_lib() -> L.LibUcp:
    """The UCX build of this test process (the one `library=auto` gives, loaded once)."""
    return L.loaded() or L.load(_builds.resolve("auto", rdma=bool(availability.rdma_devices())))


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


# The same for UCX 1.13.1's headers (Debian's libucx-dev): where 1.13 differs, the size only.
# Every field 1.13 has sits at the offset above; the rest are `L.FIELDS_AFTER_1_13`.
SIZES_1_13 = {
    "ucp_params_t": 80,
    "ucp_worker_params_t": 200,
    "ucp_ep_params_t": 104,
    "ucp_mem_map_params_t": 40,
    "ucp_request_param_t": 72,
}

# libuct's structs (`_uct`), identical in 1.13.1 and 1.22.0 (include/uct/api/uct.h).
UCT_LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "uct_component_attr_t": (
        48,
        {"name": 8, "md_resource_count": 24, "md_resources": 32, "flags": 40},
    ),
    "uct_tl_resource_desc_t": (52, {"dev_name": 10, "dev_type": 44, "sys_device": 48}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_struct_layout_matches_headers(name: str) -> None:
    struct = L.STRUCTS[name]
    size, offsets = LAYOUTS[name]
    assert ctypes.sizeof(struct) == size
    for field, offset in offsets.items():
        assert getattr(struct, field).offset == offset, f"{name}.{field}"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_ucx_1_13_lacks_only_trailing_fields_that_are_never_set(name: str) -> None:
    """Passing a 1.22-sized struct to 1.13 is safe when 1.13's struct is a prefix of it and
    the fields past that prefix are ones the binding never sets (UCX reads a field only when
    its bit is in the field mask)."""
    struct = L.STRUCTS[name]
    newer = L.FIELDS_AFTER_1_13.get(name, ())
    fields = [f[0] for f in struct._fields_]
    assert fields[len(fields) - len(newer) :] == list(newer)  # trailing
    first_new = getattr(struct, newer[0]).offset if newer else ctypes.sizeof(struct)
    if newer:
        assert first_new <= SIZES_1_13[name] <= first_new + 7  # ends where the new ones begin
    else:
        assert SIZES_1_13[name] == ctypes.sizeof(struct)


@pytest.mark.parametrize("name", sorted(UCT_LAYOUTS))
def test_uct_struct_layout_matches_headers(name: str) -> None:
    struct = _uct.STRUCTS[name]
    size, offsets = UCT_LAYOUTS[name]
    assert ctypes.sizeof(struct) == size
    for field, offset in offsets.items():
        assert getattr(struct, field).offset == offset, f"{name}.{field}"


def test_every_bound_struct_is_pinned() -> None:
    assert set(L.STRUCTS) == set(LAYOUTS) == set(SIZES_1_13)
    assert set(_uct.STRUCTS) == set(UCT_LAYOUTS)


def _header_sets() -> list[object]:
    sets = [pytest.param("system", "/usr/include", id="system")]
    wheel = _builds.find_build("wheel")
    if wheel is not None:
        include = str(Path(wheel.files.folder).parent / "include")
        sets.append(pytest.param("wheel", include, id="wheel"))
    return sets


@pytest.mark.parametrize("which, include", _header_sets())
def test_pinned_layouts_are_what_gcc_reports(which: str, include: str, tmp_path: Path) -> None:
    """Compile offsetof/sizeof of every bound field against a UCX header set (1.13 from
    libucx-dev, 1.22 from the wheel) and compare with the ctypes structs."""
    version_h = Path(include, "ucp", "api", "ucp_version.h")
    if shutil.which("gcc") is None or not version_h.exists():
        pytest.skip(f"needs gcc and UCX headers under {include}")
    minor = int(re.search(r"UCP_API_MINOR\s+(\d+)", version_h.read_text()).group(1))  # type: ignore[union-attr]
    structs = {**L.STRUCTS, **_uct.STRUCTS}
    lines = []
    for name, struct in structs.items():
        lines.append(f'printf("{name} . %zu\\n", sizeof({name}));')
        for field, *_ in struct._fields_:
            if minor < 22 and field in L.FIELDS_AFTER_1_13.get(name, ()):
                continue
            lines.append(f'printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <ucp/api/ucp.h>\n"
        "#include <uct/api/uct.h>\nint main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n"
    )
    exe = tmp_path / "layout"
    subprocess.run(["gcc", f"-I{include}", str(src), "-o", str(exe)], check=True, timeout=60)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        name, field, value = line.split()
        struct = structs[name]
        if field == ".":
            if minor >= 22 or name not in L.FIELDS_AFTER_1_13:
                assert int(value) == ctypes.sizeof(struct), (which, name)
            else:
                assert int(value) == SIZES_1_13[name] <= ctypes.sizeof(struct), (which, name)
        else:
            assert int(value) == getattr(struct, field).offset, (which, name, field)


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

    monkeypatch.setitem(_builds._FINDERS, "wheel", lambda: None)
    with pytest.raises(TransportUnavailableError, match=r"pip install 'libucx-cu13>=1\.22,<1\.23'"):
        ucx.UcxTransport(TransportConfig(name="ucx", options=(("library", "wheel"),)))


@requires_module("libucx")
def test_the_wheel_is_the_bound_version() -> None:
    wheel = _builds.find_build("wheel")
    assert wheel is not None
    header = Path(wheel.files.folder).parent / "include" / "ucp" / "api" / "ucp_version.h"
    text = header.read_text()
    for name, value in (("MAJOR", L.UCP_API_MAJOR), ("MINOR", L.UCP_API_MINOR)):
        assert re.search(rf"#define UCP_API_{name}\s+{value}\b", text), name


def test_loaded_library_is_supported_and_asks_for_its_own_api() -> None:
    lib = process_lib()
    assert lib.version()[:2] >= L.MIN_VERSION
    assert lib.api_version() == (lib.version()[0], min(lib.version()[1], L.UCP_API_MINOR))


@requires_module("libucx")
def test_bad_ucx_option_is_refused_by_name() -> None:
    from weight_transfer.backends.ucx import UcxTransport

    with pytest.raises(TransportUnavailableError, match="NO_SUCH_KNOB"):
        UcxTransport(TransportConfig(name="ucx", options=(("UCX_NO_SUCH_KNOB", "1"),)))


@requires_module("libucx")
def test_defaults_that_ucx_lacks_are_skipped_but_options_are_not() -> None:
    from weight_transfer.backends import ucx_native

    lib = process_lib()
    worker = ucx_native.UcxWorker(lib, [], name="t", defaults=[("NO_SUCH_KNOB", "1")])
    worker.destroy()
    with pytest.raises(ucx_native.UcxError, match="NO_SUCH_KNOB"):
        ucx_native.UcxWorker(lib, [("NO_SUCH_KNOB", "1")], name="t")


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
