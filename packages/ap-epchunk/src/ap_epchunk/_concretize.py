"""``concretize_chunk_symbols``: make a chunked graph static before codegen.

Between chunking and codegen the chunk extents stay symbolic (``u0``, ``u0 // 2``) so that
schedulers can reason about them. Backends must not see them, so this pass replaces **only the
chunk symbols** (recorded by ``chunk_pass`` in ``gm.meta``; without that record, the hinted
unbacked symbols of the placeholders' ``meta["val"]`` or ``meta["example_value"]``, tensor
sizes or SymInts) by their hints:

1. in node args/kwargs and in ``meta["val"]``/``meta["example_value"]`` of ``gm`` and of every
   GraphModule reachable from it through ``get_attr`` or node args (higher-order-op subgraphs);
2. scalar nodes that become constants (``sym_size``, ``//`` ...) are folded into their users,
   and the dead scalar plumbing (those nodes and ``_assert_scalar`` guards now known true) is
   erased. A scalar *placeholder* that becomes a constant (the token extent Dynamo passes as
   a graph input when the token dim is symbolic) is folded into its users and kept, unused:
   the graph's signature does not change, and no partitioner saves it for the backward as
   a plain int, which AOTAutograd would count neither as a tensor nor as a SymInt. A call
   with another extent still fails at run time, on the token tensor's size assert;
3. a guard that evaluates to False under the hints raises ``ChunkError`` *before* anything is
   changed;
4. afterwards no chunk symbol may remain anywhere (checked; an internal error otherwise).

Other symbols are left alone: ``u0 + s1`` becomes ``8 + s1``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
import torch.fx
from ap_tags.checks import require_graph_module, require_instance
from ap_tags.scoped import paused_gc

from ._errors import ChunkError
from ._passes import CHUNK_SYMBOLS_META
from ._shapes import placeholder_hints
from ._symbols import free_symbols, subst_value

aten = torch.ops.aten

_PURE_SCALAR_OPS: set[Any] = {
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.truediv,
    operator.mod,
    operator.neg,
    operator.pow,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.and_,
    operator.or_,
    operator.not_,
    torch.sym_max,
    torch.sym_min,
    torch.sym_not,
    torch.sym_ite,
    torch.sym_float,
    torch.sym_int,
}
_ASSERTS: set[Any] = {aten._assert_scalar.default}


@dataclass
class ConcretizeReport:
    symbols: dict[str, int] = field(default_factory=dict)
    graphs: int = 0
    folded: int = 0
    erased: int = 0


def _graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``gm`` plus every GraphModule reachable through ``get_attr`` or node args."""
    seen: dict[int, torch.fx.GraphModule] = {id(gm): gm}
    todo = [gm]
    while todo:
        cur = todo.pop()
        for node in cur.graph.nodes:
            found: list[Any] = []
            if node.op == "get_attr":
                obj: Any = cur
                try:
                    for part in str(node.target).split("."):
                        obj = getattr(obj, part)
                    found.append(obj)
                except AttributeError:
                    pass
            torch.fx.node.map_aggregate((node.args, node.kwargs), found.append)
            for obj in found:
                if isinstance(obj, torch.fx.GraphModule) and id(obj) not in seen:
                    seen[id(obj)] = obj
                    todo.append(obj)
    return list(seen.values())


class _Substitution:
    def __init__(self, hints: Mapping[str, int]) -> None:
        self.hints = dict(hints)
        self.cache: dict[Any, Any] = {}

    def mapping(self, value: Any) -> dict[sympy.Symbol, sympy.Expr]:
        return {
            s: sympy.Integer(self.hints[s.name])
            for s in free_symbols(value)
            if s.name in self.hints
        }

    def touches(self, value: Any) -> bool:
        return any(s.name in self.hints for s in free_symbols(value))

    def apply(self, value: Any) -> Any:
        mapping = self.mapping(value)
        return subst_value(value, mapping, self.cache) if mapping else value


def _meta_values(node: torch.fx.Node) -> Iterator[tuple[str, Any]]:
    for key in ("val", "example_value"):
        if key in node.meta:
            yield key, node.meta[key]


def _concrete(value: Any) -> bool:
    return isinstance(value, (int, float, bool)) and not isinstance(
        value, (torch.SymInt, torch.SymFloat, torch.SymBool)
    )


