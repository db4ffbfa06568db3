"""The tag-schema version: ap-tags stamps it on what it writes, and every reader refuses tags a
different schema wrote (a key whose meaning changed must never be silently misread)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from ap_tags import (
    MODULE_FQN,
    TAG_SCHEMA,
    TAG_SCHEMA_VERSION,
    TagError,
    TagSchemaError,
    annotate_module_fqns,
    is_must_save,
    mark_must_save,
    module_fqn,
    must_save_indices,
    validate_tags,
)
from ap_testing.graphs import Builder, snapshot
from torch.fx.experimental.proxy_tensor import make_fx


def _graph() -> tuple[torch.fx.GraphModule, torch.fx.Node]:
    b = Builder()
    x = b.ph("x")
    relu = b.op(torch.ops.aten.relu.default, (x,), "relu")
    return b.done(relu), relu


def test_writers_stamp_the_schema() -> None:
    _, relu = _graph()
    mark_must_save(relu)
    assert relu.meta["custom"][TAG_SCHEMA] == TAG_SCHEMA_VERSION

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).relu()

    model = M()
    with annotate_module_fqns(model):
        gm = make_fx(model)(torch.randn(2, 4))
    tagged = [n for n in gm.graph.nodes if (n.meta.get("custom") or {}).get(MODULE_FQN)]
    assert tagged and all(n.meta["custom"][TAG_SCHEMA] == TAG_SCHEMA_VERSION for n in tagged)


def test_another_schema_is_refused_by_every_reader_with_both_versions_named() -> None:
    gm, relu = _graph()
    relu.meta["custom"] = {"ap_must_save": True, TAG_SCHEMA: TAG_SCHEMA_VERSION + 1}
    before = snapshot(gm)
    expected = (
        f"tag schema {TAG_SCHEMA_VERSION + 1}; this ap-tags reads schema {TAG_SCHEMA_VERSION}"
    )
    for read in (is_must_save, must_save_indices, module_fqn, mark_must_save):
        with pytest.raises(TagSchemaError, match=expected) as info:
            read(relu)
        assert "relu" in str(info.value)
    with pytest.raises(TagSchemaError, match=expected):
        validate_tags(gm)
    assert issubclass(TagSchemaError, TagError)
    assert snapshot(gm) == before


def test_unstamped_tags_are_read_as_this_schema() -> None:
    gm, relu = _graph()
    relu.meta["custom"] = {"ap_must_save": True}  # hand-written, no stamp
    validate_tags(gm)
    assert is_must_save(relu)


@pytest.mark.parametrize("bad", ["1", True, None])
def test_a_malformed_stamp_is_a_schema_mismatch(bad: object) -> None:
    gm, relu = _graph()
    relu.meta["custom"] = {"ap_must_save": True, TAG_SCHEMA: bad}
    with pytest.raises(TagSchemaError):
        validate_tags(gm)
