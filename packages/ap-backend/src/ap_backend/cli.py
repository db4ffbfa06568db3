"""Console script ``ap-backend``: ``--version`` and ``demo``.

``ap-backend demo`` parses its options into an :class:`ap_backend.demo.DemoOptions` and runs
:func:`ap_backend.demo.run_demo`; a bad option exits 2 with one line, a loss/grad mismatch
against eager exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import NoReturn

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
        help="MoE model with EP chunking of layers.*.moe (off)",
    )
    demo.add_argument("--json", metavar="PATH", default=None, help="also write the numbers here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        print(_versions())
        return 0
    if args.command != "demo":
        parser.error("expected a command: demo (or --version)")
    from ap_backend.demo import DemoOptions, render_table, run_demo

    known = {f.name for f in dataclasses.fields(DemoOptions)}
    opts = DemoOptions(**{k: v for k, v in vars(args).items() if k in known})
    print(f"[ap-backend demo] spawning {opts.ranks} ranks ...", flush=True)
    summary = run_demo(opts, args.json)
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
