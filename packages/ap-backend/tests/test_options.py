"""autoparallel_backend rejects bad options naming the option: a TypeError for a value of the
wrong type, a ValueError for a value of the right type that is not allowed."""

from __future__ import annotations

import pytest
from ap_backend import autoparallel_backend
from ap_bucketing import BucketingConfig


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"ac_stage_size_gib": 0}, "ac_stage_size_gib"),
        ({"ac_stage_size_gib": -1.5}, "ac_stage_size_gib"),
        ({"ac_stage_size_gib": "big"}, "ac_stage_size_gib"),
        ({"partitioner": "greedy"}, "partitioner"),
        ({"overlap_scheduling": "fast"}, "overlap_scheduling"),
        ({"overlap_scheduling": "prefetch", "bucketing": False}, "overlap_scheduling"),
    ],
)
def test_disallowed_value_raises_value_error_naming_it(
    kwargs: dict[str, object], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        autoparallel_backend(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"enable_ac": "yes"}, "enable_ac"),
        ({"ac_stage_size_gib": True}, "ac_stage_size_gib"),
        ({"overlap_scheduling": 1}, "overlap_scheduling"),
        ({"bucketing": "fsdp"}, "bucketing"),
        ({"ep_chunk": {"module_patterns": ["layers.*.moe"]}}, "ep_chunk"),
        ({"partitioner": 3}, "partitioner"),
    ],
)
def test_wrong_type_raises_type_error_naming_it(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(TypeError, match=name):
        autoparallel_backend(**kwargs)  # type: ignore[arg-type]


def test_valid_options_are_normalised() -> None:
    be = autoparallel_backend(enable_ac=True, ac_stage_size_gib=2, bucketing=True)
    assert be.options.ac_stage_size_gib == 2.0
    assert isinstance(be.options.bucketing, BucketingConfig)
    assert be.options.partitioner == "save_all"
    assert autoparallel_backend(bucketing=False).options.bucketing is None
    assert autoparallel_backend(bucketing=None).options.bucketing is None


def test_bucketing_is_on_by_default() -> None:
    """The default configuration buckets: unbucketed, every weight's backward re-gather is a
    kernel of its own, and the default would generate more kernels than plain compile."""
    assert autoparallel_backend().options.bucketing is not None
    assert autoparallel_backend(bucketing="auto").options.bucketing is not None


def test_ap_bucketing_is_copy_free_unless_torch_schedules_or_the_caller_configures() -> None:
    """ap's own bucketing choice (``"auto"``, ``True``) without torch's overlap scheduler is the
    copy-free form: no flat buffer copied out to the members or gradients copied in. Under
    torch's scheduler (which cannot take a coalesced bucket: a flat one) and with ``ep_chunk`` it stays
    ``BucketingConfig()``; a config of the caller's own is kept as given."""
    copy_free = BucketingConfig(bucket_mode="coalesced")
    assert autoparallel_backend().options.bucketing == copy_free
    assert autoparallel_backend(bucketing=True).options.bucketing == copy_free
    assert autoparallel_backend(enable_ac=True, bucketing=True).options.bucketing == copy_free
    scheduled = autoparallel_backend(bucketing=True, overlap_scheduling=True)
    assert scheduled.options.bucketing == BucketingConfig()
    own = BucketingConfig(max_topo_span=100)
    assert autoparallel_backend(bucketing=own).options.bucketing is own

    import ap_epchunk

    chunk = ap_epchunk.ChunkConfig(("layers.*.moe",), num_chunks=2)
    assert autoparallel_backend(ep_chunk=chunk, bucketing=True).options.bucketing == (
        BucketingConfig()
    )
    post_pass = autoparallel_backend()._persistent_patches["post_grad_custom_post_pass"]
    assert (post_pass.reorder, post_pass.config.bucket_mode) == (False, "coalesced")


def test_default_bucketing_stays_off_for_ep_chunk_without_overlap_scheduling() -> None:
    """Bucketing after the chunk schedule without the overlap scheduler was never measured on a
    chunked EP graph, so the default leaves it off there; with the overlap scheduler (the full
    configuration) the EP routes are measured. An explicit ``bucketing=True`` is the user's."""
    import ap_epchunk

    chunk = ap_epchunk.ChunkConfig(("layers.*.moe",), num_chunks=2)
    assert autoparallel_backend(ep_chunk=chunk).options.bucketing is None
    on = autoparallel_backend(ep_chunk=chunk, overlap_scheduling=True).options.bucketing
    assert on == BucketingConfig()
    assert autoparallel_backend(ep_chunk=chunk, bucketing=True).options.bucketing is not None


def test_custom_partitioner_is_accepted_as_is() -> None:
    from ap_partitioner import MinCutPartitioner

    custom = MinCutPartitioner()
    assert autoparallel_backend(partitioner=custom).options.partitioner is custom


def test_partitioner_pickles_for_inductor_cache_key_without_cycles() -> None:
    """Inductor pickles config (our partitioner included) with a fast-mode pickler that rejects
    reference cycles; the partitioner's callbacks point back at the backend."""
    import copy
    import pickle

    import torch.fx
    from torch._inductor.codecache import FxGraphCachePickler

    be = autoparallel_backend()
    part = be._partitioner
    FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())).dumps(part)
    assert pickle.loads(pickle.dumps(part)).uuid() == part.uuid()
    assert copy.deepcopy(part) is part


