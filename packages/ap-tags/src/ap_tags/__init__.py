"""Node-meta tagging schema for two-stage torch.compile pipelines.

Every key the ap packages write or read, typed accessors for them, a validator, and the passes
that write them: saved-output tagging for the first compilation, the meta-preserving fw/bw
compiler that carries tags into the second, FSDP all-gather chain tagging, module-FQN
annotation, and the staged activation-checkpointing joint pass.

Public submodules shared by every ap package that depends on ap-tags:

* :mod:`ap_tags.graph` -- the graph vocabulary (collective kinds, waits, storage, direction,
  sizes), each predicate defined once;
* :mod:`ap_tags.counting` -- ``count_saved``: the one count (tensors, storages, bytes per
  storage, symbols) of what a partition saved for backward, shared by every report;
* :mod:`ap_tags.checks` -- argument checks (``TypeError`` for a wrong type, ``ValueError`` for a
  wrong value, both naming the entry point and the argument);
* :mod:`ap_tags.scoped` -- scoped, nestable, thread-safe process-wide patches;
* :mod:`ap_tags.torch_support` -- the torch-compatibility convention (tested versions,
  ``UnsupportedTorchError``).
"""

from __future__ import annotations

from importlib.metadata import version as _distribution_version

from . import checks, counting, graph, scoped, torch_support
from ._ac_stages import (
    AcJointPass,
    AcStageReport,
    ac_joint_pass,
    check_stage_size,
    mark_ac_stages,
)
from ._accessors import (
    ac_graph_id,
    custom_meta,
    is_must_save,
    mark_must_save,
    module_fqn,
    must_save_indices,
    recompute_policy,
    set_recompute,
)
from ._compat import SUPPORT as _TORCH_SUPPORT
from ._compat import TESTED_TORCH, UnsupportedTorchError
from ._compiler import InterpretedGraph, preserve_meta_compiler
from ._errors import TagError, TagSchemaError
from ._fsdp import (
    FsdpChain,
    FsdpTagReport,
    is_fsdp_chain_all_gather,
    mark_fsdp_all_gather_recomputation,
)
from ._keys import (
    AC_GRAPH_ID,
    CHUNK_GLUE,
    CHUNK_INDEX,
    CHUNK_REGION,
    CUSTOM,
    FSDP_AC_GRAPH_ID,
    MODULE_FQN,
    MUST_SAVE,
    MUST_SAVE_INDICES,
    PROJECT_CUSTOM_KEYS,
    RECOMPUTE,
    TAG_SCHEMA,
    TAG_SCHEMA_VERSION,
)
from ._module_fqns import annotate_module_fqns
from ._recomputed import release_recomputed_saves, unmark_forward_graph
from ._replay import ReplayedSaves, first_partition_name, replayed_saves
from ._saved import SavedOutputsReport, infer_num_fwd_outputs, tag_saved_outputs
from ._validate import node_tag_problems, validate_tags

__version__: str = _distribution_version("ap-tags")
_TORCH_SUPPORT.warn_if_untested()  # one warning on a torch newer than every TESTED_TORCH

__all__ = [
    "AC_GRAPH_ID",
    "CHUNK_GLUE",
    "CHUNK_INDEX",
    "CHUNK_REGION",
    "CUSTOM",
    "FSDP_AC_GRAPH_ID",
    "MODULE_FQN",
    "MUST_SAVE",
    "MUST_SAVE_INDICES",
    "PROJECT_CUSTOM_KEYS",
    "RECOMPUTE",
    "TAG_SCHEMA",
    "TAG_SCHEMA_VERSION",
    "TESTED_TORCH",
    "AcJointPass",
    "AcStageReport",
    "FsdpChain",
    "FsdpTagReport",
    "InterpretedGraph",
    "SavedOutputsReport",
    "ReplayedSaves",
    "TagError",
    "TagSchemaError",
    "UnsupportedTorchError",
    "__version__",
    "ac_graph_id",
    "ac_joint_pass",
    "check_stage_size",
    "checks",
    "counting",
    "graph",
    "scoped",
    "torch_support",
    "annotate_module_fqns",
    "custom_meta",
    "infer_num_fwd_outputs",
    "mark_ac_stages",
    "is_fsdp_chain_all_gather",
    "is_must_save",
    "mark_fsdp_all_gather_recomputation",
    "mark_must_save",
    "module_fqn",
    "must_save_indices",
    "node_tag_problems",
    "preserve_meta_compiler",
    "recompute_policy",
    "release_recomputed_saves",
    "unmark_forward_graph",
    "first_partition_name",
    "replayed_saves",
    "set_recompute",
    "tag_saved_outputs",
    "validate_tags",
]
