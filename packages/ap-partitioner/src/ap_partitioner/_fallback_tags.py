"""Tags the min-cut fallback cannot handle, removed from its working copy.

When the replay refuses a joint graph (malformed tags, or a saved set that is not a valid cut),
the graph goes to torch's min-cut instead. Min-cut reads the same tags, and crashes on malformed
ones or builds an invalid backward from an unsatisfiable ``MUST_RECOMPUTE``; these functions
drop exactly those tags from the working copy (never from the caller's graph) and say which.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx as fx
from ap_tags import PROJECT_CUSTOM_KEYS
from torch.utils.checkpoint import CheckpointPolicy


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
