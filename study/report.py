"""
The reports of reproduce.py's suites: each turns the raw results (results/<suite>/raw/*.json,
each a script's --json output) into summary.json (mean, sample std and n over seeds for every
number, the wall time and the machine), then tables.md and the plots drawn from it alone
(tables.py). A damaged raw file is noted and left out; so are the rows of checkpoints
that are not the suite's own.
"""

import json
import os
from pathlib import Path

import numpy as np

from lexgpt.checkpoint import load_checkpoint
from lexgpt.cli import UserError
from lexgpt.retrieval_tasks import TASKS
from study.files import check_outputs, check_raw, write_summary
from study.jobs import (
    SEEDS,
    SUITE_SCHEMES,
    expected_seconds,
    plan,
    read_result,
    read_timings,
    retrieval_plan,
    study_lengths,
    study_runs,
)
from study.tables import (
    plot_effective_context,
    plot_perplexity,
    plot_task,
    retrieval_markdown,
    tables_markdown,
)

# Schemes compared by area (different models, the same data and seeds): xPos's decay against
# RoPE, and under YaRN
COMPARED = (("xpos", "rope"), ("xpos_sb512", "rope"), ("alibi", "rope"),
            ("xpos + yarn", "rope + yarn"), ("xpos_sb512 + yarn", "rope + yarn"),
            ("xpos_sb512 + yarn", "xpos + yarn"))
CONTEXT_FIELDS = ("gain", "fall", "used", "early")
NOTED = set()  # the notes printed: each once, however many tables read the file


def report(args, budget, measured=True):
    """The study's summary.json, then tables.md and the plots drawn from it alone, from
    whatever has finished. Its machine is this one where this run measured something, else
    the one the summary already names (a redraw)."""
    results = Path(args.results)
    check_outputs(results, "study")
    check_raw(results)
    panels = {}
    ppl = gather(args, ".ppl.json", length_of, ppl_of, panels)
    scaled = f" ({budget['scaled_spans']} spans)"
    ppl.update(gather(args, ".scaled.json", length_of, ppl_of, panels, plain=scaled))
    resolution = {}
    for m in (1, 2):
        for name, by_key in gather_resolution(args, budget, m).items():
            resolution.setdefault(name, {}).update(by_key)
    summary = {"variant": args.variant, "budget": args.budget, "recipe": budget["recipe"],
               "seeds": list(SEEDS), "lengths": study_lengths(budget),
               "wall_time": wall_time(args, budget, plan),
               "machine": machine_of(args, measured),
               "perplexity": ppl, "panels": panels, "resolution": resolution,
               "effective_context": gather_repeat(args, budget),
               "passkey_accuracy": gather(args, ".passkey.json", length_of, accuracy_of)}
    context = gather_context(args)
    if context:  # (a summary drawn before the context probe existed has none)
        summary["context"] = context
    summary = write_summary(results / "summary.json", summary)
    (results / "tables.md").write_text(tables_markdown(summary))
    if summary["perplexity"]:
        plot_perplexity(summary, results / "perplexity.png")
    if summary["effective_context"]:
        plot_effective_context(summary, results / "effective_context.png")
    print(f"wrote {results / 'tables.md'}")


def length_of(row):
    return row["length"]


def ppl_of(row):
    return row["ppl"]


def accuracy_of(row):  # (a passkey file: spread over depths)
    return row["accuracy"]


def gather_repeat(args, budget):
    """The repeat probe's gain at d=0, effective context and reach bound, per row."""
    def gain_key(row):
        return "gain at d=0" if row["d"] == 0 else None

    def gain(row):
        return row["gain"]

    repeat = {}
    sequences = f" ({budget['scaled_sequences']} sequences)"
    for suffix, plain in ((".repeat.json", ""), (".repeat_scaled.json", sequences)):
        repeat.update(gather(args, suffix, gain_key, gain, plain=plain))
        for column, field in (("effective context", "effective_context"),
                              ("reach bound", "reach_bound")):
            def key(row, column=column):
                return column

            def value(row, field=field):
                return row[field]

            for name, by_key in gather(args, suffix, key, value, plain=plain).items():
                repeat.setdefault(name, {}).update(by_key)
    return repeat


def machine_of(args, measured):
    """This machine where this run measured something, else the one the summary names."""
    if not measured:
        found = previous_machine(Path(args.results) / "summary.json")
        if found:
            return found
    return machine(args.device)


