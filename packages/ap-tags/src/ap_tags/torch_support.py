"""The convention every ap package follows for the torch internals it touches.

Each package keeps *all* private torch names it uses in one module, ``<package>/_compat.py``,
which starts with::

    TESTED_TORCH = ("2.13.0", "2.14.1", "2.15.0")   # the one place the tested versions live

    class UnsupportedTorchError(ap_tags.torch_support.UnsupportedTorchError): ...

    SUPPORT = TorchSupport("ap-<name>", TESTED_TORCH, UnsupportedTorchError)

and looks every internal up through ``SUPPORT`` (``SUPPORT.attr(...)``, ``SUPPORT.module(...)``)
at call time, never at import time. Whether an internal is usable is decided by feature
detection, never by comparing version strings; a missing one raises that package's
``UnsupportedTorchError`` naming the internal and the tested versions.

The package's ``__init__`` calls ``SUPPORT.warn_if_untested()``: on a torch of a newer release
series than every tested version (a nightly included) it logs one warning per process naming
the tested versions. That comparison only decides the warning, never a feature; the package's
torch requirement has no upper bound, so a nightly installs and runs.

ap-bucketing depends on torch only: its ``_compat`` follows the same convention with its own
small copy of the error type, and a cross-package test holds the two to the same message.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from types import ModuleType
from typing import Any

import torch

__all__ = ["TorchSupport", "UnsupportedTorchError", "describe_tested", "untested_message"]


def describe_tested(tested: tuple[str, ...]) -> str:
    """``"2.13.0, 2.14.1, 2.15.0"``: how messages name the tested versions."""
    return ", ".join(tested)


class UnsupportedTorchError(RuntimeError):
    """The installed torch lacks (or changed) an internal an ap package needs.

    ``package``, ``internal`` and ``tested`` say which package, which internal and which torch
    versions the package is tested on; the message says the same in one line.
    """

    def __init__(self, package: str, internal: str, tested: tuple[str, ...]) -> None:
        self.package = package
        self.internal = internal
        self.tested = tested
        super().__init__(
            f"{package} needs {internal}, which torch {torch.__version__} does not provide "
            f"(tested torch versions: {describe_tested(tested)})"
        )


class TorchSupport:
    """Feature-detected access to torch internals on behalf of one package."""

    def __init__(
        self, package: str, tested: tuple[str, ...], error: type[UnsupportedTorchError]
    ) -> None:
        self.package = package
        self.tested = tested
        self.error = error

    def missing(self, internal: str) -> UnsupportedTorchError:
        """The package's error for a missing ``internal`` (raise it)."""
        return self.error(self.package, internal, self.tested)

    def module(self, name: str) -> ModuleType:
        """Import torch internal module ``name`` or raise the package's error naming it."""
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            raise self.missing(name) from exc

    def attr(self, module_name: str, name: str) -> Any:
        """``module_name.name`` or the package's error naming it."""
        mod = self.module(module_name)
        if not hasattr(mod, name):
            raise self.missing(f"{module_name}.{name}")
        return getattr(mod, name)

    def has(self, module_name: str, name: str) -> bool:
        """Whether this torch provides ``module_name.name`` (a feature check that raises
        nothing: for code that takes another path where the internal is missing)."""
        try:
            self.attr(module_name, name)
        except self.error:
            return False
        return True

    def attrs(self, module_name: str, names: tuple[str, ...]) -> ModuleType:
        """``module_name`` after checking that it provides every one of ``names``."""
        mod = self.module(module_name)
        missing = [n for n in names if not hasattr(mod, n)]
        if missing:
            raise self.missing(", ".join(f"{module_name}.{n}" for n in missing))
        return mod

    def warn_if_untested(self) -> bool:
        """Log :func:`untested_message` once per process, as a WARNING of the package's logger
        (``ap-epchunk`` logs to ``ap_epchunk``); True when it logged now. Changes nothing in
        torch."""
        message = untested_message(self.package, self.tested, str(torch.__version__))
        with _WARNED_LOCK:
            if message is None or self.package in _WARNED:
                return False
            _WARNED.add(self.package)
        logging.getLogger(self.package.replace("-", "_")).warning(message)
        return True


#: Packages that have logged :func:`untested_message` in this process.
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def _series(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``"2.16.0.dev20261101+cpu"`` -> ``(2, 16)``)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return None if found is None else (int(found[1]), int(found[2]))


def untested_message(package: str, tested: tuple[str, ...], version: str) -> str | None:
    """The warning for torch ``version`` when its release series (major.minor) is newer than
    every tested one -- ``2.16.0.dev20261101`` against ``2.15.0`` -- else None (a patch release
    of a tested series, an older torch, an unparsable version)."""
    current = _series(version)
    if current is None or any(current <= s for s in map(_series, tested) if s is not None):
        return None
    return (
        f"{package} is tested on torch {describe_tested(tested)}; torch {version} is newer. "
        f"A torch internal {package} needs that is missing or changed raises its "
        f"UnsupportedTorchError naming the internal"
    )
