"""Synthetic collective graphs for tests and benchmarks (no process group, never executed).

Builds FX graphs with the exact shape torch's bucketing predicates expect: functional
``_c10d_functional`` collectives with positional ``group_size``/``group_name`` arguments, a
``wait_tensor`` per collective, and ``meta['val']`` tensors on the meta device (``fakeify``
turns them into CPU fake tensors where torch's merging traces through fake mode).
``random_collective_graphs`` is the hypothesis strategy behind the bucketing properties.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy

from .graphs import fakeify

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


class GraphBuilder:
    """Append-only builder of a synthetic collective graph."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.graph = fx.Graph()
        self.dtype = dtype
        self._count = 0

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def _val(self, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype or self.dtype, device="meta")

    def placeholder(self, shape: Sequence[int], dtype: torch.dtype | None = None) -> fx.Node:
        node = self.graph.placeholder(self._name("p"))
        node.meta["val"] = self._val(shape, dtype)
        return node

    def _call(self, target: object, args: tuple[object, ...], val: torch.Tensor) -> fx.Node:
        node = self.graph.call_function(target, args)  # type: ignore[arg-type]
        node.meta["val"] = val
        return node

    def all_gather(
        self, x: fx.Node, group: str = "dp", group_size: int = 8
    ) -> tuple[fx.Node, fx.Node]:
        """``all_gather_into_tensor(x, group_size, group)`` and its wait."""
        shape = list(x.meta["val"].shape)
        shape[0] *= group_size
        val = self._val(shape, x.meta["val"].dtype)
        ag = self._call(c10d.all_gather_into_tensor.default, (x, group_size, group), val)
        return ag, self._call(c10d.wait_tensor.default, (ag,), val)

    def reduce_scatter(
        self, x: fx.Node, group: str = "dp", group_size: int = 8
    ) -> tuple[fx.Node, fx.Node]:
        """``reduce_scatter_tensor(x, "sum", group_size, group)`` and its wait."""
        shape = list(x.meta["val"].shape)
        shape[0] //= group_size
        val = self._val(shape, x.meta["val"].dtype)
        rs = self._call(c10d.reduce_scatter_tensor.default, (x, "sum", group_size, group), val)
        return rs, self._call(c10d.wait_tensor.default, (rs,), val)

    def all_reduce(self, x: fx.Node, group: str = "dp") -> tuple[fx.Node, fx.Node]:
        val = self._val(x.meta["val"].shape, x.meta["val"].dtype)
        ar = self._call(c10d.all_reduce.default, (x, "sum", group), val)
        return ar, self._call(c10d.wait_tensor.default, (ar,), val)

    def call(
        self,
        target: object,
        args: tuple[object, ...],
        shape: Sequence[int],
        dtype: torch.dtype | None = None,
    ) -> fx.Node:
        """Any ``call_function`` node with a ``meta['val']`` of ``shape``."""
        return self._call(target, args, self._val(shape, dtype))

    def relu(self, x: fx.Node) -> fx.Node:
        return self._call(aten.relu.default, (x,), self._val(x.meta["val"].shape))

    def add(self, x: fx.Node, y: fx.Node) -> fx.Node:
        return self._call(aten.add.Tensor, (x, y), self._val(x.meta["val"].shape))

    def mm(self, x: fx.Node, w: fx.Node) -> fx.Node:
        m = x.meta["val"].shape[0]
        n = w.meta["val"].shape[1]
        return self._call(aten.mm.default, (x, w), self._val((m, n)))

    def module(self, outputs: Sequence[fx.Node]) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def runnable_block_gathers(group: str, blocks: int = 4) -> fx.GraphModule:
    """``blocks`` blocks of two gathered weights (stamped ``layers.<k>.w<j>``) and two matmuls
    each, on process group ``group`` (a one-rank gloo group runs it on real data), with sizes
    the CPU estimator makes worth prefetching."""
    b = GraphBuilder(dtype=torch.float32)
    dim = 64
    x = b.placeholder((256, dim))
    shards = [[b.placeholder((dim, dim)) for _ in range(2)] for _ in range(blocks)]
    for k, block in enumerate(shards):
        for j, shard in enumerate(block):
            ag, w = b.all_gather(shard, group=group, group_size=1)
            ag.meta["custom"] = {"module_fqn": f"layers.{k}.w{j}"}
            x = b.relu(b.mm(x, b.call(aten.t.default, (w,), (dim, dim))))
    gm = b.module([x])
    fakeify(gm)
    return gm