def previous_machine(path):
    """The machine an existing summary names (None without one: drawn anew)."""
    try:
        return json.loads(path.read_text()).get("machine")
    except (OSError, ValueError, AttributeError):
        return None


def machine(device):
    import platform

    import torch
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} x {cpu}, torch {torch.__version__}"


def wall_time(args, budget, jobs_of):
    """The suite's duration: the sum over its jobs of their measured durations (timings.json
    keeps the latest run of each job); a job not measured (run before timings were kept, or
    not yet) is estimated as in the progress lines."""
    timings = read_timings(Path(args.results) / "timings.json")
    jobs = [job for job in jobs_of(args, budget) if job.kind != "report"]
    seconds = sum(expected_seconds(job, timings, args.budget) for job in jobs)
    measured = sum(job.name in timings for job in jobs)
    return {"seconds": round(seconds, 1), "measured": measured, "jobs": len(jobs)}


def spread(values):
    """Mean, sample standard deviation (None for one value) and count n of the values that
    are not None, out of `of` (a repeat probe's effective context is None where the model
    gains nothing even at the shortest distance)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    n = len(present)
    mean = sum(present) / n
    std = None
    if n > 1:
        std = (sum((v - mean) ** 2 for v in present) / (n - 1)) ** 0.5
    return {"mean": mean, "std": std, "n": n, "of": len(values), "values": present}


def spreads(table):
    """{name: {key: spread}} of {name: {key: values}}."""
    return {name: {key: spread(v) for key, v in row.items()} for name, row in table.items()}


def row_name(scheme, row):
    """The suite's scheme name (xPos has three) followed by the label's rule and scaling."""
    return scheme + row["label"][len(row["pos"]):]


def gather(args, suffix, key_of, value_of, panels=None, plain=""):
    """{row name: {key: spread over seeds}} from each scheme's raw/<scheme><suffix>, one value
    per checkpoint and key (key_of None skips a row); `panels`, if given, gets each row
    name's panel: its attention rule, or "interpolation" for a RoPE interpolation. plain:
    what sets a row without interpolation in an interpolation file apart from the same row
    measured on more text, e.g. " (16 spans)"; it shares the interpolations' panel."""
    values = {}
    for scheme, _, _ in SUITE_SCHEMES:  # (the study's are among them)
        path = Path(args.results) / "raw" / f"{scheme}{suffix}"
        try:
            found = [gathered(scheme, row, key_of, value_of, plain)
                     for row in scheme_rows(args, scheme, suffix)]
        except (KeyError, TypeError, AttributeError):  # damaged, noted by check_raw
            continue
        for name, key, ckpt, depth, value, panel in found:
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                print(f"note: {path}: {name}'s {key} is {value!r}, not a number: "
                      "left out of the tables")
                continue
            if key is not None:
                # one value per checkpoint (and passkey depth): a repeat row per distance
                # repeats its effective context
                values.setdefault(name, {}).setdefault(key, {})[ckpt, depth] = value
            if panels is not None:
                panels[name] = panel
    return {name: {k: spread(list(v.values())) for k, v in row.items()}
            for name, row in values.items()}


def gathered(scheme, row, key_of, value_of, plain):
    """(row name, key, checkpoint, depth, value, panel) of one raw row."""
    name = row_name(scheme, row)
    panel = "interpolation"
    if row["rope_scaling"] == "none":
        name += plain
        if not plain:
            panel = row["attention"]
    return name, key_of(row), row["ckpt"], row.get("depth"), value_of(row), panel


def gather_resolution(args, budget, m):
    """{row name: {"R at ml": spread, "R_shared at ml": spread}} over seeds, from
    raw/<run>.resolution<m>.json."""
    values = {}
    for scheme, runs in study_runs(budget).items():
        for run, _, passkey, _ in runs:
            path = Path(args.results) / "raw" / f"{run}.resolution{m}.json"
            if passkey or not path.exists():
                continue
            try:
                result = read_result(path)
                found = [(scheme + mode["label"][len(result["pos"]):], what, mode[what])
                         for mode in result["modes"] for what in ("R", "R_shared")]
            except (KeyError, TypeError, AttributeError):  # damaged, noted by check_raw
                continue
            for name, what, value in found:
                values.setdefault(name, {}).setdefault(f"{what} at {m}l", []).append(value)
    return spreads(values)


