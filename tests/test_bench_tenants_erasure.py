"""``dtkv bench tenants --erasure --quick`` end to end: node A running in the bench process, node B
and the new process on its view as child processes, ``dtkv tenants erase`` as its own process, on
a local-directory bucket; then nothing of the erased tenant is readable anywhere."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from dynamo_tiered_kv.bench import report
from dynamo_tiered_kv.cli import main

# a run waits at most --erase-timeout-s (300 s) per node; quick runs take seconds each
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out_file = tmp_path_factory.mktemp("erasure") / "result.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            assert main(["bench", "tenants", "--erasure", "--quick", "--json", str(out_file)]) == 0
    finally:
        report.set_progress(True)  # process-wide
    return json.loads(out_file.read_text()), stdout.getvalue()


def test_nothing_of_the_erased_tenant_is_readable_and_every_node_is_clean_in_time(quick) -> None:
    res = quick[0]
    assert set(res) >= {"erasure"} and "flood" not in res and "crypto" not in res  # --erasure alone
    er = res["erasure"]
    assert er["object_store"] == "local directory" and er["refresh_s"] == 1.0
    assert [r["encryption"] for r in er["runs"]] == ["off", "on"]
    for r in er["runs"]:
        n = r["blocks"]
        assert r["node_a_before"] == {"host": n, "ssd": n, "object": n}
        assert r["node_b"]["catalog_listed"] and r["node_b"]["held"]["ssd"] == n  # node B had them on its SSD
        assert r["command"]["records"] >= n and r["command"]["errors"] == 0
        assert r["command"]["key_destroyed"] == (r["encryption"] == "on")
        # finite times, within the documented bound (refresh + sweep) plus a loaded machine's margin
        bound = er["refresh_s"] + er["sweep_s"] + 60
        assert 0 < r["running_node_clean_s"] < bound
        assert sum(r["running_node_left"].values()) == 0 and r["running_node_kept"]["ssd"] == n
        p = r["new_process"]
        assert p["clean_after_erase_s"] is not None and 0 < p["clean_after_open_s"] < bound
        assert p["held_at_open"] >= n  # its SSD still named them when it opened...
        assert sum(p["held_at_end"].values()) == 0 and p["restored_at_end"] == 0  # ...none once it applied
        assert p["kept_tenant_found"] == n  # the other tenant's blocks are all still there
        if r["encryption"] == "on":
            assert p["restored_at_open"] == 0  # its key is gone: not one block opens, even before the sweep
        left = r["left"]
        assert left["readable_bytes"] == 0 and left["readable_records"] == 0
        assert left["plaintext_runs"] == 0 and left["listed_records"] == 0 and not left["key_exists"]
        assert left["kept_tenant_readable_bytes"] >= n * r["record_bytes"]  # the scan does find records
    assert er["goal"] == {"readable_bytes_left": 0, "all_clean_in_time": True, "met": True}


def test_the_erasure_table_and_goal_are_printed(quick) -> None:
    out = quick[1]
    assert "erasure: 4 blocks per tenant" in out and "new process clean s (from erase)" in out
    assert "goal: no readable byte of the erased tenant left" in out and ": met" in out


@pytest.mark.parametrize("argv", [["--erase-blocks", "0"], ["--erase-runs", "0"], ["--erase-refresh-s", "0"],
                                  ["--measures", "flood,erasure,nope"]])
def test_bad_erasure_arguments_are_refused_before_anything_is_built(argv: list[str], tmp_path, capsys) -> None:
    assert main(["bench", "tenants", "--erasure", *argv, "--json", str(tmp_path / "r.json")]) == 2
    assert "error: --" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
