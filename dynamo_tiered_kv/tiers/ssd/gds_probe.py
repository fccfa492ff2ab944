"""Is this true GPUDirect Storage, cuFile's compatibility mode, or nothing?

cuFile's ``allow_compat_mode`` defaults to true: without the nvidia_fs kernel module every "GDS"
transfer silently becomes POSIX I/O plus a bounce copy through host memory, and a probe that only
creates the GDS_MT backend and round-trips a few bytes passes. So the probe forbids compatibility
mode (a cuFile JSON config with ``"allow_compat_mode": false`` that ``CUFILE_ENV_PATH_JSON`` points
at, set before cuFile opens its driver, and left set for the process so later transfers cannot fall
back either), then creates the backend and round-trips 4 KiB between a registered device slab and
an O_DIRECT file in the SSD directory. Only that passing counts as GPUDirect.

Modes: ``gpudirect`` (usable), ``compat`` (cuFile is here but only its compatibility mode would
work: not used, the host-bounce path is as fast and honest about it), ``none``.
"""

from __future__ import annotations

import ctypes
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

CUFILE_ENV = "CUFILE_ENV_PATH_JSON"
_NVFS_PATHS = ("/proc/driver/nvidia-fs", "/sys/module/nvidia_fs")


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


def strict_config(base: str | None) -> dict[str, Any]:
    """``base`` (a cuFile JSON config, ``//`` comments allowed) with compatibility mode forbidden."""
    cfg: dict[str, Any] = {}
    if base:
        try:
            text = re.sub(r"(?m)^\s*//.*$|\s+//[^\"\n]*$", "", Path(base).read_text())
            loaded = json.loads(text)
            cfg = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            cfg = {}
    props = cfg.get("properties") if isinstance(cfg.get("properties"), dict) else {}
    cfg["properties"] = {**props, "allow_compat_mode": False}
    return cfg


def forbid_compat_mode() -> Path:
    """Write the strict config (merged over the operator's, if any) and point cuFile at it."""
    cfg = strict_config(os.environ.get(CUFILE_ENV))
    path = Path(tempfile.gettempdir()) / f"dtkv-cufile-{os.getpid()}.json"
    path.write_text(json.dumps(cfg, indent=1))
    os.environ[CUFILE_ENV] = str(path)
    return path


def _self_test(dio: Any, directory: Path) -> None:
    """4 KiB through a real registered CUDA slab and an O_DIRECT file in ``directory``."""
    import torch

    from ...staging.device_slabs import DeviceSlab

    slab = DeviceSlab(0, 2 << 20, torch.device("cuda", torch.cuda.current_device()))
    try:
        dio.register([slab])
        dio.self_test(directory)
    finally:
        dio.close()
        slab.release_memory()


def probe(directory: Path | None = None) -> GdsVerdict:
    """The verdict for this machine; never raises. ``directory``: where the self-test file goes
    (the SSD directory; the temp directory, often tmpfs, fails it honestly)."""
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
    try:
        where.mkdir(parents=True, exist_ok=True)
        _self_test(dio, where)
    except Exception as e:
        return GdsVerdict(False, f"GDS_MT self-test in {where} failed with compatibility mode forbidden, {nvfs_says}: "
                                 f"{type(e).__name__}: {e}", "none" if nvfs else "compat")
    return GdsVerdict(True, f"GDS_MT round trip through a registered device slab in {where}, compatibility "
                            f"mode forbidden, {nvfs_says}", "gpudirect")


def probe_gds(directory: Path | None = None) -> GdsVerdict:
    """Can NIXL GDS_MT move bytes between GPU memory and files here, without cuFile's compatibility
    mode? Never raises or hangs; ``gds_probe`` has the details. The caller logs the verdict."""
    try:
        return probe(directory)
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


def gds_verdict(directory: Path | None = None) -> GdsVerdict:
    """Probe GPUDirect Storage once per filesystem, with the self-test file in ``directory`` (the
    SSD tier's own directory; None: the temp directory); say loudly when it is not usable.
    Thread-safe: concurrent callers for one filesystem wait for one probe."""
    key = _filesystem_of(directory)
    with _GDS_LOCK:
        got = _VERDICTS.get(key)
        if got is None:
            got = _VERDICTS[key] = probe_gds(directory)
            metrics.GDS_AVAILABLE.set(1 if got.available else 0)
            if got.available:
                log.info("SSD tier: GPUDirect Storage (%s): %s", got.mode, got.reason)
            else:
                log.warning("SSD tier: GPUDirect Storage unavailable (mode %s: %s); GPU blocks take the host-bounce "
                            "path through staging slabs", got.mode, got.reason)
        return got
