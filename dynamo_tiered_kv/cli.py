"""``dtkv``: the command line. Each subcommand lives in ``dynamo_tiered_kv/commands/<name>.py``
and exposes ``register(subparsers)``, which adds its parser and sets ``func(args) -> int``.

Errors reach the user as one line on stderr and a non-zero exit: 2 for the expected kinds
(settings, files, the object store), 1 for anything else unless the command names its own code
(``set_defaults(internal_error_exit=N)``: ``fsck``, where 1 means corruption). ``--debug`` or
``DTKV_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    debug = args.debug or os.environ.get("DTKV_DEBUG", "") not in ("", "0")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"dtkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        if isinstance(e, _expected_errors()):
            print(f"dtkv {args.command}: error: {one_line(e)}", file=sys.stderr)
            return 2
        print(f"dtkv {args.command}: internal error: {type(e).__name__}: {' '.join(str(e).split())} "
              "(--debug or DTKV_DEBUG=1 shows the traceback)", file=sys.stderr)
        return int(getattr(args, "internal_error_exit", 1))


if __name__ == "__main__":
    sys.exit(main())
