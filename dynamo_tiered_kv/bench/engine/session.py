"""One vLLM engine session for ``dtkv bench agentic`` / ``dtkv bench tiers``, run in its own process.

``python -m dynamo_tiered_kv.bench.engine.session SPEC.json OUT.json``. SPEC keys:

* ``model``, ``max_model_len``, ``block_size``, ``gpu_blocks`` (``num_gpu_blocks_override``: the
  engine's own KV space, deliberately too small for every conversation at once);
* ``connector``: ``"dtkv"`` (with ``extra_config``), ``"example"`` (vLLM's ``ExampleConnector``
  with ``shared_storage_path``) or ``null`` (no connector: pure recompute);
* ``mode``:
  - ``live``: ``conversations`` (per agent: system token ids, per-turn tool-output ids) are run
    round-robin, ``idle_s`` apart; each turn's prompt is the agent's whole history plus the new
    tool output; the time to first token is measured, then ``answer_tokens`` are generated and
    appended to the history. Afterwards ``replay`` of the prompts (host tier).
  - ``replay``: ``prompts`` are measured one by one, the engine's prefix cache emptied before each
    (other agents evicted it), so every context comes back from the connector or is recomputed.

Progress goes to stdout as ``@@dtkv {"done": n}`` lines (``progress``; the parent draws the bar).
Every session module (this one, ``restore.engine``, ``interference.engine``) starts with ``start``
and ends with ``finish``: the same result file, the same exit.

Timing definitions (all wall clock, ``perf_counter``):
* ``ttft_ms``: ``generate(max_tokens=1)`` of the prompt, as the engine user sees it;
* ``save_hook_ms``: engine-thread time inside the connector's ``save_kv_layer`` + ``wait_for_save``
  during the request (ExampleConnector writes its files synchronously there);
* ``drain_ms`` (dtkv): after the request returns, the time until ``store.drain`` reports every
  accepted offload written to every tier (host and SSD write acknowledged);
* ``load_hook_ms``: time inside ``start_load_kv`` + ``wait_for_layer_load``;
* ``restore_ms`` (dtkv): the restores' own time (``TieredStore.load`` calls, on the onboarding
  threads for asynchronous restores, which the load hooks only submit);
* ``lookup_ms``: scheduler time inside ``get_num_new_matched_tokens`` (finding the stored prefix);
* ``cpu_ms``: CPU time of the whole process (``process_time``: the engine and every thread of the
  store) from the request's submission until the store is drained after it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

#: what starts a progress line on a session's stdout; the rest is ``{"done": n}`` (``launch.run_session``)
PROGRESS_PREFIX = "@@dtkv "

_HOOKS = {"save_kv_layer": "save", "wait_for_save": "save", "start_load_kv": "load",
          "wait_for_layer_load": "load", "get_num_new_matched_tokens": "lookup"}
_timers = {"save": 0.0, "load": 0.0, "lookup": 0.0}


def progress(done: int) -> None:
    """Tell the parent that ``done`` steps of this session are done (its progress bar)."""
    print(PROGRESS_PREFIX + json.dumps({"done": done}), flush=True)


def _instrument(cls: type) -> None:
    """Wrap the connector hooks of ``cls`` with wall-clock accumulators (class-level, once)."""
    for name, bucket in _HOOKS.items():
        orig = getattr(cls, name)

        def wrapped(self, *a, _orig=orig, _bucket=bucket, **kw):
            t = time.perf_counter()
            try:
                return _orig(self, *a, **kw)
            finally:
                _timers[_bucket] += time.perf_counter() - t

        setattr(cls, name, wrapped)


def _kv_transfer(spec: dict[str, Any]) -> dict[str, Any] | None:
    if spec["connector"] == "dtkv":
        from ...connectors.vllm.connector import TieredKVConnector

        _instrument(TieredKVConnector)
        return {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": spec["extra_config"]}
    if spec["connector"] == "example":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

        _instrument(ExampleConnector)
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": spec["shared_storage_path"]}}
    return None


def _wait_for_indexes(store: Any, timeout_s: float = 120.0) -> None:
    """An object tier indexes in the background and misses until its index is ready; a serving
    engine starts before that (its first requests recompute), a benchmark of restores waits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(t.index_ready for t in store.tiers if hasattr(t, "index_ready")):
        time.sleep(0.01)


