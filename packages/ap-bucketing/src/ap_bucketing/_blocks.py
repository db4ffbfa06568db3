"""Which transformer block a collective belongs to: the unit a bucket never spans.

FSDP2 gathers one ``fully_shard`` group at a time and torchtitan's graph_trainer buckets one
transformer block at a time (``get_transformer_block_buckets``): memory then holds one block's
unsharded weights (and one more in flight), whatever the model's depth. A bucket closed only by
bytes and topological span held the whole model's weights on a small model (the H200 kit at
dim 2048: 75 weights gathered before layer 0's first matmul).

A collective's block comes from the module FQN the graph carries on its node (torchtitan's and
ap-tags' ``custom["module_fqn"]``, else the innermost ``nn_module_stack`` entry), on the
single-input chain feeding it (the parameter's cast), or on the nodes reading its result (the
matmul that uses a gathered weight): the FQN's prefix through its first
numeric component (``layers.3.attention.wq`` -> ``layers.3``; ``model.layers.0.mlp`` ->
``model.layers.0``), else the whole module FQN (``tok_embeddings``, ``norm``, ``output``: the
embedding and the head are blocks of their own). A collective with no FQN anywhere has no
block (``None``); such collectives bucket together, bounded by bytes and span.

The direction (``autograd_backward``, or AOTAutograd's ``partitioner_tag == "is_backward"``)
splits a joint graph's forward gathers from the backward's re-gathers of the same block.
"""

from __future__ import annotations

import torch.fx as fx

#: where torchtitan's graph_trainer and ap-tags stamp a node's module FQN
CUSTOM = "custom"
MODULE_FQN = "module_fqn"
_CHAIN_LIMIT = 8


def module_fqn(node: fx.Node) -> str | None:
    """The module FQN stamped on ``node``: ``custom["module_fqn"]``, else the innermost
    ``nn_module_stack`` entry's path; ``None`` when it carries neither."""
    custom = node.meta.get(CUSTOM)
    if isinstance(custom, dict):
        fqn = custom.get(MODULE_FQN)
        if isinstance(fqn, str) and fqn:
            return fqn
    stack = node.meta.get("nn_module_stack")
    if isinstance(stack, dict) and stack:
        entry = list(stack.values())[-1]
        path = entry[0] if isinstance(entry, tuple) and entry else None
        if isinstance(path, str) and path:
            return _clean_dynamo_path(path)
    return None


def _clean_dynamo_path(path: str) -> str:
    """Dynamo's stack paths read ``L['self'].layers[0].attention`` or ``layers.0.attention``;
    the dotted form."""
    for prefix in ("L['self'].", "L['self']"):
        if path.startswith(prefix):
            path = path[len(prefix) :]
    return path.replace("[", ".").replace("]", "").replace("'", "").strip(".")


def block_of(fqn: str) -> str:
    """The block a module FQN belongs to: its prefix through the first numeric component
    (a ``ModuleList``/``ModuleDict`` index), else the FQN itself."""
    parts = fqn.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return fqn


def is_backward(node: fx.Node) -> bool:
    """``node`` is a backward op of a joint graph (graph_trainer's ``autograd_backward``,
    AOTAutograd's ``partitioner_tag``)."""
    return (
        bool(node.meta.get("autograd_backward"))
        or node.meta.get("partitioner_tag") == "is_backward"
    )


def collective_block(coll: fx.Node) -> str | None:
    """The block of a collective: from its own FQN, else the nearest one up its single-input
    input chain, else the nearest one among its result's readers (breadth first, a few
    levels: a wrapper that gathers every weight before calling the model -- the zoo's
    ``FsdpTrainStep`` -- stamps no module on the gathers, but the matmul that reads a weight
    is in its module); ``None`` when there is none."""
    node: fx.Node | None = coll
    for _ in range(_CHAIN_LIMIT):
        if node is None:
            break
        fqn = module_fqn(node)
        if fqn is not None:
            return block_of(fqn)
        inputs = node.all_input_nodes
        node = inputs[0] if len(inputs) == 1 else None
    frontier = [u for u in coll.users if u.op != "output"]
    seen = set(frontier)
    for _ in range(_CHAIN_LIMIT):
        found = sorted({block_of(f) for f in map(module_fqn, frontier) if f is not None})
        if found:
            return found[0]
        frontier = [u for n in frontier for u in n.users if u.op != "output" and u not in seen]
        seen.update(frontier)
        if not frontier:
            break
    return None


def source_placeholder(coll: fx.Node) -> fx.Node | None:
    """The placeholder a collective's single-input chain starts from (an FSDP all-gather's
    parameter shard, through its casts), or ``None``; a chain through another collective or
    wait is not a source (that is a dependency, not a repeat)."""
    node = coll
    for _ in range(_CHAIN_LIMIT):
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return None
        node = inputs[0]
        if node.op == "placeholder":
            return node
        if "_c10d_functional" in str(node.target):
            return None
    return None


def segment(coll: fx.Node) -> tuple[str | None, bool]:
    """``(block, is_backward)``: collectives of one segment may share a bucket."""
    return collective_block(coll), is_backward(coll)
