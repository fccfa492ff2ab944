"""Is this true GPUDirect Storage, cuFile's compatibility mode, or nothing?

cuFile's ``allow_compat_mode`` defaults to true: without the nvidia_fs kernel module every "GDS"
transfer silently becomes POSIX I/O plus a bounce copy through host memory, and a probe that only
creates the GDS_MT backend and round-trips a few bytes passes. So the probe forbids compatibility
mode (a cuFile JSON config with ``"allow_compat_mode": false`` that ``CUFILE_ENV_PATH_JSON`` points
at, set before cuFile opens its driver, and left set for the process so later transfers cannot fall
back either; the file is a copy of the operator's config, ``CUFILE_ENV_PATH_JSON`` or
``/etc/cufile.json``, with only that property changed), then creates the backend and round-trips a
production-sized slab (``staging_slab_bytes``) between registered device slabs and an O_DIRECT
file in the SSD directory, reading nvidia-fs's counters (``/proc/driver/nvidia-fs/stats``) before
and after. Only a round trip that passes and that nvidia-fs counted is GPUDirect: its I/O counters
(``Reads``/``Writes`` ``n``, ``readMiB``, ``writeMiB``) when its I/O statistics are on, else its
GPU memory mappings (``Mmap``, ``Bar1-map``). The verdict carries the counters' deltas.

Modes: ``gpudirect`` (usable), ``compat`` (cuFile is here but only its compatibility mode would
work: not used, the host-bounce path is as fast and honest about it), ``none``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import metrics
from .io import _import_nixl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GdsVerdict:
    available: bool
    reason: str
    mode: str = "none"  # gpudirect (true GPUDirect), compat (cuFile would only copy through the host), none
    #: nvidia-fs counters that moved during the probe's round trip, (name, delta) (None: not read)
    nvfs_delta: tuple[tuple[str, int], ...] | None = None

CUFILE_ENV = "CUFILE_ENV_PATH_JSON"
#: the config cuFile reads when ``CUFILE_ENV_PATH_JSON`` is not set
OPERATOR_CUFILE = Path("/etc/cufile.json")
_NVFS_PATHS = ("/proc/driver/nvidia-fs", "/sys/module/nvidia_fs")
#: nvidia-fs's counters (``Name : key=value ...`` lines)
NVFS_STATS = Path("/proc/driver/nvidia-fs/stats")
#: counters of bytes through nvidia-fs (present when its I/O statistics are on, ``rw_stats_enabled``)
_NVFS_IO = ("Writes.n", "Writes.writeMiB", "Reads.n", "Reads.readMiB")
#: GPU memory nvidia-fs mapped for DMA (always counted)
_NVFS_MAPS = ("Mmap.n", "Bar1-map.n")
#: bytes of the probe's round trip when the caller gives none: the default ``staging_slab_bytes``
DEFAULT_PROBE_BYTES = 32 << 20


def nvidia_fs_loaded() -> bool:
    return any(os.path.exists(p) for p in _NVFS_PATHS)


def _libcufile_loads() -> bool:
    try:
        ctypes.CDLL("libcufile.so.0")
        return True
    except OSError:
        return False


def _cuda_ok() -> bool:
    import torch

    return torch.cuda.is_available()


def _strip_comments(text: str) -> str:
    """cuFile's JSON dialect -> JSON: ``//`` and ``/* */`` comments and trailing commas go; string
    contents (paths, URLs with ``//``) stay as they are."""
    out: list[str] = []
    i, n, in_str = 0, len(text), False
    while i < n:
        ch = text[i]
        if in_str:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
            out.append(ch)
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
            continue
        elif ch == ",":
            j = i + 1
            while j < n and text[j] in " \t\r\n":
                j += 1
            if j < n and text[j] in "}]":  # a trailing comma
                i += 1
                continue
            out.append(ch)
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def operator_config() -> str | None:
    """The cuFile config this process would use without the probe: ``CUFILE_ENV_PATH_JSON`` if set,
    else ``/etc/cufile.json`` if it exists, else None (cuFile's built-in defaults)."""
    env = os.environ.get(CUFILE_ENV)
    if env:
        return env
    return str(OPERATOR_CUFILE) if OPERATOR_CUFILE.is_file() else None


def strict_config(base: str | None) -> dict[str, Any]:
    """``base`` (a cuFile JSON config, comments allowed) with compatibility mode forbidden and every
    other setting kept. An unreadable or malformed ``base`` is logged and replaced by cuFile's
    defaults (plus the forbidden compatibility mode)."""
    cfg: dict[str, Any] = {}
    if base:
        try:
            loaded = json.loads(_strip_comments(Path(base).read_text()))
            if not isinstance(loaded, dict):
                raise ValueError("not a JSON object")
            cfg = loaded
        except (OSError, ValueError) as e:
            log.warning("cuFile config %s not usable (%s); the GPUDirect probe runs with cuFile's defaults", base, e)
            cfg = {}
    props = cfg.get("properties") if isinstance(cfg.get("properties"), dict) else {}
    cfg["properties"] = {**props, "allow_compat_mode": False}
    return cfg


def forbid_compat_mode() -> Path:
    """Write the strict config (a copy of the operator's, if any, with compatibility mode off) and
    point cuFile at it."""
    cfg = strict_config(operator_config())
    path = Path(tempfile.gettempdir()) / f"dtkv-cufile-{os.getpid()}.json"
    path.write_text(json.dumps(cfg, indent=1))
    os.environ[CUFILE_ENV] = str(path)
    return path


_NVFS_LINE = re.compile(r"^(.*?)\s:\s(.*)$")
_NVFS_FIELD = re.compile(r"([A-Za-z][\w\-]*)=(\d+)")


def nvfs_counters(path: Path | None = None) -> dict[str, int] | None:
    """nvidia-fs's numeric counters, ``{"Writes.n": 3, "Mmap.n": 12, ...}`` (``Name : key=value``
    lines of its stats file); None when the file cannot be read (nvidia_fs not loaded)."""
    try:
        text = (path or NVFS_STATS).read_text()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _NVFS_LINE.match(line.strip())
        if m is None:
            continue
        name = m.group(1).strip()
        for f in _NVFS_FIELD.finditer(m.group(2)):
            out[f"{name}.{f.group(1)}"] = int(f.group(2))
    return out


def nvfs_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> tuple[tuple[str, int], ...] | None:
    """The counters that changed from ``before`` to ``after`` (None if either was not read)."""
    if before is None or after is None:
        return None
    return tuple((k, after[k] - before.get(k, 0)) for k in sorted(after) if after[k] != before.get(k, 0))


def nvfs_moved(before: dict[str, int] | None, after: dict[str, int] | None) -> tuple[bool, str]:
    """Did nvidia-fs carry the round trip between ``before`` and ``after``? (answer, why)."""
    delta = nvfs_delta(before, after)
    if delta is None or after is None:
        return False, f"nvidia-fs counters not readable ({NVFS_STATS})"
    moved = dict(delta)
    said = ", ".join(f"{k} {v:+d}" for k, v in delta) or "none moved"
    if any(k in after for k in _NVFS_IO):
        wrote = any(moved.get(k, 0) > 0 for k in _NVFS_IO[:2])
        read = any(moved.get(k, 0) > 0 for k in _NVFS_IO[2:])
        if wrote and read:
            return True, f"nvidia-fs counted the writes and reads ({said})"
        return False, f"nvidia-fs did not count both the writes and the reads ({said})"
    if any(moved.get(k, 0) > 0 for k in _NVFS_MAPS):
        return True, f"nvidia-fs mapped the slabs for DMA (its I/O statistics are off: bytes not counted; {said})"
    return False, f"nvidia-fs counted nothing ({said})"


def _self_test(dio: Any, directory: Path, nbytes: int) -> None:
    """``nbytes`` (a production slab) from a registered CUDA slab to an O_DIRECT file in
    ``directory`` and back into a second registered slab; ``OSError`` unless the bytes match.
    Closes ``dio``."""
    import torch

    from ...blocks.codec import ALIGN
    from ...staging.device_slabs import DeviceSlab, DeviceSpan, synchronize

    nbytes = -(-max(nbytes, ALIGN) // ALIGN) * ALIGN  # whole O_DIRECT blocks
    dev = torch.device("cuda", torch.cuda.current_device())
    src, dst = DeviceSlab(0, nbytes, dev), DeviceSlab(1, nbytes, dev)
    path = directory / f".gds-probe-{os.getpid()}"
    fd: int | None = None
    try:
        dio.register([src, dst])
        gen = torch.Generator(device=dev).manual_seed(nbytes)
        src.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=gen))
        dst.tensor.zero_()
        synchronize(dev)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        dio.write(fd, [DeviceSpan(src, 0, nbytes)], 0)
        dio.read(fd, [DeviceSpan(dst, 0, nbytes)], 0)
        synchronize(dev)
        if not torch.equal(src.tensor, dst.tensor):
            raise OSError(errno.EIO, f"NIXL {dio.backend} read back different bytes than it wrote ({nbytes} bytes)")
    finally:
        if fd is not None:
            dio.forget(fd)
            os.close(fd)
        path.unlink(missing_ok=True)
        dio.close()
        src.release_memory()
        dst.release_memory()