def interleaved_fsdp_graph(
    num_nodes: int,
    groups: Sequence[str] = ("dp", "tp"),
    compute_per_layer: int = 12,
    shard_rows: int = 64,
    width: int = 64,
    seed: int = 0,
) -> fx.GraphModule:
    """A forward-like graph of ~``num_nodes`` nodes: per layer, one FSDP all-gather per group
    (parameter placeholder -> all-gather -> wait; waits of different groups interleave), then a
    matmul/relu chain consuming the gathered weights. Upstream's adjacency-based bucketing forms
    no bucket on it; key-grouped bucketing does."""
    rng = random.Random(seed)
    b = GraphBuilder()
    x = b.placeholder((32, width))
    outputs: list[fx.Node] = []
    while len(b.graph.nodes) < num_nodes:
        gathered: list[fx.Node] = []
        for group in groups:
            param = b.placeholder((shard_rows, width))
            _, wait = b.all_gather(param, group=group, group_size=8)
            gathered.append(wait)
        for i in range(compute_per_layer):
            if i % 3 == 0:
                w = gathered[rng.randrange(len(gathered))]
                x = b.relu(b.mm(x, b.call(aten.t.default, (w,), (width, 8 * shard_rows))))
                x = b.call(aten.slice.Tensor, (x, 1, 0, width), (32, width))
            else:
                x = b.relu(x)
        outputs.append(x)
    return b.module([outputs[-1]])


def all_gather_bucketing_args(
    gm: fx.GraphModule, cap_mb: float = 10.0
) -> tuple[
    fx.GraphModule,
    Callable[[int], float],
    Callable[[fx.Node], bool],
    Callable[[fx.Node], Any],
]:
    """``(gm, cap_fn, filter_node, group_key)`` exactly as torch's all-gather wrapper passes
    them to the greedy bucketer (filter ``is_all_gather_into_tensor``, key ``_ag_group_key``)."""
    from torch._inductor.fx_passes import bucketing

    def cap_fn(_index: int) -> float:
        return cap_mb

    return gm, cap_fn, bucketing.is_all_gather_into_tensor, bucketing._ag_group_key


