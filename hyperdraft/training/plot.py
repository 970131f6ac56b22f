"""train-draft's log (train_log.jsonl: a JSON row a training window, held-out score and epoch), and the log drawn:
training.png (loss and per-position agreement, training windows and held-out points).

Each window is one or a few batches, so a long run's raw curve is noise as wide as the trend (a 141k-sample run:
loss 4.5-8 from batch to batch); the curves are drawn as running means over 1% of the windows, the raw windows
faintly behind them."""

from __future__ import annotations

import json
import os

LOG = "train_log.jsonl"


def start_log(out_dir: str, first_epoch: int, per_epoch: int) -> None:
    """The log as the run starts: empty for a new run (an earlier run's rows into the same --out joined its curves);
    for a resumed one, the rows of the epochs its checkpoint holds (a run stopped mid-epoch, or between publishing
    an epoch and checkpointing it, had logged rows that the resumed run logs again)."""
    path = os.path.join(out_dir, LOG)
    rows = []
    if first_epoch > 0 and os.path.exists(path):
        with open(path) as f:
            rows = [r for r in map(json.loads, filter(str.strip, f))
                    if (r["step"] <= first_epoch * per_epoch if r.get("kind") == "window"
                        else r.get("epoch", 0) <= first_epoch)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def append_log(out_dir: str, row: dict) -> None:
    with open(os.path.join(out_dir, LOG), "a") as f:
        f.write(json.dumps(row) + "\n")


def plot_log(out_dir: str) -> str | None:
    """training.png (loss, and accuracy per unrolled step, against samples seen; the held-out points, when there are
    any, as circles) from train_log.jsonl; None without matplotlib (the log stays; `hyperdraft train-draft --plot
    DIR` draws it on a machine that has it)."""
    with open(os.path.join(out_dir, LOG)) as f:
        rows = list(map(json.loads, filter(str.strip, f)))
    held = [r for r in rows if r.get("kind") == "validation" and "step" in r]
    rows = [r for r in rows if r.get("kind") == "window"]
    if not rows:
        raise ValueError(f"{os.path.join(out_dir, LOG)} holds no training windows to draw")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import EngFormatter
    except ImportError:
        print("train-draft: matplotlib is not installed; train_log.jsonl holds the curves")
        return None
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in rows]
    width = max(1, len(rows) // 100)
    losses = [r["loss"] for r in rows]
    raw, = ax_loss.plot(steps, losses, alpha=0.2)
    ax_loss.plot(steps, running_mean(losses, width), color=raw.get_color(), label=f"mean of {width} windows")
    if held:
        ax_loss.plot([r["step"] for r in held], [r["loss"] for r in held], marker="o", ls="--", label="held out")
    ax_loss.legend()
    ax_loss.set(xlabel="samples seen", ylabel="loss", title="training loss")
    for s in range(len(rows[0]["accuracy_by_step"])):
        accuracy = [r["accuracy_by_step"][s] for r in rows]
        line, = ax_acc.plot(steps, accuracy, alpha=0.2)
        ax_acc.plot(steps, running_mean(accuracy, width), color=line.get_color(), label=f"draft {s + 1}")
        if held:
            ax_acc.plot([r["step"] for r in held], [r["accuracy_by_step"][s] for r in held], marker="o", ls="--",
                        color=line.get_color())
    ax_acc.set(xlabel="samples seen", ylabel="accuracy", title="argmax agreement per draft position (o: held out)",
               ylim=(0, 1))
    ax_acc.legend()
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_formatter(EngFormatter())  # 140k, not 140000 run into its neighbours
    path = os.path.join(out_dir, "training.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def running_mean(values: list[float], width: int) -> list[float]:
    """Each value's mean with the width - 1 before it (fewer at the start)."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return [(sums[i + 1] - sums[max(0, i + 1 - width)]) / min(i + 1, width) for i in range(len(values))]