def gather_context(args):
    """{row name: {column: spread over seeds}} from raw/<scheme>.context.json: each
    checkpoint's gain from context beyond l (its mean over spans, over l .. T and by bin),
    the lex fall from l to T and its two parts; and "gain interval", the 95% t interval of the
    gain over seeds (t_interval). A damaged row is left out."""
    values = {}
    for scheme, row in raw_rows(args, ".context.json"):
        try:
            found = {f: float(row[f]) for f in CONTEXT_FIELDS}
            for b in row["by_bin"]:
                found[f"gain {b['start']}..{b['end']}"] = float(b["gain"])
        except (KeyError, TypeError, ValueError):
            continue
        name = row_name(scheme, row)
        for key, value in found.items():
            values.setdefault(name, {}).setdefault(key, []).append(value)
    table = spreads(values)
    for name, row in values.items():
        table[name]["gain interval"] = t_interval(row["gain"])
    return table


def raw_rows(args, suffix):
    """(scheme, row) for every row of raw/<scheme><suffix> that reads as a result and was
    measured on the suite's own checkpoints (scheme_rows)."""
    for scheme, _, _ in SUITE_SCHEMES:  # (the study's are among them)
        for row in scheme_rows(args, scheme, suffix):
            yield scheme, row


def note(text):
    if text not in NOTED:
        NOTED.add(text)
        print(text)


def scheme_rows(args, scheme, suffix):
    """The rows of raw/<scheme><suffix> and of each run's raw/<scheme>_s<seed><suffix> (none
    where missing or damaged) measured on the scheme's checkpoints under --runs, at the
    results' block_size where the checkpoint is there to say: rows of another results
    directory's models (a file copied in) would otherwise be averaged in as more seeds. The
    rows left out are noted. A checkpoint's rows in its own file replace its rows in the
    scheme's (a directory swept before the sweep was one job per checkpoint), so that no
    answer counts twice."""
    runs = [f"{scheme}_s{seed}" for seed in SEEDS] + [f"{scheme}_passkey"]
    own = {os.path.normpath(Path(args.runs) / run / "ckpt.pt") for run in runs}
    kept = []
    for name in [*runs, scheme]:
        path = Path(args.results) / "raw" / f"{name}{suffix}"
        result = read_result(path) if path.exists() else None
        rows = (result or {}).get("rows", [])
        foreign = {}
        for ckpt in {row["ckpt"] for row in rows if isinstance(row["ckpt"], str)}:
            if os.path.normpath(ckpt) not in own:
                foreign[ckpt] = (f"not one of {args.runs}/{scheme}_s<seed>/ckpt.pt "
                                 "(give the --runs it was measured with)")
                continue
            why = other_block_size(args, ckpt)
            if why:
                foreign[ckpt] = why
        for ckpt, why in sorted(foreign.items()):
            note(f"note: {path}: the rows of {ckpt} are left out of the tables: {why}")
        if name == scheme:  # the scheme's file: only checkpoints no file of their own holds
            covered = {row["ckpt"] for row in kept}
            foreign.update({row["ckpt"]: "" for row in rows if row["ckpt"] in covered})
        kept += [row for row in rows
                 if isinstance(row["ckpt"], str) and row["ckpt"] not in foreign]
    return kept


def other_block_size(args, ckpt):
    """Why a checkpoint under --runs is not the results' own (trained at another
    block_size), or None where it is, or cannot say (missing, or unreadable: the result
    stands as measured)."""
    l = getattr(args, "block_size", None)
    if l is None or not Path(ckpt).is_file():
        return None
    try:
        trained = load_checkpoint(ckpt, mmap=True, verify=())["config"].get("block_size", l)
    except UserError:
        return None
    if trained != l:
        return f"trained at block_size {trained}, not the results' {l}"
    return None


# ------------------------------------------------------------------------------------------
# The long-range task suite


