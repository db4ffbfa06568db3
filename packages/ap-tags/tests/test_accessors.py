"""Typed accessors: each reads/writes exactly its key and refuses malformed values."""

from __future__ import annotations

import ap_tags
import pytest
import torch
import torch.fx
from ap_tags import (
    FSDP_AC_GRAPH_ID,
    MODULE_FQN,
    MUST_SAVE,
    MUST_SAVE_INDICES,
    TAG_SCHEMA,
    TAG_SCHEMA_VERSION,
    TagError,
    ac_graph_id,
    is_must_save,
    mark_must_save,
    module_fqn,
    must_save_indices,
    recompute_policy,
    set_recompute,
)
from torch.utils.checkpoint import CheckpointPolicy


def _node(name: str = "n") -> torch.fx.Node:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.ops.aten.relu.default, (x,), name=name)
    g.output(n)
    return n


def test_key_constants_are_the_contract() -> None:
    assert ap_tags.MUST_SAVE == "ap_must_save"
    assert ap_tags.MUST_SAVE_INDICES == "ap_must_save_getitem_indices"
    assert ap_tags.MODULE_FQN == "module_fqn"
    assert ap_tags.FSDP_AC_GRAPH_ID == 100000
    assert ap_tags.RECOMPUTE == "recompute" and ap_tags.AC_GRAPH_ID == "ac_graph_id"
    assert set(ap_tags.__all__) <= set(dir(ap_tags))
    from ap_tags._version import __version__ as written  # the one place it is written

    assert ap_tags.__version__ == written


def test_mark_must_save_plain() -> None:
    n = _node()
    assert not is_must_save(n)
    assert must_save_indices(n) == ()
    mark_must_save(n)
    assert n.meta["custom"] == {MUST_SAVE: True, TAG_SCHEMA: TAG_SCHEMA_VERSION}
    assert is_must_save(n)
    assert must_save_indices(n) == ()


def test_mark_must_save_index_unique_in_order_and_marks_parent() -> None:
    n = _node()
    n.meta["custom"] = {"other": 1}
    mark_must_save(n, 2)
    mark_must_save(n, 0)
    mark_must_save(n, 2)
    assert n.meta["custom"] == {
        "other": 1,
        MUST_SAVE: True,
        MUST_SAVE_INDICES: [2, 0],
        TAG_SCHEMA: TAG_SCHEMA_VERSION,
    }
    assert must_save_indices(n) == (2, 0)
    assert is_must_save(n)


@pytest.mark.parametrize("bad", [-1, True, 1.0, "0"])
def test_mark_must_save_rejects_bad_index_and_writes_nothing(bad: object) -> None:
    n = _node("bad_idx")
    with pytest.raises(TagError, match="bad_idx"):
        mark_must_save(n, bad)  # type: ignore[arg-type]
    assert "custom" not in n.meta


def test_readers_raise_on_malformed_values() -> None:
    n = _node("m")
    n.meta["custom"] = {MUST_SAVE: 1, MUST_SAVE_INDICES: [0, 0], MODULE_FQN: 3}
    with pytest.raises(TagError, match="m: ap_must_save must be bool"):
        is_must_save(n)
    with pytest.raises(TagError, match="duplicate"):
        must_save_indices(n)
    with pytest.raises(TagError, match="module_fqn must be str"):
        module_fqn(n)
    n.meta["custom"] = ["not", "a", "dict"]
    with pytest.raises(TagError, match="not dict"):
        is_must_save(n)


def test_recompute_policy_and_set_recompute() -> None:
    n = _node()
    assert recompute_policy(n) is None and ac_graph_id(n) is None
    set_recompute(n, CheckpointPolicy.MUST_RECOMPUTE)
    assert recompute_policy(n) is CheckpointPolicy.MUST_RECOMPUTE
    assert ac_graph_id(n) == FSDP_AC_GRAPH_ID
    set_recompute(n, CheckpointPolicy.PREFER_SAVE, ac_graph_id=3)
    assert recompute_policy(n) is CheckpointPolicy.PREFER_SAVE and ac_graph_id(n) == 3


def test_recompute_accessors_refuse_bare_ints() -> None:
    n = _node("r")
    n.meta["recompute"] = 2  # the int value of MUST_RECOMPUTE, but not the enum
    with pytest.raises(TagError, match="r: recompute must be a CheckpointPolicy"):
        recompute_policy(n)
    n.meta["ac_graph_id"] = "1"
    with pytest.raises(TagError, match="ac_graph_id must be an int"):
        ac_graph_id(n)
    m = _node("w")
    with pytest.raises(TagError, match="CheckpointPolicy"):
        set_recompute(m, 2)
    with pytest.raises(TagError, match="ac_graph_id"):
        set_recompute(m, CheckpointPolicy.MUST_SAVE, ac_graph_id=True)
    assert "recompute" not in m.meta and "ac_graph_id" not in m.meta


def test_module_fqn_prefers_custom_then_nn_module_stack() -> None:
    n = _node()
    assert module_fqn(n) is None
    n.meta["nn_module_stack"] = {
        "a": ("layers.1", torch.nn.Module),
        "b": ("layers.1.mlp", torch.nn.Module),
    }
    assert module_fqn(n) == "layers.1.mlp"
    n.meta["nn_module_stack"] = {
        "a": ("L['self'].layers[1]", torch.nn.Module),
        "b": ("L['self'].layers[1].mlp", torch.nn.Module),
    }
    assert module_fqn(n) == "layers.1.mlp"
    n.meta["nn_module_stack"]["b"] = (
        "L['self']._modules['layers']._modules['1']._modules['mlp']",
        torch.nn.Module,
    )
    assert module_fqn(n) == "layers.1.mlp"
    # a ModuleDict with numeric keys (torchtitan's ``layers``), as Dynamo spells it
    n.meta["nn_module_stack"]["b"] = ("getattr(L['self'].layers, '1').mlp", torch.nn.Module)
    assert module_fqn(n) == "layers.1.mlp"
    # a parametrization's module (SimpleFSDP): no submodule; the entry outside it owns the weight
    n.meta["nn_module_stack"]["c"] = (
        "dict(type(L['self'].layers[1].mlp).__dict__)['weight'].fget.__closure__[0].cell_contents",
        torch.nn.Module,
    )
    assert module_fqn(n) == "layers.1.mlp"
    n.meta["custom"] = {MODULE_FQN: "layers.0.attn"}
    assert module_fqn(n) == "layers.0.attn"
