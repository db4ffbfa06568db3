"""The seam's shared pieces: the tested torch versions, the error a missing internal raises,
and the ``SUPPORT`` lookup every themed module of :mod:`ap_backend._compat` goes through."""

from __future__ import annotations

from ap_tags import torch_support

#: The torch versions ap-backend is tested on (the only place they are written).
TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")


class UnsupportedTorchError(torch_support.UnsupportedTorchError):
    """A torch internal ap-backend relies on is missing from the installed torch."""


SUPPORT = torch_support.TorchSupport("ap-backend", TESTED_TORCH, UnsupportedTorchError)
