"""The Triton FP8 block quantizer equals planner.fp8 (on the CPU) bit for bit.

Three groups: the dispatcher's CPU path and argument checks (always run); the Triton kernel
through triton's CPU interpreter (run wherever triton imports, GPU or not); the compiled kernel
on a GPU (requires_cuda). Every comparison is `torch.equal` on the fp8 bytes and the scales.
"""

from __future__ import annotations

import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.markers import requires_cuda, requires_module
from weight_transfer.backends.base import ConfigurationError
from weight_transfer.cli.launch import Child, Launch
from weight_transfer.kernels import fp8_triton
from weight_transfer.kernels.fp8_triton import quantize_fp8, quantize_fp8_blockwise_gpu
from weight_transfer.planner.fp8 import quantize_fp8_blockwise, scale_shape

_JIT_MODULE = "weight_transfer.kernels._fp8_triton_jit"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_CHILD_TIMEOUT_S = 300.0
_SENTINEL = 0x5A  # fill byte for output buffers: 0x5A is a valid fp8 value the kernel must keep


def _make(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, *, zero_blocks: bool = True
) -> torch.Tensor:
    """Seeded data with magnitudes spread over 1e-4..1e4 per row and column, some zero blocks."""
    g = torch.Generator().manual_seed(seed)
    *lead, rows, cols = shape
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    row_mag = 10.0 ** torch.empty(rows, 1, dtype=torch.float64).uniform_(-2, 2, generator=g)
    col_mag = 10.0 ** torch.empty(cols, dtype=torch.float64).uniform_(-2, 2, generator=g)
    x = x * row_mag * col_mag
    if zero_blocks and rows > 128 and cols > 128:
        x[..., 128:256, :128] = 0.0  # one all-zero block (per matrix): scale is the floor
    if rows > 3 and cols > 3:
        x[..., 1, 2] = -0.0  # the sign of zero survives
        x[..., 3, 1] = 1e-30  # tiny: rounds to zero in fp8
    return x.to(dtype)


