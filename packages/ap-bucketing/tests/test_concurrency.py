"""install/uninstall/patched under concurrency: many threads entering, leaving and raising.

Invariants checked: inside a ``patched`` block torch's two functions are the replacements and a
config is active; calls through torch's module attribute never fail while other threads toggle
the patch; once every thread is done (and ``uninstall()`` ran) torch's exact originals are back
(identity), the cache-key tag is what it was, and no config is active.
"""

from __future__ import annotations

import random

import ap_bucketing as AB
import pytest
import torch
import torch._inductor.fx_passes.bucketing as torch_bucketing
import torch._inductor.fx_passes.fsdp as torch_fsdp
from ap_bucketing import BucketingConfig
from ap_bucketing._compat import roofline_estimator_site
from ap_testing.collectives import all_gather_bucketing_args, interleaved_fsdp_graph
from ap_testing.concurrency import Boom, hammer

#: the GPU-only estimator ``cpu_overlap_estimators`` replaces (``estimate_roofline_runtime_ms``;
#: 2.11's ``estimate_runtime_analytical``)
ESTIMATOR = roofline_estimator_site()[1]

THREADS = 12
ROUNDS = 40


def _torch_functions() -> tuple[object, ...]:
    """The patch sites this torch has (2.11/2.12 predate ``identify_fsdp_groups``)."""
    sites = [getattr(torch_fsdp, "identify_fsdp_groups", None)]
    return (*(f for f in sites if f is not None), torch_bucketing.greedy_bucket_collective_by_mb)


def test_threads_entering_leaving_and_raising_restore_torch_exactly() -> None:
    originals = _torch_functions()
    tag = torch.compiler.config.cache_key_tag
    configs = [BucketingConfig(max_topo_span=s) for s in (None, 5, 50, 1500)]
    gm = interleaved_fsdp_graph(200)
    args = all_gather_bucketing_args(gm)

    def inside(rng: random.Random, depth: int) -> None:
        assert AB.current_config() is not None and AB.is_installed(), "no active config"
        assert _torch_functions() != originals, "torch not patched inside patched()"
        # a compile in this thread calls torch's module attribute: it must always work
        buckets = torch_bucketing.greedy_bucket_collective_by_mb(*args)
        assert all(len(b) >= 2 for b in buckets), "singleton bucket"
        if depth < 2 and rng.random() < 0.3:
            with AB.patched(rng.choice(configs)):
                inside(rng, depth + 1)
        if rng.random() < 0.2:
            raise Boom()

    def one_round(rng: random.Random) -> None:
        action = rng.random()
        if action < 0.1:
            AB.install(rng.choice(configs))
        elif action < 0.2:
            AB.uninstall()
        else:
            with AB.patched(rng.choice(configs)):
                inside(rng, 0)

    hammer(one_round, threads=THREADS, rounds=ROUNDS)
    AB.uninstall()  # some worker may have left an install() behind, as a program could
    assert not AB.is_installed() and AB.current_config() is None
    now = _torch_functions()
    assert len(now) == len(originals) and all(a is b for a, b in zip(now, originals, strict=True))
    assert torch.compiler.config.cache_key_tag == tag


def test_replacement_held_by_torch_falls_back_after_uninstall() -> None:
    """A reference grabbed while patched (as a running compile holds one) keeps working after
    another thread restores torch: it then behaves exactly like torch's original."""
    gm = interleaved_fsdp_graph(200)
    args = all_gather_bucketing_args(gm)
    want = torch_bucketing.greedy_bucket_collective_by_mb(*args)
    with AB.patched(BucketingConfig()):
        held = torch_bucketing.greedy_bucket_collective_by_mb
    got = held(*args)
    assert [[n.name for n in b] for b in got] == [[n.name for n in b] for b in want]


def test_exception_in_nested_blocks_restores_each_level() -> None:
    originals = _torch_functions()
    outer, inner = BucketingConfig(max_topo_span=1), BucketingConfig(max_topo_span=2)
    with pytest.raises(Boom):
        with AB.patched(outer):
            try:
                with AB.patched(inner):
                    raise Boom()
            finally:
                assert AB.current_config() is outer
            raise AssertionError("unreachable")  # pragma: no cover
    assert _torch_functions() == originals and not AB.is_installed()


def test_cpu_estimators_under_threads_restore_the_exact_original() -> None:
    """``cpu_overlap_estimators`` is refcounted across threads: the replacement is in place in
    every block, and the original is back (identity) once the last block is left, also when
    bodies raise."""
    import torch._inductor.fx_passes.overlap_scheduling as torch_overlap

    original = getattr(torch_overlap, ESTIMATOR)

    def one_round(rng: random.Random) -> None:
        with AB.cpu_overlap_estimators():
            assert getattr(torch_overlap, ESTIMATOR) is not original
            if rng.random() < 0.3:
                with AB.cpu_overlap_estimators():
                    assert getattr(torch_overlap, ESTIMATOR) is not original
                assert getattr(torch_overlap, ESTIMATOR) is not original  # still held
            if rng.random() < 0.2:
                raise Boom()

    hammer(one_round, threads=THREADS, rounds=ROUNDS)
    assert getattr(torch_overlap, ESTIMATOR) is original
