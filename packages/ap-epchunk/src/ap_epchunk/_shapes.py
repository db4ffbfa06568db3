"""Where a value carries the chunk dimension, and what a chunk of it looks like.

Two oracles answer the same three questions (``dim``, ``chunk_val``, ``chunk_args``):

* **symbolic**: the chunk extent is a hinted unbacked symbol ``u`` in the placeholders' shapes.
  A tensor carries the chunk dim ``d`` iff exactly ``shape[d]`` mentions ``u``; a chunk of it is
  the same value with ``u -> u // N``. Nothing is re-executed.
* **static**: sizes are plain ints, so the pass cannot read chunk influence off the values.
  It fake-executes every node downstream of the ``chunk_inputs`` once on chunk-sized inputs
  (a *probe*), rewriting the constant shape lists of ``view``/``reshape``/``expand`` so the
  chunk dim flows through them; the dims whose size shrank by N are the chunk dims.
  Values built from baked constant sizes that do not flow from a chunk input (e.g. ``zeros``
  with a literal shape) are, necessarily, seen as unchunked.

A value whose chunk influence shows up in more than one dim (``q @ k.T`` under sequence
chunking) is ``MULTI``; a static probe that failed is an ``Unknown`` carrying the reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
import torch.fx
from ap_tags.scoped import quiet_logger
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ._compat import FAKE_TENSOR_LOGGER, floor_div, optimization_hint, shape_env_of
from ._errors import ChunkError
from ._symbols import subst_value

aten = torch.ops.aten


class _Multi:
    def __repr__(self) -> str:
        return "MULTI"


MULTI = _Multi()


@dataclass(frozen=True)
class Unknown:
    reason: str


ChunkDim = int | None | _Multi | Unknown


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


class ChunkShapes:
    """Base oracle: subclasses decide how chunk dims are found."""

    mode = "abstract"

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks

    def dim(self, node: torch.fx.Node) -> ChunkDim:
        raise NotImplementedError

    def chunk_val(self, node: torch.fx.Node) -> Any:
        raise NotImplementedError

    def chunk_args(self, node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return node.args, dict(node.kwargs)

    def scalar_carries_chunk(self, node: torch.fx.Node) -> bool:
        return False

    def symbol_hints(self) -> dict[sympy.Symbol, int]:
        return {}


class SymbolicShapes(ChunkShapes):
    mode = "symbolic"

    def __init__(self, num_chunks: int, hints: dict[sympy.Symbol, int]) -> None:
        super().__init__(num_chunks)
        self.hints = hints
        self.mapping = {s: floor_div(s, num_chunks) for s in hints}
        self.cache: dict[Any, Any] = {}

    def dim(self, node: torch.fx.Node) -> ChunkDim:
        return _symbolic_dims(node.meta.get("val"), self.hints)

    def chunk_val(self, node: torch.fx.Node) -> Any:
        return subst_value(node.meta.get("val"), self.mapping, self.cache)

    def scalar_carries_chunk(self, node: torch.fx.Node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, torch.SymInt) and bool(
            val.node.expr.free_symbols & self.hints.keys()
        )

    def symbol_hints(self) -> dict[sympy.Symbol, int]:
        return dict(self.hints)


def find_chunk_symbols(graph: torch.fx.Graph, num_chunks: int) -> dict[sympy.Symbol, int]:
    """Hinted unbacked symbols in placeholder shapes; each hint must be divisible by N."""
    hints: dict[sympy.Symbol, int] = {}
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        env = shape_env_of(val)
        if env is None:
            continue
        for sym in sorted(free_unbacked_symbols(val), key=str):
            hint = optimization_hint(env, sym)
            if hint is None:
                continue
            if hint % num_chunks:
                raise ChunkError(
                    f"chunk extent {sym} has hint {hint}, not divisible by num_chunks={num_chunks}",
                    node,
                )
            hints[sym] = hint
    return hints


# ----------------------------------------------------------------------------- static probe

_VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _view_out_dim(in_shape: list[int], c: int, out_shape: list[int], n: int) -> int | None:
    """Output dim a view maps input chunk dim ``c`` onto, keeping chunks contiguous."""
    outer = math.prod(in_shape[:c])
    for d in range(len(out_shape)):
        if math.prod(out_shape[:d]) == outer and out_shape[d] % n == 0 and out_shape[d] >= n:
            return d
        if math.prod(out_shape[:d]) > outer:
            break
    return None


class StaticShapes(ChunkShapes):
    mode = "static"

    def __init__(
        self, graph: torch.fx.Graph, sources: dict[torch.fx.Node, int], num_chunks: int
    ) -> None:
        super().__init__(num_chunks)
        self.probe: dict[torch.fx.Node, Any] = {}
        self.failed: dict[torch.fx.Node, str] = {}
        self.args: dict[torch.fx.Node, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        for src, d in sources.items():
            val = src.meta.get("val")
            if not isinstance(val, torch.Tensor) or not -val.dim() <= d < val.dim():
                raise ChunkError(f"chunk input has no dim {d}", src)
            d %= val.dim()
            if val.shape[d] % num_chunks:
                raise ChunkError(
                    f"chunk extent {val.shape[d]} (dim {d}) is not divisible by "
                    f"num_chunks={num_chunks}",
                    src,
                )
            if val.shape[d] // num_chunks < 2:
                raise ChunkError(
                    f"chunks of {val.shape[d] // num_chunks} token along dim {d} cannot be told "
                    "apart from broadcasting in a static-size graph; use at least 2 tokens per "
                    "chunk, or an unbacked chunk dim",
                    src,
                )
            shape = list(val.shape)
            shape[d] //= num_chunks
            self.probe[src] = val.new_empty_strided(shape, val.stride())
            self.fake_mode = getattr(val, "fake_mode", None)
        self._run(graph)

    def _run(self, graph: torch.fx.Graph) -> None:
        import contextlib

        mode = self.fake_mode if self.fake_mode is not None else contextlib.nullcontext()
        # a probe that fails is an answer ("unknown"), not an error: keep the fake-tensor
        # logger from printing a traceback for each one (a scoped patch: its level is restored
        # on exit, also when several passes probe at once)
        with quiet_logger(FAKE_TENSOR_LOGGER):
            self._probe_all(graph, mode)

    def _probe_all(self, graph: torch.fx.Graph, mode: Any) -> None:
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            inputs = node.all_input_nodes
            if not any(i in self.probe or i in self.failed for i in inputs):
                continue
            bad = next((self.failed[i] for i in inputs if i in self.failed), None)
            if bad is not None:
                self.failed[node] = bad
                continue
            try:
                args, kwargs = self._rewrite_shapes(node)
                self.args[node] = (args, kwargs)
                vals = torch.fx.node.map_arg((args, kwargs), self._val)
                assert callable(node.target)
                with mode:
                    self.probe[node] = node.target(*vals[0], **vals[1])
            except Exception as exc:  # noqa: BLE001 - any failure makes the value unknown
                self.failed[node] = f"{type(exc).__name__}: {exc}".splitlines()[0]

    def _val(self, n: torch.fx.Node) -> Any:
        return self.probe[n] if n in self.probe else n.meta.get("val")

    def _rewrite_shapes(self, node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = tuple(node.args), dict(node.kwargs)
        if node.target not in _VIEW_OPS and node.target is not aten.expand.default:
            return self._rewrite_template_sizes(node, args, kwargs)
        src = args[0]
        if not isinstance(src, torch.fx.Node) or src not in self.probe:
            return args, kwargs
        c = self.dim(src)
        if not isinstance(c, int):
            return args, kwargs
        sizes = list(args[1])  # type: ignore[arg-type]
        if not all(isinstance(s, int) for s in sizes):
            return args, kwargs
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor):
            return args, kwargs
        out_shape = [int(s) for s in out.shape]
        if node.target is aten.expand.default:
            d: int | None = c + len(out_shape) - self._val(src).dim()
        else:
            d = _view_out_dim(
                [int(s) for s in src.meta["val"].shape], c, out_shape, self.num_chunks
            )
        if d is None:
            raise ChunkError(f"cannot carry chunk dim {c} through this view", node)
        if sizes[d] != -1:
            sizes[d] = out_shape[d] // self.num_chunks
        return (args[0], sizes, *args[2:]), kwargs

    def _rewrite_template_sizes(
        self, node: torch.fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``new_zeros(t, [8, 4])``, ``slice_backward(g, [8, 4], ...)``: a size list of the
        template's rank whose entry at the template's chunk dim is the full extent shrinks."""
        schema = getattr(node.target, "_schema", None)
        if schema is None or not args or not isinstance(args[0], torch.fx.Node):
            return args, kwargs
        c = self.dim(args[0]) if args[0] in self.probe else None
        if not isinstance(c, int):
            return args, kwargs
        full = args[0].meta["val"]
        new_args = list(args)
        for i, arg in enumerate(schema.arguments[: len(args)]):
            if i == 0 or str(arg.type) not in ("List[int]", "SymInt[]", "int[]"):
                continue
            sizes = args[i]
            if (
                isinstance(sizes, (list, tuple))
                and len(sizes) == full.dim()
                and all(isinstance(s, int) for s in sizes)
                and sizes[c] == full.shape[c]
            ):
                new_sizes = list(sizes)
                new_sizes[c] = int(full.shape[c]) // self.num_chunks
                new_args[i] = new_sizes
        return tuple(new_args), kwargs

    def dim(self, node: torch.fx.Node) -> ChunkDim:
        if node in self.failed:
            return Unknown(self.failed[node])
        if node not in self.probe:
            return None
        full, part = node.meta.get("val"), self.probe[node]
        if not isinstance(full, torch.Tensor) or not isinstance(part, torch.Tensor):
            return None
        if full.dim() != part.dim():
            return Unknown(f"chunk rank {part.dim()} differs from full rank {full.dim()}")
        dims = [d for d in range(full.dim()) if full.shape[d] != part.shape[d]]
        if not dims:
            return None
        if len(dims) > 1:
            return MULTI
        d = dims[0]
        if full.shape[d] != part.shape[d] * self.num_chunks:
            return Unknown(f"dim {d} shrank from {full.shape[d]} to {part.shape[d]}")
        return d

    def chunk_val(self, node: torch.fx.Node) -> Any:
        return self.probe.get(node, node.meta.get("val"))

    def chunk_args(self, node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.args.get(node, (node.args, dict(node.kwargs)))


def build_shapes(
    graph: torch.fx.Graph, num_chunks: int, chunk_inputs: tuple[str, ...], dim: int
) -> ChunkShapes:
    """The oracle for this graph: static when ``chunk_inputs`` is given, else symbolic."""
    if chunk_inputs:
        by_name = {n.name: n for n in graph.find_nodes(op="placeholder")}
        missing = [name for name in chunk_inputs if name not in by_name]
        if missing:
            raise ChunkError(
                f"ChunkConfig.chunk_inputs names no placeholder {missing}; placeholders are "
                f"{sorted(by_name)}"
            )
        return StaticShapes(graph, {by_name[name]: dim for name in chunk_inputs}, num_chunks)
    hints = find_chunk_symbols(graph, num_chunks)
    if not hints:
        raise ChunkError(
            "no chunk dimension: mark the token inputs with mark_chunk_dim(..., hint=N) before "
            "tracing, or name static-size inputs in ChunkConfig.chunk_inputs"
        )
    return SymbolicShapes(num_chunks, hints)
