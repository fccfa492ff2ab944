"""Make this package's start-up lines visible where nobody configured logging for them.

Engines configure their own loggers only: vLLM gives its ``vllm`` logger a stream handler at INFO
and leaves the root logger alone. Our records (``dynamo_tiered_kv.*``) then reach Python's
last-resort handler, which shows WARNING and above only, so the start-up line that says what each
tier will hold never appears under ``vllm serve``. ``ensure_visible`` does for this package what
vLLM does for its own logger, and only while nobody else configured logging:

* if our package logger or any ancestor (the root logger) already has a handler, it does nothing:
  the application's configuration decides what is shown (``dtkv``, Dynamo, pytest);
* otherwise it gives the package logger one stderr handler and, if the logger has no level of its
  own, the level INFO. That handler stays silent once the root logger gets a handler later, so a
  record is never printed twice; INFO records then reach the root's handlers.

Thread ownership: call from any thread; a lock makes the check-and-add atomic. Idempotent.
"""

from __future__ import annotations

import logging
import threading

PACKAGE_LOGGER = "dynamo_tiered_kv"
FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_LOCK = threading.Lock()


class _UntilRootConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """A stderr handler that defers to the root logger's handlers once there are any."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:  # configured after us: its handlers show this record
            return
        super().emit(record)


def ensure_visible(level: int = logging.INFO) -> bool:
    """Give the package logger a stderr handler at ``level`` when no handler would show its records.

    Returns whether it added one (``False``: logging was configured already, or by an earlier call)."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    with _LOCK:
        if logger.hasHandlers():
            return False
        handler = _UntilRootConfigured()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
        return True
