"""Typed readers and writers for the tags, so no pass touches ``node.meta`` keys by hand.

Writers validate what they store (a bad value raises ``TagError`` naming the node) and readers
raise on malformed values instead of guessing, because a silently misread save/recompute tag
changes what a partitioner keeps alive.
"""

from __future__ import annotations

import re
from typing import Any

import torch.fx

from ._compat import checkpoint_policy
from ._errors import TagError, TagSchemaError
from ._keys import (
    AC_GRAPH_ID,
    CUSTOM,
    FSDP_AC_GRAPH_ID,
    MODULE_FQN,
    MUST_SAVE,
    MUST_SAVE_INDICES,
    RECOMPUTE,
    TAG_SCHEMA,
    TAG_SCHEMA_VERSION,
)
from .checks import require_node


def _is_int(value: object) -> bool:
    """True for real ints; ``bool`` is an int subclass but never a valid index or id."""
    return isinstance(value, int) and not isinstance(value, bool)


def schema_problem(custom: dict[str, Any]) -> str | None:
    """Why ``custom``'s project keys cannot be read by this ap-tags, or None.

    Keys without a schema stamp (hand-written tags) are read as this schema; a stamp of another
    version is refused.
    """
    version = custom.get(TAG_SCHEMA, TAG_SCHEMA_VERSION)
    if version == TAG_SCHEMA_VERSION and not isinstance(version, bool):
        return None
    return (
        f"tags written with ap-tags tag schema {version!r}; this ap-tags reads schema "
        f"{TAG_SCHEMA_VERSION} (install the same ap-tags for both compilations)"
    )


def custom_meta(node: torch.fx.Node, *, create: bool = False) -> dict[str, Any] | None:
    """``node.meta["custom"]`` (created when ``create``); ``TagError`` if it is not a dict,
    ``TagSchemaError`` if another tag-schema version wrote it."""
    require_node(node, where="custom_meta")
    custom = node.meta.get(CUSTOM)
    if custom is None:
        if not create:
            return None
        custom = {}
        node.meta[CUSTOM] = custom
    if not isinstance(custom, dict):
        raise TagError({node.name: [f"meta[{CUSTOM!r}] is {type(custom).__name__}, not dict"]})
    problem = schema_problem(custom)
    if problem is not None:
        raise TagSchemaError({node.name: [problem]})
    return custom


def mark_must_save(node: torch.fx.Node, index: int | None = None) -> None:
    """Record that the first partition saved ``node`` (or its output ``index``).

    With ``index`` the node is a multi-output parent whose ``getitem(node, index)`` was saved:
    the parent is stamped too (a retrace re-creates getitems that inherit the parent's meta, so
    the parent is where the decision survives) and the index is appended once, keeping order.
    """
    require_node(node, where="mark_must_save")
    if index is not None and (not _is_int(index) or index < 0):
        raise TagError({node.name: [f"getitem index must be a non-negative int, got {index!r}"]})
    custom = custom_meta(node, create=True)
    assert custom is not None
    if index is not None:
        existing = custom.get(MUST_SAVE_INDICES)
        problem = None if existing is None else _indices_problem(existing)
        if problem is not None:
            raise TagError({node.name: [problem]})
        # a tuple is a valid stored form (validate_tags accepts it); rewrite it as a list
        indices: list[int] = [] if existing is None else list(existing)
        if index not in indices:
            indices.append(index)
        custom[MUST_SAVE_INDICES] = indices
    custom[MUST_SAVE] = True
    custom[TAG_SCHEMA] = TAG_SCHEMA_VERSION


def is_must_save(node: torch.fx.Node) -> bool:
    """True when the first partition saved this node's value (``custom["ap_must_save"]``)."""
    require_node(node, where="is_must_save")
    custom = custom_meta(node)
    if custom is None or MUST_SAVE not in custom:
        return False
    value = custom[MUST_SAVE]
    if not isinstance(value, bool):
        raise TagError({node.name: [f"{MUST_SAVE} must be bool, got {value!r}"]})
    return value


def must_save_indices(node: torch.fx.Node) -> tuple[int, ...]:
    """The saved getitem indices of a multi-output node, in output order (empty if none)."""
    require_node(node, where="must_save_indices")
    custom = custom_meta(node)
    if custom is None or MUST_SAVE_INDICES not in custom:
        return ()
    value = custom[MUST_SAVE_INDICES]
    problem = _indices_problem(value)
    if problem is not None:
        raise TagError({node.name: [problem]})
    return tuple(value)


