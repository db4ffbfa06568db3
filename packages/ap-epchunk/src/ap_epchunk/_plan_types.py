"""The planner's decisions as data: what :mod:`._plan` builds and :mod:`._rewrite` carries out.

:class:`Plan` holds one :class:`RegionPlan` per chunked region (its body, live-ins, mutation
chains) and, per live-out with users outside the chunked world, a :class:`Materialize` saying
how the value is made full again. Kept apart from the planner so the modules that read a plan
(the collective policy, the rewrite) depend on these types and not on the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx


@dataclass(eq=False)
class RegionPlan:
    root: str
    backward: bool
    body: list[torch.fx.Node] = field(default_factory=list)
    splits: list[torch.fx.Node] = field(default_factory=list)
    routed: set[torch.fx.Node] = field(default_factory=set)
    scalars: list[torch.fx.Node] = field(default_factory=list)
    chains: dict[torch.fx.Node, int] = field(default_factory=dict)
    followers: set[torch.fx.Node] = field(default_factory=set)
    materialize: list[Materialize] = field(default_factory=list)
    #: collectives of the region left out of the body (no chunk influence: shared by every
    #: chunk, e.g. an FSDP all-gather of an expert weight)
    shared_collectives: list[torch.fx.Node] = field(default_factory=list)


@dataclass(eq=False)
class Materialize:
    live_out: torch.fx.Node
    kind: str  # "cat" | "sum" | "ssum" | "last" | "same"
    dim: int | None
    start: torch.fx.Node  # materialized value; == live_out unless accumulated early
    chain: list[torch.fx.Node]  # nodes replayed once on the full value, ending at live_out
    full_users: list[torch.fx.Node]


@dataclass
class Plan:
    regions: list[RegionPlan]
    owner: dict[torch.fx.Node, RegionPlan]
    split_dim: dict[torch.fx.Node, int]
    scalars: set[torch.fx.Node]
    tokenish: dict[torch.fx.Node, bool] = field(default_factory=dict)
    #: unbacked symbols bound by data-dependent body ops (refreshed per chunk by the rewrite)
    body_unbacked: set[Any] = field(default_factory=set)
