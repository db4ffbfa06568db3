"""The first compilation: export the joint graph, tag it, partition it, and hand back a module
that a second ``torch.compile`` can retrace with the tags intact.

Why this shape: the first partition's decisions (FSDP all-gathers recomputed, everything else
as the first partitioner saved it) must survive into the second compile.

Which first partitioner (``first_partition=``): torch's min-cut, as Inductor would partition the
same tagged graph -- it honours the FSDP ``MUST_RECOMPUTE`` chains and the AC joint pass's tags,
and recomputes cheap pointwise work inside the backward's kernels instead of saving it. At the
token counts people train with (activations outweighing the gathered weights) that is what
keeps the replay at or under plain ``torch.compile``'s saved bytes. The default,
``"min_cut_fusible"``, is that min-cut with torch's ``ban_recompute_materialized_backward``
off, the next tier torch's own activation-memory-budget solver tries: a pointwise value the
backward reads through a matmul (SwiGLU's ``silu(w1 x) * w3 x``, a norm's output) is recomputed
there, fused into the kernel that already reads its inputs, instead of saved (``"min_cut"``
keeps the ban; see :func:`default_first_partition`).
``"default"`` is torch's ``default_partition`` (AutoParallel's ``apply_placement`` choice),
which saves every intermediate the backward reads: smaller only where few tokens meet large
weights. The replay is exact against whichever ran (the recomputed ops are in the first
backward graph, so the retrace puts them in the second joint's backward). ap-tags'
``preserve_meta_compiler`` runs the partitioned graphs through an FX interpreter under
``preserve_node_meta``; the callable returned by ``aot_compile_joint_with_descriptors`` is
``nonstrict_trace``'d, so Dynamo does not inline it and AOTAutograd re-executes those
interpreters while tracing, copying ``custom``/``recompute`` onto every retraced node.

:mod:`ap_backend._precompile` wraps it in the module users call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import ap_epchunk
import ap_tags
import torch.fx
from torch import nn

from ap_backend import _compat
from ap_backend._aot_cache import (
    Unkeyable,
    first_compilation_key,
    graphs_digest,
    stamp_first_compilation,
)
from ap_backend._artifacts import emit_json
from ap_backend._partitioners import JointPass, partitioning
from ap_backend._rounding import clear_kept_bans, keep_ban_on_rounded_values
from ap_backend._saved import SavedSummary, summarize_forward_saves
from ap_backend._signature import CallSignature, call_signature, subclass_key
from ap_backend._trace import (
    reshape_views,
    tracing_like_compile,
    translate_trace_error,
)

__all__ = [
    "FIRST_PARTITIONERS",
    "FirstCompilation",
    "FirstOptions",
    "FirstPartitioner",
    "default_first_partition",
    "first_compilation",
    "slots",
]

log = logging.getLogger(__name__)

Slot = tuple[nn.Module, str]

#: The first compilation's partitioner: torch's min-cut (default) or its ``default_partition``.
FirstPartitioner: TypeAlias = Literal["min_cut", "min_cut_fusible", "default"]
FIRST_PARTITIONERS: tuple[FirstPartitioner, ...] = ("min_cut", "min_cut_fusible", "default")
#: torch's min-cut options each min-cut first partitioner runs with (``torch._functorch.config``)
_MIN_CUT_CONFIG: dict[FirstPartitioner, dict[str, bool]] = {
    "min_cut": {},
    # torch bans recomputing a value the backward must materialize (an input of a matmul there):
    # recomputing it is "never free". It costs one write in a kernel the backward runs anyway,
    # and saves the value's bytes from the forward to its use (issue 42: torchtitan Llama3 at
    # 4 layers / seq 1024, 0.94x plain's peak with the ban, 0.81x without).
    "min_cut_fusible": {"ban_recompute_materialized_backward": False},
}


@dataclass(frozen=True)
class FirstCompilation:
    """One first compilation: the call signature it is specialised to, which partitioner ran
    (``partitioner``: ``"min_cut"``, ``"min_cut_fusible"`` or ``"default"``), what its
    partition saved for backward (``first_partition``), the FSDP chains ap-tags tagged
    (``fsdp_report``) and how long it took.

    ``reused``: taken from the record a cold run of the same program left
    (:mod:`ap_backend._first_record`); ``fn`` then makes the first compilation on its first call
    only -- which a second compilation served from AOTAutograd's cache never makes."""

    signature: CallSignature
    first_partition: SavedSummary
    fsdp_report: ap_tags.FsdpTagReport
    seconds: float
    fn: Callable[..., Any] = field(repr=False, compare=False)
    param_slots: tuple[Slot, ...] = field(repr=False, compare=False)
    buffer_slots: tuple[Slot, ...] = field(repr=False, compare=False)
    partitioner: FirstPartitioner = "min_cut"
    param_fqns: tuple[str, ...] = field(default=(), repr=False, compare=False)
    buffer_fqns: tuple[str, ...] = field(default=(), repr=False, compare=False)
    reused: bool = False


