"""Delta diff/encode and apply kernels: bit-exact against masks and indexing written here.

Two groups: the CPU (torch ops) path, always run; the Triton kernels through triton's CPU
interpreter in one spawned child (as tests/unit/test_fp8_kernel.py does), wherever triton imports.
The oracle is plain tensor indexing in the test: which elements differ, bit for bit, and the
new tensor itself after apply.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any

import pytest
import torch

from tests.markers import requires_cuda, requires_module
from weight_transfer.config import DeltaConfig
from weight_transfer.errors import ConfigurationError, WeightTransferError
from weight_transfer.kernels import delta
from weight_transfer.kernels.delta import (
    CHUNK_ELEMENTS,
    apply_changes,
    apply_runs,
    count_runs,
    diff_encode,
    encode_runs,
    encoded_nbytes,
    int_view,
    num_chunks,
    sparse_nbytes,
)

_CHILD_TIMEOUT_S = 300.0

SHAPES_DTYPES = [
    (5, torch.bfloat16, 0.5),
    (CHUNK_ELEMENTS, torch.bfloat16, 0.01),
    (CHUNK_ELEMENTS + 1, torch.float8_e4m3fn, 0.02),  # one element in a second chunk
    (3 * CHUNK_ELEMENTS - 7, torch.float32, 0.001),
    (200_003, torch.bfloat16, 0.3),
    (70_000, torch.float16, 0.0),  # nothing changed
    (70_000, torch.bfloat16, 1.0),  # everything changed
]


def _pair(numel: int, dtype: torch.dtype, density: float, seed: int) -> tuple[torch.Tensor, ...]:
    """(old, new) with about `density` of the elements changed, bitwise (random bit patterns,
    so -0.0/0.0 and NaN payloads occur too for small element sizes)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[size]
    info = torch.iinfo(ints)
    old = torch.randint(info.min, info.max, (numel,), generator=g, dtype=torch.int64).to(ints)
    new = old.clone()
    mask = torch.rand(numel, generator=g) < density
    # Every masked element gets a different bit pattern (add an odd non-zero value).
    new[mask] = (
        new[mask].to(torch.int64) + 1 + 2 * torch.randint(0, 100, (int(mask.sum()),), generator=g)
    ).to(ints)
    return old.view(dtype), new.view(dtype), mask


def _encode_apply_roundtrip(numel: int, dtype: torch.dtype, density: float, seed: int) -> None:
    old, new, mask = _pair(numel, dtype, density, seed)
    a, b = int_view(new), int_view(old)
    want = (a != b).nonzero().reshape(-1)
    assert torch.equal(want, mask.nonzero().reshape(-1))
    offsets = torch.full((num_chunks(numel) + 1,), -1, dtype=torch.int64)
    index = torch.full((numel,), 0x5A5A, dtype=torch.int16)
    values = torch.empty(numel, dtype=a.dtype)
    total = diff_encode(a, b, index=index, values=values, offsets=offsets)
    assert total == want.numel()
    # Oracle: per chunk, the changed positions in order, their 16-bit offsets and new values.
    chunk = want // CHUNK_ELEMENTS
    want_offsets = torch.zeros(num_chunks(numel) + 1, dtype=torch.int64)
    want_offsets[1:] = torch.cumsum(torch.bincount(chunk, minlength=num_chunks(numel)), 0)
    assert torch.equal(offsets, want_offsets)
    got_index = index[:total].to(torch.int64) & 0xFFFF
    assert torch.equal(got_index, want % CHUNK_ELEMENTS)
    assert torch.equal(values[:total], a[want])
    assert bool((index[total:] == 0x5A5A).all()), "wrote past the entries"
    dst = old.clone()
    apply_changes(int_view(dst), offsets, index, values)
    assert torch.equal(int_view(dst), a), "apply did not reproduce the new bytes"


@pytest.mark.parametrize(("numel", "dtype", "density"), SHAPES_DTYPES)
def test_cpu_roundtrip_bit_exact(numel: int, dtype: torch.dtype, density: float) -> None:
    assert not delta._use_triton(torch.zeros(1)) or os.environ.get("TRITON_INTERPRET")
    _encode_apply_roundtrip(numel, dtype, density, seed=numel)


