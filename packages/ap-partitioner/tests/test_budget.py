"""The activation budget's pure pieces on small traced graphs: what a node costs to recompute
and which closure a dropped value drags along (the end-to-end policy is tested through the
backend in the repository's tests/test_activation_budget.py)."""

from __future__ import annotations

import torch
import torch.fx
from ap_partitioner._budget import (
    fit_to_budget,
    is_unsafe_to_recompute,
    node_cost,
    recompute_closure,
)
from ap_partitioner._rules import SavePlan
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


def _plan_graph() -> tuple[torch.fx.Graph, dict[str, torch.fx.Node]]:
    """``relu(x)`` (128 B, cheap: 256 B moved) and ``a @ b`` (1,024 B, 32,768 FLOPs)."""

    def fn(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).sum() + (a @ b).sum()

    gm = make_fx(fn, tracing_mode="fake")(
        torch.randn(4, 8), torch.randn(16, 64), torch.randn(64, 16)
    )
    return gm.graph, {n.name: n for n in gm.graph.nodes}


def test_the_drop_that_fits_makes_an_earlier_cheaper_drop_unnecessary() -> None:
    """The greedy drops ``relu`` first (best bytes per cost) and then ``mm`` to reach 1,000 B;
    after ``mm`` (1,024 B) the budget no longer needs ``relu`` dropped: it stays saved and
    only ``mm`` is recomputed (red when the prefix is kept as the greedy found it)."""
    graph, n = _plan_graph()
    plan = SavePlan([n["relu"], n["mm"]])
    outcome = fit_to_budget(graph, plan, 1_000)
    assert [d.name for d in outcome.dropped] == ["mm"]
    assert outcome.plan.values == [n["relu"]]
    assert outcome.after_bytes == 128 <= outcome.budget_bytes
    assert (outcome.recompute_flops, outcome.recompute_bytes_moved) == (2 * 16 * 64 * 16, 0)
    # a budget that needs both drops keeps both
    both = fit_to_budget(graph, plan, 0)
    assert {d.name for d in both.dropped} == {"relu", "mm"} and both.after_bytes == 0
    # and one the cheap drop alone meets is met by it alone
    cheap = fit_to_budget(graph, plan, 1_024)
    assert [d.name for d in cheap.dropped] == ["relu"]
