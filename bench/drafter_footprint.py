"""The drafter's footprint at real shapes on CPU: bytes moved and host RAM added by TLT per weight
sync and per step (issue 39, point 3).

Random weights at real sizes: Qwen2.5-7B (vocabulary 152,064 x hidden 3,584, untied head) and
Qwen2.5-0.5B (151,936 x 896, tied), both in bf16, the rollout's dtype. One run measures one
implementation, the code importable as ``tlt_verl`` (point PYTHONPATH at an older tree to measure
it); ``--combine`` writes bench/results/drafter_footprint.json from a "before" and an "after" run.

What one run does, on a training rank (``DrafterProcess(..., capture=True)``):

1. starts the drafter's child process;
2. three weight syncs, as verl's adapter hands them over (tlt_verl/rollout/engine/adapter.py: a
   host copy of the embedding and LM head tapped from the weight stream, then
   ``set_target_tensors``): new weights, new weights again, then the same weights;
3. SIGKILLs the child and waits for its restart (which re-applies the latest target tensors);
4. closes it and starts a non-training rank's drafter (``capture=False``), measured alone;
5. one step's capture: a micro-batch of hidden states through ``verl_capture`` into the staging
   buffer whose byte budget is smaller than the micro-batch.

Bytes moved for a sync: bytes through the pipe (the parent's ``send_bytes``/``recv_bytes``,
counted) plus bytes written into freshly touched host memory by the parent and the child (minor
page faults x page size: every copy into a new buffer faults its pages in; the adapter's tap
copy included) plus bytes the implementation reports it copied into memory it already owned
(``DrafterProcess.target_bytes_copied``, an in-place rewrite of a shared segment faults nothing;
0 for an implementation without the counter). Host RAM: PSS (proportional set size, from
/proc/<pid>/smaps_rollup: a page shared by the parent and the child counts once in the sum) of
the parent plus the child, as an increase over the parent before the drafter started plus a
child that holds no target tensors (the drafter's own weights are the same in both
implementations and are not what point 2 is about). Sampled every 50 ms for peaks.

Run it alone: the 7B case holds several GB; the script stops itself (and its child) when the
machine's available memory falls below --min-available-gb.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing import connection
from pathlib import Path

import torch

SHAPES = {
    # vocab, hidden, heads, kv heads, intermediate, layers, tied
    "7b": dict(vocab_size=152064, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, num_hidden_layers=28, tie_word_embeddings=False),
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, num_hidden_layers=24, tie_word_embeddings=True),
}
PAGE = os.sysconf("SC_PAGE_SIZE")
GB = 1e9


# ---------------------------------------------------------------------- measurement

def _impl() -> str:
    """Which tlt_verl ran, without naming this machine's paths: the repository's, or another tree's commit."""
    import subprocess

    import tlt_verl

    here = Path(tlt_verl.__file__).resolve().parent
    commit = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return f"tlt_verl at {commit or 'an unversioned tree'}"


def smaps(pid: int) -> dict[str, int]:
    """Bytes of /proc/<pid>/smaps_rollup's fields (Rss, Pss, Private_Dirty, ...)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def pss(pid: int | None) -> int:
    return 0 if pid is None else smaps(pid).get("Pss", 0)


def uss(pid: int | None) -> int:
    if pid is None:
        return 0
    s = smaps(pid)
    return s.get("Private_Clean", 0) + s.get("Private_Dirty", 0)


def minflt(pid: int | None) -> int:
    if pid is None:
        return 0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7])          # field 10 of stat(5): minor faults


def available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class PipeCounter:
    """Bytes the parent sends to and receives from any multiprocessing pipe while installed."""

    def __init__(self):
        self.sent = self.received = 0
        self._send, self._recv = connection.Connection.send_bytes, connection.Connection.recv_bytes
        counter = self

        def send_bytes(conn, buf, offset=0, size=None):
            n = memoryview(buf).nbytes
            counter.sent += (n - offset) if size is None else size
            return counter._send(conn, buf, offset, size)

        def recv_bytes(conn, maxlength=None):
            data = counter._recv(conn, maxlength)
            counter.received += len(data)
            return data

        connection.Connection.send_bytes = send_bytes
        connection.Connection.recv_bytes = recv_bytes

    @property
    def total(self) -> int:
        return self.sent + self.received


class Watch:
    """Samples the PSS of this process + the drafter's child; stops both when memory runs out."""

    def __init__(self, child_pid, min_available: int):
        self.child_pid, self.min_available = child_pid, min_available
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.05):
            pid = self.child_pid()
            try:
                self.peak = max(self.peak, pss(os.getpid()) + pss(pid))
            except (FileNotFoundError, ProcessLookupError):
                pass
            if available() < self.min_available:
                print(f"drafter_footprint: MemAvailable {available() / GB:.1f} GB < "
                      f"{self.min_available / GB:.1f} GB: stopping", file=sys.stderr, flush=True)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                os._exit(3)

    def reset(self):
        self.peak = pss(os.getpid()) + pss(self.child_pid())

    def stop(self):
        self._stop.set()
        self._thread.join()


