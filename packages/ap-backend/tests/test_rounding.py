"""The default first partition keeps torch's recompute ban on values that round through low
precision (``ap_backend._rounding``); the end-to-end check is ``tests/test_saved_set_replay.py``'s
``bf16_silu`` case, bit-exact against stock ``torch.compile``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from ap_backend._rounding import KEPT_BAN, clear_kept_bans, rounds_through_low_precision
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy


def _graph(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.fx.GraphModule:
    gm: torch.fx.GraphModule = make_fx(fn, tracing_mode="fake")(x)
    return gm


def _last(gm: torch.fx.GraphModule) -> torch.fx.Node:
    (out,) = gm.graph.output_node().all_input_nodes
    return out


def _ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize(
    ("name", "fn", "dtype", "rounds"),
    [
        # a user's downcast, then an upcast: the pair Inductor may elide in one kernel only
        (
            "narrow_then_widen",
            lambda x: F.silu(x.to(torch.bfloat16)).float() * 2,
            torch.float32,
            True,
        ),
        (
            "bf16_to_fp16_then_widen",
            lambda x: x.to(torch.float16).float() + 1,
            torch.bfloat16,
            True,
        ),
        # a norm's pattern in bf16 mixed precision: widen, compute, narrow at the end
        (
            "widen_then_narrow",
            lambda x: (x.float() * 2).to(torch.bfloat16) * x,
            torch.bfloat16,
            False,
        ),
        ("fp32_only", lambda x: F.silu(x) * x, torch.float32, False),
        ("narrow_only", lambda x: (x * 2).to(torch.bfloat16), torch.float32, False),
    ],
)
def test_rounds_through_low_precision(
    name: str, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, rounds: bool
) -> None:
    gm = _graph(fn, torch.randn(4, 8, dtype=dtype))
    assert rounds_through_low_precision(_last(gm), _ops(gm)) is rounds, gm.code


def test_a_non_fusible_op_ends_the_region() -> None:
    """The narrowing happened before a matmul: the recomputation starts after it, from a saved
    value, so the pair is not in one kernel's reach."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.bfloat16).float()
        return (h @ h.t()) * 2

    gm = _graph(fn, torch.randn(4, 8))
    ops = _ops(gm)
    fusible = [n for n in ops if n.target is not torch.ops.aten.mm.default]
    assert rounds_through_low_precision(_last(gm), fusible) is False
    assert rounds_through_low_precision(_last(gm), ops) is True


def test_clear_kept_bans_removes_only_its_own_tags() -> None:
    gm = _graph(lambda x: (x * 2).sin(), torch.randn(4))
    mul, sin = _ops(gm)
    mul.meta.update({"recompute": CheckpointPolicy.MUST_SAVE, KEPT_BAN: True})
    sin.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # a user's tag
    clear_kept_bans(gm)
    assert "recompute" not in mul.meta and KEPT_BAN not in mul.meta
    assert sin.meta["recompute"] == CheckpointPolicy.MUST_SAVE
