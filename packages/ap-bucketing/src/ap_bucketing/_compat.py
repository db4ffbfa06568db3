"""Feature-detected access to the torch internals this package touches.

Every private torch symbol the package needs is looked up here, once, at call time (never at
import), so a torch that lacks one fails with a message naming the symbol and the supported
range instead of an AttributeError deep inside a compile.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

SUPPORTED_TORCH = ">=2.13,<2.16"

FSDP_MODULE = "torch._inductor.fx_passes.fsdp"
BUCKETING_MODULE = "torch._inductor.fx_passes.bucketing"
OVERLAP_MODULE = "torch._inductor.fx_passes.overlap_scheduling"


class UnsupportedTorchError(RuntimeError):
    """A torch internal that ap-bucketing relies on is missing from the installed torch."""


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch, ignoring local/dev suffixes."""
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def module(name: str) -> ModuleType:
    """Import a torch internal module or fail naming it and the supported range."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # pragma: no cover - depends on the installed torch
        raise UnsupportedTorchError(
            f"ap-bucketing needs {name}, which torch {torch.__version__} does not provide "
            f"(supported torch {SUPPORTED_TORCH})"
        ) from exc


def attr(module_name: str, name: str) -> Any:
    """Fetch ``module_name.name`` or fail naming it and the supported range."""
    mod = module(module_name)
    if not hasattr(mod, name):
        raise UnsupportedTorchError(
            f"ap-bucketing needs {module_name}.{name}, which torch {torch.__version__} does "
            f"not provide (supported torch {SUPPORTED_TORCH})"
        )
    return getattr(mod, name)


def wait_tensor_op() -> Any:
    """The functional ``wait_tensor`` overload every bucketing predicate keys on."""
    return torch.ops._c10d_functional.wait_tensor.default
