#!/usr/bin/env python
"""Writes docs/config.md, the reference of every `tlt.*` option, from the config dataclasses.

    .venv/bin/python scripts/gen_config_doc.py           # rewrite docs/config.md
    .venv/bin/python scripts/gen_config_doc.py --check   # exit 1 if docs/config.md is out of date

The dataclasses are the truth (tlt_verl/integration/config.py's TLTConfig and the ones it nests),
so the types and defaults come from them, never from a hand-kept list. A meaning comes from
MEANINGS below, else from the option's comment in recipes/tlt.yaml (the user-facing one), else
from the comment on the field in its dataclass; an option with none of the three is an error, so a
new field cannot reach the reference undocumented. tests/test_docs.py runs --check's comparison.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "config.md"
YAML = REPO / "recipes" / "tlt.yaml"

# Options whose dataclass field and YAML line carry no comment, or one that leans on the line
# above it ("... and while it does not"), which a table row cannot. These win over the comments.
# For a new option prefer a comment on the field: it travels with the code.
MEANINGS = {
    "tlt.enable": "The switch: true runs verl's trainer in TLT's mode (drafter, adaptive SD, Spot Trainer); "
                  "false changes nothing",
    "tlt.drafter.trainer.beta1": "AdamW beta1",
    "tlt.drafter.trainer.beta2": "AdamW beta2",
    "tlt.drafter.trainer.weight_decay": "AdamW weight decay",
    "tlt.drafter.trainer.warmup_steps": "linear learning-rate warm-up, in drafter steps",
    "tlt.drafter.trainer.lr": "peak learning rate of the drafter's AdamW",
    "tlt.drafter.trainer.grad_accum": "micro-batches per optimizer step",
    "tlt.drafter.trainer.max_age_steps": "samples older than this many RL steps are not drawn (null: no limit)",
    "tlt.drafter.trainer.seed": "seed of the drafter's batch sampling",
    "tlt.drafter.trainer.loss.hidden_weight": "weight of the SmoothL1 loss on the next hidden state (EAGLE-1/2)",
    "tlt.drafter.trainer.loss.prob_weight": "weight of the soft cross-entropy against the target's next-token "
                                            "distribution",
    "tlt.drafter.trainer.loss.eagle3_steps": "unrolled draft steps in EAGLE-3's training loss",
    "tlt.drafter.trainer.loss.step_decay": "EAGLE-3: weight of unrolled step i is step_decay**i",
    "tlt.drafter.trainer.loss.token_chunk": "tokens per tile of the chunked soft-CE kernel (memory, not result)",
    "tlt.drafter.trainer.loss.vocab_chunk": "vocabulary entries per tile of the chunked soft-CE kernel",
    "tlt.sd.steps_per_pull": "engine steps one bandit pull lasts (its arm's k held for them)",
    "tlt.sd.bandit.epsilon": "a bucket's first exploration probability",
    "tlt.sd.bandit.min_epsilon": "floor of a bucket's exploration probability",
    "tlt.sd.bandit.seed": "seed of the bandit's exploration draws",
    "tlt.spot.train_every_steps": "train the drafter in the long tail every N RL steps (1: every step)",
    "tlt.spot.retrain_below_acceptance": "also train whenever the last rollout's mean acceptance length fell "
                                         "below this (0: off)",
    "tlt.spot.observe_interval_s": "how often the coordinator looks at the replicas while the drafter does not "
                                   "train (then only the rollout timeline needs them)",
    "tlt.export.enable": "at each checkpoint save (`trainer.save_freq`), export that step for serving to "
                         "`<default_local_dir>/tlt/export/step_N`",
    "tlt.export.at_end": "after the last step, save verl's checkpoint (when `save_freq` did not) and export it",
    "tlt.drafter.buffer.spill_dir": "folder for samples evicted from memory (null: they are dropped)",
    "tlt.drafter.buffer.spill_budget_bytes": "disk budget of `spill_dir`, oldest files deleted past it "
                                             "(null: no limit)",
}


def _plain(value: Any) -> str:
    """A default as a Hydra override or recipes/tlt.yaml writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    return str(value)


