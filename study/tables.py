"""
The tables (markdown) and plots of reproduce.py's suites, each drawn from a summary.json
alone (report.py writes it from the raw results): what the tables show is what the
file holds.
"""

from lexgpt.outputs import pyplot, save_plot
from lexgpt.retrieval_tasks import by_elimination

# The paper's numbers (its 1024-token models on arXiv text) beside ours, row by row: (our row
# name, the paper's row name, the paper's values). Table 2: perplexity at 1/4, 1/2, 1, 2 and 4
# x the training length; Table 3: attention resolution at 1 and 2 x (the "- BCA" row is xPos
# with plain causal attention); Table 4: perplexity at the training length; Table 5:
# perplexity at 2 and 4 x, with and without BCA. Our rows without a paper row have None.
PAPER_TABLES = (
    ("Table 2: perplexity against length", "perplexity", (0.25, 0.5, 1, 2, 4, 8, 16), 2, (
        ("learned", None, None),
        ("sinusoidal", "Transformer", (46.34, 36.39, 29.94, 132.63, 1283.79)),
        ("alibi", "Alibi", (37.66, 29.92, 24.99, 23.14, 24.26)),
        ("rope", "Roformer", (38.09, 30.38, 25.52, 73.6, 294.45)),
        ("xpos + BCA", "LeX", (34.3, 27.55, 23.31, 21.6, 20.73)),
        ("xpos_sb512 + BCA", None, None))),
    ("Table 3: attention resolution (R; R_shared beside it)", "resolution", (1, 2), 3, (
        ("sinusoidal", "Transformer", (0.87, 0.28)),
        ("alibi", "Alibi", (0.81, 0.88)),
        ("rope", "Roformer", (0.91, 0.08)),
        ("xpos + BCA", "LeX", (0.98, 1.08)),
        ("xpos", "LeX - BCA", (0.98, 0.54)),
        ("xpos_sb512 + BCA", None, None),
        ("xpos_sb512", None, None))),
    ("Table 4: the rotation ablation, perplexity at the training length", "perplexity", (1,), 2, (
        ("rope", "RoPE", (17.74,)),
        ("xpos", "xPos", (17.54,)),
        ("xpos_norot", "- Rotation", (33.68,)))),
    ("Table 5: blockwise causal attention, perplexity", "perplexity", (2, 4, 8, 16), 2, (
        ("rope", "RoPE", (73.6, 294.45)),
        ("rope + BCA", "RoPE + BCA", (25.57, 25.65)),
        ("alibi", "Alibi", (23.14, 24.26)),
        ("alibi + BCA", "Alibi + BCA", (24.6, 25.37)),
        ("xpos", "xPos", (22.56, 28.43)),
        ("xpos + BCA", "xPos + BCA", (21.6, 20.73)),
        ("xpos_sb512", None, None),
        ("xpos_sb512 + BCA", None, None))),
)


def clock(seconds):
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def interval(bounds, digits):
    if not bounds:
        return "–"
    return f"[{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]"


def cell(stat, digits=2):
    """mean ± std [each checkpoint's value, in seed order], and "(n of N)" where only some
    checkpoints have one."""
    if stat is None:
        return "–"
    text = f"{stat['mean']:.{digits}f}"
    if stat["std"] is not None:
        text += f" ± {stat['std']:.{digits}f}"
    if stat["n"] > 1 and stat.get("values"):  # (a summary from before had no values)
        text += " [" + " / ".join(f"{v:.{digits}f}" for v in stat["values"]) + "]"
    return text + partial(stat)


def partial(stat):
    """" (n of N)" where a spread rests on only n of its N checkpoints, else nothing."""
    if stat and stat["n"] < stat["of"]:
        return f" ({stat['n']} of {stat['of']})"
    return ""


def table_head(title, columns, header="model"):
    """A markdown table's title, header row and rule."""
    names = " | ".join(str(c) for c in columns)
    return [f"### {title}", "", f"| {header} | {names} |", "|---" * (len(columns) + 1) + "|"]


