"""The zoo's configurations: which ``autoparallel_backend`` options each case name means."""

from __future__ import annotations

from typing import Any

from ap_bucketing import BucketingConfig

__all__ = [
    "AP_CONFIGS",
    "BACKEND_CONFIGS",
    "BUCKET_FORM_CONFIGS",
    "BUDGET_CONFIGS",
    "CONFIGS",
    "OPTION_CONFIGS",
]

#: The backend options of each ap configuration.
AP_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "ac": {"enable_ac": True},
    "full": {"enable_ac": True, "bucketing": True, "overlap_scheduling": True},
}
#: The full configuration with each of torch's bucket forms named explicitly (``full`` takes
#: ap-bucketing's default form): a user can pass either, so either must train correctly or be
#: refused. Not part of a whole-zoo run unless asked for (``--configs``).
BUCKET_FORM_CONFIGS: dict[str, dict[str, Any]] = {
    f"full_bucket_{mode}": {
        "enable_ac": True,
        "bucketing": BucketingConfig(bucket_mode=mode),
        "overlap_scheduling": True,
    }
    for mode in ("default", "custom_ops")
}
#: Each remaining backend option alone (issue #23 item 4: every option a user can pass runs at
#: 2 ranks or is refused): bucketing without overlap scheduling, overlap scheduling without
#: bucketing, torch's min-cut in place of the save-all replay, and ap-bucketing's own FSDP
#: schedule (``"prefetch"``, copy-free buckets) with and without AC. Not part of a whole-zoo
#: run unless asked for.
OPTION_CONFIGS: dict[str, dict[str, Any]] = {
    "bucket": {"bucketing": True},
    "overlap": {"overlap_scheduling": True},
    "min_cut": {"partitioner": "min_cut"},
    "prefetch": {"overlap_scheduling": "prefetch"},
    "full_prefetch": {"enable_ac": True, "overlap_scheduling": "prefetch"},
}
#: Every named configuration's backend options (the budget ones are sized per model: see
#: ``BUDGET_CONFIGS``).
BACKEND_CONFIGS: dict[str, dict[str, Any]] = {**AP_CONFIGS, **BUCKET_FORM_CONFIGS, **OPTION_CONFIGS}
#: The save-all replay under an activation budget, as a fraction of the first partition's saved
#: bytes (``autoparallel_backend(activation_budget_bytes=...)``, issue #25).
BUDGET_CONFIGS: dict[str, float] = {
    "budget_zero": 0.0,
    "budget_quarter": 0.25,
    "budget_half": 0.5,
    "budget_3q": 0.75,
}
CONFIGS: tuple[str, ...] = (
    "stock",
    *AP_CONFIGS,
    *BUCKET_FORM_CONFIGS,
    *OPTION_CONFIGS,
    *BUDGET_CONFIGS,
)
