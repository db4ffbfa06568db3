"""The torch internals ap-tags touches, looked up once and feature-detected.

Everything here is private to torch and marked ``is_backward_compatible=False`` upstream, so each
lookup fails with a message naming the supported torch range instead of an AttributeError deep
inside a pass.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx

SUPPORTED_TORCH = ">=2.13,<2.16"


class UnsupportedTorchError(RuntimeError):
    """A torch internal ap-tags relies on is missing from the installed torch."""


def _missing(what: str) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"ap-tags needs {what}, which torch {torch.__version__} does not provide; "
        f"supported torch versions: {SUPPORTED_TORCH}"
    )


def checkpoint_policy() -> Any:
    """``torch.utils.checkpoint.CheckpointPolicy`` (the enum behind ``meta['recompute']``)."""
    policy = getattr(torch.utils.checkpoint, "CheckpointPolicy", None)
    if policy is None:
        raise _missing("torch.utils.checkpoint.CheckpointPolicy")
    return policy


def require_fx_traceback(*names: str) -> None:
    """Fail clearly when one of the ``torch.fx.traceback`` helpers we use is gone."""
    for name in names:
        if not hasattr(torch.fx.traceback, name):
            raise _missing(f"torch.fx.traceback.{name}")


@functools.cache
def functional_collective_ops() -> tuple[Any, Any, Any | None]:
    """``(all_gather_into_tensor.default, wait_tensor.default, wait_tensors.default | None)``.

    Importing ``torch.distributed._functional_collectives`` registers the ``_c10d_functional``
    ops (and marks ``wait_tensor`` side-effectful). ``wait_tensors`` only exists from 2.15.
    """
    try:
        import torch.distributed._functional_collectives  # noqa: F401
    except ImportError as exc:  # pragma: no cover - torch built without distributed
        raise _missing("torch.distributed._functional_collectives") from exc
    ns = torch.ops._c10d_functional
    try:
        all_gather = ns.all_gather_into_tensor.default
        wait = ns.wait_tensor.default
    except (AttributeError, RuntimeError) as exc:
        raise _missing("torch.ops._c10d_functional.{all_gather_into_tensor,wait_tensor}") from exc
    wait_many: Any | None
    try:
        wait_many = ns.wait_tensors.default
    except (AttributeError, RuntimeError):
        wait_many = None
    return all_gather, wait, wait_many


@functools.cache
def saved_output_descriptor_types() -> tuple[type, ...]:
    """AOTAutograd's output descriptors that mark a value saved for backward.

    ``_extract_fwd_bwd_modules`` (2.13-2.15) writes the forward graph's output node
    ``meta["desc"]`` as ``fwd_outputs_descs + [SavedForBackwards(NoVcCheck)AOTOutput(i), ...]``;
    an empty tuple means the descriptors module is missing and callers fall back.
    """
    try:
        from torch._functorch._aot_autograd import descriptors
    except ImportError:
        return ()
    names = ("SavedForBackwardsAOTOutput", "SavedForBackwardsNoVcCheckAOTOutput")
    found = tuple(getattr(descriptors, n) for n in names if hasattr(descriptors, n))
    return tuple(t for t in found if isinstance(t, type))
