"""Where a value carries the chunk dimension, and what a chunk of it looks like.

Two oracles answer the same questions (``dim``, ``chunk_val``, ``chunk_args``; the interface is
``_chunk_dims.ChunkShapes``), and :func:`build_shapes` picks one per graph:

* **symbolic** (here): the chunk extent is a hinted unbacked symbol ``u`` in the placeholders'
  shapes. A tensor carries the chunk dim ``d`` iff exactly ``shape[d]`` mentions ``u``; a chunk
  of it is the same value with ``u -> u // N``, and so is every raw SymInt argument of a chunk
  copy (``as_strided(x, [u0, 256], ...)`` becomes ``[u0 // N, 256]``). Nothing is re-executed.
* **static** (``_static_shapes``): sizes are plain ints, so the pass fake-executes the graph
  once on chunk-sized ``chunk_inputs`` (a *probe*).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ._chunk_dims import MULTI, ChunkDim, ChunkShapes
from ._compat import floor_div, optimization_hint, shape_env_of, tree_map
from ._errors import ChunkError
from ._static_shapes import StaticShapes
from ._symbols import subst_scalar, subst_value

aten = torch.ops.aten


def _symbolic_dims(val: Any, symbols: Iterable[sympy.Symbol]) -> ChunkDim:
    if not isinstance(val, torch.Tensor):
        return None
    syms = set(symbols)
    dims = [
        d
        for d, s in enumerate(val.shape)
        if isinstance(s, torch.SymInt) and s.node.expr.free_symbols & syms
    ]
    if not dims:
        return None
    return dims[0] if len(dims) == 1 else MULTI


class SymbolicShapes(ChunkShapes):
    mode = "symbolic"

    def __init__(self, num_chunks: int, hints: dict[sympy.Symbol, int]) -> None:
        super().__init__(num_chunks)
        self.hints = hints
        self.mapping = {s: floor_div(s, num_chunks) for s in hints}
        self.cache: dict[Any, Any] = {}

    def _mentions(self, value: Any) -> bool:
        return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and bool(
            value.node.expr.free_symbols & self.hints.keys()
        )

    def dim(self, node: torch.fx.Node) -> ChunkDim:
        return _symbolic_dims(node.meta.get("val"), self.hints)

    def chunk_val(self, node: torch.fx.Node) -> Any:
        return subst_value(node.meta.get("val"), self.mapping, self.cache)

    def chunk_args(self, node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        def one(v: Any) -> Any:
            return subst_scalar(v, self.mapping, self.cache) if self._mentions(v) else v

        args, kwargs = tree_map(one, (tuple(node.args), dict(node.kwargs)))
        return tuple(args), dict(kwargs)

    def scalar_carries_chunk(self, node: torch.fx.Node) -> bool:
        return self._mentions(node.meta.get("val"))

    def args_carry_chunk(self, node: torch.fx.Node) -> bool:
        found = [False]

        def one(v: Any) -> Any:
            if self._mentions(v):
                found[0] = True
            return v

        tree_map(one, (tuple(node.args), dict(node.kwargs)))
        return found[0]

    def symbol_hints(self) -> dict[sympy.Symbol, int]:
        return dict(self.hints)


def _hinted_symbols(val: Any) -> dict[sympy.Symbol, int]:
    """The hinted unbacked symbols of a fake tensor's sizes and strides, or of a SymInt."""
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        env = val.node.shape_env
    elif isinstance(val, torch.Tensor):
        env = shape_env_of(val)
    else:
        return {}
    if env is None:
        return {}
    out: dict[sympy.Symbol, int] = {}
    for sym in sorted(free_unbacked_symbols(val), key=str):
        hint = optimization_hint(env, sym)
        if hint is not None:
            out[sym] = hint
    return out


def _symbol_at(val: torch.Tensor, dim: int, hinted: dict[sympy.Symbol, int]) -> set[sympy.Symbol]:
    if not -val.dim() <= dim < val.dim():
        return set()
    size = val.shape[dim]
    if not isinstance(size, torch.SymInt):
        return set()
    return set(size.node.expr.free_symbols) & hinted.keys()


def placeholder_hints(graph: torch.fx.Graph) -> dict[sympy.Symbol, int]:
    """Every hinted unbacked symbol of the placeholders' ``meta["val"]`` or
    ``meta["example_value"]`` (a Dynamo graph's), tensors and SymInts alike, with its hint:
    the chunk symbols concretization assumes when ``chunk_pass`` left no record."""
    out: dict[sympy.Symbol, int] = {}
    for node in graph.find_nodes(op="placeholder"):
        for key in ("val", "example_value"):
            for sym, hint in _hinted_symbols(node.meta.get(key)).items():
                out.setdefault(sym, hint)
    return out


