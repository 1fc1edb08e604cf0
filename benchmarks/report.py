"""What a run prints and draws from its rows: a line per row as it is timed, a markdown table at
the end, and a plot of GB/s against context length (PNG, when matplotlib imports). Pure functions
of the rows (dicts, as in the JSON); nothing here needs a GPU.

A row: {"case", "batch", "mean_kv_len", "uniform", "family", "bytes", "floor_us", "impls":
{name: entry}, "best_peer_us", "best_peer_graph_us"}; an entry: {"us", "graph_us", ...} or
{"error"} (a graph that failed adds "graph_error").
"""

from __future__ import annotations

import math

from benchmarks.cases import BASE_FAMILY, gb_per_s
from benchmarks.peers import PEERS


def best_of(impls: dict, key: str) -> float | None:
    """The fastest peer's time under key ("us" or "graph_us"), None when no peer has one."""
    times = [impls[n][key] for n in PEERS if key in impls.get(n, {})]
    return min(times) if times else None


def ratio(peer_us, us) -> str:
    """Speed against the peer (above 1: faster), as '1.05x'."""
    return f"{peer_us / us:.2f}x" if peer_us and us else "n/a"


def time_pair(entry: dict | None, sep: str = "/", width: int = 40) -> str:
    """'eager/graph' µs of an entry, ERR(...) for a failed half, '-' for a missing one."""
    if not entry:
        return "-"
    if "error" in entry:
        return f"ERR({entry['error'][:width]})"
    if "graph_us" in entry:
        graph = f"{entry['graph_us']:.1f}"
    elif "graph_error" in entry:
        graph = f"ERR({entry['graph_error'][:width]})"
    else:
        graph = "-"
    return f"{entry['us']:.1f}{sep}{graph}"


def format_row(row: dict, ceiling_gbs: float) -> str:
    """The line printed as a row is timed: flashjit's eager/graph µs and bandwidth, its speed
    against the best peer (eager and graph), the plan's splits, then every peer's eager/graph µs."""
    impls = row["impls"]
    fj = impls.get("flashjit", {})
    us, graph_us = fj.get("us"), fj.get("graph_us")
    line = (f"{row['case']:46s} {row['bytes'] / 1e6:8.1f} MB  floor {row['floor_us']:7.1f} us | "
            f"flashjit {time_pair(fj):>15s} us")
    if us:
        gbs = gb_per_s(row["bytes"], us)
        line += f" {gbs:5.0f} GB/s ({100 * gbs / ceiling_gbs:5.1f}% of copy, {100 * row['floor_us'] / us:3.0f}% of floor)"
    line += f" | vs best peer {ratio(row['best_peer_us'], us)} eager, {ratio(row['best_peer_graph_us'], graph_us)} graph"
    if us and graph_us:
        line += f" | graph/eager speed {us / graph_us:.2f}"
    if "splits" in fj:
        line += f" | splits {fj['splits']}" + (f" (graph {fj['graph_splits']})" if "graph_splits" in fj else "")
    if "speedup_vs_bf16" in row:
        line += f" | {row['speedup_vs_bf16']:.2f}x bf16"
    others = "  ".join(f"{name} {time_pair(entry)}" for name, entry in impls.items() if name != "flashjit")
    return line + (f" | {others}" if others else "")


def impl_names(rows) -> list[str]:
    """Every implementation of the rows: flashjit first, then the peers in PEERS order, then the rest."""
    seen = {name for row in rows for name in row["impls"]}
    order = ["flashjit"] + [n for n in PEERS if n in seen]
    return order + sorted(seen - set(order))


