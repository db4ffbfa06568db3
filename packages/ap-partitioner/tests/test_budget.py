"""The activation budget's pure pieces on small traced graphs: what a node costs to recompute
and which closure a dropped value drags along (the end-to-end policy is tested through the
backend in the repository's tests/test_activation_budget.py)."""

from __future__ import annotations

import torch
import torch.fx
from ap_partitioner._budget import is_unsafe_to_recompute, node_cost, recompute_closure
from torch.fx.experimental.proxy_tensor import make_fx


def _graph(fn: object, *args: torch.Tensor) -> dict[str, torch.fx.Node]:
    gm = make_fx(fn, tracing_mode="fake")(*args)  # type: ignore[arg-type]
    return {n.name: n for n in gm.graph.nodes}


def test_matmuls_cost_flops_and_pointwise_ops_cost_bytes_moved() -> None:
    n = _graph(lambda x, w: torch.relu(x @ w).sum(), torch.randn(4, 8), torch.randn(8, 16))
    assert node_cost(n["mm"]) == (2 * 4 * 8 * 16, 0)
    assert node_cost(n["relu"]) == (0, 2 * 4 * 16 * 4)  # read + write, fp32
    assert node_cost(n["sum_1"]) == (0, 4 * 16 * 4 + 4)


def test_the_closure_stops_at_available_values_and_refuses_random_ops() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ w)
        return torch.sigmoid(h) * torch.rand_like(h)

    n = _graph(fn, torch.randn(4, 8), torch.randn(8, 16))
    inputs = {n["x_1"], n["w_1"]}
    assert [m.name for m in recompute_closure(n["sigmoid"], inputs | {n["relu"]}) or []] == [
        "sigmoid"
    ]
    assert {m.name for m in recompute_closure(n["sigmoid"], inputs) or []} == {
        "sigmoid",
        "relu",
        "mm",
    }
    rand = next(m for name, m in n.items() if name.startswith("rand"))
    assert is_unsafe_to_recompute(rand)
    assert recompute_closure(n["mul"], inputs | {n["sigmoid"]}) is None
