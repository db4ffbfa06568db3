"""``autoparallel_backend``: Inductor with the ap passes composed around it.

Every torch setting the backend touches is scoped (``docs/architecture.md``, "Backend scopes"),
and each scope is where it is for a reason:

* The partitioner (``custom_partitioner_fn``), the joint pass (AC staging + EP chunking,
  through ``torch._functorch.config.joint_custom_pass``) and ``wait_tensor_dce()`` are needed
  only while AOTAutograd splits the joint graph, which happens synchronously inside
  ``compile_fx`` -- so one ``with partitioning(...)`` around the call is enough, and nothing
  outlives it, not even when the compile raises.
* Overlap scheduling and bucketing must also reach the *backward*, which AOTAutograd compiles
  lazily on the first ``.backward()``, after this backend returned. Their settings therefore
  go through ``compile_fx(config_patches=...)``, which compile_fx re-applies around every
  ``inner_compile``. With bucketing that is ap-bucketing's ``OverlapBucketingPass``, which
  enters ap-bucketing's torch patch and CPU estimators itself each time it runs; without, our
  ``inner_compile`` wrapper enters the CPU estimators for torch's overlap scheduler -- for the
  forward and the lazy backward alike.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import ap_bucketing
import ap_epchunk
import ap_tags
import torch.fx
from ap_tags.checks import require_graph_module, require_instance
from ap_tags.tracing import aot_input_index, scalar_outputs_allowed

from ap_backend import _compat
from ap_backend._aot_cache import first_compilation_calls_cacheable, key_first_compilation_calls
from ap_backend._artifacts import emit_json, emit_string
from ap_backend._options import BackendOptions, validate_options
from ap_backend._overlap import has_gpu, overlap_config_patches
from ap_backend._partitioners import MeasuringPartitioner, make_partitioner, partitioning
from ap_backend._saved import SavedSummary

__all__ = ["AutoParallelBackend", "autoparallel_backend"]


log = logging.getLogger(__name__)


def collective_counts(graph: torch.fx.Graph) -> dict[str, int]:
    """How many of each functional collective (``_c10d_functional.<name>``, waits excluded)
    ``graph`` issues, by op name: what a partitioned graph hands Inductor, before its post-grad
    passes (bucketing) merge any."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        namespace, _, rest = str(node.target).partition(".")
        name = rest.split(".")[0]
        if namespace == "_c10d_functional" and name != "wait_tensor":
            counts[name] = counts.get(name, 0) + 1
    return counts


def described_input_count(graph: torch.fx.Graph) -> int | None:
    """How many flat arguments of the compiled function ``graph``'s placeholders stand for
    (``ap_tags.tracing.aot_input_index``, a tensor subclass's inner tensors counted as their
    argument), or None for a graph without descriptors.

    Why: AOTAutograd partitions the body of a nested compiled region (``invoke_subgraph``, e.g.
    an attention block a library marks for reuse) as a joint graph of its own, through the same
    joint pass as the graph Dynamo handed the backend; its placeholders stand for the region's
    arguments, not for the compiled graph's inputs."""
    placeholders = [p for p in graph.find_nodes(op="placeholder") if p.meta.get("desc") is not None]
    if not placeholders:
        return None
    indices = {aot_input_index(p, through_subclasses=True) for p in placeholders}
    indices.discard(None)
    return len(indices)


def _joint_key(options: BackendOptions) -> str:
    """What identifies the backend's joint pass, for its partitioner's cache key (see
    :class:`~ap_backend._partitioners.MeasuringPartitioner`): the AC and EP-chunk options, and
    the code of the packages that run them (a changed pass must not be served its old graph).
    Empty when no joint pass runs."""
    if not options.enable_ac and options.ep_chunk is None:
        return ""
    packages = [ap_tags] if options.enable_ac else []
    if options.ep_chunk is not None:
        packages.append(ap_epchunk)
    code = _compat.hash_package_sources(packages).hex()
    return repr((options.enable_ac, options.ac_stage_size_gib, options.ep_chunk, code))


