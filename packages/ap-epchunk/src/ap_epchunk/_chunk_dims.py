"""What a chunk-dim oracle answers, and the values its answers take.

An oracle (``_shapes.SymbolicShapes``, ``_static_shapes.StaticShapes``) tells the planner where
each value carries the chunk dimension (``dim``: an int, ``None``, ``MULTI`` or ``Unknown``),
what a chunk of a value looks like (``chunk_val``) and which arguments a chunk copy takes
(``chunk_args``). A value whose chunk influence shows up in more than one dim (``q @ k.T``
under sequence chunking) is ``MULTI``; a value the static probe could not compute is
``Unknown``, which carries the node where propagation first failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
import torch.fx

aten = torch.ops.aten


class _Multi:
    def __repr__(self) -> str:
        return "MULTI"


MULTI = _Multi()


@dataclass(frozen=True)
class Unknown:
    """The static probe could not compute this value: ``reason`` at node ``origin`` (the first
    node whose propagation failed), which came from ``source``."""

    reason: str
    origin: str | None = None
    source: str = ""

    def describe(self) -> str:
        if self.origin is None:
            return self.reason
        return (
            f"shape propagation of the chunk dim first failed at node {self.origin!r} "
            f"({self.source}): {self.reason}"
        )


ChunkDim = int | None | _Multi | Unknown

#: Schema argument names that hold the output size of an op (as opposed to strides, dims...).
SIZE_ARGS = frozenset({"size", "sizes", "shape", "input_sizes"})


def size_arg_positions(node: torch.fx.Node) -> list[int]:
    """Positions of ``node``'s int-list size arguments (``view(self, size)``, ``full(size)``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    return [
        i
        for i, arg in enumerate(schema.arguments)
        if arg.name in SIZE_ARGS and str(arg.type) in ("List[int]", "SymInt[]", "int[]")
    ]


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
        return tuple(node.args), dict(node.kwargs)

    def scalar_carries_chunk(self, node: torch.fx.Node) -> bool:
        return False

    def args_carry_chunk(self, node: torch.fx.Node) -> bool:
        """A raw (non-node) argument of ``node`` mentions the chunk extent."""
        return False

    def symbol_hints(self) -> dict[sympy.Symbol, int]:
        return {}
