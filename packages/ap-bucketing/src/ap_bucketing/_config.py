"""``BucketingConfig``: the knobs of topo-span-bounded FSDP bucketing.

A frozen, validated dataclass (a field of the wrong type raises ``TypeError``, one out of range
``ValueError``). It is read from the *instance* handed to ``install``/``patched``/
``bucket_collectives``/``OverlapBucketingPass``, so two configs can be active in one process, and
its ``fingerprint()`` feeds Inductor's cache key so a graph bucketed under one config is never
reused under another. See ``docs/architecture.md``, "Bucketing rules".
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from ._checks import require_bool, require_instance, require_int, require_mib
from ._source import package_source_hash

#: The bucket forms: torch's (``bucketing.BucketMode``) ``"default"`` packs a bucket with
#: explicit copies into one flat buffer and slices it back out; ``"custom_ops"`` packs inside
#: one opaque custom op per bucket and unpacks with one ``split_with_sizes_copy``, so Inductor
#: does not generate a copy kernel per member; ap-bucketing's ``"coalesced"`` issues one
#: coalesced collective per bucket, each member into or from its own tensor (no copy out, no
#: copy in).
BUCKET_MODES: tuple[str, ...] = ("default", "custom_ops", "coalesced")
#: ap-bucketing's own copy-free form (``_coalesced.py``): one coalesced collective per bucket
COALESCED = "coalesced"


@dataclass(frozen=True)
class BucketingConfig:
    """Configuration of the bucketing patch and of ``OverlapBucketingPass``.

    Attributes:
        max_topo_span: close a bucket when adding a collective would make the distance between
            its lowest and highest topological rank exceed this; ``None`` = bytes only.
            Bounding the span stops one merge from dragging consumers of early members past
            many layers of compute (the "MM x N" backward peak-memory blow-up).
        max_compute_pre_fetch: how many compute nodes ahead of its first consumer the overlap
            scheduler may launch a collective.
        bucket_cap_mb: byte cap per bucket in MiB; ``None`` keeps torch's own cap (the
            saturation model for FSDP pre-bucketing, the caller's cap function otherwise).
        primary_group_only: treat only the process group with the most FSDP collectives as the
            FSDP group (minority groups, e.g. norm weights on a dp x tp group, stay unbucketed
            by the FSDP all-reduce path and do not steer the cap).
        non_adjacent: group collectives by key without requiring them to be adjacent in wait
            order (interleaved dp/tp collectives otherwise never bucket).
        bucket_mode: how torch materialises a bucket (one of :data:`BUCKET_MODES`), handed to
            its FSDP pre-bucketing and overlap scheduler. ``"custom_ops"`` (the default) packs
            a bucket inside one opaque op: on torchtitan's Llama3 at 8 layers Inductor emits 22
            C++ kernels instead of 104 with ``"default"``, and AC + bucketing + overlap compiles
            in 0.92x stock Inductor's time instead of 2.63x (benchmarks/RESULTS.md, section 7).
            Its unpack fills each member with an ``out=`` copy that the member's readers have
            no data edge to; torch's overlap scheduler hoisted such reads above the copy (NaN
            losses), which ``OverlapBucketingPass`` undoes (``_hazards.py``). ``"default"``
            (one copy kernel per member, all visible to Inductor) is for a pipeline that runs
            torch's overlap scheduler or another reordering pass on the bucketed graph *without*
            ``OverlapBucketingPass``: nothing else restores the ``out=`` order there.
        block_buckets: a bucket never spans two transformer blocks, nor a joint graph's
            forward and backward (``_blocks.py``: the block from the module FQN the graph
            carries, embedding and head their own), and never gathers one parameter twice.
            FSDP2 and torchtitan's graph_trainer bound memory the same way; the byte cap and
            the span stay as safety nets, and a graph without module FQNs buckets by them.
        backward_parts: with ``block_buckets``, a backward bucket also stays within one of its
            block's direct submodules (``layers.3.feed_forward``, ``layers.3.attention``); a
            submodule with one collective or under an eighth of the block's bytes of that kind
            (a norm's weight) joins the bucket of the submodule before it in wait order (the
            first one: the one after). Needs ``non_adjacent`` (torch's adjacent runs keep
            block-wide backward buckets). The backward runs the feed-forward and the attention one after the
            other, so a block-wide bucket holds the attention's gathered weights through the
            feed-forward's backward and the feed-forward's unreduced gradients through the
            attention's; per submodule each is alive only while its own part runs (the kit at
            dim 256, 2 layers, seq 512: default peak 25.5 MB against 26.3 block-wide, full
            configuration 20.5 against 22.3; docs/architecture.md). The forward keeps
            block-wide buckets: its peak is the saved activations at its end, where one
            block's weights are a small share.
        prefetch_depth: in ``OverlapBucketingPass``, a bucketed (or FSDP) collective is issued
            at most this many collectives of its kind ahead of the last one waited for: with
            1, the next bucket's all-gather starts once the current one's is waited (FSDP2's
            prefetch of one: the next block's in the forward, with ``backward_parts`` the next
            submodule's in the backward), and a reduce-scatter once the previous one is
            waited. ``None``
            leaves the issue order to the scheduler (and to the merge, without reordering).
    """

    max_topo_span: int | None = 1500
    max_compute_pre_fetch: int = 50
    bucket_cap_mb: float | None = None
    primary_group_only: bool = True
    non_adjacent: bool = True
    bucket_mode: str = "custom_ops"
    block_buckets: bool = True
    backward_parts: bool = True
    prefetch_depth: int | None = 1

    def __post_init__(self) -> None:
        where = "BucketingConfig"
        if self.max_topo_span is not None:
            require_int(self.max_topo_span, where=where, arg="max_topo_span", minimum=0)
        require_int(self.max_compute_pre_fetch, where=where, arg="max_compute_pre_fetch", minimum=0)
        if self.bucket_cap_mb is not None:
            require_mib(self.bucket_cap_mb, where=where, arg="bucket_cap_mb")
        require_bool(self.primary_group_only, where=where, arg="primary_group_only")
        require_bool(self.non_adjacent, where=where, arg="non_adjacent")
        require_instance(self.bucket_mode, str, where=where, arg="bucket_mode", expected="a str")
        require_bool(self.block_buckets, where=where, arg="block_buckets")
        require_bool(self.backward_parts, where=where, arg="backward_parts")
        if self.prefetch_depth is not None:
            require_int(self.prefetch_depth, where=where, arg="prefetch_depth", minimum=1)
        if self.bucket_mode not in BUCKET_MODES:
            raise ValueError(
                f"{where}: bucket_mode must be one of {', '.join(map(repr, BUCKET_MODES))}, "
                f"got {self.bucket_mode!r}"
            )

    def fingerprint(self) -> str:
        """A short stable hash of every field plus the package's source code.

        Used for cache keys: two configs (or two versions of this package) that could bucket
        differently never share a fingerprint.
        """
        fields = ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        digest = hashlib.sha256(f"{fields}|{package_source_hash()}".encode())
        return digest.hexdigest()[:16]


def resolve_config(config: object, *, where: str) -> BucketingConfig:
    """``config``, or ``BucketingConfig()`` when it is ``None``; anything else is a TypeError."""
    if config is None:
        return BucketingConfig()
    return require_instance(
        config, BucketingConfig, where=where, arg="config", expected="a BucketingConfig"
    )
