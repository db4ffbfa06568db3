"""The ap workspace's shared test kit (never published). See the package README."""

from __future__ import annotations

__all__: list[str] = []
