"""FP8 block quantization: destination-layout quantization through recipes, scale shapes, and
the e4m3 error bound.

Error bound. float8_e4m3fn has 3 mantissa bits and a smallest normal of 2**-6. A scaled value
y = x / s (s = amax / 448, so |y| <= 448) in the binade [2**k, 2**(k+1)) lies on a grid of
spacing 2**(k-3); round-to-nearest is off by at most half of that, 2**(k-4) <= |y| * 2**-4.
Below 2**-6 the grid is the subnormal spacing 2**-9, so the error is at most 2**-10. Hence,
per element,  |dequant - x| <= max(|x| * 2**-4, s * 2**-10)  (+ float32 rounding of the
division and of the dequantizing product, < 2**-23 * (|x| + s)).
Per block, |y| <= 448 < 2**9 gives k <= 8, so |dequant - x| <= 2**4 * s = amax / 28: a step of
the largest binade (32 units of s) halved. (A bound of s * 2**-3 would be wrong: it confuses
the relative step 2**-3 with an absolute one; the test shows real errors exceed it.)
"""

from __future__ import annotations

import math

import pytest
import torch

from weight_transfer.planner.fp8 import (
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    scale_shape,
)
from weight_transfer.planner.presets.models import get_model_shape, hf_parameter_shapes
from weight_transfer.planner.presets.vllm import DEFAULT_MOE_PREFIX, vllm_recipes, vllm_tensor_specs
from weight_transfer.planner.recipes import engine_tensor_specs, fused_qkv, with_fp8
from weight_transfer.planner.reference import materialize

L0 = "model.layers.0."


