"""The vLLM preset against vLLM 0.33.0's own layouts (tests/fixtures/vllm_layouts.txt)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from weight_transfer.backends.base import ConfigurationError
from weight_transfer.planner.presets.models import (
    ModelShape,
    from_hf_config,
    get_model_shape,
    hf_parameter_shapes,
    num_parameters,
)
from weight_transfer.planner.presets.vllm import (
    DEFAULT_MOE_PREFIX,
    VLLM_VERSION,
    vllm_recipes,
    vllm_tensor_specs,
    vocab_rows,
)
from weight_transfer.planner.recipes import recipe_shape
from weight_transfer.planner.types import Recipe, box_in, full_box

ORACLE = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_layouts.txt"
LAYER = "model.layers.0."

_HEADER = re.compile(r"^(cfg_\w+) tp=(\d+) rank=(\d+):")
_PARAM = re.compile(r"^\s+(\S+) \[([\d, ]+)\](?: (\w+))? unwritten=(\d+): (?:e0: )?(.*)$")
_ENTRY = re.compile(r"\[(\d+):(\d+)\]<-(\S+?)\[(\d+):(\d+),(\d+):(\d+)\]")


@dataclasses.dataclass(frozen=True)
class OracleParam:
    name: str
    shape: tuple[int, ...]
    dtype: str | None
    unwritten: int
    entries: tuple[tuple[tuple[int, int], str, tuple[int, int], tuple[int, int]], ...]
    """(dest rows, source, source rows, source cols); for MoE lines, those of expert 0."""


@dataclasses.dataclass(frozen=True)
class OracleBlock:
    cfg: str
    tp_size: int
    tp_rank: int
    params: tuple[OracleParam, ...]


def parse_oracle(text: str) -> list[OracleBlock]:
    blocks: list[OracleBlock] = []
    params: list[OracleParam] = []
    head: tuple[str, int, int] | None = None
    for line in text.splitlines() + ["cfg_end tp=0 rank=0:"]:
        if not line.strip() or line.startswith("#"):
            continue
        m = _HEADER.match(line)
        if m:
            if head is not None:
                blocks.append(OracleBlock(*head, params=tuple(params)))
            head, params = (m.group(1), int(m.group(2)), int(m.group(3))), []
            continue
        p = _PARAM.match(line)
        assert p is not None, f"unparsed oracle line: {line!r}"
        entries = tuple(
            ((int(a), int(b)), src, (int(r0), int(r1)), (int(c0), int(c1)))
            for a, b, src, r0, r1, c0, c1 in _ENTRY.findall(p.group(5))
        )
        assert entries, f"no entries in oracle line: {line!r}"
        params.append(
            OracleParam(
                name=p.group(1),
                shape=tuple(int(x) for x in p.group(2).split(",")),
                dtype=p.group(3),
                unwritten=int(p.group(4)),
                entries=entries,
            )
        )
    return blocks


BLOCKS = parse_oracle(ORACLE.read_text())
SHAPES = {"cfg_a": get_model_shape("tiny"), "cfg_moe": get_model_shape("tiny-moe")}


def test_oracle_is_complete() -> None:
    """The oracle has every rank of cfg_a at tp 1/2/4/8 and cfg_moe at tp 1/2."""
    seen = {(b.cfg, b.tp_size, b.tp_rank) for b in BLOCKS}
    want = {("cfg_a", tp, r) for tp in (1, 2, 4, 8) for r in range(tp)}
    want |= {("cfg_moe", tp, r) for tp in (1, 2) for r in range(tp)}
    assert seen == want
    assert len(BLOCKS) == len(want)
    assert sum(len(b.params) for b in BLOCKS) == 15 * 4 + 3 * 2


def _dense_entries(recipe: Recipe, cols: int) -> list[tuple[object, ...]]:
    out = []
    for part in recipe.parts:
        assert len(part.dest_box) == 2
        assert part.dest_box[1] == (0, cols), "a part must fill every dest column"
        (r0, r1), (c0, c1) = part.source_box
        out.append((part.dest_box[0], part.source.removeprefix(LAYER), (r0, r1), (c0, c1)))
    return sorted(out, key=str)


@pytest.mark.parametrize(
    "block", BLOCKS, ids=[f"{b.cfg}-tp{b.tp_size}-rank{b.tp_rank}" for b in BLOCKS]
)
def test_preset_matches_vllm_layout(block: OracleBlock) -> None:
    shape = SHAPES[block.cfg]
    recipes = {r.dest: r for r in vllm_recipes(shape, block.tp_rank, block.tp_size)}
    specs = {s.name: s for s in vllm_tensor_specs(shape, block.tp_rank, block.tp_size)}
    for param in block.params:
        name = LAYER + param.name
        assert name in recipes, f"{name} missing from the preset"
        recipe = recipes[name]
        assert param.unwritten == 0
        assert recipe_shape(recipe) == param.shape  # also checks exact cover
        assert specs[name].shape == param.shape
        assert specs[name].dtype == (param.dtype or "bfloat16")
        want = sorted(param.entries, key=str)
        if len(param.shape) == 2:
            assert _dense_entries(recipe, param.shape[1]) == want
            continue
        # MoE: the oracle prints expert 0; every expert follows the same pattern.
        num_experts = param.shape[0]
        assert num_experts == shape.num_experts
        for e in range(num_experts):
            mine = [
                dataclasses.replace(p, dest_box=p.dest_box[1:])
                for p in recipe.parts
                if p.dest_box[0] == (e, e + 1)
            ]
            sub = Recipe(dest=name, parts=tuple(mine))
            expert_want = sorted(
                ((d, s.replace("experts.0.", f"experts.{e}."), r, c) for d, s, r, c in want),
                key=str,
            )
            assert _dense_entries(sub, param.shape[2]) == expert_want, f"expert {e}"
        assert len(recipe.parts) == num_experts * len(want)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "llama-3.1-8b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
@pytest.mark.parametrize("moe_layout", ["per_expert", "fused"])
def test_sources_exist_and_every_element_is_sent(name: str, tp_size: int, moe_layout: str) -> None:
    """Every recipe reads existing HF tensors inside their bounds, and over all ranks every
    element of every HF tensor reaches the engine (replicated tensors on every rank)."""
    shape = get_model_shape(name)
    if name in ("llama-3.1-8b", "qwen3-30b-a3b"):
        shape = dataclasses.replace(shape, num_layers=1)
    hf = hf_parameter_shapes(shape, moe_layout=moe_layout)  # type: ignore[arg-type]
    received = dict.fromkeys(hf, 0)
    for rank in range(tp_size):
        for recipe in vllm_recipes(shape, rank, tp_size, hf_moe_layout=moe_layout):  # type: ignore[arg-type]
            recipe_shape(recipe)
            for part in recipe.parts:
                assert part.source in hf, f"{recipe.dest} reads unknown {part.source}"
                assert box_in(part.source_box, full_box(hf[part.source]))
                received[part.source] += math.prod(b - a for a, b in part.source_box)
    for src, dims in hf.items():
        n = math.prod(dims)
        kv = src.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))
        replicated = len(dims) == 1 or src.endswith(
            ("mlp.gate.weight", "shared_expert_gate.weight")
        )
        if replicated:
            assert received[src] == n * tp_size, src
        elif kv and tp_size > shape.num_kv_heads:
            assert received[src] == n * (tp_size // shape.num_kv_heads), src
        else:
            assert received[src] == n, src


def test_fp8_applies_to_linear_weights_only() -> None:
    shape = dataclasses.replace(
        get_model_shape("tiny-moe"),
        shared_expert_intermediate_size=256,
        qkv_bias=True,
        qk_norm=True,
    )
    recipes = vllm_recipes(shape, 1, 2, fp8=True)
    quantized = {
        r.dest.removeprefix(LAYER) for r in recipes if r.quant and r.dest.startswith(LAYER)
    }
    assert quantized == {
        "self_attn.qkv_proj.weight",
        "self_attn.o_proj.weight",
        f"{DEFAULT_MOE_PREFIX}.w13_weight",
        f"{DEFAULT_MOE_PREFIX}.w2_weight",
        "mlp.shared_expert.gate_up_proj.weight",
        "mlp.shared_expert.down_proj.weight",
    }
    for r in recipes:
        if r.quant is not None:
            assert r.quant.scale_dest == r.dest + "_scale_inv"
            assert r.quant.block == (128, 128)
    unquantized = {
        r.dest.split(".", 3)[-1] if r.dest.startswith("model.layers.") else r.dest
        for r in recipes
        if r.quant is None
    }
    assert unquantized == {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "self_attn.qkv_proj.bias",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate.weight",
        "mlp.shared_expert_gate.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    }
    specs = {s.name: s for s in vllm_tensor_specs(shape, 1, 2, fp8=True)}
    w13 = LAYER + f"{DEFAULT_MOE_PREFIX}.w13_weight"
    assert specs[w13].shape == (4, 384, 256) and specs[w13].dtype == "float8_e4m3fn"
    assert specs[w13 + "_scale_inv"].shape == (4, 3, 2)
    assert specs[w13 + "_scale_inv"].dtype == "float32"
    assert specs["model.embed_tokens.weight"].dtype == "bfloat16"
    assert specs["lm_head.weight"].dtype == "bfloat16"


def test_real_model_shapes() -> None:
    llama = vllm_tensor_specs(
        dataclasses.replace(get_model_shape("llama-3.1-8b"), num_layers=1), 3, 8, fp8=True
    )
    s = {t.name: t.shape for t in llama}
    assert s[LAYER + "self_attn.qkv_proj.weight"] == (512 + 128 + 128, 4096)
    assert s[LAYER + "self_attn.qkv_proj.weight_scale_inv"] == (6, 32)
    assert s[LAYER + "self_attn.o_proj.weight"] == (4096, 512)
    assert s[LAYER + "mlp.gate_up_proj.weight"] == (2 * 1792, 4096)
    assert s[LAYER + "mlp.gate_up_proj.weight_scale_inv"] == (28, 32)
    assert s[LAYER + "mlp.down_proj.weight"] == (4096, 1792)
    assert s["model.embed_tokens.weight"] == (128256 // 8, 4096)
    qwen = dataclasses.replace(get_model_shape("qwen3-30b-a3b"), num_layers=1)
    s = {t.name: t.shape for t in vllm_tensor_specs(qwen, 5, 8)}
    # tp 8 > 4 kv heads: each rank holds 4 query heads and one (replicated) kv head.
    assert s[LAYER + "self_attn.qkv_proj.weight"] == (4 * 128 + 128 + 128, 2048)
    assert s[LAYER + f"{DEFAULT_MOE_PREFIX}.w13_weight"] == (128, 2 * 96, 2048)
    assert s[LAYER + f"{DEFAULT_MOE_PREFIX}.w2_weight"] == (128, 2048, 96)
    assert s[LAYER + "self_attn.q_norm.weight"] == (128,)
    assert s[LAYER + "mlp.gate.weight"] == (128, 2048)
    assert VLLM_VERSION == "0.33.0"


def test_kv_head_replication_in_preset() -> None:
    """tp 8 over 2 kv heads: ranks 0-3 hold kv head 0, ranks 4-7 kv head 1."""
    shape = get_model_shape("tiny")
    for rank in range(8):
        recipe = next(
            r for r in vllm_recipes(shape, rank, 8) if r.dest == LAYER + "self_attn.qkv_proj.weight"
        )
        q, k, v = recipe.parts
        head = rank // 4
        assert q.source_box[0] == (rank * 32, rank * 32 + 32)
        assert k.source_box[0] == v.source_box[0] == (head * 32, head * 32 + 32)


def test_tied_embeddings_have_no_lm_head() -> None:
    shape = dataclasses.replace(get_model_shape("tiny"), tie_word_embeddings=True)
    names = {r.dest for r in vllm_recipes(shape, 0, 2)}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_moe_prefix_is_a_parameter() -> None:
    names = {
        r.dest for r in vllm_recipes(get_model_shape("tiny-moe"), 0, 1, moe_prefix="mlp.experts")
    }
    assert LAYER + "mlp.experts.w13_weight" in names
    assert LAYER + "mlp.experts.w2_weight" in names


def test_vocab_rows_follow_vllm_padding() -> None:
    # vocab 1000 pads to 1024: rank 0 holds rows 0-511, rank 1 rows 512-999 (+24 padding).
    assert [vocab_rows(1000, r, 2) for r in range(2)] == [(0, 512), (512, 1000)]
    assert [vocab_rows(1000, r, 4) for r in range(4)] == [
        (0, 256),
        (256, 512),
        (512, 768),
        (768, 1000),
    ]
    assert vocab_rows(128256, 7, 8) == (7 * 16032, 128256)
    with pytest.raises(ConfigurationError, match="embed_tokens.*not divisible by tp_size 3"):
        vocab_rows(1000, 0, 3)
    with pytest.raises(ConfigurationError, match="only vocabulary padding"):
        vocab_rows(10, 1, 2)


@pytest.mark.parametrize(
    ("shape", "tp_size", "match"),
    [
        # vocab 960 pads to 960 = 3 * 320, so the heads are what fails.
        (
            dataclasses.replace(get_model_shape("tiny"), vocab_size=960),
            3,
            r"qkv_proj.weight.*num_heads=8, num_kv_heads=2, tp_size=3",
        ),
        (
            ModelShape(
                vocab_size=1024,
                hidden_size=256,
                intermediate_size=700,
                num_layers=1,
                num_heads=8,
                num_kv_heads=8,
                head_dim=32,
            ),
            8,
            r"mlp.gate_up_proj.weight \(intermediate 700\)"
            r".*not divisible by tensor-parallel size 8",
        ),
        (
            ModelShape(
                vocab_size=1024,
                hidden_size=256,
                intermediate_size=512,
                num_layers=1,
                num_heads=12,
                num_kv_heads=3,
                head_dim=32,
            ),
            2,
            r"qkv_proj.weight.*num_kv_heads=3, tp_size=2",
        ),
        (
            ModelShape(
                vocab_size=1024,
                hidden_size=256,
                intermediate_size=512,
                num_layers=1,
                num_heads=12,
                num_kv_heads=3,
                head_dim=32,
            ),
            4,
            r"qkv_proj.weight.*num_heads=12, num_kv_heads=3, tp_size=4",
        ),
        (
            ModelShape(
                vocab_size=768,
                hidden_size=256,
                intermediate_size=512,
                num_layers=1,
                num_heads=12,
                num_kv_heads=4,
                head_dim=32,
            ),
            6,
            r"num_kv_heads=4, tp_size=6.*multiple of num_kv_heads",
        ),
        (
            dataclasses.replace(get_model_shape("tiny-moe"), moe_intermediate_size=385),
            2,
            r"w13_weight \(moe_intermediate_size 385\).*not divisible",
        ),
    ],
)
def test_indivisible_sizes_error_naming_the_tensor(
    shape: ModelShape, tp_size: int, match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match) as info:
        vllm_recipes(shape, 0, tp_size)
    assert isinstance(info.value, ValueError)


def test_bad_rank_and_layout() -> None:
    with pytest.raises(ConfigurationError, match="tp_rank 2"):
        vllm_recipes(get_model_shape("tiny"), 2, 2)
    with pytest.raises(ConfigurationError, match="hf_moe_layout"):
        vllm_recipes(get_model_shape("tiny"), 0, 1, hf_moe_layout="stacked")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Model shapes (planner.presets.models)
# ---------------------------------------------------------------------------------------------

_SMALL = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("config_cls", "extra", "tied"),
    [
        ("LlamaConfig", {}, False),
        ("LlamaConfig", {"tie_word_embeddings": True}, True),
        ("Qwen2Config", {}, False),
        ("Qwen3Config", {"head_dim": 24}, False),
        (
            "Qwen3MoeConfig",
            {"num_experts": 4, "moe_intermediate_size": 40, "num_experts_per_tok": 2},
            False,
        ),
        (
            "Qwen2MoeConfig",
            {
                "num_experts": 4,
                "moe_intermediate_size": 40,
                "shared_expert_intermediate_size": 48,
                "num_experts_per_tok": 2,
            },
            False,
        ),
    ],
)
def test_hf_parameter_shapes_match_transformers_modules(
    config_cls: str, extra: dict[str, object], tied: bool
) -> None:
    """Names and shapes equal a real transformers model's parameters (built on meta).

    transformers >= 5 holds experts stacked ("fused"); per-expert names are the checkpoints'.
    """
    import torch
    import transformers

    cfg = getattr(transformers, config_cls)(**_SMALL, **extra)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    actual = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shape = from_hf_config(cfg)
    assert shape.tie_word_embeddings == tied
    assert shape == from_hf_config(cfg.to_dict())
    assert hf_parameter_shapes(shape, moe_layout="fused") == actual
    # Every engine tensor of every rank builds from these names.
    for rank in range(2):
        for recipe in vllm_recipes(shape, rank, 2, hf_moe_layout="fused"):
            for part in recipe.parts:
                assert box_in(part.source_box, full_box(actual[part.source])), recipe.dest


def test_from_hf_config_dict_and_errors() -> None:
    shape = from_hf_config(
        {**_SMALL, "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32}
    )
    assert shape.is_moe and shape.qk_norm and not shape.qkv_bias
    assert shape.head_dim == 16 and shape.num_kv_heads == 2 and not shape.tie_word_embeddings
    assert from_hf_config({**_SMALL, "num_key_value_heads": None}).num_kv_heads == 4
    with pytest.raises(ValueError, match="lacks required keys \\['hidden_size'\\]"):
        from_hf_config({k: v for k, v in _SMALL.items() if k != "hidden_size"})
    with pytest.raises(
        ValueError, match="interleaves dense and MoE layers.*mlp_only_layers=\\[0\\]"
    ):
        from_hf_config(
            {**_SMALL, "num_experts": 8, "moe_intermediate_size": 32, "mlp_only_layers": [0]}
        )
    with pytest.raises(ValueError, match="attention_bias=True"):
        from_hf_config({**_SMALL, "attention_bias": True})


def test_named_shapes_and_validation() -> None:
    tiny = get_model_shape("tiny")
    assert (
        tiny.hidden_size,
        tiny.num_heads,
        tiny.num_kv_heads,
        tiny.head_dim,
        tiny.intermediate_size,
        tiny.num_layers,
        tiny.vocab_size,
    ) == (256, 8, 2, 32, 704, 2, 1000)
    moe = get_model_shape("tiny-moe")
    assert (moe.num_experts, moe.moe_intermediate_size, moe.hidden_size) == (4, 384, 256)
    qwen = get_model_shape("qwen3-30b-a3b")
    # About 30.5 B parameters, 48 layers of 128 experts.
    assert 30.0e9 < num_parameters(qwen) < 31.0e9
    assert 8.0e9 < num_parameters(get_model_shape("llama-3.1-8b")) < 8.1e9
    with pytest.raises(
        ValueError,
        match="unknown model shape 'gpt'; known: llama-3.1-8b, qwen3-30b-a3b, tiny, tiny-moe",
    ):
        get_model_shape("gpt")
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        dataclasses.replace(tiny, num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="needs moe_intermediate_size > 0"):
        dataclasses.replace(tiny, num_experts=4)
    with pytest.raises(ValueError, match="ModelShape.hidden_size must be a positive int"):
        dataclasses.replace(tiny, hidden_size=0)
    with pytest.raises(ValueError, match="moe_layout must be one of"):
        hf_parameter_shapes(tiny, moe_layout="stacked")  # type: ignore[arg-type]
