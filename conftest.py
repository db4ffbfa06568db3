"""Workspace-wide pytest setup.

Inductor's FX-graph and AOTAutograd caches silently skip custom partitioners and graph passes
when they hit (a partitioner's ``uuid()`` of ``None`` does not bypass them), so every test run
disables both and compiles into a private cache directory. This must happen before torch is
imported, which is why it lives in the root conftest and not in a fixture.
"""

from __future__ import annotations

import os
import tempfile

os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ap-inductor-cache-"))