def _wide(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Seeded random data spanning many binades (exercises normals and subnormals)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(2.0 * torch.randn(*shape, generator=g))
    return x.to(dtype)


def _sources(name: str, seed: int) -> dict[str, torch.Tensor]:
    hf = hf_parameter_shapes(get_model_shape(name))
    return {k: _wide(*dims, seed=seed + i) for i, (k, dims) in enumerate(hf.items())}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_materialize_quantizes_the_fused_sharded_destination(tp: int) -> None:
    shape = get_model_shape("tiny")
    src = _sources("tiny", seed=100 + tp)
    kv_chunks = min(tp, shape.num_kv_heads)
    for rank in range(tp):
        kv_idx = rank * kv_chunks // tp
        got = materialize(
            vllm_recipes(shape, rank, tp, fp8=True),
            vllm_tensor_specs(shape, rank, tp, fp8=True),
            src,
        )
        a, m = L0 + "self_attn.", L0 + "mlp."
        hand = {
            a + "qkv_proj.weight": torch.cat(
                [
                    src[a + "q_proj.weight"].chunk(tp)[rank],
                    src[a + "k_proj.weight"].chunk(kv_chunks)[kv_idx],
                    src[a + "v_proj.weight"].chunk(kv_chunks)[kv_idx],
                ]
            ),
            a + "o_proj.weight": src[a + "o_proj.weight"].chunk(tp, dim=1)[rank],
            m + "gate_up_proj.weight": torch.cat(
                [
                    src[m + "gate_proj.weight"].chunk(tp)[rank],
                    src[m + "up_proj.weight"].chunk(tp)[rank],
                ]
            ),
            m + "down_proj.weight": src[m + "down_proj.weight"].chunk(tp, dim=1)[rank],
        }
        for name, fused in hand.items():
            q, s = quantize_fp8_blockwise(fused)
            assert _bits_equal(got[name], q), name
            assert torch.equal(got[name + "_scale_inv"], s), name
        # Sizes that are not multiples of 128: the gate_up shard has 2 * 704 / tp rows.
        rows = 2 * 704 // tp
        assert got[m + "gate_up_proj.weight_scale_inv"].shape == (math.ceil(rows / 128), 2)
        assert got[L0 + "input_layernorm.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("tp", "w13_scale", "w2_scale"), [(1, (4, 6, 2), (4, 2, 3)), (2, (4, 3, 2), (4, 2, 2))]
)
def test_moe_fp8_per_expert_blocks(
    tp: int, w13_scale: tuple[int, ...], w2_scale: tuple[int, ...]
) -> None:
    shape = get_model_shape("tiny-moe")
    src = _sources("tiny-moe", seed=200 + tp)
    e = range(shape.num_experts)
    x = L0 + "mlp.experts."
    for rank in range(tp):
        got = materialize(
            vllm_recipes(shape, rank, tp, fp8=True),
            vllm_tensor_specs(shape, rank, tp, fp8=True),
            src,
        )
        w13 = torch.stack(
            [
                torch.cat(
                    [
                        src[f"{x}{i}.gate_proj.weight"].chunk(tp)[rank],
                        src[f"{x}{i}.up_proj.weight"].chunk(tp)[rank],
                    ]
                )
                for i in e
            ]
        )
        w2 = torch.stack([src[f"{x}{i}.down_proj.weight"].chunk(tp, dim=1)[rank] for i in e])
        p = L0 + DEFAULT_MOE_PREFIX + "."
        for name, fused, want_scale in (
            (p + "w13_weight", w13, w13_scale),
            (p + "w2_weight", w2, w2_scale),
        ):
            q, s = quantize_fp8_blockwise(fused)
            assert s.shape == want_scale
            assert _bits_equal(got[name], q), name
            assert torch.equal(got[name + "_scale_inv"], s), name
            # Experts are independent: expert 1 alone quantizes to the same bits.
            q1, s1 = quantize_fp8_blockwise(fused[1])
            assert _bits_equal(got[name][1], q1) and torch.equal(got[name + "_scale_inv"][1], s1)


def test_fused_block_straddles_parts() -> None:
    """At tp 2 the qkv shard's second row block holds k and v rows together: one scale for
    both, unlike quantizing k and v separately (what a per-source loader would do)."""
    q, k, v = _wide(256, 256, seed=1), _wide(64, 256, seed=2), _wide(64, 256, seed=3)
    k = k * 1000  # k's amax dominates the shared block
    recipe = with_fp8(
        fused_qkv(
            "qkv",
            "q",
            "k",
            "v",
            num_heads=8,
            num_kv_heads=2,
            head_dim=32,
            trailing=(256,),
            tp_rank=0,
            tp_size=2,
        )
    )
    got = materialize([recipe], engine_tensor_specs([recipe]), {"q": q, "k": k, "v": v})
    assert got["qkv_scale_inv"].shape == (2, 2)
    both = torch.cat([k[:32], v[:32]]).float().abs()
    assert torch.equal(
        got["qkv_scale_inv"][1], torch.stack([both[:, :128].amax(), both[:, 128:].amax()]) / 448
    )
    assert not _bits_equal(got["qkv"][160:], quantize_fp8_blockwise(v[:32])[0])


@pytest.mark.parametrize(
    ("shape", "block", "want"),
    [
        ((300, 200), (128, 128), (3, 2)),
        ((129, 1), (128, 128), (2, 1)),
        ((128, 128), (128, 128), (1, 1)),
        ((4, 352, 100), (128, 128), (4, 3, 1)),
        ((100, 100), (64, 32), (2, 4)),
    ],
)
def test_scale_shape_not_multiple_of_block(
    shape: tuple[int, ...], block: tuple[int, int], want: tuple[int, ...]
) -> None:
    assert scale_shape(shape, block) == want
    x = _wide(*shape, seed=sum(shape))
    q, s = quantize_fp8_blockwise(x, block)
    assert s.shape == want and q.shape == x.shape
    # Edge blocks use only their own elements.
    b0, b1 = block
    last = x[..., (want[-2] - 1) * b0 :, (want[-1] - 1) * b1 :].float().abs()
    assert torch.equal(s[..., -1, -1], last.amax(dim=(-2, -1)) / 448)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((300, 200), torch.bfloat16), ((3, 257, 130), torch.float32), ((1024, 512), torch.float32)],
)
def test_fp8_error_bound(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = _wide(*shape, seed=len(shape) * 1000 + shape[-1], dtype=dtype)
    q, s = quantize_fp8_blockwise(x)
    x32 = x.float()
    deq = dequantize_fp8_blockwise(q, s)
    err = (deq - x32).abs()
    scale = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., : shape[-2], : shape[-1]]
    rounding = 2.0**-23 * (x32.abs() + scale)
    per_element = torch.maximum(x32.abs() * 2.0**-4, scale * 2.0**-10) + rounding
    assert bool((err <= per_element).all()), float((err / per_element).max())
    # Per block: at most half a step of the largest binade, 16 * s = amax / 28.
    assert bool((err <= 16 * scale * (1 + 2.0**-20)).all())
    # The bound is tight on random data (the test could fail), and the naive s * 2**-3 is wrong.
    assert float((err / per_element).max()) > 0.9
    assert bool((err > scale * 2.0**-3).any())
    assert not torch.isnan(deq).any()


def test_zero_block_and_mixed_source_dtypes() -> None:
    x = _wide(256, 256, seed=9, dtype=torch.float32)
    x[:128, :128] = 0
    q, s = quantize_fp8_blockwise(x)
    assert torch.equal(q[:128, :128].float(), torch.zeros(128, 128))
    assert math.isfinite(float(s[0, 0])) and float(s[0, 0]) > 0
    # Parts of different float dtypes assemble in float32 before quantizing.
    qs, ks, vs = (
        _wide(256, 64, seed=10, dtype=torch.float32),
        _wide(64, 64, seed=11),
        _wide(64, 64, seed=12, dtype=torch.float16),
    )
    recipe = with_fp8(
        fused_qkv(
            "qkv",
            "q",
            "k",
            "v",
            num_heads=4,
            num_kv_heads=1,
            head_dim=64,
            trailing=(64,),
            tp_rank=0,
            tp_size=1,
        )
    )
    got = materialize([recipe], engine_tensor_specs([recipe]), {"q": qs, "k": ks, "v": vs})
    want_q, want_s = quantize_fp8_blockwise(torch.cat([qs, ks.float(), vs.float()]))
    assert _bits_equal(got["qkv"], want_q) and torch.equal(got["qkv_scale_inv"], want_s)
