"""The report's figures, drawn with matplotlib's object API on the Agg canvas (no pyplot, no display).

Each function takes a table of `tables` and returns a Figure; long tables are cut to the
top rows and the title says so. Text from the DB is escaped (`plain`): a `$` in a description
is a dollar sign, not TeX.
"""

from __future__ import annotations

import io
from typing import Callable

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from codesign.report import fmt

MAX_BARS = 12  # plans shown per cluster
MAX_PANELS = 6  # clusters shown in one figure
MAX_ROWS = 24  # bars in one-panel figures
WIDTH = 11.0
DPI = 100
STYLE = {"font.size": 8, "axes.titlesize": 9, "axes.grid": True,
         "grid.alpha": 0.3, "axes.axisbelow": True}
STATUS_COLORS = {"failed": "#d62728", "timeout": "#ff7f0e", "oom": "#9467bd", "invalid": "#7f7f7f",
                 "interrupted": "#bcbd22"}


def png(figure: Figure) -> bytes:
    with matplotlib.rc_context(STYLE):
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def throughput(ranked: pd.DataFrame, what: str) -> Figure:
    """One panel per cluster: its top plans by throughput (`score`), a colour per model."""
    by_size = ranked.assign(devices=ranked["num_nodes"] * ranked["gpus_per_node"])
    clusters = list(dict.fromkeys(by_size.sort_values(["devices", "cluster"], kind="stable")["cluster"]))
    clusters = clusters[:MAX_PANELS]
    tops = [ranked[ranked["cluster"].eq(c)].head(MAX_BARS) for c in clusters]
    colors = _colors(ranked["model"])
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(WIDTH, 1.0 + sum(0.28 * len(t) + 0.6 for t in tops)), layout="constrained")
        axes = figure.subplots(len(tops), 1, squeeze=False,
                               gridspec_kw={"height_ratios": [len(t) + 1.5 for t in tops]})[:, 0]
        for ax, cluster, top in zip(axes, clusters, tops):
            total = int(ranked["cluster"].eq(cluster).sum())
            _bars(ax, top["plan"], top["score"], [colors[m] for m in top["model"]])
            ax.set_title(f"{plain(cluster)}: " + (f"top {len(top)} of {total} plans" if total > len(top)
                                           else f"{total} plan(s)"), loc="left")
        axes[-1].set_xlabel(f"{what} (samples/s)")
        _model_legend(figure, colors)
        if len(set(ranked["cluster"])) > len(clusters):
            figure.suptitle(f"first {len(clusters)} of {len(set(ranked['cluster']))} clusters", x=0.01,
                            ha="left")
    return figure


def speedups(table: pd.DataFrame) -> Figure:
    """Best plan over the data-parallel plan, per model, cluster and global batch."""
    shown = table.sort_values("speedup", ascending=False).head(MAX_ROWS)
    labels = [f"{m} | {c} | batch {b:.0f}" for m, c, b in zip(shown["model"], shown["cluster"], shown["global_batch"])]
    with matplotlib.rc_context(STYLE):
        figure = _one_panel(len(shown))
        ax = figure.axes[0]
        _bars(ax, labels, shown["speedup"], ["#1f77b4"] * len(shown), fmt.ratio)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xlabel("speedup of the best plan over data parallel (x)")
        _cut_title(ax, "model | cluster | global batch", len(shown), len(table))
    return figure


def predictions(errors: pd.DataFrame) -> Figure:
    """Predicted against measured, one panel per quantity, with y = x and the error figures."""
    quantities = list(dict.fromkeys(errors["quantity"]))
    units = {"time": ("s", 1.0), "memory": ("MiB", 2.0 ** 20)}
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(WIDTH / 2 * len(quantities), 4.8), layout="constrained")
        for ax, quantity in zip(figure.subplots(1, len(quantities), squeeze=False)[0], quantities):
            rows = errors[errors["quantity"].eq(quantity)]
            unit, scale = units[quantity]
            measured, predicted = rows["measured"] / scale, rows["predicted"] / scale
            ax.scatter(measured, predicted, s=12, alpha=0.7)
            low, high = _span(measured, predicted)
            ax.plot([low, high], [low, high], color="black", lw=1, label="y = x")
            scale = _scale(low, high)
            ax.set(xscale=scale, yscale=scale, xlim=(low, high), ylim=(low, high), aspect="equal",
                   xlabel=f"measured {quantity} ({unit})", ylabel=f"predicted {quantity} ({unit})")
            error = rows["error"].abs()
            ax.set_title(f"{quantity}: {len(rows)} attempts, |error| median {100 * error.median():.1f}%, "
                         f"p90 {100 * error.quantile(0.9):.1f}%", loc="left")
            ax.legend(loc="upper left")
    return figure


