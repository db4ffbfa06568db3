"""The one exception the package raises for input it refuses.

``ChunkError`` subclasses ``ValueError`` so callers that already guard graph passes with
``except ValueError`` keep working. Every refusal names the node (or option) at fault and the
reason, and the pass that raised it leaves the graph exactly as it received it.
"""

from __future__ import annotations

import torch.fx


class ChunkError(ValueError):
    """A graph (or config) the chunk pass or concretization cannot handle safely."""

    def __init__(self, reason: str, node: torch.fx.Node | str | None = None) -> None:
        self.reason = reason
        self.node_name = node.name if isinstance(node, torch.fx.Node) else node
        where = f"node {self.node_name!r}: " if self.node_name is not None else ""
        super().__init__(f"{where}{reason}")


class UnsupportedTorchError(RuntimeError):
    """This torch lacks an internal the package needs (supported: ``>=2.13,<2.16``)."""
