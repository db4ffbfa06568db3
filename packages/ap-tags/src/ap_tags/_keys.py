"""Every node-meta key the ap packages write or read.

All project keys live under ``node.meta["custom"]`` because that dict is one of the fields
``torch.fx.traceback.preserve_node_meta`` copies onto every node traced while an interpreted
node runs (``torch.fx.proxy._COPY_META_FIELDS``); anything stored elsewhere is lost when the
first compilation's graphs are retraced by the second. ``recompute``/``ac_graph_id`` are torch's
own top-level keys and keep torch's ``CheckpointPolicy`` semantics.
"""

from __future__ import annotations

from typing import Final

#: ``node.meta`` key of the dict that survives retracing.
CUSTOM: Final = "custom"
#: torch's activation-checkpoint policy key (value: ``CheckpointPolicy``).
RECOMPUTE: Final = "recompute"
#: torch's AC-region id key (int); adjacent regions with different ids get a MUST_SAVE boundary.
AC_GRAPH_ID: Final = "ac_graph_id"

#: ``custom`` key: True when the first partition saved this node's value for backward.
MUST_SAVE: Final = "ap_must_save"
#: ``custom`` key on a multi-output parent: the getitem indices the first partition saved.
MUST_SAVE_INDICES: Final = "ap_must_save_getitem_indices"
#: ``custom`` key: fully qualified name of the submodule the node was traced inside.
MODULE_FQN: Final = "module_fqn"
#: ``ac_graph_id`` value the project stamps on nodes it tags, so user AC regions stay apart.
FSDP_AC_GRAPH_ID: Final = 100000

#: ``custom`` key: index of the chunk a node computes (int, 0-based), set by ap-epchunk.
CHUNK_INDEX: Final = "ap_chunk_index"
#: ``custom`` key: the region pattern/FQN a chunked node belongs to (str), set by ap-epchunk.
CHUNK_REGION: Final = "ap_chunk_region"
#: ``custom`` key: True on the nodes ap-epchunk inserted to split or merge chunks.
CHUNK_GLUE: Final = "ap_chunk_glue"

#: ``custom`` key: the tag-schema version of the ap-tags that wrote the node's project keys.
TAG_SCHEMA: Final = "ap_tags_schema"
#: The tag schema this ap-tags writes and reads. It changes whenever a key's meaning changes,
#: so tags written by one ap-tags are never silently misread by another.
TAG_SCHEMA_VERSION: Final = 1

#: Every ``custom`` key the project owns; ``validate_tags`` checks these.
PROJECT_CUSTOM_KEYS: Final = (
    TAG_SCHEMA,
    MUST_SAVE,
    MUST_SAVE_INDICES,
    MODULE_FQN,
    CHUNK_INDEX,
    CHUNK_REGION,
    CHUNK_GLUE,
)
