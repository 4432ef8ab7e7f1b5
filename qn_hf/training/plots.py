"""PNG figures from a run's records: the loss curve and a pipeline timeline (Gantt chart).

matplotlib is imported inside each function with the file-only Agg backend, so a training job
never needs a display and the library does not import it unless a figure is drawn.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from ..checkpoint.atomic import write_bytes_atomic


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    """``fig`` as a PNG at ``path``, replaced by rename: never written through a link planted there."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    _pyplot().close(fig)
    write_bytes_atomic(path, buffer.getvalue())


def loss_curve(path: str, *, runs: Sequence[tuple[str, list[dict]]], title: str) -> None:
    """Training loss per step (and validation loss/accuracy where recorded) for one or more runs."""
    _save(loss_figure(runs=runs, title=title), path)


def loss_figure(*, runs: Sequence[tuple[str, list[dict]]], title: str):
    """The figure ``loss_curve`` saves (a matplotlib Figure; the caller closes it)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    has_acc = any("val_accuracy" in r for _, records in runs for r in records)
    fig, axes = plt.subplots(1, 2 if has_acc else 1, figsize=(11 if has_acc else 7, 4), squeeze=False)
    ax = axes[0][0]
    for i, (label, records) in enumerate(runs):
        style = "-" if i == 0 else "--"
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], style, lw=1.2, label=f"{label} train")
        evals = [r for r in records if "val_loss" in r]
        if evals:
            ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o" + style, ms=3, label=f"{label} validation")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, even on short runs
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if has_acc:
        acc = axes[0][1]
        for i, (label, records) in enumerate(runs):
            evals = [r for r in records if "val_accuracy" in r]
            acc.plot([r["step"] for r in evals], [100 * r["val_accuracy"] for r in evals], "o" + ("-" if i == 0 else "--"),
                     ms=3, label=label)
        acc.set(xlabel="step", ylabel="validation accuracy (%)", title="accuracy")
        acc.xaxis.set_major_locator(MaxNLocator(integer=True))
        acc.grid(alpha=0.3)
        acc.legend(fontsize=8)
    fig.tight_layout()
    return fig


def pipeline_timeline(path: str, *, ranks: Sequence[tuple[str, list[tuple[str, int, int, float, float]]]],
                      title: str) -> None:
    """One row per rank; a bar per forward, backward and deferred weight-gradient action labelled
    with its microbatch (``chunk:mb`` when the rank runs several chunks). Events are (op, chunk, mb,
    start, stop); times are seconds since the step started on that rank (after a barrier), so idle
    gaps are the bubble."""
    plt = _pyplot()
    colors = {"fwd": "#4C72B0", "bwd": "#DD8452", "wgt": "#55A868"}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(ranks) + 1.2))
    longest = max((e[4] for _, evs in ranks for e in evs), default=0.0)
    for row, (_, events) in enumerate(ranks):
        several = len({chunk for _, chunk, _, _, _ in events}) > 1
        for op, chunk, mb, start, stop in events:
            if op not in colors:
                continue
            ax.barh(row, (stop - start) * 1e3, left=start * 1e3, color=colors[op], edgecolor="white", height=0.8)
            if stop - start > 0.02 * longest:
                label = f"{chunk}:{mb}" if several else str(mb)
                ax.text((start + stop) / 2 * 1e3, row, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)), [label for label, _ in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms since the step started", title=title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=["forward", "backward", "weight gradient"],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    _save(fig, path)
