"""``precompile`` and the module it returns.

A first compilation is a function of one call signature (``_signature.CallSignature``: the
modules' train/eval flags, every input's shape and dtype, every non-tensor argument). So
:class:`PrecompiledModule` behaves like the module it wraps: a call in another mode or with
other shapes gets its own first compilation, made on first use and cached (at most
``max_signatures``; past that, an error names the argument that changed). With gradients
disabled nothing is saved for a backward, so the module itself runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ap_tags
import torch
from ap_tags.checks import require_bool, require_callable, require_instance, require_int
from torch import nn

from ap_backend._first_compilation import (
    FIRST_PARTITIONERS,
    FirstCompilation,
    FirstOptions,
    FirstPartitioner,
    default_first_partition,
)
from ap_backend._partitioners import JointPass
from ap_backend._reuse import first_compilation_or_record
from ap_backend._saved import SavedSummary
from ap_backend._signature import CallSignature, call_signature, refuse_dynamic_dims
from ap_backend._trace import PrecompileError

__all__ = ["PrecompiledModule", "precompile"]

log = logging.getLogger(__name__)

#: Default bound on first compilations per module (Dynamo's own recompile limit is 8 too).
DEFAULT_MAX_SIGNATURES = 8


class PrecompiledModule(nn.Module):
    """The module ``precompile`` returns: calls a first compilation with the wrapped module's
    parameters and buffers (in the exported order) followed by the user's arguments.
    ``module`` stays a submodule, so ``parameters()``/``state_dict()``/optimizers see the same
    (sharded) tensors.

    It behaves like the wrapped module: ``train()``/``eval()``, new shapes and new non-tensor
    arguments each get their own first compilation on first use (``compilations`` lists them,
    at most ``max_signatures``); with gradients disabled the wrapped module runs as it is.
    Under ``torch.compile`` the choice is made by a forward pre-hook that runs outside Dynamo
    (``torch.compiler.disable``), so a first compilation never happens inside a trace and
    Dynamo guards on which one the call uses.

    ``first_partition`` / ``fsdp_report`` describe the first compilation ``precompile`` made.
    """

    def __init__(self, module: nn.Module, first: FirstCompilation, options: FirstOptions) -> None:
        super().__init__()
        self.module = module
        self._options = options
        self._compilations: dict[CallSignature, FirstCompilation] = {first.signature: first}
        self._numbered: list[FirstCompilation] = [first]
        self._first = first
        #: Index into ``_numbered`` of the compilation the pre-hook chose for this call (-1:
        #: run the module itself). An int attribute of a module, so Dynamo specialises on it
        #: and guards its value: a compiled graph is reused only for the compilation it traced.
        self._active = 0
        self._lock = threading.Lock()
        choose: Callable[..., None] = torch.compiler.disable(self._choose)  # type: ignore[no-untyped-call]
        self.register_forward_pre_hook(choose, with_kwargs=True)

    @property
    def first_partition(self) -> SavedSummary:
        """What the first partition of ``precompile``'s own call saved for backward."""
        return self._first.first_partition

    @property
    def first_partitioner(self) -> FirstPartitioner:
        """Which partitioner the first compilation ran: ``"min_cut"``, ``"min_cut_fusible"`` or
        ``"default"``."""
        return self._first.partitioner

    @property
    def fsdp_report(self) -> ap_tags.FsdpTagReport:
        """The FSDP chains ap-tags found and tagged in ``precompile``'s own call."""
        return self._first.fsdp_report

    @property
    def compilations(self) -> tuple[FirstCompilation, ...]:
        """Every first compilation made so far, oldest first."""
        return tuple(self._numbered)

    @property
    def max_signatures(self) -> int:
        return self._options.max_signatures

    def _choose(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook, outside Dynamo: pick (or make) this call's first compilation."""
        chosen = self._select(args, kwargs)
        self._active = -1 if chosen is None else self._numbered.index(chosen)

    def _select(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FirstCompilation | None:
        if not torch.is_grad_enabled():
            return None
        where = "PrecompiledModule"
        refuse_dynamic_dims(
            self.module, args, kwargs, where=where, limit=self._options.max_signatures
        )
        signature = call_signature(self.module, args, kwargs)
        found = self._compilations.get(signature)
        if found is not None:
            return found
        with self._lock:
            found = self._compilations.get(signature)
            if found is not None:
                return found
            change = self._first.signature.difference(signature)
            limit = self._options.max_signatures
            if len(self._compilations) >= limit:
                raise PrecompileError(
                    f"{where}: this call needs first compilation #{len(self._compilations) + 1}"
                    f" but max_signatures={limit}: {change}. Each new train/eval mode, input "
                    "shape or non-tensor argument value is a first compilation of its own; "
                    "pad inputs to a shape already compiled, or pass precompile(..., "
                    "max_signatures=N) to allow more."
                )
            log.info(
                "%s: first compilation #%d (of at most %d) for a new call signature: %s",
                where,
                len(self._compilations) + 1,
                limit,
                change,
            )
            made = first_compilation_or_record(
                self.module, args, kwargs, self._options, where=where
            )
            self._compilations[signature] = made
            self._numbered.append(made)
            return made

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            chosen = None if self._active < 0 else self._numbered[self._active]
        else:
            chosen = self._select(args, kwargs)
        if chosen is None:
            return self.module(*args, **kwargs)
        params = [owner._parameters[name] for owner, name in chosen.param_slots]
        buffers = [owner._buffers[name] for owner, name in chosen.buffer_slots]
        return chosen.fn(*params, *buffers, *args, **kwargs)


def precompile(
    module: nn.Module,
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    reshard_after_forward: bool = True,
    joint_pass: JointPass | None = None,
    max_signatures: int = DEFAULT_MAX_SIGNATURES,
    first_partition: FirstPartitioner | None = None,
    first_compilation_cache: bool = True,
) -> PrecompiledModule:
    """Run the first compilation of ``module(*example_args, **example_kwargs)`` and return a
    module that ``torch.compile(..., backend=autoparallel_backend())`` retraces with the tags
    intact.

    The module's Python runs once more with fake tensors while ``torch.compiler.
    is_compiling()`` is True (as under ``torch.compile``); what would be a graph break there
    -- reading a tensor's value, value-dependent output shapes, ``print`` -- raises
    :class:`PrecompileError` naming the op and the source line. Dims marked dynamic
    (``torch._dynamo.mark_dynamic``) are refused: a first compilation is static, and each new
    signature (mode, shapes, non-tensor arguments) gets its own, up to ``max_signatures``.
    A token dim marked with ``ap_epchunk.mark_chunk_dim(t, d, hint=N)`` is the exception: it
    is traced as a hinted unbacked symbol, for ``autoparallel_backend(ep_chunk=...)``.

    ``joint_pass(gm, joint_inputs) -> gm`` (e.g. ``ap_tags.ac_joint_pass(...)``) runs on the
    joint graph right before the first partition, as ``torch._functorch.config.
    joint_custom_pass`` would. ``reshard_after_forward=True`` tags every FSDP all-gather chain
    MUST_RECOMPUTE (the backward re-gathers); ``False`` saves the gathered weight instead.

    ``first_partition`` picks the first compilation's partitioner, whose saved set the
    backend's save-all partitioner replays. ``None`` (default) means ``"min_cut_fusible"``, except for
    a call whose tensors carry ``ap_epchunk.mark_chunk_dim`` marks (the EP chunk route), which
    keeps ``"default"``: with min-cut's recomputation in the first backward, the chunk pass
    mis-ordered a wait on torchtitan's Qwen3-MoE with real EP (``BackendCompilerFailed``), and
    that route is measured on ``default_partition``. ``"min_cut"`` is torch's min-cut on the
    tagged joint graph, as Inductor would partition it -- at real token counts it saves no more
    than plain ``torch.compile`` and never an all-gathered weight; ``"min_cut_fusible"`` is the
    same min-cut without torch's ``ban_recompute_materialized_backward``, so a pointwise value
    a backward matmul reads (SwiGLU's product, a norm's output) is recomputed in the backward
    kernel that reads its inputs instead of saved: fewer saved bytes than plain, for one more
    write per such value in the backward; ``"default"`` is torch's
    ``default_partition`` (AutoParallel's choice), which saves every intermediate the backward
    reads. ``first_partitioner`` and the ``ap_first_partition`` artifact say which ran.

    ``first_compilation_cache`` (on by default; it acts only while Inductor's FX-graph and
    AOTAutograd caches are on): a restarted job skips its first compilations. Each call is
    keyed before anything is compiled -- a fake-tensor trace of its forward, the Python its
    backward runs (custom ``autograd.Function`` and custom op code, the files of the module's
    classes, backward hooks and the hooks the forward registers on tensors, and every file and
    global constant that code reaches by name), the module's layout, the signature, these
    options, the config and versions -- and a cold run records what its first compilation was
    under that key. A warm run that finds the record hands back a stand-in
    (``compilations[i].reused``) that makes the first compilation only if something calls it:
    the second compilation's retrace on a cache miss, or an eager call. ``False`` for code
    whose backward reads what no name resolution pins down (an object's attribute, a
    function saved on ``ctx``) or registers hooks on autograd nodes (``grad_fn.register_hook``)
    in the forward.
    """
    where = "precompile"
    require_instance(module, nn.Module, where=where, arg="module", expected="an nn.Module")
    require_instance(
        example_args, (tuple, list), where=where, arg="example_args", expected="a tuple or list"
    )
    if example_kwargs is not None:
        require_instance(
            example_kwargs, Mapping, where=where, arg="example_kwargs", expected="a mapping"
        )
    require_bool(reshard_after_forward, where=where, arg="reshard_after_forward")
    require_callable(joint_pass, where=where, arg="joint_pass", optional=True)
    require_int(max_signatures, where=where, arg="max_signatures", minimum=1)
    require_bool(first_compilation_cache, where=where, arg="first_compilation_cache")
    if first_partition is None:
        first_partition = default_first_partition(example_args, example_kwargs)
    if first_partition not in FIRST_PARTITIONERS:
        choices = " or ".join(repr(c) for c in FIRST_PARTITIONERS)
        raise ValueError(f"{where}: first_partition must be {choices}, got {first_partition!r}")
    args = tuple(example_args)
    kwargs = dict(example_kwargs or {})
    refuse_dynamic_dims(module, args, kwargs, where=where, limit=max_signatures)
    options = FirstOptions(
        reshard_after_forward, joint_pass, max_signatures, first_partition, first_compilation_cache
    )
    first = first_compilation_or_record(module, args, kwargs, options, where=where)
    log.info(
        "precompile: first partition (%s) saved %d activations (%d bytes), %d all-gather outputs",
        first.partitioner,
        first.first_partition.count,
        first.first_partition.nbytes,
        len(first.first_partition.all_gather_outputs),
    )
    return PrecompiledModule(module, first, options)
