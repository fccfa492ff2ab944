"""The benchmarks' HDD mode: every OSD operation of the local Ceph cluster waits a fixed time.

One HDD seeks once per operation (8 ms is a typical 7,200 rpm seek plus half a rotation), so a
restore from an HDD-backed bucket pays per request, not per byte. Ceph models exactly that with
two OSD options, set at run time through each OSD's admin socket::

    ceph --admin-daemon DIR/run/osd.0.asok config set osd_debug_inject_dispatch_delay_duration 0.008
    ceph --admin-daemon DIR/run/osd.0.asok config set osd_debug_inject_dispatch_delay_probability 1

Every OSD op then waits on the messenger thread that received it, so the ops of one connection
queue behind each other, as on one disk (no transfer-time term: this models seek latency, not an
HDD's bandwidth). ``osd_op_delay`` applies the delay for the length of a ``with`` block and puts
back the values it found when the block ends, however it ends (an exception, Ctrl-C, SIGTERM).

The delay is only possible on a cluster this machine runs: ``find_local_ceph`` maps a bucket's
endpoint to the cluster ``tests/infra/ceph_rgw.sh`` started (its directory holds ``ceph.conf``
with the RGW's port and ``run/*.asok``), and raises ``OsdDelayError`` with the reason otherwise
(a remote endpoint, moto, a cluster whose sockets are gone).

``object_requests`` counts what the object tier sent, from its backend's counters
(``BackendStats``): the request count per restored GB is what this mode prices.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DURATION = "osd_debug_inject_dispatch_delay_duration"
PROBABILITY = "osd_debug_inject_dispatch_delay_probability"
#: what ``tests/infra/ceph_rgw.sh`` uses when given no directory
DEFAULT_CEPH_DIR = "/tmp/dtkv-ceph"
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_RGW_PORT = re.compile(r"^\s*rgw[ _]frontends\s*=.*?\b(?:endpoint=[^\s:]+|endpoint=\[[^\]]*\]|port)[:=](\d+)",
                       re.MULTILINE)
#: ``BackendStats`` fields that each stand for requests sent: logical requests, each retry,
#: each hedged twin, and each operation that failed after its retries
REQUEST_FIELDS = ("gets", "heads", "lists", "puts", "deletes", "retries", "hedges_sent", "failures")
_ADMIN_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)


class OsdDelayError(RuntimeError):
    """The delay cannot be applied (or put back): the message says why and what to do."""


@dataclass(frozen=True)
class LocalCeph:
    """A Ceph cluster started on this machine by ``tests/infra/ceph_rgw.sh``.

    Attributes:
        dir: the cluster's directory (``ceph.conf``, ``run/``, ``log/``).
        rgw_port: the port its RGW serves S3 on (loopback).
        osd_sockets: every OSD's admin socket.
        rgw_socket: the RGW's admin socket (its perf counters count S3 requests), if present.
    """

    dir: Path
    rgw_port: int
    osd_sockets: tuple[Path, ...]
    rgw_socket: Path | None


@dataclass
class OsdDelay:
    """What ``osd_op_delay`` applied, and the values it found (and puts back) per OSD socket."""

    delay_s: float
    ceph_dir: str
    osd_sockets: list[str]
    before: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"ms_per_op": self.delay_s * 1e3, "ceph_dir": self.ceph_dir, "osd_sockets": self.osd_sockets,
                "before": self.before}


def candidate_dirs() -> list[Path]:
    """Where clusters of ``ceph_rgw.sh`` live: ``$DTKV_CEPH_DIR``, ``$CEPH_DIR``, its default
    directory, and the temporary ones the test runner and the test fixture create."""
    named = [os.environ.get("DTKV_CEPH_DIR"), os.environ.get("CEPH_DIR"), DEFAULT_CEPH_DIR]
    found = [Path(d) for d in named if d]
    tmp = Path(tempfile.gettempdir())
    found += sorted(p for p in tmp.glob("dtkv-ceph*") if p.is_dir())
    seen: set[Path] = set()
    return [p for p in found if not (p in seen or seen.add(p))]  # type: ignore[func-returns-value]


def rgw_port(ceph_conf: Path) -> int | None:
    """The port of the RGW frontend ``ceph_conf`` configures (None: none, or unreadable)."""
    try:
        m = _RGW_PORT.search(ceph_conf.read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _loopback_port(endpoint: str) -> int:
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if parts.hostname not in _LOOPBACK:
        raise OsdDelayError(f"the OSD delay model needs the bucket on a Ceph RGW on this machine; "
                            f"{endpoint} is not a loopback address")
    return parts.port or (443 if parts.scheme == "https" else 80)


def find_local_ceph(endpoint: str | None, ceph_dir: str | os.PathLike[str] | None = None) -> LocalCeph:
    """The local Ceph cluster whose RGW serves ``endpoint``.

    Args:
        endpoint: the S3 endpoint the benchmark reads from (``http://127.0.0.1:PORT``).
        ceph_dir: the cluster's directory; None searches ``candidate_dirs()``.

    Raises:
        OsdDelayError: no endpoint, not a loopback one, no cluster whose RGW has that port, no
            OSD admin socket, or no ``ceph`` command.
    """
    if not endpoint:
        raise OsdDelayError("the OSD delay model needs an S3 endpoint (--s3-endpoint or DTKV_S3_ENDPOINT) "
                            "served by a local Ceph RGW (tests/infra/ceph_rgw.sh start)")
    port = _loopback_port(endpoint)
    dirs = [Path(ceph_dir)] if ceph_dir else candidate_dirs()
    for d in dirs:
        if rgw_port(d / "ceph.conf") != port:
            continue
        osds = tuple(sorted((d / "run").glob("osd.*.asok")))
        if not osds:
            raise OsdDelayError(f"{d}: the RGW on port {port} is this cluster's, but {d}/run holds no OSD "
                                "admin socket (osd.N.asok): is the cluster still running?")
        if shutil.which("ceph") is None:
            raise OsdDelayError("the OSD delay model needs the `ceph` command (Debian package ceph-common)")
        rgw = sorted((d / "run").glob("client.rgw*.asok"))
        return LocalCeph(d, port, osds, rgw[0] if rgw else None)
    where = ", ".join(str(d) for d in dirs) or "nowhere"
    raise OsdDelayError(f"{endpoint} is not the RGW of a local Ceph cluster (looked for a ceph.conf with "
                        f"rgw port {port} in {where}); the OSD delay model works only on a cluster started "
                        "by tests/infra/ceph_rgw.sh (give its directory with --ceph-dir), not on moto or "
                        "a remote S3")


def admin(socket: Path | str, *args: str) -> str:
    """``ceph --admin-daemon SOCKET ARGS...``: its stdout; OsdDelayError if it fails."""
    cmd = ["ceph", "--admin-daemon", str(socket), *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=_ADMIN_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise OsdDelayError(f"{' '.join(cmd)}: {e}") from e
    if p.returncode != 0:
        raise OsdDelayError(f"{' '.join(cmd)} failed (rc {p.returncode}): {(p.stderr or p.stdout).strip()[-500:]}")
    return p.stdout


def config_get(socket: Path | str, name: str) -> str:
    """An OSD option's current value, as the daemon prints it (``"0.008000"``)."""
    out = admin(socket, "config", "get", name)
    try:
        return str(json.loads(out)[name])
    except (ValueError, KeyError, TypeError) as e:
        raise OsdDelayError(f"{socket}: unexpected answer to `config get {name}`: {out[:200]!r}") from e


def config_set(socket: Path | str, name: str, value: str) -> None:
    """Set an OSD option and check the daemon now reports it."""
    admin(socket, "config", "set", name, value)
    got = config_get(socket, name)
    try:
        same = abs(float(got) - float(value)) <= 1e-9
    except ValueError:
        same = got == value
    if not same:
        raise OsdDelayError(f"{socket}: set {name} to {value}, but the daemon reports {got}")


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit (so ``finally`` clauses run) if nothing else
    handles it; only on the main thread, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def osd_op_delay(ceph: LocalCeph, delay_ms: float) -> Iterator[OsdDelay]:
    """Every OSD op of ``ceph`` waits ``delay_ms`` inside the block; the values found before are
    put back when it ends, also on an exception or SIGTERM.

    The duration is set before the probability and put back after it, so no op ever waits the
    option's default duration (0.1 s). A failure to put a value back raises OsdDelayError after
    every socket was tried, unless the block itself raised (that exception propagates; the
    failure is logged).
    """
    if not delay_ms > 0:
        raise OsdDelayError(f"the OSD op delay must be > 0 ms, got {delay_ms}")
    state = OsdDelay(delay_ms / 1e3, str(ceph.dir), [str(s) for s in ceph.osd_sockets])
    applied: list[Path] = []
    with _sigterm_unwinds():
        try:
            for sock in ceph.osd_sockets:
                state.before[str(sock)] = {n: config_get(sock, n) for n in (DURATION, PROBABILITY)}
            for sock in ceph.osd_sockets:
                applied.append(sock)
                config_set(sock, DURATION, f"{delay_ms / 1e3:.6f}")
                config_set(sock, PROBABILITY, "1")
            yield state
        except BaseException:
            try:
                _put_back(applied, state.before)
            except OsdDelayError as e:
                log.error("%s", e)
            raise
        _put_back(applied, state.before)


def _put_back(sockets: list[Path], before: dict[str, dict[str, str]]) -> None:
    errors = []
    for sock in sockets:
        for name in (PROBABILITY, DURATION):
            try:
                config_set(sock, name, before[str(sock)][name])
            except OsdDelayError as e:
                errors.append(str(e))
    if errors:
        raise OsdDelayError("could not put the OSD delay options back (set them by hand: "
                            f"`ceph --admin-daemon SOCKET config set {PROBABILITY} 0`): " + "; ".join(errors))


def object_requests(before: Mapping[str, int], after: Mapping[str, int]) -> int:
    """Requests an object backend sent between two snapshots of its ``BackendStats`` (as dicts)."""
    return sum(int(after.get(k, 0)) - int(before.get(k, 0)) for k in REQUEST_FIELDS)


def stats_snapshot(stats: object) -> dict[str, int]:
    """The request counters of a ``BackendStats`` (any object with those attributes)."""
    return {k: int(getattr(stats, k, 0)) for k in REQUEST_FIELDS}


def per_gb(requests: int, nbytes: float) -> float | None:
    """Requests per restored GB (10^9 bytes); None when nothing was restored."""
    return requests / (nbytes / 1e9) if nbytes > 0 else None


def summary_line(what: str, requests_per_gb: float | None, restore_s: float, nbytes: float,
                 delay: Mapping[str, Any] | None) -> str:
    """The printed line of the request count and restore time of one benchmark row."""
    req = "-" if requests_per_gb is None else f"{requests_per_gb:.1f}"
    model = f", every OSD op delayed {delay['ms_per_op']:g} ms" if delay else ""
    return (f"{what}: {req} requests per restored GB, restore {restore_s * 1e3:.1f} ms for "
            f"{nbytes / 2**20:.1f} MiB{model}")


# ---------------------------------------------------------------- wiring into a benchmark


def _delay_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--osd-op-delay-ms`` and ``--ceph-dir``, the HDD mode's flags, for a benchmark's parser."""
    p.add_argument("--osd-op-delay-ms", type=_delay_ms, default=None, metavar="MS",
                   help="HDD mode: every OSD op of the local Ceph cluster serving the bucket waits MS during "
                        "the measured phase (8: one spindle's seek); the values found are put back afterwards")
    p.add_argument("--ceph-dir", default=None,
                   help="HDD mode: that cluster's directory (default: found by the endpoint's port among "
                        "the clusters tests/infra/ceph_rgw.sh started)")


def hdd_mode(bench: str, endpoint: str | None, delay_ms: float | None,
             ceph_dir: str | None = None) -> LocalCeph | None:
    """The cluster to delay (None without ``--osd-op-delay-ms``); exits with the reason when the
    bucket is not on a local Ceph this machine can reach."""
    if delay_ms is None:
        return None
    try:
        return find_local_ceph(endpoint, ceph_dir)
    except OsdDelayError as e:
        raise SystemExit(f"bench {bench}: --osd-op-delay-ms: {e}") from None


@contextmanager
def measured(ceph: LocalCeph | None, delay_ms: float | None) -> Iterator[dict[str, Any] | None]:
    """The measured phase of a benchmark: under the delay when ``ceph`` is given (yields what was
    applied, for the result), else as it is (yields None)."""
    if ceph is None or delay_ms is None:
        yield None
        return
    with osd_op_delay(ceph, delay_ms) as d:
        yield d.to_dict()
