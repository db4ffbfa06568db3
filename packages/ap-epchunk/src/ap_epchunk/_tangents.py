"""Which forward output each tangent of a joint graph is the gradient of.

AOTAutograd describes a joint graph's tangent placeholders (``TangentAOTInput(output=...)``)
and its outputs (the output node's ``meta["desc"]``, one descriptor per returned value). A
tangent has the shape of the output it differentiates, so where that output carries the chunk
dim, so does its tangent: the static oracle probes it chunk-sized once the output's dim is
known (the loss computed outside the compiled module, whose tangent has the full batch shape).
A graph without descriptors (torch before 2.15's descriptors, a hand-built graph) pairs
nothing.
"""

from __future__ import annotations

from typing import Any

import torch.fx


def tangent_outputs(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """``{tangent placeholder: the forward output node it is the gradient of}``."""
    outputs = list(graph.find_nodes(op="output"))
    if len(outputs) != 1:
        return {}
    (out,) = outputs
    values: Any = out.args[0] if out.args else None
    descs: Any = out.meta.get("desc")
    if not isinstance(values, (list, tuple)) or not isinstance(descs, (list, tuple)):
        return {}
    by_desc: list[tuple[Any, torch.fx.Node]] = [
        (d, v)
        for d, v in zip(descs, values, strict=False)
        if d is not None and isinstance(v, torch.fx.Node)
    ]
    pairs: dict[torch.fx.Node, torch.fx.Node] = {}
    for ph in graph.find_nodes(op="placeholder"):
        target = getattr(ph.meta.get("desc"), "output", None)
        if target is None or type(ph.meta["desc"]).__name__ != "TangentAOTInput":
            continue
        match = [v for d, v in by_desc if d == target]
        if len(match) == 1:
            pairs[ph] = match[0]
    return pairs
