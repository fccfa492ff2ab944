"""Shared S3 fixtures: an in-process moto server (always) and Ceph RGW (marked ``s3``).

Use them from a test module with ``pytest_plugins = ["infra.fixtures_s3"]`` (helpers such as
``S3Server`` and ``unique_bucket`` live in ``infra.s3util``). Ceph RGW resolution order:

1. ``DTKV_S3_ENDPOINT`` (+ ``DTKV_S3_ACCESS_KEY`` / ``DTKV_S3_SECRET_KEY``) set, e.g. by ``.ci/run``;
2. else, if ``radosgw`` is installed, ``tests/infra/ceph_rgw.sh`` starts a cluster for the session;
3. else the ``s3`` tests skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from .faultproxy import FaultProxy
from .s3util import S3Server

CEPH_SCRIPT = Path(__file__).with_name("ceph_rgw.sh")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for sk in socks:
            sk.bind(("127.0.0.1", 0))
        return [sk.getsockname()[1] for sk in socks]
    finally:
        for sk in socks:
            sk.close()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}", "testing", "testing", "moto")
    finally:
        server.stop()


@pytest.fixture(scope="session")
def ceph_s3() -> Iterator[S3Server]:
    env = os.environ
    if env.get("DTKV_S3_ENDPOINT"):
        yield S3Server(env["DTKV_S3_ENDPOINT"], env.get("DTKV_S3_ACCESS_KEY", "testing"),
                       env.get("DTKV_S3_SECRET_KEY", "testing"), "ceph")
        return
    if shutil.which("radosgw") is None:
        pytest.skip("no S3 server: set DTKV_S3_ENDPOINT or install radosgw ceph-mon ceph-osd "
                    "(apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd ceph-mgr)")
    d = tempfile.mkdtemp(prefix="dtkv-ceph-")
    # Free ports, so concurrent test sessions (and a CI-started cluster) never collide.
    port, mon2, mon1 = (str(p) for p in _free_ports(3))
    senv = {**env, "RGW_PORT": port, "MON_PORT_V2": mon2, "MON_PORT_V1": mon1}
    r = subprocess.run([str(CEPH_SCRIPT), "start", d], capture_output=True, text=True, env=senv, timeout=180)
    if r.returncode != 0:
        subprocess.run([str(CEPH_SCRIPT), "stop", d], env=senv, timeout=60)
        shutil.rmtree(d, ignore_errors=True)
        msg = f"Ceph RGW did not start:\n{r.stderr[-3000:]}"
        if env.get("DTKV_REQUIRE_S3") == "1":
            pytest.fail(msg)
        pytest.skip(msg)  # an infrastructure failure, not a product one; DTKV_REQUIRE_S3=1 makes it fatal
    try:
        yield S3Server(f"http://127.0.0.1:{port}", "testing", "testing", "ceph")
    finally:
        subprocess.run([str(CEPH_SCRIPT), "stop", d], env=senv, timeout=60)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["moto_s3", pytest.param("ceph_s3", marks=pytest.mark.s3)])
def server(request: pytest.FixtureRequest) -> S3Server:
    """Each test that takes it runs on moto and on Ceph RGW (marked ``s3``)."""
    return request.getfixturevalue(request.param)


@pytest.fixture
async def proxy(server: S3Server) -> AsyncIterator[FaultProxy]:
    """A fault-injecting TCP proxy in front of ``server`` (``infra.faultproxy``)."""
    host, port = server.endpoint.rsplit("//", 1)[1].split(":")
    p = await FaultProxy(host, int(port)).start()
    yield p
    await p.stop()
