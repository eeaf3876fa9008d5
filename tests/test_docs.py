"""The docs stay true: docs/config.md matches the config dataclasses, and every command the README
shows runs as written in a fresh copy of the repository (the cheap ones run; the expensive ones run
their `--help`, or stop at the one-line error a fresh clone gives, which proves their arguments
parsed). A few seconds in all: no Ray, no engine, no model."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_config_doc", REPO / "scripts" / "gen_config_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- docs/config.md


def test_config_doc_matches_the_dataclasses():
    assert (REPO / "docs" / "config.md").read_text() == _gen().render(), (
        "docs/config.md is out of date: run .venv/bin/python scripts/gen_config_doc.py")


def test_config_doc_lists_every_option_of_recipes_tlt_yaml():
    import yaml

    def leaves(d, prefix="tlt"):
        for k, v in d.items():
            yield from leaves(v, f"{prefix}.{k}") if isinstance(v, dict) else [f"{prefix}.{k}"]

    doc = (REPO / "docs" / "config.md").read_text()
    block = yaml.safe_load((REPO / "recipes" / "tlt.yaml").read_text())["tlt"]
    missing = [name for name in leaves(block) if f"| `{name}` |" not in doc]
    assert not missing


def _with_new_spot_field():
    from tlt_verl.integration.config import SpotSection, TLTConfig

    @dataclasses.dataclass(frozen=True)
    class SpotWithNewKnob(SpotSection):
        # A knob added without running the generator.
        new_knob: int = 7

    return dataclasses.replace(TLTConfig(), spot=SpotWithNewKnob())


def test_config_doc_sees_a_field_added_to_a_dataclass():
    """What the first test guards against, shown once on a copy of the config."""
    gen = _gen()
    text = gen.render(_with_new_spot_field())
    assert "| `tlt.spot.new_knob` | `int` | `7` | A knob added without running the generator. |" in text
    assert text != (REPO / "docs" / "config.md").read_text()


def test_config_doc_refuses_an_option_without_a_meaning():
    from tlt_verl.integration.config import SpotSection, TLTConfig

    @dataclasses.dataclass(frozen=True)
    class SpotWithSilentKnob(SpotSection):
        silent_knob: int = 7

    with pytest.raises(SystemExit, match="tlt.spot.silent_knob has no meaning"):
        _gen().render(dataclasses.replace(TLTConfig(), spot=SpotWithSilentKnob()))


# ---------------------------------------------------------------- README commands


def _readme_commands(text: str) -> list[str]:
    """Each command line of the README's ```bash blocks (continuation lines joined, comments cut),
    then each command quoted inline in its prose (`./tlt ...`, `bash ...`), once each."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(re.sub(r"\s+", " ", line))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    out += re.findall(r"`((?:\./tlt|bash) [^`]+)`", prose)
    return list(dict.fromkeys(out))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The repository's files as a fresh clone of this tree has them (tracked and new, not ignored:
    no .cache/, runs/ or build output), with this session's environment as its .venv."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    dest = tmp_path_factory.mktemp("clone")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    venv = Path(sys.prefix)
    # ./tlt rebuilds an environment whose stamp does not match the requirements: never in a test.
    stamp = venv / ".tlt-env-stamp"
    want = hashlib.sha256(b"".join((dest / f).read_bytes() for f in
                                   ("requirements/cpu.txt", "pyproject.toml", "setup.py", "scripts/fix_env.py")))
    if not stamp.is_file() or stamp.read_text().strip() != want.hexdigest()[:16]:
        pytest.skip(f"{venv} is not the environment ./tlt would reuse (its stamp differs)")
    (dest / ".venv").symlink_to(venv)
    return dest


def _sh(clone: Path, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "TLT_VENV": str(clone / ".venv"), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _ok(clone: Path, command: str) -> str:
    p = _sh(clone, command)
    assert p.returncode == 0, f"{command}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return p.stdout + p.stderr


def _flags_in_help(clone: Path, command: str) -> None:
    """An expensive command: its subcommand's --help must succeed and know every flag it is given."""
    words = shlex.split(command)
    sub = [w for w in words[1:] if not w.startswith("-")][:2 if words[1] == "drafter" else 1]
    text = _ok(clone, " ".join([words[0], *sub, "--help"]))
    for flag in (w.split("=")[0] for w in words if w.startswith("--")):
        assert flag in text, f"{command}: {flag} is not in `{' '.join([words[0], *sub])} --help`"


def _tlt_overrides_parse(command: str) -> None:
    """Every +tlt.* override the command gives builds a valid TLTConfig (a drafter folder that a
    fresh clone has not built yet stands in as scratch)."""
    from omegaconf import OmegaConf

    from tlt_verl.integration.config import TLTConfig

    overrides = [w[1:] for w in shlex.split(command) if w.startswith("+tlt.")]
    assert overrides, command
    block = OmegaConf.to_container(OmegaConf.from_dotlist(overrides))["tlt"]
    if block.get("drafter", {}).get("init") not in (None, "scratch") and not (REPO / block["drafter"]["init"]).is_dir():
        block["drafter"]["init"] = "scratch"
    assert TLTConfig.from_dict(block).enable


def _in(path: Path, text: str) -> None:
    assert text in path.read_text(), f"{path}: no {text}"


def _no_export_yet(clone: Path, command: str) -> None:
    """`./tlt serve RUN ...` in a fresh clone: the one-line error of a run not made yet, after
    argparse accepted every argument (it would exit 2 with usage first)."""
    p = _sh(clone, command)
    assert p.returncode == 1 and p.stderr.strip() == "tlt-verl: serve: runs/mine: no such folder", p.stderr


def _export_path(clone: Path, command: str) -> None:
    """The folder the README sends the reader to is where the default run's export lands."""
    recipe = (clone / "recipes" / "tiny_cpu_grpo.sh").read_text()
    assert "trainer.project_name=tlt " in recipe and "trainer.experiment_name=tiny_cpu_grpo " in recipe
    runner = (clone / "tlt_verl" / "launch" / "runner.py").read_text()
    assert "{run_dir}/checkpoints/${{trainer.project_name}}/${{trainer.experiment_name}}" in runner
    # <default_local_dir>/tlt/export/step_N, read from the code (importing the trainer imports verl: slow)
    trainer = (clone / "tlt_verl" / "integration" / "tlt_trainer.py").read_text()
    assert 'os.path.join(config.trainer.default_local_dir, "tlt")' in trainer
    assert "os.path.join(tlt_work_dir(self.config), EXPORT_DIR)" in trainer
    export = (clone / "tlt_verl" / "serve" / "export.py").read_text()
    assert 'EXPORT_DIR = "export"' in export and 'STEP_PREFIX = "step_"' in export
    assert re.search(r'"--steps", type=int, default=14\b', (clone / "tlt_verl" / "cli.py").read_text())
    assert command == "cd runs/mine/checkpoints/tlt/tiny_cpu_grpo/tlt/export/step_14"


def _plain_vllm_serve(clone: Path, command: str) -> None:
    # `vllm serve --help` imports vLLM (20-45 s on two busy cores): read its argument instead.
    assert (clone / ".venv" / "bin" / "vllm").exists()
    vllm = Path(importlib.util.find_spec("vllm").origin).parent  # finds it without importing it
    assert '"--speculative-config"' in (vllm / "engine" / "arg_utils.py").read_text()
    serve = (clone / "tlt_verl" / "serve")
    assert any("vllm_speculative_config.json" in f.read_text() for f in serve.glob("*.py")), (
        "the README serves vllm_speculative_config.json, which no export writes")


# Each README command and how it is checked; a command not listed here fails the test, so a new one
# gets a check when it is added.
CHECKS = {
    "./tlt run": lambda c, cmd: _ok(c, "./tlt run --help"),
    "./tlt run --compare": _flags_in_help,
    "./tlt test": lambda c, cmd: _ok(c, "./tlt test --help"),
    "python -m verl.trainer.main_ppo <your overrides> +tlt.enable=true +tlt.drafter.init=DRAFTER_DIR":
        lambda c, cmd: _tlt_overrides_parse(cmd),
    "source .venv/bin/activate": lambda c, cmd: _ok(c, "source .venv/bin/activate && python -c 'import tlt_verl'"),
    "MODEL=.cache/tlt/assets/sft_model TRAIN=.cache/tlt/assets/data/train.parquet "
    "VAL=.cache/tlt/assets/data/val.parquet bash recipes/tiny_cpu_grpo.sh +tlt.enable=true "
    "+tlt.drafter.init=.cache/tlt/assets/warm_drafter":
        lambda c, cmd: (_ok(c, "bash -n recipes/tiny_cpu_grpo.sh"), _tlt_overrides_parse(cmd)),
    "./tlt drafter warmup --target MODEL_DIR --prompts train.parquet --out drafters/mine --kind eagle3 "
    "--parallel-drafting --budget-s 600": _flags_in_help,
    "./tlt prepare --model smollm2-135m": lambda c, cmd: (_flags_in_help(c, cmd),
                                                          _in(c / "tlt_verl" / "task" / "models.py", '"smollm2-135m"')),
    "./tlt run --run-dir runs/mine": _flags_in_help,
    "./tlt serve runs/mine": lambda c, cmd: _no_export_yet(c, cmd + " --dry-run"),
    "./tlt serve runs/mine --dry-run": _no_export_yet,
    "./tlt serve runs/mine --no-drafter --port 8001": lambda c, cmd: _no_export_yet(c, cmd + " --dry-run"),
    "./tlt export CKPT_DIR/global_step_N": _flags_in_help,
    "cd runs/mine/checkpoints/tlt/tiny_cpu_grpo/tlt/export/step_14": _export_path,
    'vllm serve policy --speculative-config "$(cat vllm_speculative_config.json)"': _plain_vllm_serve,
    "./tlt serve": lambda c, cmd: _ok(c, "./tlt serve --help"),
    "./tlt bench-e2e": lambda c, cmd: _ok(c, "./tlt bench-e2e --help"),
    "bash bench/gpu_check.sh": lambda c, cmd: _ok(c, "bash bench/gpu_check.sh --help"),
    # Not run as written: it would run this module inside itself.
    "./tlt test tests/test_docs.py": lambda c, cmd: _ok(c, "./tlt test --collect-only -q tests/test_docs.py"),
    # Its output is test_config_doc_matches_the_dataclasses's business; a second import of torch
    # here would double this module's time on a busy box.
    ".venv/bin/python scripts/gen_config_doc.py": lambda c, cmd: _ok(c, cmd + " --help"),
}


def test_every_readme_command_has_a_check():
    commands = _readme_commands((REPO / "README.md").read_text())
    assert commands
    assert [c for c in commands if c not in CHECKS] == []
    assert [c for c in CHECKS if c not in commands] == [], "checks for commands the README no longer shows"


@pytest.mark.parametrize("command", _readme_commands((REPO / "README.md").read_text()))
def test_readme_command_runs_in_a_fresh_clone(clone, command):
    if command not in CHECKS:
        pytest.fail(f"README command without a check in tests/test_docs.py: {command}")
    CHECKS[command](clone, command)


def test_readme_is_a_guide():
    """At most 12 KiB, and its links point at files that exist."""
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= 12288
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (REPO / target).exists(), target