@dataclass
class Moved:
    pipe_bytes: int
    faulted_bytes: int            # parent + child, fresh pages x page size
    in_place_bytes: int           # reported by the implementation
    seconds: float

    @property
    def total(self) -> int:
        return self.pipe_bytes + self.faulted_bytes + self.in_place_bytes


# ---------------------------------------------------------------------- the target

def write_target(folder: Path, shape: str) -> Path:
    """config.json + model.safetensors holding only the embedding and LM head (what a drafter
    reads), bf16 random; reused when present."""
    from safetensors.torch import save_file

    s = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "model.safetensors").is_file():
        return folder
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643, **s}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(s["vocab_size"], s["hidden_size"], generator=g,
                                                        dtype=torch.bfloat16)}
    if not s["tie_word_embeddings"]:
        tensors["lm_head.weight"] = torch.randn(s["vocab_size"], s["hidden_size"], generator=g, dtype=torch.bfloat16)
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.rename(folder / "model.safetensors")
    return folder


def service_config(shape: str, rollout_dtype: str):
    from tlt_verl.capture.buffer import BufferConfig
    from tlt_verl.spot.drafter_service import DrafterServiceConfig

    # A staging budget below one micro-batch's states, so that capture's trim is exercised.
    kw = dict(kind="eagle", buffer=BufferConfig(kind="eagle", budget_bytes=64 << 20, dtype="bfloat16"))
    if "target_dtype" in DrafterServiceConfig.__dataclass_fields__:
        kw["target_dtype"] = rollout_dtype
    return DrafterServiceConfig(**kw)


# ---------------------------------------------------------------------- one run

