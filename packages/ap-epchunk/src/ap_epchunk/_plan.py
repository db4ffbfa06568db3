"""Deciding everything before the graph is touched.

The planner walks the regions in graph order and decides, for each one:

* its **body**: candidates influenced by the chunk dim (through a live-in carrying it, a chunked
  value of an earlier region routed here, or a scalar live-in mentioning the chunk symbol).
  Candidates that only see parameters (transposes, casts, all-gathers of weights) are left out
  of the body and therefore shared by every chunk;
* its **live-ins**: *split* (a tensor carrying the chunk dim, split once for the whole graph),
  *routed* (a chunked value of an earlier region: its chunk ``i`` feeds chunk ``i`` directly, so
  adjacent chunked regions never cat-then-split), *scalar* (a SymInt mentioning the chunk
  symbol, divided by N per chunk) or shared;
* **mutation chains**: a body op that mutates a shared value (a buffer) runs chunk after chunk,
  each copy mutating the result of the previous one;
* its **live-outs** with users outside the chunked world, and how each is made full again:
  ``cat`` along the chunk dim, ``sum`` of backward partials (parameter gradients), ``ssum`` of
  symbolic sizes (``operator.add``, so it stays an int), ``last`` for a mutation chain, ``same``
  for a value that does not depend on the chunk. Anything else is refused.

Every refusal raises ``ChunkError`` here, before any mutation.
"""

from __future__ import annotations

from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
import torch.fx
from ap_tags.graph import is_collective, is_getitem, is_reduce_scatter, is_wait

from ._body_checks import check_body_node, unknown_refusal
from ._chunk_dims import MULTI, ChunkShapes, Unknown
from ._compat import all_reduce_op, unbacked_bindings
from ._errors import ChunkError, source_of
from ._plan_types import Materialize, Plan, RegionPlan
from ._region_collectives import check_collectives
from ._regions import Region
from ._symbols import free_symbols

aten = torch.ops.aten


def _carries_tokens(node: torch.fx.Node, shapes: ChunkShapes) -> bool:
    d = shapes.dim(node)
    return isinstance(d, (int, Unknown)) or d is MULTI


def _feeds_token_values(node: torch.fx.Node, plan: Plan, shapes: ChunkShapes) -> bool:
    """Whether a value computed from ``node`` (not ``node`` itself) carries the chunk dim.

    Memoized over the whole graph, so checking every summed live-out stays linear.
    """
    stack = [(u, False) for u in node.users]
    while stack:
        cur, done = stack.pop()
        if cur in plan.tokenish:
            continue
        if done:
            plan.tokenish[cur] = _carries_tokens(cur, shapes) or any(
                plan.tokenish.get(u, False) for u in cur.users
            )
            continue
        stack.append((cur, True))
        stack.extend((u, False) for u in cur.users if u not in plan.tokenish)
    return any(plan.tokenish.get(u, False) for u in node.users)


def _name_list(nodes: list[torch.fx.Node], limit: int = 4) -> str:
    names = [n.name for n in nodes[:limit]]
    return ", ".join(names) + (", ..." if len(nodes) > limit else "")


def _mutated_positions(node: torch.fx.Node) -> list[int]:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    return [
        i
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write and not arg.kwarg_only
    ]


