"""The connector's worker takes its tensor- and pipeline-parallel rank from vLLM's distributed
state; with more than one rank and that state unreadable it refuses to start rather than take
rank 0 (every rank would write the same keys into the shared object tier)."""

from __future__ import annotations

import pytest

from dynamo_tiered_kv.connectors.vllm.connector import _rank
from dynamo_tiered_kv.errors import ConfigError


def test_one_rank_needs_no_distributed_state() -> None:
    assert _rank("tensor", 1) == 0
    assert _rank("pipeline", 1) == 0


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_an_unknown_rank_among_several_is_refused(kind: str) -> None:
    # no vLLM distributed group is initialised in this process
    with pytest.raises(ConfigError, match=f"{kind}-parallel rank is unknown"):
        _rank(kind, 8)


def test_the_rank_comes_from_vllms_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.distributed as dist

    class _Group:
        rank_in_group = 3

    monkeypatch.setattr(dist, "get_tensor_model_parallel_rank", lambda: 5)
    monkeypatch.setattr(dist, "get_pp_group", lambda: _Group())
    assert _rank("tensor", 8) == 5
    assert _rank("pipeline", 4) == 3
