"""Argument checks shared by the public entry points.

A pass handed the wrong kind of object used to fail with an ``AttributeError`` from deep inside
torch.fx (``'str' object has no attribute 'nodes'``); these checks turn that into a
``TypeError`` that names the function and the argument, before anything is read or written.
"""

from __future__ import annotations

import torch.fx


def as_graph(graph: object, where: str, arg: str = "graph") -> torch.fx.Graph:
    """The ``torch.fx.Graph`` behind ``graph`` (a Graph or GraphModule), else ``TypeError``."""
    if isinstance(graph, torch.fx.GraphModule):
        return graph.graph
    if isinstance(graph, torch.fx.Graph):
        return graph
    raise TypeError(
        f"{where}: {arg} must be a torch.fx.Graph or torch.fx.GraphModule, "
        f"got {type(graph).__name__}"
    )


def require_graph_module(gm: object, where: str, arg: str = "fw_gm") -> torch.fx.GraphModule:
    """``gm`` itself when it is a ``torch.fx.GraphModule``, else ``TypeError``."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"{where}: {arg} must be a torch.fx.GraphModule, got {type(gm).__name__}")
    return gm


def require_node(node: object, where: str) -> torch.fx.Node:
    """``node`` itself when it is a ``torch.fx.Node``, else ``TypeError``."""
    if not isinstance(node, torch.fx.Node):
        raise TypeError(f"{where}: node must be a torch.fx.Node, got {type(node).__name__}")
    return node


def check_num_fwd_outputs(value: object, where: str) -> int | None:
    """``num_fwd_outputs`` must be None or a (non-bool) int."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{where}: num_fwd_outputs must be an int or None, got {value!r}")
    return value
