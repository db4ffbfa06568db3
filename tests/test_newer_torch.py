"""Importing any ap package on a torch newer than its tested versions logs that package's one
warning naming them (``ap_tags.torch_support.TorchSupport.warn_if_untested``; ap-bucketing's own
copy in its ``_compat``), and nothing on a tested torch."""

from __future__ import annotations

import importlib
import logging

import ap_bucketing._compat
import pytest
import torch
from ap_tags import torch_support

PACKAGES = ("ap-tags", "ap-partitioner", "ap-bucketing", "ap-epchunk", "ap-backend")
NIGHTLY = "2.16.0.dev20261101"


@pytest.mark.parametrize("name", PACKAGES)
@pytest.mark.parametrize("version", [NIGHTLY, None])
def test_import_on_a_newer_torch_warns_once_per_package(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    name: str,
    version: str | None,
) -> None:
    module = importlib.import_module(name.replace("-", "_"))
    monkeypatch.setattr(torch_support, "_WARNED", set())
    monkeypatch.setattr(ap_bucketing._compat, "_WARNED", set())
    if version is not None:
        monkeypatch.setattr(torch, "__version__", version)
    with caplog.at_level(logging.WARNING):
        importlib.reload(module)
        importlib.reload(module)  # a second import in the same process says nothing more
    got = [r.getMessage() for r in caplog.records if r.name == module.__name__]
    if version is None:  # the locked torch is a tested one
        assert str(torch.__version__).startswith(module.TESTED_TORCH), torch.__version__
        assert got == []
        return
    tested = ", ".join(module.TESTED_TORCH)
    assert len(got) == 1, got
    assert got[0].startswith(f"{name} is tested on torch {tested}; torch {NIGHTLY} is newer")
