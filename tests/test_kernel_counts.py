"""The default configuration generates no more kernels than plain ``torch.compile`` (at most
1.05x), the full configuration fewer.

Why: resharding after forward re-gathers every weight in the backward, and each unbucketed
re-gather is a cast-and-copy kernel of its own (20 more kernels than plain on this model, a
1.2x step of extra launches -- what bound a small step on a GPU). Bucketing, on by default,
pays that kernel once per bucket. Counted as Inductor counts them
(``torch._inductor.metrics.generated_kernel_count``, forward + lazy backward), on the model
kit at dim 256, seq 512, batch 2, bf16 gathers, fake process group world 8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ap_tags
import pytest
import torch
from ap_backend import autoparallel_backend, precompile
from ap_backend.models import ModelConfig, Sharding, Transformer
from ap_testing.distributed import fake_world
from torch._inductor import metrics

CONFIG = ModelConfig(dim=256, n_layers=2, n_heads=4, ffn_dim=1024, vocab=1024, seq_len=512, batch=2)


def _kernels(build: Callable[[Transformer, tuple[Any, ...]], Any]) -> int:
    """Inductor's generated kernels for one forward + backward of the compiled step."""
    with fake_world(8):
        model = Transformer(CONFIG, Sharding.from_world(gather_dtype=torch.bfloat16))
        batch = model.example_batch(0, 0)
        compiled = build(model, batch)
        metrics.reset()
        compiled(*batch).backward()
        return int(metrics.generated_kernel_count)


def _plain(model: Transformer, batch: tuple[Any, ...]) -> Any:
    return torch.compile(model)


def _default(model: Transformer, batch: tuple[Any, ...]) -> Any:
    return torch.compile(precompile(model, batch), backend=autoparallel_backend())


def _unbucketed(model: Transformer, batch: tuple[Any, ...]) -> Any:
    return torch.compile(precompile(model, batch), backend=autoparallel_backend(bucketing=False))


def _full(model: Transformer, batch: tuple[Any, ...]) -> Any:
    pm = precompile(model, batch, joint_pass=ap_tags.ac_joint_pass())
    backend = autoparallel_backend(enable_ac=True, bucketing=True, overlap_scheduling=True)
    return torch.compile(pm, backend=backend)


@pytest.mark.slow
@pytest.mark.heavy  # four codegen compiles of the model kit: ~2.5 min on 2 cores
def test_default_and_full_configurations_generate_no_more_kernels_than_plain() -> None:
    counts = {
        name: _kernels(fn)
        for name, fn in (
            ("plain", _plain),
            ("default", _default),
            ("unbucketed", _unbucketed),
            ("full", _full),
        )
    }
    assert counts["default"] <= 1.05 * counts["plain"], counts
    assert counts["full"] < counts["plain"], counts
    # what bucketing buys: the backward's per-weight re-gather kernels (one per FSDP weight)
    assert counts["unbucketed"] > 1.05 * counts["plain"], counts
