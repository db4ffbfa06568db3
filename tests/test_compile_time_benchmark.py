"""``benchmarks.compile_time`` (issue 42, item 5): its warm run is warm. The second compile of
the same job, a new process on the cache directory the first one filled, hits Inductor's
FX-graph and AOTAutograd caches; its first version spawned ``benchmarks.kernels``' worker,
which switches the caches off, and its "warm" runs recompiled everything but the C++.
An ap configuration's warm run hits AOTAutograd's cache as plain's does (it bypassed it until
the second compilation's call of the first compilation was keyed by the first's content), so
one test holds both: the worker keeps the caches on, and ap's warm run is served by both.

And a restarted job of the copy-free bucket form runs: its warm FX-graph cache serves code that
calls ``ap_bucketing::pack_shards`` without running the pass that first registered the op
(``AttributeError: ... no attribute 'pack_shards'`` until the pass registered it when made)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

#: the one-layer kit (``benchmarks.kernels.QUICK_KIT``)
QUICK = {"dim": 64, "n_layers": 1, "n_heads": 4, "ffn_dim": 128, "vocab": 128, "seq_len": 64}


# two compiles of the one-layer kit, AC + prefetch + coalesced (~60 s alone, 117 s in a CI run
# on 2 cores): heavy; a restart served by the caches is held in CI by ap-backend's
# test_first_compilation_reuse.py and test_first_compilation_key.py
@pytest.mark.heavy
@pytest.mark.slow
def test_a_restarted_copy_free_job_runs_from_the_warm_cache(
    tmp_path: Path, run_with_caches: Any
) -> None:
    job = ["-m", "benchmarks.compile_time", "--worker", "ap_full_prefetch", json.dumps(QUICK)]
    cold = run_with_caches(job, tmp_path)
    warm = run_with_caches(job, tmp_path)
    assert cold["caches"].get("inductor.fxgraph_cache_miss") == 2, cold["caches"]
    assert cold["caches"].get("aot_autograd.autograd_cache_saved") == 1, cold["caches"]
    # the second compilation's call of the first is keyed by the first's content
    # (ap_backend._aot_cache): AOTAutograd's cache serves it instead of bypassing it
    assert warm["caches"].get("aot_autograd.autograd_cache_hit") == 1, warm["caches"]
    assert warm["caches"].get("inductor.fxgraph_cache_hit") == 2, warm["caches"]
