"""Console script ``ap-backend``: ``--version`` and ``demo``.

``ap-backend demo`` parses its options into an :class:`ap_backend.demo.DemoOptions` and runs
:func:`ap_backend.demo.run_demo`. Exit status: 0 ok; 1 a loss/grad mismatch against eager; 2 a
bad option, one line, before any rank starts (``--json``'s directory must exist and be
writable; ``--fsdp simple`` needs torchtitan); 130 on Ctrl-C and 143 on SIGTERM, one line, with
every rank stopped (``spawn_ranks`` terminates them). Output: the demo's progress lines and
table; ``--verbose`` adds torch's own log lines from every rank (``demo/_quiet.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from types import FrameType
from typing import NoReturn

from ap_tags.scoped import ScopedPatch

__all__ = ["main"]

_PACKAGES = ("ap-tags", "ap-partitioner", "ap-bucketing", "ap-epchunk", "ap-backend", "torch")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _versions() -> str:
    parts = []
    for name in _PACKAGES:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    return "\n".join(parts)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _ranks(text: str) -> int:
    value = _positive(text)
    if 8 % value != 0:
        raise argparse.ArgumentTypeError(f"must divide 8 (1, 2, 4 or 8), got {value}")
    return value


def _parser() -> _Parser:
    parser = _Parser(prog="ap-backend", description="The ap compile backend.")
    parser.add_argument("--version", action="store_true", help="print package versions and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    demo = sub.add_parser("demo", help="train a small FSDP transformer on CPU ranks, print a table")
    demo.add_argument("--layers", type=_positive, default=2, help="transformer layers (2)")
    demo.add_argument("--steps", type=_positive, default=4, help="training steps (4)")
    demo.add_argument("--ranks", type=_ranks, default=2, help="gloo ranks on 127.0.0.1 (2)")
    demo.add_argument(
        "--ac",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="AC staging pass in the backend (on)",
    )
    demo.add_argument(
        "--bucketing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ap-bucketing + overlap scheduling (on)",
    )
    demo.add_argument(
        "--chunk",
        action=argparse.BooleanOptionalAction,
        default=False,
        help=(
            "MoE model with real expert parallelism (experts split over the ranks, tokens "
            "exchanged all-to-all), layers.*.moe chunked in 2 along tokens (off)"
        ),
    )
    demo.add_argument(
        "--fsdp",
        choices=("ap", "simple"),
        default="ap",
        help="FSDP engine: ap (the model kit's all-gathers) or simple (torchtitan's SimpleFSDP, "
        "DTensor parameters; needs torchtitan) (ap)",
    )
    demo.add_argument("--json", metavar="PATH", default=None, help="also write the numbers here")
    demo.add_argument(
        "--verbose",
        action="store_true",
        help="also print torch's own log lines from every rank (Inductor INFO lines such as "
        "pre_bucket_fsdp_collectives, the no-CUDA-runtime warning); off: the demo's progress "
        "lines and table only",
    )
    return parser


def _check_json_path(parser: _Parser, path: str) -> None:
    """``--json PATH`` must be writable before any rank starts (the demo takes a minute)."""
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        parser.error(f"argument --json: {path!r} is a directory, expected a file path")
    if not os.path.isdir(folder):
        parser.error(f"argument --json: directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"argument --json: directory {folder!r} is not writable")
    if os.path.exists(target) and not os.access(target, os.W_OK):
        parser.error(f"argument --json: {path!r} exists and is not writable")


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so ``spawn_ranks`` stops the ranks on its way out."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _sigterm_raises() -> Callable[[], None]:
    previous = signal.signal(signal.SIGTERM, _raise_terminated)

    def undo() -> None:
        signal.signal(signal.SIGTERM, previous)

    return undo


_SIGTERM_RAISES = ScopedPatch("SIGTERM raises in the demo's main thread", _sigterm_raises)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        print(_versions())
        return 0
    if args.command != "demo":
        parser.error("expected a command: demo (or --version)")
    from ap_backend.demo import DemoOptions, render_table, run_demo
    from ap_backend.demo._quiet import QUIET_DEMO_LOGS

    if args.json is not None:
        _check_json_path(parser, args.json)
    if args.fsdp == "simple":
        if args.chunk:
            parser.error("argument --fsdp simple: --chunk needs the model kit's MoE (--fsdp ap)")
        from ap_backend.demo import require_simple_fsdp

        try:
            require_simple_fsdp()
        except ImportError as exc:
            parser.error(f"argument --fsdp: {str(exc).splitlines()[0]}")
    known = {f.name for f in dataclasses.fields(DemoOptions)}
    opts = DemoOptions(**{k: v for k, v in vars(args).items() if k in known})
    try:
        with _SIGTERM_RAISES, contextlib.nullcontext() if args.verbose else QUIET_DEMO_LOGS:
            print(f"[ap-backend demo] spawning {opts.ranks} ranks ...", flush=True)
            summary = run_demo(opts, args.json)
    except KeyboardInterrupt:
        print("ap-backend demo: interrupted (Ctrl-C), all ranks stopped", file=sys.stderr)
        return 130
    except _Terminated:
        print("ap-backend demo: terminated (SIGTERM), all ranks stopped", file=sys.stderr)
        return 143
    print(render_table(summary))
    if summary["mismatches"]:
        print(
            f"ap-backend demo: {summary['mismatches']} loss/grad mismatches vs eager",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
