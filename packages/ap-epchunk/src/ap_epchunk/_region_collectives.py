"""Collectives in a planned region: which run once per chunk, which stay whole, and the policy.

Only the EP token exchange (``all_to_all_single``) is chunked -- one per chunk, which is what
chunking exists to overlap. A gradient ``all_reduce`` / reduce-scatter that early accumulation
replays once on the summed partials, or a collective no chunk influences (shared by every
chunk), stays whole; :func:`region_collectives` reports both, and :func:`check_collectives`
refuses any other collective in a chunk body.
"""

from __future__ import annotations

import torch.fx
from ap_tags.graph import is_collective, op_overload

from ._errors import ChunkError, source_of
from ._plan_types import Plan, RegionPlan


def is_all_to_all(node: torch.fx.Node) -> bool:
    """The EP token exchange (``all_to_all_single``): what chunking exists to overlap."""
    op = op_overload(node)
    return op is not None and str(op._schema.name).endswith("::all_to_all_single")


def collective_name(node: torch.fx.Node) -> str:
    op = op_overload(node)
    return str(op._schema.name).split("::")[-1] if op is not None else str(node.target)


def region_collectives(rp: RegionPlan) -> tuple[int, list[str]]:
    """``(all-to-alls chunked, collectives kept whole with why)`` of one planned region."""
    replayed = {p for m in rp.materialize for p in m.chain}
    exchanges = sum(1 for n in rp.body if is_collective(n) and is_all_to_all(n))
    whole = [
        f"{collective_name(n)}: replayed once on the summed chunk partials"
        for n in rp.body
        if is_collective(n) and n in replayed
    ]
    whole += [
        f"{collective_name(n)}: not influenced by the chunk dim, shared by every chunk"
        for n in rp.shared_collectives
    ]
    return exchanges, whole


def check_collectives(plan: Plan) -> None:
    """The collective policy: a chunk body may run EP all-to-alls (one per chunk: what
    chunking exists to overlap). Any other collective in a body would silently become N
    collectives over partial values (a data-parallel ``all_reduce``, a TP all-gather); it is
    refused unless it is part of a suffix early accumulation replays once on the full value
    (gradient all-reduce / reduce-scatter after the partials are summed)."""
    for rp in plan.regions:
        replayed = {p for m in rp.materialize for p in m.chain}
        for node in rp.body:
            if is_collective(node) and not is_all_to_all(node) and node not in replayed:
                op = op_overload(node)
                name = str(op._schema.name) if op is not None else str(node.target)
                raise ChunkError(
                    f"collective {name} inside chunked region {rp.root!r} "
                    f"({'backward' if rp.backward else 'forward'}) would run once per chunk on "
                    "partial values; only EP all-to-alls (all_to_all_single) are chunked. Move it "
                    "out of the region (gradient collectives run once on the summed partials "
                    f"with early_grad_accumulation=True) ({source_of(node)})",
                    node,
                )