class Session:
    """An in-process ``LLM`` plus the probes the benchmark reads around each request."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import logging

        logging.disable(logging.WARNING)
        from vllm import LLM, SamplingParams

        from ...connectors.vllm.cpu_amx import request_amx_tiles

        request_amx_tiles()  # every session alike, with or without a connector (see cpu_amx.py)
        kv = _kv_transfer(spec)
        args: dict[str, Any] = {"max_num_seqs": 4, "max_num_batched_tokens": spec["max_model_len"],
                                **spec.get("engine_args", {})}  # engine_args: overrides (bench restore)
        self.llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
                       enforce_eager=True, seed=0, block_size=spec["block_size"], enable_prefix_caching=True,
                       num_gpu_blocks_override=spec["gpu_blocks"], **args,
                       **({"kv_transfer_config": kv} if kv else {}))
        self.block_size = spec["block_size"]
        self.first = SamplingParams(max_tokens=1, temperature=0)
        self.SamplingParams = SamplingParams
        self.conn = None
        if kv:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            self.conn = get_kv_transfer_group()
        worker = getattr(self.conn, "worker", None)
        self.store = getattr(worker, "store", None)
        self.worker = worker if self.store is not None else None
        if self.store is not None:
            _wait_for_indexes(self.store)
        # first forward pays one-time costs (allocation, kernel selection): keep them out
        self.llm.generate([{"prompt_token_ids": list(range(4, 4 + 2 * self.block_size + 1)), "cache_salt": "warm"}],
                          self.first, use_tqdm=False)

    def _read_bytes(self) -> dict[str, float]:
        if self.store is None:
            return {}
        return {t.name: self.store.metrics.value("tier_read_bytes_total", tier=t.name) for t in self.store.tiers}

    def measure(self, prompt: list[int], *, reset: bool) -> dict[str, Any]:
        """Time to first token of ``prompt`` plus what the connector did for it."""
        if self.store is not None:
            self.store.drain(120)  # earlier background writes finished: an idle machine
        if reset:
            self.llm.reset_prefix_cache()
        if self.worker is not None:
            self.worker.served.clear()
        before, t0 = dict(_timers), self._read_bytes()
        loaded_s = self.worker.load_seconds if self.worker is not None else 0.0
        cpu = time.process_time()  # every thread of this process: the engine, its restores, the store
        t = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], self.first, use_tqdm=False)[0]
        ttft = time.perf_counter() - t
        rec: dict[str, Any] = {"context_tokens": len(prompt), "ttft_ms": ttft * 1000,
                               "cached_tokens": int(out.num_cached_tokens or 0),
                               "first_token": list(out.outputs[0].token_ids),
                               "save_hook_ms": (_timers["save"] - before["save"]) * 1000,
                               "load_hook_ms": (_timers["load"] - before["load"]) * 1000,
                               "lookup_ms": (_timers["lookup"] - before["lookup"]) * 1000}
        if self.store is not None:
            t = time.perf_counter()
            self.store.drain(120)
            rec["drain_ms"] = (time.perf_counter() - t) * 1000
            after = self._read_bytes()
            rec["read_bytes"] = {k: after[k] - t0.get(k, 0.0) for k in after if after[k] - t0.get(k, 0.0)}
            tiers: dict[str, int] = {}
            for names in self.worker.served.values():
                for n in names:
                    tiers[n] = tiers.get(n, 0) + 1
            rec["served_blocks"] = tiers
            # the restores' own time (an async restore runs outside the load hooks)
            rec["restore_ms"] = (self.worker.load_seconds - loaded_s) * 1000
            rec["restored_tokens"] = sum(tiers.values()) * self.block_size
        # CPU of the request and of the background work it caused (promotions, writes: drained above)
        rec["cpu_ms"] = (time.process_time() - cpu) * 1000
        return rec

    def close(self) -> None:
        if self.conn is not None:
            self.conn.shutdown()  # drains offloads, seals the SSD segment, flushes it to objects


def _live(s: Session, spec: dict[str, Any]) -> dict[str, Any]:
    answer = s.SamplingParams(max_tokens=spec["answer_tokens"], temperature=0)
    convs = spec["conversations"]
    histories = [list(c["system"]) for c in convs]
    turns, prompts, done = [], [], 0
    t_start = time.perf_counter()
    gen_tokens = prompt_tokens = 0
    for turn in range(max(len(c["tools"]) for c in convs)):
        for a, conv in enumerate(convs):
            if turn >= len(conv["tools"]):
                continue
            if done:
                time.sleep(spec["idle_s"])  # the agent runs its tool; the GPU serves others
            prompt = histories[a] + conv["tools"][turn]
            rec = s.measure(prompt, reset=False)  # no reset: eviction by other agents is real here
            t = time.perf_counter()
            reply = s.llm.generate([{"prompt_token_ids": prompt}], answer, use_tqdm=False)[0]
            rec["answer_ms"] = (time.perf_counter() - t) * 1000
            ids = list(reply.outputs[0].token_ids)
            gen_tokens += len(ids) + 1
            prompt_tokens += len(prompt)
            histories[a] = prompt + ids
            rec.update(agent=a, turn=turn + 1)
            turns.append(rec)
            prompts.append({"agent": a, "turn": turn + 1, "prompt": prompt})
            done += 1
            progress(done)
    wall = time.perf_counter() - t_start
    if s.store is not None:  # seal + write back to objects now, so no flush runs under the replay
        s.store.persist(300)
    return {"turns": turns, "prompts": prompts, "wall_s": wall, "generated_tokens": gen_tokens,
            "prompt_tokens": prompt_tokens}


def _replay(s: Session, spec: dict[str, Any], start: int = 0) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(spec["prompts"]):
        rec = s.measure(p["prompt"], reset=True)
        rec.update(agent=p.get("agent", 0), turn=p.get("turn", i + 1))
        out.append(rec)
        progress(start + i + 1)
    return out


def start(spec_path: str) -> tuple[dict[str, Any], Session, dict[str, Any]]:
    """A session module's start: its spec (``SPEC.json``), the engine session built from it, and
    the result to fill, which begins with the engine's start time (``engine_start_s``)."""
    spec = json.loads(Path(spec_path).read_text())
    t = time.perf_counter()
    s = Session(spec)
    return spec, s, {"engine_start_s": time.perf_counter() - t}


def finish(s: Session, spec: dict[str, Any], res: dict[str, Any], out_path: str) -> NoReturn:
    """A session module's end: persist if ``spec["persist"]`` (seal the SSD segment, write it back
    to objects), close (timed: ``close_s``), write ``res`` to ``out_path`` and exit the process."""
    if spec.get("persist") and s.store is not None:
        s.store.persist(300)
    t = time.perf_counter()
    s.close()
    res["close_s"] = time.perf_counter() - t
    Path(out_path).write_text(json.dumps(res))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # state is persisted; skip the in-process engine's slow interpreter-exit teardown


def main(spec_path: str, out_path: str) -> None:
    spec, s, result = start(spec_path)
    if spec["mode"] == "live":
        result["live"] = _live(s, spec)
        spec["prompts"] = result["live"]["prompts"]
        result["replay"] = _replay(s, spec, start=len(result["live"]["turns"]))
    else:
        result["replay"] = _replay(s, spec)
    finish(s, spec, result, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
