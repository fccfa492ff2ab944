"""Import every module of the installed ``dynamo_tiered_kv`` (run by .ci/plain-install-smoke.sh in a
virtualenv with the runtime dependencies only). A module may fail to import only for want of what
its user brings: the engine it adapts (vLLM, SGLang) or an optional extra (``gpu``, ``bench``); the
conformance suite may want pytest. Anything else (a test tool, a missing runtime dependency) fails."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import dynamo_tiered_kv

# top-level module -> who brings it
BROUGHT = {"vllm": "the vLLM engine", "msgspec": "the vLLM engine (its dependency)", "sglang": "SGLang",
           "triton": "the gpu extra", "matplotlib": "the bench extra", "nixl": "the nixl extra"}
TEST_SUITE = {"dynamo_tiered_kv.testing.conformance": {"pytest", "hypothesis"}}
# modules a user names in an engine's config: each must import, or want only its engine
USER_FACING = ["dynamo_tiered_kv.connectors.vllm", "dynamo_tiered_kv.connectors.sglang.backend",
               "dynamo_tiered_kv.connectors.vllm_tiering", "dynamo_tiered_kv.cli", "dynamo_tiered_kv.factory"]


def main() -> int:
    found = pkgutil.walk_packages(dynamo_tiered_kv.__path__, "dynamo_tiered_kv.", onerror=lambda name: None)
    names = [m.name for m in found]
    ok: list[str] = []
    wants: dict[str, list[str]] = {}
    bad: list[str] = []
    for name in ["dynamo_tiered_kv", *names]:
        try:
            importlib.import_module(name)
            ok.append(name)
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            if top in BROUGHT or top in TEST_SUITE.get(name, set()):
                wants.setdefault(top, []).append(name)
            else:
                bad.append(f"{name}: {type(e).__name__}: {e}")
        except Exception as e:
            bad.append(f"{name}: {type(e).__name__}: {e}")
    tools = sorted({"pytest", "hypothesis", "moto"} & {m.split(".")[0] for m in sys.modules})
    print(f"plain-install: {len(ok)} modules import; " + "; ".join(
        f"{len(v)} want {BROUGHT.get(k, k)} ({k})" for k, v in sorted(wants.items())), file=sys.stderr)
    for m in USER_FACING:
        state = "imports" if m in ok else next((f"wants {k} only" for k, v in wants.items() if m in v),
                                               "not in this version" if m not in names else "FAILS (above)")
        print(f"plain-install:   {m}: {state}", file=sys.stderr)
    if tools:
        bad.append(f"test tools loaded by product modules: {', '.join(tools)}")
    for line in bad:
        print(f"plain-install: FAILED: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
