"""Source manifests from live tensors: tied parameters are one source with aliases."""

from __future__ import annotations

import torch

from weight_transfer.manifest import named_tensors, source_manifest, tied_names


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.mid = torch.nn.Linear(4, 4, bias=False)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tied_module_parameters_are_one_source_under_their_first_name() -> None:
    m = _Tied()
    manifest = source_manifest(named_tensors(m), rank=0, world_size=1, compute_device="cpu")
    by_name = {t.name: t for t in manifest.tensors}
    assert sorted(by_name) == ["embed.weight", "mid.weight"]
    assert by_name["embed.weight"].aliases == ("head.weight",)
    assert by_name["mid.weight"].aliases == ()


def test_state_dict_views_of_one_weight_are_tied_and_distinct_memory_is_not() -> None:
    m = _Tied()
    sd = m.state_dict(keep_vars=False)  # detached views: distinct objects, one memory
    assert sd["embed.weight"] is not sd["head.weight"]
    assert tied_names(sd) == {"embed.weight": ("head.weight",), "mid.weight": ()}
    # Equal values in other memory, or another view of the same storage, are not ties.
    base = torch.randn(8, 4)
    other = {"a": base[:4], "b": base[4:], "c": base[:4].clone(), "d": base[:4].t()}
    assert tied_names(other) == {"a": (), "b": (), "c": (), "d": ()}
    # Empty shards (an FSDP rank holding no rows) share no memory, whatever their pointers say.
    empty = {"x": torch.empty(0, 4), "y": torch.empty(0, 4)}
    assert tied_names(empty) == {"x": (), "y": ()}