def prediction_order(times: pd.DataFrame) -> Figure:
    """|time error| of each measured attempt in the order they ran, a colour per platform: the median
    of each third as a bar across it, a dashed line where a new calibration first priced an attempt."""
    cycle = matplotlib.colormaps["tab10"].colors
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(WIDTH, 4.2), layout="constrained")
        ax = figure.subplots()
        for color, (platform, rows) in zip(cycle, times.groupby("platform", sort=True)):
            ax.scatter(rows["order"] + 1, 100 * rows["abs_error"], s=12, alpha=0.6, color=color,
                       label=f"{plain(str(platform))}: {len(rows)} attempts")
            for _, part in rows.groupby("third"):
                ax.hlines(100 * part["abs_error"].median(), part["order"].min() + 0.5, part["order"].max() + 1.5,
                          color=color, lw=2.5)
            changes = rows[rows["calibration"].ne(rows["calibration"].shift())].iloc[1:]
            for order, version in zip(changes["order"], changes["calibration"]):
                ax.axvline(order + 0.5, color=color, ls="--", lw=0.8)
                ax.annotate(f"calibration {plain(version)}", (order + 0.6, 0.98), xycoords=("data", "axes fraction"),
                            rotation=90, va="top", fontsize=7)
        ax.set(xlabel="attempt, in the order they ran", ylabel="|time error| (%)", ylim=(0, None))
        ax.set_title("|predicted - measured| / measured time per step; bars: the median of each third", loc="left")
        ax.legend(loc="upper right", fontsize=7)
    return figure


def energy_frontier(points: pd.DataFrame) -> Figure:
    """Per (model, cluster, setup): every plan's predicted time and energy per iteration (grey), the
    predicted frontier as a line, and the measured points, each joined to its own prediction."""
    groups = list(points.groupby(["model", "cluster", "global_batch", "precision"], dropna=False, sort=False))
    shown = groups[:MAX_PANELS]
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(WIDTH, 3.4 * len(shown)), layout="constrained")
        for ax, ((model, cluster, batch, _), group) in zip(figure.subplots(len(shown), 1, squeeze=False)[:, 0], shown):
            priced = group[group["predicted_time"].notna() & group["predicted_energy"].notna()]
            on = priced[priced["frontier"]].sort_values("predicted_time")
            ran = group[group["median"].notna() & group["energy_per_iter"].notna()]
            ax.scatter(priced["predicted_time"] * 1e3, priced["predicted_energy"], s=12, color="#b8c0cc",
                       label="predicted")
            ax.plot(on["predicted_time"] * 1e3, on["predicted_energy"], color="#d62728", marker="o", ms=4, lw=1,
                    label="predicted frontier")
            joined = ran[ran["predicted_time"].notna() & ran["predicted_energy"].notna()]
            for row in joined.itertuples():
                ax.plot([row.predicted_time * 1e3, row.median * 1e3], [row.predicted_energy, row.energy_per_iter],
                        color="#5a6578", lw=0.7)
            ax.scatter(ran["median"] * 1e3, ran["energy_per_iter"], marker="x", s=28, color="black", label="measured")
            times = pd.concat([priced["predicted_time"], ran["median"]]) * 1e3
            energies = pd.concat([priced["predicted_energy"], ran["energy_per_iter"]])
            ax.set(xscale=_scale(*_span(times)), yscale=_scale(*_span(energies)),
                   xlabel="time per iteration (ms)", ylabel="energy per iteration (J)")
            ax.set_title(f"{plain(model)} | {plain(cluster)}, batch {batch:.0f}: {len(priced)} plans predicted, "
                         f"{len(on)} on the frontier, {len(ran)} measured", loc="left")
            ax.legend(loc="best", fontsize=7)
        if len(groups) > len(shown):
            figure.suptitle(f"first {len(shown)} of {len(groups)} groups", x=0.01, ha="left")
    return figure


