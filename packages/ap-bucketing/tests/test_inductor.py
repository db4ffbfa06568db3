"""Inductor-level behaviour: FX-graph cache keying and end-to-end FSDP-style compiles (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ap_bucketing
import ap_bucketing._patching
import pytest
import torch
import torch.fx as fx
from ap_bucketing import (
    BucketingConfig,
    OverlapBucketingPass,
    collect_stats,
    overlap_config_patches,
    primary_fsdp_groups,
)
from ap_bucketing._compat import predates_fsdp_prebucketing
from ap_testing.models import FsdpStack
from torch._inductor.compile_fx import compile_fx

#: torch 2.11/2.12: no Inductor FSDP pre-bucketing (ap-bucketing carries its own)
PREDATES = predates_fsdp_prebucketing()

_AGS = (
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor_out.default,
)
_RS = torch.ops._c10d_functional.reduce_scatter_tensor.default


_CACHE_SCRIPT = """
import json
import torch
from torch._dynamo.utils import counters
from ap_bucketing import BucketingConfig, patched

def f(x):
    return (x.sin() + 1).relu()

def compile_once(span):
    torch._dynamo.reset()
    counters.clear()
    with patched(BucketingConfig(max_topo_span=span)):
        torch.compile(f, backend="inductor", fullgraph=True)(torch.randn(16))
    inductor = counters["inductor"]
    return [inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]]

with torch._functorch.config.patch(enable_autograd_cache=False):
    print(json.dumps([compile_once(1500), compile_once(1500), compile_once(100)]))
"""


@pytest.mark.slow
def test_changing_max_topo_span_recompiles_instead_of_reusing(tmp_path: Path) -> None:
    # The root conftest forces the FX-graph cache off through TORCHINDUCTOR_FX_GRAPH_CACHE=0,
    # an env "force" that beats config.patch; so this runs in a child process with the cache
    # forced on and a private cache directory.
    env = dict(os.environ)
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", _CACHE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, same, changed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first == [0, 1]
    assert same == [1, 0]  # the cache works: same config, same key
    assert changed == [0, 1]  # max_topo_span changed: new key, recompiled


def test_the_code_in_the_cache_keys_covers_the_compat_subpackage(tmp_path: Path) -> None:
    """The pass's and the config's cache keys carry a hash of the package's code; it covers
    every ``*.py`` under the package, the compat seam (``ap_bucketing/_compat/``) included: two
    copies that differ only in a subpackage module hash apart, and the package's own hash
    reads its seam."""
    from ap_bucketing import _source

    def package(name: str, sub_text: str) -> Path:
        root = tmp_path / name
        (root / "_compat").mkdir(parents=True)
        (root / "__init__.py").write_text("x = 1\n")
        (root / "_compat" / "__init__.py").write_text(sub_text)
        return root

    same = {_source.source_hash(package(n, "y = 1\n")) for n in ("a", "b")}
    assert len(same) == 1
    assert _source.source_hash(package("c", "y = 2\n")) not in same
    root = Path(ap_bucketing.__file__).parent
    assert (root / "_compat" / "_fsdp.py").is_file()
    assert _source.package_source_hash() == _source.source_hash(root)


def test_pass_uuid_covers_config_and_options() -> None:
    base = OverlapBucketingPass(BucketingConfig(), cpu=True)
    assert base.uuid() == OverlapBucketingPass(BucketingConfig(), cpu=True).uuid()
    assert base.uuid() != OverlapBucketingPass(BucketingConfig(max_topo_span=100), cpu=True).uuid()
    assert base.uuid() != OverlapBucketingPass(BucketingConfig(), cpu=False).uuid()
    assert base.uuid() != OverlapBucketingPass(BucketingConfig(), cpu=True, reorder=False).uuid()
    assert base.uuid() != OverlapBucketingPass(cpu=True, max_in_flight_gb=1.0).uuid()
    with pytest.raises(TypeError, match="OverlapBucketingPass: config must be a BucketingConfig"):
        OverlapBucketingPass(object())  # type: ignore[arg-type]


class _CountingPass(OverlapBucketingPass):
    """Records collective counts before and after the real pass, per graph."""

    seen: list[dict[str, int]]

    def __call__(self, graph: fx.Graph) -> None:
        before = _count(graph)
        super().__call__(graph)
        after = _count(graph)
        self.seen.append(
            {
                "ag_before": before[0],
                "ag_after": after[0],
                "rs_before": before[1],
                "rs_after": after[1],
            }
        )


def _count(graph: fx.Graph) -> tuple[int, int]:
    ag = sum(len(graph.find_nodes(op="call_function", target=t)) for t in _AGS)
    rs = len(graph.find_nodes(op="call_function", target=_RS))
    return ag, rs


@pytest.mark.slow
def test_end_to_end_fsdp_model_buckets_all_gathers_with_the_patched_functions(
    fake_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = BucketingConfig(max_topo_span=10_000)
    patches = overlap_config_patches(config, cpu=True)
    counting = _CountingPass(config, cpu=True)
    counting.seen = []
    patches["post_grad_custom_post_pass"] = counting
    identify_calls: list[BucketingConfig | None] = []

    def spy(gm: fx.GraphModule) -> object:
        identify_calls.append(ap_bucketing.current_config())
        return primary_fsdp_groups(gm)

    # The patched identify_fsdp_groups delegates here; torch reaches it only while patched.
    monkeypatch.setattr(ap_bucketing._patching, "primary_fsdp_groups", spy)

    def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        return compile_fx(gm, example_inputs, config_patches=patches)

    model = FsdpStack(fake_pg)  # 4 layers of 1/8 weight shards, all-gathered in forward
    x = torch.randn(4, 32, requires_grad=True)
    with collect_stats() as stats:
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        # (a torch before FSDP pre-bucketing, 2.11/2.12, has no identify_fsdp_groups to call)
        assert len(identify_calls) == (0 if PREDATES else 1)  # forward compiled, backward not yet
        out.sum().backward()  # the backward compiles lazily, outside torch.compile's call
    assert not ap_bucketing.is_installed()  # scoped: nothing left patched afterwards
    forward, backward = counting.seen
    assert forward["ag_before"] == 4 and forward["ag_after"] == 1
    assert backward["rs_before"] == 4  # the pass ran on the lazily compiled backward too
    assert identify_calls == ([] if PREDATES else [config, config])  # patched identify, fw and bw
    # The patched greedy function bucketed the four all-gathers into one bucket.
    assert any(s.buckets == 1 and s.bucketed == 4 for s in stats)
    assert all(s.max_topo_span == 10_000 for s in stats)
    assert all(shard.grad is not None for shard in model.shards)