def retrieval_report(args, budget, measured=True):
    """The suite's summary.json, then tables.md and one plot per task drawn from it alone."""
    results = Path(args.results)
    check_outputs(results, "retrieval")
    check_raw(results)
    panels = {}
    reach = gather(args, ".tasks.json", distance_task, reach_of, panels)
    for key, field in (("{} at 1x", "accuracy_1x"), ("{} bound", "reach_bound")):
        def key_of(row, key=key):
            return key.format(row["task"]) if row["kind"] == "distance" else None

        def value_of(row, field=field):
            return row[field]

        for name, by_key in gather(args, ".tasks.json", key_of, value_of).items():
            reach.setdefault(name, {}).update(by_key)
    curves = gather(args, ".tasks.json", curve_key, accuracy_of)
    summary = {"suite": "retrieval", "budget": args.budget, "recipe": budget["recipe"],
               "seeds": list(SEEDS),
               "schemes": {name: n for name, _, n in SUITE_SCHEMES if name in budget["schemes"]},
               "wall_time": wall_time(args, budget, retrieval_plan),
               "machine": machine_of(args, measured), "tasks": list(TASKS), "reach": reach,
               "accuracy": curves, "panels": panels,
               "mqar_by_query": mqar_by_query(args, budget["recipe"]["block_size"]),
               "area": gather_area(args)}
    sweep, sweep_curves = gather_sweep(args)
    if sweep:  # (a suite scored before the sweep existed has none)
        summary.update(sweep=sweep, sweep_accuracy=sweep_curves)
    summary = write_summary(results / "summary.json", summary)
    (results / "tables.md").write_text(retrieval_markdown(summary))
    for task in summary["tasks"]:
        plot_task(summary, task, results / f"{task}.png")
        swept = summary.get("sweep_accuracy", {}).values()
        if any(k.startswith(f"{task} ") for row in swept for k in row):
            plot_task(summary, task, results / f"sweep_{task}.png", sweep=True)
    print(f"wrote {results / 'tables.md'}")


def distance_task(row):
    return row["task"] if row["kind"] == "distance" else None


def reach_of(row):
    return row["retrieval_reach"]


def curve_key(row):
    """"<task> distance <d>" or "<task> length <n>": a point of an accuracy curve."""
    if row["kind"] == "distance":
        return f"{row['task']} {row['kind']} {row['d']}"
    return f"{row['task']} {row['kind']} {row['length']}"


def area(curve):
    """The area under accuracy against log2 distance over the grid, divided by its width: the
    mean accuracy over log distance, every cell counted (curve: sorted [(d, accuracy)])."""
    d, acc = (np.array(x, dtype=float) for x in zip(*curve))
    x = np.log2(d)
    return float(((acc[1:] + acc[:-1]) / 2 * np.diff(x)).sum() / (x[-1] - x[0]))


# Student's t, 97.5%, by the number of values (n - 1 degrees of freedom)
T_975 = {2: 12.7062, 3: 4.3027, 4: 3.1824, 5: 2.7764, 6: 2.5706, 7: 2.4469, 8: 2.3646,
         9: 2.3060, 10: 2.2622}


def t_interval(values):
    """The 95% t interval of the mean of a few values, one a seed (None for one): every
    interval the study publishes, over seeds, n - 1 degrees of freedom. Each value is a seed's
    own mean over its spans or instances (or a seed's paired difference), so the spread between
    seeds already holds each seed's noise within; with three seeds t is 4.303, not a normal
    quantile's 1.96. Past 10 values, 9 degrees': wider, never narrower."""
    if len(values) < 2:
        return None
    t = T_975.get(len(values), T_975[10])
    half = t * float(np.std(values, ddof=1)) / len(values) ** 0.5
    return [float(np.mean(values)) - half, float(np.mean(values)) + half]


def seed_of(ckpt):
    """The training seed of a suite checkpoint, from its run directory (<scheme>_s<seed>), or
    the path itself where it names none."""
    run = Path(ckpt).parent.name
    head, _, seed = run.rpartition("_s")
    return seed if head and seed.isdigit() else str(ckpt)


def area_curves(args):
    """{(row name, scheme, task): {checkpoint: [(d, accuracy)]}} from the distance grid of
    raw/<scheme>.tasks.json."""
    curves = {}
    for scheme, row in raw_rows(args, ".tasks.json"):
        try:
            if row["kind"] != "distance":
                continue
            point = (int(row["d"]), float(row["accuracy"]))
            key = (row_name(scheme, row), scheme, row["task"])
        except (KeyError, TypeError, ValueError):
            continue
        curves.setdefault(key, {}).setdefault(row["ckpt"], []).append(point)
    return curves