def probe(directory: Path | None = None, slab_bytes: int = DEFAULT_PROBE_BYTES) -> GdsVerdict:
    """The verdict for this machine; never raises. ``directory``: where the self-test file goes
    (the SSD directory; the temp directory, often tmpfs, fails it honestly). ``slab_bytes``: the
    round trip's size, the store's staging slab."""
    nvfs = nvidia_fs_loaded()
    nvfs_says = "nvidia_fs loaded" if nvfs else "nvidia_fs not loaded"
    try:
        _import_nixl()
    except Exception as e:
        return GdsVerdict(False, f"nixl not importable: {e}", "none")
    try:
        if not _cuda_ok():
            return GdsVerdict(False, "no CUDA device", "none")
    except Exception as e:  # torch without CUDA support at all
        return GdsVerdict(False, f"torch: {e}", "none")
    cfg = forbid_compat_mode()
    from .gds import DeviceIO

    try:
        dio = DeviceIO("GDS_MT")
    except Exception as e:
        mode = "compat" if not nvfs and _libcufile_loads() else "none"
        return GdsVerdict(False, f"GDS_MT backend with compatibility mode forbidden ({cfg}) failed, {nvfs_says}: "
                                 f"{type(e).__name__}: {e}", mode)
    where = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    before = nvfs_counters()
    try:
        where.mkdir(parents=True, exist_ok=True)
        _self_test(dio, where, slab_bytes)
    except Exception as e:
        return GdsVerdict(False, f"GDS_MT self-test ({slab_bytes} bytes) in {where} failed with compatibility mode "
                                 f"forbidden, {nvfs_says}: {type(e).__name__}: {e}", "none" if nvfs else "compat",
                          nvfs_delta(before, nvfs_counters()))
    after = nvfs_counters()
    moved, counted = nvfs_moved(before, after)
    if not moved:  # the bytes went some other way (or could not be shown to go through nvidia-fs)
        return GdsVerdict(False, f"GDS_MT round trip of {slab_bytes} bytes in {where} passed with compatibility "
                                 f"mode forbidden, {nvfs_says}, but {counted}: not GPUDirect",
                          "none" if nvfs else "compat", nvfs_delta(before, after))
    return GdsVerdict(True, f"GDS_MT round trip of {slab_bytes} bytes through registered device slabs in {where}, "
                            f"compatibility mode forbidden, {nvfs_says}, {counted}", "gpudirect",
                      nvfs_delta(before, after))