def markdown_table(rows) -> str:
    """µs per implementation (eager / graph), flashjit's speed against the best peer in each mode,
    and flashjit's graph speed against its eager speed."""
    names = impl_names(rows)
    header = (["case", "MB", "floor µs"] + [f"{n} (eager / graph)" for n in names]
              + ["÷ best peer, eager", "÷ best peer, graph", "flashjit graph ÷ eager"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        fj = row["impls"].get("flashjit", {})
        us, graph_us = fj.get("us"), fj.get("graph_us")
        cells = [row["case"], f"{row['bytes'] / 1e6:.1f}", f"{row['floor_us']:.1f}"]
        cells += [time_pair(row["impls"].get(n), sep=" / ", width=24) for n in names]
        cells += [ratio(row["best_peer_us"], us), ratio(row["best_peer_graph_us"], graph_us),
                  f"{us / graph_us:.2f}" if us and graph_us else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the plot ---------------------------------------------------------------------------------

MIXED_PANEL = "mixed lengths (in order of mean length)"


def plot_points(rows) -> dict:
    """{panel: {(implementation, "eager" | "graph"): [(context length, GB/s, case), ...]}} over the rows
    of the default shape (BASE_FAMILY): a panel per batch size of one length, in batch order, then one
    for the mixed batches (at their mean length)."""
    keyed: dict = {}
    for row in rows:
        if row["family"] != BASE_FAMILY:
            continue
        panel = keyed.setdefault((0, row["batch"]) if row["uniform"] else (1, 0), {})
        for name, entry in row["impls"].items():
            for mode, key in (("eager", "us"), ("graph", "graph_us")):
                if key in entry:
                    point = (row["mean_kv_len"], gb_per_s(row["bytes"], entry[key]), row["case"])
                    panel.setdefault((name, mode), []).append(point)
    for panel in keyed.values():
        for points in panel.values():
            points.sort()
    return {(MIXED_PANEL if mixed else f"batch {batch}"): keyed[mixed, batch] for mixed, batch in sorted(keyed)}


STYLES = {"eager": ("-", "o"), "graph": ("--", "x")}
PANELS_PER_LINE = 3


def panel_lines(count: int) -> list[int]:
    """Panels on each line of the figure: at most PANELS_PER_LINE, the lines as even as they can be,
    so no place of the grid is left empty (the panels of a shorter line are wider)."""
    lines = math.ceil(count / PANELS_PER_LINE)
    return [count // lines + (1 if i < count % lines else 0) for i in range(lines)]


def legend_names(rows, panels) -> list[tuple[str, bool]]:
    """Every implementation measured in any row, each with whether it has a point in the plot (a
    peer timed only on other shapes is still named, as such)."""
    drawn = {name for series in panels.values() for name, _ in series}
    return [(name, name in drawn) for name in impl_names(rows)]


def write_plot(rows, path: str, ceiling_gbs: float | None = None, title: str = "", gpu: str = "") -> str:
    """Draws plot_points(rows) into a PNG at path (a colour per implementation, solid eager, dashed
    graph; GB/s axes from zero; the GPU named in the title); returns what it did: written, or why not."""
    panels = plot_points(rows)
    if not panels:
        return f"plot: no row of the default shape ({BASE_FAMILY}) was timed; nothing drawn"
    try:
        import matplotlib
    except ImportError as exc:
        return f"plot skipped: matplotlib not importable ({exc})"
    import textwrap

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    names = legend_names(rows, panels)
    colors = {name: f"C{i % 10}" for i, (name, _) in enumerate(names)}
    lines = panel_lines(len(panels))
    width = math.lcm(*lines)  # grid columns: each line's panels split them evenly
    figure = plt.figure(figsize=(5.2 * max(lines), 4.2 * len(lines)))
    grid = figure.add_gridspec(len(lines), width)
    places = [grid[line, i * width // count:(i + 1) * width // count]
              for line, count in enumerate(lines) for i in range(count)]
    for place, (panel, series) in zip(places, panels.items()):
        ax = figure.add_subplot(place)
        mixed = panel == MIXED_PANEL
        cases = sorted({(x, case) for points in series.values() for x, _, case in points})
        position = {case: i for i, (_, case) in enumerate(cases)}  # mixed rows: one place each, by mean length
        for (name, mode), points in series.items():
            xs = [position[case] if mixed else x for x, _, case in points]
            line, marker = STYLES[mode]
            ax.plot(xs, [y for _, y, _ in points], linestyle="none" if mixed else line, marker=marker,
                    color=colors[name])
        if ceiling_gbs:
            ax.axhline(ceiling_gbs, color="gray", linestyle=":", linewidth=1)
        if mixed:
            ax.set_xticks(range(len(cases)), [textwrap.fill(case, 18) for _, case in cases], fontsize="x-small")
            ax.set_xlim(-0.5, len(cases) - 0.5)
        else:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens per request)")
        ax.set_ylim(bottom=0)
        ax.set_title(panel)
        ax.set_ylabel("GB/s (K/V attended + q + out)")
        ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=colors[n], linewidth=3,
                      label=n if drawn else f"{n} (no point: failed or not run on this shape)") for n, drawn in names]
    handles += [Line2D([], [], color="black", linestyle=line, marker=marker, label=mode)
                for mode, (line, marker) in STYLES.items()]
    if ceiling_gbs:
        handles.append(Line2D([], [], color="gray", linestyle=":", label=f"copy ceiling {ceiling_gbs:.0f} GB/s"))
    figure.legend(handles=handles, loc="lower center", ncol=min(5, len(handles)), fontsize="small")
    heading = title or f"decode bandwidth by context length, {BASE_FAMILY}"
    figure.suptitle(f"{heading}, {gpu}" if gpu else heading)
    figure.tight_layout(rect=(0, 0.04 + 0.03 * math.ceil(len(handles) / 5), 1, 0.96))
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"plot written to {path}"