def energy(table: pd.DataFrame) -> Figure:
    """Joules per sample, cheapest plans first."""
    shown = table.head(MAX_ROWS)
    labels = [f"{c} | {p}" for c, p in zip(shown["cluster"], shown["plan"])]
    colors = _colors(table["model"])
    with matplotlib.rc_context(STYLE):
        figure = _one_panel(len(shown))
        ax = figure.axes[0]
        _bars(ax, labels, shown["energy_per_sample"], [colors[m] for m in shown["model"]])
        ax.set_xlabel("energy per sample (J)")
        _cut_title(ax, "cluster | plan, cheapest first", len(shown), len(table))
        _model_legend(figure, colors)
    return figure


def compile_vs_step(points: pd.DataFrame) -> Figure:
    """Compile time against step time, a colour per cluster: how many steps a compile is worth."""
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(WIDTH, 4.5), layout="constrained")
        ax = figure.subplots()
        for cluster, rows in points.groupby("cluster", sort=True):
            ax.scatter(rows["avg"] * 1e3, rows["compile_time"], s=14, alpha=0.75, label=plain(cluster))
        ax.set(xscale=_scale(*_span(points["avg"])), yscale=_scale(*_span(points["compile_time"])),
               xlabel="step time (ms)", ylabel="compile time (s)")
        ax.set_title(f"{len(points)} succeeded attempts", loc="left")
        ax.legend(loc="best", fontsize=7)
    return figure


def failures(counts: pd.DataFrame) -> Figure:
    """Failed attempts per cluster, stacked by status."""
    with matplotlib.rc_context(STYLE):
        figure = _one_panel(len(counts))
        ax = figure.axes[0]
        left = np.zeros(len(counts))
        for status in counts.columns:
            ax.barh(range(len(counts)), counts[status], left=left, label=status, color=STATUS_COLORS[status])
            left += counts[status].to_numpy()
        ax.set_yticks(range(len(counts)), [plain(c) for c in counts.index])
        ax.invert_yaxis()
        ax.set_xlabel("failed attempts")
        figure.legend(loc="outside right upper")
    return figure


def auto_vs_manual(table: pd.DataFrame) -> Figure:
    """Auto search's measured throughput next to the best manual plan's, per group."""
    shown = table.head(MAX_ROWS)
    labels = [f"{m} | {c} | batch {b:.0f}" for m, c, b in zip(shown["model"], shown["cluster"], shown["global_batch"])]
    y = np.arange(len(shown))
    with matplotlib.rc_context(STYLE):
        figure = _one_panel(2 * len(shown))
        ax = figure.axes[0]
        ax.barh(y - 0.2, shown["score_auto"], height=0.4, label="Auto search", color="#2ca02c")
        ax.barh(y + 0.2, shown["score_manual"].fillna(0), height=0.4, label="best manual plan", color="#1f77b4")
        ax.set_yticks(y, [plain(label) for label in labels])
        ax.invert_yaxis()
        ax.set_xlabel("throughput (samples/s)")
        figure.legend(loc="outside right upper")
        _cut_title(ax, "model | cluster | global batch", len(shown), len(table))
    return figure


def _one_panel(rows: int) -> Figure:
    figure = Figure(figsize=(WIDTH, 1.2 + 0.28 * max(rows, 1)), layout="constrained")
    figure.subplots()
    return figure


def _bars(ax: Axes, labels: pd.Series | list, values: pd.Series, colors: list,
          text: Callable[[float], str] = fmt.number) -> None:
    y = np.arange(len(values))
    ax.barh(y, values, color=colors)
    ax.set_yticks(y, [plain(str(label)) for label in labels])
    ax.invert_yaxis()
    for yi, value in zip(y, values):
        ax.annotate(text(value), (value, yi), xytext=(3, 0), textcoords="offset points", va="center",
                    fontsize=7)


def _cut_title(ax: Axes, title: str, shown: int, total: int) -> None:
    ax.set_title(title + (f" (first {shown} of {total})" if total > shown else ""), loc="left")


def _colors(models: pd.Series) -> dict[str, tuple]:
    cycle = matplotlib.colormaps["tab10"].colors
    return {m: cycle[i % len(cycle)] for i, m in enumerate(sorted(set(models)))}


def _model_legend(figure: Figure, colors: dict[str, tuple]) -> None:
    if len(colors) > 1:
        handles = [Patch(color=c, label=plain(m)) for m, c in list(colors.items())[:10]]
        figure.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, title="model")


