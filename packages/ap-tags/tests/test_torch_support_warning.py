"""``TorchSupport.warn_if_untested``: on a torch of a newer release series than every tested
version, one WARNING per process per package, naming the package, that torch and the tested
versions; nothing on a tested series (patch releases included) or an older torch."""

from __future__ import annotations

import importlib
import logging

import ap_tags
import pytest
import torch
from ap_tags import torch_support

TESTED = ("2.13.0", "2.14.1", "2.15.0")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A process in which no package has warned yet."""
    monkeypatch.setattr(torch_support, "_WARNED", set())
    return monkeypatch


def _support() -> torch_support.TorchSupport:
    return torch_support.TorchSupport("ap-demo", TESTED, torch_support.UnsupportedTorchError)


@pytest.mark.parametrize("version", ["2.16.0.dev20261101", "2.16.0.dev20261101+cpu", "3.0.0"])
def test_a_newer_torch_logs_one_warning_naming_the_tested_versions(
    fresh: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, version: str
) -> None:
    fresh.setattr(torch, "__version__", version)
    with caplog.at_level(logging.WARNING, logger="ap_demo"):
        assert _support().warn_if_untested() is True
        assert _support().warn_if_untested() is False  # once per process
    records = [r for r in caplog.records if r.name == "ap_demo"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert message == torch_support.untested_message("ap-demo", TESTED, version)
    assert "ap-demo" in message and f"torch {version}" in message
    assert "2.13.0, 2.14.1, 2.15.0" in message and "UnsupportedTorchError" in message


@pytest.mark.parametrize(
    "version", ["2.15.0", "2.15.1", "2.14.0", "2.13.0a0+git1234", "2.12.1", "?"]
)
def test_a_tested_series_or_older_torch_logs_nothing(
    fresh: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, version: str
) -> None:
    fresh.setattr(torch, "__version__", version)
    with caplog.at_level(logging.DEBUG):
        assert _support().warn_if_untested() is False
    assert not caplog.records
    assert torch_support.untested_message("ap-demo", TESTED, version) is None


def test_importing_ap_tags_on_a_newer_torch_warns_once(
    fresh: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fresh.setattr(torch, "__version__", "2.16.0.dev20261101")
    with caplog.at_level(logging.WARNING, logger="ap_tags"):
        importlib.reload(ap_tags)
        importlib.reload(ap_tags)
    records = [r for r in caplog.records if r.name == "ap_tags"]
    assert [r.getMessage() for r in records] == [
        torch_support.untested_message("ap-tags", ap_tags.TESTED_TORCH, "2.16.0.dev20261101")
    ]


def test_has_answers_without_raising() -> None:
    support = _support()
    assert support.has("torch.fx", "Graph")
    assert not support.has("torch.fx", "no_such_internal")
    assert not support.has("torch.no_such_module", "Graph")
