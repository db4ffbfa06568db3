"""install/uninstall/patched: exact restore, nesting, idempotence, threads, cache tag."""

from __future__ import annotations

import threading

import ap_bucketing
import pytest
import torch
import torch._inductor.fx_passes.bucketing as torch_bucketing
import torch._inductor.fx_passes.fsdp as torch_fsdp
from ap_bucketing import BucketingConfig, collect_stats, install, is_installed, patched, uninstall
from ap_bucketing._compat import predates_fsdp_prebucketing
from ap_testing.collectives import GraphBuilder
from ap_testing.collectives import all_gather_bucketing_args as ag_args


def _torch_functions() -> tuple[object, ...]:
    """The patch sites this torch has (2.11/2.12 predate ``identify_fsdp_groups``)."""
    sites = [getattr(torch_fsdp, "identify_fsdp_groups", None)]
    return (*(f for f in sites if f is not None), torch_bucketing.greedy_bucket_collective_by_mb)


def test_importing_the_package_changed_nothing() -> None:
    *identify, greedy = _torch_functions()
    assert all(getattr(f, "__module__", "") == "torch._inductor.fx_passes.fsdp" for f in identify)
    assert getattr(greedy, "__module__", "") == "torch._inductor.fx_passes.bucketing"
    assert "ap_bucketing" not in torch.compiler.config.cache_key_tag
    assert ap_bucketing.current_config() is None


def test_install_uninstall_restore_the_exact_originals() -> None:
    originals = _torch_functions()
    tag = torch.compiler.config.cache_key_tag
    install(BucketingConfig(max_topo_span=7))
    install(BucketingConfig(max_topo_span=7))  # idempotent
    patched_fns = _torch_functions()
    assert is_installed()
    assert all(p is not o for p, o in zip(patched_fns, originals, strict=True))
    assert ap_bucketing.current_config() == BucketingConfig(max_topo_span=7)
    install(BucketingConfig(max_topo_span=9))  # replaces the config, not the functions
    assert _torch_functions() == patched_fns
    uninstall()
    assert _torch_functions() == originals
    assert all(p is o for p, o in zip(_torch_functions(), originals, strict=True))
    assert torch.compiler.config.cache_key_tag == tag
    uninstall()  # no-op
    assert _torch_functions() == originals


def test_nested_patched_restores_the_outer_config() -> None:
    originals = _torch_functions()
    outer, inner = BucketingConfig(max_topo_span=10), BucketingConfig(max_topo_span=20)
    with patched(outer):
        tag_outer = torch.compiler.config.cache_key_tag
        with patched(inner):
            assert ap_bucketing.current_config() is inner
            assert torch.compiler.config.cache_key_tag != tag_outer
        assert ap_bucketing.current_config() is outer
        assert torch.compiler.config.cache_key_tag == tag_outer
        assert is_installed()
    assert not is_installed()
    assert all(p is o for p, o in zip(_torch_functions(), originals, strict=True))


def test_patched_inside_install_returns_to_the_installed_config() -> None:
    base = BucketingConfig(max_topo_span=5)
    install(base)
    with patched(BucketingConfig(max_topo_span=None)):
        assert ap_bucketing.current_config() == BucketingConfig(max_topo_span=None)
    assert ap_bucketing.current_config() is base
    uninstall()


def _state() -> tuple[object, ...]:
    """Everything entering a patch may change: torch's patch sites, the cache-key tag and
    the active config."""
    return (*_torch_functions(), torch.compiler.config.cache_key_tag, ap_bucketing.current_config())


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b, strict=True))


def test_a_failing_patched_entry_leaves_nothing_behind() -> None:
    """Entry is all-or-nothing: a tag the fingerprint cannot be appended to is refused before
    torch's functions are replaced."""
    with torch.compiler.config.patch(cache_key_tag=None):
        before = _state()
        with pytest.raises(TypeError, match="patched: torch.compiler.config.cache_key_tag"):
            with patched(BucketingConfig()):
                raise AssertionError("entered")  # pragma: no cover
        assert _same(_state(), before), "a failing patched() entry left state behind"
        assert torch.compiler.config.cache_key_tag is None
        assert not is_installed()
    with patched(BucketingConfig(max_topo_span=3)) as cfg:  # and patching still works
        assert ap_bucketing.current_config() is cfg
    assert not is_installed()