def is_mutating(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def is_dead_getitem(node: torch.fx.Node) -> bool:
    """A getitem nobody reads: not a user that needs the full value of its parent."""
    return is_getitem(node) and not node.users


def semantic_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node``'s users, without dead getitems of a multi-output op (nothing reads them)."""
    return [u for u in node.users if not is_dead_getitem(u)]


def _routable(value: torch.fx.Node, src: RegionPlan, dst: RegionPlan, shapes: ChunkShapes) -> bool:
    """Chunk ``i`` of ``value`` (computed in ``src``) may feed chunk ``i`` of ``dst``."""
    if value in src.chains or value in src.followers:
        return False  # a mutated buffer is only complete after the last chunk
    if isinstance(shapes.dim(value), int):
        return True
    return src.root == dst.root and not src.backward and dst.backward


#: Out-of-place accumulation into a shared buffer (a functionalized ``buf.add_(counts)``).
_ACCUMULATE: frozenset[Any] = frozenset({aten.add.Tensor})
#: How a functionalized graph writes a new buffer value back into the buffer.
_WRITE_BACK: frozenset[Any] = frozenset({aten.copy.default, aten.copy_.default})


def _written_back(shared: torch.fx.Node, value: torch.fx.Node) -> bool:
    """``value`` reaches ``copy_(shared, ...)`` (through ``copy(shared, ...)``): it is the new
    value of the buffer ``shared``, i.e. the functional form of an in-place update."""
    values = {value}
    for user in shared.users:  # graph order: a copy(shared, v) precedes the copy_ of its result
        if user.target in _WRITE_BACK and len(user.args) >= 2 and user.args[0] is shared:
            if user.args[1] in values:
                if user.target is aten.copy_.default:
                    return True
                values.add(user)
    return False


def _accumulation_position(
    node: torch.fx.Node, body: set[torch.fx.Node], plan: Plan, shapes: ChunkShapes
) -> int | None:
    """``add(buf, v)`` with ``buf`` a shared buffer written back afterwards and ``v`` a body
    value without the chunk dim: the position of ``buf``, which chunk ``i`` replaces by chunk
    ``i - 1``'s result (``buf + v_0 + v_1 ...``, the order in which eager chunking updates the
    buffer)."""
    if node.target not in _ACCUMULATE or len(node.args) < 2 or shapes.dim(node) is not None:
        return None
    for pos, other in ((0, 1), (1, 0)):
        buf, v = node.args[pos], node.args[other]
        if not isinstance(buf, torch.fx.Node) or not isinstance(v, torch.fx.Node):
            continue
        if buf in body or buf in plan.owner or buf in plan.split_dim or v not in body:
            continue
        if shapes.dim(buf) is not None or shapes.dim(v) is not None:
            continue
        if _written_back(buf, node):
            return pos
    return None


def _interleaved_fix(node: torch.fx.Node, root: str) -> str:
    """The fix an interleaving refusal names: leaving the region unchunked, and first, when the
    shared value is a creation op (no input nodes), the hinted marks.

    Measured on torchtitan's Qwen3-MoE (``precompile``, ``ChunkConfig.chunk_inputs`` names, AC
    in the first compilation, loss outside the compiled step): one node, the router's ``zeros``
    for ``scatter_add`` and likewise the experts' ``index_put`` buffer, serves the forward and the
    backward's recomputation of the MoE, because without chunk marks ``precompile`` partitions
    with min-cut, which recomputes. With the tokens marked, ``precompile`` keeps the chunk
    route's ``default_partition``, and the same case with local experts trains like eager (the
    zoo's EP route matrix)."""
    if node.all_input_nodes:
        return f" Fix: {_leave_unchunked(root)}"
    return (
        f" {node.name!r} creates a buffer two regions share, as a min-cut first partition that "
        "recomputes the region in the backward leaves it. Fix: mark the token inputs with "
        "ap_epchunk.mark_chunk_dim(t, 0, hint=t.shape[0]) before precompile (which then keeps "
        "the chunk route's default_partition; no ChunkConfig.chunk_inputs), or "
        f"{_leave_unchunked(root)}"
    )


def _plan_body(region: Region, plan: Plan, shapes: ChunkShapes) -> RegionPlan:
    rp = RegionPlan(region.root, region.backward)
    body: set[torch.fx.Node] = set()
    where = f"region {region.root!r} ({'backward' if region.backward else 'forward'})"
    for node in region.candidates:
        influenced = False
        for inp in node.all_input_nodes:
            if inp in body:
                influenced = True
            elif inp in plan.owner and _routable(inp, plan.owner[inp], rp, shapes):
                rp.routed.add(inp)
                influenced = True
            elif inp in plan.split_dim or inp in plan.scalars:
                influenced = True
            elif shapes.scalar_carries_chunk(inp):
                plan.scalars.add(inp)
                rp.scalars.append(inp)
                influenced = True
            elif inp not in plan.owner:
                d = shapes.dim(inp)
                if isinstance(d, int):
                    plan.split_dim[inp] = d
                    rp.splits.append(inp)
                    influenced = True
                elif d is MULTI:
                    raise ChunkError(
                        f"live-in {inp.name!r} of region {region.root!r} carries the chunk dim in "
                        "more than one dim; chunking it would mix tokens of different chunks",
                        node,
                    )
                elif isinstance(d, Unknown):
                    raise unknown_refusal(
                        node,
                        d,
                        f"so {where} cannot tell where its live-in {inp.name!r} carries the "
                        "chunk dim",
                    )
        if not influenced:
            # an op whose raw size arguments mention the chunk symbol (``full([u0, 8])``), or a
            # creation op the static probe chunked
            influenced = shapes.args_carry_chunk(node) or (
                not node.all_input_nodes and isinstance(shapes.dim(node), int)
            )
        if not influenced and is_collective(node):
            rp.shared_collectives.append(node)
        if influenced:
            if node in plan.split_dim or node in plan.scalars:
                raise ChunkError(
                    f"{where} computes a value an earlier-starting region already consumed as a "
                    "live-in; interleaved regions are not supported."
                    + _interleaved_fix(node, region.root),
                    node,
                )
            check_body_node(node, region.root, shapes)
            body.add(node)
            rp.body.append(node)
            plan.owner[node] = rp
            # the symbols the values mention (a binding of a retraced graph is renamed)
            plan.body_unbacked.update(unbacked_bindings(node))
    for node in rp.body:
        shared = [
            i
            for i in _mutated_positions(node)
            if i < len(node.args)
            and isinstance(node.args[i], torch.fx.Node)
            and node.args[i] not in body
            and node.args[i] not in plan.split_dim
            and node.args[i] not in rp.routed
        ]
        if len(shared) > 1:
            raise ChunkError("chunked op mutates more than one shared input", node)
        if shared:
            rp.chains[node] = shared[0]
            continue
        pos = _accumulation_position(node, body, plan, shapes)
        if pos is not None:
            rp.chains[node] = pos
            continue
        body_inputs = [i for i in node.all_input_nodes if i in body]
        if (
            body_inputs
            and shapes.dim(node) is None
            and all(i in rp.chains or i in rp.followers for i in body_inputs)
        ):
            rp.followers.add(node)  # computed from a buffer's running value only
    return rp


#: Single-input ops a summed live-out may be reached through and that commute with the sum of
#: the chunk partials (layout only), plus the communicating ``all_reduce`` / reduce-scatter and
#: waits (see ``_replayable``): the partials are summed before them, they run once.
_SUM_TRANSPARENT: frozenset[Any] = frozenset(
    {
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.squeeze.dim,
        aten.unsqueeze.default,
        aten.alias.default,
        aten.clone.default,
        aten.detach.default,
    }
)
#: The same for a concatenated live-out (the chunk dim must survive the op; see ``_early_chain``).
_CAT_TRANSPARENT: frozenset[Any] = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.alias.default,
        aten.clone.default,
        aten.detach.default,
    }
)
_CAT_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _replayable(node: torch.fx.Node, kind: str) -> bool:
    """``node`` may run once on the full value instead of once per chunk: a layout op of its
    kind's set, a wait, an ``all_reduce``, or (summed values only) a reduce-scatter."""
    if node.target in (_SUM_TRANSPARENT if kind == "sum" else _CAT_TRANSPARENT):
        return True
    if is_wait(node):
        return True
    all_reduce = all_reduce_op()
    if all_reduce is not None and node.target is all_reduce:
        return True
    return kind == "sum" and is_reduce_scatter(node)


