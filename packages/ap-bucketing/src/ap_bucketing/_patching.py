"""Scoped, reversible replacement of torch's FSDP group detection and greedy bucketer.

``install``/``uninstall``/``patched`` swap two module attributes (one call site each in torch
2.13-2.15, both resolved through module globals at call time):

* ``torch._inductor.fx_passes.fsdp.identify_fsdp_groups`` -> primary-group detection;
* ``torch._inductor.fx_passes.bucketing.greedy_bucket_collective_by_mb`` -> ``bucket_collectives``.

The replacements read the *active* config at call time: the innermost ``patched`` block, else the
``install``-ed one. The originals are saved once and put back exactly when nothing is active.
While a config is active, ``torch.compiler.config.cache_key_tag`` carries its fingerprint, which
Inductor's ``FxGraphHashDetails`` (and AOTAutograd's cache key, which extends it) hash, so a graph
bucketed under one config is never served from cache under another. Importing the package
changes nothing.

Entering (``install``, ``patched``) is all-or-nothing: whatever can fail -- a missing patch
site, a ``cache_key_tag`` that is not a str, the fingerprint -- is checked before the first
change, so a failing entry leaves torch and the active config exactly as they were. Leaving is
exception-safe: a ``patched`` block restores its outer state however the body exits.

The patch is process-wide (torch looks the functions up globally), so a ``patched`` block in one
thread also affects compiles running in other threads for its duration.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Collection, Hashable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from . import _compat
from ._checks import require_instance
from ._config import BucketingConfig, resolve_config
from ._greedy import bucket_collectives
from ._groups import all_fsdp_groups, primary_fsdp_groups

if TYPE_CHECKING:
    from ._compat import OrderedSet

log = logging.getLogger(__name__)

_TAG_PREFIX = "|ap_bucketing="

_lock = threading.RLock()
_installed: BucketingConfig | None = None
_scoped: list[tuple[object, BucketingConfig]] = []
_originals: dict[str, Any] = {}
_applied = False  # the replacements and the tag below are in torch
_tag_base: str | None = None  # cache_key_tag before this package extended it
_tag_applied: str | None = None  # cache_key_tag as this package set it


#: While set (``only_groups``), the patched greedy bucketer considers only collectives of these
#: process groups: torch's FSDP pre-bucketing identifies the FSDP groups but then buckets every
#: FSDP-*shaped* all-gather / reduce-scatter of the graph, whatever its group (a TP group's
#: all-gathers of parameter shards and reduce-scatters of gradients included).
_only_groups: contextvars.ContextVar[frozenset[Hashable] | None] = contextvars.ContextVar(
    "ap_bucketing_only_groups", default=None
)


@contextlib.contextmanager
def only_groups(groups: Collection[Hashable]) -> Iterator[None]:
    """Within the block, the patched greedy bucketer buckets collectives of ``groups`` only."""
    token = _only_groups.set(frozenset(groups))
    try:
        yield
    finally:
        _only_groups.reset(token)


#: While set (``excluding``), the patched greedy bucketer never buckets these collectives:
#: ``OverlapBucketingPass`` names the ones that read a storage the graph writes in place (a
#: bucket's pack would read it at another point of the write order than the collective did).
_excluded: contextvars.ContextVar[frozenset[fx.Node]] = contextvars.ContextVar(
    "ap_bucketing_excluded", default=frozenset()
)


@contextlib.contextmanager
def excluding(nodes: Collection[fx.Node]) -> Iterator[None]:
    """Within the block, the patched greedy bucketer leaves ``nodes`` unbucketed."""
    token = _excluded.set(frozenset(nodes))
    try:
        yield
    finally:
        _excluded.reset(token)


def _restricted(filter_node: Callable[[fx.Node], bool]) -> Callable[[fx.Node], bool]:
    groups = _only_groups.get()
    excluded = _excluded.get()
    if groups is None and not excluded:
        return filter_node
    _, group_name, _ = _compat.fsdp_all_gather_helpers()

    def allowed(node: fx.Node) -> bool:
        if node in excluded or not filter_node(node):
            return False
        return groups is None or group_name(node) in groups

    return allowed


def current_config() -> BucketingConfig | None:
    """The config the patched functions use right now (``None`` when not patched)."""
    with _lock:
        if _scoped:
            return _scoped[-1][1]
        return _installed


def _patched_identify_fsdp_groups(gm: fx.GraphModule) -> tuple[OrderedSet[Any], int | None]:
    """Replacement for ``fsdp.identify_fsdp_groups`` honouring the active config."""
    cfg = current_config()
    if cfg is None:  # uninstalled while torch held a reference; behave like torch
        original: Callable[[fx.GraphModule], tuple[OrderedSet[Any], int | None]] = _originals[
            "identify_fsdp_groups"
        ]
        return original(gm)
    return primary_fsdp_groups(gm) if cfg.primary_group_only else all_fsdp_groups(gm)


def _patched_greedy_bucket_collective_by_mb(
    gm: fx.GraphModule,
    bucket_cap_mb_by_bucket_idx: Callable[[int], float],
    filter_node: Callable[[fx.Node], bool],
    node_group_key: Callable[[fx.Node], Any],
    filter_wait_node: Callable[[fx.Node], bool] | None = None,
) -> list[list[fx.Node]]:
    """Replacement for ``bucketing.greedy_bucket_collective_by_mb`` (same signature)."""
    cfg = current_config()
    if cfg is None:
        original: Callable[..., list[list[fx.Node]]] = _originals["greedy_bucket_collective_by_mb"]
        return original(
            gm, bucket_cap_mb_by_bucket_idx, filter_node, node_group_key, filter_wait_node
        )
    return bucket_collectives(
        gm,
        bucket_cap_mb_by_bucket_idx,
        _restricted(filter_node),
        node_group_key,
        filter_wait_node,
        config=cfg,
    )


Site = tuple[Any, str, Callable[..., Any]]


def _sites() -> list[Site]:
    """The two patch sites and their replacements; the package's error if torch lacks one.

    A torch from before FSDP pre-bucketing (2.11, 2.12: neither ``identify_fsdp_groups`` nor
    ``pre_bucket_fsdp_collectives``) has no group detection to replace: only the greedy
    bucketer is patched there (``OverlapBucketingPass`` then pre-buckets with ap-bucketing's
    carried pre-bucketing, which asks :func:`primary_fsdp_groups` itself)."""
    greedy: Site = (*_compat.greedy_bucketer_site(), _patched_greedy_bucket_collective_by_mb)
    if _compat.predates_fsdp_prebucketing():
        return [greedy]
    return [(*_compat.fsdp_groups_site(), _patched_identify_fsdp_groups), greedy]


def _apply_locked(sites: list[Site]) -> None:
    for mod, name, replacement in sites:
        current = getattr(mod, name)
        if current is replacement:
            continue
        _originals[name] = current
        setattr(mod, name, replacement)


def _restore_locked(sites: list[Site]) -> None:
    # ``_originals`` is kept after restoring: a caller that grabbed a reference to a
    # replacement while patched still reaches torch's function through the fallback.
    for mod, name, replacement in sites:
        if name not in _originals or getattr(mod, name) is not replacement:
            if name in _originals and getattr(mod, name) is not _originals[name]:
                log.warning(
                    "ap_bucketing: %s.%s was replaced by someone else while patched; leaving it",
                    mod.__name__,
                    name,
                )
            continue
        setattr(mod, name, _originals[name])


def _strip_tag(tag: object) -> object:
    """``tag`` without the fingerprint this package appended (anything else unchanged)."""
    if isinstance(tag, str) and _TAG_PREFIX in tag:
        return tag[: tag.index(_TAG_PREFIX)]
    return tag


def _plan_tag_locked(
    cfg: BucketingConfig | None, where: str
) -> tuple[object, str | None, str | None]:
    """``(cache_key_tag to set, new _tag_base, new _tag_applied)`` for ``cfg``. Reads only, so
    a tag it cannot extend (not a str) raises before anything changed."""
    current: object = torch.compiler.config.cache_key_tag
    if cfg is None:
        # Back to the tag from before; one someone else replaced meanwhile keeps their value.
        restored = _tag_base if current == _tag_applied else _strip_tag(current)
        return restored, None, None
    if _tag_applied is not None and current == _tag_applied and _tag_base is not None:
        base = _tag_base
    else:
        tag = require_instance(
            current,
            str,
            where=where,
            arg="torch.compiler.config.cache_key_tag",
            expected="a str (ap-bucketing appends the config fingerprint to it)",
        )
        base = str(_strip_tag(tag))
    applied = f"{base}{_TAG_PREFIX}{cfg.fingerprint()}"
    return applied, base, applied


def _sync_locked(where: str) -> None:
    """Make torch match the active config (patched sites + tag), or torch's own state when none
    is active. Every lookup and check runs before the first change: if this raises, nothing
    changed."""
    global _applied, _tag_base, _tag_applied
    cfg = current_config()
    if cfg is None and not _applied:
        return
    sites = _sites()
    tag, base, applied = _plan_tag_locked(cfg, where)
    # From here on nothing raises.
    if cfg is None:
        _restore_locked(sites)
    else:
        _apply_locked(sites)
    cconfig: Any = torch.compiler.config
    cconfig.cache_key_tag = tag
    _applied, _tag_base, _tag_applied = cfg is not None, base, applied


def install(config: BucketingConfig | None = None) -> None:
    """Patch torch process-wide with ``config`` (default ``BucketingConfig()``) until
    ``uninstall()``. Installing again replaces the installed config; idempotent. A failing
    install changes nothing."""
    global _installed
    cfg = resolve_config(config, where="install")
    with _lock:
        previous, _installed = _installed, cfg
        try:
            _sync_locked("install")
        except BaseException:
            _installed = previous
            raise


def uninstall() -> None:
    """Remove the ``install``-ed config; restore torch's exact originals once no ``patched``
    block is active either. A no-op when nothing is installed."""
    global _installed
    with _lock:
        _installed = None
        _sync_locked("uninstall")


def is_installed() -> bool:
    """Whether torch's two functions are currently replaced (by ``install`` or ``patched``)."""
    return current_config() is not None


@contextlib.contextmanager
def patched(config: BucketingConfig | None = None) -> Iterator[BucketingConfig]:
    """Patch torch with ``config`` for the block; nestable (the innermost config wins and the
    outer one is back on exit) and thread-safe. Yields the active config. A failing entry
    changes nothing."""
    cfg = resolve_config(config, where="patched")
    token = object()
    with _lock:
        _scoped.append((token, cfg))
        try:
            _sync_locked("patched")
        except BaseException:
            _remove_scope_locked(token)
            raise
    try:
        yield cfg
    finally:
        with _lock:
            _remove_scope_locked(token)
            _sync_locked("patched")


def _remove_scope_locked(token: object) -> None:
    for index, (entry, _) in enumerate(_scoped):
        if entry is token:
            del _scoped[index]
            return
