"""`shardrl plot RUN_DIR`: the curve of a run (from its metrics.jsonl) as a PNG: the reward of a `shardrl train` run,
the loss of a `shardrl sft`, `dpo` or `rm` run (which has no reward). `shardrl plot DIR` on a folder of runs (run
folders one or two levels down: `outputs/demo`, or `outputs` with its experiments) overlays them all, one colour and
one legend entry a run, on one chart per kind (reward, loss)."""

from __future__ import annotations

import sys
from pathlib import Path

from shardrl.metrics import read_metrics

OFFLINE_LOSSES = ("sft/loss", "dpo/loss", "kto/loss", "rm/loss")
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


def find_runs(folder: Path) -> list[Path]:
    """The run folders (holding a metrics.jsonl) just under `folder`, else two levels down (`outputs/<experiment>/
    <timestamp>`), sorted by path (a timestamp's order)."""
    runs = sorted(folder.glob("*/metrics.jsonl")) or sorted(folder.glob("*/*/metrics.jsonl"))
    return [m.parent for m in runs]


def plot_runs(folder: Path, runs: list[Path], out_path: Path | None) -> Path:
    """The runs of `folder` overlaid: one chart per kind of curve their metrics hold (reward, loss), a colour a run
    (its train curve a line, its validation points joined by a dashed line), a legend naming each run by its path
    under `folder`. A run with nothing to plot is skipped with a note; none left is a ValueError."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_kind: dict[str, list[tuple[str, list[dict], list[tuple[str, str, str]]]]] = {}
    for run in runs:
        metrics = run / "metrics.jsonl"
        records = read_metrics(metrics)
        try:
            if not records:
                raise ValueError(f"{metrics} holds no metrics yet")
            kind, curves = choose_curves(records, metrics)
        except ValueError as e:
            print(f"skipped {run}: {e}", file=sys.stderr)
            continue
        by_kind.setdefault(kind, []).append((str(run.relative_to(folder)), records, curves))
    if not by_kind:
        raise ValueError(f"no run under {folder} has a reward or a loss to plot")
    kinds = sorted(by_kind, key=("reward", "loss").index)
    fig, axes = plt.subplots(1, len(kinds), figsize=(8 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for i, (name, records, curves) in enumerate(by_kind[kind]):
            color = f"C{i % 10}"
            for (key, style, _), line in zip(curves, ("-", "o--")):
                points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
                if points:
                    label = name if line == "-" else f"{name} (validation)"
                    ax.plot(*zip(*points), line, color=color, label=label, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(kind)
        ax.set_title(f"{folder.name}: {len(by_kind[kind])} run(s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    out_path = out_path or folder / f"{'_'.join(kinds)}_curves.png"
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def image_path(out: str | None, name: str) -> Path | None:
    """Where `--out` puts the image: a folder gets `name` inside it, a name without an extension a .png (as
    matplotlib would write it: the path printed is the file written); None: the default."""
    if not out:
        return None
    path = Path(out)
    if path.is_dir():
        return path / name
    return path if path.suffix else path.with_name(path.name + ".png")


def plot_main(args) -> int:
    run_dir = Path(args.run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() and run_dir.is_dir() and (runs := find_runs(run_dir)):
        print(plot_runs(run_dir, runs, image_path(args.out, "curves.png")))
        return 0
    if not metrics.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl, and no run folder under it holds one; is it a shardrl "
                         "run folder, or a folder of runs?")
    records = read_metrics(metrics)
    if not records:
        raise ValueError(f"{metrics} holds no metrics yet")
    name = f"{choose_curves(records, metrics)[0]}_curve.png"
    out = image_path(args.out, name) or run_dir / name
    print(plot_rewards(metrics, out, records))
    return 0
