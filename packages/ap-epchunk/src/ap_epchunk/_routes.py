"""Which graphs a chunk plan with data-dependent body ops may be carried out on.

A chunked region whose body binds unbacked symbols (``.item()`` / ``.tolist()``: the split
sizes of an expert-parallel exchange) is exact on a joint graph traced by
:func:`ap_epchunk.trace_joint` and on the second compilation of ``ap_backend.precompile``
(whose backward ops carry the module FQN the first compilation stamped,
:func:`ap_epchunk.tag_backward_module_fqns`). On a joint graph AOTAutograd traced straight from
Dynamo -- ``torch.compile(step, backend=autoparallel_backend(ep_chunk=...))`` with
``capture_scalar_outputs=True``, no first compilation -- the chunked graph compiles and then
fails at run time (torchtitan's Qwen3-MoE with real expert parallelism at 2 gloo ranks: with
the tokens marked ``hint=N`` the lazily compiled backward's ``repeat_interleave(...,
output_size=u7 + u8)`` raised "allocated size does not match required size"; issue 34 reports
``Eq(u32 + u34, 256)`` in the forward with static token placeholders). Such a plan is refused
at compile time, naming the route that works.
"""

from __future__ import annotations

import torch.fx
from ap_tags import CUSTOM
from ap_tags.graph import is_backward_node

from ._errors import BACKWARD_FQN_KEY, ChunkError, source_of
from ._plan_types import Plan


def _from_dynamo_without_first_compilation(graph: torch.fx.Graph) -> bool:
    """An AOTAutograd joint graph (its placeholders carry AOTAutograd's input descriptors)
    whose backward ops carry no FQN stamp of a first compilation."""
    described = any(
        type(p.meta.get("desc")).__module__.endswith("descriptors")
        for p in graph.find_nodes(op="placeholder")
    )
    if not described:
        return False
    for node in graph.nodes:
        custom = node.meta.get(CUSTOM)
        if is_backward_node(node) and isinstance(custom, dict) and BACKWARD_FQN_KEY in custom:
            return False
    return True


def check_route(graph: torch.fx.Graph, plan: Plan) -> None:
    """Refuse a plan whose bodies bind unbacked symbols on a graph from Dynamo without
    ``precompile`` (see the module docstring)."""
    if not plan.body_unbacked or not _from_dynamo_without_first_compilation(graph):
        return
    for rp in plan.regions:
        for node in rp.body:
            if node.meta.get("unbacked_bindings"):
                raise ChunkError(
                    f"data-dependent op in chunked region {rp.root!r} "
                    f"({'backward' if rp.backward else 'forward'}; e.g. the .tolist() split "
                    "sizes of an expert-parallel exchange) on a graph torch.compile traced "
                    "without a first compilation: chunked, it compiles and then fails at run "
                    "time. Compile the precompiled module instead: mark the token inputs "
                    "(ap_epchunk.mark_chunk_dim(t, 0, hint=t.shape[0])), pm = "
                    "ap_backend.precompile(module, example_args), then torch.compile(pm, "
                    f"backend=autoparallel_backend(ep_chunk=...)) ({source_of(node)})",
                    node,
                )
