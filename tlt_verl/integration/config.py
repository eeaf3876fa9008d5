"""The `tlt:` block of a verl config: one switch and its typed, validated settings.

    python -m verl.trainer.main_ppo <stock overrides> +tlt.enable=true +tlt.drafter.init=scratch

Mirrors recipes/tlt.yaml (every option with its default; tests/test_bad_input.py keeps them equal). Checked in the driver at start-up (tlt_verl/integration/startup_checks.py);
every error is one line naming the option.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from tlt_verl.capture.buffer import BufferConfig
from tlt_verl.drafter.trainer import TrainerConfig
from tlt_verl.rollout.policy.bandit import BanditConfig
from tlt_verl.rollout.policy.sd_policy import SDPolicyConfig
from tlt_verl.serve.export import ExportConfig

# Rollout backends whose server runs the drafter, the SD policy and the drafter push.
SUPPORTED_ROLLOUTS = ("tlt_vllm", "vllm")
# verl trainer modes TLT extends (its hooks are the synchronous colocated trainer's).
SUPPORTED_TRAINER_MODES = ("sync",)
SCRATCH = "scratch"
AUTO = "auto"


class TLTConfigError(ValueError):
    pass


def _build(cls, value: Any, option: str):
    """A dataclass from a mapping, unknown keys refused by name."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TLTConfigError(f"{option}: expected a mapping, got {value!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise TLTConfigError(f"{option}: unknown option(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**dict(value))
    except (TypeError, ValueError) as e:
        raise TLTConfigError(f"{option}: {e}") from None


@dataclass(frozen=True)
class DrafterSection:
    # eagle (EAGLE-1) or eagle3; None: the kind of the init folder (eagle for scratch).
    kind: Optional[str] = None
    # Where the first drafter comes from: an exported EAGLE folder (warm start), or "scratch"
    # (random, trained during RL). Required: a silent random default would look like TLT failing.
    init: Optional[str] = None
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(lr=1e-3, warmup_steps=10, total_steps=2000))
    buffer: BufferConfig = field(default_factory=lambda: BufferConfig(budget_bytes=256 << 20))


@dataclass(frozen=True)
class SpotSection:
    # Train the drafter on drained replicas during the rollout: true, false (the drafter stays as
    # tlt.drafter.init gave it; SD still runs, nothing is captured), or auto: true where the rollout
    # replicas run on GPUs, false on CPU. A drained replica's GPU is idle; on CPU its core is not:
    # the replica still decoding, verl's agent loop and reward share the cores and memory system,
    # and training there made the rollout 1.3-1.45x slower (bench/results/tlt_e2e{,_s27}.json, arm tlt_adaptive).
    train_drafter: Union[bool, str] = "auto"
    # Train the drafter in the long tail every N RL steps (1: every step).
    train_every_steps: int = 1
    # ... or whenever the mean acceptance length of the last rollout fell below this (0: off).
    retrain_below_acceptance: float = 0.0
    # A replica counts as drained once it has had no request in flight for this long.
    drain_grace_s: float = 0.05
    # How often the coordinator looks at the replicas' request counts while the rollout trains
    # (a drained rank should join at once), and while it does not (then only the timeline needs
    # them: each look is a Ray call to every replica's server, whose event loop also streams the
    # rollout's tokens, so 50 looks a second would be work stock verl does not do).
    poll_interval_s: float = 0.02
    observe_interval_s: float = 0.25
    # Bound on waiting for a preempted training session to stop.
    preempt_timeout_s: float = 10.0

    def __post_init__(self):
        if self.train_drafter not in (True, False, AUTO):
            raise ValueError(f"train_drafter={self.train_drafter!r}: must be true, false or {AUTO}")
        if self.train_every_steps < 1:
            raise ValueError(f"train_every_steps={self.train_every_steps}: must be >= 1")
        for name in ("drain_grace_s", "retrain_below_acceptance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        for name in ("poll_interval_s", "observe_interval_s", "preempt_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")


def trains_drafter(setting: Union[bool, str], device: str) -> bool:
    """tlt.spot.train_drafter for a rank whose rollout replica runs on ``device`` (verl's device
    name: "cuda", "npu", "cpu")."""
    return device != "cpu" if setting == AUTO else bool(setting)


def _resolve_kind(d: DrafterSection) -> DrafterSection:
    """The drafter kind: as given, else the init folder's; the buffer stores what that kind reads."""
    found = None
    if d.init not in (None, SCRATCH) and (Path(d.init) / "config.json").is_file():
        from tlt_verl.drafter.export import folder_kind

        try:
            found = folder_kind(d.init)
        except ValueError as e:
            raise TLTConfigError(f"tlt.drafter.init={d.init}: {e}") from None
    kind = d.kind or found or "eagle"
    if found is not None and kind != found:
        raise TLTConfigError(f"tlt.drafter.kind={kind}: tlt.drafter.init={d.init} is an {found} drafter "
                             "(leave kind unset to take the folder's)")
    return replace(d, kind=kind, buffer=replace(d.buffer, kind=kind))


@dataclass(frozen=True)
class TLTConfig:
    enable: bool = False
    drafter: DrafterSection = field(default_factory=DrafterSection)
    sd: SDPolicyConfig = field(default_factory=SDPolicyConfig)
    spot: SpotSection = field(default_factory=SpotSection)
    export: ExportConfig = field(default_factory=ExportConfig)

    @classmethod
    def from_dict(cls, block: Optional[Mapping[str, Any]]) -> "TLTConfig":
        block = dict(block or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(block) - known)
        if unknown:
            raise TLTConfigError(f"tlt: unknown option(s) {unknown}; known: {sorted(known)}")
        drafter = dict(block.get("drafter") or {})
        for name, sub in (("trainer", TrainerConfig), ("buffer", BufferConfig)):
            if name in drafter:
                base = asdict(getattr(DrafterSection(), name))
                merged = {**base, **dict(drafter[name] or {})}
                if name == "trainer" and isinstance(merged.get("loss"), Mapping):
                    from tlt_verl.drafter.config import LossConfig
                    merged["loss"] = _build(LossConfig, merged["loss"], "tlt.drafter.trainer.loss")
                drafter[name] = _build(sub, merged, f"tlt.drafter.{name}")
        sd = dict(block.get("sd") or {})
        if "bandit" in sd:
            sd["bandit"] = _build(BanditConfig, sd["bandit"], "tlt.sd.bandit")
        section = _build(DrafterSection, drafter, "tlt.drafter")
        enable = bool(block.get("enable", False))
        cfg = cls(enable=enable,
                  drafter=_resolve_kind(section) if enable else section,
                  sd=_build(SDPolicyConfig, sd, "tlt.sd"),
                  spot=_build(SpotSection, block.get("spot"), "tlt.spot"),
                  export=_build(ExportConfig, block.get("export"), "tlt.export"))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not self.enable:
            return
        d = self.drafter
        if d.kind not in ("eagle", "eagle3"):
            raise TLTConfigError(f"tlt.drafter.kind={d.kind!r}: one of eagle, eagle3")
        if d.init is None:
            raise TLTConfigError("tlt.drafter.init: not set; give an exported EAGLE drafter folder to warm start "
                                 f"from, or tlt.drafter.init={SCRATCH} to train one from a random start")
        if d.init != SCRATCH:
            folder = Path(d.init)
            if not (folder / "config.json").is_file():
                raise TLTConfigError(f"tlt.drafter.init={d.init}: no config.json there (an exported EAGLE "
                                     f"drafter folder, or {SCRATCH})")