def retraces_first_compilation(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo's graph ``gm`` calls a ``nonstrict_trace``'d function (how
    ``PrecompiledModule`` calls its first compilation): only then does its backward carry the
    module FQNs the first compilation stamped, and only then is their absence a loss."""
    return any(
        node.op == "call_function" and _compat.is_nonstrict_capture(node.target)
        for node in gm.graph.nodes
    )


#: Inductor config under AC (``enable_ac=True``). Why no buffer reuse: Inductor's wrapper keeps
#: a freed buffer for a later allocation of the same size whenever its own peak estimate allows,
#: and AC's recomputation makes every layer's buffers the same sizes -- so the last layer's
#: feed-forward buffers stayed allocated through its attention backward, to be reused by the
#: next layer's feed-forward. The estimate cannot see an extern kernel's workspace (the SDPA
#: backward's) or the buckets prefetched there, so the held buffers landed on the real peak:
#: model kit dim 256 / 2 layers / seq 512, fake PG 8, full configuration with the prefetch
#: schedule, 20,540,040 B with reuse and 16,061,960 B without (plain 29.5 MB either way; the
#: default, without AC, the same bytes either way). Freed buffers go back to the allocator
#: (a GPU's caching allocator hands them out again without a device call).
AC_INDUCTOR_PATCHES: dict[str, Any] = {"allow_buffer_reuse": False}


class AutoParallelBackend:
    """The callable returned by :func:`autoparallel_backend`. Besides compiling, it keeps what
    each compile decided, so tests and the demo read results without monkeypatching:

    * ``saved``: one :class:`SavedSummary` per joint partition (same measure as precompile's);
    * ``partition_reports``: ap-partitioner's reports;
    * ``bucketing_stats``: ap-bucketing's stats, forward and backward;
    * ``chunk_reports``: ap-epchunk's reports (one per chunked joint graph);
    * ``schedule_reports``: ap-epchunk's overlap-schedule reports (one per chunked joint graph
      whose ``ChunkConfig.schedule_overlap`` is on);
    * ``lane_reports``: ap-epchunk's exchange-lane reports (``ChunkConfig.exchange_lane``);
    * ``compile_seconds``: wall time of each backend call (forward + joint partition);
    * ``inner_compiles``: per graph handed to Inductor, ``is_backward``, ``collectives``
      (:func:`collective_counts` of the partitioned graph) and ``module_fqns_lost`` (how many
      of a retraced first compilation's backward collectives arrived without their stamped
      module FQN; logged as a warning).

    A compile served from Inductor's caches records less: an AOTAutograd cache hit (a restarted
    job, caches on) runs no partitioner and no pass, so these lists stay empty; an FX-graph
    cache hit runs the partitioner but not the post-grad passes (no ``bucketing_stats``).
    """

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.saved: list[SavedSummary] = []
        self.partition_reports: list[Any] = []
        self.bucketing_stats: list[Any] = []
        self.chunk_reports: list[Any] = []
        self.schedule_reports: list[Any] = []
        self.lane_reports: list[Any] = []
        self.compile_seconds: list[float] = []
        self.inner_compiles: list[dict[str, Any]] = []
        self._partitioner = MeasuringPartitioner(
            make_partitioner(
                options.partitioner, self._on_partition_report, options.activation_budget_bytes
            ),
            self._on_saved,
            joint_key=_joint_key(options),
        )
        self._persistent_patches = self._config_patches()
        self._ac_pass = (
            ap_tags.ac_joint_pass(options.ac_stage_size_gib) if options.enable_ac else None
        )

    # -- callbacks -----------------------------------------------------------------------------
    def _on_partition_report(self, report: Any) -> None:
        self.partition_reports.append(report)
        emit_json("ap_partition_report", report)

    def _on_saved(self, summary: SavedSummary) -> None:
        self.saved.append(summary)
        emit_json("ap_saved_activations", summary.to_dict())

    def _on_bucketing_stats(self, stats: Any) -> None:
        self.bucketing_stats.append(stats)
        emit_json("ap_bucketing_stats", stats)

    # -- configuration -------------------------------------------------------------------------
    def _config_patches(self) -> dict[str, Any]:
        opts = self.options
        patches = overlap_config_patches(
            overlap_scheduling=opts.overlap_scheduling, bucketing=opts.bucketing
        )
        if opts.ep_chunk is not None and opts.ep_chunk.schedule_overlap:
            # Inductor's peak-memory reorder (on by default) picks another topological order
            # for a scheduled forward whenever ours has a higher estimated peak, which undoes
            # the chunk pipeline (measured on Qwen3-MoE N=2: chunk 1's dispatch then waits
            # until chunk 0's experts ran); without it Inductor keeps the FX order
            patches = {**patches, "reorder_for_peak_memory": False}
        if opts.enable_ac:
            patches = {**patches, **AC_INDUCTOR_PATCHES}
        return patches

    def _joint_pass(
        self, gm: torch.fx.GraphModule, joint_inputs: Any, graph_inputs: Sequence[Any] = ()
    ) -> torch.fx.GraphModule:
        opts = self.options
        described = described_input_count(gm.graph)
        nested = described is not None and described != len(graph_inputs)
        if opts.ep_chunk is not None and nested:
            # a nested compiled region's own joint graph (invoke_subgraph): its regions, if
            # any, run inside the outer graph's; the marks name the outer graph's inputs
            log.info(
                "autoparallel_backend: ep_chunk skips a nested region's joint graph (%d of the "
                "compiled graph's %d inputs)",
                described,
                len(graph_inputs),
            )
        elif opts.ep_chunk is not None:
            before = gm.print_readable(print_output=False) if _compat.structured_tracing() else ""
            emit_string("ap_chunk_before", lambda: before)
            # the token arguments: ``mark_chunk_dim`` marks on the tensors Dynamo compiled with
            # (the joint graph's primals follow the compiled graph's inputs in order)
            config = ap_epchunk.chunk_inputs_from_marks(opts.ep_chunk, gm.graph, graph_inputs)
            report = ap_epchunk.chunk_pass(gm, config)
            ap_epchunk.concretize_chunk_symbols(gm)
            gm.recompile()
            self.chunk_reports.append(report)
            emit_json("ap_chunk_report", report)
            if config.schedule_overlap:
                # after concretization (static sizes) and before partitioning: the partitioner
                # and its autograd-order epilogue keep this order (ap_epchunk._schedule)
                schedule = ap_epchunk.schedule_chunk_overlap(
                    gm, place_fsdp_collectives=config.place_fsdp_collectives
                )
                self.schedule_reports.append(schedule)
                emit_json("ap_chunk_schedule", schedule)
            if config.exchange_lane:
                lane = ap_epchunk.exchange_lane(gm)
                self.lane_reports.append(lane)
                emit_json("ap_chunk_lane", lane)
            emit_string("ap_chunk_after", lambda: gm.print_readable(print_output=False))
        if self._ac_pass is not None:
            gm = self._ac_pass(gm, joint_inputs)
            reports = getattr(self._ac_pass, "reports", None)
            if reports:
                emit_json("ap_ac_stages", reports[-1])
        return gm

    # -- compile -------------------------------------------------------------------------------
    def _inner_compile(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        retraces_first_compilation: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Wraps Inductor's ``compile_fx_inner`` (looked up at call time) for the forward and
        the lazily compiled backward; ``retraces_first_compilation``: the Dynamo graph calls a
        first compilation (bound by :meth:`__call__`)."""
        opts = self.options
        is_backward = bool(kwargs.get("is_backward", False))
        # torch's forward-to-backward metadata copy named one module for the whole backward of
        # the retraced first compilation; put back each node's own (the gradient reduce-scatters
        # name their parameter's module: what block-wide bucketing keys on)
        ap_epchunk.restore_backward_module_fqns(gm.graph)
        lost: list[str] = []
        if is_backward and retraces_first_compilation:
            lost = ap_epchunk.backward_module_fqns_lost(gm.graph)
        if lost:
            log.warning(
                "autoparallel_backend: %d backward collective(s) of a first compilation (%s) "
                "reached Inductor without the module FQN the first compilation stamped on them "
                "(torch's forward-to-backward metadata copy dropped it); they name the first "
                "forward op's module instead, so block-wide bucketing buckets them as one block "
                "(gradients are unaffected; peak memory is not)",
                len(lost),
                ", ".join(lost[:4]) + (", ..." if len(lost) > 4 else ""),
            )
        self.inner_compiles.append(
            {
                "is_backward": is_backward,
                "collectives": collective_counts(gm.graph),
                "module_fqns_lost": len(lost),
            }
        )
        with contextlib.ExitStack() as stack:
            if opts.overlap_scheduling is True and opts.bucketing is None:
                stack.enter_context(ap_bucketing.cpu_overlap_estimators(not has_gpu()))
            stats = stack.enter_context(ap_bucketing.collect_stats())
            compiled = _compat.compile_fx_inner()(gm, example_inputs, **kwargs)
        for item in stats:
            self._on_bucketing_stats(item)
        return compiled

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        where = "autoparallel_backend"
        require_graph_module(gm, where=where, arg="gm")
        require_instance(
            example_inputs,
            (list, tuple),
            where=where,
            arg="example_inputs",
            expected="a list or tuple",
        )
        opts = self.options
        needs_joint_pass = opts.enable_ac or opts.ep_chunk is not None
        start = time.perf_counter()
        joint_pass = functools.partial(self._joint_pass, graph_inputs=list(example_inputs))
        retraced = retraces_first_compilation(gm)  # before the cache keying rewrites the call
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                partitioning(self._partitioner, joint_pass if needs_joint_pass else None)
            )
            stack.enter_context(scalar_outputs_allowed(example_inputs))
            # the backward keeps the module FQNs the first compilation stamped (torch 2.11
            # replaced them with the first forward op's: one block for the whole backward)
            stack.enter_context(_compat.BACKWARD_CUSTOM_MERGE)
            # EP chunking reads chunk-dim marks off the input tensors, which the cache key
            # does not see: its graphs keep bypassing AOTAutograd's cache
            keyed = key_first_compilation_calls(gm) if opts.ep_chunk is None else 0
            if keyed:
                log.info(
                    "autoparallel_backend: %d call(s) of a first compilation keyed by content "
                    "for AOTAutograd's cache",
                    keyed,
                )
                stack.enter_context(first_compilation_calls_cacheable())
            compiled = _compat.compile_fx()(
                gm,
                example_inputs,
                inner_compile=functools.partial(
                    self._inner_compile, retraces_first_compilation=retraced
                ),
                config_patches=self._persistent_patches or None,
            )
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled


