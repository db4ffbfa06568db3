"""pytest plugin of the ap workspace (auto-loaded through the ``pytest11`` entry point).

Fixtures every package's tests share, so no test directory copies them or edits ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .distributed import fake_world
from .graphs import Builder


@pytest.fixture
def fake_pg() -> Iterator[str]:
    """The default process group on torch's ``fake`` backend (world size 8) for one test;
    yields the group name. Structure only: its data is garbage."""
    with fake_world() as group_name:
        yield group_name


@pytest.fixture
def build() -> type[Builder]:
    """The hand-built graph :class:`~ap_testing.graphs.Builder` class."""
    return Builder
