"""Every private torch name ap-tags uses, looked up at call time and feature-detected.

See :mod:`ap_tags.torch_support` for the convention all ap packages follow.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx

from . import torch_support

#: The torch versions ap-tags is tested on (the only place they are written).
TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")


class UnsupportedTorchError(torch_support.UnsupportedTorchError):
    """A torch internal ap-tags relies on is missing from the installed torch."""


SUPPORT = torch_support.TorchSupport("ap-tags", TESTED_TORCH, UnsupportedTorchError)


def checkpoint_policy() -> Any:
    """``torch.utils.checkpoint.CheckpointPolicy`` (the enum behind ``meta['recompute']``)."""
    return SUPPORT.attr("torch.utils.checkpoint", "CheckpointPolicy")


def require_fx_traceback(*names: str) -> None:
    """Fail clearly when one of the ``torch.fx.traceback`` helpers we use is gone."""
    SUPPORT.attrs("torch.fx.traceback", names)


@functools.cache
def tracer_copies_autograd_backward() -> bool:
    """Does the FX tracer copy ``autograd_backward`` from the node being interpreted onto the
    nodes it creates (``torch.fx.proxy``, torch 2.12+, with ``traceback._mark_autograd_backward``)?
    torch 2.11 copies ``partitioner_tag`` but not that mark."""
    return hasattr(torch.fx.traceback, "_mark_autograd_backward")


def op_overload_type() -> type:
    """``torch._ops.OpOverload``: the type of an ATen/custom op target in an FX graph."""
    op_type: type = SUPPORT.attr("torch._ops", "OpOverload")
    return op_type


def partitioners_is_rng_op() -> Any | None:
    """torch's ``partitioners.is_rng_op`` (``torch._functorch.partitioners``, 2.14+: is this
    node's seeded nondeterminism not statically ruled out?), or None on a torch that predates
    it (2.11-2.13)."""
    return getattr(SUPPORT.module("torch._functorch.partitioners"), "is_rng_op", None)


@functools.cache
def functional_collective_ops() -> tuple[Any, Any, Any | None]:
    """``(all_gather_into_tensor.default, wait_tensor.default, wait_tensors.default | None)``.

    Importing ``torch.distributed._functional_collectives`` registers the ``_c10d_functional``
    ops (and marks ``wait_tensor`` side-effectful). ``wait_tensors`` only exists from 2.15.
    """
    SUPPORT.module("torch.distributed._functional_collectives")
    ns = torch.ops._c10d_functional
    try:
        all_gather = ns.all_gather_into_tensor.default
        wait = ns.wait_tensor.default
    except (AttributeError, RuntimeError) as exc:
        raise SUPPORT.missing(
            "torch.ops._c10d_functional.{all_gather_into_tensor,wait_tensor}"
        ) from exc
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
        descriptors = SUPPORT.module("torch._functorch._aot_autograd.descriptors")
    except UnsupportedTorchError:
        return ()
    names = ("SavedForBackwardsAOTOutput", "SavedForBackwardsNoVcCheckAOTOutput")
    found = tuple(getattr(descriptors, n) for n in names if hasattr(descriptors, n))
    return tuple(t for t in found if isinstance(t, type))


def input_mutation_output_type() -> type | None:
    """AOTAutograd's output descriptor for an input's new value (``InputMutationAOTOutput``,
    2.13-2.15: a buffer the forward updates, e.g. batch norm's running statistics, returned for
    the runtime to write back); None when the descriptors module is missing."""
    try:
        descriptors = SUPPORT.module("torch._functorch._aot_autograd.descriptors")
    except UnsupportedTorchError:
        return None
    found = getattr(descriptors, "InputMutationAOTOutput", None)
    return found if isinstance(found, type) else None


def symint_hint(value: torch.SymInt) -> int | None:
    """A concrete int for ``value`` from hints only (see ``ap_tags.graph.size_hint``).

    torch's ``optimization_hint`` (2.13+) answers for backed symbols and for unbacked ones marked with
    ``hint_override``, but invents a heuristic value (8192) for an unbacked symbol nobody
    hinted; such an expression is reported as unknown instead. The ShapeEnv tables are
    ``backed_var_to_val`` from 2.15 and ``var_to_val`` before.
    """
    if value.node.hint is not None:
        return int(value.node.hint)
    env: Any = value.node.shape_env
    if env is None:
        return None
    backed = getattr(env, "backed_var_to_val", None)
    if backed is None:
        backed = getattr(env, "var_to_val", {})
    overrides = getattr(env, "var_to_hint_override", {})
    expr = value.node.expr.xreplace(env.replacements)
    if any(s not in backed and s not in overrides for s in expr.free_symbols):
        return None
    shapes = SUPPORT.module("torch.fx.experimental.symbolic_shapes")
    hint = getattr(shapes, "optimization_hint", None)
    if hint is not None:
        return int(hint(value))
    # 2.11/2.12 have no optimization_hint: every free symbol has a value here (checked above),
    # so substituting them is what 2.13+'s optimization_hint computes.
    try:
        return int(expr.xreplace({**backed, **overrides}))
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def _scalar_outputs_allowed(fake_mode: Any) -> Iterator[None]:
    old = fake_mode.allow_scalar_outputs
    fake_mode.allow_scalar_outputs = True
    try:
        yield
    finally:
        fake_mode.allow_scalar_outputs = old


def fake_mode_of(values: Sequence[Any]) -> Any | None:
    """The fake mode a trace over ``values`` runs in (its TracingContext's, else the one active
    or under the values), or None."""
    return SUPPORT.attr("torch._guards", "detect_fake_mode")(list(values))


def scalar_outputs_allowed(values: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """``FakeTensorMode.allow_scalar_outputs`` set on the fake mode of ``values`` within the
    block, restored on exit (nothing when there is no fake mode with a shape env)."""
    fake_mode = fake_mode_of(values)
    if fake_mode is None or fake_mode.shape_env is None:
        return contextlib.nullcontext()
    return _scalar_outputs_allowed(fake_mode)


def aot_input_index(node: torch.fx.Node, *, through_subclasses: bool) -> int | None:
    """``i`` when placeholder ``node``'s AOTAutograd descriptor (``meta["desc"]``) is
    ``PlainAOTInput(idx=i)`` -- or, with ``through_subclasses``, the inner tensor of such an
    input (``SubclassGetAttrAOTInput`` followed to its base); else None."""
    desc = node.meta.get("desc")
    if desc is None:
        return None
    descriptors: Any = SUPPORT.attrs(
        "torch._functorch._aot_autograd.descriptors",
        ("PlainAOTInput", "SubclassGetAttrAOTInput"),
    )
    while through_subclasses and isinstance(desc, descriptors.SubclassGetAttrAOTInput):
        desc = desc.base
    return int(desc.idx) if isinstance(desc, descriptors.PlainAOTInput) else None


def replay_scope(args: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """The scope in which a recorded graph is re-executed on fake tensors (a later trace
    running the first compilation's forward/backward graphs).

    * Its data-dependent reads (``_local_scalar_dense``: ``.tolist()`` split sizes) are allowed
      to produce unbacked symbols, as they did when the graph was recorded, whether or not the
      tracer that runs it (Dynamo) was configured with ``capture_scalar_outputs``: the graph
      was already accepted with them, and the user wrote no new read.
    * Where the graph runs as one opaque call (no ``make_fx`` proxy mode on the stack: Dynamo
      running a ``nonstrict_trace``'d function for its example outputs) the symbols those reads
      create are internal to the call and never reach its outputs, so the run ignores them as
      AOTAutograd's own metadata pass does (``ShapeEnv.ignore_fresh_unbacked_symbols``);
      otherwise the caller fails with "pending unbacked symbols not in returned outputs".
      Under a proxy mode each op is recorded and binds its own symbols.
    """
    fake_mode = fake_mode_of(args)
    if fake_mode is None or fake_mode.shape_env is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(_scalar_outputs_allowed(fake_mode))
    proxy_tensor: Any = SUPPORT.attrs("torch.fx.experimental.proxy_tensor", ("get_proxy_mode",))
    if proxy_tensor.get_proxy_mode() is None:
        stack.enter_context(fake_mode.shape_env.ignore_fresh_unbacked_symbols())
    return stack
