"""The static oracle: where a value carries the chunk dim when every size is a plain int.

The pass cannot read chunk influence off static values, so it fake-executes the graph once on
chunk-sized ``chunk_inputs`` (a *probe*):

- the constant shape lists of ``view``/``reshape``/``expand`` and the ``size`` lists of
  template ops (``new_zeros(t, [8, 4])``, ``as_strided``, ``slice_backward``) follow the chunk
  dim of their input;
- **creation ops** (``full``, ``zeros``, ``ones``, ``empty``, ``empty_strided``, ``arange``:
  what ``zeros_like(x)`` decomposes to) have no input to follow. They start full-size; when a
  consumer then fails on a full-size value next to chunk-sized ones (a broadcast, an
  ``index_put``), or a scatter/gather writes a chunk-carrying index into a full-size ``self``,
  the probe *repairs* it: it re-runs the consumers with each creation op upstream chunked
  along each divisible dim and keeps the one combination that makes them consistent (a
  chunked ``arange`` gives chunk-local positions). None fitting, or several, is a failure;
- a failure is recorded at the node where propagation first failed, with its source line,
  and every value computed from it reports that origin -- so a refusal names the cause, not
  a later victim.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from ap_tags.scoped import quiet_logger

from ._chunk_dims import MULTI, ChunkDim, ChunkShapes, Unknown, size_arg_positions
from ._compat import FAKE_TENSOR_LOGGER
from ._errors import ChunkError, source_of
from ._probe_ops import (
    SCATTER_OPERANDS,
    VIEW_OPS,
    check_index_put_values,
    chunked_creation_args,
    creation_dims,
    is_creation,
    view_out_dim,
)
from ._tangents import tangent_outputs

aten = torch.ops.aten


#: How far back from a failing node the repair looks for creation ops (nodes visited).
_REPAIR_REACH = 400

#: A table entry the trial did not have (told apart from an entry of None).
_MISSING: Any = object()


@dataclass(frozen=True)
class _Failure:
    reason: str
    origin: torch.fx.Node


class StaticShapes(ChunkShapes):
    mode = "static"

    def __init__(
        self, graph: torch.fx.Graph, sources: dict[torch.fx.Node, int], num_chunks: int
    ) -> None:
        super().__init__(num_chunks)
        self.probe: dict[torch.fx.Node, Any] = {}
        self.failed: dict[torch.fx.Node, _Failure] = {}
        self.args: dict[torch.fx.Node, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        #: creation ops the probe chunked, and along which dim
        self.chunked_creations: dict[torch.fx.Node, int] = {}
        self.fake_mode: Any = None
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
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        mode = self.fake_mode if self.fake_mode is not None else contextlib.nullcontext()
        # a probe that fails is an answer, not an error: keep the fake-tensor logger from
        # printing a traceback for each one (a scoped patch: its level is restored on exit,
        # also when several passes probe at once)
        with quiet_logger(FAKE_TENSOR_LOGGER), mode:
            self._probe_all(graph)

    # ------------------------------------------------------------------ the walk
    def _probe_all(self, graph: torch.fx.Graph) -> None:
        tangents = tangent_outputs(graph)
        for node in graph.nodes:
            if node.op != "call_function" or node in self.probe:
                continue
            inputs = node.all_input_nodes
            for tangent in inputs:
                if tangent in tangents and tangent not in self.probe:
                    self._probe_tangent(tangent, tangents[tangent])
            if not any(i in self.probe or i in self.failed for i in inputs):
                continue
            bad = next((self.failed[i] for i in inputs if i in self.failed), None)
            if bad is not None:
                self.failed[node] = bad  # the origin stays the node that failed first
                continue
            error = self._compute(node)
            if error is None:
                self._unify_scatter(node)
                continue
            if not self._repair(node, lambda: True) and node not in self.failed:
                self.failed[node] = _Failure(error, node)

    def _probe_tangent(self, tangent: torch.fx.Node, output: torch.fx.Node) -> None:
        """A tangent is chunk-sized along the dim its forward output carries (_tangents)."""
        d, val = self.dim(output), tangent.meta.get("val")
        if isinstance(d, int) and isinstance(val, torch.Tensor) and val.dim() > d:
            shape = list(val.shape)
            shape[d] //= self.num_chunks
            self.probe[tangent] = val.new_empty_strided(shape, val.stride())

    def _compute(self, node: torch.fx.Node) -> str | None:
        """Probe one node from its inputs' probe values; None, or why it failed."""
        try:
            if node.meta.get("unbacked_bindings"):
                # data-dependent (``.item()``, ``nonzero``): its value cannot be probed; the
                # traced value stands in (its symbols are refreshed per chunk by the rewrite)
                self.args[node] = (tuple(node.args), dict(node.kwargs))
                self.probe[node] = node.meta.get("val")
                return None
            args, kwargs = self._rewrite_shapes(node)
            vals = torch.fx.node.map_arg((args, kwargs), self._val)
            assert callable(node.target)
            self.probe[node] = node.target(*vals[0], **vals[1])
            check_index_put_values(node, vals[0], vals[1])
            self.args[node] = (args, kwargs)
            return None
        except Exception as exc:  # noqa: BLE001 - any failure makes the value unknown
            self.probe.pop(node, None)
            self.args.pop(node, None)
            return f"{type(exc).__name__}: {exc}".splitlines()[0]

    def _val(self, n: torch.fx.Node) -> Any:
        return self.probe[n] if n in self.probe else n.meta.get("val")

    # ------------------------------------------------------------------ creation-op repair
    def _creation_candidates(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """Creation ops upstream of ``node`` still at full size, reached through values without
        a chunk dim (probed, or computed from non-chunk inputs only; nearest first)."""
        found: list[torch.fx.Node] = []
        seen: set[torch.fx.Node] = set()
        todo = list(node.all_input_nodes)
        while todo and len(seen) < _REPAIR_REACH:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            if is_creation(cur) and cur not in self.probe:
                found.append(cur)
            elif cur.op == "call_function" and cur not in self.failed:
                if cur not in self.probe or self.dim(cur) is None:
                    todo.extend(cur.all_input_nodes)  # full-size values only
        return sorted(found, key=lambda n: -self.order[n])

    def _descendants(self, start: torch.fx.Node, upto: torch.fx.Node) -> list[torch.fx.Node]:
        """Nodes computed from ``start`` (itself excluded) up to ``upto`` in graph order."""
        limit = self.order[upto]
        seen: set[torch.fx.Node] = set()
        todo = [start]
        while todo:
            cur = todo.pop()
            for user in cur.users:
                if user not in seen and self.order.get(user, limit + 1) <= limit:
                    seen.add(user)
                    todo.append(user)
        return sorted((n for n in seen if n.op == "call_function"), key=self.order.__getitem__)

    def _trial(
        self, creation: torch.fx.Node, d: int, upto: torch.fx.Node, ok: Callable[[], bool]
    ) -> Callable[[], None] | None:
        """Chunk ``creation`` along ``d`` and re-probe everything computed from it up to
        ``upto``. Success (``upto`` and every re-probed node computed, ``ok()`` holds): the new
        state stays and an undo function is returned. Failure: the old state is back, None."""
        new_args = chunked_creation_args(creation, d, self.num_chunks)
        if new_args is None:
            return None
        affected = [creation, *self._descendants(creation, upto)]
        saved = {
            n: (self.probe.get(n, _MISSING), self.args.get(n, _MISSING), self.failed.get(n))
            for n in affected
        }

        def undo() -> None:
            for n, (p, a, f) in saved.items():
                for table, old in ((self.probe, p), (self.args, a)):
                    if old is _MISSING:
                        table.pop(n, None)
                    else:
                        table[n] = old
                if f is None:
                    self.failed.pop(n, None)
                else:
                    self.failed[n] = f

        try:
            assert callable(creation.target)
            vals = torch.fx.node.map_arg(new_args, self._val)  # expand's input: its full value
            self.probe[creation] = creation.target(*vals[0], **vals[1])
            self.args[creation] = new_args
            self.failed.pop(creation, None)
            for n in affected[1:]:
                was_probed = saved[n][0] is not _MISSING or n is upto
                if not was_probed and not any(i in self.probe for i in n.all_input_nodes):
                    continue
                bad = next((self.failed[i] for i in n.all_input_nodes if i in self.failed), None)
                if bad is not None:  # failed for another reason; this trial cannot fix it
                    self.failed[n] = bad
                    self.probe.pop(n, None)
                    if n is upto:
                        undo()
                        return None
                    continue
                self.failed.pop(n, None)
                if self._compute(n) is not None:
                    undo()
                    return None
        except Exception:  # noqa: BLE001 - a creation op that cannot be built this way
            undo()
            return None
        if self.dim(creation) != d or not ok():
            undo()
            return None
        return undo

    def _repair(
        self, node: torch.fx.Node, ok: Callable[[], bool], *, blame_ambiguity: bool = True
    ) -> bool:
        """Find the one (creation op, dim) whose chunking makes ``node`` consistent; keep it.
        Several fitting: with ``blame_ambiguity`` the creation op is recorded as where
        propagation failed."""
        fits: list[tuple[torch.fx.Node, int]] = []
        for creation in self._creation_candidates(node):
            for d in creation_dims(creation, self.num_chunks):
                undo = self._trial(creation, d, node, ok)
                if undo is not None:
                    undo()
                    fits.append((creation, d))
            if fits:
                break  # the nearest creation op that fits is the one this node needs
        if len(fits) != 1:
            if len(fits) > 1 and blame_ambiguity:
                creation = fits[0][0]
                dims = [d for _, d in fits]
                self.failed[creation] = _Failure(
                    f"cannot tell which dim of this {creation.target} "
                    f"(shape {list(creation.meta['val'].shape)}) carries the tokens: chunking "
                    f"dim {dims[0]} or dim {dims[1]} both fit its users; a size equal to the "
                    "chunk extent that cannot be proven unrelated is refused",
                    creation,
                )
                self.failed[node] = self.failed[creation]
            return False
        creation, d = fits[0]
        kept = self._trial(creation, d, node, ok)
        assert kept is not None
        self.chunked_creations[creation] = d
        return True

    def _unify_scatter(self, node: torch.fx.Node) -> None:
        """``scatter(self, dim, index, src)``, ``slice_scatter(self, src, ...)`` and the rest of
        the scatter family with a full-size ``self`` made by a creation op and an ``index`` /
        ``src`` carrying the chunk dim at a position where their full sizes agree: the
        per-chunk ``self`` must be chunk-sized too (``zeros_like(x)`` followed by
        ``scatter_add``; the backward of a slice), although the full-size op does not fail."""
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            return
        names = [a.name for a in schema.arguments]
        if "self" not in names:
            return
        bound = dict(zip(names, node.args, strict=False))
        bound.update(node.kwargs)
        target = bound.get("self")
        if not isinstance(target, torch.fx.Node) or self.dim(target) is not None:
            return
        full_t = target.meta.get("val")
        if not isinstance(full_t, torch.Tensor):
            return
        for name in SCATTER_OPERANDS:
            other = bound.get(name)
            if not isinstance(other, torch.fx.Node):
                continue
            c = self.dim(other)
            full_o = other.meta.get("val")
            if not isinstance(c, int) or not isinstance(full_o, torch.Tensor):
                continue
            if full_t.dim() != full_o.dim() or full_t.shape[c] != full_o.shape[c]:
                continue
            if self._repair(
                node, functools.partial(self._has_dim, target, c), blame_ambiguity=False
            ):
                return

    def _has_dim(self, node: torch.fx.Node, d: int) -> bool:
        return self.dim(node) == d

    # ------------------------------------------------------------------ shape rewriting
    def _rewrite_shapes(self, node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = tuple(node.args), dict(node.kwargs)
        if node.target not in VIEW_OPS and node.target is not aten.expand.default:
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
            d = view_out_dim([int(s) for s in src.meta["val"].shape], c, out_shape, self.num_chunks)
        if d is None:
            raise ChunkError(f"cannot carry chunk dim {c} through this view", node)
        if sizes[d] != -1:
            sizes[d] = out_shape[d] // self.num_chunks
        return (args[0], sizes, *args[2:]), kwargs

    def _rewrite_template_sizes(
        self, node: torch.fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``new_zeros(t, [8, 4])``, ``as_strided(t, [8, 4], ...)``, ``slice_backward(g, [8, 4],
        ...)``: a size list of the template's rank whose entry at the template's chunk dim is
        the full extent shrinks (strides and offsets are left alone: they address storage)."""
        if not args or not isinstance(args[0], torch.fx.Node) or args[0] not in self.probe:
            return args, kwargs
        c = self.dim(args[0])
        if not isinstance(c, int):
            return args, kwargs
        full = args[0].meta["val"]
        new_args = list(args)
        for i in size_arg_positions(node):
            if i == 0 or i >= len(args):
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

    # ------------------------------------------------------------------ the oracle
    def dim(self, node: torch.fx.Node) -> ChunkDim:
        if node in self.failed:
            f = self.failed[node]
            return Unknown(f.reason, f.origin.name, source_of(f.origin))
        if node not in self.probe:
            return None
        full, part = node.meta.get("val"), self.probe[node]
        if not isinstance(full, torch.Tensor) or not isinstance(part, torch.Tensor):
            return None
        if full.dim() != part.dim():
            return Unknown(
                f"chunk rank {part.dim()} differs from full rank {full.dim()}",
                node.name,
                source_of(node),
            )
        dims = [d for d in range(full.dim()) if full.shape[d] != part.shape[d]]
        if not dims:
            return None
        if len(dims) > 1:
            return MULTI
        d = dims[0]
        if full.shape[d] != part.shape[d] * self.num_chunks:
            return Unknown(
                f"dim {d} shrank from {full.shape[d]} to {part.shape[d]}",
                node.name,
                source_of(node),
            )
        return d

    def chunk_val(self, node: torch.fx.Node) -> Any:
        return self.probe.get(node, node.meta.get("val"))

    def chunk_args(self, node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.args.get(node, (tuple(node.args), dict(node.kwargs)))
