"""The SGLang backend's namespace names everything in SGLang's ``ServerArgs`` that changes KV bytes.

Every field of the installed ``ServerArgs`` must be classified in ``SERVER_ARGS_FIELDS``; every
``identity:`` field must move the namespace; servers sharing a bucket that differ in quantization,
revision or model overrides never read each other's pages.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="sglang 0.5.23 not installed (bash .ci/install-sglang.sh)")
from dynamo_tiered_kv.blocks.layout import EngineLayout
from dynamo_tiered_kv.connectors.sglang.identity import (
    SERVER_ARGS_FIELDS,
    hub_commit,
    model_identity,
    namespace_for,
    ranks_of,
    server_identity,
)
from dynamo_tiered_kv.testing import sglang_host as sh

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 16, 4
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def sgl() -> sh.Sglang:
    return sh.load_sglang()


def server_args(**fields: Any) -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(**{"model_path": "org/model", **fields})


@contextmanager
def published(args: Any) -> Iterator[None]:
    """This process as an SGLang scheduler that published ``args`` (SGLang's own runtime context)."""
    from sglang.srt import runtime_context as rc

    with rc.use_context(rc.create_context(args, role="scheduler")):
        yield


def server_fields() -> list[str]:
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    return [f.name for f in record_fields(ServerArgs)]


def namespace_digest(sgl: sh.Sglang, args: Any, override: str = "") -> bytes:
    pool = sh.mha_host_pool(sgl, "page_first", layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE, pages=4)
    layout = EngineLayout.from_sglang_host(pool.kv_buffer, "page_first", PAGE, mla=False)
    conf = sh.storage_config(sgl, {}, model_name="served-name")
    ns = namespace_for(layout.shape, model_id=model_identity("served-name", override, args), kv_dtype="bfloat16",
                       ranks=ranks_of(conf), is_mla=False, tenant_salt="")
    return ns.digest


def test_every_server_args_field_is_classified() -> None:
    fields = server_fields()
    assert len(fields) > 100
    missing = sorted(set(fields) - set(SERVER_ARGS_FIELDS))
    assert not missing, f"classify these ServerArgs fields in connectors/sglang/server_args_table.py: {missing}"
    bad = {k: v for k, v in SERVER_ARGS_FIELDS.items() if not v.startswith(("identity: ", "ignored: "))}
    assert not bad


def _other_value(default: Any) -> Any:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default + 0.5
    return "dtkv-probe"


def test_every_identity_field_reaches_the_namespace(sgl: sh.Sglang) -> None:
    base = server_args()
    want = namespace_digest(sgl, base)
    identity = [k for k, v in SERVER_ARGS_FIELDS.items() if v.startswith("identity: ")]
    assert {"quantization", "revision", "json_model_override_args", "kv_cache_dtype", "dtype", "page_size",
            "tp_size", "weight_version"} <= set(identity)
    unmoved = [name for name in identity
               if namespace_digest(sgl, server_args(**{name: _other_value(getattr(base, name))})) == want]
    assert not unmoved
    assert namespace_digest(sgl, server_args(log_level="debug", port=1234)) == want  # ignored fields


def test_model_id_override_drops_the_path_not_the_settings(sgl: sh.Sglang) -> None:
    a = namespace_digest(sgl, server_args(model_path="/mnt/a/model"), override="shared")
    assert namespace_digest(sgl, server_args(model_path="/mnt/b/model"), override="shared") == a
    assert namespace_digest(sgl, server_args(model_path="/mnt/b/model", quantization="fp8"), override="shared") != a


def test_hub_commit_names_the_snapshot_a_branch_resolved_to(sgl: sh.Sglang, tmp_path: Path) -> None:
    repo = tmp_path / "models--org--model"
    refs = repo / "refs"
    for d in (refs, repo / "snapshots" / COMMIT_A, repo / "snapshots" / COMMIT_B):
        d.mkdir(parents=True)
    (refs / "main").write_text(COMMIT_A)
    args = server_args(download_dir=str(tmp_path))
    assert hub_commit("org/model", None, str(tmp_path)) == COMMIT_A
    assert f"commit={COMMIT_A}" in server_identity(args)
    before = namespace_digest(sgl, args)
    (refs / "main").write_text(COMMIT_B)  # the hub's main moved and the server downloaded it
    assert namespace_digest(sgl, args) != before
    assert hub_commit("org/model", COMMIT_B, None) == COMMIT_B
    assert hub_commit(str(tmp_path), None, None) == ""  # a local path: the weights fingerprint covers it
    assert hub_commit("org/absent", None, str(tmp_path)) == ""


SHARED_TIERS = {"host_capacity_bytes": 0, "staging_slab_bytes": 1 << 20, "staging_slabs": 4,
                "object_refresh_s": None}


@pytest.mark.parametrize("differs", [{"quantization": "fp8"}, {"revision": "v2"},
                                     {"json_model_override_args": '{"num_hidden_layers": 1}'}])
def test_servers_sharing_a_bucket_with_other_weights_never_share_pages(sgl: sh.Sglang, tmp_path: Path,
                                                                      differs: dict[str, Any]) -> None:
    """Same served model name, another --quantization/--revision/--json-model-override-args: a miss."""
    extra = sh.backend_extra(**SHARED_TIERS, object_url=f"file://{tmp_path / 'obj'}")
    hashes = sh.page_hashes(sgl, list(range(3 * PAGE)), PAGE)

    def attach(args: Any) -> tuple[Any, Any]:
        pool = sh.mha_host_pool(sgl, "page_first", layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE,
                                pages=8)
        with published(args):
            return sh.attach(sgl, sh.storage_config(sgl, extra, model_name="served"), pool), pool

    writer, pool = attach(server_args(model_path="dummy"))
    writer.batch_set_v1(hashes, pool.alloc(3 * PAGE))
    writer.store.persist(30)
    writer.close()
    seen = {}
    for name, args in {"same": server_args(model_path="dummy"),
                       "other": server_args(model_path="dummy", **differs)}.items():
        reader, _ = attach(args)
        seen[name] = _exists_when_indexed(reader, hashes)
        reader.close()
    assert seen == {"same": 3, "other": 0}


def _exists_when_indexed(backend: Any, hashes: list[str]) -> int:
    """A fresh object tier indexes in the background (misses until then)."""
    end = time.monotonic() + 15
    for t in backend.store.tiers:
        while not getattr(t, "index_ready", True) and time.monotonic() < end:
            time.sleep(0.05)
    return backend.batch_exists(hashes)


def test_served_weight_version_names_the_weights(sgl: sh.Sglang) -> None:
    """A backend attached after a weight update that named a version (SGLang records it in its runtime
    context, not in ServerArgs) is in another namespace than one attached before it."""
    from sglang.srt import runtime_context as rc

    args = server_args(model_path="dummy")
    with published(args):
        before = namespace_digest(sgl, args)
        rc.get_context().override("scheduler.weight_version", weight_version="step-42")
        assert namespace_digest(sgl, args) != before