def _store(owner: nn.Module, kind: str) -> dict[str, Any]:
    """Where ``owner`` keeps its own parameters or buffers (not what ``getattr`` returns)."""
    store: dict[str, Any] = owner._parameters if kind == "parameter" else owner._buffers
    return store


def slots(module: nn.Module, fqns: Sequence[str], kind: str) -> tuple[Slot, ...]:
    """``(owning submodule, local name)`` for each exported parameter/buffer FQN.

    The value is read from the owner's ``_parameters``/``_buffers`` at every call, never with
    ``getattr``: a parametrized module (torchtitan's SimpleFSDP, ``torch.nn.utils.
    parametrize``) exposes its parameter's *name* as a property computing something else (the
    all-gathered weight), while the export lifted the stored parameter itself."""
    slots = []
    for fqn in fqns:
        owner_name, _, local = fqn.rpartition(".")
        owner = module.get_submodule(owner_name)
        store = _store(owner, kind)
        if local not in store:
            raise RuntimeError(
                f"precompile: exported {kind} {fqn!r} is not a registered {kind} of "
                f"{type(owner).__name__}"
            )
        slots.append((owner, local))
    return tuple(slots)


def _subclass_state(fqns: Sequence[str], slots: Sequence[Slot], kind: str) -> tuple[Any, ...]:
    """``(fqn, subclass key)`` of each exported parameter or buffer that is a tensor subclass
    (SimpleFSDP's DTensor parameters): part of the first compilation's cache key, because the
    runtime wrappers that rebuild its gradients as DTensors hold their placements and the
    graphs do not (:func:`~ap_backend._signature.subclass_key`)."""
    keys = []
    for fqn, (owner, local) in zip(fqns, slots, strict=True):
        value = _store(owner, kind)[local]
        if isinstance(value, torch.Tensor):
            key = subclass_key(value)
            if key:
                keys.append((fqn, key))
    return tuple(keys)


