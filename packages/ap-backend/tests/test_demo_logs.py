"""ap-backend demo's output is its own lines unless --verbose: the filters that drop torch's
INFO lines and the no-CUDA warning, scoped to the demo (no ranks spawned; the end-to-end check
is tests/test_cli.py::test_demo_subprocess_table_agrees_with_json)."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
from ap_backend.cli import _parser
from ap_backend.demo._quiet import QUIET_DEMO_LOGS, QUIET_ENV, quiet_from_env, quiet_torch_logs

FSDP = logging.getLogger("torch._inductor.fx_passes.fsdp")
CPP = logging.getLogger("torch.utils.cpp_extension")


def _passes(logger: logging.Logger, level: int, msg: str) -> bool:
    record = logger.makeRecord(logger.name, level, __file__, 1, msg, (), None)
    return bool(logger.filter(record))


def _observed() -> dict[str, bool]:
    return {
        "fsdp info": _passes(FSDP, logging.INFO, "pre_bucket_fsdp_collectives: fsdp_groups=%s"),
        "fsdp warning": _passes(FSDP, logging.WARNING, "a real fsdp warning"),
        "fsdp error": _passes(FSDP, logging.ERROR, "a real fsdp error"),
        "no cuda": _passes(CPP, logging.WARNING, "No CUDA runtime is found, using CUDA_HOME='%s'"),
        "other cpp warning": _passes(CPP, logging.WARNING, "Error checking compiler version"),
    }


ALL_PASS = dict.fromkeys(
    ("fsdp info", "fsdp warning", "fsdp error", "no cuda", "other cpp warning"), True
)
QUIET = {**ALL_PASS, "fsdp info": False, "no cuda": False}


def test_filters_drop_only_the_two_kinds_of_line_and_come_off_again() -> None:
    assert _observed() == ALL_PASS
    undo = quiet_torch_logs()
    try:
        assert _observed() == QUIET
    finally:
        undo()
    assert _observed() == ALL_PASS


def test_the_demo_scope_quiets_this_process_and_tells_the_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(QUIET_ENV, raising=False)
    with QUIET_DEMO_LOGS:
        assert os.environ[QUIET_ENV] == "1"  # inherited by the spawned ranks
        assert _observed() == QUIET
    assert QUIET_ENV not in os.environ
    assert _observed() == ALL_PASS


def test_a_rank_quiets_itself_only_when_the_demo_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(QUIET_ENV, raising=False)
    assert quiet_from_env() is False
    assert _observed() == ALL_PASS
    monkeypatch.setenv(QUIET_ENV, "1")
    before = (list(FSDP.filters), list(CPP.filters))
    try:
        assert quiet_from_env() is True
        assert _observed() == QUIET
    finally:
        FSDP.filters[:], CPP.filters[:] = before


def test_verbose_is_a_demo_option_off_by_default() -> None:
    assert _parser().parse_args(["demo"]).verbose is False
    assert _parser().parse_args(["demo", "--verbose"]).verbose is True


def _warns(message: str) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn(message, UserWarning, stacklevel=1)
    return bool(seen)


def test_torch_2_11_process_group_warnings_are_dropped_and_come_back() -> None:
    """torch 2.11/2.12's comm_analysis warns on every gloo compile in every rank."""
    pg = "`_get_pg_default_device` will be deprecated, it only stays for backward-compatibility"
    multiple = "Multiple backends are registered with this ProcessGroup. We cannot determine"
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert _warns(pg) and _warns(multiple) and _warns("another UserWarning")
        undo = quiet_torch_logs()
        try:
            assert not _warns(pg) and not _warns(multiple)
            assert _warns("another UserWarning")
        finally:
            undo()
        assert _warns(pg) and _warns(multiple)
