"""Installing our wheel next to Hugging Face's ``kernels`` (SGLang 0.5.23 requires it) leaves theirs
working: the wheel has one top-level package, ``dynamo_tiered_kv`` (our kernels are
``dynamo_tiered_kv.kernels``), and in a virtualenv with their ``kernels`` installed first, ours
installed after it, ``from kernels import get_kernel`` still imports theirs.

The wheel is built from a copy of the checkout's packages and build files (the checkout is left as it
is). Their wheels come from ``DTKV_HF_KERNELS_WHEELS`` (a directory), a cached download, or
``pip download``; without them that half is skipped. Dependencies both need (huggingface_hub,
torch, ...) are this interpreter's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "dynamo_tiered_kv"
HF_KERNELS = ("kernels==0.14.1", "kernels-data>=0.14.0.dev1,<0.15", "tomlkit>=0.13.3")  # theirs, as SGLang pins it
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dtkv" / "wheels" / "hf-kernels"


def _build_wheel(out: Path, tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in ROOT.iterdir():  # every top-level package of the checkout: the build decides what ships
        if pkg.is_dir() and pkg.name != "tests" and (pkg / "__init__.py").is_file():
            shutil.copytree(pkg, src / pkg.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("dynamo_tiered_kv-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    return _build_wheel(tmp / "dist", tmp)


def _hf_wheels() -> list[Path]:
    given = os.environ.get("DTKV_HF_KERNELS_WHEELS")
    where = Path(given) if given else CACHE
    found = sorted(where.glob("*.whl"))
    if len(found) >= len(HF_KERNELS):
        return found
    if given:
        pytest.skip(f"DTKV_HF_KERNELS_WHEELS={given} lacks the wheels of {HF_KERNELS}")
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(CACHE), *HF_KERNELS], check=True, timeout=300, capture_output=True, text=True)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"Hugging Face's kernels wheels not available ({e}); set DTKV_HF_KERNELS_WHEELS")
    found = sorted(CACHE.glob("*.whl"))
    if len(found) < len(HF_KERNELS):
        pytest.skip(f"pip download did not produce the wheels of {HF_KERNELS} in {CACHE}")
    return found


def test_wheel_has_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert tops == {PKG}
    assert f"{PKG}/kernels/__init__.py" in names


def test_hugging_face_kernels_still_import_after_ours(wheel: Path, tmp_path: Path) -> None:
    hf = _hf_wheels()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # Dependencies (huggingface_hub, torch, ...) from this interpreter, after the venv's own packages.
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    def install(*wheels: Path) -> None:
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                               "--no-index", *map(str, wheels)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]

    install(*hf)  # theirs first, as in an SGLang environment
    install(wheel)

    # the venv's imports only: a PYTHONPATH naming a checkout would shadow the installed wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def where(code: str) -> str:
        proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip()

    theirs = where("import kernels\nfrom kernels import get_kernel\nassert callable(get_kernel)\n"
                   "print(kernels.__file__)")
    assert Path(theirs) == site / "kernels" / "__init__.py"
    ours = where("import dynamo_tiered_kv.kernels as k\nassert callable(k.gather_records)\nprint(k.__file__)")
    assert Path(ours) == site / PKG / "kernels" / "__init__.py"
