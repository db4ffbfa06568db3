"""Carrying out a plan (``ap_epchunk._plan.Plan``) on a graph.

For every region, in graph order, each body node is rewritten *in place* as chunk 0 (renamed
``<orig>_chunk0``) and copied for chunks 1..N-1 right after it (``<orig>_chunk<i>``), so the
graph stays topologically valid without any reordering; a scheduler may reorder later.
Live-ins are split just before their first chunked user; escaping values are materialized just
after their last chunk copy, and their full users are rewired to the materialized node.
Copies left without users (e.g. the per-chunk suffix an early accumulation replaced) are erased.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from ap_tags import (
    CHUNK_GLUE,
    CHUNK_INDEX,
    CHUNK_REGION,
    CUSTOM,
    MODULE_FQN,
    TAG_SCHEMA,
    TAG_SCHEMA_VERSION,
)
from ap_tags.graph import is_collective, is_wait

from ._chunk_dims import ChunkShapes
from ._compat import (
    fresh_unbacked_like,
    materialize_symints,
    shape_env_of,
    tree_leaves,
    tree_map,
    unbacked_bindings,
)
from ._config import ChunkReport, RegionSummary
from ._plan import is_dead_getitem, is_mutating
from ._plan_types import Materialize, Plan, RegionPlan
from ._region_collectives import region_collectives
from ._shapes import SymbolicShapes
from ._symbols import SymMap, free_symbols, subst_scalar, subst_value

aten = torch.ops.aten


def sum_order(num_chunks: int) -> list[int]:
    """Order in which gradient partials are added: last chunk first.

    That is how autograd accumulates the N uses of a parameter under eager chunking (the
    backward of the last forward chunk runs first), so the sum is bitwise equal to it.
    """
    return list(reversed(range(num_chunks)))


class Rewriter:
    """Carries out a plan in one pass: ``Rewriter(graph, plan, shapes, fqns, report).run()``.

    Keeps the chunk copies, split pieces and full values it made, and fills ``report``.
    """

    def __init__(
        self,
        graph: torch.fx.Graph,
        plan: Plan,
        shapes: ChunkShapes,
        fqns: dict[torch.fx.Node, str],
        report: ChunkReport,
    ) -> None:
        self.graph = graph
        self.plan = plan
        self.shapes = shapes
        self.fqns = fqns
        self.report = report
        self.n = shapes.num_chunks
        self.copies: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        self.pieces: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        self.per_chunk_scalar: dict[torch.fx.Node, torch.fx.Node] = {}
        self.full: dict[torch.fx.Node, torch.fx.Node] = {}
        self.orig: dict[torch.fx.Node, tuple[Any, Any, dict[str, Any], str]] = {}
        self.created: list[torch.fx.Node] = []
        #: per chunk: each unbacked symbol a data-dependent body op binds -> that chunk's own
        #: symbol (every chunk, the first included; see ``_make_fresh_symbols``)
        self.fresh: list[dict[Any, Any]] = [{} for _ in range(self.n)]
        #: every chunk's own symbols, once (``_lift_symints`` asks for each body node)
        self.fresh_symbols: frozenset[Any] = frozenset()

    # ------------------------------------------------------------------ metadata helpers
    def _glue_meta(self, rp: RegionPlan, val: Any, index: int | None = None) -> dict[str, Any]:
        custom: dict[str, Any] = {
            MODULE_FQN: rp.root,
            CHUNK_GLUE: True,
            CHUNK_REGION: rp.root,
            TAG_SCHEMA: TAG_SCHEMA_VERSION,
        }
        if index is not None:
            custom[CHUNK_INDEX] = index
        meta: dict[str, Any] = {CUSTOM: custom, "val": val}
        stack = rp.body[0].meta.get("nn_module_stack") if rp.body else None
        if stack is not None:
            meta["nn_module_stack"] = stack
        if rp.backward:
            meta["autograd_backward"] = True
        return meta

    def _glue(
        self,
        rp: RegionPlan,
        target: Any,
        args: tuple[Any, ...],
        val: Any,
        name: str | None = None,
        index: int | None = None,
    ) -> torch.fx.Node:
        node = self.graph.call_function(target, args)
        if name is not None:
            node._rename(name)
        node.meta = self._glue_meta(rp, val, index)
        self.created.append(node)
        return node

    def _copy_meta(self, node: torch.fx.Node, rp: RegionPlan, index: int) -> dict[str, Any]:
        meta = dict(self.orig[node][2])
        custom = dict(meta.get(CUSTOM) or {})
        custom.setdefault(MODULE_FQN, self.fqns.get(node, rp.root))
        custom[CHUNK_INDEX] = index
        custom[CHUNK_REGION] = rp.root
        custom[TAG_SCHEMA] = TAG_SCHEMA_VERSION
        meta[CUSTOM] = custom
        meta["val"] = self._refresh(self.chunk_vals[node], index)
        meta.pop("tensor_meta", None)
        bindings = meta.get("unbacked_bindings")
        if isinstance(bindings, dict) and self.fresh[index]:
            meta["unbacked_bindings"] = {
                self.fresh[index].get(sym, sym): path for sym, path in bindings.items()
            }
        if rp.backward:
            meta["autograd_backward"] = True
        return meta

    def _refresh(self, value: Any, index: int) -> Any:
        """``value`` in chunk ``index``'s own data-dependent symbols."""
        fresh: SymMap = self.fresh[index]
        if not fresh or not (free_symbols(value) & fresh.keys()):
            return value
        return subst_value(value, fresh)

    def _make_fresh_symbols(self) -> None:
        for rp in self.plan.regions:
            for node in rp.body:
                bindings = unbacked_bindings(node)
                env = shape_env_of(node.meta.get("val"))
                if not bindings or env is None:
                    continue
                # every chunk, the first included: the traced symbols keep the full graph's
                # facts (the ShapeEnv's deferred runtime asserts, e.g. an exchange's split
                # sizes summing to the full token count), which no chunk satisfies. Keyed by
                # the symbol the values mention and by the binding's raw key, which differ on
                # a graph AOTAutograd retraced from Dynamo's (``u26`` renamed to ``u1``)
                for i in range(self.n):
                    for sym, (raw, _) in bindings.items():
                        self.fresh[i][sym] = self.fresh[i][raw] = fresh_unbacked_like(env, sym)
        self.fresh_symbols = frozenset(s for chunk in self.fresh for s in chunk)

    # ------------------------------------------------------------------ live-ins
    def _piece_val(self, live_in: torch.fx.Node) -> Any:
        if isinstance(self.shapes, SymbolicShapes):
            return subst_value(live_in.meta.get("val"), self.shapes.mapping)
        return self.shapes.chunk_val(live_in)

    def _split(self, live_in: torch.fx.Node, rp: RegionPlan) -> None:
        d = self.plan.split_dim[live_in]
        val = live_in.meta["val"]
        piece = self._piece_val(live_in)
        size: Any
        if isinstance(val.shape[d], torch.SymInt):
            sz = self._glue(rp, aten.sym_size.int, (live_in, d), val.shape[d])
            size = self._glue(rp, operator.floordiv, (sz, self.n), piece.shape[d])
        else:
            size = int(val.shape[d]) // self.n
        split = self._glue(
            rp, aten.split_with_sizes.default, (live_in, [size] * self.n, d), [piece] * self.n
        )
        self.pieces[live_in] = [
            self._glue(rp, operator.getitem, (split, i), piece, f"{live_in.name}_chunk{i}", i)
            for i in range(self.n)
        ]
        self.report.split_live_ins.append(live_in.name)

    def _scalar(self, live_in: torch.fx.Node, rp: RegionPlan) -> None:
        assert isinstance(self.shapes, SymbolicShapes)
        # a scalar computed by an earlier region: divide its full value, not its chunk 0
        full = self.full.get(live_in, live_in)
        meta, name = live_in.meta, live_in.name
        if live_in in self.orig:
            meta, name = self.orig[live_in][2], self.orig[live_in][3]
        val = subst_scalar(meta["val"], self.shapes.mapping)
        self.per_chunk_scalar[live_in] = self._glue(
            rp, operator.floordiv, (full, self.n), val, f"{name}_per_chunk"
        )

    # ------------------------------------------------------------------ body
    def _mapper(self, rp: RegionPlan, i: int) -> Any:
        def one(a: torch.fx.Node) -> torch.fx.Node:
            if a in self.copies and (self.plan.owner[a] is rp or a in rp.routed):
                return self.copies[a][i]
            if a in self.per_chunk_scalar:
                return self.per_chunk_scalar[a]
            if a in self.pieces:
                return self.pieces[a][i]
            if a in self.full:
                return self.full[a]
            return a

        return one

    def _lift_symints(
        self, node: torch.fx.Node, rp: RegionPlan, tree: tuple[tuple[Any, ...], dict[str, Any]]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``tree`` (a body node's per-chunk arguments) with every raw SymInt leaf that the
        chunk pass divided (``u0`` -> ``u0 // N``) computed by FX nodes placed before ``node``.

        Why: a raw symbolic argument is a value only the trace-time ShapeEnv can read; torch
        asks passes to materialise it, and a node computed from the graph's own producer of
        ``u0`` (``sym_size(x, 0) // N``) is what every chunk's copy should read at run time.
        A leaf that depends on a chunk's own data-dependent symbol, or whose symbol has no
        producer in the graph, stays raw (as the input graph had it).
        """
        original = {id(v) for v in tree_leaves((tuple(node.args), dict(node.kwargs)))}
        fresh_syms = self.fresh_symbols
        leaves = [
            v
            for v in tree_leaves(tree)
            if isinstance(v, torch.SymInt)
            and id(v) not in original
            and not v.node.expr.is_number
            and not (v.node.expr.free_symbols & fresh_syms)
        ]
        if not leaves:
            return tree
        before = set(self.graph.nodes)
        with self.graph.inserting_before(node):
            lifted = materialize_symints(self.graph, leaves)
        made = [n for n in self.graph.nodes if n not in before]
        if lifted is None:
            for n in reversed(made):  # a failed attempt may have left producers behind
                if not n.users:
                    self.graph.erase_node(n)
            return tree
        for n in made:
            n.meta = self._glue_meta(rp, n.meta.get("val"))
            self.created.append(n)
        by_id = {id(v): out for v, out in zip(leaves, lifted, strict=True)}
        lifted_tree: tuple[tuple[Any, ...], dict[str, Any]] = tree_map(
            lambda v: by_id.get(id(v), v), tree
        )
        self.report.lifted_symints += len(leaves)
        return lifted_tree

    def _body_node(self, node: torch.fx.Node, rp: RegionPlan) -> None:
        args, kwargs = self._lift_symints(node, rp, self.shapes.chunk_args(node))
        self.orig[node] = (node.args, node.kwargs, dict(node.meta), node.name)
        for inp in node.all_input_nodes:
            with self.graph.inserting_before(node):
                if inp in self.plan.split_dim and inp not in self.pieces:
                    self._split(inp, rp)
                own = self.plan.owner.get(inp) is rp or inp in rp.routed
                if inp in self.plan.scalars and inp not in self.per_chunk_scalar and not own:
                    self._scalar(inp, rp)
        chain_pos = rp.chains.get(node)
        copies: list[torch.fx.Node] = []
        prev = node
        for i in range(self.n):
            new_args, new_kwargs = torch.fx.node.map_arg((args, kwargs), self._mapper(rp, i))
            if self.fresh[i]:
                new_args, new_kwargs = self._refresh((new_args, new_kwargs), i)
            if chain_pos is not None and i > 0:
                new_args = (*new_args[:chain_pos], copies[i - 1], *new_args[chain_pos + 1 :])
            if i == 0:
                node.args, node.kwargs = new_args, new_kwargs
                node._rename(f"{self.orig[node][3]}_chunk0")
                node.meta = self._copy_meta(node, rp, 0)
                copy = node
            else:
                with self.graph.inserting_after(prev):
                    copy = self.graph.create_node(
                        "call_function",
                        node.target,
                        new_args,
                        new_kwargs,
                        name=f"{self.orig[node][3]}_chunk{i}",
                        type_expr=node.type,
                    )
                copy.meta = self._copy_meta(node, rp, i)
                self.created.append(copy)
            copies.append(copy)
            prev = copy
        self.copies[node] = copies

    # ------------------------------------------------------------------ live-outs
    def _materialize(self, m: Materialize, rp: RegionPlan) -> None:
        parts = self.copies[m.start]
        orig_val = self.orig[m.start][2].get("val")
        base = self.orig[m.start][3]
        full: torch.fx.Node
        with self.graph.inserting_before(parts[-1].next):
            if m.kind == "cat":
                full = self._glue(
                    rp, aten.cat.default, (list(parts), m.dim), orig_val, f"{base}_full"
                )
                self.report.concatenated.append(base)
            elif m.kind in ("sum", "ssum"):
                add = aten.add.Tensor if m.kind == "sum" else operator.add
                order = sum_order(self.n)
                acc = parts[order[0]]
                for k, i in enumerate(order[1:], start=1):
                    name = f"{base}_full" if k == self.n - 1 else f"{base}_sum{k}"
                    acc = self._glue(rp, add, (acc, parts[i]), orig_val, name)
                full = acc
                self.report.summed.append(base)
            elif m.kind == "last":
                full = parts[-1]
                self.report.mutation_chains.append(base)
            else:  # "same": every chunk computes the full value
                full = parts[0]
        prev = full
        for p in m.chain:
            args, kwargs = self.orig[p][0], self.orig[p][1]
            new_args = (prev, *args[1:])  # the chain runs through each node's first input
            new_kwargs = dict(kwargs)
            assert callable(p.target)
            with self.graph.inserting_after(self.copies[p][-1]):
                replay = self.graph.call_function(p.target, new_args, new_kwargs)
            replay._rename(f"{self.orig[p][3]}_full")
            meta = dict(self.orig[p][2])
            custom = dict(meta.get(CUSTOM) or {})
            custom.update({CHUNK_GLUE: True, CHUNK_REGION: rp.root, TAG_SCHEMA: TAG_SCHEMA_VERSION})
            custom.setdefault(MODULE_FQN, self.fqns.get(p, rp.root))
            meta[CUSTOM] = custom
            meta.pop("tensor_meta", None)
            replay.meta = meta
            self.created.append(replay)
            prev = replay
        self.full[m.live_out] = prev
        for user in m.full_users:
            if user not in self.plan.owner:  # later body nodes read self.full in _mapper
                user.replace_input_with(m.live_out, prev)

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        self.chunk_vals: dict[torch.fx.Node, Any] = {}
        for rp in self.plan.regions:
            for node in rp.body:
                self.chunk_vals[node] = self.shapes.chunk_val(node)
        self._make_fresh_symbols()
        for rp in self.plan.regions:
            for node in rp.body:
                for user in list(node.users):
                    if is_dead_getitem(user) and user not in self.plan.owner:
                        self.graph.erase_node(user)  # reads the full value nobody uses
                self._body_node(node, rp)
            for m in rp.materialize:
                self._materialize(m, rp)
            self.report.routed_live_ins += len(rp.routed)
            exchanges, whole = region_collectives(rp)
            self.report.regions.append(
                RegionSummary(rp.root, rp.backward, len(rp.body), exchanges, whole)
            )
        self._erase_dead()

    def _erase_dead(self) -> None:
        candidates = set(self.created)
        for copies in self.copies.values():
            candidates.update(copies)
        for node in reversed(list(self.graph.nodes)):
            if node in candidates and not node.users and _erasable(node):
                self.graph.erase_node(node)


def _erasable(node: torch.fx.Node) -> bool:
    """A dead chunk copy or glue node may go: not a mutation, and not impure (a runtime
    assert of a chunk's data-dependent size stays) -- except functional collectives and their
    waits, whose per-chunk copies a once-on-the-full-value replay made dead."""
    if is_mutating(node):
        return False
    return not node.is_impure() or is_collective(node) or is_wait(node)
