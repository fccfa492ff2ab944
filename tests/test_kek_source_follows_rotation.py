"""A running worker follows a rotated key-encryption key source: a mounted Kubernetes Secret (or
a key file) that changes is re-read, at most once per ``check_s``, so new tenant keys are wrapped
under the new current version without a restart, versions still in the source keep opening what
they wrapped, and a version gone or replaced by other material is a miss, never another key."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_tiered_kv.errors import ConfigError
from dynamo_tiered_kv.tenants.kek import KeySource
from dynamo_tiered_kv.tenants.keystore import TenantKeyStore, TenantKeyUnreadable
from dynamo_tiered_kv.testing.clock import ManualClock
from dynamo_tiered_kv.tiers.objectstore import LocalDirBackend

T1, T2, T3, T4 = (bytes([i]) * 8 for i in (1, 2, 3, 4))
K1, K2, K3 = (bytes([i]) * 32 for i in (0xA1, 0xB2, 0xC3))
CHECK_S = 5.0


def b64(k: bytes) -> str:
    return base64.b64encode(k).decode()


class SecretMount:
    """A directory laid out and updated as the kubelet projects a Secret volume: the files live in
    a timestamped directory, ``..data`` links to it and each key is a link ``name -> ..data/name``.
    An update writes a new timestamped directory, renames a fresh ``..data`` link over the old one
    (the atomic swap), links new names, unlinks gone ones and removes the old directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.updates = 0

    def publish(self, files: dict[str, str]) -> None:
        self.updates += 1
        new = self.root / f"..2026_12_03_10_00_{self.updates:02d}.{1000 + self.updates}"
        new.mkdir()
        for name, text in files.items():
            (new / name).write_text(text)
        data = self.root / "..data"
        old = os.readlink(data) if data.is_symlink() else None
        os.symlink(new.name, self.root / "..data_tmp")
        os.rename(self.root / "..data_tmp", data)
        for name in files:
            if not (self.root / name).is_symlink():
                os.symlink(f"..data/{name}", self.root / name)
        for entry in self.root.iterdir():
            if not entry.name.startswith(".") and entry.name not in files:
                entry.unlink()
        if old is not None:
            shutil.rmtree(self.root / old)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(10)
    lp.close()


def on(loop: asyncio.AbstractEventLoop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(60)


def copies(bucket: Path, ks: TenantKeyStore, tenant: bytes) -> set[str]:
    """The KEK versions the tenant's stored key is wrapped under."""
    return set(json.loads((bucket / ks.object_name(tenant)).read_bytes())["copies"])


def test_a_rotated_secret_directory_is_followed_without_a_restart(tmp_path: Path, loop) -> None:
    clock = ManualClock(0.0)
    mount = SecretMount(tmp_path / "secret")
    mount.publish({"v1": b64(K1)})
    src = KeySource.from_dir(mount.root, check_s=CHECK_S, clock=clock)
    bucket = tmp_path / "bucket"
    # no key caching: every read goes to the key store and unwraps under the source's KEKs
    ks = TenantKeyStore(LocalDirBackend(bucket), src, key_cache_s=0, absent_cache_s=0)
    key1 = on(loop, ks.get_or_create(T1))
    assert copies(bucket, ks, T1) == {"v1"}

    mount.publish({"v1": b64(K1), "v2": b64(K2), "current": "v2"})
    on(loop, ks.get_or_create(T2))  # within check_s of the last look: the source is not stat'ed again
    assert copies(bucket, ks, T2) == {"v1"}
    clock.t += CHECK_S
    key3 = on(loop, ks.get_or_create(T3))
    assert copies(bucket, ks, T3) == {"v2"}  # new tenant keys: the new current version
    assert src.current_key() == ("v2", K2)
    assert on(loop, ks.get(T1)) == key1  # v1 is still in the source: what it wrapped still opens

    # v1 leaves the source before the tenant keys were rotated: a miss for T1, never a second key
    mount.publish({"v2": b64(K2), "current": "v2"})
    clock.t += CHECK_S
    assert on(loop, ks.get(T1)) is None
    with pytest.raises(TenantKeyUnreadable):
        on(loop, ks.get_or_create(T1))
    assert ks.lookup(loop)(T1, True) is None  # the record path: a miss, not an error
    assert on(loop, ks.get(T3)) == key3

    # other material under the old version's name opens nothing it did not wrap
    mount.publish({"v1": b64(K3), "v2": b64(K2), "current": "v2"})
    clock.t += CHECK_S
    assert on(loop, ks.get(T1)) is None and on(loop, ks.get(T3)) == key3
    # the right v1 back in the source: T1 opens again, its key unchanged
    mount.publish({"v1": b64(K1), "v2": b64(K2), "current": "v2"})
    clock.t += CHECK_S
    assert on(loop, ks.get(T1)) == key1

    # a broken update (current names a version with no key) keeps the keys in use
    mount.publish({"v1": b64(K1), "v2": b64(K2), "current": "v9"})
    clock.t += CHECK_S
    on(loop, ks.get_or_create(T4))
    assert src.current == "v2" and copies(bucket, ks, T4) == {"v2"}
    assert src.versions() == ("v1", "v2")


def test_a_key_file_in_a_secret_mount_is_followed(tmp_path: Path) -> None:
    clock = ManualClock(0.0)
    mount = SecretMount(tmp_path / "secret")
    mount.publish({"keks.txt": f"v1={b64(K1)}\n"})
    src = KeySource.from_file(mount.root / "keks.txt", check_s=CHECK_S, clock=clock)
    assert src.current_key() == ("v1", K1)
    mount.publish({"keks.txt": f"v1={b64(K1)}\nv2={b64(K2)}\ncurrent=v2\n"})
    assert src.current == "v1"
    clock.t += CHECK_S
    assert src.current_key() == ("v2", K2) and src.get("v1") == K1
    # a file replaced by rename (an editor, a config tool) is followed too
    plain = tmp_path / "keks.json"
    plain.write_text(json.dumps({"keys": {"v2": b64(K2)}}))
    src = KeySource.from_file(plain, check_s=CHECK_S, clock=clock)
    tmp = tmp_path / "keks.json.new"
    tmp.write_text(json.dumps({"current": "v3", "keys": {"v2": b64(K2), "v3": b64(K3)}}))
    os.replace(tmp, plain)
    clock.t += CHECK_S
    assert src.current_key() == ("v3", K3) and src.get("v2") == K2


def test_env_and_memory_sources_do_not_change(tmp_path: Path) -> None:
    env = {"KEKS": f"v1={b64(K1)}"}
    src = KeySource.from_env("KEKS", environ=env)
    env["KEKS"] = f"v2={b64(K2)}"  # a process's own environment: only reload() reads it again
    assert src.current_key() == ("v1", K1)
    src.reload()
    assert src.current_key() == ("v2", K2)
    assert KeySource({"v1": K1}).current_key() == ("v1", K1)
    with pytest.raises(ConfigError, match="check_s"):
        KeySource.from_file(tmp_path / "x", check_s=0)