def test_a_failing_nested_entry_keeps_the_outer_block_exactly() -> None:
    outer = BucketingConfig(max_topo_span=10)
    with patched(outer):
        with torch.compiler.config.patch(cache_key_tag=None):  # someone replaced the tag
            before = _state()
            with pytest.raises(TypeError, match="cache_key_tag"):
                with patched(BucketingConfig(max_topo_span=20)):
                    raise AssertionError("entered")  # pragma: no cover
            assert _same(_state(), before)
            assert ap_bucketing.current_config() is outer
    assert not is_installed()


def test_a_failing_install_leaves_nothing_behind() -> None:
    with torch.compiler.config.patch(cache_key_tag=None):
        before = _state()
        with pytest.raises(TypeError, match="install: torch.compiler.config.cache_key_tag"):
            install(BucketingConfig())
        assert _same(_state(), before), "a failing install() left state behind"
        assert not is_installed()
    base = BucketingConfig(max_topo_span=5)
    install(base)
    with torch.compiler.config.patch(cache_key_tag=None):
        before = _state()
        with pytest.raises(TypeError):
            install(BucketingConfig(max_topo_span=6))
        assert _same(_state(), before)
        assert ap_bucketing.current_config() is base  # the installed config is kept
    uninstall()
    assert not is_installed()


@pytest.mark.skipif(
    predates_fsdp_prebucketing(),
    reason="this torch has no fsdp.identify_fsdp_groups to patch (FSDP pre-bucketing is 2.13+)",
)
def test_torch_callers_reach_the_active_config() -> None:
    # The bucketing wrappers torch's FSDP path uses look the greedy function up at call time.
    b = GraphBuilder()
    ags = []
    waits = []
    for group in ["dp", "tp", "dp", "tp"]:
        ag, w = b.all_gather(b.placeholder((4, 8)), group=group)
        ags.append(ag)
        waits.append(w)
    gm = b.module(waits)
    assert torch_bucketing.bucket_all_gather_by_mb(gm, lambda _i: 10.0) == []
    with patched(BucketingConfig()), collect_stats() as stats:
        buckets = torch_bucketing.bucket_all_gather_by_mb(gm, lambda _i: 10.0)
        groups = torch_fsdp.identify_fsdp_groups(gm)
    assert buckets == [[ags[0], ags[2]], [ags[1], ags[3]]]
    assert len(stats) == 1
    assert list(groups[0]) == ["dp"]  # tie, dp seen first; torch returns both groups
    assert list(torch_fsdp.identify_fsdp_groups(gm)[0]) == ["dp", "tp"]
    with patched(BucketingConfig(primary_group_only=False)):
        assert list(torch_fsdp.identify_fsdp_groups(gm)[0]) == ["dp", "tp"]
    assert torch_bucketing.greedy_bucket_collective_by_mb(*ag_args(gm)) == []


def test_concurrent_patched_blocks_restore_exactly() -> None:
    originals = _torch_functions()
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker(span: int) -> None:
        try:
            with patched(BucketingConfig(max_topo_span=span)):
                barrier.wait(timeout=10)
                assert is_installed()
                barrier.wait(timeout=10)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(p is o for p, o in zip(_torch_functions(), originals, strict=True))
    assert "ap_bucketing" not in torch.compiler.config.cache_key_tag


def test_a_reference_grabbed_while_patched_falls_back_to_torch_after_uninstall() -> None:
    with patched(BucketingConfig()):
        grabbed_greedy = torch_bucketing.greedy_bucket_collective_by_mb
    b = GraphBuilder()
    waits = [b.all_gather(b.placeholder((4, 8)), group=g)[1] for g in ["dp", "tp", "dp"]]
    gm = b.module(waits)
    with collect_stats() as stats:
        assert grabbed_greedy(*ag_args(gm)) == []  # torch's adjacency behaviour
    assert stats == []  # not our bucketer