def test_signed_zero_and_nan_payloads_count_as_changes() -> None:
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0
    new.view(torch.int16)[2] = old.view(torch.int16)[2] + 1  # another NaN
    a, b = int_view(new), int_view(old)
    offsets = torch.empty(2, dtype=torch.int64)
    index = torch.empty(5, dtype=torch.int16)
    values = torch.empty(5, dtype=torch.int16)
    assert diff_encode(a, b, index=index, values=values, offsets=offsets) == 2
    assert index[:2].tolist() == [0, 2]
    dst = old.clone()
    apply_changes(int_view(dst), offsets, index, values)
    assert torch.equal(dst.view(torch.int16), new.view(torch.int16))


def test_over_capacity_writes_nothing_but_offsets() -> None:
    old, new, mask = _pair(100_000, torch.bfloat16, 0.05, seed=3)
    cap = int(mask.sum()) - 1
    index = torch.full((cap,), 7, dtype=torch.int16)
    values = torch.full((cap,), 9, dtype=torch.int16)
    offsets = torch.empty(num_chunks(100_000) + 1, dtype=torch.int64)
    total = diff_encode(int_view(new), int_view(old), index=index, values=values, offsets=offsets)
    assert total == int(mask.sum())
    assert bool((index == 7).all()) and bool((values == 9).all())


def test_bad_arguments_raise_before_writing() -> None:
    a = torch.zeros(10, dtype=torch.int16)
    with pytest.raises(ConfigurationError, match="differ"):
        diff_encode(
            a,
            torch.zeros(11, dtype=torch.int16),
            index=torch.empty(10, dtype=torch.int16),
            values=torch.empty(10, dtype=torch.int16),
            offsets=torch.empty(2, dtype=torch.int64),
        )
    with pytest.raises(ConfigurationError, match="flat integer"):
        diff_encode(
            torch.zeros(10, dtype=torch.bfloat16),
            torch.zeros(10, dtype=torch.bfloat16),
            index=torch.empty(10, dtype=torch.int16),
            values=torch.empty(10, dtype=torch.int16),
            offsets=torch.empty(2, dtype=torch.int64),
        )
    with pytest.raises(ConfigurationError, match="contiguous"):
        int_view(torch.zeros(4, 4)[:, 1])
    dst = torch.zeros(10, dtype=torch.int16)
    offsets = torch.tensor([0, 1], dtype=torch.int64)
    with pytest.raises(ConfigurationError, match="outside"):
        # Index 12 of a 10-element run: refused, nothing written.
        apply_changes(
            dst,
            offsets,
            torch.tensor([12], dtype=torch.int16),
            torch.tensor([5], dtype=torch.int16),
        )
    assert bool((dst == 0).all())