def test_prefetch_schedule_buckets_copy_free_unless_given_a_config() -> None:
    """``overlap_scheduling="prefetch"``: ap-bucketing's FSDP schedule in the post-grad pass
    (not torch's scheduler), with the copy-free bucket form by default -- torch's scheduler is
    what ruled that form out -- and a config of the caller's own kept as given."""
    from ap_bucketing import OverlapBucketingPass

    options = autoparallel_backend(overlap_scheduling="prefetch").options
    assert options.bucketing == BucketingConfig(bucket_mode="coalesced")
    assert autoparallel_backend(
        overlap_scheduling="prefetch", bucketing=True
    ).options.bucketing == (BucketingConfig(bucket_mode="coalesced"))
    own = BucketingConfig(bucket_mode="custom_ops", prefetch_depth=2)
    assert (
        autoparallel_backend(overlap_scheduling="prefetch", bucketing=own).options.bucketing is own
    )
    patches = autoparallel_backend(overlap_scheduling="prefetch")._persistent_patches
    post_pass = patches["post_grad_custom_post_pass"]
    assert isinstance(post_pass, OverlapBucketingPass)
    assert (post_pass.reorder, post_pass.config.bucket_mode) == ("prefetch", "coalesced")
    assert patches["aten_distributed_optimizations.enable_overlap_scheduling"] is False
    torch_scheduler = autoparallel_backend(overlap_scheduling=True)._persistent_patches
    assert torch_scheduler["post_grad_custom_post_pass"].reorder is True


def test_prefetch_schedule_is_refused_with_ep_chunk() -> None:
    import ap_epchunk

    chunk = ap_epchunk.ChunkConfig(("layers.*.moe",), num_chunks=2)
    with pytest.raises(ValueError, match="overlap_scheduling='prefetch' with ep_chunk"):
        autoparallel_backend(ep_chunk=chunk, overlap_scheduling="prefetch")


def test_ac_compiles_without_inductor_buffer_reuse() -> None:
    """AC makes every layer's buffers the same sizes, and Inductor's buffer reuse then held one
    layer's through the next one's attention backward, onto the real peak (the ``heavy``
    ``tests/test_peak_memory.py::test_full_configuration_at_the_dim_256_kit`` measures it).
    Without AC the backend leaves Inductor's reuse as it is."""
    assert autoparallel_backend(enable_ac=True)._persistent_patches["allow_buffer_reuse"] is False
    assert "allow_buffer_reuse" not in autoparallel_backend()._persistent_patches
    assert (
        "allow_buffer_reuse"
        not in autoparallel_backend(overlap_scheduling=True)._persistent_patches
    )
