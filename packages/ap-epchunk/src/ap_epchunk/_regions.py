"""Which nodes belong to which module region, and in which direction.

A forward node's module FQN comes from ``custom["module_fqn"]`` (ap-tags'
``annotate_module_fqns``). A backward node borrows the FQN of the forward node with the same
``seq_nr`` (AOTAutograd and :func:`ap_epchunk.trace_joint` stamp the forward op's ``seq_nr`` on
the backward ops that differentiate it; in a graph retraced from a first compilation, the
``ap_chunk_backward_fqn`` that :func:`tag_backward_module_fqns` left there), then its own
``custom["module_fqn"]``; the last
fallback is the innermost ``nn_module_stack`` entry. A region is every ``call_function`` node of one direction (``ap_tags.graph.
is_backward_node``) whose FQN equals a matched *root* or lies below it; the root is the FQN
truncated to the pattern's length.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

import torch.fx
from ap_tags import CHUNK_GLUE, CHUNK_INDEX, CUSTOM, MODULE_FQN, module_fqn
from ap_tags.graph import is_backward_node, is_collective

from ._errors import BACKWARD_FQN_KEY


@dataclass(frozen=True)
class Region:
    """Candidate nodes (graph order) of one root in one direction."""

    root: str
    backward: bool
    candidates: tuple[torch.fx.Node, ...]


def _custom_fqn(node: torch.fx.Node) -> str | None:
    custom = node.meta.get(CUSTOM)
    if isinstance(custom, dict) and MODULE_FQN in custom:
        return module_fqn(node)  # validates the type
    return None


def module_fqns(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    """The module FQN of every node that has one (see the module docstring for the order)."""
    fqns: dict[torch.fx.Node, str] = {}
    by_seq: dict[int, str] = {}
    for node in graph.nodes:
        if is_backward_node(node):
            continue
        fqn = module_fqn(node)
        if fqn is not None:
            fqns[node] = fqn
            seq = node.meta.get("seq_nr")
            if isinstance(seq, int) and seq >= 0:
                by_seq.setdefault(seq, fqn)
    # a graph retraced from a first compilation: its backward ops carry the FQN the first
    # compilation stamped, and their seq_nr no longer names the forward op they differentiate
    retraced = any(_stamped_fqn(n) is not None for n in graph.nodes if is_backward_node(n))
    for node in graph.nodes:
        if not is_backward_node(node):
            continue
        seq = node.meta.get("seq_nr")
        # the forward op a backward op differentiates says where it belongs; a backward node's
        # own tag is second: a graph retraced through the first compilation's interpreter
        # stamps every backward op with the tag current when autograd ran it (one FQN for all)
        fqn = _stamped_fqn(node)
        if fqn is None and retraced:
            continue  # unstamped in the first compilation too: see _enclosing_fqn
        if fqn is None:
            fqn = by_seq.get(seq) if isinstance(seq, int) else None
        if fqn is None:
            fqn = _custom_fqn(node)
        if fqn is None:
            fqn = module_fqn(node)  # innermost nn_module_stack entry
        if fqn is not None:
            fqns[node] = fqn
    for node in graph.nodes:
        if node not in fqns and node.op == "call_function" and is_backward_node(node):
            enclosing = _enclosing_fqn(node, fqns)
            if enclosing is not None:
                fqns[node] = enclosing
    return fqns


def _stamped_fqn(node: torch.fx.Node) -> str | None:
    custom = node.meta.get(CUSTOM)
    fqn = custom.get(BACKWARD_FQN) if isinstance(custom, dict) else None
    return fqn if isinstance(fqn, str) else None


def _enclosing_fqn(node: torch.fx.Node, fqns: dict[torch.fx.Node, str]) -> str | None:
    """The FQN of a backward node autograd inserted on its own -- the sum of the gradients of
    a value used twice (``add`` of two expert matmul gradients in a MoE) has no forward op and
    no module -- when every input has an FQN and a user has one: the innermost module enclosing
    its inputs and those users (their longest common dotted prefix). Without it the sum sits outside
    the region that computes and consumes it, and the region's gradients look like values
    that leave it."""
    inputs = node.all_input_nodes
    users = [fqns[u] for u in node.users if u in fqns]
    if not inputs or not users or any(i not in fqns for i in inputs):
        return None  # not between module ops (a last op feeding the outputs stays outside)
    around = [fqns[i] for i in inputs] + users
    common = around[0].split(".")
    for fqn in around[1:]:
        parts = fqn.split(".")
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return ".".join(common) or None


#: ``custom`` key: the module FQN of the forward op a backward op differentiates, written by
#: :func:`tag_backward_module_fqns` in a first compilation. A key of its own because torch
#: merges the forward node's ``custom`` over a backward node's by ``seq_nr`` when it traces a
#: joint graph, and in a second compilation every node shares one ``seq_nr`` (the first
#: compilation runs as one autograd op): ``module_fqn`` then says one FQN for the whole backward.
BACKWARD_FQN = BACKWARD_FQN_KEY


def tag_backward_module_fqns(graph: torch.fx.Graph) -> int:
    """Stamp every backward op of a joint graph with the module FQN of the forward op it
    differentiates (same ``seq_nr``), under a key torch's forward-to-backward metadata copy
    does not overwrite, so ``chunk_pass`` finds backward regions in a graph retraced from this
    one (``ap_backend.precompile`` calls it). Returns how many nodes were stamped."""
    by_seq: dict[int, str] = {}
    for node in graph.nodes:
        seq = node.meta.get("seq_nr")
        if not is_backward_node(node) and isinstance(seq, int):
            fqn = module_fqn(node)
            if fqn is not None:
                by_seq.setdefault(seq, fqn)
    stamped = 0
    for node in graph.nodes:
        seq = node.meta.get("seq_nr")
        if is_backward_node(node) and isinstance(seq, int) and seq in by_seq:
            custom = node.meta.get(CUSTOM)
            own = dict(custom) if isinstance(custom, dict) else {}  # custom dicts may be shared
            node.meta[CUSTOM] = {**own, BACKWARD_FQN: by_seq[seq]}
            stamped += 1
    return stamped


def restore_backward_module_fqns(graph: torch.fx.Graph) -> int:
    """Give every node that carries the FQN :func:`tag_backward_module_fqns` (or
    :func:`tag_recomputed_module_fqns`) stamped that FQN as its ``custom["module_fqn"]`` too;
    returns how many nodes changed.

    Why: a second compilation retraces the first one as a single autograd op, so torch's
    forward-to-backward metadata copy gives every backward node of it the ``module_fqn`` of
    that op's first forward node -- on the model kit and torchtitan's Llama3, every gradient
    reduce-scatter (and the cast feeding it) read ``tok_embeddings``. A pass keyed by module
    (ap-bucketing's block-wide buckets) then sees the whole backward as one block. The stamped
    FQN is the module whose forward op the node differentiates: the parameter's own module
    for its gradient's reduce-scatter."""
    changed = 0
    for node in graph.nodes:
        fqn = _stamped_fqn(node)
        if fqn is None:
            continue
        custom = node.meta.get(CUSTOM)
        own = dict(custom) if isinstance(custom, dict) else {}  # custom dicts may be shared
        if own.get(MODULE_FQN) != fqn:
            node.meta[CUSTOM] = {**own, MODULE_FQN: fqn}
            changed += 1
    return changed


def backward_module_fqns_lost(graph: torch.fx.Graph) -> list[str]:
    """The backward collectives of ``graph`` that name a module (``custom["module_fqn"]``) but
    carry no FQN stamped by :func:`tag_backward_module_fqns` or
    :func:`tag_recomputed_module_fqns`. In a graph retraced from a first compilation, where both
    stamp every backward collective, each one listed lost its stamp to torch's
    forward-to-backward metadata copy (it replaces ``custom`` on torch 2.11) and names the
    first forward op's module instead of its own: :func:`restore_backward_module_fqns` has
    nothing to put back for it. Empty when nothing was lost.

    A forward op this graph's own partition recomputed in the backward (``partitioner_tag``
    ``"is_forward"``: a forward all-gather an activation budget or AC re-issues there) is not
    listed: torch's extraction marks every node of a backward graph ``autograd_backward``, but
    such a copy carries its forward node's metadata, which the forward-to-backward copy never
    rewrites -- its ``module_fqn`` is its own module. The first compilation's own re-gathers
    carry that tag too (they were recomputed forward ops there), so a stamp lost on one of them
    is not listed; torch's copy rewrites every backward node at once, so such a loss still
    shows on the gradient reduce-scatters, which are backward ops."""
    return [
        node.name
        for node in graph.nodes
        if node.op == "call_function"
        and is_backward_node(node)
        and node.meta.get("partitioner_tag") not in _FORWARD_TAGS
        and is_collective(node)
        and _stamped_fqn(node) is None
        and _custom_fqn(node) is not None
    ]


#: ``partitioner_tag`` values AOTAutograd puts on forward ops; in a backward graph they mark
#: the forward ops the partition recomputed there.
_FORWARD_TAGS = ("is_forward", "must_be_in_forward")


def tag_recomputed_module_fqns(graph: torch.fx.Graph) -> int:
    """Stamp the forward ops a first partition recomputed in its backward graph (activation
    checkpointing) with their own module FQN, under the key :func:`tag_backward_module_fqns`
    uses, so ``chunk_pass`` puts them in their module's backward region when the graph is
    retraced (unstamped, they would sit outside it, and a region value they read that has no
    chunk dim -- the rows an expert-parallel exchange received -- could not reach them).
    ``ap_backend.precompile`` calls it on the first compilation's backward graph. Returns how
    many nodes were stamped."""
    stamped = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.meta.get("partitioner_tag") not in _FORWARD_TAGS:
            continue
        if _stamped_fqn(node) is not None:
            continue
        fqn = _custom_fqn(node)
        if fqn is None:
            continue
        custom = node.meta.get(CUSTOM)
        own = dict(custom) if isinstance(custom, dict) else {}  # shared with the joint node
        node.meta[CUSTOM] = {**own, BACKWARD_FQN: fqn}
        stamped += 1
    return stamped


def root_of(fqn: str, patterns: Iterable[str]) -> str | None:
    """The prefix of ``fqn`` matched by the first pattern that matches one, else None."""
    parts = fqn.split(".")
    for pattern in patterns:
        k = len(pattern.split("."))
        if len(parts) >= k:
            root = ".".join(parts[:k])
            if fnmatch.fnmatchcase(root, pattern):
                return root
    return None


def already_chunked(node: torch.fx.Node) -> bool:
    custom = node.meta.get(CUSTOM)
    return isinstance(custom, dict) and (CHUNK_INDEX in custom or CHUNK_GLUE in custom)


def find_regions(
    graph: torch.fx.Graph, patterns: tuple[str, ...], fqns: dict[torch.fx.Node, str]
) -> list[Region]:
    """Regions in the order of their first node (forward regions precede their backward)."""
    members: dict[tuple[str, bool], list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node not in fqns or already_chunked(node):
            continue
        root = root_of(fqns[node], patterns)
        if root is not None:
            members.setdefault((root, is_backward_node(node)), []).append(node)
    owner = {n: key for key, nodes in members.items() for n in nodes}
    for guard in graph.find_nodes(op="call_function", target=_ASSERT_SCALAR):
        if guard in fqns or already_chunked(guard):
            continue
        adopted = _guard_chain(guard, owner, fqns)
        if adopted is not None:
            key, chain = adopted
            members[key].extend(chain)
    order = {n: i for i, n in enumerate(graph.nodes)}
    return [
        Region(root, bw, tuple(sorted(nodes, key=order.__getitem__)))
        for (root, bw), nodes in members.items()
    ]


_ASSERT_SCALAR = torch.ops.aten._assert_scalar.default


def _guard_chain(
    guard: torch.fx.Node,
    owner: dict[torch.fx.Node, tuple[str, bool]],
    fqns: dict[torch.fx.Node, str],
) -> tuple[tuple[str, bool], list[torch.fx.Node]] | None:
    """A runtime guard no module owns (``_assert_scalar`` of a deferred runtime assert, traced
    outside every module) whose condition reads the values of exactly one region of its own
    direction -- ``u1 + u2 == x.size(0)`` over the data-dependent split sizes of a body --
    belongs to that region: the chunked body checks it once per chunk, on that chunk's values,
    as running the module chunk by chunk would. Returns the region's key and the guard with
    the module-less scalar nodes between it and the region (each used only by the guard's
    condition), or None when the condition reads no region, several, or the other direction."""
    chain: list[torch.fx.Node] = [guard]
    keys: set[tuple[str, bool]] = set()
    todo = list(guard.all_input_nodes)
    seen: set[torch.fx.Node] = set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in owner:
            keys.add(owner[node])
        elif (
            node.op == "call_function"
            and node not in fqns
            and not isinstance(node.meta.get("val"), torch.Tensor)
        ):
            chain.append(node)
            todo.extend(node.all_input_nodes)
        # else: a placeholder or a value outside every region, read as a live-in
    own = set(chain)
    if any(u not in own for n in chain[1:] for u in n.users):
        return None  # a scalar of the condition is used beyond the guard: not the guard's own
    if len(keys) != 1:
        return None
    (key,) = keys
    if key[1] != is_backward_node(guard):
        return None
    return key, chain