def run(shape: str, label: str, min_available_gb: float, work: Path, restart: bool = True) -> dict:
    import tlt_verl
    from tlt_verl.spot.drafter_process import DrafterProcess

    s = SHAPES[shape]
    V, H, tied = s["vocab_size"], s["hidden_size"], s["tie_word_embeddings"]
    embed_head = V * H * 2 * (1 if tied else 2)          # bf16, the rollout's dtype
    target = write_target(work / f"target-{shape}", shape)
    counter = PipeCounter()
    proc_ref: list = [None]

    def child_pid():
        p = proc_ref[0]
        return None if p is None else p.pid

    def alive_child():
        p = proc_ref[0]
        return None if p is None or p._proc is None or not p._proc.is_alive() else p.pid

    watch = Watch(alive_child, int(min_available_gb * GB))
    parent0 = pss(os.getpid())
    out = {"shape": shape, "label": label, "impl": _impl(), "vocab": V, "hidden": H,
           "tied": tied, "embed_head_bytes": embed_head, "page_bytes": PAGE}

    t0 = time.perf_counter()
    cfg = service_config(shape, "bfloat16")
    # Minutes at 7B on a loaded box: building the drafter's 7B-sized layer in the child.
    proc = DrafterProcess(str(target), cfg, capture=True, start_timeout_s=1800)
    proc_ref[0] = proc
    out["start_s"] = time.perf_counter() - t0
    out["after_start"] = {"parent_pss": pss(os.getpid()) - parent0, "child_pss": pss(proc.pid),
                          "child_uss": uss(proc.pid)}

    def in_place() -> int:
        return int(getattr(proc, "target_bytes_copied", 0))

    def sync(version: int) -> tuple[Moved, int]:
        """One weight sync as the adapter does it; returns bytes moved and the peak PSS."""
        watch.reset()
        pid = proc.pid
        f0, c0, ip0 = minflt(os.getpid()) + minflt(pid), counter.total, in_place()
        t = time.perf_counter()
        # adapter._tap: a fresh host copy of each tensor as it passes (made here, one value per
        # weight version, so that the rollout's own weights need not be held as well; values do
        # not change what is copied, and filling is what a copy costs, where random draws take
        # minutes at 7B).
        e = torch.full((V, H), 0.01 * version, dtype=torch.bfloat16)
        h = e if tied else torch.full((V, H), -0.01 * version, dtype=torch.bfloat16)
        proc.set_target_tensors(e, h)          # returns once the child has them
        del e, h
        moved = Moved(counter.total - c0, (minflt(os.getpid()) + minflt(pid) - f0) * PAGE, in_place() - ip0,
                      time.perf_counter() - t)
        return moved, watch.peak

    syncs = {}
    for name, version in (("first", 1), ("new_weights", 2), ("same_weights", 2)):
        moved, peak = sync(version)
        syncs[name] = {**asdict(moved), "total_bytes": moved.total, "peak_pss_added": peak - parent0,
                       "parent_pss_added": pss(os.getpid()) - parent0, "child_pss": pss(proc.pid),
                       "child_uss": uss(proc.pid)}
        print(f"{shape} {label} sync {name}: moved {moved.total / GB:.2f} GB (pipe {moved.pipe_bytes / GB:.2f}, "
              f"faulted {moved.faulted_bytes / GB:.2f}, in place {moved.in_place_bytes / GB:.2f}) "
              f"in {moved.seconds:.1f}s; peak added {(peak - parent0) / GB:.2f} GB", flush=True)
    if hasattr(proc, "target_update"):
        # The same sync had the adapter written each tensor straight into the segment as the
        # weight stream passes it (DrafterProcess.target_update) instead of tapping a host copy
        # first: the stream's tensors are the rollout's, made outside the measured window.
        e = torch.full((V, H), 0.03, dtype=torch.bfloat16)
        h = e if tied else torch.full((V, H), -0.03, dtype=torch.bfloat16)
        watch.reset()
        f0, c0, ip0 = minflt(os.getpid()) + minflt(proc.pid), counter.total, in_place()
        t = time.perf_counter()
        with proc.target_update() as write:
            write("embed", e)
            write("lm_head", h)
        moved = Moved(counter.total - c0, (minflt(os.getpid()) + minflt(proc.pid) - f0) * PAGE, in_place() - ip0,
                      time.perf_counter() - t)
        del e, h
        syncs["streamed"] = {**asdict(moved), "total_bytes": moved.total, "peak_pss_added": watch.peak - parent0}
        print(f"{shape} {label} sync streamed: moved {moved.total / GB:.2f} GB in {moved.seconds:.1f}s", flush=True)
    out["syncs"] = syncs
    steady = pss(os.getpid()) + pss(proc.pid) - parent0
    out["steady_pss_added_with_child"] = steady

    # A restart: the new child must map the latest target tensors again.
    if restart:
        old_pid = proc.pid
        c0 = counter.total
        os.kill(old_pid, signal.SIGKILL)
        t = time.perf_counter()
        while True:
            try:
                proc.state_version             # waits for the restart (the new child maps the segment)
                break
            except Exception:
                time.sleep(0.2)
        out["restart"] = {"seconds": time.perf_counter() - t, "pipe_bytes": counter.total - c0,
                          "new_pid": proc.pid != old_pid, "child_pss": pss(proc.pid)}
    proc.close()
    proc_ref[0] = None
    del proc

    # A rank whose drafter never trains: its child alone, the baseline of "a child".
    t = time.perf_counter()
    idle = DrafterProcess(str(target), cfg, capture=False, start_timeout_s=1800)
    proc_ref[0] = idle
    out["non_training_child"] = {"pss": pss(idle.pid), "uss": uss(idle.pid),
                                 "start_s": time.perf_counter() - t}
    idle.close()
    proc_ref[0] = None
    watch.stop()

    out["capture_step"] = capture_step(H)
    out["peak_pss_added_with_child"] = max(v["peak_pss_added"] for v in syncs.values())
    return out


