"""Which graphs a chunk plan with data-dependent body ops may be carried out on.

A chunked region whose body binds unbacked symbols (``.item()`` / ``.tolist()``: the split
sizes of an expert-parallel exchange) gets fresh symbols per chunk. That is exact on a joint
graph traced by :func:`ap_epchunk.trace_joint`, on the second compilation of
``ap_backend.precompile`` (whose backward ops carry the module FQN the first compilation
stamped, :func:`ap_epchunk.tag_backward_module_fqns`), and on a joint graph AOTAutograd traced
straight from Dynamo -- ``torch.compile(step, backend=autoparallel_backend(ep_chunk=...))``
with ``capture_scalar_outputs=True``, no first compilation -- when the token dim is a hinted
unbacked symbol (``mark_chunk_dim(t, 0, hint=N)``): Dynamo's runtime asserts on the split
sizes (``Eq(u1 + u2, 32*u0)``, the splits summing to the exchanged rows) then read the token
symbol, which the chunk pass divides, so each chunk's copy checks its own count.

With static token sizes (``hint=None``) on such a graph the same asserts carry the full
batch's count as a constant (``Eq(u0 + u1, 256)``), which no chunk satisfies: the chunked
graph failed to compile (torchtitan's Qwen3-MoE with real expert parallelism at 2 gloo ranks:
Inductor's ``mul`` of the chunk's combined rows ``[u32 + u34, 64]`` with ``[128, 1]`` saw
``u32 + u34 == 256``; issue 34 reported ``Eq(u32 + u34, 256)`` raised at run time). Such a
plan is refused at compile time, naming the routes that work. (The precompiled route has no
such asserts in its second joint graph.)
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


def check_route(graph: torch.fx.Graph, plan: Plan, mode: str) -> None:
    """Refuse a plan whose bodies bind unbacked symbols on a graph from Dynamo without
    ``precompile`` when the chunk dims are static (``mode == "static"``; see the module
    docstring)."""
    if mode != "static" or not plan.body_unbacked:
        return
    if not _from_dynamo_without_first_compilation(graph):
        return
    for rp in plan.regions:
        for node in rp.body:
            if node.meta.get("unbacked_bindings"):
                raise ChunkError(
                    f"data-dependent op in chunked region {rp.root!r} "
                    f"({'backward' if rp.backward else 'forward'}; e.g. the .tolist() split "
                    "sizes of an expert-parallel exchange) on a graph torch.compile traced "
                    "without a first compilation, with static token sizes: its runtime asserts "
                    "compare each chunk's sizes with the full batch's constant count, which no "
                    "chunk satisfies. Mark the token inputs with their extent as hint "
                    "(ap_epchunk.mark_chunk_dim(t, 0, hint=t.shape[0])) before the first "
                    "compiled call, or compile the precompiled module: pm = "
                    "ap_backend.precompile(module, example_args), then torch.compile(pm, "
                    f"backend=autoparallel_backend(ep_chunk=...)) ({source_of(node)})",
                    node,
                )
