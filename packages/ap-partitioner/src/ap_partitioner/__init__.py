"""Save-all partitioner that replays the first compilation's saved set.

The save rules are in ``docs/architecture.md``, "Save rules". Every private torch name the
package touches is behind ``ap_partitioner._compat``; ``TESTED_TORCH`` lists the torch versions
it is tested on and :class:`UnsupportedTorchError` names an internal a torch lacks.
"""

from importlib.metadata import version as _distribution_version

from ap_tags.graph import is_all_gather_output

from ap_partitioner._budget import (
    BudgetError,
    BudgetOutcome,
    DroppedSave,
    check_activation_budget,
    fit_to_budget,
)
from ap_partitioner._compat import SUPPORT as _TORCH_SUPPORT
from ap_partitioner._compat import TESTED_TORCH, UnsupportedTorchError
from ap_partitioner._dce import wait_tensor_dce
from ap_partitioner._partitioner import (
    MinCutPartitioner,
    ReplayError,
    SaveAllPartitioner,
    report_for,
)
from ap_partitioner._report import PartitionReport
from ap_partitioner._rules import SavePlan, plan_saves

__version__: str = _distribution_version("ap-partitioner")
_TORCH_SUPPORT.warn_if_untested()  # one warning on a torch newer than every TESTED_TORCH

__all__ = [
    "TESTED_TORCH",
    "BudgetError",
    "BudgetOutcome",
    "DroppedSave",
    "MinCutPartitioner",
    "PartitionReport",
    "ReplayError",
    "SavePlan",
    "SaveAllPartitioner",
    "UnsupportedTorchError",
    "__version__",
    "check_activation_budget",
    "fit_to_budget",
    "is_all_gather_output",
    "plan_saves",
    "report_for",
    "wait_tensor_dce",
]