def _early_chain(
    live_out: torch.fx.Node, kind: str, rp: RegionPlan, plan: Plan, shapes: ChunkShapes
) -> list[torch.fx.Node]:
    """[start, ..., live_out]: the single-input suffix to replay once on the full value."""
    chain = [live_out]
    p = live_out
    while _replayable(p, kind) and p.args and isinstance(p.args[0], torch.fx.Node):
        q = p.args[0]
        if plan.owner.get(q) is not rp or len(q.users) != 1 or q in rp.chains:
            break
        # other inputs must exist at full size before the replay: shared values and scalar
        # live-ins (the replay uses their full value), never chunk-valued ones
        others = [a for a in p.all_input_nodes if a is not q]
        if any(a in plan.owner or a in plan.split_dim for a in others):
            break
        if kind == "sum":
            if shapes.dim(q) is not None:
                break
        else:
            dq, dp = shapes.dim(q), shapes.dim(p)
            if not isinstance(dq, int) or not isinstance(dp, int):
                break
            if p.target in _CAT_VIEWS and not dq == dp == 0:
                break
            if p.target not in _CAT_VIEWS and dq != dp:
                break
        chain.insert(0, q)
        p = q
    return chain


def _is_linear_in_chunk_symbol(val: Any, hints: dict[sympy.Symbol, int]) -> bool:
    if not isinstance(val, torch.SymInt):
        return False
    expr = val.node.expr
    syms = expr.free_symbols & hints.keys()
    if len(syms) != 1 or expr.free_symbols - syms:
        return False
    (s,) = syms
    return bool(expr.subs(s, 0) == 0 and sympy.diff(expr, s).is_number)


