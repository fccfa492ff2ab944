"""Ask Linux for the AMX tile state before vLLM's CPU attention executes AMX instructions.

vLLM's CPU attention (0.32) selects its AMX kernel from CPUID alone (bf16, block size a multiple
of 32). Linux (5.16+) kills a process with SIGILL when it executes an AMX tile instruction before
asking for that state with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``. oneDNN asks on
its first AMX matmul, so whether an engine survives its first forward depends on which kernel
happens to run first. Measured on an AMX VM (Sapphire Rapids class): a plain engine got the
permission inside its first forward; the same engine with the connector and an SSD-only tier died
in ``cpu_attention_with_kv_cache`` with SIGILL on its first forward. Asking once per process,
before the first forward, removes the dependence; on CPUs without AMX the call fails harmlessly.
"""
from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_granted: bool | None = None


def request_amx_tiles() -> bool:
    """Request AMX tile state for this process (idempotent); True when granted."""
    global _granted
    if _granted is None:
        _granted = False
        if sys.platform == "linux" and platform.machine() == "x86_64":
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                _granted = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
            except (OSError, AttributeError) as e:  # no libc syscall(): nothing to ask
                log.debug("AMX permission request unavailable: %s", e)
    return _granted
