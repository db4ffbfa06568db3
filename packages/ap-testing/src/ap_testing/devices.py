"""Device-parametrized tests: the CUDA tests and their CPU twins (the ``gpu`` marker).

A test written once, ``@pytest.mark.parametrize("device", DEVICES)``, runs the same code path on
CPU (in every ``uv run pytest``) and on CUDA (skipped with the reason where CUDA is not
available). ``--device cpu|cuda|all`` (the plugin's option, default ``all``) keeps one of them:
``scripts/gpu-check`` runs ``pytest -m gpu --device cuda`` on a GPU machine and ``--device cpu``
for its CPU path.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["DEVICES", "cuda_skip_reason"]

#: the ``device`` parametrization of a GPU-check test (both variants carry the ``gpu`` marker)
DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.gpu),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def cuda_skip_reason() -> str | None:
    """Why a CUDA test cannot run here (None when it can)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"no CUDA device available (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return None
