"""`shardrl plot RUN_DIR`: the reward curve of a run (from its metrics.jsonl) as a PNG."""

from __future__ import annotations

from pathlib import Path

from shardrl.metrics import read_metrics


def plot_rewards(metrics_path: Path, out_path: Path, records: list[dict] | None = None) -> Path:
    """The reward curve of `records` (default: read from `metrics_path`, whose folder names the plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path) if records is None else records
    if not records:
        raise ValueError(f"{metrics_path} holds no metrics yet")
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["reward/mean"]) for r in records if r.get("reward/mean") is not None]
    if train:
        ax.plot(*zip(*train), label="train reward (mean)")
    val = [(r["step"], r["val/reward_mean"]) for r in records if r.get("val/reward_mean") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="validation reward (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
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
    out = Path(args.out) if args.out else run_dir / "reward_curve.png"
    print(plot_rewards(metrics, out))
    return 0
