"""Warm Inductor caches never serve a graph compiled under another joint pass.

Why: torch keys its FX-graph and AOTAutograd caches on the custom partitioner's ``uuid()`` but
leaves ``torch._functorch.config.joint_custom_pass`` -- where the backend runs AC staging and
EP chunking -- out of the key. The EP route matrix found it: with caches on, a backend asked for
N = 4 chunks was served the N = 2 graph of the compile before it, and its chunk pass never ran.
The partitioner's uuid now carries the joint pass's options (``MeasuringPartitioner.joint_key``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ap_epchunk
import pytest
from ap_backend import autoparallel_backend


def _uuid(**options: object) -> str:
    return str(autoparallel_backend(**options)._partitioner.uuid())  # type: ignore[arg-type]


def test_the_partitioner_key_changes_with_every_joint_pass_option() -> None:
    chunks = [ap_epchunk.ChunkConfig(("layers.*",), num_chunks=n) for n in (2, 4)]
    keys = [
        _uuid(),
        _uuid(enable_ac=True),
        _uuid(enable_ac=True, ac_stage_size_gib=0.5),
        _uuid(ep_chunk=chunks[0]),
        _uuid(ep_chunk=chunks[1]),
    ]
    assert len(set(keys)) == len(keys)
    assert _uuid(ep_chunk=chunks[0]) == keys[3]  # and is stable


_WARM_CACHE_RUN = """
import json
import ap_epchunk
import torch
from ap_backend import autoparallel_backend
from torch import nn


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


torch.manual_seed(0)
model = Blocks()
reports = {}
for n in (2, 4):
    torch._dynamo.reset()
    x = torch.randn(8, 16)
    ap_epchunk.mark_chunk_dim(x, 0, hint=8)
    config = ap_epchunk.ChunkConfig(
        ("layers.*",), num_chunks=n, schedule_overlap=False, exchange_lane=False
    )
    backend = autoparallel_backend(ep_chunk=config)
    torch.compile(model, backend=backend)(x).sum().backward()
    reports[n] = len(backend.chunk_reports)
print(json.dumps(reports))
"""


@pytest.mark.slow
def test_a_warm_cache_does_not_serve_another_chunk_count(tmp_path: Path) -> None:
    # the caches on, in a process of its own: the test session forces both off (conftest),
    # and torch reads those variables once, at import
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _WARM_CACHE_RUN],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reports["2"] == 1
    # N = 4 chunked its own graph: not a cache hit of the N = 2 graph
    assert reports["4"] == 1, "the N=4 backend was served the cached N=2 graph"


def test_the_code_hash_covers_a_package_s_subpackages(tmp_path: Path) -> None:
    """The code a key stands for is every ``*.py`` under a package, subpackages included:
    ap-backend's compat seam is a subpackage (``ap_backend/_compat/``), and an edit there (a
    changed lookup of a torch internal) must miss the caches as an edit of a top-level module
    does. Two copies of a package that differ only in a subpackage's module hash apart (torch's
    ``get_hash_for_files`` hashes the files' bytes, not their paths)."""
    import types

    from ap_backend import _compat

    def package(name: str, sub_text: str) -> types.ModuleType:
        root = tmp_path / name
        (root / "sub").mkdir(parents=True)
        (root / "__init__.py").write_text("x = 1\n")
        (root / "sub" / "__init__.py").write_text("")
        (root / "sub" / "mod.py").write_text(sub_text)
        module = types.ModuleType(name)
        module.__file__ = str(root / "__init__.py")
        return module

    same = [_compat.hash_package_sources([package(n, "y = 1\n")]) for n in ("a", "b")]
    assert same[0] == same[1]
    edited = _compat.hash_package_sources([package("c", "y = 2\n")])
    assert edited != same[0]
