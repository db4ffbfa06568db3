"""Every private torch name ap-backend uses, looked up at call time and feature-detected.

See :mod:`ap_tags.torch_support` for the convention all ap packages follow. Nothing here runs
at import time: importing ``ap_backend`` on a torch that lacks one of these internals works,
and the feature that needs it raises :class:`UnsupportedTorchError` naming it.

The seam is this package, one module per concern (``_config``, ``_inductor``, ``_tracing``,
``_logs``, ``_collectives``, ``_patches``, ``_nonstrict``; ``_support`` holds the shared
``SUPPORT`` lookup). Callers use the names re-exported here (``_compat.caches_on()``), looked
up on this module at call time, so a test's ``monkeypatch.setattr(_compat, ...)`` reaches them.
"""

from __future__ import annotations

from ._collectives import (
    all_gather_wait,
    all_to_all_wait,
    grouped_mm,
    load_functional_collectives,
    require_grouped_mm,
)
from ._config import (
    caches_on,
    config_snapshot,
    configs_as,
    dynamo_config_patch,
    functorch_config_patch,
    inductor_cache_dir,
    inductor_config_patch,
    inductor_has_option,
    marked_cacheable_functions,
    portable_configs,
)
from ._inductor import (
    aot_autograd_backend,
    as_custom_partitioner,
    compile_fx,
    compile_fx_inner,
    custom_partitioner_type,
    default_partition,
    hash_files,
    hash_package_sources,
    inductor_decompositions,
    inductor_joint_graph_passes,
    inductor_partition_fn,
    is_custom_partitioner,
    min_cut_partition,
    partitioner_op_types,
)
from ._logs import (
    FSDP_PASS_LOGGER,
    structured_tracing,
    trace_structured,
    unprinted_joint_compile,
)
from ._nonstrict import (
    fake_script_object_class,
    is_nonstrict_capture,
    leaf_callable_function,
    leaf_callable_like,
    nonstrict_trace,
    op_overload_type,
    operator_types,
)
from ._patches import (
    BACKWARD_CUSTOM_MERGE,
    FIRST_PARTITION_RNG_RULE,
    metadata_copy_replaces_custom,
)
from ._support import SUPPORT, TESTED_TORCH, UnsupportedTorchError
from ._tracing import (
    COMPILING,
    custom_op_functions,
    data_dependent_errors,
    dynamic_dim_marks,
    fake_mode_with_shape_env,
    fake_propagation_mode,
    fake_tree,
    global_module_backward_hooks,
    joint_export_api,
    make_fx,
    pristine_fx_traceback,
    pytree,
    tree_leaves_with_path,
)

__all__ = [
    "BACKWARD_CUSTOM_MERGE",
    "COMPILING",
    "FIRST_PARTITION_RNG_RULE",
    "FSDP_PASS_LOGGER",
    "SUPPORT",
    "TESTED_TORCH",
    "UnsupportedTorchError",
    "all_gather_wait",
    "all_to_all_wait",
    "aot_autograd_backend",
    "as_custom_partitioner",
    "caches_on",
    "compile_fx",
    "compile_fx_inner",
    "config_snapshot",
    "configs_as",
    "custom_op_functions",
    "custom_partitioner_type",
    "data_dependent_errors",
    "default_partition",
    "dynamic_dim_marks",
    "dynamo_config_patch",
    "fake_mode_with_shape_env",
    "fake_propagation_mode",
    "fake_script_object_class",
    "fake_tree",
    "functorch_config_patch",
    "global_module_backward_hooks",
    "grouped_mm",
    "hash_files",
    "hash_package_sources",
    "inductor_cache_dir",
    "inductor_config_patch",
    "inductor_decompositions",
    "inductor_has_option",
    "inductor_joint_graph_passes",
    "inductor_partition_fn",
    "is_custom_partitioner",
    "is_nonstrict_capture",
    "joint_export_api",
    "leaf_callable_function",
    "leaf_callable_like",
    "load_functional_collectives",
    "make_fx",
    "marked_cacheable_functions",
    "metadata_copy_replaces_custom",
    "min_cut_partition",
    "nonstrict_trace",
    "op_overload_type",
    "operator_types",
    "partitioner_op_types",
    "portable_configs",
    "pristine_fx_traceback",
    "pytree",
    "require_grouped_mm",
    "structured_tracing",
    "trace_structured",
    "tree_leaves_with_path",
    "unprinted_joint_compile",
]
