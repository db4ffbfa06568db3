"""The exception the package raises for graphs (and inputs) it refuses.

``ChunkError`` subclasses ``ValueError``: a refusal is a value the pass cannot handle, so
callers that already guard graph passes with ``except ValueError`` keep working. Every refusal
names the node (or argument) at fault and the reason, and the pass that raised it leaves the
graph exactly as it received it. Arguments of the wrong *type* raise ``TypeError`` instead
(see ``ap_tags.checks``); a missing torch internal raises ``UnsupportedTorchError``
(``ap_epchunk._compat``).
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
