"""The long tail as a picture: each replica's rollout (generating / drained / training the drafter)
per step, next to acceptance length and SD share over steps. Written by `./tlt run` with TLT on.
"""
from __future__ import annotations

import json
from pathlib import Path

COLORS = {"generating": "tab:blue", "drained": "lightgrey", "training": "tab:green"}


def load_spot_timeline(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_spot(entries: list[dict], steps: list[dict], png: Path, max_steps: int = 8) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = entries[-max_steps:]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    labels = []
    for row, (entry, replica, spans) in enumerate((e, r, sp) for e in shown for r, sp in sorted(e["replicas"].items())):
        for t0, t1, state in spans:
            if state in COLORS:
                ax0.barh(row, t1 - t0, left=t0, color=COLORS[state], height=0.8)
        labels.append(f"step {entry['step']} r{replica}")
    ax0.set_yticks(range(len(labels)), labels, fontsize=8)
    ax0.invert_yaxis()
    ax0.set_xlabel("seconds into the rollout")
    ax0.set_title("replicas in the long tail")
    ax0.legend(handles=[Patch(color=c, label=s) for s, c in COLORS.items()], loc="lower right", fontsize=8)

    xs = [s["step"] for s in steps if s.get("tlt")]
    if xs:
        ax1.plot(xs, [s["tlt"]["acceptance_length"] for s in steps if s.get("tlt")], marker="o", label="acceptance length")
        ax1.set_ylabel("tokens per draft round")
        twin = ax1.twinx()
        twin.plot(xs, [s["tlt"]["sd_share"] for s in steps if s.get("tlt")], marker="s", color="tab:orange",
                  label="SD share of decode steps")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("SD share")
        ax1.legend(loc="upper left", fontsize=8)
        twin.legend(loc="lower right", fontsize=8)
    ax1.set_xlabel("RL step")
    ax1.set_title("speculative decoding over steps")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
