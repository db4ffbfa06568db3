"""Which transformer block a collective belongs to: the unit a bucket never spans.

FSDP2 gathers one ``fully_shard`` group at a time and torchtitan's graph_trainer buckets one
transformer block at a time (``get_transformer_block_buckets``): memory then holds one block's
unsharded weights (and one more in flight), whatever the model's depth. A bucket closed only by
bytes and topological span held the whole model's weights on a small model (the H200 kit at
dim 2048: 75 weights gathered before layer 0's first matmul).

A collective's block comes from the module FQN the graph carries on its node (torchtitan's and
ap-tags' ``custom["module_fqn"]``, else the innermost ``nn_module_stack`` entry, else -- on a
backward node of stock AOTAutograd, which carries no stack of its own -- the forward node's
``fwd_nn_module_stack``), on the single-input chain feeding it (the parameter's cast; a
gradient's ``mm``), or on the nodes reading its result (the matmul that uses a gathered
weight). The block is the FQN's prefix through its first numeric component below the
prefix all of the graph's FQNs share (``layers.3.attention.wq`` -> ``layers.3``;
``model.layers.0.mlp`` -> ``model.layers.0``), else the whole module FQN (``tok_embeddings``,
``norm``, ``output``: the embedding and the head are blocks of their own). The shared prefix is
skipped because a wrapper holding the whole model at one index (``nn.Sequential(model)``, the
zoo's ``FsdpTrainStep``: ``_model.0.layers.1``) would otherwise make the model one block. A graph
with no numeric component below its shared prefix (a model without a stack of blocks, or a
graph compiled per block) is one block, bounded by bytes and span. A collective with no FQN
anywhere has no block (``None``); such collectives bucket together, bounded by bytes and span.

Dynamo spells module paths as Python (``getattr(L['self'].layers, '0').attention`` for a
``ModuleDict``, ``L['self'].layers[0]`` for a ``ModuleList``); ``module_fqn`` returns the dotted
FQN (``layers.0.attention``) whichever spelling the node carries.

The direction (``autograd_backward``, or AOTAutograd's ``partitioner_tag == "is_backward"``)
splits a joint graph's forward gathers from the backward's re-gathers of the same block.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch.fx as fx

#: where torchtitan's graph_trainer and ap-tags stamp a node's module FQN
CUSTOM = "custom"
MODULE_FQN = "module_fqn"
_CHAIN_LIMIT = 8


def module_fqn(node: fx.Node) -> str | None:
    """The module FQN stamped on ``node``: ``custom["module_fqn"]``, else the innermost
    submodule of its ``nn_module_stack``, else of its ``fwd_nn_module_stack`` (the forward
    module a stock backward node differentiates); ``None`` when it carries none."""
    custom = node.meta.get(CUSTOM)
    if isinstance(custom, dict):
        fqn = custom.get(MODULE_FQN)
        if isinstance(fqn, str) and fqn:
            cleaned = _clean_dynamo_path(fqn)  # a stamp copied from a stack path, as written
            if cleaned and _ATTRIBUTE_PATH.fullmatch(cleaned):
                return cleaned
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = node.meta.get(key)
        if isinstance(stack, dict) and stack:
            return _innermost_module(stack)
    return None


def _innermost_module(stack: dict[object, object]) -> str | None:
    """The innermost entry of a module stack whose path names a submodule. Entries that are
    not attribute paths are skipped: a parametrization's module (SimpleFSDP's gather of a
    DTensor parameter is traced as ``dict(type(L['self'].layers.0.wq).__dict__)['weight']
    .fget.__closure__[0].cell_contents``) is reached through the module that owns the
    parameter, the entry outside it. The root module (an empty FQN) is no module."""
    for entry in reversed(list(stack.values())):
        path = entry[0] if isinstance(entry, tuple) and entry else None
        if not isinstance(path, str):
            continue
        fqn = _clean_dynamo_path(path)
        if _ATTRIBUTE_PATH.fullmatch(fqn):
            return fqn or None
    return None


_GETATTR = re.compile(r"getattr\(([^(),]*),\s*'([^']*)'\)")
#: what is left of a path that names a submodule: no call, subscript or quote of Python
_ATTRIBUTE_PATH = re.compile(r"[^()\[\]'\"]*")


@functools.lru_cache(maxsize=4096)
def _clean_dynamo_path(path: str) -> str:
    """The dotted FQN of a stack path: Dynamo's ``L['self'].layers[0].attention``,
    ``getattr(L['self'].layers, '0').attention`` (a ``ModuleDict`` with numeric keys, as
    torchtitan's ``layers``) and ``L['self']._modules['layers']`` all read
    ``layers.0.attention``; export's paths are dotted already. Cached: a graph repeats a few
    hundred paths over its thousands of nodes, and ``block_context`` and the collectives'
    chain and reader walks read them again."""
    previous = None
    while previous != path:  # innermost ``getattr(x, 'k')`` first: they nest
        previous = path
        path = _GETATTR.sub(r"\1.\2", path)
    path = re.sub(r"^[LG]\['[^']*'\]\.?", "", path)
    path = re.sub(r"_modules\['([^']*)'\]", r"\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return re.sub(r"\.+", ".", path).strip(".")


@dataclass(frozen=True)
class BlockContext:
    """What a graph's module FQNs say about its blocks (``block_context``).

    ``prefix``: the components every FQN in the graph shares (``_model.0`` when a wrapper
    holds the whole model at one index; ``layers.3`` in a graph of one block). ``stacked``:
    some FQN has a numeric component below the prefix, so the graph holds a stack of repeated
    blocks (``layers.0``, ``layers.1``)."""

    prefix: tuple[str, ...] = ()
    stacked: bool = True


def block_context(graph: fx.Graph) -> BlockContext:
    """The ``BlockContext`` of ``graph``'s module FQNs (nodes at the root, with an empty FQN,
    and nodes without one are not counted)."""
    fqns = [fqn.split(".") for node in graph.nodes if (fqn := module_fqn(node))]
    if not fqns:
        return BlockContext()
    prefix = fqns[0]
    for parts in fqns[1:]:
        common = 0
        while common < min(len(prefix), len(parts)) and prefix[common] == parts[common]:
            common += 1
        prefix = prefix[:common]
    stacked = any(part.isdigit() for parts in fqns for part in parts[len(prefix) :])
    return BlockContext(tuple(prefix), stacked)


def block_of(fqn: str, context: BlockContext | None = None) -> str:
    """The block a module FQN belongs to.

    Below the graph's common prefix (``context``), the FQN's prefix through its first numeric
    component (a ``ModuleList``/``ModuleDict`` index: ``layers.3.attention.wq`` -> ``layers.3``),
    else the FQN itself (a module outside the stack: the embedding, the final norm, the head).
    A graph without a stack below its prefix is one block (the prefix): a model without
    repeated blocks buckets by bytes and span, and a graph compiled per block stays one block.
    Without ``context``, the first numeric component of the whole FQN."""
    parts = fqn.split(".")
    start = 0
    if context is not None:
        if tuple(parts[: len(context.prefix)]) == context.prefix:
            start = len(context.prefix)
        if not context.stacked:
            return ".".join(context.prefix)
    for position in range(start, len(parts)):
        if parts[position].isdigit():
            return ".".join(parts[: position + 1])
    return fqn


def is_backward(node: fx.Node) -> bool:
    """``node`` is a backward op of a joint graph (graph_trainer's ``autograd_backward``,
    AOTAutograd's ``partitioner_tag``)."""
    return (
        bool(node.meta.get("autograd_backward"))
        or node.meta.get("partitioner_tag") == "is_backward"
    )


def collective_fqn(coll: fx.Node) -> str | None:
    """The module FQN a collective belongs to: its own, else the nearest one up its
    single-input input chain, else the nearest one among its result's readers (breadth first,
    a few levels: a wrapper that gathers every weight before calling the model -- the zoo's
    ``FsdpTrainStep`` -- stamps no module on the gathers, but the matmul that reads a weight
    is in its module; of several readers' FQNs the smallest); ``None`` when there is none."""
    node: fx.Node | None = coll
    for _ in range(_CHAIN_LIMIT):
        if node is None:
            break
        fqn = module_fqn(node)
        if fqn is not None:
            return fqn
        inputs = node.all_input_nodes
        node = inputs[0] if len(inputs) == 1 else None
    frontier = [u for u in coll.users if u.op != "output"]
    seen = set(frontier)
    for _ in range(_CHAIN_LIMIT):
        found = sorted({f for f in map(module_fqn, frontier) if f is not None})
        if found:
            return found[0]
        frontier = [u for n in frontier for u in n.users if u.op != "output" and u not in seen]
        seen.update(frontier)
        if not frontier:
            break
    return None


def collective_block(coll: fx.Node, context: BlockContext | None = None) -> str | None:
    """The block of a collective (``block_of`` its ``collective_fqn``); ``None`` when no FQN
    is found."""
    fqn = collective_fqn(coll)
    return None if fqn is None else block_of(fqn, context)


def part_of(fqn: str, context: BlockContext | None = None) -> str:
    """The block's direct submodule a module FQN is in (``layers.3.attention.wq`` ->
    ``layers.3.attention``; ``model.layers.0.mlp.up_proj`` -> ``model.layers.0.mlp``; in a
    graph of one block, ``layers.3``, the same): the unit a backward bucket stays within under
    ``BucketingConfig.backward_parts``. An FQN that is its block (the embedding, the head) is
    its block."""
    block = block_of(fqn, context)
    if not fqn.startswith(block):  # a graph of one block: the block is the shared prefix
        return block
    rest = fqn[len(block) :].lstrip(".")
    if not rest:
        return block
    head = rest.split(".")[0]
    return f"{block}.{head}" if block else head


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
