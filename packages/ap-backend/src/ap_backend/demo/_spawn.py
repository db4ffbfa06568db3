"""Spawn N local ranks (gloo on 127.0.0.1, a free port) and collect one result per rank.

Used by the demo, the cross-package tests and the e2e benchmark. Each rank runs
``fn(rank, world_size, *args)`` after ``init_process_group("gloo")`` and returns a picklable
value; an exception in any rank is re-raised in the parent with that rank's traceback.

Interrupts belong to the parent: the ranks start with SIGINT ignored (a terminal's Ctrl-C
reaches the whole process group, and a rank importing torch would print a traceback), and when
the parent is interrupted -- ``KeyboardInterrupt``, or any exception while it waits -- it
terminates every rank at once (SIGTERM, then SIGKILL after ``STOP_GRACE_S``), so no rank is left
compiling after the parent is gone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import traceback
from collections.abc import Callable
from typing import Any

from ap_tags.scoped import ScopedPatch

__all__ = ["STOP_GRACE_S", "RankError", "free_port", "spawn_ranks"]

#: Seconds a rank gets to exit after SIGTERM before it is killed.
STOP_GRACE_S = 3.0


class RankError(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    import torch
    import torch.distributed as dist

    from ap_backend.demo._quiet import quiet_from_env

    quiet_from_env()  # ap-backend demo without --verbose: torch's INFO / no-CUDA lines dropped
    # Each rank gets its share of the cores: with every rank using all of them, intra-op
    # threads spin against the other ranks' and each gloo collective waits for a time slice.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - forwarded to the parent verbatim
        results.put((rank, "error", traceback.format_exc()))


def _ignore_sigint() -> Callable[[], None]:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def undo() -> None:
        signal.signal(signal.SIGINT, previous)

    return undo


_SIGINT_IGNORED = ScopedPatch("SIGINT ignored while ranks start", _ignore_sigint)


def _start_ignoring_sigint(procs: list[Any]) -> None:
    """Start ``procs`` with SIGINT ignored: an ignored disposition survives ``exec``, and
    Python then installs no ``KeyboardInterrupt`` handler in the child. The parent's own
    handler is put back at once (only the main thread may change it; from another thread the
    ranks start with the parent's disposition)."""
    if threading.current_thread() is not threading.main_thread():
        for p in procs:
            p.start()
        return
    with _SIGINT_IGNORED:
        for p in procs:
            p.start()


def _stop(procs: list[Any]) -> None:
    """Terminate every live rank now; kill what is still alive after ``STOP_GRACE_S``."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0
) -> list[Any]:
    """Run ``fn`` on ``world_size`` fresh processes; results ordered by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results), daemon=False)
        for r in range(world_size)
    ]
    out: dict[int, Any] = {}
    errors: list[str] = []
    _start_ignoring_sigint(procs)
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise RankError(f"ranks timed out after {timeout_s:.0f} s") from None
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    except BaseException:
        _stop(procs)  # interrupted (Ctrl-C, SIGTERM turned into an exception) or timed out
        raise
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        raise RankError("\n".join(errors))
    return [out[r] for r in range(world_size)]