def markdown(title, table, columns, digits=2, header=None):
    """A markdown table of cells; `digits` is one number for every column, or {column: digits}."""
    places = digits if isinstance(digits, dict) else dict.fromkeys(columns, digits)
    lines = table_head(title, columns, header or "model")
    for name, row in table.items():
        cells = " | ".join(cell(row.get(c), places[c]) for c in columns)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines) + "\n"


def wall_text(wall):
    return f"{clock(wall['seconds'])} ({wall['measured']} of its {wall['jobs']} jobs measured"


# ------------------------------------------------------------------------------------------
# The study


def tables_markdown(summary):
    """Every table of the study: the paper's Tables 2-5 beside ours, then the full tables."""
    ppl = summary["perplexity"]
    passkey = summary["passkey_accuracy"]
    wall = summary["wall_time"]
    seeds = ", ".join(map(str, summary["seeds"]))
    estimated = ""
    if wall["measured"] < wall["jobs"]:
        estimated = ", the others estimated from the jobs of their kind"
    head = (f"Study: {summary['variant']} variant, {summary['budget']} budget, training length "
            f"{summary['recipe']['block_size']}, seeds {seeds}; wall time {wall_text(wall)}"
            f"{estimated}), on {summary['machine']}.\n")
    res_columns = [f"{what} at {m}l" for m in (1, 2) for what in ("R", "R_shared")]
    repeat_digits = {"gain at d=0": 3, "effective context": 0, "reach bound": 0}
    tables = [head, *paper_tables(summary),
              markdown("Perplexity against length (lex protocol), mean ± std over seeds", ppl,
                       [str(n) for n in summary["lengths"]]),
              markdown("Attention resolution (Eq. 3 on Eq. 11), layer average, heads averaged "
                       "first", summary["resolution"], res_columns, digits=3),
              markdown("Repeat probe: retrieval gain with the span repeated at once, effective "
                       "context (tokens; \"n of N\": only n checkpoints gain anything at d=0) "
                       "and the reach bound", summary["effective_context"],
                       list(repeat_digits), digits=repeat_digits)]
    if passkey:
        lengths = sorted({n for row in passkey.values() for n in row}, key=int)
        tables.append(markdown("Passkey accuracy against document length, mean ± std over the "
                               "depths (one model)", passkey, lengths))
    else:
        tables.append("")
    if summary.get("context"):
        tables.append(context_markdown(summary["context"]))
    return "\n".join(tables)


