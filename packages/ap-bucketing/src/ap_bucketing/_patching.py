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

The patch is process-wide (torch looks the functions up globally), so a ``patched`` block in one
thread also affects compiles running in other threads for its duration.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._ordered_set import OrderedSet

from . import _compat
from ._config import BucketingConfig
from ._greedy import bucket_collectives
from ._groups import all_fsdp_groups, primary_fsdp_groups

log = logging.getLogger(__name__)

_TAG_PREFIX = "|ap_bucketing="

_lock = threading.RLock()
_installed: BucketingConfig | None = None
_scoped: list[tuple[object, BucketingConfig]] = []
_originals: dict[str, Any] = {}
_tag_base: str | None = None
_tag_applied: str | None = None


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
        gm, bucket_cap_mb_by_bucket_idx, filter_node, node_group_key, filter_wait_node, config=cfg
    )


def _sites() -> list[tuple[Any, str, Callable[..., Any]]]:
    fsdp = _compat.module(_compat.FSDP_MODULE)
    bucketing = _compat.module(_compat.BUCKETING_MODULE)
    sites: list[tuple[Any, str, Callable[..., Any]]] = [
        (fsdp, "identify_fsdp_groups", _patched_identify_fsdp_groups),
        (bucketing, "greedy_bucket_collective_by_mb", _patched_greedy_bucket_collective_by_mb),
    ]
    for mod, name, _ in sites:
        _compat.attr(mod.__name__, name)  # fail clearly before touching anything
    return sites


def _apply_locked() -> None:
    for mod, name, replacement in _sites():
        current = getattr(mod, name)
        if current is replacement:
            continue
        _originals[name] = current
        setattr(mod, name, replacement)


def _restore_locked() -> None:
    # ``_originals`` is kept after restoring: a caller that grabbed a reference to a
    # replacement while patched still reaches torch's function through the fallback.
    for mod, name, replacement in _sites():
        if name not in _originals or getattr(mod, name) is not replacement:
            if name in _originals and getattr(mod, name) is not _originals[name]:
                log.warning(
                    "ap_bucketing: %s.%s was replaced by someone else while patched; leaving it",
                    mod.__name__,
                    name,
                )
            continue
        setattr(mod, name, _originals[name])


def _strip_tag(tag: str) -> str:
    index = tag.find(_TAG_PREFIX)
    return tag if index < 0 else tag[:index]


def _sync_cache_tag_locked(cfg: BucketingConfig | None) -> None:
    global _tag_base, _tag_applied
    cconfig: Any = torch.compiler.config
    current: str = cconfig.cache_key_tag
    if cfg is None:
        if _tag_applied is not None:
            cconfig.cache_key_tag = _tag_base if current == _tag_applied else _strip_tag(current)
        _tag_base = _tag_applied = None
        return
    if _tag_applied is None or current != _tag_applied:
        _tag_base = _strip_tag(current)
    _tag_applied = f"{_tag_base}{_TAG_PREFIX}{cfg.fingerprint()}"
    cconfig.cache_key_tag = _tag_applied


def _sync_locked() -> None:
    cfg = _scoped[-1][1] if _scoped else _installed
    if cfg is None:
        _restore_locked()
    else:
        _apply_locked()
    _sync_cache_tag_locked(cfg)


def _check(config: object, function: str) -> BucketingConfig:
    if config is None:
        return BucketingConfig()
    if not isinstance(config, BucketingConfig):
        raise ValueError(
            f"{function}: config must be a BucketingConfig, got {type(config).__name__}"
        )
    return config


def install(config: BucketingConfig | None = None) -> None:
    """Patch torch process-wide with ``config`` (default ``BucketingConfig()``) until
    ``uninstall()``. Installing again replaces the installed config; idempotent."""
    global _installed
    cfg = _check(config, "install")
    with _lock:
        _sites()  # every patch site exists, before any state changes
        _installed = cfg
        _sync_locked()


def uninstall() -> None:
    """Remove the ``install``-ed config; restore torch's exact originals once no ``patched``
    block is active either. A no-op when nothing is installed."""
    global _installed
    with _lock:
        _installed = None
        _sync_locked()


def is_installed() -> bool:
    """Whether torch's two functions are currently replaced (by ``install`` or ``patched``)."""
    return current_config() is not None


@contextlib.contextmanager
def patched(config: BucketingConfig | None = None) -> Iterator[BucketingConfig]:
    """Patch torch with ``config`` for the block; nestable (the innermost config wins and the
    outer one is back on exit) and thread-safe. Yields the active config."""
    cfg = _check(config, "patched")
    token = object()
    with _lock:
        _sites()
        _scoped.append((token, cfg))
        _sync_locked()
    try:
        yield cfg
    finally:
        with _lock:
            for index, (entry, _) in enumerate(_scoped):
                if entry is token:
                    del _scoped[index]
                    break
            _sync_locked()