def find_chunk_symbols(
    graph: torch.fx.Graph,
    num_chunks: int,
    names: tuple[str, ...] = (),
    dim: int | None = None,
) -> dict[sympy.Symbol, int]:
    """The chunk symbols of a graph with hinted unbacked token dims, each with its hint.

    * ``names`` given: the hinted symbol at ``dim`` of each named placeholder;
    * otherwise, when ``dim`` is given and some placeholder has a hinted symbol alone at
      ``dim``: those symbols (an input carrying several, e.g. batch and width, is read at the
      token dim only);
    * otherwise every hinted unbacked symbol of the placeholders, as long as no placeholder
      carries more than one (then the token dim must be named with ``ChunkConfig.dim``);
      ``dim=None`` (concretization without a record) takes them all.

    Each hint must be divisible by N.
    """
    placeholders = [
        n for n in graph.find_nodes(op="placeholder") if isinstance(n.meta.get("val"), torch.Tensor)
    ]
    if names:
        placeholders = [n for n in placeholders if n.name in names]
    chosen: dict[sympy.Symbol, tuple[int, torch.fx.Node]] = {}
    several: list[tuple[torch.fx.Node, list[str]]] = []
    for node in placeholders:
        val = node.meta["val"]
        hinted = _hinted_symbols(val)
        at_dim = _symbol_at(val, dim, hinted) if dim is not None else set()
        if names and len(at_dim) != 1:
            size = val.shape[dim] if dim is not None and -val.dim() <= dim < val.dim() else None
            raise ChunkError(
                f"ChunkConfig.chunk_inputs names this placeholder, but its dim {dim} ({size}) is "
                "not one hinted unbacked size",
                node,
            )
        if len(at_dim) == 1:
            (sym,) = at_dim
            chosen.setdefault(sym, (hinted[sym], node))
        if len(hinted) > 1:
            several.append((node, [str(s) for s in hinted]))
    if not chosen and not names:
        if several and dim is not None:
            node, syms = several[0]
            raise ChunkError(
                f"this input carries several hinted unbacked symbols {syms} and none of them is "
                f"alone at ChunkConfig.dim={dim}; name the token dim with ChunkConfig(dim=...) "
                "(and ChunkConfig(chunk_inputs=...) for the inputs that carry it)",
                node,
            )
        for node in placeholders:
            for sym, hint in _hinted_symbols(node.meta["val"]).items():
                chosen.setdefault(sym, (hint, node))
    hints: dict[sympy.Symbol, int] = {}
    for sym, (hint, node) in chosen.items():
        if hint % num_chunks:
            raise ChunkError(
                f"chunk extent {sym} has hint {hint}, not divisible by num_chunks={num_chunks}",
                node,
            )
        hints[sym] = hint
    return hints


def build_shapes(
    graph: torch.fx.Graph, num_chunks: int, chunk_inputs: tuple[str, ...], dim: int
) -> ChunkShapes:
    """The oracle for this graph.

    With ``chunk_inputs``: symbolic when the named placeholders' ``dim`` is a hinted unbacked
    size, static when it is a plain int. Without: symbolic over the placeholders' hinted
    unbacked symbols (``dim`` picks one when an input carries several).
    """
    if chunk_inputs:
        by_name = {n.name: n for n in graph.find_nodes(op="placeholder")}
        missing = [name for name in chunk_inputs if name not in by_name]
        if missing:
            raise ChunkError(
                f"ChunkConfig.chunk_inputs names no placeholder {missing}; placeholders are "
                f"{sorted(by_name)}"
            )
        named = [by_name[name] for name in chunk_inputs]
        symbolic = [
            n
            for n in named
            if isinstance(n.meta.get("val"), torch.Tensor)
            and _symbol_at(n.meta["val"], dim, _hinted_symbols(n.meta["val"]))
        ]
        if not symbolic:
            return StaticShapes(graph, {n: dim for n in named}, num_chunks)
        return SymbolicShapes(num_chunks, find_chunk_symbols(graph, num_chunks, chunk_inputs, dim))
    hints = find_chunk_symbols(graph, num_chunks, (), dim)
    if not hints:
        raise ChunkError(
            "no chunk dimension: mark the token inputs with ap_epchunk.mark_chunk_dim(x, dim, "
            "hint=x.shape[dim]) before trace_joint, precompile or the first call of a module "
            "compiled with autoparallel_backend(ep_chunk=...) (a hinted unbacked dim; "
            "hint=None keeps static sizes), or name the token placeholders in "
            "ChunkConfig.chunk_inputs"
        )
    return SymbolicShapes(num_chunks, hints)