def paper_tables(summary):
    """The paper's Tables 2-5 in its layout, each of our rows (mean ± std over seeds) followed
    by the paper's row. Lengths are multiples of the training length l: ours is the recipe's
    block_size, the paper's 1024."""
    l = summary["recipe"]["block_size"]
    out = []
    for title, measure, multiples, digits, rows in PAPER_TABLES:
        lines = table_head(title, [f"{m:g}l" for m in multiples])
        for ours, theirs, values in rows:
            row = summary[measure].get(ours, {})
            if measure == "perplexity":
                cells = [cell(row.get(str(int(m * l))), digits) for m in multiples]
            else:
                cells = [cell(row.get(f"R at {m}l"), digits) + "; "
                         + cell(row.get(f"R_shared at {m}l"), digits) for m in multiples]
            lines.append(f"| {ours} (ours, l = {l}) | " + " | ".join(cells) + " |")
            if theirs:
                cells = [f"{v:g}" for v in values] + ["–"] * (len(multiples) - len(values))
                lines.append(f"| {theirs} (paper, l = 1024) | " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
    return out


def context_markdown(context):
    """The context probe's table: the gain from context beyond l with its t interval over seeds
    and by bin, and the lex fall split."""
    bins = {k for row in context.values() for k in row if k.startswith("gain ") and ".." in k}
    bins = sorted(bins, key=bin_start)
    columns = ["gain", "gain interval", *bins, "fall", "used", "early"]
    titles = {"gain": "gain, l .. T", "gain interval": "95% t interval over seeds",
              "fall": "lex fall l -> T", "used": "of it: context used",
              "early": "of it: fewer early tokens"}
    title = ("Context beyond l: NLL given the last l tokens minus NLL under the rule (nats "
             "per token; mean ± std over seeds [each seed]); the lex protocol's fall from l to "
             "T split into context used and fewer early tokens")
    lines = table_head(title, [titles.get(c, c) for c in columns])
    for name, row in context.items():
        cells = []
        for c in columns:
            if c == "gain interval":
                cells.append(interval(row.get(c), 4))
            else:
                cells.append(cell(row.get(c), 4))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bin_start(column):
    """The first position of a "gain <start>..<end>" column."""
    return int(column.split()[1].split("..")[0])


def plot_perplexity(summary, path):
    """Perplexity against length, one panel per attention rule (and one for the
    interpolations, under causal attention), the spread over seeds shaded (mean ± std)."""
    plt = pyplot()
    table, panels = summary["perplexity"], summary["panels"]
    titles = dict(causal="causal", bca="BCA", sliding="sliding window",
                  sinks="attention sinks", interpolation="RoPE interpolation (causal)")
    shown = [p for p in titles if p in panels.values()]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4.5), sharey=True,
                             squeeze=False)
    for ax, panel in zip(axes[0], shown):
        for name, row in table.items():
            if panels[name] != panel:
                continue
            xs = [n for n in summary["lengths"] if str(n) in row]
            mean = [row[str(n)]["mean"] for n in xs]
            std = [row[str(n)]["std"] or 0 for n in xs]
            low = [m - s for m, s in zip(mean, std)]
            high = [m + s for m, s in zip(mean, std)]
            ax.plot(xs, mean, marker="o", ms=3, label=name)
            ax.fill_between(xs, low, high, alpha=0.2)
        ax.axvline(summary["recipe"]["block_size"], color="gray", ls=":")
        ax.set(xscale="log", yscale="log", title=titles[panel],
               xlabel="evaluation length (tokens)")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("perplexity (mean ± std over seeds)")
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)


def plot_effective_context(summary, path):
    """The repeat probe's effective context per row (mean ± std over seeds) against its reach
    bound (the farthest a copy can be seen under the row's rule; none for causal attention)."""
    plt = pyplot()
    rows = summary["effective_context"]
    names = list(rows)
    labels = [name + partial(rows[name].get("effective context")) for name in names]
    fig, ax = plt.subplots(figsize=(7, 0.25 * len(names) + 1.5))
    for i, name in enumerate(names):
        stat = rows[name].get("effective context")
        bound = rows[name].get("reach bound")
        if stat is not None:
            ax.barh(i, stat["mean"], xerr=stat["std"] or 0, color="C0", alpha=0.7)
        if bound is not None:
            ax.plot(bound["mean"], i, "k|", ms=10)
    ax.set(yticks=range(len(names)), xlabel="effective context (tokens): bar; reach bound: |")
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# The long-range task suite