def _assert_same(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    gq, gs = got
    wq, ws = want
    assert gq.dtype == torch.float8_e4m3fn and gs.dtype == torch.float32
    assert gq.shape == wq.shape and gs.shape == ws.shape
    gq_bytes, wq_bytes = gq.cpu().view(torch.uint8), wq.cpu().view(torch.uint8)
    num_bad = int((gq_bytes != wq_bytes).sum())
    assert torch.equal(gq_bytes, wq_bytes), f"{num_bad} fp8 bytes differ"
    assert torch.equal(gs.cpu(), ws.cpu()), f"{int((gs.cpu() != ws.cpu()).sum())} scales differ"


def _conversion_block() -> torch.Tensor:
    """A 128x128 float32 block with amax 448 (scale exactly 1) holding every e4m3 value, every
    midpoint between neighbours and the floats just beside each midpoint: the cast's rounding,
    ties to even and subnormals are all exercised exactly."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    mids = (codes[:-1] + codes[1:]) / 2  # exact: e4m3 values have 4 significant bits
    up = torch.nextafter(mids, torch.full_like(mids, 1e9))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    values = torch.cat([codes, mids, up, down])
    values = torch.cat([values, -values, torch.tensor([448.0, -448.0, -0.0])])
    g = torch.Generator().manual_seed(7)
    block = torch.empty(128 * 128, dtype=torch.float32).uniform_(-448.0, 448.0, generator=g)
    block[: values.numel()] = values
    block[-1] = 448.0
    return block.reshape(128, 128)


# ---------------------------------------------------------------------------------------------
# Dispatcher, CPU path, argument checks: no triton needed.
# ---------------------------------------------------------------------------------------------


def test_dispatcher_cpu_equals_reference() -> None:
    x = _make((300, 260), torch.bfloat16, seed=1)
    _assert_same(quantize_fp8(x), quantize_fp8_blockwise(x))


def test_dispatcher_cpu_writes_into_strided_out_slices() -> None:
    x = _make((2, 200, 300), torch.float32, seed=2)
    want = quantize_fp8_blockwise(x, (128, 128))
    q_buf = torch.full((2, 210, 320), _SENTINEL, dtype=torch.uint8)
    s_buf = torch.full((2, 5, 7), -1.0)
    out_q = q_buf[:, 5:205, 10:310].view(torch.float8_e4m3fn)
    out_s = s_buf[:, 1:3, 2:5]
    q, s = quantize_fp8(x, (128, 128), out_q=out_q, out_scale=out_s)
    assert q.data_ptr() == out_q.data_ptr() and s.data_ptr() == out_s.data_ptr()
    _assert_same((q, s), want)
    q_buf[:, 5:205, 10:310] = _SENTINEL
    s_buf[:, 1:3, 2:5] = -1.0
    assert bool((q_buf == _SENTINEL).all()) and bool((s_buf == -1.0).all()), "wrote outside"


@pytest.mark.parametrize(
    ("out_q_spec", "out_s_spec", "match"),
    [
        ((torch.float8_e4m3fn, (200, 301)), (torch.float32, (2, 3)), "out_q for 'w0' has shape"),
        ((torch.uint8, (200, 300)), (torch.float32, (2, 3)), "out_q for 'w0' has dtype"),
        (
            (torch.float8_e4m3fn, (200, 300)),
            (torch.float32, (3, 3)),
            "out_scale for 'w0' has shape",
        ),
        (
            (torch.float8_e4m3fn, (200, 300)),
            (torch.bfloat16, (2, 3)),
            "out_scale for 'w0' has dtype",
        ),
    ],
)
def test_dispatcher_rejects_bad_out_before_writing(
    out_q_spec: tuple[torch.dtype, tuple[int, int]],
    out_s_spec: tuple[torch.dtype, tuple[int, int]],
    match: str,
) -> None:
    x = _make((200, 300), torch.float32, seed=3)
    out_q = torch.full(out_q_spec[1], _SENTINEL, dtype=torch.uint8).view(out_q_spec[0])
    out_s = torch.full(out_s_spec[1], -1.0).to(out_s_spec[0])
    with pytest.raises(ConfigurationError, match=match):
        quantize_fp8(x, out_q=out_q, out_scale=out_s, name="w0")
    assert bool((out_q.view(torch.uint8) == _SENTINEL).all()), "out_q written despite the error"
    assert bool((out_s == -1.0).all()), "out_scale written despite the error"


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ConfigurationError, match="at least 2 dims"):
        quantize_fp8(torch.ones(5), name="bias")
    with pytest.raises(ConfigurationError, match="dtype"):
        quantize_fp8(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ConfigurationError, match="block"):
        quantize_fp8(torch.ones(4, 4), (0, 128))
    with pytest.raises(ConfigurationError, match="too large"):
        quantize_fp8(torch.ones(4, 4), (512, 512))
    broadcast = torch.empty(1, dtype=torch.float8_e4m3fn).expand(4, 4)
    with pytest.raises(ConfigurationError, match="zero stride"):
        quantize_fp8(torch.ones(4, 4), out_q=broadcast)


def test_gpu_entry_rejects_cpu_tensor() -> None:
    # Holds with or without triton: a compiled kernel never takes a CPU tensor (only a process
    # that imported triton in interpreter mode may pass one).
    if fp8_triton.triton_available() and fp8_triton._is_interpreted(
        fp8_triton._jit_module().fp8_block_quant_kernel
    ):
        pytest.skip("TRITON_INTERPRET is set for this process; CPU tensors are allowed then")
    with pytest.raises(ConfigurationError, match="needs 'w' on a CUDA device.*quantize_fp8"):
        quantize_fp8_blockwise_gpu(torch.ones(4, 4), name="w")


def test_import_without_triton_and_clear_error() -> None:
    # A fresh interpreter in which `import triton` fails: importing the module must work, and
    # asking for the kernel must say what to install.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import weight_transfer.kernels.fp8_triton as m\n"
        "from weight_transfer.backends.base import WeightTransferError\n"
        "assert not m.triton_available()\n"
        "try:\n"
        "    m._jit_module()\n"
        "except WeightTransferError as e:\n"
        "    assert 'pip install triton' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=_REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# ---------------------------------------------------------------------------------------------
# The kernel itself through triton's CPU interpreter.
#
# Triton picks interpreter or compiler when it is imported (its own `tl.max` & co. are jitted
# then), so the interpreted cases run in one spawned child started with TRITON_INTERPRET=1.
# Each case is a module-level function that raises on failure; the child reports per case.
# ---------------------------------------------------------------------------------------------

CASES = [
    ((256, 384), torch.float32, (128, 128)),
    ((704, 256), torch.bfloat16, (128, 128)),
    ((1000, 300), torch.float32, (128, 128)),
    ((3, 300, 200), torch.float16, (128, 128)),
    ((200, 300), torch.bfloat16, (96, 80)),  # non-power-of-two block: padded tile, masked
    ((40, 300), torch.float32, (1, 128)),  # per-token groups
    ((130, 129), torch.float64, (128, 128)),
    ((5, 7), torch.float32, (128, 128)),  # smaller than one block
]


def _case_shapes() -> None:
    for shape, dtype, block in CASES:
        x = _make(shape, dtype, seed=sum(shape))
        try:
            _assert_same(quantize_fp8_blockwise_gpu(x, block), quantize_fp8_blockwise(x, block))
        except AssertionError as exc:
            raise AssertionError(f"shape {shape} {dtype} block {block}: {exc}") from exc


def _case_cast_rounding() -> None:
    block = _conversion_block()
    x = torch.cat([block, block / 7.0], dim=1)  # second block: scale != 1, same rounding paths
    _assert_same(quantize_fp8_blockwise_gpu(x), quantize_fp8_blockwise(x))


def _case_block_edges() -> None:
    # The largest values sit just past each block boundary: a block that read a neighbour's
    # rows or columns (or the padded part of its power-of-two tile) gets a different scale.
    for block in [(96, 80), (128, 128), (1, 128)]:
        x = _make((2, 300, 350), torch.float32, seed=block[0], zero_blocks=False)
        x[:, block[0] : 300 : block[0], :] *= 1e3
        x[:, :, block[1] : 350 : block[1]] *= 1e3
        try:
            _assert_same(quantize_fp8_blockwise_gpu(x, block), quantize_fp8_blockwise(x, block))
        except AssertionError as exc:
            raise AssertionError(f"block {block}: {exc}") from exc


def _case_strided_inputs() -> None:
    # Every view lies inside a frame of large values, so a read past a view's edge is seen.
    big = torch.full((530, 710), 3e4, dtype=torch.bfloat16)
    big[5:525, 5:705] = _make((520, 700), torch.bfloat16, seed=11)
    stack = torch.full((8, 140, 310), -3e4)
    stack[:, 5:135, 5:305] = _make((8, 130, 300), torch.float32, seed=12, zero_blocks=False)
    views = {
        "slice": big[10:510, 69:369],
        "transposed": big[5:305, 5:405].t(),  # last-dim stride != 1
        "stack_foldable": big[5:505, 5:605].reshape(500, 3, 200).transpose(0, 1),
        # strides (4S, S) over the first dims: they do not fold into one
        "stack_not_foldable": stack.view(2, 4, 140, 310)[:, 1:, 5:135, 5:305],
    }
    assert fp8_triton._collapse_leading(views["stack_not_foldable"]) is None
    for label, x in views.items():
        assert not x.is_contiguous(), label
        try:
            _assert_same(quantize_fp8_blockwise_gpu(x), quantize_fp8_blockwise(x.contiguous()))
        except AssertionError as exc:
            raise AssertionError(f"view {label}: {exc}") from exc


def _case_out_slices() -> None:
    x = _make((2, 260, 300), torch.bfloat16, seed=12)
    q_buf = torch.full((3, 270, 310), _SENTINEL, dtype=torch.uint8)
    s_buf = torch.full((3, 6, 8), -1.0)
    out_q = q_buf[1:, 5:265, 3:303].view(torch.float8_e4m3fn)
    out_s = s_buf[1:, 1:4, 2:5]
    q, s = quantize_fp8_blockwise_gpu(x, out_q=out_q, out_scale=out_s)
    assert q.data_ptr() == out_q.data_ptr() and s.data_ptr() == out_s.data_ptr()
    _assert_same((out_q, out_s), quantize_fp8_blockwise(x))
    q_buf[1:, 5:265, 3:303] = _SENTINEL
    s_buf[1:, 1:4, 2:5] = -1.0
    assert bool((q_buf == _SENTINEL).all()) and bool((s_buf == -1.0).all()), "wrote outside"


def _case_non_finite() -> None:
    x = _make((256, 384), torch.float32, seed=13)
    x[3, 5] = float("nan")  # block (0, 0): NaN scale, every q NaN
    x[130, 140] = float("inf")  # block (1, 1): inf scale, finite q -> +-0, inf -> NaN
    got_q, got_s = quantize_fp8_blockwise_gpu(x)
    want_q, want_s = quantize_fp8_blockwise(x)
    assert torch.equal(got_s.isnan(), want_s.isnan()) and bool(got_s.isnan()[0, 0])
    finite = ~want_s.isnan()
    assert torch.equal(got_s[finite], want_s[finite])
    # NaN bytes are 0x7F/0xFF; the sign of a NaN differs between CPU and GPU arithmetic.
    got_b, want_b = got_q.view(torch.uint8), want_q.view(torch.uint8)
    got_nan, want_nan = (got_b & 0x7F) == 0x7F, (want_b & 0x7F) == 0x7F
    assert torch.equal(got_nan, want_nan) and bool(got_nan[:128, :128].all())
    assert torch.equal(got_b[~got_nan], want_b[~want_nan])


def _case_quant_table() -> None:
    # One launch over many matrices of mixed shapes (edges, views, a frame of large values
    # around each view) equals the reference on each; and an aligned table (vectorized path).
    big = torch.full((530, 710), 3e4, dtype=torch.bfloat16)
    big[5:525, 5:705] = _make((520, 700), torch.bfloat16, seed=21)
    inputs = [
        _make((256, 384), torch.bfloat16, seed=22),
        _make((130, 129), torch.bfloat16, seed=23),
        _make((5, 7), torch.bfloat16, seed=24),
        big[10:300, 64:320],
        big[6:200, 5:333],
    ]
    aligned = [
        _make((256, 128), torch.bfloat16, seed=25),
        _make((128, 384), torch.bfloat16, seed=26),
    ]
    for group, sub_rows in [(g, r) for g in (inputs, aligned) for r in (0, 32)]:
        outs = []
        for x in group:
            q = torch.full(x.shape, _SENTINEL, dtype=torch.uint8).view(torch.float8_e4m3fn)
            outs.append((x, q, torch.full(scale_shape(tuple(x.shape), (128, 128)), -1.0)))
        table = fp8_triton.QuantTable(outs, (128, 128), sub_rows=sub_rows)
        assert table._aligned == (group is aligned)
        table.launch()
        for i, (x, q, s) in enumerate(outs):
            try:
                _assert_same((q, s), quantize_fp8_blockwise(x.contiguous(), (128, 128)))
            except AssertionError as exc:
                raise AssertionError(
                    f"table call {i} {tuple(x.shape)} sub_rows {sub_rows}: {exc}"
                ) from exc
    x = _make((256, 384), torch.float32, seed=27)
    x[3, 5] = float("nan")
    x[200, 300] = float("inf")
    for sub_rows in (0, 32):
        q, s = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(2, 3)
        fp8_triton.QuantTable([(x, q, s)], (128, 128), sub_rows=sub_rows).launch()
        assert bool(s.isnan()[0, 0]) and int(s.isnan().sum()) == 1, sub_rows
        assert torch.equal(s[~s.isnan()], quantize_fp8_blockwise(x)[1][~s.isnan()]), sub_rows
    try:
        fp8_triton.QuantTable([(big[5:305, 5:405].t(), q, s)], (128, 128))
    except ConfigurationError as exc:
        assert "stride" in str(exc) or "match" in str(exc), exc
    else:
        raise AssertionError("a transposed input was accepted")


def _case_kernel_is_interpreted() -> None:
    # Guards the harness itself: the cases above must have run the Triton kernel.
    assert fp8_triton._is_interpreted(fp8_triton._jit_module().fp8_block_quant_kernel)


INTERPRETER_CASES = {
    "shapes": _case_shapes,
    "cast_rounding": _case_cast_rounding,
    "block_edges": _case_block_edges,
    "strided_inputs": _case_strided_inputs,
    "out_slices": _case_out_slices,
    "non_finite": _case_non_finite,
    "quant_table": _case_quant_table,
    "kernel_is_interpreted": _case_kernel_is_interpreted,
}


def _interpreter_worker(results: Any) -> None:
    """Spawned child (TRITON_INTERPRET=1 inherited): run every case, report name -> error."""
    for case_name, case in INTERPRETER_CASES.items():
        try:
            case()
        except Exception:  # report every failure by name; the parent asserts per case
            results.put((case_name, traceback.format_exc()))
        else:
            results.put((case_name, ""))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    got: dict[str, str] = {}
    # TRITON_INTERPRET=1 reaches the spawned child only; a crash (e.g. an out-of-bounds access)
    # is reported with its exit code.
    outcome = Launch(
        [Child("interpreter", _interpreter_worker)], env={"TRITON_INTERPRET": "1"}
    ).run(
        timeout_s=_CHILD_TIMEOUT_S,
        on_message=lambda _child, msg: got.__setitem__(msg[0], msg[1]),
    )
    assert outcome.ok, f"{outcome.errors}; got {got}"
    return got


@requires_module("triton")
@pytest.mark.parametrize("case_name", list(INTERPRETER_CASES))
def test_interpreter(interpreter_results: dict[str, str], case_name: str) -> None:
    error = interpreter_results[case_name]
    assert not error, f"interpreted kernel, case {case_name}:\n{error}"


# ---------------------------------------------------------------------------------------------
# The kernel compiled ahead of time for an H100/H200 (sm_90): no GPU needed, only triton and
# its bundled ptxas. Checks the instructions bit-exactness depends on.
# ---------------------------------------------------------------------------------------------


def _compile_for_sm90(in_dtype: str) -> str:
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = fp8_triton._jit_module().fp8_block_quant_kernel
    names = [p.name for p in kernel.params]
    signature = {n: "i32" for n in names}
    signature.update(x_ptr=f"*{in_dtype}", q_ptr="*u8", s_ptr="*fp32", amax_floor="fp32")
    constexprs = {
        "BLOCK_R": 128,
        "BLOCK_C": 128,
        "TILE_R": 128,
        "TILE_C": 128,
        "FP8_MAX": 448.0,
        "SOFTWARE_CVT": False,
        "x_stride_c": 1,  # what triton specializes a unit stride to
        "q_stride_c": 1,
    }
    signature.update({n: "constexpr" for n in constexprs})
    # What triton's launcher infers for 16-aligned pointers and sizes (7168 x 2048; a 2-D
    # input gets leading stride 0, also a multiple of 16).
    aligned = ["x_ptr", "q_ptr", "s_ptr", "rows", "cols"]
    aligned += ["x_stride_l", "x_stride_r", "q_stride_l", "q_stride_r"]
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton_compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert compiled.asm["cubin"], "ptxas produced no cubin"
    return str(compiled.asm["ptx"])


@requires_module("triton")
@pytest.mark.parametrize("in_dtype", ["bf16", "fp32"])
def test_sm90_code_uses_ieee_division_and_rne_cast(in_dtype: str) -> None:
    if fp8_triton._is_interpreted(fp8_triton._jit_module().fp8_block_quant_kernel):
        pytest.skip("TRITON_INTERPRET is set for this process; nothing is compiled")
    ptx = _compile_for_sm90(in_dtype)
    # IEEE round-to-nearest division (not div.full / div.approx / rcp: those differ in the
    # last bit), hardware round-to-nearest-even fp8 cast, vectorized loads and stores.
    assert "div.rn.f32" in ptx
    for approx in ("div.full", "div.approx", "rcp.approx"):
        assert approx not in ptx, approx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx


def _compile_table_for_sm90(aligned: bool) -> str:
    import triton.language as tl
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = fp8_triton._jit_module().fp8_table_quant_kernel
    names = [p.name for p in kernel.params]
    constexprs = {
        "X_DTYPE": tl.bfloat16,
        "ALIGNED": aligned,
        "BLOCK_R": 128,
        "BLOCK_C": 128,
        "TILE_R": 128,
        "TILE_C": 128,
        "FP8_MAX": 448.0,
        "SOFTWARE_CVT": False,
    }
    signature = {"units_ptr": "*i64", "block_unit_ptr": "*i32", "amax_floor": "fp32"}
    signature.update({n: "constexpr" for n in constexprs})
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={
            (names.index(n),): [["tt.divisibility", 16]] for n in ("units_ptr", "block_unit_ptr")
        },
    )
    compiled = triton_compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert compiled.asm["cubin"], "ptxas produced no cubin"
    return str(compiled.asm["ptx"])


@requires_module("triton")
def test_sm90_table_kernel_is_exact_and_vectorized_when_aligned() -> None:
    if fp8_triton._is_interpreted(fp8_triton._jit_module().fp8_table_quant_kernel):
        pytest.skip("TRITON_INTERPRET is set for this process; nothing is compiled")
    ptx = _compile_table_for_sm90(aligned=True)
    assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    for approx in ("div.full", "div.approx", "rcp.approx"):
        assert approx not in ptx, approx
    # The addresses come from a table, so only the ALIGNED hints make the accesses vectorized.
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    assert "ld.global.v4" not in _compile_table_for_sm90(aligned=False)


# ---------------------------------------------------------------------------------------------
# The compiled kernel on a GPU.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def compiled() -> None:
    if fp8_triton._is_interpreted(fp8_triton._jit_module().fp8_block_quant_kernel):
        pytest.skip("TRITON_INTERPRET is set for this process; the compiled kernel is not used")


GPU_CASES = [
    *CASES,
    ((8, 768, 256), torch.bfloat16, (128, 128)),
    ((2048, 2048), torch.bfloat16, (128, 128)),
]


@requires_cuda
@requires_module("triton")
@pytest.mark.parametrize(("shape", "dtype", "block"), GPU_CASES)
def test_gpu_equals_cpu_reference(
    compiled: None, shape: tuple[int, ...], dtype: torch.dtype, block: tuple[int, int]
) -> None:
    x = _make(shape, dtype, seed=sum(shape) + 1)
    got = quantize_fp8_blockwise_gpu(x.cuda(), block)
    _assert_same(got, quantize_fp8_blockwise(x, block))
    _assert_same(quantize_fp8(x.cuda(), block), quantize_fp8_blockwise(x, block))


@requires_cuda
@requires_module("triton")
def test_gpu_cast_rounding_exact(compiled: None) -> None:
    block = _conversion_block()
    x = torch.cat([block, block / 7.0], dim=1)
    _assert_same(quantize_fp8_blockwise_gpu(x.cuda()), quantize_fp8_blockwise(x))


@requires_cuda
@requires_module("triton")
def test_gpu_strided_input_into_out_slices(compiled: None) -> None:
    big = _make((2, 300, 700), torch.bfloat16, seed=21)
    x = big.cuda()[:, 20:280, 100:400]
    q_buf = torch.full((3, 270, 310), _SENTINEL, dtype=torch.uint8, device="cuda")
    s_buf = torch.full((3, 6, 8), -1.0, device="cuda")
    out_q = q_buf[1:, 5:265, 3:303].view(torch.float8_e4m3fn)
    out_s = s_buf[1:, 1:4, 2:5]
    quantize_fp8_blockwise_gpu(x, out_q=out_q, out_scale=out_s)
    _assert_same((out_q, out_s), quantize_fp8_blockwise(big[:, 20:280, 100:400]))
    q_buf[1:, 5:265, 3:303] = _SENTINEL
    s_buf[1:, 1:4, 2:5] = -1.0
    assert bool((q_buf == _SENTINEL).all()) and bool((s_buf == -1.0).all()), "wrote outside"


@requires_cuda
@requires_module("triton")
def test_gpu_writes_into_pinned_host_memory(compiled: None) -> None:
    x = _make((384, 512), torch.bfloat16, seed=22)
    out_q = torch.empty(x.shape, dtype=torch.float8_e4m3fn).pin_memory()
    out_s = torch.empty(scale_shape(tuple(x.shape)), dtype=torch.float32).pin_memory()
    quantize_fp8_blockwise_gpu(x.cuda(), out_q=out_q, out_scale=out_s)
    torch.cuda.synchronize()
    _assert_same((out_q, out_s), quantize_fp8_blockwise(x))


@requires_cuda
def test_gpu_rejects_out_on_other_device() -> None:
    x = torch.ones(4, 4, device="cuda")
    with pytest.raises(ConfigurationError, match="out_q.*w1.*cpu"):
        quantize_fp8(x, out_q=torch.empty(4, 4, dtype=torch.float8_e4m3fn), name="w1")
