"""A first compilation made, or taken from the record a cold run of the same program left.

Why: on a warm cache the second compilation is served from AOTAutograd's cache and never runs
the first compilation's callable; making it (about 6 s at 8 layers of the model kit) was most
of a warm start. With Inductor's FX-graph and AOTAutograd caches on, ``precompile`` keys the
call before compiling anything (:mod:`ap_backend._program_key`, a fake-tensor trace of the
forward: about 0.5 s there) and looks for a record (:mod:`ap_backend._first_record`):

* none: the first compilation is made as always, and its record written;
* one: :class:`DeferredFirstCompilation` stands in for it, stamped with the recorded content
  key (what the second compilation's cache entry is filed under). Its first call -- the second
  compilation's retrace on a cache miss, or an eager call -- makes the first compilation then,
  in a thread of its own (so no trace of the caller's is active in it) and under the Inductor
  and functorch config ``precompile`` saw. A content key other than the recorded one raises
  :class:`~ap_backend._trace.PrecompileError` and drops the record: the compiled graph the key
  stood for is not this program's, and nothing is compiled from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ap_backend import _compat
from ap_backend._aot_cache import KEY_ATTRIBUTE, Unkeyable, stamp_first_compilation
from ap_backend._artifacts import emit_json
from ap_backend._first_compilation import (
    FirstCompilation,
    FirstOptions,
    default_first_partition,
    first_compilation,
    slots,
)
from ap_backend._first_record import FirstRecord, drop_record, load_record, save_record
from ap_backend._program_key import OutputSpec, program_key
from ap_backend._signature import call_signature
from ap_backend._trace import PrecompileError

__all__ = ["DeferredFirstCompilation", "deferred_of", "first_compilation_or_record"]

log = logging.getLogger(__name__)


def _describe_option(value: object) -> object:
    """An option as the key sees it: a joint pass by its ``uuid()`` (Inductor's custom-pass
    protocol, which ``ap_tags.ac_joint_pass()`` follows), anything else by value."""
    uuid = getattr(value, "uuid", None)
    return uuid() if callable(uuid) else value


def _key_options(options: FirstOptions) -> dict[str, object]:
    return {
        "reshard_after_forward": options.reshard_after_forward,
        "first_partition": options.first_partition,
        "joint_pass": _describe_option(options.joint_pass),
    }


class DeferredFirstCompilation:
    """A first compilation known from its record, made on its first call (see the module
    docstring). Thread-safe: concurrent first calls make it once."""

    def __init__(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: FirstOptions,
        record: FirstRecord,
        key: str,
        returns: OutputSpec,
        *,
        where: str,
    ) -> None:
        self._call: tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None = (
            module,
            args,
            kwargs,
        )
        self._options = options
        self._record = record
        self._key = key
        self._where = where
        self._returns = returns
        self._config = _compat.config_snapshot()
        self._made: FirstCompilation | None = None
        self._lock = threading.Lock()

    @property
    def made(self) -> FirstCompilation | None:
        """The first compilation, once a call has made it."""
        return self._made

    def make(self) -> FirstCompilation:
        """Make the first compilation now (once)."""
        with self._lock:
            if self._made is None:
                self._made = self._make()
            return self._made

    def _make(self) -> FirstCompilation:
        assert self._call is not None
        module, args, kwargs = self._call
        log.info("%s: a recorded first compilation is made after all", self._where)
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                with _compat.configs_as(self._config), _compat.pristine_fx_traceback():
                    made = first_compilation(module, args, kwargs, self._options, where=self._where)
                    _first_call_on_fakes(module, made, args, kwargs)
                    result["made"] = made
            except BaseException as exc:  # re-raised on the caller's thread
                result["error"] = exc

        # a thread of its own: no trace, fake mode or functionalization of the caller's is on
        worker = threading.Thread(target=work, name="ap-first-compilation")
        worker.start()
        worker.join()
        if "error" in result:
            raise result["error"]
        made: FirstCompilation = result["made"]
        content = getattr(made.fn, KEY_ATTRIBUTE, None)
        if content != self._record.content_key:
            drop_record(self._key)
            raise PrecompileError(
                f"{self._where}: the first compilation recorded for this program (content key "
                f"{self._record.content_key[:16]}...) is not the one it makes now "
                f"({str(content)[:16]}...): something its key does not cover changed (Python "
                "run only in the backward, in a file no module, custom autograd.Function or "
                "custom op of the model is defined in). The record is dropped; run again, or "
                "pass precompile(..., first_compilation_cache=False) for this model."
            )
        self._call = None  # the example inputs are not needed any more
        return made

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._made is None:
            fake_mode = _compat.fake_propagation_mode([*args, *kwargs.values()])
            if fake_mode is not None:  # Dynamo learning the outputs: no need to make it
                return self._returns.fakes(fake_mode)
        return self.make().fn(*args, **kwargs)


def _first_call_on_fakes(
    module: nn.Module, made: FirstCompilation, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Call ``made`` once on fake tensors, as Dynamo does while it traces the call.

    Why: the first call of a first compilation's callable must not be inside a trace that
    functionalizes (the second compilation's retrace): the custom ops in its graphs then
    dispatch on functional tensors with no functionalization mode of their own and fail. Made
    by ``precompile``, its first call is Dynamo's, on fakes; made late, this call stands in."""
    params = [owner._parameters[name] for owner, name in made.param_slots]
    buffers = [owner._buffers[name] for owner, name in made.buffer_slots]
    fake_args = _compat.fake_tree(
        (params, buffers, args, kwargs), _compat.fake_mode_with_shape_env()
    )
    fp, fb, fa, fk = fake_args
    made.fn(*fp, *fb, *fa, **fk)