def capture_step(H: int) -> dict:
    """One step's capture: a micro-batch (16 samples x 1,024 tokens, bf16 final states: 117 MB at
    H=3,584) through ``verl_capture`` into a 64 MiB staging buffer; bytes written to host memory."""
    from tlt_verl.capture import verl_capture
    from tlt_verl.capture.staging import StagingBuffer

    n, L, prompt = 16, 1024, 256

    class Decoder(torch.nn.Module):
        """Shaped like a Qwen2 decoder for the hooks; its output stands for the final states."""

        def __init__(self):
            super().__init__()
            self.embed_tokens, self.norm, self.layers = torch.nn.Identity(), torch.nn.Identity(), torch.nn.ModuleList()

        def forward(self, x):
            return (x,)                        # as a decoder returns (last_hidden_state, ...)

    decoder = Decoder()
    ids = torch.randint(0, 1000, (n, L))
    mb = _micro_batch(ids, prompt)
    sink = StagingBuffer(64 << 20)
    verl_capture.enable("eagle", (), None, sink=sink)
    # fp32, as an fp32 forward hands them over: the capture's cast to the buffer's bf16 is a real copy
    # here, as the device-to-host copy is on a GPU.
    states = torch.randn(n, L, H)
    with verl_capture.capture_pass(object(), decoder) as cp:
        decoder(states)
        f0 = minflt(os.getpid())
        t = time.perf_counter()
        cp.collect(mb, packed=False)
        seconds = time.perf_counter() - t
        faulted = (minflt(os.getpid()) - f0) * PAGE
    out = {"micro_batch_state_bytes_bf16": states.numel() * 2, "staged_bytes": sink.nbytes,
           "faulted_bytes": faulted, "seconds": seconds, "staged_samples": len(sink), "dropped": sink.dropped}
    verl_capture.disable()
    return out


def _micro_batch(ids: torch.Tensor, prompt: int):
    """verl 0.9.1's no-padding micro-batch: nested input_ids, prompts and response masks."""
    from tensordict import TensorDict

    def nested(rows):
        return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)

    n = ids.shape[0]
    return TensorDict({"input_ids": nested(ids), "prompts": nested(ids[:, :prompt]),
                       "responses": nested(ids[:, prompt:]),
                       "response_mask": nested(torch.ones_like(ids[:, prompt:], dtype=torch.bool))},
                      batch_size=[n])


# ---------------------------------------------------------------------- combine

def _per_embed_head(run: dict, child_base: int) -> dict:
    """A run's numbers as multiples of its embedding + LM head size (bf16)."""
    t = run["embed_head_bytes"]
    sync, same = run["syncs"]["new_weights"], run["syncs"]["same_weights"]
    return {"bytes_per_sync": sync["total_bytes"] / t, "pipe_bytes_per_sync": sync["pipe_bytes"] / t,
            "bytes_per_unchanged_sync": same["total_bytes"] / t,
            "host_ram_added": (run["steady_pss_added_with_child"] - child_base) / t,
            "peak_host_ram_added": (run["peak_pss_added_with_child"] - child_base) / t}