def retrieval_markdown(summary):
    """The suite's tables: retrieval reach per model and task, accuracy at 1 x, MQAR by query,
    the areas, the sweep, then accuracy by distance and by total length per task."""
    l, wall = summary["recipe"]["block_size"], summary["wall_time"]
    seeds = ", ".join(map(str, summary["seeds"]))
    by_count = {}  # the schemes planned, by their number of seeds
    for name, n in (summary.get("schemes") or {}).items():  # (none in an older summary)
        by_count.setdefault(n, []).append(name)
    words = {1: "one", 2: "two", 3: "three"}
    counts = "; ".join(f"{words.get(n, n)} for " + (
        "the others" if len(by_count) > 1 and n == min(by_count) and len(names) > 2
        else ", ".join(names)) for n, names in sorted(by_count.items(), reverse=True))
    head = (f"Long-range task suite: {summary['budget']} budget, training length l = {l}, "
            f"seeds {seeds}{f' (planned: {counts})' if counts else ''}; "
            f"wall time {wall_text(wall)}), on {summary['machine']}.\n")
    names = summary["tasks"]
    reach, at_1x = {}, {}
    for name, row in summary["reach"].items():
        bounds = [row[f"{t} bound"] for t in names if row.get(f"{t} bound")]
        reach[name] = {task: row.get(task) for task in names}
        reach[name]["bound"] = bounds[0] if bounds else None
        at_1x[name] = {task: row.get(f"{task} at 1x") for task in names}
    tables = [head]
    if reach:  # (a suite swept before its task probes ran has none yet)
        tables += [markdown("Retrieval reach (tokens; the largest distance up to which accuracy "
                            "stays >= 90% of that at 1 x, mean ± std over seeds; \"n of N\": "
                            "only n checkpoints retrieve at 1 x) and the rule's reach bound",
                            reach, [*names, "bound"], digits=0),
                   markdown("Accuracy at 1 x (mean over the distances whose whole instance "
                            "fits in a training record, l + 1 tokens)", at_1x, names)]
    by_query = summary.get("mqar_by_query") or {}
    if by_query:
        tables.append(by_query_markdown(by_query))
    tables += area_markdown(summary.get("area") or {}, names)
    sweep = summary.get("sweep") or {}
    tables += sweep_markdown(sweep, summary.get("sweep_accuracy") or {}, names, l)
    for task in names:
        for kind in ("distance", "length"):
            tables += accuracy_markdown(summary["accuracy"], task, kind, l)
    return "\n".join(tables)


def by_query_markdown(by_query):
    n = len(next(iter(by_query.values())))
    rows = {"picking among the values not yet asked for": by_elimination(n), **by_query}
    columns = [str(i + 1) for i in range(n)]
    table = {}
    for name, row in rows.items():
        table[name] = {str(i + 1): spread_of_one(a) for i, a in enumerate(row)}
    return markdown("mqar: accuracy by query, 1st to last, at 1 x under causal attention, per "
                    "checkpoint", table, columns, header="run")


def spread_of_one(value):
    """A cell of one value (report.spread([value]))."""
    return {"mean": value, "std": None, "n": 1, "of": 1, "values": [value]}


def accuracy_markdown(accuracy, task, kind, l):
    """A task's accuracy by distance or by total length: [a table], or [] without rows."""
    table = {}
    for name, row in accuracy.items():
        found = {int(k.split()[-1]): v for k, v in row.items() if k.startswith(f"{task} {kind} ")}
        if found:
            table[name] = found
    if not table:
        return []
    columns = sorted({c for row in table.values() for c in row})
    title = f"{task}: accuracy by {kind}"
    if kind == "length":
        title += f" (the answers at distance {l // 2} or the task's shortest)"
    table = {n: {str(c): v for c, v in row.items()} for n, row in table.items()}
    return [markdown(title, table, [str(c) for c in columns])]