def gather_area(args):
    """{row name: {task: spread of area over seeds, "<task> interval": its t interval over
    seeds, "<task> paired": spread of the row's area minus its scheme's plain causal row on the
    same checkpoints, and "<task> paired interval": its t interval over seeds}}; and for each
    pair of COMPARED, "<a> − <b>": {task: the difference of the means, "values": the
    difference seed by seed (a seed gives both schemes the same initial weights and batches),
    "interval": its t interval}."""
    curves = area_curves(args)
    table, by_seed = {}, {}
    for (name, scheme, task), by_ckpt in curves.items():
        by_ckpt = {c: sorted(v) for c, v in by_ckpt.items() if len(v) > 1}
        if not by_ckpt:
            continue
        plain = curves.get((scheme, scheme, task), {}) if name != scheme else {}
        paired = [area(by_ckpt[c]) - area(sorted(plain[c]))
                  for c in by_ckpt if len(plain.get(c, ())) > 1]
        areas = [area(v) for v in by_ckpt.values()]
        by_seed[name, task] = {seed_of(c): a for c, a in zip(by_ckpt, areas)}
        row = table.setdefault(name, {})
        row[task] = spread(areas)
        row[f"{task} interval"] = t_interval(areas)
        if paired:
            row[f"{task} paired"] = spread(paired)
            row[f"{task} paired interval"] = t_interval(paired)
    # other models: the difference of the means, its interval over the seeds both have
    for a, b in COMPARED:
        for task in TASKS:
            if (a, task) in by_seed and (b, task) in by_seed:
                mine, theirs = by_seed[a, task], by_seed[b, task]
                diffs = [mine[s] - theirs[s] for s in mine if s in theirs]
                mean = table[a][task]["mean"] - table[b][task]["mean"]
                table.setdefault(f"{a} − {b}", {})[task] = {
                    "mean": mean, "values": diffs, "interval": t_interval(diffs)}
    return table


def gather_sweep(args):
    """From raw/<scheme>_s<seed>.sweep.json: ({row name: {"<task> <zone>": spread over seeds of the
    accuracy pooled over the distances, "<task> <zone> answers": answers scored a checkpoint,
    "bound": [least, most]}}, {row name: {"<task> <d>": spread of the accuracy}})."""
    zones, curves, bounds = {}, {}, {}
    for scheme, row in raw_rows(args, ".sweep.json"):
        try:
            name, task = row_name(scheme, row), row["task"]
            for zone, (right, n) in row["zones"].items():
                by_ckpt = zones.setdefault(name, {}).setdefault(f"{task} {zone}", {})
                pooled = by_ckpt.setdefault(row["ckpt"], [0, 0])
                pooled[0], pooled[1] = pooled[0] + right, pooled[1] + n
            point = curves.setdefault(name, {}).setdefault(f"{task} {row['d']}", [])
            point.append(float(row["accuracy"]))
            bounds[name] = [row["reach_bound"], row["reach_bound_max"]]
        except (KeyError, TypeError, ValueError):
            continue
    table = {}
    for name, by_key in zones.items():
        table[name] = {}
        for key, v in by_key.items():
            table[name][key] = spread([r / n if n else None for r, n in v.values()])
        for key, v in by_key.items():
            table[name][f"{key} answers"] = next(iter(v.values()))[1]
        table[name]["bound"] = bounds[name]
    return table, spreads(curves)


def mqar_by_query(args, l):
    """{run: MQAR accuracy at each query, first to last}, at 1 x (the distances whose instance
    fits in l + 1 tokens, weighted alike) under plain causal attention, per checkpoint: a
    model that recalls is right at every query, one that picks among the values not yet
    asked for climbs as retrieval_tasks.by_elimination does. Rows scored before by_query existed, or
    damaged, are left out."""
    found = {}
    for scheme, row in raw_rows(args, ".tasks.json"):
        try:
            which = (row["task"], row["kind"], row_name(scheme, row))
            if which == ("mqar", "distance", scheme) and row["length"] <= l + 1 \
                    and "by_query" in row:
                run = Path(row["ckpt"]).parent.name
                found.setdefault(run, []).append([float(a) for a in row["by_query"]])
        except (KeyError, TypeError, ValueError):
            continue
    return {run: [sum(q) / len(q) for q in zip(*rows)] for run, rows in found.items()
            if len({len(r) for r in rows}) == 1}
