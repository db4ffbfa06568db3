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
from ap_tags import CUSTOM, module_fqn

#: see ``_regions.BACKWARD_FQN``
BACKWARD_FQN_KEY = "ap_chunk_backward_fqn"


class ChunkError(ValueError):
    """A graph (or config) the chunk pass or concretization cannot handle safely."""

    def __init__(self, reason: str, node: torch.fx.Node | str | None = None) -> None:
        self.reason = reason
        self.node_name = node.name if isinstance(node, torch.fx.Node) else node
        where = f"node {self.node_name!r}: " if self.node_name is not None else ""
        super().__init__(f"{where}{reason}")


def source_of(node: torch.fx.Node) -> str:
    """Where ``node`` came from, for a refusal: the innermost user-code frame of its
    ``stack_trace`` (``File "...", line N, in f: code``) and its module FQN.

    Graphs retraced from an interpreted first compilation carry no stack trace; the module FQN
    (``annotate_module_fqns``) still says which submodule the op belongs to.
    """
    parts: list[str] = []
    trace = node.meta.get("stack_trace")
    if isinstance(trace, str) and trace.strip():
        lines = [ln.rstrip() for ln in trace.strip().splitlines() if ln.strip()]
        frames = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("File ")]
        if frames:
            i = frames[-1]
            frame = lines[i].strip()
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            parts.append(f"{frame}: {code}" if code else frame)
    custom = node.meta.get(CUSTOM)
    fqn = custom.get(BACKWARD_FQN_KEY) if isinstance(custom, dict) else None
    if not isinstance(fqn, str):
        try:
            fqn = module_fqn(node)
        except Exception:  # noqa: BLE001 - a malformed tag must not hide the refusal itself
            fqn = None
    if fqn:
        parts.append(f"module {fqn!r}")
    if not parts:
        return "no source line recorded"
    return "; ".join(parts)
