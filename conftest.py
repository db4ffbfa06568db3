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
# Two xdist workers share the machine's cores (pyproject's `-n 2`): each gets half of them for
# intra-op threads, and compiles its C++ kernels itself instead of starting a compile-worker
# pool (one per worker and per spawned rank, each importing torch). On 2 cores this measured
# 266 s against 287 s for a 4-file subset. The xdist workers and the ranks tests spawn inherit
# both through the environment; a value already set wins.
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # The first pytest process makes the directory; its xdist workers and the subprocesses tests
    # spawn inherit it through the environment. Removed when that process exits (before, every
    # run and every worker left one behind in the temp dir).
    _CACHE_DIR = tempfile.mkdtemp(prefix="ap-inductor-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config: object, items: list[Any]) -> None:
    """Run the tests marked ``slow`` first.

    Why: the suite runs on two pytest-xdist workers, one test file per work unit, in collection
    order (``--dist loadfile --no-loadscope-reorder`` in pyproject.toml). A few files take minutes
    (the zoo, the README examples, the benchmark smoke run); started last, one of them would
    keep a worker busy long after the other ran out of work. Started first, the many short
    files fill the gaps. A stable sort: the order within each group is collection order.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