def autoparallel_backend(
    *,
    enable_ac: bool = False,
    ac_stage_size_gib: float | str = "auto",
    overlap_scheduling: bool | str = False,
    bucketing: ap_bucketing.BucketingConfig | bool | str | None = "auto",
    ep_chunk: ap_epchunk.ChunkConfig | None = None,
    partitioner: str | Any | None = None,
    activation_budget_bytes: int | None = None,
) -> AutoParallelBackend:
    """A ``torch.compile`` backend composing the ap passes around Inductor.

    * ``enable_ac``: run ap-tags' AC staging pass on the joint graph (``ac_stage_size_gib``:
      ``"auto"`` or a positive size in GiB), and compile with Inductor's buffer reuse off
      (``AC_INDUCTOR_PATCHES``: AC makes every layer's buffers the same sizes, and reuse held
      one layer's through the next one's attention backward -- 0.70x of plain's peak with it,
      0.54x without, on the model kit at dim 256).
    * ``overlap_scheduling``: ``True``: Inductor's overlap scheduler for forward and backward
      (works on CPU-only machines: analytical estimators, no fusion regions). ``"prefetch"``:
      ap-bucketing's FSDP schedule instead (FSDP2's and torchtitan graph_trainer's order: each
      block's all-gather bucket issued once the previous block's is waited, each
      reduce-scatter waited before the next is issued, nothing else moved; no cost model),
      with the copy-free bucket form (``BucketingConfig(bucket_mode="coalesced")``) unless
      ``bucketing`` is a config of your own; needs bucketing, refused with ``ep_chunk``.
    * ``bucketing``: topo-span-bounded FSDP bucketing for every graph this backend compiles,
      including the lazy backward -- on by default (``"auto"``: ``ap_bucketing.
      BucketingConfig()``, except with ``ep_chunk`` and without ``overlap_scheduling``, where
      bucketing without the overlap scheduler once broke the chunk schedule's order on
      torchtitan's Qwen3-MoE with real EP; ``bucketing=True`` trains like eager there now, but
      the EP route matrix has not been measured with it); ``True`` or a ``BucketingConfig`` of
      your own turns it on, ``False``/``None`` off. Without torch's overlap scheduler and without ``ep_chunk``,
      ``"auto"`` and ``True`` take the copy-free form (``BucketingConfig(bucket_mode=
      "coalesced")``: one coalesced collective per bucket, no copy out of or into a flat
      buffer); with ``overlap_scheduling=True`` they keep ``BucketingConfig()``'s
      ``"custom_ops"`` (torch's scheduler takes a flat bucket only). Why on by default:
      resharding after forward re-gathers every weight in the
      backward, and each re-gather costs its own cast-and-copy kernel (one per weight,
      unbucketed); a bucket pays one for all its weights, which is what keeps the default's
      kernel count at or under plain ``torch.compile``'s. Bucketing is exact (the same
      values reach every consumer), and a graph without FSDP collectives is left as it is.
    * ``ep_chunk``: an ``ap_epchunk.ChunkConfig``; chunks the selected regions of the joint graph
      and concretizes the chunk symbols before partitioning, then (``schedule_overlap``, on by
      default) pipelines each chunked region so one chunk's token exchange runs under another
      chunk's compute (``ap_epchunk.schedule_chunk_overlap``; with ``place_fsdp_collectives``,
      on by default, the FSDP all-gathers / reduce-scatters in flight inside a region's span
      first move to the dense stretch around it), and (``exchange_lane``, on by
      default) moves exchanges that share a process group with FSDP collectives to a group of
      their own (``ap_epchunk.exchange_lane``).
    * ``partitioner``: ``None``/``"save_all"`` (replay the first compile's saves), ``"min_cut"``,
      or any ``CustomPartitionerFn``.
    * ``activation_budget_bytes``: with the save-all replay, keep each partition's saved
      activations at or under this many bytes per rank, recomputing the cheapest replayed saves
      in the backward (``ap_partitioner.SaveAllPartitioner(activation_budget_bytes=...)``; the
      report's ``budget_*`` fields say what it cost); a budget under the graph's floor is an
      ``ap_partitioner.BudgetError`` naming the floor.

    Raises ``TypeError`` (an option of the wrong type) or ``ValueError`` (an option value that
    is not allowed) naming the first invalid option.
    """
    options = locals()  # every parameter is an option, under the same name
    return AutoParallelBackend(validate_options(**options))
