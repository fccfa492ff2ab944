"""The compiled codec helper: built, self-contained, hash-identical with ``xxhash``, loud when missing."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import dynamo_tiered_kv._native as native_pkg
from dynamo_tiered_kv._native import fast
from dynamo_tiered_kv.store.metrics import StoreMetrics

LARGE = [1023, 1024, 1025, 4096, 65536 + 7, 1 << 20, (3 << 20) + 5]


def _built() -> None:
    if not fast.AVAILABLE:
        if os.environ.get("CI", "").lower() == "true":  # a CI image must build it: a silent slow path is a bug
            pytest.fail(f"compiled codec helper did not build: {fast.UNAVAILABLE_REASON}")
        pytest.skip(f"compiled codec helper not built here: {fast.UNAVAILABLE_REASON}")


def test_helper_built() -> None:
    _built()
    assert fast.AVAILABLE


@pytest.mark.parametrize("offset", [0, 3])  # aligned and unaligned start addresses
def test_xxh3_matches_python_every_short_length(offset: int) -> None:
    _built()
    rng = np.random.default_rng(offset)
    buf = rng.integers(0, 256, 300 + offset, dtype=np.uint8)
    for n in range(301):
        view = buf[offset : offset + n]
        assert fast.xxh3_64(view) == xxhash.xxh3_64_intdigest(view.tobytes()), n


@pytest.mark.parametrize("n", LARGE)
def test_xxh3_matches_python_large(n: int) -> None:
    _built()
    data = np.random.default_rng(n).integers(0, 256, n + 5, dtype=np.uint8)
    for off in (0, 5):
        view = data[off : off + n]
        assert fast.xxh3_64(view) == xxhash.xxh3_64_intdigest(view.tobytes())


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=5000))
def test_xxh3_matches_python_random(data: bytes) -> None:
    _built()
    assert fast.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _runnable_variants() -> list[str]:
    return list(fast.XXH3_VARIANTS[: fast.XXH3_VARIANTS.index(fast.xxh3_variant()) + 1])


def test_xxh3_picks_the_widest_loop_this_cpu_runs() -> None:
    _built()
    flags = _cpu_flags()
    if not flags or os.uname().machine != "x86_64":
        pytest.skip("x86-64 Linux only")
    expect = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "baseline"
    assert fast.xxh3_variant() == expect


@pytest.mark.parametrize("n", [0, 1, 16, 17, 128, 129, 240, 241, 255, 256, 1023, 1024, 4096 + 3, 128 << 10, *LARGE])
def test_every_xxh3_loop_matches_python(n: int) -> None:
    """Each vector loop (at most the ones this CPU runs) returns the Python package's value, at
    every boundary of XXH3's length classes and its 1 KiB stripe blocks, aligned or not."""
    _built()
    data = np.random.default_rng(n + 11).integers(0, 256, n + 7, dtype=np.uint8)
    for off in (0, 7):
        view = data[off : off + n]
        want = xxhash.xxh3_64_intdigest(view.tobytes())
        assert {v: fast.xxh3_64(view, v) for v in _runnable_variants()} == dict.fromkeys(_runnable_variants(), want)


def test_xxh3_loop_this_cpu_lacks_is_refused() -> None:
    _built()
    if fast.xxh3_variant() == "avx512":
        pytest.skip("this CPU runs every loop")
    with pytest.raises(ValueError, match="does not run"):
        fast.xxh3_64(b"x" * 1000, "avx512")


@pytest.fixture
def reload_fast(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Reload ``fast`` under patched imports; the real module state is restored afterwards."""
    with monkeypatch.context() as m:
        yield m
    importlib.reload(fast)


def test_helper_needs_no_private_library_of_xxhash(reload_fast: pytest.MonkeyPatch) -> None:
    """The helper must not depend on a private extension module of the ``xxhash`` wheel."""
    _built()
    reload_fast.setitem(sys.modules, "xxhash._xxhash", None)  # a rebuilt wheel without that module/symbol
    importlib.reload(fast)
    assert fast.AVAILABLE, fast.UNAVAILABLE_REASON
    assert fast.xxh3_64(b"dtkv") == xxhash.xxh3_64_intdigest(b"dtkv")


def test_missing_helper_warns_and_gauge_reads_zero(
    reload_fast: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reload_fast.delattr(native_pkg, "_fastcodec", raising=False)
    reload_fast.setitem(sys.modules, "dynamo_tiered_kv._native._fastcodec", None)  # as if never built
    with caplog.at_level(logging.WARNING, logger=fast.__name__):
        importlib.reload(fast)
    assert not fast.AVAILABLE
    assert any(r.levelno == logging.WARNING and "_fastcodec unavailable" in r.getMessage() for r in caplog.records)
    assert StoreMetrics().value("codec_fast_path") == 0.0


def test_gauge_reads_one_when_built() -> None:
    _built()
    assert StoreMetrics().value("codec_fast_path") == 1.0
