"""Random joint graphs for property tests (hypothesis), with random valid and invalid tags.

A graph is a small DAG over float32 values of shape ``(4, 4)`` ("mat") or ``(4,)`` ("row"):
pointwise unary/binary ops (rows broadcast), ``mm``, views (``t``, ``view``, ``alias``),
multi-output ops (``unbind`` -> getitems, ``sort`` -> getitem 0), FSDP-style chains
(``placeholder -> casts -> all_gather_into_tensor -> wait_tensor -> t``), and a backward part
fed by ``tangents_1`` that reads forward values. Values are computed eagerly while the graph is
built, so ``meta["val"]`` holds real tensors and graphs without collectives can be executed.

Two output layouts (``layout=``):

* ``"joint"``: ``[forward outputs | gradients]``, as a joint graph handed to a partitioner
  (output ``meta["desc"]`` all None, as on hand-built joints);
* ``"forward"``: ``[forward outputs | gradient | values saved for backward]``, as an AOT
  forward graph returns them after its user outputs (what ``tag_saved_outputs`` reads).

``partition_aware=True`` draws tags the way a real first compilation leaves them (policies on
forward nodes, occasionally an unsatisfiable ``MUST_RECOMPUTE`` on an input); otherwise tags
land anywhere, which is what validation properties want.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional)
import torch.fx
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy

__all__ = [
    "BAD_CUSTOM",
    "BAD_RECOMPUTE",
    "GOOD_CUSTOM",
    "GOOD_RECOMPUTE",
    "RandomJoint",
    "random_joints",
    "run",
    "run_partition",
]

Layout = Literal["joint", "forward"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

GOOD_CUSTOM: list[dict[str, Any]] = [
    {"ap_must_save": True},
    {"ap_must_save": False},
    {"ap_must_save": True, "ap_must_save_getitem_indices": [0]},
    {"module_fqn": "layers.0.mlp"},
    {"ap_chunk_index": 1, "ap_chunk_region": "layers.*.moe", "ap_chunk_glue": False},
    {"unrelated_key": object()},
]
BAD_CUSTOM: list[Any] = [
    {"ap_must_save": 1},
    {"ap_must_save": "yes"},
    {"ap_must_save": True, "ap_must_save_getitem_indices": [-1]},
    {"ap_must_save": True, "ap_must_save_getitem_indices": [0, 0]},
    {"ap_must_save": True, "ap_must_save_getitem_indices": "0"},
    {"ap_must_save_getitem_indices": [0]},
    {"module_fqn": 3},
    {"ap_chunk_index": -2},
    {"ap_chunk_glue": "no"},
    "not-a-dict",
]
GOOD_RECOMPUTE = [(p, gid) for p in CheckpointPolicy for gid in (None, 1, 100000)]
BAD_RECOMPUTE: list[tuple[Any, Any]] = [
    (2, None),
    ("MUST_SAVE", 1),
    (CheckpointPolicy.MUST_SAVE, "x"),
]


@dataclass
class RandomJoint:
    gm: torch.fx.GraphModule
    inputs: list[torch.Tensor]
    executable: bool
    num_fwd_outputs: int
    fsdp_chains: int
    bad_nodes: set[str] = field(default_factory=set)
    bad_ac_nodes: set[str] = field(default_factory=set)


class _Builder:
    """Builds the graph and computes every value eagerly (``env``)."""

    def __init__(self) -> None:
        self.g = torch.fx.Graph()
        self.env: dict[torch.fx.Node, Any] = {}
        self.mats: list[torch.fx.Node] = []
        self.rows: list[torch.fx.Node] = []

    def ph(self, name: str, value: torch.Tensor) -> torch.fx.Node:
        n = self.g.placeholder(name)
        n.meta["val"] = value
        self.env[n] = value
        return n

    def op(self, target: Any, args: tuple[Any, ...], value: Any = None) -> torch.fx.Node:
        n = self.g.call_function(target, args)
        if value is None:
            real = tuple(self.env[a] if isinstance(a, torch.fx.Node) else a for a in args)
            value = target(*real)
        n.meta["val"] = value
        self.env[n] = value
        return n

    def keep(self, n: torch.fx.Node) -> None:
        val = self.env[n]
        if isinstance(val, torch.Tensor) and val.dtype == torch.float32:
            if tuple(val.shape) == (4, 4):
                self.mats.append(n)
            elif tuple(val.shape) == (4,):
                self.rows.append(n)


UNARY = [aten.relu.default, aten.sin.default, aten.neg.default, aten.exp.default]
BINARY = [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor]
KINDS = ["unary", "binary", "mm", "view", "unbind", "sort", "fsdp"]


@st.composite
def random_joints(
    draw: st.DrawFn,
    *,
    tags: bool = True,
    collectives: bool = True,
    layout: Layout = "joint",
    partition_aware: bool | None = None,
) -> RandomJoint:
    """A random joint graph (see the module doc); ``partition_aware`` defaults to
    ``layout == "joint"``."""
    b = _Builder()
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    n_primals = draw(st.integers(1, 3))
    for i in range(n_primals):
        b.keep(b.ph(f"primals_{i + 1}", torch.randn(4, 4, generator=gen)))
    tangent = b.ph("tangents_1", torch.randn(4, 4, generator=gen))
    chains = 0
    kinds = KINDS if collectives else KINDS[:-1]
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(kinds))
        pool = b.mats + b.rows
        a = draw(st.sampled_from(pool))
        if kind == "unary":
            b.keep(b.op(draw(st.sampled_from(UNARY)), (a,)))
        elif kind == "binary":
            b.keep(b.op(draw(st.sampled_from(BINARY)), (a, draw(st.sampled_from(pool)))))
        elif kind == "mm":
            x, y = draw(st.sampled_from(b.mats)), draw(st.sampled_from(b.mats))
            b.keep(b.op(aten.mm.default, (x, y)))
        elif kind == "view":
            m = draw(st.sampled_from(b.mats))
            target = draw(st.sampled_from(["t", "view", "alias"]))
            if target == "t":
                b.keep(b.op(aten.t.default, (m,)))
            elif target == "view":
                b.keep(b.op(aten.view.default, (m, [4, 4])))
            else:
                b.keep(b.op(aten.alias.default, (m,)))
        elif kind == "unbind":
            m = draw(st.sampled_from(b.mats))
            parent = b.op(aten.unbind.int, (m, 0))
            for idx in sorted(draw(st.sets(st.integers(0, 3), min_size=1, max_size=4))):
                b.keep(b.op(operator.getitem, (parent, idx)))
        elif kind == "sort":
            m = draw(st.sampled_from(b.mats))
            parent = b.op(aten.sort.default, (m,))
            b.keep(b.op(operator.getitem, (parent, 0)))
        else:  # an FSDP chain from a fresh sharded parameter
            chains += 1
            shard = b.ph(f"primals_{n_primals + chains}", torch.randn(2, 4, generator=gen))
            cur = shard
            for _ in range(draw(st.integers(0, 2))):
                cur = b.op(aten._to_copy.default, (cur,), torch.empty(2, 4))
            ag = b.op(c10d.all_gather_into_tensor.default, (cur, 2, "0"), torch.empty(4, 4))
            wait = b.op(c10d.wait_tensor.default, (ag,), torch.randn(4, 4, generator=gen))
            cur = wait
            if draw(st.booleans()):
                cur = b.op(aten.t.default, (cur,))
            b.keep(cur)
    _sort_placeholders(b.g)  # FSDP shard placeholders were created mid-graph
    fwd_values = b.mats + b.rows
    fwd_outs = draw(st.lists(st.sampled_from(fwd_values), min_size=1, max_size=3))
    grad = tangent
    for _ in range(draw(st.integers(1, 4))):
        other = draw(st.sampled_from(fwd_values))
        grad = b.op(draw(st.sampled_from(BINARY)), (grad, other))
        if tuple(b.env[grad].shape) != (4, 4):
            grad = b.op(aten.add.Tensor, (grad, tangent))
    if layout == "forward":
        # then values "saved for backward", as an AOT forward graph returns them
        saved = draw(st.lists(st.sampled_from(fwd_values), max_size=4))
        b.g.output((*fwd_outs, grad, *saved))
    else:
        grads = [grad]
        if draw(st.booleans()):  # a second gradient reading another forward value
            other = draw(st.sampled_from(b.mats))
            grads.append(b.op(aten.mul.Tensor, (tangent, other)))
        outs = [*fwd_outs, *grads]
        out = b.g.output(tuple(outs))
        out.meta["desc"] = [None] * len(outs)
    gm = torch.fx.GraphModule(torch.nn.Module(), b.g)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    joint = RandomJoint(
        gm=gm,
        inputs=[b.env[p] for p in ph],
        executable=chains == 0,
        num_fwd_outputs=len(fwd_outs),
        fsdp_chains=chains,
    )
    if tags:
        aware = layout == "joint" if partition_aware is None else partition_aware
        _tag(draw, joint, aware)
    return joint


def _sort_placeholders(g: torch.fx.Graph) -> None:
    """Placeholders first (primals by number, then tangents), as AOTAutograd emits them."""
    ph = [n for n in g.nodes if n.op == "placeholder"]
    ph.sort(key=lambda n: (n.target.startswith("tangents"), len(n.target), n.target))
    first = next(n for n in g.nodes if n.op != "placeholder") if len(g.nodes) > len(ph) else None
    for n in ph:
        if first is not None:
            first.prepend(n)


PARENT_CUSTOM: list[tuple[dict[str, Any] | None, bool]] = [
    (None, False),
    ({"ap_must_save": True, "ap_must_save_getitem_indices": [0]}, False),
    ({"ap_must_save": True, "ap_must_save_getitem_indices": (1,)}, False),
    ({"ap_must_save": True, "ap_must_save_getitem_indices": "0"}, True),
    ({"ap_must_save": True, "ap_must_save_getitem_indices": [1, 1]}, True),
]


def _tag(draw: st.DrawFn, joint: RandomJoint, partition_aware: bool) -> None:
    """Random tags on random nodes; invalid ones are recorded so properties can predict errors.

    ``partition_aware``: policies land on forward nodes (bad ones anywhere), bad customs are
    rarer, and one input in six is tagged ``MUST_RECOMPUTE`` (no valid replay cut exists)."""
    nodes = [n for n in joint.gm.graph.nodes if n.op != "output"]
    backward: set[torch.fx.Node] = set()
    for n in nodes:
        if str(n.target).startswith("tangents") or any(i in backward for i in n.all_input_nodes):
            backward.add(n)
    primals = [n for n in nodes if str(n.target).startswith("primals")]
    if partition_aware and draw(st.integers(0, 5)) == 0:
        draw(st.sampled_from(primals)).meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    parent_choices = [(None, False), *PARENT_CUSTOM] if partition_aware else PARENT_CUSTOM
    for n in nodes:  # multi-output parents: index lists, the trickiest tag
        if any(u.target is operator.getitem for u in n.users):
            custom, bad = draw(st.sampled_from(parent_choices))
            if custom is not None:
                n.meta["custom"] = copy.deepcopy(custom)
            if bad:
                joint.bad_nodes.add(n.name)
    # bias towards the nodes passes act on: multi-output parents and output values
    parents = [n for n in nodes if n.target is operator.getitem for n in n.all_input_nodes]
    outputs = [a for a in _outputs(joint.gm) if isinstance(a, torch.fx.Node)]
    pool = nodes + parents * 2 + outputs
    bad_custom_odds = 5 if partition_aware else 2
    for n in draw(st.lists(st.sampled_from(pool), max_size=5, unique=True)):
        if draw(st.booleans()):
            joint.bad_nodes.discard(n.name)  # its custom is replaced below
            if draw(st.integers(0, bad_custom_odds)) == 0:
                n.meta["custom"] = copy.deepcopy(draw(st.sampled_from(BAD_CUSTOM)))
                joint.bad_nodes.add(n.name)
            else:
                n.meta["custom"] = copy.deepcopy(draw(st.sampled_from(GOOD_CUSTOM)))
            continue
        if partition_aware and n in backward and not draw(st.integers(0, 3)) == 0:
            continue  # torch/ap-tags put policies on forward nodes only; bad ones anywhere
        if partition_aware:
            bad = n in backward or draw(st.integers(0, 7)) == 0
        else:
            bad = draw(st.integers(0, 3)) == 0
        if bad:
            policy, gid = draw(st.sampled_from(BAD_RECOMPUTE))
            joint.bad_nodes.add(n.name)
            joint.bad_ac_nodes.add(n.name)
        else:
            policy, gid = draw(st.sampled_from(GOOD_RECOMPUTE))
        n.meta["recompute"] = policy
        if gid is not None:
            n.meta["ac_graph_id"] = gid


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    values = gm.graph.output_node().args[0]
    return list(values) if isinstance(values, list | tuple) else [values]


def run(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = torch.fx.Interpreter(gm).run(*inputs)
    return [o.clone() if isinstance(o, torch.Tensor) else o for o in out]


def run_partition(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    joint: RandomJoint,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run the forward on the primals and the backward on (saved by name, tangents by name)."""
    by_name = {
        n.name: v
        for n, v in zip(
            [n for n in joint.gm.graph.nodes if n.op == "placeholder"], joint.inputs, strict=False
        )
    }
    primals = [by_name[n.name] for n in fw.graph.nodes if n.op == "placeholder"]
    fw_out = run(fw, primals)
    saved = {
        a.name: v
        for a, v in zip(
            _outputs(fw)[joint.num_fwd_outputs :],
            fw_out[joint.num_fwd_outputs :],
            strict=True,
        )
        if isinstance(a, torch.fx.Node)
    }
    bw_args = []
    for n in bw.graph.nodes:
        if n.op != "placeholder":
            continue
        bw_args.append(by_name[n.name] if n.name.startswith("tangents") else saved[n.name])
    return fw_out[: joint.num_fwd_outputs], run(bw, bw_args)
