"""One rule for "S3 says it is not there": a miss (None), never an error; other errors propagate."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from dynamo_tiered_kv.tiers.objectstore.s3 import or_missing


def _error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


async def _raises(e: BaseException) -> dict:
    raise e


async def _ok() -> dict:
    return {"ContentLength": 3}


@pytest.mark.parametrize(("code", "status"), [("NoSuchKey", 404), ("404", 404), ("NotFound", 404),
                                              ("InvalidRange", 416), ("", 404), ("", 416)])
async def test_missing_objects_and_ranges_are_none(code: str, status: int) -> None:
    assert await or_missing(_raises(_error(code, status))) is None


@pytest.mark.parametrize(("code", "status"), [("AccessDenied", 403), ("NoSuchBucket", 400),
                                              ("InternalError", 500), ("SlowDown", 503)])
async def test_other_errors_propagate(code: str, status: int) -> None:
    with pytest.raises(ClientError):
        await or_missing(_raises(_error(code, status)))


async def test_a_result_passes_through() -> None:
    assert await or_missing(_ok()) == {"ContentLength": 3}
