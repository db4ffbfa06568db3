"""Workspace-wide pytest setup.

Inductor's FX-graph and AOTAutograd caches silently skip custom partitioners and graph passes
when they hit (a partitioner's ``uuid()`` of ``None`` does not bypass them), so every test run
disables both and compiles into a private cache directory. This must happen before torch is
imported, which is why it lives in the root conftest and not in a fixture.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # The first pytest process makes the directory; its xdist workers and the subprocesses tests
    # spawn inherit it through the environment. Removed when that process exits (before, every
    # run and every worker left one behind in the temp dir).
    _CACHE_DIR = tempfile.mkdtemp(prefix="ap-inductor-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)


#: Seconds each of the slowest test files took in a fresh-clone CI run on the 2-core machine
#: (2026-11-28, stop 52's durations plus the tests added since). A scheduling hint only: a
#: stale or missing entry changes the order, never what runs.
_CI_SECONDS = {
    "tests/test_zoo.py": 500,
    "tests/test_graph_trainer.py": 310,
    "tests/test_ep_routes.py": 254,
    "tests/test_bucketing_stock_compile.py": 220,
    "tests/test_cli.py": 213,
    "tests/test_readme_examples.py": 200,
    "tests/test_peak_memory.py": 189,
    "tests/test_multirank_gloo.py": 180,
    "tests/test_ep_chunk_backend.py": 173,
    "tests/test_loss_tail_replay.py": 155,
    "tests/test_hf_models.py": 128,
    "tests/test_activation_budget.py": 125,
    "tests/test_backward_module_fqns.py": 112,
    "tests/test_meshes.py": 109,
    "packages/ap-epchunk/tests/test_graph_safety.py": 104,
    "packages/ap-backend/tests/test_gpu.py": 97,
    "packages/ap-epchunk/tests/test_runtime_property.py": 90,
    "tests/test_first_partition_sweep.py": 89,
    "tests/test_ep_property.py": 77,
    "tests/test_benchmarks_smoke.py": 66,
    "tests/test_ep_schedule.py": 64,
    "packages/ap-backend/tests/test_first_compilation_reuse.py": 63,
}


def pytest_collection_modifyitems(config: object, items: list[Any]) -> None:
    """Run the longest test files first, then the other tests marked ``slow``, then the rest.

    Why: the suite runs on two pytest-xdist workers, one test file per work unit, in collection
    order (``--dist loadfile --no-loadscope-reorder`` in pyproject.toml), and a worker is handed
    its next file while its current one still has two tests to go. A few files take minutes
    (the zoo, torchtitan's own trainer, the EP routes); started last, one of them would keep a
    worker busy long after the other ran out of work. Longest first (``_CI_SECONDS``, marked
    ``slow`` or not), then the other slow files, then the many short files, which fill the
    gaps. A stable sort: the order within each group is collection order.
    """
    root = getattr(config, "rootpath", None)

    def key(item: Any) -> tuple[int, bool]:
        path = str(item.path)
        if root is not None:
            path = os.path.relpath(path, root)
        return -_CI_SECONDS.get(path, 0), item.get_closest_marker("slow") is None

    items.sort(key=key)
