"""The seam's shared pieces: the tested torch versions, the error a missing internal raises,
the ``SUPPORT`` lookup every themed module of :mod:`ap_backend._compat` goes through, and the
dotted names of the torch modules more than one of them reads."""

from __future__ import annotations

from ap_tags import torch_support

#: The torch versions ap-backend is tested on (the only place they are written).
TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")


class UnsupportedTorchError(torch_support.UnsupportedTorchError):
    """A torch internal ap-backend relies on is missing from the installed torch."""


SUPPORT = torch_support.TorchSupport("ap-backend", TESTED_TORCH, UnsupportedTorchError)

_INDUCTOR_CONFIG = "torch._inductor.config"
_FUNCTORCH_CONFIG = "torch._functorch.config"
_COMPILE_FX = "torch._inductor.compile_fx"
_CUSTOM_GRAPH_PASS = "torch._inductor.custom_graph_pass"
_AOT_AUTOGRAD = "torch._functorch.aot_autograd"
#: The logger ``TORCH_TRACE`` attaches its handler to (structured trace artifacts).
_TRACE_LOGGER = "torch.__trace"
