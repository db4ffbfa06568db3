"""Save-all partitioner that replays the first compilation's saved set (SPEC §4)."""

from ap_partitioner._compat import SUPPORTED_TORCH, UnsupportedTorchError
from ap_partitioner._dce import wait_tensor_dce
from ap_partitioner._partitioner import (
    MinCutPartitioner,
    ReplayError,
    SaveAllPartitioner,
    report_for,
)
from ap_partitioner._report import PartitionReport, is_all_gather_output
from ap_partitioner._rules import SavePlan, plan_saves

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_TORCH",
    "MinCutPartitioner",
    "PartitionReport",
    "ReplayError",
    "SavePlan",
    "SaveAllPartitioner",
    "UnsupportedTorchError",
    "__version__",
    "is_all_gather_output",
    "plan_saves",
    "report_for",
    "wait_tensor_dce",
]
