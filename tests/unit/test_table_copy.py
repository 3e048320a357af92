"""The loopback backend's batched device copy: coalescing, the chunk table, and the Triton
kernels under triton's CPU interpreter (a child process started with TRITON_INTERPRET=1).

Every check compares bytes exactly (`torch.equal`) on seeded random data, against slicing
written here in the test, with poisoned destinations so an unwritten byte shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.markers import requires_module
from weight_transfer.kernels.table_copy import ALIGN, Copy, chunk_table, coalesce

_REPO_ROOT = Path(__file__).resolve().parents[2]


def test_coalesce_merges_runs_contiguous_in_both_and_keeps_the_rest() -> None:
    copies = [
        Copy(dst=1000, src=5000, nbytes=100),
        Copy(dst=1100, src=5100, nbytes=50),  # continues both: merged
        Copy(dst=1150, src=9000, nbytes=10),  # continues dst only: kept
        Copy(dst=400, src=100, nbytes=600),  # out of order: sorted first, then merged below
        Copy(dst=1160, src=9010, nbytes=40),  # continues the previous one: merged
    ]
    assert coalesce(copies) == [Copy(400, 100, 600), Copy(1000, 5000, 150), Copy(1150, 9000, 50)]
    # src contiguous but dst not: never merged
    assert coalesce([Copy(0, 0, 16), Copy(32, 16, 16)]) == [Copy(0, 0, 16), Copy(32, 16, 16)]
    assert coalesce([]) == []


def _expand(copies: list[Copy]) -> dict[int, int]:
    """dst byte -> src byte for every byte the copies write."""
    out = {}
    for c in copies:
        for k in range(c.nbytes):
            out[c.dst + k] = c.src + k
    return out


def test_chunk_table_covers_every_byte_exactly_once() -> None:
    chunk = 64
    copies = [
        Copy(dst=0, src=1 << 20, nbytes=64 * 3 + 32),  # three chunks and a tail
        Copy(dst=4096, src=2 << 20, nbytes=64),  # one chunk, no tail
        Copy(dst=8192, src=3 << 20, nbytes=48),  # a tail only
        Copy(dst=9001, src=4 << 20, nbytes=32),  # unaligned: plain
        Copy(dst=12288, src=5 << 20, nbytes=40),  # length not a multiple of 16: plain
    ]
    t = chunk_table(copies, chunk)
    assert t.nbytes == sum(c.nbytes for c in copies)
    got: list[Copy] = [Copy(int(d), int(s), chunk) for s, d in t.chunks.tolist()]
    got += [Copy(int(d), int(s), int(n)) for s, d, n in t.tails.tolist()]
    got += list(t.plain)
    assert sorted(t.plain, key=lambda c: c.dst) == [copies[3], copies[4]]
    assert all(n < chunk and n % ALIGN == 0 for _, _, n in t.tails.tolist())
    assert _expand(got) == _expand(copies)
    assert sum(c.nbytes for c in got) == t.nbytes  # no byte twice


# -- the kernels, interpreted -------------------------------------------------------------

_KERNEL_CHILD = r"""
import torch

from weight_transfer.kernels import table_copy as tc

g = torch.Generator().manual_seed(7)
src = torch.randint(-2**62, 2**62, (40000,), dtype=torch.int64, generator=g)
dst = torch.full((40000,), 0x5A5A5A5A5A5A5A5A, dtype=torch.int64)
want = dst.clone()
sb, db = src.data_ptr(), dst.data_ptr()
chunk = 8192  # bytes; 1024 words per chunk
pieces = [(100, 7000, 3000), (3100, 10000, 1000), (20000, 200, 1030), (30000, 33000, 2)]
copies = []
for d, s, n in pieces:  # (dst word, src word, words)
    copies.append(tc.Copy(db + 8 * d, sb + 8 * s, 8 * n))
    want[d:d + n] = src[s:s + n]
merged = tc.coalesce(copies)
assert len(merged) == 3, merged  # the first two continue each other in src and dst
table = tc.chunk_table(merged, chunk)
assert table.chunks.shape[0] > 0 and table.tails.shape[0] > 0, tc.describe(table)
tc.launch(tc.to_device(table, torch.device("cpu"), len(merged)), chunk)
for c in table.plain:
    raise SystemExit(f"unexpected plain copy {c}")
assert torch.equal(dst, want), (dst != want).nonzero()[:10]
print("ok")
"""


@requires_module("triton")
def test_table_kernels_copy_exactly_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _KERNEL_CHILD],
        cwd=_REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_prepared_writes_post_repeatedly_and_check_regions() -> None:
    from weight_transfer.backends.base import RegionRole, TransportConfig, WriteOp, create_transport

    with (
        create_transport(TransportConfig(name="loopback")) as a,
        create_transport(TransportConfig(name="loopback")) as b,
    ):
        a.connect("b", b.endpoint())
        g = torch.Generator().manual_seed(3)
        src = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
        dst = torch.full((4096,), 0x5A, dtype=torch.uint8)
        rs = a.register(src, role=RegionRole.SOURCE)
        rt = b.register(dst, role=RegionRole.TARGET)
        assert rt.descriptor is not None
        ops = [WriteOp(rs, 0, rt.descriptor, 1024, 512), WriteOp(rs, 512, rt.descriptor, 0, 256)]
        prepared = a.prepare_writes("b", ops)
        for round_ in range(2):
            src[:] = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
            a.wait(a.post_prepared(prepared), 10.0)
            view = rt.tensor
            assert torch.equal(view[1024:1536], src[0:512]), round_
            assert torch.equal(view[0:256], src[512:768]), round_
            assert torch.equal(view[256:1024], torch.full((768,), 0x5A, dtype=torch.uint8))
        with pytest.raises(ValueError, match="outside its region"):
            a.prepare_writes("b", [WriteOp(rs, 4000, rt.descriptor, 0, 200)])
        a.deregister(rs)
        with pytest.raises(ValueError, match="deregistered since the batch was prepared"):
            a.post_prepared(prepared)


def test_loopback_copy_kernel_options_are_checked_by_name() -> None:
    """The kernels' tuning comes in as loopback options (the library reads no environment):
    good values are taken, bad ones refused naming the option."""
    from weight_transfer.backends.base import ConfigurationError, TransportConfig
    from weight_transfer.backends.loopback import LoopbackTransport
    from weight_transfer.kernels.table_copy import Tuning

    def make(*options: tuple[str, str]) -> LoopbackTransport:
        return LoopbackTransport(TransportConfig(name="loopback", options=options))

    t = make(("copy_kernel", "off"), ("copy_chunk_bytes", "8192"), ("copy_num_warps", "4"))
    try:
        assert t._tuning == Tuning(chunk_bytes=8192, num_warps=4)
        assert t._tuning.block_words == Tuning().block_words
        assert not t._copy_kernel
    finally:
        t.close()
    for options, name in [
        ((("copy_chunk_bytes", "1000"),), "copy_chunk_bytes"),
        ((("copy_chunk_bytes", "8"),), "copy_chunk_bytes"),
        ((("copy_block_words", "0"),), "copy_block_words"),
        ((("copy_num_warps", "four"),), "copy_num_warps"),
        ((("copy_kernel", "on"),), "copy_kernel"),
        ((("copy_chunk", "8192"),), "copy_chunk"),
    ]:
        with pytest.raises(ConfigurationError, match=name):
            make(*options)
