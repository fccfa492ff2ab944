"""The connector asks Linux for AMX tile state before vLLM's CPU attention can execute AMX code."""
from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_tiered_kv.connectors.vllm.cpu_amx import request_amx_tiles

_ARCH_GET_XCOMP_PERM = 0x1022
_XTILEDATA_BIT = 1 << 18


def _cpu_has_amx() -> bool:
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _permitted() -> int:
    perm = ctypes.c_uint64(0)
    ctypes.CDLL(None).syscall(158, _ARCH_GET_XCOMP_PERM, ctypes.byref(perm))
    return perm.value


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="x86_64 Linux only")
def test_granted_exactly_where_the_cpu_has_amx() -> None:
    granted = request_amx_tiles()
    assert request_amx_tiles() is granted  # asked once per process
    assert granted is _cpu_has_amx()
    assert bool(_permitted() & _XTILEDATA_BIT) is granted


@pytest.mark.skipif(not _cpu_has_amx(), reason="this CPU has no AMX tiles")
def test_a_fresh_process_gains_the_permission_only_when_asked() -> None:
    code = ("import ctypes; from dynamo_tiered_kv.connectors.vllm.cpu_amx import request_amx_tiles as r\n"
            "g = lambda: (lambda v: (ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(v)), v.value)[1])"
            "(ctypes.c_uint64(0))\n"
            "before = bool(g() & (1 << 18)); ok = r(); print(before, ok, bool(g() & (1 << 18)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True"]
