"""FSDP predicates carried from torch 2.15 (``torch/_inductor/fx_passes/fsdp.py``) for a torch
whose Inductor predates FSDP pre-bucketing (2.11, 2.12): pure FX, no torch internal. ``_compat``
hands them out only there; on 2.13+ torch's own are used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx.operator_schemas

# torch 2.11/2.12 lack these three (2.12 has an older ``is_fsdp_all_gather``, used as it is);
# carried from torch 2.15, ``torch/_inductor/fx_passes/fsdp.py``.


def is_fsdp_all_gather(n: torch.fx.Node) -> bool:
    """The all-gather derives from exactly one placeholder (a parameter), through any number
    of input branches (torch 2.15's ``is_fsdp_all_gather``)."""
    visited: set[torch.fx.Node] = set()
    queue = list(n.all_input_nodes)
    placeholders = 0
    while queue:
        node = queue.pop()
        if node in visited:
            continue
        visited.add(node)
        if node.op == "placeholder":
            placeholders += 1
            if placeholders > 1:
                return False
        else:
            queue.extend(node.all_input_nodes)
    return placeholders == 1


def collective_kwargs(n: torch.fx.Node) -> dict[str, object]:
    normalized = torch.fx.operator_schemas.normalize_function(
        n.target,  # type: ignore[arg-type]
        args=n.args,
        kwargs=n.kwargs,
        normalize_to_only_use_kwargs=True,
    )
    if normalized is None:
        raise ValueError(f"ap-bucketing: cannot read the arguments of collective {n.name}")
    return dict(normalized[1])


def get_group_name(n: torch.fx.Node) -> str:
    return str(collective_kwargs(n)["group_name"])


def get_group_size_from_node(n: torch.fx.Node) -> int:
    size: Any = collective_kwargs(n)["group_size"]
    return int(size)


def is_fsdp_reduce_scatter_wait(wait: torch.fx.Node) -> bool:
    """torch 2.15's ``fsdp.is_fsdp_reduce_scatter_wait`` (2.11/2.12's own accepts only a wait
    that is itself an output or feeds one cast): every path from the wait reaches an output
    through single-input ops."""
    if not wait.users:
        return False
    visited: set[torch.fx.Node] = set()
    queue = [wait]
    while queue:
        node = queue.pop()
        if node in visited:
            continue
        visited.add(node)
        for user in node.users:
            if user.op == "output":
                continue
            if len(user.all_input_nodes) != 1:
                return False
            queue.append(user)
    return True
