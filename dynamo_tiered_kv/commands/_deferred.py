"""Subcommand parsers that add their arguments on first use.

Building ``dtkv``'s parser must stay cheap: ``dtkv --help`` and every other command would
otherwise pay for the imports one command's arguments need (``plan`` and ``bench`` list model
shapes and benchmarks whose modules import torch). A command hands ``defer`` a function that adds
its arguments; it runs when that parser parses or prints help, never when another command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

Fill = Callable[[argparse.ArgumentParser], None]


class DeferredParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that completes itself (``defer``) before parsing or formatting help."""

    _fill: Fill | None = None

    def complete(self) -> DeferredParser:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill(self)
        return self

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.complete()
        return super().format_help()

    def format_usage(self) -> str:
        self.complete()
        return super().format_usage()


def defer(parser: Any, fill: Fill) -> None:
    """Add ``parser``'s arguments with ``fill`` on first use (now, for a plain ArgumentParser)."""
    if isinstance(parser, DeferredParser):
        parser._fill = fill
    else:
        fill(parser)
