"""``dtkv``: the command line. Each subcommand lives in ``dynamo_tiered_kv/commands/<name>.py``
and exposes ``register(subparsers)``, which adds its parser and sets ``func(args) -> int``.

Errors reach the user as one line on stderr and a non-zero exit: 2 for the expected kinds
(settings, files, the object store), 1 for anything else unless the command names its own code
(``set_defaults(internal_error_exit=N)``: ``fsck``, where 1 means corruption). ``--debug`` or
``DTKV_DEBUG=1`` shows the traceback instead.

Output closed early (``dtkv plan | head``): the command stops quietly with exit status 141, what a
shell reports for a program a closed pipe ended (128 + SIGPIPE), and no error line.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import select
import sys

from . import __version__, commands
from .commands._deferred import DeferredParser
from .errors import TieredKVError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtkv", description="dynamo-tiered-kv: tiered, persistent KV cache")
    p.add_argument("--version", action="version", version=f"dtkv {__version__}", help="print the version")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors (also DTKV_DEBUG=1)")
    # each command adds its arguments when it runs (commands/_deferred.py): no command's imports slow another
    sub = p.add_subparsers(dest="command", required=True, parser_class=DeferredParser)
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{commands.__name__}.{mod.name}").register(sub)
    return p


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Failures of the user's input or environment, not of dtkv: shown as one line."""
    kinds: list[type[BaseException]] = [TieredKVError, OSError]
    try:  # botocore comes with the object tier; a command may fail inside it
        from botocore.exceptions import BotoCoreError, ClientError

        kinds += [BotoCoreError, ClientError]
    except ImportError:  # pragma: no cover - botocore is a dependency
        pass
    return tuple(kinds)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if isinstance(e, OSError) or not text else text


EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE


def _stdout_closed() -> bool:
    """Has the reader of stdout gone away (a pipe or socket whose other end is closed)?"""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # stdout closed, replaced or without a descriptor
        return False


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's last flush must not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # pragma: no cover - stdout without a descriptor
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    debug = args.debug or os.environ.get("DTKV_DEBUG", "") not in ("", "0")
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return rc
    except BrokenPipeError as e:
        if _stdout_closed():
            _quiet_stdout()
            return EXIT_OUTPUT_CLOSED
        if debug:  # a connection of the command's own broke: an error like any other
            raise
        return _report(args, e)
    except KeyboardInterrupt:
        print(f"dtkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        return _report(args, e)


def _report(args: argparse.Namespace, e: Exception) -> int:
    """One line on stderr for a failed command; its exit status."""
    if isinstance(e, _expected_errors()):
        print(f"dtkv {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"dtkv {args.command}: internal error: {type(e).__name__}: {' '.join(str(e).split())} "
          "(--debug or DTKV_DEBUG=1 shows the traceback)", file=sys.stderr)
    return int(getattr(args, "internal_error_exit", 1))

if __name__ == "__main__":
    sys.exit(main())
