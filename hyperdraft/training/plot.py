"""train-draft's log, drawn: training.png from train_log.jsonl (loss and per-position agreement, training windows
and held-out points)."""

from __future__ import annotations

import json
import os

LOG = "train_log.jsonl"


def plot_log(out_dir: str) -> str | None:
    """training.png (loss, and accuracy per unrolled step, against samples seen; the held-out points, when there are
    any, as circles) from train_log.jsonl; None without matplotlib (the log stays; `hyperdraft train-draft --plot
    DIR` draws it on a machine that has it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train-draft: matplotlib is not installed; train_log.jsonl holds the curves")
        return None
    with open(os.path.join(out_dir, LOG)) as f:
        rows = list(map(json.loads, filter(str.strip, f)))
    held = [r for r in rows if r.get("kind") == "validation" and "step" in r]
    rows = [r for r in rows if r.get("kind") == "window"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in rows]
    ax_loss.plot(steps, [r["loss"] for r in rows], marker=".")
    if held:
        ax_loss.plot([r["step"] for r in held], [r["loss"] for r in held], marker="o", ls="--", label="held out")
        ax_loss.legend()
    ax_loss.set(xlabel="samples seen", ylabel="loss", title="training loss")
    for s in range(len(rows[0]["accuracy_by_step"])):
        line, = ax_acc.plot(steps, [r["accuracy_by_step"][s] for r in rows], marker=".", label=f"draft {s + 1}")
        if held:
            ax_acc.plot([r["step"] for r in held], [r["accuracy_by_step"][s] for r in held], marker="o", ls="--",
                        color=line.get_color())
    ax_acc.set(xlabel="samples seen", ylabel="accuracy", title="argmax agreement per draft position (o: held out)",
               ylim=(0, 1))
    ax_acc.legend()
    path = os.path.join(out_dir, "training.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