def area_markdown(table, names):
    """Per task: the area under accuracy against log distance, with its interval, and paired
    with the plain causal row of the same checkpoints."""
    out = []
    differences = {name: row for name, row in table.items() if " − " in name}
    if differences:
        title = ("Area under accuracy against log2 distance: one scheme minus another "
                 "(different models, the same data and seeds), with the 95% t interval over "
                 "seeds of the difference seed by seed")
        lines = table_head(title, names, "difference")
        for name, row in differences.items():
            cells = []
            for t in names:
                if t in row:
                    cells.append(f"{row[t]['mean']:.2f} {interval(row[t]['interval'], 2)}")
                else:
                    cells.append("–")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
    columns = ["area", "95% t interval", "paired difference", "95% t interval"]
    for task in names:
        rows = {n: row for n, row in table.items() if row.get(task) and " − " not in n}
        if not rows:
            continue
        title = (f"{task}: area under accuracy against log2 distance (the mean accuracy over "
                 "log distance, every cell of the grid counted), mean ± std over seeds [each "
                 "seed], with its 95% t interval over seeds; paired: minus the plain causal row "
                 "of the same checkpoints, with its 95% t interval over seeds")
        lines = table_head(title, columns)
        for name, row in rows.items():
            cells = [cell(row[task]), interval(row.get(f"{task} interval"), 2),
                     cell(row.get(f"{task} paired")),
                     interval(row.get(f"{task} paired interval"), 2)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
    return out


def sweep_markdown(sweep, curves, names, l):
    """Per task: accuracy where the rule acts by zone (direct, relay, beyond) with the reach
    bound's range, then by distance on the sweep's grid."""
    out = []
    for task in names:
        rows = {n: row for n, row in sweep.items() if any(k.startswith(f"{task} ") for k in row)}
        if not rows:
            continue
        title = (f"{task} where the rule acts (after {2 * l} tokens, the answer's phase drawn "
                 "uniformly over BCA's segment of l/2): accuracy by zone, pooled over the sweep's "
                 "distances, mean ± std over seeds [each seed], and in parentheses the answers "
                 "a checkpoint scores in that zone")
        lines = table_head(title, ["direct", "relay", "beyond", "reach bound"])
        for name, row in rows.items():
            cells = [zone_cell(row, task, z) for z in ("direct", "relay", "beyond")]
            bound = row.get("bound") or [None, None]
            cells.append(f"{bound[0]}–{bound[1]}" if bound[0] else "–")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
        table = {}
        for name, row in curves.items():
            found = {k.split()[-1]: v for k, v in row.items() if k.startswith(f"{task} ")}
            if found:
                table[name] = found
        columns = sorted({c for row in table.values() for c in row}, key=int)
        out.append(markdown(f"{task} where the rule acts: accuracy by distance", table, columns))
    return out


def zone_cell(row, task, zone):
    text = cell(row.get(f"{task} {zone}"))
    answers = row.get(f"{task} {zone} answers")
    if answers:
        text += f" ({answers})"
    return text


def plot_task(summary, task, path, sweep=False):
    """Accuracy against distance, a panel per rule (and one for the interpolations), a curve
    per scheme (mean over seeds); the training length and each rule's reach bound marked."""
    prefix = f"{task} " if sweep else f"{task} distance "  # the sweep's, or the distance grid's
    curves = summary["sweep_accuracy" if sweep else "accuracy"]
    rows = {}
    for name, row in curves.items():
        points = [(int(k.split()[-1]), v["mean"]) for k, v in row.items()
                  if k.startswith(prefix) and v]
        rows[name] = sorted(points)
    order = ("causal", "bca", "sliding", "sinks", "interpolation")
    panels = [p for p in order if any(summary["panels"].get(n) == p and rows[n] for n in rows)]
    if not panels:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True,
                             squeeze=False)
    l = summary["recipe"]["block_size"]
    for ax, panel in zip(axes[0], panels):
        shown = [(n, c) for n, c in rows.items() if summary["panels"].get(n) == panel and c]
        for i, (name, curve) in enumerate(shown):
            # past matplotlib's ten colours, a dashed line tells them apart
            line, = ax.plot(*zip(*curve), marker="o", ms=3, ls="-" if i < 10 else "--",
                            label=name)
            mark_bound(ax, summary, name, task, line.get_color(), sweep)
        ax.axvline(l, color="grey", ls="--", lw=1)
        title = f"{task}: {panel}"
        xlabel = "distance (tokens); grey dashed: l, "
        if sweep:
            title += f", after {2 * l} tokens, every phase"
            xlabel += "shaded: reach bound"
        else:
            ax.set_xscale("log", base=2)
            xlabel += "dotted: reach bound"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)