def _recording_partition(
    sink: list[SavedSummary],
    digests: list[str | None],
    which: FirstPartitioner,
    joint: torch.fx.GraphModule,
    joint_inputs: Any,
    **kwargs: Any,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The first compilation's partitioner, measured. Min-cut partitions as Inductor's own
    ``partition_fn`` does: after Inductor's joint-graph passes, with ``compiler="inductor"``
    (the second compilation is Inductor's, so what it deems cheap to recompute is what
    Inductor fuses into the backward's kernels). Without the joint-graph passes the first
    partition saved what they rewrite away (HF GPT-2 / Llama computing their own loss: 16 B
    more than the backend's min-cut on the same tagged graph)."""
    kwargs.pop("compiler", None)
    # torch < 2.14: AC-recomputed zero-dropout SDPA is not random (see _compat)
    with _compat.FIRST_PARTITION_RNG_RULE:
        if which in _MIN_CUT_CONFIG:
            joint = _compat.inductor_joint_graph_passes(joint, joint_inputs)
            if which == "min_cut_fusible":
                kept = keep_ban_on_rounded_values(joint)
                if kept:
                    log.info(
                        "precompile: %d value(s) round through low precision and keep "
                        "torch's ban on recomputing them: %s",
                        len(kept),
                        kept,
                    )
            try:
                with _compat.functorch_config_patch(_MIN_CUT_CONFIG[which]):
                    fw, bw = _compat.min_cut_partition()(
                        joint, joint_inputs, compiler="inductor", **kwargs
                    )
            finally:
                clear_kept_bans(joint)
            clear_kept_bans(fw, bw)
        else:
            fw, bw = _compat.default_partition()(joint, joint_inputs, **kwargs)
    sink.append(summarize_forward_saves(fw, int(kwargs["num_fwd_outputs"])))
    try:  # before the compilers tag them: the second compilation's AOTAutograd cache key
        digests.append(graphs_digest((fw, bw)))
    except (Unkeyable, _compat.UnsupportedTorchError) as exc:
        log.info("precompile: the second compilation bypasses AOTAutograd's cache: %s", exc)
        digests.append(None)
    return fw, bw


def default_first_partition(
    args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> FirstPartitioner:
    """``first_partition=None``: min-cut without torch's ban on recomputing what a backward
    matmul reads (``"min_cut_fusible"``), unless an input tensor carries a chunk-dim mark (the
    EP chunk route, which is built and measured on ``default_partition``'s backward; see
    :func:`precompile`).

    Why fusible: with the ban, min-cut saves every pointwise value a backward matmul reads
    (SwiGLU's product, a norm's output), so on torchtitan's Llama3 (4 layers, seq 1024) the
    replay held 0.93x plain's peak; without it, 0.80x, and 0.38x against 0.57x on the kit at dim
    1024 -- for one more write per such value in a backward kernel that reads its inputs anyway
    (docs/architecture.md, "Why the first partition is min-cut without the ban")."""
    values = [*args, *(kwargs or {}).values()]
    marked = any(isinstance(v, torch.Tensor) and ap_epchunk.chunk_dims_of(v) for v in values)
    return "default" if marked else "min_cut_fusible"


def _retraceable(compiler: Callable[..., Any], backward: bool = False) -> Callable[..., Any]:
    """``compiler`` after :func:`~ap_backend._trace.reshape_views` (see ``_trace``); for the
    backward also after ``ap_epchunk.tag_recomputed_module_fqns`` (the forward ops AC made the
    partition recompute there belong to their module's backward region in ``ep_chunk``)."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        reshape_views(gm)
        if backward:
            ap_epchunk.tag_recomputed_module_fqns(gm.graph)
        return compiler(gm, example_inputs)

    return compile_graph


def _first_decompositions(partitioner: FirstPartitioner) -> dict[Any, Any] | None:
    """The decompositions the first compilation traces with: Inductor's for min-cut, none for
    ``default_partition``.

    Why: min-cut chooses what to save by the ops it sees. Traced without Inductor's
    decompositions, the first partition saw composite ops (a norm, a softmax) whole, where the
    backend's Inductor compile sees their pointwise parts and recomputes the cheap ones; the
    replay then saved 8.6% more than Inductor's own min-cut on the same tagged graph (model kit,
    dim 256, seq 512, batch 2, bf16 gathers, fake PG 8: 26,267,652 B against 24,178,692 B).
    Traced with them, the two are the same set, and the replay of it is exact
    (``ap_tags.unmark_forward_graph``, ``ap_tags.graph.is_pass_created``).
    ``default_partition`` (AutoParallel's choice, and the EP chunk route's) keeps the graph as
    exported: its saves do not depend on granularity the way min-cut's do, and the chunk pass's
    region rules were written against it.
    """
    return _compat.inductor_decompositions() if partitioner in _MIN_CUT_CONFIG else None


@dataclass(frozen=True)
class FirstOptions:
    """What ``precompile`` was asked for, kept for every later first compilation of the same
    module (a new call signature is compiled the same way)."""

    reshard_after_forward: bool
    joint_pass: JointPass | None
    max_signatures: int
    first_partition: FirstPartitioner = "min_cut"
    #: Reuse the record of a cold run of the same program (``ap_backend._reuse``).
    first_compilation_cache: bool = True


def first_compilation(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: FirstOptions,
    *,
    where: str,
) -> FirstCompilation:
    """Export, tag, partition and wrap one call signature of ``module``."""
    signature = call_signature(module, args, kwargs)
    export_joint, compile_joint = _compat.joint_export_api()
    summaries: list[SavedSummary] = []
    digests: list[str | None] = []
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(ap_tags.annotate_module_fqns(module))
        try:
            # static sizes, but a shape environment for .tolist()/.item() reads; a chunk dim marked
            # with a hint becomes an unbacked symbol (see ap_epchunk.fake_chunk_inputs)
            fake_args, fake_kwargs = ap_epchunk.fake_chunk_inputs(
                (args, kwargs), _compat.fake_mode_with_shape_env()
            )
            with tracing_like_compile():
                jd = export_joint(
                    stack,
                    module,
                    fake_args,
                    fake_kwargs or None,
                    decompositions=_first_decompositions(options.first_partition),
                )
        except Exception as exc:
            translated = translate_trace_error(exc, where=where)
            if translated is None:
                raise
            raise translated from exc
        # ep_chunk finds backward regions by this tag in the second compilation
        ap_epchunk.tag_backward_module_fqns(jd.graph_module.graph)
        fsdp_report = ap_tags.mark_fsdp_all_gather_recomputation(
            jd.graph_module.graph, reshard_after_forward=options.reshard_after_forward
        )
        # nothing caches this compile: its graphs' text is made only for a log or trace
        _compat.unprinted_joint_compile(jd)
        with partitioning(None, options.joint_pass):
            compiled_fn = compile_joint(
                jd,
                partition_fn=functools.partial(
                    _recording_partition, summaries, digests, options.first_partition
                ),
                fw_compiler=_retraceable(ap_tags.preserve_meta_compiler(tag_forward=True)),
                bw_compiler=_retraceable(
                    ap_tags.preserve_meta_compiler(tag_forward=False), backward=True
                ),
            )
    if len(summaries) != 1:
        raise RuntimeError(
            f"{where}: expected one joint partition, saw {len(summaries)} (does the module's "
            "output require grad?)"
        )
    summary = summaries[0]
    param_slots = slots(module, jd.params_spec, "parameter")
    buffer_slots = slots(module, jd.buffers_spec, "buffer")
    if digests[0] is not None:
        # AOTAutograd's cache keys the second compilation's call of this one by its content
        key = first_compilation_key(
            digests[0],
            signature.modes,
            str(signature.spec),
            signature.leaves,
            options.first_partition,
            options.reshard_after_forward,
            _subclass_state(jd.params_spec, param_slots, "parameter"),
            _subclass_state(jd.buffers_spec, buffer_slots, "buffer"),
        )
        stamp_first_compilation(compiled_fn, key)
    emit_json("ap_first_partition", {"partitioner": options.first_partition, **summary.to_dict()})
    return FirstCompilation(
        signature=signature,
        first_partition=summary,
        fsdp_report=fsdp_report,
        seconds=time.perf_counter() - start,
        partitioner=options.first_partition,
        fn=compiled_fn,
        param_slots=param_slots,
        buffer_slots=buffer_slots,
        param_fqns=tuple(jd.params_spec),
        buffer_fqns=tuple(jd.buffers_spec),
    )
