"""An HTTP client for `./tlt serve`: start servers as child processes, send chat requests, and compare
the server with the drafter against the same export served without it (identical answers at T=0,
batch-1 decoding speed). tests/test_serve.py and bench/serve.py use it.
"""
from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import requests

from tlt_verl.serve.server import DEFAULT_NAME


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `./tlt serve` child process in a session of its own (vLLM's engine processes included)."""

    def __init__(self, run_dir: Path, log: Path, drafter: bool = True, port: Optional[int] = None,
                 options: tuple[str, ...] = (), extra: tuple[str, ...] = (), env: Optional[dict] = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        cmd = [sys.executable, "-m", "tlt_verl.cli", "serve", str(run_dir), "--port", str(self.port)]
        cmd += ["--no-drafter"] if not drafter else list(options)
        if extra:
            cmd += ["--", *extra]
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Seconds until /health answers; a server that exits first raises with its log's tail."""
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server on port {self.port} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.time() - t0
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server on port {self.port} not ready after {timeout_s:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server, then SIGKILL to its process group (its pid is the group's id)."""
        # vLLM's server shuts its engine processes down on SIGTERM; SIGKILL to the group if it hangs.
        for kill, sig, wait in ((os.kill, signal.SIGTERM, grace_s), (os.killpg, signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                kill(self.proc.pid, sig)
                self.proc.wait(wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        try:      # children that outlived the server (its engine core) share its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log_file.close()


@contextmanager
def servers(run_dir: Path, logs: Path, sd_options: tuple[str, ...] = (),
            extra: tuple[str, ...] = ()) -> Iterator[dict[str, Server]]:
    """The export served with ("sd", `./tlt serve` options ``sd_options``) and without ("plain") its
    drafter, started side by side and stopped by pid on the way out."""
    logs.mkdir(parents=True, exist_ok=True)
    started: dict[str, Server] = {}
    try:
        for name, drafter in (("sd", True), ("plain", False)):
            started[name] = Server(run_dir, logs / f"serve_{name}.log", drafter=drafter, options=sd_options, extra=extra)
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


def chat(url: str, messages: list[dict], max_tokens: int, model: str = DEFAULT_NAME, timeout_s: float = 300.0) -> dict:
    """One chat completion at temperature 0: its text, token count, finish reason and wall time."""
    body = {"model": model, "messages": messages, "temperature": 0.0, "max_tokens": max_tokens}
    t0 = time.perf_counter()
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s)
    total = time.perf_counter() - t0
    r.raise_for_status()
    d = r.json()
    choice = d["choices"][0]
    return {"text": choice["message"]["content"], "tokens": int(d["usage"]["completion_tokens"]),
            "finish_reason": choice.get("finish_reason"), "total_s": total}


# vLLM's /metrics counters (Prometheus) read around each batch of requests: speculative decoding's,
# and the engine's own per-request decode time (first token to last, from the engine's timestamps).
COUNTERS = {"vllm:spec_decode_num_drafts_total": "num_drafts",
            "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
            "vllm:request_decode_time_seconds_sum": "decode_s",
            "vllm:request_generation_tokens_sum": "generation_tokens",
            "vllm:request_generation_tokens_count": "requests"}


def server_counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS:
            out[COUNTERS[name]] = out.get(COUNTERS[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def task_messages(n: int, seed: int, min_steps: int = 8) -> list[list[dict]]:
    """Chat requests of the run's task with long worked solutions (at least ``min_steps`` lines)."""
    from tlt_verl.task.longtail import generate_problems

    problems = [p for p in generate_problems(64 * n, seed) if p.num_steps >= min_steps][:n]
    return [[{"role": "user", "content": p.prompt}] for p in problems]


def _delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


# vLLM's engine worker busy-polls its input queue for 1 s after its last step (SpinCondition in
# vllm/distributed/device_communicators/shm_broadcast.py) before it blocks: a server measured right
# after the other one shares its core with that spin (measured here: 0.8 s of CPU during a 2.3 s
# batch). So each server's batch starts once the other has gone idle.
SETTLE_S = 1.5


def compare(urls: dict[str, str], prompts: list[list[dict]], rounds: int, max_tokens: int, log=print) -> dict:
    """Send every prompt, one request at a time (batch 1), to the "sd" and the "plain" server: per
    round each server's batch in turn, which goes first alternating from round to round, each
    batch started once the other server is idle. Per round: answers compared at T=0, completion
    tokens per second of request time (what a client sees) and per second of the engine's own
    decode time (vLLM's counters, first token to last)."""
    names = ("sd", "plain")
    for url in urls.values():                  # one unrecorded request each: first-request costs
        chat(url, prompts[0], max_tokens=16)
    per_round, identical, total, spec = [], 0, 0, {}
    for r in range(rounds):
        before = {n: server_counters(urls[n]) for n in names}
        answers: dict[str, list] = {}
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            time.sleep(SETTLE_S)
            answers[n] = [chat(urls[n], m, max_tokens) for m in prompts]
        counters = {n: _delta(server_counters(urls[n]), before[n]) for n in names}
        same = [a["text"] == b["text"] and a["tokens"] == b["tokens"] for a, b in zip(answers["sd"], answers["plain"])]
        identical, total = identical + sum(same), total + len(same)
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            spec[k] = spec.get(k, 0.0) + counters["sd"].get(k, 0.0)
        rec: dict = {"order": list(order), "identical": sum(same), "requests": len(same)}
        for n in names:
            c, tokens = counters[n], sum(a["tokens"] for a in answers[n])
            seconds = sum(a["total_s"] for a in answers[n])
            rec.setdefault("tokens", {})[n] = tokens
            rec.setdefault("request_s", {})[n] = seconds
            rec.setdefault("request_tok_s", {})[n] = tokens / max(1e-9, seconds)
            # Tokens after each request's first, per second of the engine's decode time.
            rec.setdefault("engine_decode_tok_s", {})[n] = \
                (c.get("generation_tokens", 0) - c.get("requests", 0)) / max(1e-9, c.get("decode_s", 0))
        rec["speedup"] = rec["request_tok_s"]["sd"] / rec["request_tok_s"]["plain"]
        rec["engine_decode_speedup"] = rec["engine_decode_tok_s"]["sd"] / rec["engine_decode_tok_s"]["plain"]
        rec["loadavg_1min"] = os.getloadavg()[0]
        rec["mismatches"] = [{"prompt": i, "sd": answers["sd"][i]["text"], "plain": answers["plain"][i]["text"]}
                             for i, ok in enumerate(same) if not ok][:3]
        per_round.append(rec)
        log(f"round {r + 1}/{rounds} ({order[0]} first): identical {sum(same)}/{len(same)}, tok/s sd {rec['request_tok_s']['sd']:.1f} "
            f"plain {rec['request_tok_s']['plain']:.1f} -> {rec['speedup']:.2f}x "
            f"(engine decode {rec['engine_decode_speedup']:.2f}x; load {rec['loadavg_1min']:.1f})")

    def spread(xs: list[float]) -> dict:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
                "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0, "rounds": xs}

    speedups = [x["speedup"] for x in per_round]
    return {
        "identical_fraction": identical / max(1, total),
        "batch1_speedup": statistics.median(speedups),
        "batch1_speedup_spread": spread(speedups),
        "engine_decode_speedup": spread([x["engine_decode_speedup"] for x in per_round]),
        "acceptance_length": 1 + spec.get("num_accepted_tokens", 0.0) / max(1.0, spec.get("num_drafts", 0.0)),
        "spec_decode_counters": spec,
        "requests_per_round": len(prompts), "rounds": rounds, "max_tokens": max_tokens,
        "per_round": per_round,
    }
