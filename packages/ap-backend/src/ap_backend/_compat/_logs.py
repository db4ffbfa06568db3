"""Loggers and the structured trace (``TORCH_TRACE``): whether anything reads AOTAutograd's graph
text, and the artifact writer.

Part of the compat seam (:mod:`ap_backend._compat`): every private torch name is looked up
at call time through ``SUPPORT``."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from ._support import SUPPORT, UnsupportedTorchError

#: The logger ``TORCH_TRACE`` attaches its handler to (structured trace artifacts).
_TRACE_LOGGER = "torch.__trace"

#: The logger of Inductor's FSDP pre-bucketing pass (INFO ``pre_bucket_fsdp_collectives: ...``
#: on every compile; the demo filters it unless ``--verbose``).
FSDP_PASS_LOGGER = "torch._inductor.fx_passes.fsdp"


def trace_structured() -> Callable[..., Any]:
    """``torch._logging.trace_structured``: writes an artifact into ``TORCH_TRACE``."""
    fn: Callable[..., Any] = SUPPORT.attr("torch._logging._internal", "trace_structured")
    return fn


def structured_tracing() -> bool:
    """Is ``TORCH_TRACE`` structured logging on (so artifact payloads are written)?

    Any handler on torch's trace logger counts, except torch's own ``LazyTraceHandler`` when
    it will drop itself at its first record: without a ``TORCH_TRACE`` directory, an
    open-source build's handler (``torch.version.git_version``, no ``MAST_HPC_JOB_NAME``)
    writes nothing and removes itself then, the rule its ``emit`` applies. Until a compile has
    logged once it is still attached, so a bare ``handlers`` check said "on" to every
    ``precompile`` that ran before the first ``torch.compile``."""
    return any(_trace_handler_writes(h) for h in logging.getLogger(_TRACE_LOGGER).handlers)


def _trace_handler_writes(handler: logging.Handler) -> bool:
    if type(handler).__name__ != "LazyTraceHandler":
        return True
    if getattr(handler, "stream", None) is not None or getattr(handler, "root_dir", None):
        return True
    import torch.version

    return not (hasattr(torch.version, "git_version") and os.getenv("MAST_HPC_JOB_NAME") is None)


_AOT_GRAPH_COMPILE = "torch._functorch._aot_autograd.graph_compile"


def unprinted_joint_compile(joint: Any) -> bool:
    """Stop AOTAutograd printing the graphs of ``joint``'s compile (``enable_log=False`` on
    its ``AOTConfig``) when nothing would read the text; returns whether it did.

    Why: ``aot_stage2_compile`` builds the joint, forward and backward graphs' full text
    (``print_readable``) whether or not any log or trace takes it, for the AOTAutograd cache
    entry, which an export-route compile (``precompile``'s first compilation) never writes.
    At 8 layers of the model kit that is 0.3-0.5 s of each cold ``precompile``. The text is
    still made when ``TORCH_TRACE`` is on or ``TORCH_LOGS`` asks for ``aot_graphs`` /
    ``aot_joint_graph``: the first compilation's graphs stay in tlparse and in the logs.
    Only logging reads ``enable_log``; a torch without the field is left as it is."""
    if structured_tracing() or _aot_graph_logs_on():
        return False
    state = getattr(joint, "_aot_state", None)
    config = getattr(state, "aot_config", None)
    if not hasattr(config, "enable_log"):
        return False
    state.aot_config = dataclasses.replace(config, enable_log=False)  # type: ignore[union-attr,type-var]
    return True


def _aot_graph_logs_on() -> bool:
    """Does ``TORCH_LOGS`` ask for AOTAutograd's graphs (``aot_graphs``, ``aot_joint_graph``)?
    A torch whose loggers are not where this looks counts as yes: its text is left alone."""
    try:
        module = SUPPORT.module(_AOT_GRAPH_COMPILE)
    except UnsupportedTorchError:
        return True
    loggers = [getattr(module, name, None) for name in ("aot_joint_log", "aot_graphs_log")]
    return any(
        not isinstance(logger, logging.Logger) or logger.isEnabledFor(logging.INFO)
        for logger in loggers
    )