def probe_gds(directory: Path | None = None, slab_bytes: int = DEFAULT_PROBE_BYTES) -> GdsVerdict:
    """Can NIXL GDS_MT move bytes between GPU memory and files here, without cuFile's compatibility
    mode and through nvidia-fs? Never raises or hangs; ``gds_probe`` has the details. The caller
    logs the verdict."""
    try:
        return probe(directory, slab_bytes)
    except Exception as e:  # pragma: no cover - the probe catches its own failures
        return GdsVerdict(False, f"probe failed: {type(e).__name__}: {e}", "none")


#: verdicts by filesystem (``st_dev`` of the self-test directory): whether cuFile can do true
#: GPUDirect depends on the filesystem a file lives on, so one SSD directory's verdict says
#: nothing of another's on a different filesystem
_VERDICTS: dict[int | str, GdsVerdict] = {}
_GDS_LOCK = threading.Lock()


def _filesystem_of(directory: Path | None) -> int | str:
    """The cache key of ``directory`` (the temp directory when None): its filesystem's device
    number; its path when it cannot be created or stat'ed (the probe then fails there honestly)."""
    where = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    try:
        where.mkdir(parents=True, exist_ok=True)
        return os.stat(where).st_dev
    except OSError:
        return str(where.resolve())


def gds_verdict(directory: Path | None = None, slab_bytes: int = DEFAULT_PROBE_BYTES) -> GdsVerdict:
    """Probe GPUDirect Storage once per filesystem, with the self-test file in ``directory`` (the
    SSD tier's own directory; None: the temp directory) and a round trip of ``slab_bytes`` (the
    store's staging slab); say loudly when it is not usable. Thread-safe: concurrent callers for
    one filesystem wait for one probe."""
    key = _filesystem_of(directory)
    with _GDS_LOCK:
        got = _VERDICTS.get(key)
        if got is None:
            got = _VERDICTS[key] = probe_gds(directory, slab_bytes)
            metrics.GDS_AVAILABLE.set(1 if got.available else 0)
            if got.available:
                log.info("SSD tier: GPUDirect Storage (%s): %s", got.mode, got.reason)
            else:
                log.warning("SSD tier: GPUDirect Storage unavailable (mode %s: %s); GPU blocks take the host-bounce "
                            "path through staging slabs", got.mode, got.reason)
        return got
