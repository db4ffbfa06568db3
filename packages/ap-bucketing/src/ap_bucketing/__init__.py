"""Topo-span-bounded FSDP collective bucketing for Inductor.

Importing this package changes nothing in torch. Use ``patched(config)`` / ``install(config)``
to replace torch's FSDP group detection and greedy collective bucketer, the pure functions to
bucket a graph yourself, or ``OverlapBucketingPass`` / ``overlap_config_patches`` to get FSDP
pre-bucketing + overlap scheduling through Inductor's ``post_grad_custom_post_pass``.
"""

from importlib.metadata import version as _distribution_version

from ._compat import TESTED_TORCH, UnsupportedTorchError
from ._compat import warn_if_untested as _warn_if_untested
from ._config import BucketingConfig
from ._cpu_estimation import cpu_overlap_estimators, cpu_runtime_estimation
from ._greedy import bucket_collectives
from ._groups import primary_fsdp_groups
from ._liveness import max_gathered_bytes
from ._metrics import max_consec_compute_between_rs
from ._overlap import OverlapBucketingPass, overlap_config_patches
from ._patching import current_config, install, is_installed, patched, uninstall
from ._sizes import MissingValueError
from ._stats import (
    BucketingStats,
    add_stats_observer,
    collect_stats,
    remove_stats_observer,
)

__version__: str = _distribution_version("ap-bucketing")
_warn_if_untested()  # one warning on a torch newer than every TESTED_TORCH

__all__ = [
    "TESTED_TORCH",
    "BucketingConfig",
    "BucketingStats",
    "MissingValueError",
    "OverlapBucketingPass",
    "UnsupportedTorchError",
    "__version__",
    "add_stats_observer",
    "bucket_collectives",
    "collect_stats",
    "cpu_overlap_estimators",
    "cpu_runtime_estimation",
    "current_config",
    "install",
    "is_installed",
    "max_consec_compute_between_rs",
    "max_gathered_bytes",
    "overlap_config_patches",
    "patched",
    "primary_fsdp_groups",
    "remove_stats_observer",
    "uninstall",
]
