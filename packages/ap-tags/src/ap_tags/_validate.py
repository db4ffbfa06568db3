"""``validate_tags``: check every project tag in a graph and report all bad nodes at once.

Passes and partitioners trust the tags blindly; one malformed value (an index list with a
duplicate, a recompute policy stored as a bare int) would silently change what is saved. This
check runs before a consumer acts, and names every offending node so a user fixes them in one go.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx

from ._accessors import _indices_problem, _is_int, schema_problem
from ._compat import checkpoint_policy
from ._errors import TagError, TagSchemaError
from ._keys import (
    AC_GRAPH_ID,
    CHUNK_GLUE,
    CHUNK_INDEX,
    CHUNK_REGION,
    CUSTOM,
    MODULE_FQN,
    MUST_SAVE,
    MUST_SAVE_INDICES,
    RECOMPUTE,
)
from .checks import require_bool, require_graph, require_node


def _bool_problem(key: str) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        return None if isinstance(value, bool) else f"{key} must be bool, got {value!r}"

    return check


def _str_problem(key: str) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        return None if isinstance(value, str) else f"{key} must be str, got {value!r}"

    return check


def _chunk_index_problem(value: object) -> str | None:
    if not _is_int(value):
        return f"{CHUNK_INDEX} must be an int, got {value!r}"
    assert isinstance(value, int)
    return None if value >= 0 else f"{CHUNK_INDEX} must be >= 0, got {value}"


_CUSTOM_CHECKS: dict[str, Callable[[object], str | None]] = {
    MUST_SAVE: _bool_problem(MUST_SAVE),
    MUST_SAVE_INDICES: _indices_problem,
    MODULE_FQN: _str_problem(MODULE_FQN),
    CHUNK_INDEX: _chunk_index_problem,
    CHUNK_REGION: _str_problem(CHUNK_REGION),
    CHUNK_GLUE: _bool_problem(CHUNK_GLUE),
}


def _output_count(node: torch.fx.Node) -> int | None:
    """How many outputs a multi-output node has, from ``meta["val"]`` (None if unknown)."""
    val = node.meta.get("val")
    return len(val) if isinstance(val, list | tuple) else None


def node_tag_problems(node: torch.fx.Node, *, retraced: bool = False) -> list[str]:
    """Every problem with ``node``'s project and AC tags (empty when well-formed).

    ``retraced=True`` (a graph traced again from the tagged one, e.g. the second
    compilation's joint): getitem indices are not range-checked, because the retrace may have
    decomposed the op they were recorded on (``native_layer_norm`` -> ``var_mean``); the
    replay maps saved outputs by what the backward reads instead (``replayed_saves``).
    """
    require_node(node, where="node_tag_problems")
    problems: list[str] = []
    custom: Any = node.meta.get(CUSTOM)
    if custom is not None and not isinstance(custom, dict):
        problems.append(f"meta[{CUSTOM!r}] is {type(custom).__name__}, not dict")
        custom = None
    if custom:
        mismatch = schema_problem(custom)
        if mismatch is not None:
            return [mismatch]  # the other keys may mean something else in that schema
        for key, check in _CUSTOM_CHECKS.items():
            if key in custom:
                problem = check(custom[key])
                if problem is not None:
                    problems.append(problem)
        indices = custom.get(MUST_SAVE_INDICES)
        if indices is not None and custom.get(MUST_SAVE) is not True:
            problems.append(f"{MUST_SAVE_INDICES} is set but {MUST_SAVE} is not True")
        count = None if retraced else _output_count(node)
        if count is not None and isinstance(indices, list | tuple):
            out_of_range = [i for i in indices if _is_int(i) and i >= count]
            if out_of_range:
                problems.append(
                    f"{MUST_SAVE_INDICES} {out_of_range!r} out of range for {count} outputs"
                )
    policy = node.meta.get(RECOMPUTE)
    if policy is not None and not isinstance(policy, checkpoint_policy()):
        problems.append(f"{RECOMPUTE} must be a CheckpointPolicy, got {policy!r}")
    graph_id = node.meta.get(AC_GRAPH_ID)
    if graph_id is not None and not _is_int(graph_id):
        problems.append(f"{AC_GRAPH_ID} must be an int, got {graph_id!r}")
    return problems


def validate_tags(graph: torch.fx.Graph | torch.fx.GraphModule, *, retraced: bool = False) -> None:
    """Raise ``TagError`` naming every node whose tags are malformed; return None otherwise.

    Tags written by another tag-schema version raise ``TagSchemaError`` (a ``TagError``) naming
    those nodes. ``retraced``: see ``node_tag_problems``.
    """
    g = require_graph(graph, where="validate_tags")
    require_bool(retraced, where="validate_tags", arg="retraced")
    problems: dict[str, list[str]] = {}
    schema: dict[str, list[str]] = {}
    for node in g.nodes:
        custom = node.meta.get(CUSTOM)
        if isinstance(custom, dict) and schema_problem(custom) is not None:
            schema[node.name] = node_tag_problems(node)
            continue
        found = node_tag_problems(node, retraced=retraced)
        if found:
            problems[node.name] = found
    if schema:
        raise TagSchemaError(schema)
    if problems:
        raise TagError(problems)