def _deferred_callable(
    deferred: DeferredFirstCompilation, record: FirstRecord
) -> Callable[..., Any]:
    """What ``PrecompiledModule`` calls: ``deferred``, behind ``nonstrict_trace`` as the first
    compilation's own callable is, under its name (Dynamo names the call's graph attributes
    after it, and AOTAutograd's cache key reads them), stamped with its content key."""

    def call_first_compilation(*args: Any, **kwargs: Any) -> Any:
        return deferred(*args, **kwargs)

    call_first_compilation.__name__ = record.fn_name
    call_first_compilation.__qualname__ = record.fn_name
    fn = _compat.nonstrict_trace(call_first_compilation)
    stamp_first_compilation(fn, record.content_key)
    setattr(fn, _DEFERRED_ATTRIBUTE, deferred)
    return fn


#: The attribute a deferred first compilation's callable carries its stand-in in.
_DEFERRED_ATTRIBUTE = "__ap_deferred_first_compilation__"


def deferred_of(fn: Callable[..., Any]) -> DeferredFirstCompilation | None:
    """The stand-in behind a first compilation's callable; None when it was made outright."""
    deferred = getattr(fn, _DEFERRED_ATTRIBUTE, None)
    return deferred if isinstance(deferred, DeferredFirstCompilation) else None


def _record_of(made: FirstCompilation) -> FirstRecord | None:
    content = getattr(made.fn, KEY_ATTRIBUTE, None)
    if not isinstance(content, str):
        return None  # the second compilation bypasses AOTAutograd's cache: nothing to reuse
    return FirstRecord(
        content_key=content,
        partitioner=made.partitioner,
        first_partition=made.first_partition,
        fsdp_report=made.fsdp_report,
        param_fqns=made.param_fqns,
        buffer_fqns=made.buffer_fqns,
        fn_name=str(getattr(made.fn, "__name__", "")),
    )


def _reusable(args: tuple[Any, ...], kwargs: Mapping[str, Any], options: FirstOptions) -> bool:
    """Worth keying: the caches that would serve the second compilation are on, and the call
    is not the EP chunk route (its hinted unbacked token dim is not a static signature)."""
    if not options.first_compilation_cache or not _compat.caches_on():
        return False
    return default_first_partition(args, kwargs) != "default"


def first_compilation_or_record(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: FirstOptions,
    *,
    where: str,
) -> FirstCompilation:
    """``module(*args, **kwargs)``'s first compilation, or its record's stand-in."""
    if not _reusable(args, kwargs, options):
        return first_compilation(module, args, kwargs, options, where=where)
    start = time.perf_counter()
    signature = call_signature(module, args, kwargs)
    try:
        key, returns = program_key(module, args, kwargs, signature, _key_options(options))
    except (Unkeyable, _compat.UnsupportedTorchError) as exc:
        log.info("%s: the first compilation is made (no key for a record: %s)", where, exc)
        return first_compilation(module, args, kwargs, options, where=where)
    record = load_record(key)
    if record is None:
        made = first_compilation(module, args, kwargs, options, where=where)
        fresh = _record_of(made)
        if fresh is not None:
            save_record(key, fresh)
        return made
    deferred = DeferredFirstCompilation(
        module, args, kwargs, options, record, key, returns, where=where
    )
    log.info("%s: first compilation taken from its record (made only on a cache miss)", where)
    emit_json(
        "ap_first_partition",
        {
            "partitioner": options.first_partition,
            "reused": True,
            **record.first_partition.to_dict(),
        },
    )
    return FirstCompilation(
        signature=signature,
        first_partition=record.first_partition,
        fsdp_report=record.fsdp_report,
        seconds=time.perf_counter() - start,
        fn=_deferred_callable(deferred, record),
        param_slots=slots(module, record.param_fqns, "parameter"),
        buffer_slots=slots(module, record.buffer_fqns, "buffer"),
        partitioner=options.first_partition,
        param_fqns=record.param_fqns,
        buffer_fqns=record.buffer_fqns,
        reused=True,
    )
