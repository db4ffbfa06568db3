"""Inductor's, functorch's and Dynamo's config: scoped patches, snapshots a cache key
covers, and the cache switches a warm start reads.

Part of the compat seam (:mod:`ap_backend._compat`): every private torch name is looked up
at call time through ``SUPPORT``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ._support import SUPPORT

_INDUCTOR_CONFIG = "torch._inductor.config"
_FUNCTORCH_CONFIG = "torch._functorch.config"

# --------------------------------------------------------------------------- config scopes


def inductor_config_patch(changes: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """``torch._inductor.config.patch(changes)``: set for the block, restored on exit."""
    config: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("patch",))
    patch: contextlib.AbstractContextManager[Any] = config.patch(changes)
    return patch


def functorch_config_patch(changes: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """``torch._functorch.config.patch(changes)``: set for the block, restored on exit."""
    config: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("patch",))
    patch: contextlib.AbstractContextManager[Any] = config.patch(changes)
    return patch


def dynamo_config_patch(changes: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """``torch._dynamo.config.patch(changes)``: set for the block, restored on exit."""
    config: Any = SUPPORT.attrs("torch._dynamo.config", ("patch",))
    patch: contextlib.AbstractContextManager[Any] = config.patch(changes)
    return patch


# --------------------------------------------------------------------------- first compilation records


def portable_configs() -> tuple[dict[str, Any], dict[str, Any]]:
    """``save_config_portable()`` of Inductor's and functorch's config: the settings a cache
    key may cover (torch's own AOTAutograd cache keys on the same)."""
    inductor: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("save_config_portable",))
    functorch: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("save_config_portable",))
    return inductor.save_config_portable(), functorch.save_config_portable()


def config_snapshot() -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_config_copy()`` of Inductor's and functorch's config."""
    inductor: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("get_config_copy",))
    functorch: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("get_config_copy",))
    return inductor.get_config_copy(), functorch.get_config_copy()


@contextlib.contextmanager
def configs_as(snapshot: tuple[dict[str, Any], dict[str, Any]]) -> Any:
    """Inductor's and functorch's config set back to ``snapshot`` (:func:`config_snapshot`)
    for the block: only the entries that differ are patched, restored on exit."""
    inductor: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("get_config_copy",))
    functorch: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("get_config_copy",))
    now_i, now_f = inductor.get_config_copy(), functorch.get_config_copy()
    then_i, then_f = snapshot
    with (
        inductor_config_patch(_changed(now_i, then_i)),
        functorch_config_patch(_changed(now_f, then_f)),
    ):
        yield


def _changed(now: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``then`` whose value ``now`` no longer has."""
    changed = {}
    for key, value in then.items():
        try:
            same = bool(now.get(key) == value)
        except Exception:  # a value without a plain equality
            same = now.get(key) is value
        if not same:
            changed[key] = value
    return changed


def caches_on() -> bool:
    """Are Inductor's FX-graph cache and AOTAutograd's cache both on (what a warm start
    needs: the second compilation served from them)?"""
    inductor: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("fx_graph_cache", "force_disable_caches"))
    functorch: Any = SUPPORT.attrs(_FUNCTORCH_CONFIG, ("enable_autograd_cache",))
    return bool(
        inductor.fx_graph_cache
        and functorch.enable_autograd_cache
        and not inductor.force_disable_caches
    )


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    fn: Callable[[], str] = SUPPORT.attr("torch._inductor.runtime.cache_dir_utils", "cache_dir")
    return fn()


def inductor_has_option(dotted: str) -> bool:
    """``torch._inductor.config`` has the option ``dotted`` (``"aten_distributed_optimizations.
    compute_estimator"``: 2.12+; 2.11's overlap scheduler has no compute estimator choice)."""
    node: Any = SUPPORT.module(_INDUCTOR_CONFIG)
    for part in dotted.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def marked_cacheable_functions() -> dict[str, str]:
    """``torch._inductor.config.unsafe_marked_cacheable_functions``: function name -> the
    string AOTAutograd's cache key carries for it (the config is part of the key)."""
    config: Any = SUPPORT.attrs(_INDUCTOR_CONFIG, ("unsafe_marked_cacheable_functions",))
    return dict(config.unsafe_marked_cacheable_functions)
