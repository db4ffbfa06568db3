"""``ap_tags.tracing``: the one reading of AOTAutograd's input descriptors and of scalar reads
that ap-epchunk's mark matching and ap-backend's nested-region check share."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from ap_tags.tracing import aot_input_index, scalar_outputs_allowed
from torch._functorch._aot_autograd.descriptors import (
    ParamAOTInput,
    PlainAOTInput,
    SubclassGetAttrAOTInput,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv


def _placeholders(*descs: object) -> list[torch.fx.Node]:
    g = torch.fx.Graph()
    nodes = []
    for i, desc in enumerate(descs):
        node = g.placeholder(f"arg{i}")
        if desc is not None:
            node.meta["desc"] = desc
        nodes.append(node)
    return nodes


def test_plain_inputs_answer_their_index_and_subclass_pieces_only_when_asked() -> None:
    plain, inner, param, bare = _placeholders(
        PlainAOTInput(3),
        SubclassGetAttrAOTInput(PlainAOTInput(5), "_local_tensor"),
        ParamAOTInput("w"),
        None,
    )
    assert aot_input_index(plain) == 3
    # a DTensor argument is one placeholder per inner tensor: not the argument "as a whole"
    assert aot_input_index(inner) is None
    assert aot_input_index(inner, through_subclasses=True) == 5
    assert aot_input_index(param) is None and aot_input_index(bare) is None


def test_aot_input_index_refuses_a_non_node() -> None:
    with pytest.raises(TypeError, match="aot_input_index"):
        aot_input_index("arg0")  # type: ignore[arg-type]


def test_scalar_outputs_allowed_sets_and_restores_the_fake_mode_flag() -> None:
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x = torch.empty(4)
    assert not mode.allow_scalar_outputs
    with scalar_outputs_allowed([x]):
        assert mode.allow_scalar_outputs
    assert not mode.allow_scalar_outputs
    with scalar_outputs_allowed([torch.empty(4)]):  # no fake mode: nothing to change
        pass