def combine(runs: list[Path], out: Path) -> dict:
    """Ratios per shape. Host RAM added: parent + child PSS over the parent before the drafter
    started plus the PSS of a child that holds no target tensors (the "after" run's non-training
    child: the "before" code's non-training child holds fp32 tensors, the very thing measured).
    A shape without a "before" run (7B: the old path's peak, about 7.5x the embedding + LM head,
    does not fit this box beside the others' work) gets it from another shape's "before" run,
    scaled by the embedding + LM head size, and says so."""
    by, capture_only = {}, {}
    for p in runs:
        r = json.loads(p.read_text())
        if r.get("capture_only"):
            capture_only[(r["shape"], r["label"])] = r["capture_step"]
        else:
            by.setdefault(r["shape"], {})[r["label"]] = r
    measured_before = {s: rs["before"] for s, rs in by.items() if "before" in rs}
    result = {}
    for shape, rs in sorted(by.items()):
        after = rs["after"]
        t = after["embed_head_bytes"]
        base = after["non_training_child"]["pss"]
        a = _per_embed_head(after, base)
        if "before" in rs:
            before_from, b = shape, _per_embed_head(rs["before"], base)
        else:
            before_from = sorted(measured_before)[0]
            b = _per_embed_head(measured_before[before_from], by[before_from]["after"]["non_training_child"]["pss"])
        cap_b = rs["before"]["capture_step"] if "before" in rs else capture_only.get((shape, "before"))
        entry = {
            "embed_head_bytes": t,
            "before_measured_at": before_from,
            "bytes_per_sync_before": b["bytes_per_sync"] * t, "bytes_per_sync_after": a["bytes_per_sync"] * t,
            "bytes_per_sync_before_over_after": b["bytes_per_sync"] / a["bytes_per_sync"],
            # Had the adapter (tlt_verl/rollout/engine/adapter.py) written into the segment as the
            # stream passes instead of tapping a host copy first: one copy per sync, not two.
            "bytes_per_sync_streamed": after["syncs"].get("streamed", {}).get("total_bytes"),
            "bytes_per_sync_before_over_streamed": (b["bytes_per_sync"] * t / after["syncs"]["streamed"]["total_bytes"]
                                                    if "streamed" in after["syncs"] else None),
            "pipe_bytes_per_sync_before": b["pipe_bytes_per_sync"] * t,
            "pipe_bytes_per_sync_after": a["pipe_bytes_per_sync"] * t,
            "bytes_per_unchanged_sync_before": b["bytes_per_unchanged_sync"] * t,
            "bytes_per_unchanged_sync_after": a["bytes_per_unchanged_sync"] * t,
            "host_ram_added_before_over_embed_head": b["host_ram_added"],
            "host_ram_added_over_embed_head": a["host_ram_added"],
            "peak_host_ram_added_before_over_embed_head": b["peak_host_ram_added"],
            "peak_host_ram_added_over_embed_head": a["peak_host_ram_added"],
            "capture_step_bytes_before": None if cap_b is None else cap_b["faulted_bytes"],
            "capture_step_bytes_after": after["capture_step"]["faulted_bytes"],
            "capture_micro_batch_state_bytes_bf16": after["capture_step"]["micro_batch_state_bytes_bf16"],
            "non_training_child_pss_before": rs["before"]["non_training_child"]["pss"] if "before" in rs else None,
            "non_training_child_pss_after": base,
            "runs": rs,
        }
        result[shape] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--label", choices=("before", "after"), default="after")
    ap.add_argument("--out", type=Path, help="this run's JSON")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tlt-drafter-footprint")
    ap.add_argument("--min-available-gb", type=float, default=1.5)
    ap.add_argument("--no-restart", action="store_true", help="skip the SIGKILL-and-restart step")
    ap.add_argument("--combine", type=Path, nargs="*", help="run JSONs to combine into --out")
    ap.add_argument("--capture-only", action="store_true",
                    help="only the per-step capture (cheap at any shape: a 'before' where the whole run does not fit)")
    args = ap.parse_args(argv)
    if args.combine:
        print(json.dumps(combine(args.combine, args.out), indent=1)[:4000])
        return 0
    torch.set_num_threads(1)
    if args.capture_only:
        res = {"shape": args.shape, "label": args.label, "capture_only": True,
               "capture_step": capture_step(SHAPES[args.shape]["hidden_size"])}
    else:
        res = run(args.shape, args.label, args.min_available_gb, args.work, restart=not args.no_restart)
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