def _remedy(rp: RegionPlan, shapes: ChunkShapes) -> str:
    """The fix a live-out refusal names: with static sizes (``hint=None`` marks or
    ``ChunkConfig.chunk_inputs`` names) a value whose token dim hides behind a data-dependent
    size (an expert-parallel exchange's received rows) is not told apart from a parameter
    gradient, which hinted marks tell; in any mode, leaving the region unchunked."""
    hinted = (
        " With static token sizes the token dim of a value behind a data-dependent size (the "
        "rows an expert-parallel exchange received) cannot be followed: mark the token inputs "
        "with their extent as hint instead, ap_epchunk.mark_chunk_dim(t, 0, hint=t.shape[0]), "
        "before the first compiled call (no ChunkConfig.chunk_inputs);"
        if shapes.mode == "static"
        else ""
    )
    return f".{hinted} {'or' if hinted else 'Fix:'} {_leave_unchunked(rp.root)}"


def _leave_unchunked(root: str) -> str:
    """The fix every region refusal can name: chunk without this region."""
    return (
        f"leave {root!r} unchunked (ChunkConfig(module_patterns=...) without it, or "
        "num_chunks=1: ep_chunk=None)"
    )


def _plan_live_outs(rp: RegionPlan, plan: Plan, shapes: ChunkShapes, early: bool) -> None:
    for node in rp.body:
        users = semantic_users(node)
        full = [
            u
            for u in users
            if not (plan.owner.get(u) is rp or (u in plan.owner and node in plan.owner[u].routed))
        ]
        if not full:
            continue
        val = node.meta.get("val")
        d = shapes.dim(node)
        if node in rp.chains or node in rp.followers:
            kind = "last"
        elif isinstance(d, int):
            kind = "cat"
        elif isinstance(val, torch.Tensor):
            if not rp.backward or not (val.dtype.is_floating_point or val.dtype.is_complex):
                raise ChunkError(
                    f"value without the chunk dim escapes region {rp.root!r} to full users "
                    f"({_name_list(full)}); only backward parameter-gradient partials can be "
                    f"summed, forward values must carry the chunk dim{_remedy(rp, shapes)}",
                    node,
                )
            if _feeds_token_values(node, plan, shapes):
                raise ChunkError(
                    f"backward value without the chunk dim escapes region {rp.root!r} into values "
                    f"that carry tokens ({_name_list(full)}); only parameter-gradient partials "
                    f"(whose consumers never carry the chunk dim) can be summed"
                    f"{_remedy(rp, shapes)}; where the compiled callable returns an output "
                    "and the loss is computed after it (a full-batch tangent), return the "
                    "loss from the compiled callable instead",
                    node,
                )
            kind = "sum"
        elif isinstance(val, (int, torch.SymInt)) and not shapes.scalar_carries_chunk(node):
            if free_symbols(val) & plan.body_unbacked:
                raise ChunkError(
                    f"data-dependent scalar {val} computed from chunk values in region "
                    f"{rp.root!r} escapes to full users ({_name_list(full)}); each chunk has "
                    f"its own value and none of them is the full one ({source_of(node)})",
                    node,
                )
            kind = "same"
        elif _is_linear_in_chunk_symbol(val, shapes.symbol_hints()):
            kind = "ssum"
        else:
            raise ChunkError(
                f"cannot rebuild the full value of this region-{rp.root!r} live-out from its "
                f"chunks for full users ({_name_list(full)})",
                node,
            )
        chain = [node]
        if early and rp.backward and kind in ("cat", "sum") and len(full) == len(users):
            chain = _early_chain(node, kind, rp, plan, shapes)
        start = chain[0]
        dim = shapes.dim(start) if kind == "cat" else None
        rp.materialize.append(
            Materialize(node, kind, dim if isinstance(dim, int) else None, start, chain[1:], full)
        )


def make_plan(regions: list[Region], shapes: ChunkShapes, early_grad_accumulation: bool) -> Plan:
    plan = Plan([], {}, {}, set())
    for region in regions:
        rp = _plan_body(region, plan, shapes)
        if rp.body:
            plan.regions.append(rp)
    if not plan.regions:
        raise ChunkError(
            "the matched regions contain no node influenced by the chunk dimension: "
            + ", ".join(sorted({f"{r.root} ({'bw' if r.backward else 'fw'})" for r in regions}))
        )
    order = {id(rp): i for i, rp in enumerate(plan.regions)}
    for rp in plan.regions:
        for node in rp.body:
            for user in node.users:
                owner = plan.owner.get(user)
                if owner is not None and order[id(owner)] < order[id(rp)]:
                    raise ChunkError(
                        f"region {owner.root!r} starts before region {rp.root!r} but consumes "
                        "its value; interleaved regions are not supported",
                        node,
                    )
        _plan_live_outs(rp, plan, shapes, early_grad_accumulation)
    check_collectives(plan)
    return plan