def _tables_roundtrip(device: str) -> None:
    """Every case of SHAPES_DTYPES in one batch through the table kernels (`count_runs`,
    `encode_runs`, `apply_runs`), against the masks: counts, offsets, indices, values, and the
    new runs after apply. Half the runs are carved out of one buffer at an odd element offset,
    so rows that are not 16-byte aligned take the masked kernel."""
    news, olds, masks = [], [], []
    for k, (numel, dtype, density) in enumerate(SHAPES_DTYPES):
        old, new, mask = _pair(numel, dtype, density, seed=100 + k)
        if k % 2:
            pad_old = torch.empty(numel + 1, dtype=dtype)
            pad_new = torch.empty(numel + 1, dtype=dtype)
            pad_old[1:], pad_new[1:] = old, new
            old, new = pad_old[1:], pad_new[1:]
        news.append(int_view(new.to(device)))
        olds.append(int_view(old.to(device)))
        masks.append(mask)
    counted = count_runs(news, olds)
    outputs: list[Any] = []
    for i, (a, mask) in enumerate(zip(news, masks, strict=True)):
        want = mask.nonzero().reshape(-1)
        assert counted.totals[i] == want.numel(), f"run {i}"
        want_counts = torch.bincount(want // CHUNK_ELEMENTS, minlength=num_chunks(a.numel()))
        assert counted.run_counts(i).tolist() == want_counts.tolist(), f"run {i}"
        outputs.append(
            (
                i,
                torch.full((num_chunks(a.numel()) + 1,), -1, dtype=torch.int64, device=device),
                torch.full((want.numel(),), 0x5A5A, dtype=torch.int16, device=device),
                torch.empty(want.numel(), dtype=a.dtype, device=device),
            )
        )
    encode_runs(counted, outputs, olds)
    items = []
    for (i, offsets, index, values), a, b, mask in zip(outputs, news, olds, masks, strict=True):
        want = mask.nonzero().reshape(-1)
        want_offsets = torch.zeros(num_chunks(a.numel()) + 1, dtype=torch.int64)
        want_offsets[1:] = torch.cumsum(
            torch.bincount(want // CHUNK_ELEMENTS, minlength=num_chunks(a.numel())), 0
        )
        assert torch.equal(offsets.cpu(), want_offsets), f"run {i}: offsets"
        assert torch.equal(index.cpu().to(torch.int64) & 0xFFFF, want % CHUNK_ELEMENTS)
        assert torch.equal(values.cpu(), a.cpu()[want]), f"run {i}: values"
        dst = b.clone()
        items.append((dst, offsets, index, values))
    apply_runs(items)
    for (dst, _, _, _), a in zip(items, news, strict=True):
        assert torch.equal(dst.cpu(), a.cpu())


def test_tables_on_the_cpu_path() -> None:
    if delta._use_triton(torch.zeros(1)):
        pytest.skip("TRITON_INTERPRET is set: the interpreter case covers this")
    _tables_roundtrip("cpu")


def test_kernel_selection_is_checked_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """`use_kernels` / `DeltaConfig.kernels` / `ReceiverConfig.patch_kernels` take only known
    names; "auto" without the CUDA C module (CuPy missing) gives the Triton path, "cuda"
    raises naming CuPy, and CPU tensors never take the CUDA C path."""
    from weight_transfer.config import ReceiverConfig

    with pytest.raises(ConfigurationError, match="one of"):
        delta.use_kernels("cub")
    with pytest.raises(ConfigurationError, match="delta.kernels"):
        DeltaConfig(kernels="cub")
    with pytest.raises(ConfigurationError, match="patch_kernels"):
        ReceiverConfig(patch_kernels="cub")
    monkeypatch.setattr(delta, "_CUDA_MODULE", "weight_transfer.kernels._no_such_module")
    delta._cuda_module.cache_clear()
    try:
        gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
        delta.use_kernels("auto")
        assert delta._cuda_kernels(gpu) is None
        delta.use_kernels("cuda")
        assert delta._cuda_kernels(cpu) is None
        with pytest.raises(WeightTransferError, match="cupy"):
            delta._cuda_kernels(gpu)
        delta.use_kernels("triton")
        assert delta._cuda_kernels(gpu) is None
    finally:
        delta.use_kernels("auto")
        monkeypatch.undo()
        delta._cuda_module.cache_clear()


def test_auto_falls_back_to_triton_when_cuda_c_does_not_compile(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ "auto" with CuPy present but a compile that fails (a CuPy for another CUDA): Triton,
    with one warning naming the device and the error; "cuda" still selects CUDA C (and fails
    at its launch), and a module that compiles is taken."""
    import types

    def broken(device_index: int, defines: tuple[tuple[str, int], ...]) -> None:
        raise RuntimeError("nvrtc: unsupported architecture")

    fake = types.ModuleType("fake_delta_cuda")
    fake._module = broken  # type: ignore[attr-defined]
    working = types.ModuleType("working_delta_cuda")
    working._module = lambda device_index, defines: None  # type: ignore[attr-defined]
    gpu = torch.device("cuda", 3)
    monkeypatch.setattr(delta, "_cuda_module", lambda required: fake)
    delta._cuda_compiles.cache_clear()
    try:
        delta.use_kernels("auto")
        with caplog.at_level("WARNING", logger=delta.__name__):
            assert delta._cuda_kernels(gpu) is None
            assert delta._cuda_kernels(gpu) is None  # decided once per device
        warnings = [r for r in caplog.records if "did not compile" in r.getMessage()]
        assert len(warnings) == 1
        assert "cuda:3" in warnings[0].getMessage()
        assert "unsupported architecture" in warnings[0].getMessage()
        delta.use_kernels("cuda")
        assert delta._cuda_kernels(gpu) is fake
        monkeypatch.setattr(delta, "_cuda_module", lambda required: working)
        delta.use_kernels("auto")
        assert delta._cuda_kernels(gpu) is working
    finally:
        delta.use_kernels("auto")
        delta._cuda_compiles.cache_clear()


def test_kernels_report_says_which_kernels_run_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kernels_report` (`weight-transfer doctor`'s line) for each selection, with stand-in
    modules for the CUDA C kernels (no GPU here): which set runs on the device, and why."""
    import importlib.util
    import types

    def broken(device_index: int, defines: tuple[tuple[str, int], ...]) -> None:
        raise RuntimeError("nvrtc: unsupported architecture")

    def no_cupy(required: bool) -> types.ModuleType | None:
        if required:
            raise WeightTransferError("the CUDA C delta kernels need cupy")
        return None

    working = types.ModuleType("working_delta_cuda")
    working._module = lambda device_index, defines: None  # type: ignore[attr-defined]
    failing = types.ModuleType("failing_delta_cuda")
    failing._module = broken  # type: ignore[attr-defined]
    triton = "Triton " if importlib.util.find_spec("triton") is not None else "none: "
    delta._cuda_compiles.cache_clear()
    try:
        delta.use_kernels("auto")
        monkeypatch.setattr(delta, "_cuda_module", lambda required: working)
        assert delta.kernels_report(3).startswith("CUDA C (CuPy ")
        monkeypatch.setattr(delta, "_cuda_module", lambda required: failing)
        got = delta.kernels_report(3)
        assert got.startswith(triton) and "do not compile for cuda:3" in got, got
        monkeypatch.setattr(delta, "_cuda_module", no_cupy)
        got = delta.kernels_report(3)
        assert got.startswith(triton) and "CuPy does not import" in got, got
        delta.use_kernels("triton")
        got = delta.kernels_report(3)
        assert got.startswith(triton) and 'kernels = "triton"' in got, got
        delta.use_kernels("cuda")
        assert delta.kernels_report(3) == "none: the CUDA C delta kernels need cupy"
    finally:
        delta.use_kernels("auto")
        delta._cuda_compiles.cache_clear()


def test_encoded_nbytes_formulas() -> None:
    mask = torch.zeros(256, 256, dtype=torch.bool)
    mask[0, 0] = mask[200, 3] = mask[255, 255] = True
    assert encoded_nbytes("index32", mask, value_bytes=2) == 3 * 6
    assert (
        encoded_nbytes("chunk_index16", mask, value_bytes=2) == sparse_nbytes(3, 65536, 2) == 4 + 12
    )
    assert encoded_nbytes("bitmap", mask, value_bytes=1) == 65536 // 8 + 3
    # Blocks (0,0), (1,0), (1,1) changed; three whole 128x128 blocks plus their indices.
    assert encoded_nbytes("blocks128", mask, value_bytes=2) == 3 * 128 * 128 * 2 + 12
    # Runs of 256 elements: rows 0, 200, 255 (one run each), plus a bitmap of 256 runs.
    assert encoded_nbytes("runs256", mask, value_bytes=2) == 32 + 3 * 512
    assert encoded_nbytes("hybrid16", mask, value_bytes=2) == 4 + 3 * 2 + 3 * 2


# ---------------------------------------------------------------------------------------------
# The Triton kernels through triton's CPU interpreter (a spawned child with TRITON_INTERPRET=1).
# ---------------------------------------------------------------------------------------------


def _case_roundtrips() -> None:
    assert delta._use_triton(torch.zeros(1)), "the child should run the interpreted kernels"
    for numel, dtype, density in SHAPES_DTYPES:
        try:
            _encode_apply_roundtrip(numel, dtype, density, seed=numel + 1)
        except AssertionError as exc:
            raise AssertionError(f"{numel} {dtype} {density}: {exc}") from exc


def _case_triton_equals_cpu() -> None:
    # The interpreted kernels and the torch path produce the same entries (order included).
    old, new, _ = _pair(150_000, torch.bfloat16, 0.1, seed=11)
    a, b = int_view(new), int_view(old)
    offsets = torch.empty(num_chunks(150_000) + 1, dtype=torch.int64)
    index = torch.empty(150_000, dtype=torch.int16)
    values = torch.empty(150_000, dtype=torch.int16)
    total = diff_encode(a, b, index=index, values=values, offsets=offsets)
    want = (a != b).nonzero().reshape(-1)
    assert torch.equal(index[:total].to(torch.int64) & 0xFFFF, want % CHUNK_ELEMENTS)
    assert torch.equal(values[:total], a[want])


def _case_patch_tables() -> None:
    # PatchBuilder.add_runs, apply_patch_region and Snapshot.advance on the table kernels.
    from tests.unit import test_delta_patch

    assert delta.uses_triton(torch.zeros(1))
    test_delta_patch.test_add_runs_equals_add()
    test_delta_patch.test_corrupt_patch_refused_and_nothing_written("offsets")


def _case_tables() -> None:
    assert delta._use_triton(torch.zeros(1)), "the child should run the interpreted kernels"
    _tables_roundtrip("cpu")


def _case_sender_tables() -> None:
    # A whole sender and two receivers in delta mode with the sender on the table path
    # (PatchBuilder.add_table from addresses, the batch columns cached across updates):
    # bit-exact against slicing written in the test over deltas and anchors, then a slot
    # overflow failing cleanly.
    from tests.unit import test_delta_runtime as rt

    assert delta.uses_triton(torch.zeros(1))
    s = rt.Setup(
        "loopback", DeltaConfig(enabled=True, anchor_every_updates=5, full_when_slower=False)
    )
    try:
        rt.test_bit_exact_over_many_steps_with_anchors(s)
    finally:
        s.close()
    rt.test_patch_slot_overflow_fails_cleanly_then_full()


INTERPRETER_CASES = {
    "roundtrips": _case_roundtrips,
    "triton_equals_cpu": _case_triton_equals_cpu,
    "tables": _case_tables,
    "patch_tables": _case_patch_tables,
    "sender_tables": _case_sender_tables,
}


def _interpreter_worker(results: Any) -> None:
    """Spawned child (TRITON_INTERPRET=1 inherited): run every case, report name -> error."""
    for case_name, case in INTERPRETER_CASES.items():
        try:
            case()
        except Exception:  # every failure reported by name; the parent asserts per case
            results.put((case_name, traceback.format_exc()))
        else:
            results.put((case_name, ""))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the spawned child only
    try:
        child = ctx.Process(target=_interpreter_worker, args=(results,))
        child.start()
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    got: dict[str, str] = {}
    deadline = time.monotonic() + _CHILD_TIMEOUT_S
    try:
        while len(got) < len(INTERPRETER_CASES) and time.monotonic() < deadline:
            try:
                case_name, error = results.get(timeout=1.0)
            except queue.Empty:
                if not child.is_alive():
                    break
                continue
            got[case_name] = error
    finally:
        child.join(timeout=max(1.0, deadline - time.monotonic()))
        if child.exitcode is None:
            child.kill()
            child.join(timeout=10)
    assert child.exitcode == 0, f"interpreter child exited with {child.exitcode}; got {got}"
    return got


@requires_module("triton")
@pytest.mark.parametrize("case_name", list(INTERPRETER_CASES))
def test_interpreter(interpreter_results: dict[str, str], case_name: str) -> None:
    error = interpreter_results[case_name]
    assert not error, f"interpreted kernel, case {case_name}:\n{error}"


# ---------------------------------------------------------------------------------------------
# The compiled kernels on a GPU (skipped here; docs/gpu_runs.md has the command that runs them).
# ---------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize(("numel", "dtype", "density"), SHAPES_DTYPES)
def test_cuda_roundtrip_bit_exact(numel: int, dtype: torch.dtype, density: float) -> None:
    old, new, mask = _pair(numel, dtype, density, seed=numel + 2)
    old, new = old.cuda(), new.cuda()
    a, b = int_view(new), int_view(old)
    offsets = torch.empty(num_chunks(numel) + 1, dtype=torch.int64, device="cuda")
    index = torch.empty(numel, dtype=torch.int16, device="cuda")
    values = torch.empty(numel, dtype=a.dtype, device="cuda")
    total = diff_encode(a, b, index=index, values=values, offsets=offsets)
    want = mask.nonzero().reshape(-1)
    assert total == want.numel()
    assert torch.equal(index[:total].cpu().to(torch.int64) & 0xFFFF, want % CHUNK_ELEMENTS)
    dst = old.clone()
    apply_changes(int_view(dst), offsets, index, values)
    assert torch.equal(int_view(dst).cpu(), a.cpu())


@requires_cuda
@pytest.mark.parametrize("kernels", ["triton", pytest.param("cuda", marks=requires_module("cupy"))])
def test_cuda_tables_bit_exact(kernels: str) -> None:
    """Both GPU kernel sets (`delta.use_kernels`) against the masks."""
    delta.use_kernels(kernels)
    try:
        _tables_roundtrip("cuda")
    finally:
        delta.use_kernels("auto")


@requires_cuda
@requires_module("cupy")
def test_cuda_tables_large_chunks_bit_exact() -> None:
    """Both kernel sets on many whole chunks of every element size (the vector path of the CUDA
    C count and the staged copy of its encode, whose output starts at every alignment; dense,
    sparse, nearly empty and empty chunks) give the same patch as masks written here."""
    g = torch.Generator(device="cuda").manual_seed(7)
    try:
        for ints in (torch.int8, torch.int16, torch.int32):
            numel = 37 * CHUNK_ELEMENTS + 1000
            info = torch.iinfo(ints)
            old = torch.randint(
                info.min, info.max, (numel,), generator=g, device="cuda", dtype=torch.int64
            ).to(ints)
            density = torch.rand(numel // CHUNK_ELEMENTS + 1, generator=g, device="cuda")
            density[::5] = 0.0
            density[1::7] = 1.0
            per = density.repeat_interleave(CHUNK_ELEMENTS)[:numel]
            # Chunks with nothing, up to 10%, and everything changed.
            mask = (torch.rand(numel, generator=g, device="cuda") < per * 0.1) | (per == 1.0)
            # Chunks with exactly k changes: fewer bytes than one 16-byte store, the staging
            # limit (STAGE = 4,096 changes) and one past it.
            for c, k in ((2, 1), (3, 2), (4, 3), (6, 7), (8, 9), (9, 4096), (11, 4097), (12, 8)):
                lo = c * CHUNK_ELEMENTS
                mask[lo : lo + CHUNK_ELEMENTS] = False
                at = torch.randperm(CHUNK_ELEMENTS, generator=g, device="cuda")[:k]
                mask[lo + at] = True
            new = old.clone()
            new[mask] ^= 1
            # Two runs, so that the second one's chunks stage from a row past the first's.
            cut = 20 * CHUNK_ELEMENTS
            news, olds = [new[:cut], new[cut:]], [old[:cut], old[cut:]]
            wants = [mask[:cut].nonzero().reshape(-1), mask[cut:].nonzero().reshape(-1)]
            for kernels in ("triton", "cuda"):
                delta.use_kernels(kernels)
                counted = count_runs(news, olds)
                outputs: list[Any] = []
                for i, (a, want) in enumerate(zip(news, wants, strict=True)):
                    total = counted.totals[i]
                    assert total == want.numel(), (kernels, ints, i)
                    outputs.append(
                        (
                            i,
                            torch.empty(
                                num_chunks(a.numel()) + 1, dtype=torch.int64, device="cuda"
                            ),
                            torch.empty(total, dtype=torch.int16, device="cuda"),
                            torch.empty(total, dtype=ints, device="cuda"),
                        )
                    )
                encode_runs(counted, outputs)
                items = []
                for (i, offsets, index, values), a, b, want in zip(
                    outputs, news, olds, wants, strict=True
                ):
                    got = index.to(torch.int64) & 0xFFFF
                    assert torch.equal(got, want % CHUNK_ELEMENTS), (kernels, ints, i)
                    assert torch.equal(values, a[want]), (kernels, ints, i)
                    items.append((b.clone(), offsets, index, values))
                apply_runs(items)
                for (dst, _, _, _), a in zip(items, news, strict=True):
                    assert torch.equal(dst, a), (kernels, ints)
    finally:
        delta.use_kernels("auto")
