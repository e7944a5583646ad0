"""Gantt chart of a plan: ranks on y, rounds one after another along time (seconds) on x."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from hdp.packing.cost import CostModel
from hdp.packing.plan import Plan
from hdp.packing.simulate import rank_loads
from hdp.trainer.cli.output import atomic_output

__all__ = ["plot_gantt", "FORMATS"]

FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")
"""Suffixes a chart may be written as (matplotlib's formats; a name without a suffix gets ``.png``)."""

logger = logging.getLogger(__name__)

_DETAIL_RANKS = 64
"""Above this many ranks the chart drops per-sample labels and edges."""


def plot_gantt(plan: Plan, cost: CostModel, path: str | os.PathLike, title: str | None = None,
               flag: str = "path") -> str:
    """Draw ``plan`` under ``cost`` as a Gantt chart at exactly ``path`` (PNG, or the format its suffix
    names), written atomically (`hdp.trainer.cli.output`; ``flag`` names the path in errors); return it.

    Each round is as wide as its slowest rank plus beta (hatched); each group is a box over its
    ranks holding its samples as sub-boxes with widths proportional to their cost, coloured by the
    group size k; idle rank time stays light grey; round boundaries are vertical lines.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch, Rectangle

    unit = cost.unit_time_s
    loads = rank_loads(plan, cost) * unit  # [R, N] seconds
    beta = cost.round_cost * unit
    round_max = loads.max(axis=1) if plan.num_rounds else np.zeros(0)
    starts = np.concatenate([[0.0], np.cumsum(round_max + beta)])  # [R + 1]
    total = float(starts[-1])
    n_ranks = plan.num_ranks
    detail = n_ranks <= _DETAIL_RANKS

    sizes = sorted({int(k) for k in np.unique(plan.group_size)})
    cmap = plt.get_cmap("viridis" if len(sizes) > 10 else "tab10")
    colour = {k: cmap(i / max(1, len(sizes) - 1) if len(sizes) > 10 else i % 10) for i, k in enumerate(sizes)}

    height = min(14.0, max(3.0, 0.28 * n_ranks + 1.5)) if detail else 12.0
    fig, ax = plt.subplots(figsize=(14, height))
    idle_boxes, beta_boxes, sample_boxes, sample_colours, group_boxes = [], [], [], [], []
    labels: list[tuple[float, float, str]] = []
    label_min = 0.04 * total

    for r, rnd in enumerate(plan.rounds):
        x0, width = float(starts[r]), float(round_max[r])
        idle_boxes.append(Rectangle((x0, -0.5), width, n_ranks))  # busy boxes are drawn on top
        if beta > 0:
            beta_boxes.append(Rectangle((x0 + width, -0.5), beta, n_ranks))
        for g in rnd.groups:
            g_time = float(loads[r, g.start])
            group_boxes.append(Rectangle((x0, g.start - 0.45), g_time, g.size - 0.1))
            share = cost.sample_cost(np.asarray(g.lengths), g.size)  # per-sample cost, units
            share = share / share.sum() * g_time if share.sum() > 0 else np.zeros_like(share)
            x = x0
            for length, wdt in zip(g.lengths, share):
                sample_boxes.append(Rectangle((x, g.start - 0.45), float(wdt), g.size - 0.1))
                sample_colours.append(colour[g.size])
                if detail and wdt >= label_min:
                    labels.append((x + wdt / 2, g.start + (g.size - 1) / 2, f"{length / 1024:.1f}K"))
                x += float(wdt)

    ax.add_collection(PatchCollection(idle_boxes, facecolor="#eeeeee", edgecolor="none", zorder=0))
    if beta_boxes:
        ax.add_collection(PatchCollection(
            beta_boxes, facecolor="#bbbbbb", edgecolor="none", hatch="//" if detail else None, zorder=1,
        ))
    ax.add_collection(PatchCollection(
        sample_boxes, facecolor=sample_colours,
        edgecolor="white" if detail else "none", linewidth=0.4 if detail else 0.0, zorder=2,
    ))
    if detail:
        ax.add_collection(PatchCollection(
            group_boxes, facecolor="none", edgecolor="black", linewidth=0.8, zorder=3,
        ))
        for x, y, text in labels:
            ax.text(x, y, text, ha="center", va="center", fontsize=7, color="white", zorder=4)
    for x in starts:
        ax.axvline(float(x), color="black", linewidth=0.8 if detail else 0.5, zorder=5)

    ax.set_xlim(0.0, total if total > 0 else 1.0)
    ax.set_ylim(n_ranks - 0.5, -0.5)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("rank")
    if detail:
        ax.set_yticks(range(n_ranks))
        ax.tick_params(axis="y", labelsize=7 if n_ranks > 16 else 9)
    handles: list[Any] = [Patch(facecolor=colour[k], label=f"CP{k}") for k in sizes]
    handles.append(Patch(facecolor="#eeeeee", edgecolor="#999999", label="idle"))
    if beta > 0:
        handles.append(Patch(facecolor="#bbbbbb", label="round cost β"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="group size")
    if title is None:
        title = f"policy {plan.policy}: N={n_ranks}, {plan.num_samples} samples, {plan.num_rounds} rounds"
        if plan.stats is not None:
            title += f", T={plan.stats.step_time_s:.3g} s, efficiency {plan.stats.efficiency:.1%}"
        else:
            title += f", T={total:.3g} s"
    ax.set_title(title)
    fig.tight_layout()
    fmt = Path(path).suffix[1:].lower() or "png"
    try:
        with atomic_output(path, flag) as tmp:
            fig.savefig(tmp, dpi=110, format=fmt)
    finally:
        plt.close(fig)
    logger.info("wrote Gantt chart %s", path)
    return os.fspath(path)