def _span(*series: pd.Series) -> tuple[float, float]:
    values = pd.concat(series)
    values = values[values > 0]
    return float(values.min()) / 1.2, float(values.max()) * 1.2


def _scale(low: float, high: float) -> str:
    """Logarithmic when the values span more than a decade (log ticks over less read badly)."""
    return "log" if high > 10 * low else "linear"


def plain(label: str, limit: int = 80) -> str:
    """A label from the DB as literal text: `$` escaped (matplotlib reads $...$ as TeX), cut to limit."""
    short = label if len(label) <= limit else label[:limit - 3] + "..."
    return short.replace("$", r"\$")



def codesign_frontier(ranking: pd.DataFrame) -> Figure:
    """Per cluster: every candidate's parameters against its predicted samples/s (grey), the
    Pareto frontier coloured by predicted memory per device."""
    keys = list(dict.fromkeys(zip(ranking["cluster"], ranking["micro_batches"])))[:MAX_PANELS]
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(WIDTH, 3.2 * len(keys)), layout="constrained")
        for ax, (cluster, micro) in zip(figure.subplots(len(keys), 1, squeeze=False)[:, 0], keys):
            rows = ranking[ranking["cluster"].eq(cluster) & ranking["micro_batches"].eq(micro)]
            fit = rows[rows["predicted_samples_per_s"].notna()]
            on = fit[fit["pareto"].eq(1)].sort_values("params")
            ax.scatter(fit["params"] / 1e6, fit["predicted_samples_per_s"], s=2, color="#b8c0cc", rasterized=True)
            ax.plot(on["params"] / 1e6, on["predicted_samples_per_s"], color="#d62728", lw=1)
            dots = ax.scatter(on["params"] / 1e6, on["predicted_samples_per_s"], s=22, zorder=3,
                              c=on["predicted_memory_gib"], cmap="viridis")
            figure.colorbar(dots, ax=ax, label="predicted GiB per device")
            ax.set(xlabel="parameters (millions)", ylabel="predicted samples/s")
            ax.set_title(f"{plain(cluster)}, {micro} micro-batches: {len(fit):,} candidates that fit, "
                         f"{len(on)} on the frontier", loc="left")
    return figure


def codesign_measured(ranking: pd.DataFrame) -> Figure:
    """Predicted against measured samples/s of the candidates `--run-top` ran, a colour per cluster."""
    ran = ranking[ranking["measured_samples_per_s"].notna()]
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(WIDTH / 2, 4.8), layout="constrained")
        ax = figure.subplots()
        for cluster, rows in ran.groupby("cluster", sort=True):
            ax.scatter(rows["measured_samples_per_s"], rows["predicted_samples_per_s"], s=16, label=plain(cluster))
        low, high = _span(ran["measured_samples_per_s"], ran["predicted_samples_per_s"])
        ax.plot([low, high], [low, high], color="black", lw=1, label="y = x")
        ax.set(xlabel="measured samples/s", ylabel="predicted samples/s", xlim=(low, high), ylim=(low, high))
        ax.legend(loc="upper left", fontsize=7)
    return figure


def codesign_energy(ranking: pd.DataFrame, frontier: pd.DataFrame) -> Figure:
    """Per cluster: every candidate's predicted samples per joule against samples/s (grey), and the
    candidates no other beats on both as a line."""
    clusters = list(dict.fromkeys(frontier["cluster"]))[:MAX_PANELS]
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(WIDTH, 3.2 * len(clusters)), layout="constrained")
        for ax, cluster in zip(figure.subplots(len(clusters), 1, squeeze=False)[:, 0], clusters):
            rows = ranking[ranking["cluster"].eq(cluster)]
            on = frontier[frontier["cluster"].eq(cluster)]
            ax.scatter(rows["samples_per_joule"], rows["predicted_samples_per_s"], s=2, color="#b8c0cc",
                       rasterized=True)
            ax.plot(on["samples_per_joule"], on["predicted_samples_per_s"], color="#d62728", marker="o", ms=4, lw=1)
            ax.set(xlabel="predicted samples per joule", ylabel="predicted samples/s")
            ax.set_title(f"{plain(cluster)}: {int(rows['samples_per_joule'].notna().sum()):,} candidates priced, "
                         f"{len(on)} on the time-energy frontier", loc="left")
    return figure
