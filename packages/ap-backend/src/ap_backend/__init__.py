"""The torch.compile backend composing the ap passes.

* :func:`autoparallel_backend` -- the backend (SaveAll partitioner, AC staging, overlap
  scheduling, topo-span-bounded bucketing, EP chunking), every torch setting it touches scoped
  to its compile calls (see ``docs/architecture.md``, "Backend scopes");
* :func:`precompile` -- the first compilation whose tags the backend replays, returning a
  :class:`PrecompiledModule` (one :class:`FirstCompilation` per train/eval mode and input
  signature, made on first use); :class:`PrecompileError` -- what cannot be traced into one
  graph (a would-be graph break), with the op, the source line and the way out;
* :func:`measure_saved` / :class:`SavedSummary` -- what a partition saves for backward,
  measured one way for every partitioner; :func:`is_all_gather_output` is
  ``ap_tags.graph.is_all_gather_output`` (one definition for every package);
* :data:`TESTED_TORCH` / :class:`UnsupportedTorchError` -- the torch versions ap-backend is
  tested on, and the error a missing torch internal raises;
* :mod:`ap_backend.models` -- a small FSDP-style model kit;
* :mod:`ap_backend.demo` -- the application: gloo ranks, the eager-checked training loop and
  the ``ap-backend demo`` table (the console script is :mod:`ap_backend.cli`).
"""

from importlib.metadata import version as _distribution_version

from ap_tags.graph import is_all_gather_output

from ap_backend._backend import AutoParallelBackend, autoparallel_backend
from ap_backend._compat import SUPPORT as _TORCH_SUPPORT
from ap_backend._compat import TESTED_TORCH, UnsupportedTorchError
from ap_backend._first_compilation import FirstCompilation
from ap_backend._measure import measure_saved
from ap_backend._precompile import PrecompiledModule, precompile
from ap_backend._saved import SavedSummary
from ap_backend._trace import PrecompileError

__version__: str = _distribution_version("ap-backend")
_TORCH_SUPPORT.warn_if_untested()  # one warning on a torch newer than every TESTED_TORCH

__all__ = [
    "TESTED_TORCH",
    "AutoParallelBackend",
    "FirstCompilation",
    "PrecompileError",
    "PrecompiledModule",
    "SavedSummary",
    "UnsupportedTorchError",
    "__version__",
    "autoparallel_backend",
    "is_all_gather_output",
    "measure_saved",
    "precompile",
]
