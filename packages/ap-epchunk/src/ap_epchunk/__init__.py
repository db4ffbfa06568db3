"""Expert-parallel chunking of module regions and chunk-symbol concretization.

``chunk_pass(gm, ChunkConfig(...))`` splits the forward and backward regions of selected modules
of a joint graph into N chunks along the token dim; ``concretize_chunk_symbols(gm)`` then
replaces the chunk symbols by their hints before codegen. ``EagerChunked`` is the eager
numerical reference; ``schedule_chunk_overlap(gm)`` pipelines the chunks of every chunked
region so one chunk's token exchange runs under another chunk's compute; ``trace_joint`` traces a training step into a joint graph with the
metadata the pass reads.

``TESTED_TORCH`` lists the torch versions the package is tested on; ``UnsupportedTorchError``
(an ``ap_tags.torch_support.UnsupportedTorchError``, a ``RuntimeError``) is raised when the
installed torch lacks an internal the package needs.
"""

from importlib.metadata import version as _distribution_version

from ._compat import SUPPORT as _TORCH_SUPPORT
from ._compat import TESTED_TORCH, UnsupportedTorchError
from ._concretize import ConcretizeReport, concretize_chunk_symbols
from ._config import ChunkConfig, ChunkReport, RegionSummary
from ._eager import EagerChunked
from ._errors import ChunkError
from ._lane import LaneReport, exchange_lane
from ._marking import chunk_dims_of, chunk_inputs_from_marks, mark_chunk_dim
from ._passes import chunk_pass
from ._regions import (
    backward_module_fqns_lost,
    restore_backward_module_fqns,
    tag_backward_module_fqns,
    tag_recomputed_module_fqns,
)
from ._schedule import RegionSchedule, ScheduleReport, schedule_chunk_overlap
from ._tracing import fake_chunk_inputs, trace_joint

__version__: str = _distribution_version("ap-epchunk")
_TORCH_SUPPORT.warn_if_untested()  # one warning on a torch newer than every TESTED_TORCH

__all__ = [
    "ChunkConfig",
    "ChunkError",
    "ChunkReport",
    "ConcretizeReport",
    "EagerChunked",
    "LaneReport",
    "RegionSchedule",
    "RegionSummary",
    "ScheduleReport",
    "TESTED_TORCH",
    "UnsupportedTorchError",
    "__version__",
    "chunk_dims_of",
    "chunk_inputs_from_marks",
    "chunk_pass",
    "concretize_chunk_symbols",
    "exchange_lane",
    "fake_chunk_inputs",
    "mark_chunk_dim",
    "schedule_chunk_overlap",
    "backward_module_fqns_lost",
    "restore_backward_module_fqns",
    "tag_backward_module_fqns",
    "tag_recomputed_module_fqns",
    "trace_joint",
]
