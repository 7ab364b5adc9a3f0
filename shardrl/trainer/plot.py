"""`shardrl plot RUN_DIR`: the curve of a run (from its metrics.jsonl) as a PNG: the reward of a `shardrl train` run,
the loss of a `shardrl sft`, `dpo` or `rm` run (which has no reward)."""

from __future__ import annotations

from pathlib import Path

from shardrl.metrics import read_metrics

OFFLINE_LOSSES = ("sft/loss", "dpo/loss", "rm/loss")
"""The step's loss each offline trainer logs (`trainer.offline`: `<name>/loss`); its validation loss is val/loss."""


def choose_curves(records: list[dict], metrics_path: Path) -> tuple[str, list[tuple[str, str, str]]]:
    """What to draw for `records`: the y label and (metric, style, label) per line; the reward when the run logs one,
    else the trainer's loss. A ValueError naming `metrics_path` when there is neither."""
    if any(r.get("reward/mean") is not None or r.get("val/reward_mean") is not None for r in records):
        return "reward", [("reward/mean", "-", "train reward (mean)"),
                          ("val/reward_mean", "o-", "validation reward (greedy)")]
    for key in OFFLINE_LOSSES:
        if any(r.get(key) is not None for r in records):
            return "loss", [(key, "-", f"train loss ({key})"), ("val/loss", "o-", "validation loss")]
    raise ValueError(f"{metrics_path} holds no reward (reward/mean) and no loss ({', '.join(OFFLINE_LOSSES)}) to "
                     "plot; is it a shardrl run folder?")


def plot_rewards(metrics_path: Path, out_path: Path, records: list[dict] | None = None) -> Path:
    """The reward curve of `records` (default: read from `metrics_path`, whose folder names the plot); the loss
    curve for a run without rewards (`choose_curves`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path) if records is None else records
    if not records:
        raise ValueError(f"{metrics_path} holds no metrics yet")
    ylabel, curves = choose_curves(records, metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style, label in curves:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def plot_main(args) -> int:
    run_dir = Path(args.run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl; is it a shardrl run folder?")
    records = read_metrics(metrics)
    if not records:
        raise ValueError(f"{metrics} holds no metrics yet")
    out = Path(args.out) if args.out else run_dir / f"{choose_curves(records, metrics)[0]}_curve.png"
    print(plot_rewards(metrics, out, records))
    return 0
