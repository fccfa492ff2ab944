"""Uploads are signed with UNSIGNED-PAYLOAD: no SHA-256 of the body on either side, also over
plain HTTP; the server accepts them and the bytes read back are the bytes sent."""

from __future__ import annotations

import os

import pytest
from infra.s3util import S3Server, unique_bucket

from dynamo_tiered_kv.tiers.objectstore import S3Backend

pytest_plugins = ["infra.fixtures_s3"]


@pytest.fixture(params=["moto_s3", pytest.param("ceph_s3", marks=pytest.mark.s3)])
def server(request: pytest.FixtureRequest) -> S3Server:
    return request.getfixturevalue(request.param)


async def test_puts_and_parts_carry_no_payload_hash(server: S3Server) -> None:
    b = S3Backend(unique_bucket("unsigned"), part_bytes=5 << 20, **server.backend_kwargs())
    await b.open()
    puts: dict[str, set[str]] = {"object": set(), "part": set()}

    def capture(request, **_: object) -> None:
        if (request.method == "PUT" and "/small" in request.url) or "partNumber=" in request.url:
            value = request.headers.get("X-Amz-Content-SHA256", b"")
            puts["part" if "partNumber=" in request.url else "object"].add(
                value.decode() if isinstance(value, bytes) else str(value))

    b._client.meta.events.register("before-send.s3", capture)
    try:
        small, large = os.urandom(1 << 20), os.urandom((11 << 20) + 17)
        assert await b.put_object("small", memoryview(small), if_absent=True)
        assert await b.put_object("large", memoryview(large), if_absent=True)  # multipart
        assert puts == {"object": {"UNSIGNED-PAYLOAD"}, "part": {"UNSIGNED-PAYLOAD"}}
        assert await b.get_bytes("small") == small
        assert await b.get_bytes("large") == large
    finally:
        await b.close()
