"""pytest plugin of the ap workspace (auto-loaded through the ``pytest11`` entry point).

Fixtures every package's tests share, so no test directory copies them or edits ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .devices import cuda_skip_reason
from .distributed import fake_world
from .graphs import Builder


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        choices=("all", "cpu", "cuda"),
        default="all",
        help="device-parametrized (gpu-marked) tests: run the cpu twins, the cuda variants or "
        "both (default: all; the cuda variants skip without CUDA)",
    )


def _device_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    device = None if callspec is None else callspec.params.get("device")
    return device if isinstance(device, str) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--device cpu|cuda`` deselects the other device's variants."""
    wanted = config.getoption("--device", default="all")
    if wanted == "all":
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        device = _device_of(item)
        (drop if device is not None and device != wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A cuda variant skips, naming why, where CUDA is not available."""
    if _device_of(item) == "cuda" and (reason := cuda_skip_reason()) is not None:
        pytest.skip(reason)


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
