"""The engine benches' session protocol, both sides, with a stand-in child module (no vLLM): the
parent (``bench.engine.launch``: ``run_session``, ``EngineSessions``, ``run_plan``) starts
``python -m MODULE SPEC.json OUT.json`` and follows the progress lines the child writes with
``bench.engine.session.progress``."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from dynamo_tiered_kv.bench.engine.launch import EngineSessions, run_plan, run_session

CHILD = "dtkv_fake_engine_session"

CHILD_SOURCE = """
import json
import sys
from pathlib import Path

from dynamo_tiered_kv.bench.engine.session import progress

spec = json.loads(Path(sys.argv[1]).read_text())
print("a line that is not progress", flush=True)
for i in range(spec.get("steps", 0)):
    progress(i + 1)
if spec.get("fail"):
    print("child gave up", file=sys.stderr)
    sys.exit(3)
Path(sys.argv[2]).write_text(json.dumps({"spec": spec}))
"""


class Bar:
    """Records what the parent sets on its progress bar (tqdm's attributes it uses)."""

    def __init__(self) -> None:
        self.n = 0
        self.seen: list[int] = []

    def refresh(self) -> None:
        self.seen.append(self.n)


@pytest.fixture
def child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    src = tmp_path / "mods"
    src.mkdir()
    (src / f"{CHILD}.py").write_text(textwrap.dedent(CHILD_SOURCE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH")) if p))
    return CHILD


def test_run_session_follows_the_childs_progress_from_its_offset(tmp_path: Path, child: str) -> None:
    bar = Bar()
    out = run_session({"steps": 3, "k": 1}, tmp_path, "one", bar, 10, module=child)
    assert out == {"spec": {"steps": 3, "k": 1}}
    assert bar.seen == [11, 12, 13]
    assert json.loads((tmp_path / "one.spec.json").read_text()) == {"steps": 3, "k": 1}


def test_a_failed_session_raises_with_its_output(tmp_path: Path, child: str) -> None:
    with pytest.raises(RuntimeError, match=r"engine session bad failed \(exit 3\)") as e:
        run_session({"fail": True}, tmp_path, "bad", None, 0, module=child)
    assert "a line that is not progress" in str(e.value) and "child gave up" in str(e.value)


def test_sessions_run_in_order_each_starting_where_the_last_one_ended(tmp_path: Path, child: str) -> None:
    with EngineSessions(tmp_path, 5, "test", "step", True, module=child) as runner:
        first = runner.run({"steps": 2}, 2, name="a", label="first")
        assert runner.done == 2 and runner.bar.n == 2
        second = runner.run({"steps": 3, "x": 1}, 3, name="b")
        assert runner.done == 5 and runner.bar.n == 5
    assert first == {"spec": {"steps": 2}} and second == {"spec": {"steps": 3, "x": 1}}
    assert {p.name for p in tmp_path.glob("*.out.json")} == {"a.out.json", "b.out.json"}


def test_run_plan_merges_the_base_names_the_files_and_wipes_the_ssd_when_asked(tmp_path: Path, child: str) -> None:
    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd" / "segment").write_bytes(b"x")
    plan = [("host", {"steps": 1}), ("object", {"steps": 2, "wipe_ssd": True})]
    got = run_plan(plan, [1, 2], {"model": "m"}, tmp_path, "bench", child, True)
    assert list(got) == ["host", "object"]
    assert got["object"] == {"spec": {"model": "m", "steps": 2}}  # wipe_ssd is the parent's, not the child's
    assert not (tmp_path / "ssd").exists()
    assert (tmp_path / "bench-host.out.json").exists() and (tmp_path / "bench-object.log").exists()
