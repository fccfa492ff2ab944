"""One engine session of ``dtkv bench interference``, run in its own process.

``python -m dynamo_tiered_kv.bench.interference.engine SPEC.json OUT.json``. SPEC: the keys of
``engine.session.Session`` (``engine_args``: ``max_num_seqs``, ``max_num_batched_tokens``) plus

* ``store``: prompts computed first (with the connector: stored), outside any measurement;
* ``restores``: long prompts requested during the decode (restored by the connector, or
  recomputed without one), the i-th ``start_s + i * stagger_s`` after every stream has its first
  token; ``streams`` decode requests of ``decode_prompt_tokens`` generating at least
  ``decode_tokens`` each and, in a restore phase, until every restore has its first token;
* ``rounds``: each round runs ``baseline`` (the streams alone), ``restore`` (the streams plus the
  restores) and, with ``resident``, the same long requests arriving while their prefixes are in
  vLLM's own prefix cache (computed once just before, unmeasured): the engine work a restored
  request costs beyond its restore (its computed tail attending over the whole context). Phase
  order rotates; the engine's prefix cache is emptied before each phase;
* ``persist``: at the end, seal the SSD segment and write it back to the object tier;
* ``trace_steps``: record every step's wall time and each thread's CPU during it
  (``step_trace.StepTrace``) into the result's ``step_trace``.

The engine is driven like a server: ``LLMEngine.add_request`` at arrival times, ``step()`` in a
loop; a stream's token times are the wall times of the steps that produced them.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any

from ..engine.session import Session, finish, progress, start
from .step_trace import StepTrace

#: a stream generates at most this many times ``decode_tokens`` (the engine's KV is sized for it)
MAX_DECODE_FACTOR = 8


def run_phase(s: Session, spec: dict[str, Any], tag: str, restores: list[list[int]],
              resident: bool = False, trace: StepTrace | None = None) -> dict[str, Any]:
    """Decode streams (plus ``restores`` arriving while they decode): token times and restore TTFTs.
    ``resident``: the long prompts are computed first, so their prefixes arrive in vLLM's prefix cache."""
    from ..engine.tiny_model import synthetic_tokens

    if s.store is not None:
        s.store.drain(120)
    s.llm.reset_prefix_cache()
    if resident:
        s.llm.generate([{"prompt_token_ids": p} for p in restores], s.SamplingParams(max_tokens=1, temperature=0),
                       use_tqdm=False)
        if s.store is not None:
            s.store.drain(120)
    eng = s.llm.llm_engine
    # streams decode until they have decode_tokens AND every restore has its first token, then are aborted
    dec = s.SamplingParams(max_tokens=spec["decode_tokens"] * MAX_DECODE_FACTOR, temperature=0, ignore_eos=True)
    one = s.SamplingParams(max_tokens=1, temperature=0)
    times: dict[str, list[float]] = {}
    for i in range(spec["streams"]):
        rid = f"{tag}-d{i}"
        eng.add_request(rid, {"prompt_token_ids": synthetic_tokens(spec["decode_prompt_tokens"],
                                                                   seed=hash((tag, i)) % 2**31, vocab_size=2000)}, dec)
        times[rid] = []
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    due: list[float] | None = None
    while eng.has_unfinished_requests() or (due is not None and len(added) < len(restores)):
        now = time.perf_counter()
        if len(ttft) == len(restores) and all(len(ts) >= spec["decode_tokens"] for ts in times.values()):
            eng.abort_request(list(times))
            break
        if due is None and all(times[r] for r in times):
            due = [now + spec["start_s"] + i * spec["stagger_s"] for i in range(len(restores))]
        if due is not None:
            for i, t in enumerate(due):
                rid = f"{tag}-r{i}"
                if rid not in added and now >= t:
                    eng.add_request(rid, {"prompt_token_ids": restores[i]}, one)
                    added[rid] = time.perf_counter()
        if not eng.has_unfinished_requests():
            time.sleep(0.001)
            continue
        if trace is not None:
            trace.begin()
        outs = eng.step()
        now = time.perf_counter()
        if trace is not None:
            trace.end(tag, sum(1 for r in added if r not in ttft))
        for o in outs:
            if o.request_id in times:
                n = len(o.outputs[0].token_ids)
                times[o.request_id] += [now] * (n - len(times[o.request_id]))
            elif o.request_id in added and o.request_id not in ttft and o.outputs[0].token_ids:
                ttft[o.request_id] = (now - added[o.request_id]) * 1000
    while eng.has_unfinished_requests():  # aborted streams leave the engine
        eng.step()
    itl = [(b - a) * 1000 for ts in times.values() for a, b in itertools.pairwise(ts)]
    return {"itl_ms": itl, "restore_ttft_ms": [ttft.get(f"{tag}-r{i}") for i in range(len(restores))],
            "decode_s": max(ts[-1] for ts in times.values()) - min(ts[0] for ts in times.values())}


def main(spec_path: str, out_path: str) -> None:
    spec, s, res = start(spec_path)
    res["rounds"] = []
    trace = StepTrace() if spec.get("trace_steps") else None
    done = 0
    for p in spec.get("store", []):
        s.measure(p, reset=True)
        done += 1
        progress(done)
    if s.store is not None:
        s.store.drain(120)
    names = ["baseline", "restore", *(["resident"] if spec.get("resident") else [])]
    for r in range(spec["rounds"]):
        phases = names[r % len(names):] + names[:r % len(names)]
        rnd = {}
        for ph in phases:
            rnd[ph] = run_phase(s, spec, f"r{r}-{ph}", spec["restores"] if ph != "baseline" else [],
                                resident=ph == "resident", trace=trace)
            done += 1
            progress(done)
        res["rounds"].append(rnd)
    if trace is not None:
        res["step_trace"] = trace.steps
    finish(s, spec, res, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