def mark_bound(ax, summary, name, task, color, sweep):
    """The reach bound of a row: its range over the phases (the sweep), or a dotted line."""
    if sweep:
        bound = summary["sweep"].get(name, {}).get("bound") or [None]
        if bound[0]:
            least, most = summary["sweep"][name]["bound"]
            ax.axvspan(least, most + 1, color=color, alpha=0.1)
        return
    bound = summary["reach"].get(name, {}).get(f"{task} bound")
    if bound:
        ax.axvline(bound["mean"], color=color, ls=":", lw=1)


# ------------------------------------------------------------------------------------------
# The context extension


def extension_markdown(summary):
    """The extension's table from its summary.json."""
    l, tuned, wall = summary["recipe"]["block_size"], summary["fine_tune"], summary["wall_time"]
    seeds = ", ".join(map(str, summary["seeds"]))
    sequences = tuned["batch_size"] * tuned["gradient_accumulation_steps"]
    head = (f"Context extension: the study's models (training length l = {l}, seeds {seeds}) "
            f"zero-shot, and fine-tuned at {tuned['block_size']} tokens for "
            f"{tuned['max_iters']} iterations of {sequences} sequences "
            f"({summary['extra_tokens']:,} tokens, learning rate {tuned['learning_rate']:g} to "
            f"{tuned['min_lr']:g}); {summary['budget']} budget, wall time {wall_text(wall)}), "
            f"on {summary['machine']}.\n")
    columns = [str(n) for n in summary["lengths"]]
    title = ("Perplexity against length (lex protocol) and the gain from context beyond l "
             "(the context probe at 16l, nats per token), mean ± std over seeds [each seed]")
    lines = table_head(title, ["seeds", "extra tokens", *columns, "context gain beyond l"])
    for name, row in summary["table"].items():
        tokens = row.get("extra tokens")
        tokens = f"{int(tokens['mean']):,}" if tokens else "–"
        seeds = max((row[c]["n"] for c in columns if row.get(c)), default=0)
        cells = [str(seeds), tokens, *(cell(row.get(c), 3) for c in columns),
                 cell(row.get("context gain"), 4)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = head + "\n" + "\n".join(lines) + "\n"
    if summary.get("yarn", {}).get("grid"):
        yarn = summary["yarn"]
        text += ("\n" + "\n".join(table_head(
            f"YaRN's ramp ends (alpha, beta) at 4l = {4 * l}, zero-shot RoPE with s = 4: "
            f"perplexity, mean ± std over seeds [each seed]; chosen: alpha = {yarn['alpha']:g}, "
            f"beta = {yarn['beta']:g}, {yarn['chosen']}", ["perplexity"], header="alpha,beta"))
            + "\n" + "\n".join(f"| {ends} | {cell(g, 3)} |" for ends, g in yarn["grid"].items())
            + "\n")
    if summary.get("task_suite"):
        text += "\n" + suite_markdown(summary["task_suite"])
    return text


def suite_markdown(suite):
    """The task-suite part of the extension: accuracy within the fine-tuning length and
    past it."""
    l, tuned = suite["recipe"]["block_size"], suite["fine_tune"]
    seeds = ", ".join(map(str, suite["seeds"]))
    sequences = tuned["batch_size"] * tuned["gradient_accumulation_steps"]
    tasks = sorted({t for row in suite["table"].values() for t in row},
                   key=["copy", "mqar", "passkey"].index)
    title = (f"The task suite's models (training length l = {l}, seed {seeds}) zero-shot, and "
             f"fine-tuned at {tuned['block_size']} tokens for {tuned['max_iters']} iterations "
             f"of {sequences} sequences ({suite['extra_tokens']:,} tokens, learning rate "
             f"{tuned['learning_rate']:g} to {tuned['min_lr']:g}): mean accuracy over the "
             f"task probe's distances up to 4l = {4 * l} and past it")
    columns = [f"{t} {where}" for t in tasks for where in ("<= 4l", "> 4l")]
    lines = table_head(title, columns)
    for name, row in suite["table"].items():
        cells = []
        for t in tasks:
            for where in ("within", "past"):
                value = row.get(t, {}).get(where)
                cells.append("–" if value is None else f"{value:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

