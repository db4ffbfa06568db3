"""Argument checking for the public entry points, and the working copy partitions run on.

Bad input fails here, before any graph is touched, with a ``TypeError``/``ValueError`` naming
the entry point, the argument and what was passed. Partitioning itself runs on a working copy
of the joint graph (nodes copied, meta dicts shallow-copied), so a partitioner that refuses its
input (``strict=True``) leaves the caller's graph exactly as it was, and a fallback gets the
graph as given rather than one half-normalized by the replay's prologue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.fx as fx
from ap_tags import PROJECT_CUSTOM_KEYS
from torch.utils.checkpoint import CheckpointPolicy

from ap_partitioner import _compat


def _kind(value: object) -> str:
    return type(value).__name__


def check_bool(owner: str, option: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: option {option!r} must be bool, got {_kind(value)} {value!r}")
    return value


def check_callback(owner: str, option: str, value: object) -> Callable[..., Any] | None:
    if value is not None and not callable(value):
        raise TypeError(
            f"{owner}: option {option!r} must be a callable or None, got {_kind(value)} {value!r}"
        )
    return value


def check_module(owner: str, arg: str, value: object) -> fx.GraphModule:
    if not isinstance(value, fx.GraphModule):
        raise TypeError(f"{owner}: {arg!r} must be a torch.fx.GraphModule, got {_kind(value)}")
    return value


def check_count(owner: str, arg: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {arg!r} must be an int, got {_kind(value)} {value!r}")
    return value


def check_nodes(owner: str, arg: str, value: object) -> list[fx.Node]:
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes)):
        raise TypeError(
            f"{owner}: {arg!r} must be an iterable of torch.fx.Node, got {_kind(value)}"
        )
    nodes = list(value)
    bad = [n for n in nodes if not isinstance(n, fx.Node)]
    if bad:
        raise TypeError(
            f"{owner}: {arg!r} must hold torch.fx.Node values, got {_kind(bad[0])} {bad[0]!r}"
        )
    return nodes


def check_node(owner: str, value: object) -> fx.Node:
    if not isinstance(value, fx.Node):
        raise TypeError(f"{owner}: expected a torch.fx.Node, got {_kind(value)} {value!r}")
    return value


def check_call(
    owner: str, gm: object, joint_inputs: object, kwargs: dict[str, Any]
) -> tuple[fx.GraphModule, int, list[int], str]:
    """Validate one partitioner call; return ``(gm, num_fwd_outputs, static indices, compiler)``.

    Inductor/AOTAutograd pass ``num_fwd_outputs`` (required), ``static_lifetime_input_indices``
    and ``compiler`` (which ``default_partition`` does not accept, so it is popped here).
    """
    module = check_module(owner, "gm", gm)
    if not isinstance(joint_inputs, Sequence) or isinstance(joint_inputs, (str, bytes)):
        raise TypeError(
            f"{owner}: 'joint_inputs' must be a list or tuple, got {_kind(joint_inputs)}"
        )
    if "num_fwd_outputs" not in kwargs:
        raise TypeError(f"{owner}: call is missing the required keyword 'num_fwd_outputs'")
    num_fwd_outputs = check_count(owner, "num_fwd_outputs", kwargs.pop("num_fwd_outputs"))
    outputs = _output_count(module)
    if not 0 <= num_fwd_outputs <= outputs:
        raise ValueError(
            f"{owner}: 'num_fwd_outputs'={num_fwd_outputs} is outside [0, {outputs}] "
            f"(the joint graph has {outputs} outputs)"
        )
    static = kwargs.pop("static_lifetime_input_indices", None)
    if static is None:
        static = []
    if not isinstance(static, (list, tuple)) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in static
    ):
        raise TypeError(
            f"{owner}: 'static_lifetime_input_indices' must be a list of ints, got {static!r}"
        )
    compiler = kwargs.pop("compiler", "inductor")
    if not isinstance(compiler, str):
        raise TypeError(f"{owner}: 'compiler' must be a str, got {_kind(compiler)} {compiler!r}")
    return module, num_fwd_outputs, list(static), compiler


def _output_count(gm: fx.GraphModule) -> int:
    outputs = gm.graph.find_nodes(op="output")
    if not outputs:
        return 0
    args = outputs[0].args[0]
    return len(args) if isinstance(args, (list, tuple)) else 1


def working_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a node-by-node copy of ``gm.graph`` (same names; each node's
    ``meta`` dict shallow-copied, so top-level tag writes never reach the caller's nodes).

    Its code is generated lazily: the working copy is only read as a graph, and an eager
    recompile here (and after each graph replacement in the prologue) cost more than the copy.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph._codegen = gm.graph._codegen
    return _compat.deferred_codegen_module(gm, graph, gm.__class__.__name__)


def sanitize_tags(gm: fx.GraphModule, bad_nodes: Iterable[str]) -> None:
    """Drop malformed ``recompute``/``ac_graph_id``/``custom`` meta from ``bad_nodes`` of a
    working copy, so the min-cut fallback does not crash on them (it reads all three)."""
    bad = set(bad_nodes)
    for node in gm.graph.nodes:
        if node.name not in bad:
            continue
        if not isinstance(node.meta.get("recompute", CheckpointPolicy.MUST_SAVE), CheckpointPolicy):
            node.meta.pop("recompute")
        graph_id = node.meta.get("ac_graph_id", 0)
        if isinstance(graph_id, bool) or not isinstance(graph_id, int):
            node.meta.pop("ac_graph_id")
        if "custom" in node.meta and not isinstance(node.meta["custom"], dict):
            node.meta.pop("custom")
        elif isinstance(node.meta.get("custom"), dict):  # copy: the dict is shared with the caller
            node.meta["custom"] = {
                k: v for k, v in node.meta["custom"].items() if k not in PROJECT_CUSTOM_KEYS
            }


def release_unsatisfiable_recompute(gm: fx.GraphModule, names: Iterable[str]) -> list[str]:
    """Drop MUST_RECOMPUTE from placeholders and from the named values of a working copy.

    A tag that made the replay's cut invalid cannot be honoured by min-cut either (an input
    cannot be recomputed; min-cut would build a backward that reads an invalid node), so the
    fallback partitions without it. Returns the names released, for the report.
    """
    wanted = set(names)
    released = []
    for node in gm.graph.nodes:
        if node.meta.get("recompute") is not CheckpointPolicy.MUST_RECOMPUTE:
            continue
        if node.op == "placeholder" or node.name in wanted:
            node.meta.pop("recompute")
            released.append(node.name)
    return released
