"""The seam's shared pieces: the tested torch versions, this package's
``UnsupportedTorchError``, the newer-torch message, and the two lookups (``module``, ``attr``)
every other module of :mod:`ap_bucketing._compat` goes through."""

from __future__ import annotations

import importlib
import re
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from torch._inductor.custom_graph_pass import CustomGraphPass as CustomGraphPass
    from torch.utils._ordered_set import OrderedSet as OrderedSet

TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
PACKAGE = "ap-bucketing"

#: The two patch sites (``install``/``patched``) and the overlap scheduler.
FSDP_MODULE = "torch._inductor.fx_passes.fsdp"
BUCKETING_MODULE = "torch._inductor.fx_passes.bucketing"
OVERLAP_MODULE = "torch._inductor.fx_passes.overlap_scheduling"

T = TypeVar("T")
_ABSENT = object()


class UnsupportedTorchError(RuntimeError):
    """The installed torch lacks (or changed) an internal ap-bucketing needs.

    ``package``, ``internal`` and ``tested`` name the package, the internal and the torch
    versions it is tested on; the message says the same in one line.
    """

    def __init__(self, package: str, internal: str, tested: tuple[str, ...]) -> None:
        self.package, self.internal, self.tested = package, internal, tested
        super().__init__(
            f"{package} needs {internal}, which torch {torch.__version__} does not provide "
            f"(tested torch versions: {', '.join(tested)})"
        )


def missing(internal: str) -> UnsupportedTorchError:
    """This package's error for a missing ``internal`` (raise it)."""
    return UnsupportedTorchError(PACKAGE, internal, TESTED_TORCH)


def _series(version: str) -> tuple[int, ...]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return tuple(map(int, found.groups())) if found else ()


def untested_message(package: str, tested: tuple[str, ...], version: str) -> str | None:
    """The convention's newer-torch warning: only when ``version``'s major.minor is newer than
    every tested one (a nightly of the next release, not a patch release of a tested one)."""
    current = _series(version)
    if not current or any(current <= _series(v) for v in tested):
        return None
    return (
        f"{package} is tested on torch {', '.join(tested)}; torch {version} is newer. A torch "
        f"internal {package} needs that is missing or changed raises its UnsupportedTorchError "
        "naming the internal"
    )


def module(name: str) -> ModuleType:
    """Import torch internal module ``name`` or raise the package's error naming it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise missing(name) from exc


def attr(module_name: str, name: str) -> Any:
    """``module_name.name`` or the package's error naming it."""
    found = getattr(module(module_name), name, _ABSENT)
    if found is _ABSENT:
        raise missing(f"{module_name}.{name}")
    return found


def _custom_graph_pass() -> Any:
    return attr("torch._inductor.custom_graph_pass", "CustomGraphPass")


if not TYPE_CHECKING:
    # The one lookup made at import time: a class's base must exist when the class is defined
    # (``OverlapBucketingPass``). Inductor keys its FX-graph cache on ``uuid()`` only for
    # instances of this class, so the pass must derive from it.
    CustomGraphPass = _custom_graph_pass()