def _type(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    # One spelling for "or None", and none with a pipe, which would split a Markdown table cell.
    text = re.sub(r"^(.*) \| None$", r"Optional[\1]", text)
    return text.replace(" | ", " or ")


def yaml_comments(path: Path = YAML) -> dict[str, str]:
    """{'tlt.sd.threshold': 'its trailing comment', ...} from recipes/tlt.yaml."""
    out, stack = {}, []  # stack: (indent, key)
    for line in path.read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z_][\w]*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        if "#" in rest:
            out[".".join(k for _, k in stack)] = rest.split("#", 1)[1].strip()
    return out


def field_comments(cls: type) -> dict[str, str]:
    """The comment above each field of a dataclass (joined) and its trailing one."""
    out, pending = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("def ") or stripped.startswith("@"):
            break
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"^\s+(\w+)\s*:[^=]*(=.*)?$", line)
        if m and not stripped.startswith(("return", "raise")):
            trailing = line.split("#", 1)[1].strip() if "#" in line else ""
            out[m.group(1)] = " ".join(pending + ([trailing] if trailing else []))
        pending = []
    return out


def options(config: Any, prefix: str = "tlt") -> Iterator[tuple[str, type, list[tuple[str, str, str, str]]]]:
    """(section, its dataclass, [(option, type, default, meaning), ...]) for each dataclass, depth first."""
    comments = yaml_comments()
    source = {}
    for cls in reversed(type(config).__mro__):  # a subclass's inherited fields are commented in its base
        if dataclasses.is_dataclass(cls):
            source.update(field_comments(cls))
    rows, nested = [], []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        name = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            nested.append((name, value))
            continue
        meaning = MEANINGS.get(name) or comments.get(name) or source.get(f.name)
        if not meaning:
            raise SystemExit(f"gen_config_doc: {name} has no meaning: comment its field in "
                             f"{inspect.getsourcefile(type(config))} or its line in recipes/tlt.yaml")
        rows.append((name, _type(f.type), _plain(value), meaning))
    yield prefix, type(config), rows
    for name, value in nested:
        yield from options(value, name)


HEADER = """# `tlt.*` options

<!-- Generated by scripts/gen_config_doc.py from the config dataclasses; do not edit by hand.
     tests/test_docs.py fails when this file and the dataclasses differ. -->

Every option of the `tlt:` block of a verl config, with its type and default. On a stock verl
command line give only what differs, as Hydra overrides with a leading `+` (the block is not in
verl's own schema):

```bash
python -m verl.trainer.main_ppo <your overrides> +tlt.enable=true +tlt.drafter.init=DRAFTER_DIR +tlt.sd.threshold=32
```

`recipes/tlt.yaml` is the same block as YAML, every option at its default. Start-up checks the
block (`tlt_verl/integration/config.py`) and refuses an unknown option or a bad value in one line
that names it. Types are the dataclass annotations; `null` is YAML's None.
"""


def render(config: Any = None) -> str:
    if config is None:
        from tlt_verl.integration.config import TLTConfig

        config = TLTConfig()
    parts = [HEADER]
    for section, cls, rows in options(config):
        if not rows:
            continue
        where = Path(inspect.getsourcefile(cls)).resolve().relative_to(REPO)
        parts.append(f"\n## `{section}`\n")
        parts.append(f"`{cls.__name__}` in `{where}`.\n")
        parts.append("| option | type | default | meaning |\n|---|---|---|---|")
        for name, typ, default, meaning in rows:
            meaning = meaning.replace("|", "\\|")
            parts.append(f"| `{name}` | `{typ}` | `{default}` | {meaning} |")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC.relative_to(REPO)} is out of date: run .venv/bin/python scripts/gen_config_doc.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