def _indices_problem(value: object) -> str | None:
    """Why ``value`` is not a valid index list, or None when it is."""
    if not isinstance(value, list | tuple):
        return f"{MUST_SAVE_INDICES} must be a list of ints, got {type(value).__name__}"
    bad = [v for v in value if not _is_int(v)]
    if bad:
        return f"{MUST_SAVE_INDICES} holds non-int entries {bad!r}"
    negative = [v for v in value if v < 0]
    if negative:
        return f"{MUST_SAVE_INDICES} holds negative indices {negative!r}"
    dupes = sorted({v for v in value if list(value).count(v) > 1})
    if dupes:
        return f"{MUST_SAVE_INDICES} holds duplicate indices {dupes!r}"
    return None


def recompute_policy(node: torch.fx.Node) -> Any:
    """``meta["recompute"]`` as a ``torch.utils.checkpoint.CheckpointPolicy``, or None."""
    require_node(node, where="recompute_policy")
    value = node.meta.get(RECOMPUTE)
    if value is None:
        return None
    policy_type = checkpoint_policy()
    if not isinstance(value, policy_type):
        raise TagError({node.name: [f"{RECOMPUTE} must be a CheckpointPolicy, got {value!r}"]})
    return value


def ac_graph_id(node: torch.fx.Node) -> int | None:
    """``meta["ac_graph_id"]`` (the AC region id), or None when unset."""
    require_node(node, where="ac_graph_id")
    value = node.meta.get(AC_GRAPH_ID)
    if value is None:
        return None
    if not _is_int(value):
        raise TagError({node.name: [f"{AC_GRAPH_ID} must be an int, got {value!r}"]})
    assert isinstance(value, int)
    return value


def set_recompute(node: torch.fx.Node, policy: Any, ac_graph_id: int = FSDP_AC_GRAPH_ID) -> None:
    """Write torch's ``recompute`` policy and ``ac_graph_id`` together, as torch's SAC does.

    Both keys are in ``torch.fx.proxy._COPY_META_FIELDS``, so they survive a retrace under
    ``preserve_node_meta``. The default id keeps project tags apart from user AC regions.
    """
    require_node(node, where="set_recompute")
    policy_type = checkpoint_policy()
    if not isinstance(policy, policy_type):
        raise TagError({node.name: [f"{RECOMPUTE} must be a CheckpointPolicy, got {policy!r}"]})
    if not _is_int(ac_graph_id):
        raise TagError({node.name: [f"{AC_GRAPH_ID} must be an int, got {ac_graph_id!r}"]})
    node.meta[RECOMPUTE] = policy
    node.meta[AC_GRAPH_ID] = ac_graph_id


def module_fqn(node: torch.fx.Node) -> str | None:
    """FQN of the innermost submodule ``node`` was traced in.

    Prefers ``custom["module_fqn"]`` (written by ``annotate_module_fqns``; survives retraces and
    reaches backward nodes) and falls back to the innermost ``nn_module_stack`` entry that
    Dynamo/export record and that names a submodule (export's path is already an FQN, e.g.
    ``"layers.1.mlp"``; Dynamo's ``L['self']`` and ``getattr(...)`` spellings are normalised
    here).
    """
    require_node(node, where="module_fqn")
    custom = custom_meta(node)
    if custom is not None and MODULE_FQN in custom:
        value = custom[MODULE_FQN]
        if not isinstance(value, str):
            raise TagError({node.name: [f"{MODULE_FQN} must be str, got {value!r}"]})
        return value
    stack = node.meta.get("nn_module_stack")
    if not isinstance(stack, dict) or not stack:
        return None
    for entry in reversed(list(stack.values())):
        path = entry[0] if isinstance(entry, tuple) and entry else None
        if isinstance(path, str):
            fqn = _normalise_module_path(path)
            if fqn is not None:
                return fqn
    return None


_GETATTR = re.compile(r"getattr\(([^(),]*),\s*'([^']*)'\)")


def _normalise_module_path(path: str) -> str | None:
    """Turn Dynamo's ``L['self'].layers[1].mlp``, ``L['self']._modules['x']`` and
    ``getattr(L['self'].layers, '1').mlp`` (a ``ModuleDict`` with numeric keys) into an FQN;
    ``None`` for a path that names no submodule (a parametrization's module, traced as
    ``dict(type(L['self'].wq).__dict__)['weight'].fget...``: the caller takes the entry
    outside it, the module owning the parameter)."""
    previous = None
    while previous != path:  # innermost first: they nest
        previous = path
        path = _GETATTR.sub(r"\1.\2", path)
    if path.startswith(("L[", "G[")):
        path = re.sub(r"^[LG]\['[^']*'\]\.?", "", path)
        path = re.sub(r"_modules\['([^']*)'\]", r"\1", path)
        path = re.sub(r"\[(\d+)\]", r".\1", path)
        path = re.sub(r"\['([^']*)'\]", r".\1", path)
        path = re.sub(r"\.+", ".", path).strip(".")
    return None if re.search(r"[()\[\]'\"]", path) else path