def backward_like_graph(
    layers: int,
    group: str,
    dim: int = 64,
    tokens: int = 64,
    *,
    regather: bool = True,
    all_reduce: bool = False,
) -> fx.GraphModule:
    """A backward-like FSDP graph: per layer (last to first) re-gather the weight, two matmuls,
    reduce-scatter the weight gradient to the output. With ``regather=False`` the gathered
    weights are inputs instead (the forward saved them, as stock min-cut does): the backward
    only reduce-scatters. ``all_reduce=True`` (with ``regather=False``) all-reduces the
    gradients instead, as DDP does. Values are CPU fake tensors, because torch's bucket merging traces
    through fake mode; ``group`` must name a real (or fake) process group when the graph is
    merged or scheduled."""
    b = GraphBuilder(dtype=torch.float32)
    grad = b.placeholder((tokens, dim))
    acts = [b.placeholder((tokens, dim)) for _ in range(layers)]
    shape = (dim // 8, dim) if regather else (dim, dim)
    shards = [b.placeholder(shape) for _ in range(layers)]
    outputs: list[fx.Node] = []
    for layer in reversed(range(layers)):
        if regather:
            _, weight = b.all_gather(shards[layer], group=group, group_size=8)
        else:
            weight = shards[layer]
        grad_in = b.mm(grad, weight)
        grad_t = b.call(aten.t.default, (grad,), (dim, tokens))
        grad_w = b.mm(grad_t, acts[layer])
        if all_reduce:
            _, grad_shard = b.all_reduce(grad_w, group=group)
        else:
            _, grad_shard = b.reduce_scatter(grad_w, group=group, group_size=8)
        outputs.append(grad_shard)
        grad = b.relu(grad_in)
    gm = b.module([*outputs, grad])
    fakeify(gm)
    return gm


def hsdp_backward_graph(
    layers: int,
    shard_group: str,
    replicate_group: str,
    *,
    group_size: int = 1,
    dim: int = 16,
    tokens: int = 16,
    activation_all_reduce: bool = True,
    all_reduce_first: bool = False,
) -> fx.GraphModule:
    """An HSDP backward: per layer (last to first) all-gather the weight shard on
    ``shard_group``, two matmuls, reduce-scatter the weight gradient on ``shard_group`` and
    all-reduce that shard on ``replicate_group`` straight to the output (FSDP2's order).
    ``all_reduce_first``: SimpleFSDP's order instead (torchtitan's ``hybrid_shard``): all-reduce
    the unsharded gradient on ``replicate_group``, then reduce-scatter it to the output.
    ``activation_all_reduce`` adds one all-reduce on ``replicate_group`` that is not a gradient
    (its result feeds the next layer's matmul). ``group_size`` is the shard group's size;
    with 1 (and both names registered on one rank) the graph runs on real data."""
    b = GraphBuilder(dtype=torch.float32)
    grad = b.placeholder((tokens, dim))
    acts = [b.placeholder((tokens, dim)) for _ in range(layers)]
    shards = [b.placeholder((dim // group_size, dim)) for _ in range(layers)]
    outputs: list[fx.Node] = []
    for layer in reversed(range(layers)):
        _, weight = b.all_gather(shards[layer], group=shard_group, group_size=group_size)
        grad_in = b.mm(grad, weight)
        grad_t = b.call(aten.t.default, (grad,), (dim, tokens))
        grad_w = b.mm(grad_t, acts[layer])
        if all_reduce_first:
            _, full = b.all_reduce(grad_w, group=replicate_group)
            _, reduced = b.reduce_scatter(full, group=shard_group, group_size=group_size)
        else:
            _, shard = b.reduce_scatter(grad_w, group=shard_group, group_size=group_size)
            _, reduced = b.all_reduce(shard, group=replicate_group)
        outputs.append(reduced)
        if activation_all_reduce and layer == layers - 1:
            _, grad_in = b.all_reduce(grad_in, group=replicate_group)
        grad = b.relu(grad_in)
    gm = b.module([*outputs, grad])
    fakeify(gm)
    return gm


# --------------------------------------------------------------------------- random graphs

ROWS = 8


@dataclass
class RandomCollectiveGraph:
    gm: fx.GraphModule
    all_gathers: int
    reduce_scatters: int
    missing_val: str | None


@st.composite
def random_collective_graphs(draw: st.DrawFn, groups: tuple[str, ...]) -> RandomCollectiveGraph:
    b = GraphBuilder(dtype=torch.float32)
    ready: list[fx.Node] = [b.placeholder((ROWS, ROWS))]
    pending: list[fx.Node] = []
    n_ag = n_rs = 0
    for _ in range(draw(st.integers(2, 16))):
        action = draw(
            st.sampled_from(
                ["ph", "pointwise", "mm", "view", "split", "ag", "ag", "rs", "ar", "wait"]
            )
        )
        if action == "ph":
            ready.append(b.placeholder((ROWS, ROWS)))
        elif action == "pointwise":
            x, y = draw(st.sampled_from(ready)), draw(st.sampled_from(ready))
            ready.append(b.add(x, y) if draw(st.booleans()) else b.relu(x))
        elif action == "mm":
            ready.append(b.mm(draw(st.sampled_from(ready)), draw(st.sampled_from(ready))))
        elif action == "view":
            x = draw(st.sampled_from(ready))
            ready.append(b.call(aten.t.default, (x,), (ROWS, ROWS)))
        elif action == "split":
            x = draw(st.sampled_from(ready))
            parent = b.call(aten.split.Tensor, (x, ROWS // 2), (ROWS, ROWS))
            parent.meta["val"] = (torch.empty(ROWS // 2, ROWS, device="meta"),) * 2
            halves = [b.call(operator.getitem, (parent, i), (ROWS // 2, ROWS)) for i in range(2)]
            ready.append(b.call(aten.cat.default, (halves,), (ROWS, ROWS)))
        elif action in ("ag", "rs", "ar"):
            src = draw(st.sampled_from(ready))
            group = draw(st.sampled_from(groups))
            if action == "ag":
                if draw(st.booleans()):  # an FSDP-style gather of a parameter shard
                    shard = b.placeholder((ROWS // 2, ROWS))
                else:
                    shard = b.call(aten.slice.Tensor, (src, 0, 0, ROWS // 2), (ROWS // 2, ROWS))
                coll = b.all_gather(shard, group=group, group_size=2)[0]
                n_ag += 1
            elif action == "rs":
                coll = b.reduce_scatter(src, group=group, group_size=2)[0]
                n_rs += 1
            else:
                coll = b.all_reduce(src, group=group)[0]
            b.graph.erase_node(next(iter(coll.users)))  # its wait comes later
            pending.append(coll)
        elif pending:
            ready.append(_wait(b, pending.pop(draw(st.integers(0, len(pending) - 1)))))
    while pending:
        ready.append(_wait(b, pending.pop(draw(st.integers(0, len(pending) - 1)))))
    gm = b.module(ready[-draw(st.integers(1, 3)) :])
    fakeify(gm)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for n in draw(st.lists(st.sampled_from(nodes), max_size=4, unique=True)):
        n.meta["custom"] = {"ap_must_save": draw(st.booleans()), "module_fqn": "layers.0"}
        n.meta["recompute"] = draw(st.sampled_from(list(CheckpointPolicy)))
    missing = None
    colls = [
        n
        for n in nodes
        if str(n.target).startswith("_c10d_functional.") and "wait" not in str(n.target)
    ]
    if colls and draw(st.integers(0, 7)) == 0:
        victim = draw(st.sampled_from(colls))
        del victim.meta["val"]
        missing = victim.name
    return RandomCollectiveGraph(gm, n_ag, n_rs, missing)


def _wait(b: GraphBuilder, coll: fx.Node) -> fx.Node:
    """The wait, brought back to ``(ROWS, ROWS)`` (a reduce-scatter halves the rows)."""
    w = b.graph.call_function(c10d.wait_tensor.default, (coll,))
    w.meta["val"] = coll.meta["val"]
    if tuple(w.meta["val"].shape) != (ROWS, ROWS):
        w = b.call(aten.cat.default, ([w, w],), (ROWS, ROWS))
    return w


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node reachable from ``node`` through users (``node`` itself excluded): the
    obviously correct, quadratic-if-repeated check behind "no bucket member depends on
    another"."""
    out: set[fx.Node] = set()
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in out:
                out.add(user)
                stack.append(user)
    return out
