"""ap-bucketing tests: scaffolding comes from ap-testing (its pytest plugin and modules); this
conftest only guarantees that no test leaks a patch into the next."""

from __future__ import annotations

from collections.abc import Iterator

import ap_bucketing
import pytest


@pytest.fixture(autouse=True)
def _never_leak_patches() -> Iterator[None]:
    """Every test starts and ends with torch unpatched (a leak would mask other tests)."""
    assert not ap_bucketing.is_installed()
    yield
    ap_bucketing.uninstall()
    assert not ap_bucketing.is_installed()