def _check_guards(gm: torch.fx.GraphModule, sub: _Substitution) -> None:
    for node in gm.graph.nodes:
        if node.target not in _ASSERTS or not node.args:
            continue
        cond = node.args[0]
        value = cond.meta.get("val") if isinstance(cond, torch.fx.Node) else cond
        if not sub.touches(value):
            continue
        result = sub.apply(value)
        if result is False:
            msg = node.args[1] if len(node.args) > 1 else ""
            raise ChunkError(
                f"guard is false after substituting chunk-symbol hints {sub.hints}: "
                f"{value} ({msg})",
                node,
            )


def _concretize_graph(gm: torch.fx.GraphModule, sub: _Substitution, rep: ConcretizeReport) -> None:
    touched: set[torch.fx.Node] = set()
    constants: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if sub.touches((node.args, node.kwargs)):
            node.args, node.kwargs = torch.fx.node.map_aggregate(
                (node.args, node.kwargs), sub.apply
            )
            touched.add(node)
        for key, value in list(_meta_values(node)):
            mapping = sub.mapping(value)
            if mapping:
                new = subst_value(value, mapping, sub.cache)
                node.meta[key] = new
                touched.add(node)
                if _concrete(new) and (
                    node.op == "placeholder"
                    or node.op == "call_function"
                    and node.target in _PURE_SCALAR_OPS
                ):
                    constants[node] = new
    for node, const in constants.items():
        for user in list(node.users):
            user.args, user.kwargs = torch.fx.node.map_arg(
                (user.args, user.kwargs), _replacer(node, const)
            )
        rep.folded += 1
    for node in reversed(list(gm.graph.nodes)):
        if node.users or node not in touched and node not in _assert_true(node):
            continue
        if node.target in _PURE_SCALAR_OPS or (
            node.target in _ASSERTS and node.args and node.args[0] is True
        ):
            gm.graph.erase_node(node)
            rep.erased += 1
    gm.graph.lint()
    gm.recompile()


def _replacer(node: torch.fx.Node, const: Any) -> Any:
    def one(a: torch.fx.Node) -> Any:
        return const if a is node else a

    return one


def _assert_true(node: torch.fx.Node) -> set[torch.fx.Node]:
    if node.target in _ASSERTS and node.args and node.args[0] is True:
        return {node}
    return set()


def _leftovers(gm: torch.fx.GraphModule, sub: _Substitution) -> list[str]:
    bad = []
    for node in gm.graph.nodes:
        values = [node.args, node.kwargs, *(v for _, v in _meta_values(node))]
        if sub.touches(values):
            bad.append(node.name)
    return bad


def concretize_chunk_symbols(
    gm: torch.fx.GraphModule, example_inputs: list[Any] | tuple[Any, ...] | None = None
) -> ConcretizeReport:
    """Replace the chunk symbols of ``gm`` (and its subgraphs) by their hints; see module doc.

    ``example_inputs``, when a list, has its fake tensors carrying chunk symbols replaced in
    place by concrete ones, so it keeps matching the placeholders.
    """
    require_graph_module(gm, where="concretize_chunk_symbols")
    if example_inputs is not None:
        require_instance(
            example_inputs,
            (list, tuple),
            where="concretize_chunk_symbols",
            arg="example_inputs",
            expected="a list (or tuple, left unchanged) or None",
        )
    with paused_gc():
        return _concretize(gm, example_inputs)


def _concretize(
    gm: torch.fx.GraphModule, example_inputs: list[Any] | tuple[Any, ...] | None
) -> ConcretizeReport:
    hints: dict[str, int] | None = gm.meta.get(CHUNK_SYMBOLS_META)
    if hints is None:
        hints = {s.name: h for s, h in placeholder_hints(gm.graph).items()}
    rep = ConcretizeReport(symbols=dict(hints))
    if not hints:
        return rep
    sub = _Substitution(hints)
    modules = _graph_modules(gm)
    for mod in modules:
        _check_guards(mod, sub)
    for mod in modules:
        _concretize_graph(mod, sub, rep)
    rep.graphs = len(modules)
    if isinstance(example_inputs, list):
        example_inputs[:] = [
            sub.apply(v) if isinstance(v, torch.Tensor) else v for v in example_inputs
        ]
    left = {mod: _leftovers(mod, sub) for mod in modules}
    bad = [name for names in left.values() for name in names]
    if bad:
        raise AssertionError(
            f"concretize_chunk_symbols left chunk symbols {sorted(hints)} in nodes {bad}"
        )
    gm.meta.pop(CHUNK_SYMBOLS_META, None)
    return rep
