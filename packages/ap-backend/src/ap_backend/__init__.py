"""The torch.compile backend composing the ap passes.

* :func:`autoparallel_backend` -- the backend (SaveAll partitioner, AC staging, overlap
  scheduling, topo-span-bounded bucketing, EP chunking);
* :func:`precompile` -- the first compilation whose tags the backend replays;
* :mod:`ap_backend.models` -- a small FSDP-style model kit;
* ``ap-backend demo`` -- the main job (see :mod:`ap_backend.cli`).
"""

from ap_backend._backend import AutoParallelBackend, autoparallel_backend
from ap_backend._measure import measure_saved
from ap_backend._precompile import PrecompiledModule, precompile
from ap_backend._saved import SavedSummary, is_all_gather_output

__version__ = "0.1.0"

__all__ = [
    "AutoParallelBackend",
    "PrecompiledModule",
    "SavedSummary",
    "__version__",
    "autoparallel_backend",
    "is_all_gather_output",
    "measure_saved",
    "precompile",
]
