"""
reproduce.py --suite extension: the study's models (and one seed of the task suite's)
fine-tuned at 4l with PI, YaRN and no scaling, the jobs that score them against the zero-shot
methods, and the report that tables them.
"""

import os
from pathlib import Path

from alternatives import YARN_ALPHA, YARN_BETA
from lexgpt.cli import UserError
from study.files import check_outputs, check_raw, write_summary
from study.jobs import (
    FINE_TUNES,
    PY,
    RETRIEVAL_CONFIG,
    SEEDS,
    VARIANTS,
    Job,
    ckpt_flags,
    plan,
    prepare_job,
    read_result,
    scheme_settings,
    schemes_of,
    study_runs,
    train_job,
)
from study.report import machine_of, note, spread, wall_time
from study.tables import extension_markdown

# ------------------------------------------------------------------------------------------
# --suite extension: context extension by fine-tuning the study's models, against the
# zero-shot methods. RoPE is fine-tuned at 4l with PI and with YaRN (s = 4), xPos at 4l with
# no scaling (fine-tuning at a longer length helps any scheme, so xPos gets it too), each
# for the same budget (FINE_TUNE_BUDGETS).
EXTENSION_SOURCES = ("rope", "xpos", "alibi")
# The rules of each model (its perplexity and context probe alike): the sources zero-shot
# (RoPE + YaRN at inference too), the fine-tunes under causal attention with their own
# scaling (the checkpoint's, by default), and xPos with BCA past its new length too
EXTENSION_RULES = {
    "rope": ["--attention", "causal,bca", "--rope_scaling", "none,yarn"],
    "xpos": ["--attention", "causal,bca"],
    "alibi": ["--attention", "causal"],
    "rope_pi": ["--attention", "causal"],
    "rope_yarn": ["--attention", "causal"],
    "rope_yarn_tuned": ["--attention", "causal"],
    "xpos_long": ["--attention", "causal,bca"],
    "rope_more": ["--attention", "causal,bca"],
    "xpos_more": ["--attention", "causal,bca"],
}
# The fine-tuning budget: 50 iterations of 8 sequences of 4l = 512 tokens, 205k tokens, 5% of
# pre-training's 4.1M. YaRN's paper fine-tuned on about 0.1% of pre-training's tokens, which
# here is 2 iterations: too few to mean anything. The rate starts at pre-training's last
# (min_lr) after a short warmup and decays tenfold.
FINE_TUNE_BUDGETS = {
    "full": dict(multiple=4, batch_size=8, gradient_accumulation_steps=1, max_iters=50,
                 lr_decay_iters=50, warmup_iters=5, learning_rate=4e-4, min_lr=4e-5,
                 eval_interval=25, eval_iters=10, log_interval=5),
    "toy": dict(multiple=4, batch_size=2, gradient_accumulation_steps=1, max_iters=2,
                lr_decay_iters=2, warmup_iters=1, learning_rate=4e-4, min_lr=4e-5,
                eval_interval=2, eval_iters=1, log_interval=1),
}
# Claim 13's control: a fine-tune at 4l trains on more tokens as well as at a longer length, so
# each source is also fine-tuned at l itself, unscaled, on the same tokens (4 x the sequences
# of l): what it gains from the extra training alone
CONTROL_FINE_TUNES = ("rope_more", "rope"), ("xpos_more", "xpos")
# YaRN's ramp ends (alpha, beta: turns over l), tuned here: alternatives.py's defaults are
# LLaMA's (l = 2048, d = 128), while at the study's l = 128 and head dimension 32 the fastest
# pair turns 20.4 times, fewer than beta = 32, so every pair but the first is interpolated in
# part. Each pair of the grid is scored zero-shot at 4l with s = 4 on the rope sources, 3 seeds,
# on validation spans of length 4l (raw/yarn_tuning); the pair of least mean perplexity there is
# the one the tuned rows use (tuned_ends), planned once the sweep has run. At l = 128, d = 32
# these 15 pairs (alpha < beta) are 15 different ramps (beta = 16 would be beta = 32's: both
# end at pair 0).
YARN_GRID = [(a, b) for a in (0.25, 0.5, 1.0, 2.0) for b in (2.0, 4.0, 8.0, 32.0) if a < b]
EXTENSION_MULTIPLES = (1, 4, 8, 16)  # x l: to the fine-tuning length 4l and past it
EXTENSION_SPANS = {"full": "32", "toy": "1"}


def fine_tune_settings(args, budget, budgets=FINE_TUNE_BUDGETS):
    """train.py's settings of every fine-tune: the budget's (FINE_TUNE_BUDGETS, or the task
    suite's SUITE_FINE_TUNE_BUDGETS), block_size = multiple x l."""
    settings = dict(budgets[args.budget])
    settings["block_size"] = settings.pop("multiple") * budget["recipe"]["block_size"]
    return settings


def extra_tokens(settings):
    """The tokens a fine-tune with these settings trains on: iterations x sequences x length."""
    sequences = settings["batch_size"] * settings["gradient_accumulation_steps"]
    return settings["max_iters"] * sequences * settings["block_size"]


def extension_models(args, budget):
    """{model name: its checkpoints, in seed order}: the sources' study runs, the fine-tunes
    under runs/extension (the one with YaRN's tuned ends once they are chosen)."""
    runs = Path(args.runs)
    sources = [s for s in EXTENSION_SOURCES if s in budget["schemes"]]
    models = {}
    for scheme in sources:
        models[scheme] = [runs / f"{scheme}_s{seed}" / "ckpt.pt" for seed in SEEDS]
    tuned = [(n, s) for n, s, _ in FINE_TUNES + tuned_fine_tunes(args, budget)]
    for name, source in tuned + list(CONTROL_FINE_TUNES):
        if source in sources:
            models[name] = [runs / "extension" / f"{name}_s{seed}" / "ckpt.pt" for seed in SEEDS]
    return models


def tuned_fine_tunes(args, budget):
    """(name, source, train.py overrides) of the RoPE fine-tune at 4l with YaRN's tuned ends;
    none before the sweep has chosen them."""
    ends = tuned_ends(args, budget)
    if ends is None or ends == (YARN_ALPHA, YARN_BETA):  # LLaMA's ends: rope_yarn itself
        return ()
    return (("rope_yarn_tuned", "rope", dict(rope_scaling="yarn", rope_factor=4.0,
                                             yarn_alpha=ends[0], yarn_beta=ends[1])),)


def rescored(args, budget):
    """(name, the model whose checkpoints, rules) of the rows scored from another model's
    checkpoints under other flags (perplexity only): the YaRN fine-tunes past 4l with s that grows
    with the length from l (YaRN's dynamic scaling, RopeScaling.factor_at), beside their fixed
    s = 4; and, once chosen, zero-shot RoPE under YaRN's tuned ends."""
    dynamic = ["--attention", "causal", "--rope_scaling", "yarn"]
    rows = [("rope_yarn_dynamic", "rope_yarn", dynamic)]
    ends = tuned_ends(args, budget)
    if ends is not None and ends != (YARN_ALPHA, YARN_BETA):
        flags = ["--yarn_alpha", f"{ends[0]:g}", "--yarn_beta", f"{ends[1]:g}"]
        rows += [("rope_yarn_tuned_zero_shot", "rope", dynamic + flags),
                 ("rope_yarn_tuned_dynamic", "rope_yarn_tuned", dynamic)]
    return rows


def rescored_models(args, budget):
    """{name: (checkpoints, rules)} of the rescored rows whose model is among extension_models."""
    models = extension_models(args, budget)
    return {name: (models[model], rules) for name, model, rules in rescored(args, budget)
            if model in models}


def yarn_tuning_jobs(args, budget):
    """YARN_GRID's pairs, each scored zero-shot at 4l with s = 4 on the rope sources: the
    perplexity from which the tuned ends are chosen."""
    if "rope" not in budget["schemes"]:
        return []
    ckpts = [Path(args.runs) / f"rope_s{seed}" / "ckpt.pt" for seed in SEEDS]
    length = str(4 * budget["recipe"]["block_size"])
    jobs = []
    for alpha, beta in YARN_GRID:
        out = tuning_path(args, alpha, beta)
        jobs.append(Job(f"tune yarn a={alpha:g} b={beta:g}", "extrapolate", out,
                        [PY, "eval_extrapolate.py", *ckpt_flags(ckpts), "--data_dir",
                         str(Path(args.data)), "--device", args.device, "--attention", "causal",
                         "--rope_scaling", "yarn", "--rope_factor", "4", "--yarn_alpha",
                         f"{alpha:g}", "--yarn_beta", f"{beta:g}", "--lengths", length,
                         "--max_len", length, "--spans", EXTENSION_SPANS[args.budget],
                         "--json", str(out)], inputs=ckpts))
    return jobs


def tuning_path(args, alpha, beta):
    return Path(args.results) / "raw" / "yarn_tuning" / f"a{alpha:g}_b{beta:g}.ppl.json"


def yarn_grid(args, budget):
    """{"alpha,beta": spread of perplexity at 4l over the rope sources' seeds} of every pair of
    YARN_GRID, from raw/yarn_tuning; None until every pair is measured on this run's sources."""
    if "rope" not in budget["schemes"]:
        return None
    own = {os.path.normpath(Path(args.runs) / f"rope_s{seed}" / "ckpt.pt") for seed in SEEDS}
    grid = {}
    for alpha, beta in YARN_GRID:
        path = tuning_path(args, alpha, beta)
        rows = (read_result(path) or {}).get("rows", []) if path.exists() else []
        ppl = [r["ppl"] for r in rows if os.path.normpath(str(r["ckpt"])) in own]
        if len(ppl) != len(own):
            return None
        grid[f"{alpha:g},{beta:g}"] = spread(ppl)
    return grid


def tuned_ends(args, budget):
    """(alpha, beta) of least mean perplexity in the sweep (the first such pair of YARN_GRID),
    or None before the sweep has run."""
    grid = yarn_grid(args, budget)
    if grid is None:
        return None
    best = min(grid, key=lambda k: grid[k]["mean"])
    return tuple(float(x) for x in best.split(","))


def yarn_tuning(args, budget):
    """{"alpha", "beta", "chosen", "grid"}: the tuned ends and how they were chosen (None before
    the sweep has run)."""
    grid = yarn_grid(args, budget)
    if grid is None:
        return None
    alpha, beta = tuned_ends(args, budget)
    chosen = (f"the least mean perplexity at 4l (zero-shot, s = 4) over {len(SEEDS)} seeds of "
              f"{len(YARN_GRID)} pairs, alpha in {{0.25, 0.5, 1, 2}} and beta in {{2, 4, 8, 32}}, "
              "on the validation text the table is scored on")
    return {"alpha": alpha, "beta": beta, "chosen": chosen, "grid": grid}


def extension_plan(args, budget):
    """--suite extension: the study's data and its rope, xpos and alibi models (the study's own
    training jobs: a finished one is kept), the fine-tunes from them, then perplexity from l
    to 16l and the context probe at 16l of every model."""
    jobs = [prepare_job(args, Path(args.data))]
    for job in plan(args, budget):  # the study's own training jobs, not the passkey mix's
        if job.kind == "train" and not job.name.endswith("_passkey"):
            jobs.append(job)
    jobs += yarn_tuning_jobs(args, budget)
    jobs += fine_tune_jobs(args, budget) + extension_score_jobs(args, budget)
    return jobs + suite_jobs(args, budget)


def fine_tune_jobs(args, budget):
    """Every fine-tune, the controls at l first: claim 13's comparison rests on them (PI, whose
    rows the comparison needs least, last)."""
    models = extension_models(args, budget)
    overrides = {scheme: runs[0][3] for scheme, runs in study_runs(budget).items()}
    tuned = fine_tune_settings(args, budget)
    at_l = at_l_settings(tuned, budget)
    config = VARIANTS[args.variant]["config"]
    jobs = []
    fine_tunes = [(name, source, at_l, {}) for name, source in CONTROL_FINE_TUNES]
    fine_tunes += [(name, source, tuned, scaling)
                   for name, source, scaling in FINE_TUNES + tuned_fine_tunes(args, budget)]
    fine_tunes.sort(key=lambda f: f[0] == "rope_pi")
    for name, source, own, scaling in fine_tunes:
        if name not in models:  # its source is not among --schemes
            continue
        for seed, src, ckpt in zip(SEEDS, models[source], models[name]):
            # the source's model, then the fine-tune's own settings
            settings = dict(overrides[source], **budget["train"])
            settings.update(own, **scaling, seed=seed, init_from=str(src),
                            out_dir=str(ckpt.parent), data_dir=str(Path(args.data)),
                            device=args.device)
            jobs.append(train_job(f"fine-tune {name}_s{seed}", config, ckpt, settings,
                                  budget["recipe"], inputs=[src], max_iters=own["max_iters"]))
    return jobs


def at_l_settings(tuned, budget):
    """The control fine-tunes' settings: the fine-tune's, at block_size l with as many more
    sequences, so the same tokens an iteration."""
    l = budget["recipe"]["block_size"]
    multiple = tuned["block_size"] // l
    return dict(tuned, block_size=l, batch_size=tuned["batch_size"] * multiple)


def extension_score_jobs(args, budget):
    """Perplexity at l .. 16l and the context probe at 16l (beyond l, fine-tuned or not)."""
    l = budget["recipe"]["block_size"]
    raw = Path(args.results) / "raw"
    lengths = ",".join(str(m * l) for m in EXTENSION_MULTIPLES)
    spans = EXTENSION_SPANS[args.budget]
    scored = {name: (ckpts, EXTENSION_RULES[name])
              for name, ckpts in extension_models(args, budget).items()}
    scored.update(rescored_models(args, budget))
    scored = dict(sorted(scored.items(), key=lambda item: item[0] == "rope_pi"))
    jobs, contexts = [], []  # every perplexity first: the context probes take longer
    for name, (ckpts, rules) in scored.items():
        common = [*ckpt_flags(ckpts), "--data_dir", str(Path(args.data)),
                  "--device", args.device, *rules]
        ppl, context = raw / f"{name}.ppl.json", raw / f"{name}.context.json"
        jobs.append(Job(f"perplexity {name}", "extrapolate", ppl,
                        [PY, "eval_extrapolate.py", *common, "--lengths", lengths,
                         "--spans", spans, "--json", str(ppl)], inputs=ckpts))
        if name in EXTENSION_RULES:
            contexts.append(Job(f"context {name}", "context", context,
                                [PY, "study/eval_retrieval.py", *common, "--probe", "context",
                                 "--beyond", str(l), "--lengths",
                                 str(EXTENSION_MULTIPLES[-1] * l), "--sequences", spans,
                                 "--json", str(context)], inputs=ckpts))
    return jobs + contexts


# The suite part: the task suite's rope and xpos, one seed, fine-tuned the same way (at 4l,
# the same scalings) for the same share of their pre-training tokens, 5%: 400 iterations of
# 16 sequences of 512 tokens, 3.3M of the suite's 65.5M. The rate starts at the suite's
# min_lr and decays tenfold. Scored on copy, MQAR and the passkey at every distance of the
# task probe, within 4l and past it; the zero-shot rows are the same checkpoints (--task_runs).
SUITE_SEEDS = SEEDS[:1]
SUITE_SOURCES = ("rope", "xpos")
SUITE_TASKS = "copy,mqar,passkey"
SUITE_DISTANCES = (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16)  # x l, the task probe's own
SUITE_FINE_TUNE_BUDGETS = {
    "full": dict(multiple=4, batch_size=16, gradient_accumulation_steps=1, max_iters=400,
                 lr_decay_iters=400, warmup_iters=20, learning_rate=1.5e-4, min_lr=1.5e-5,
                 eval_interval=200, eval_iters=10, log_interval=50),
    "toy": FINE_TUNE_BUDGETS["toy"],
}
# The zero-shot rows of the suite's own results (raw/<scheme>.tasks.json, by label)
SUITE_ZERO_SHOT = {"rope": ("rope + BCA", "rope + yarn"), "xpos": ("xpos + BCA",),
                   "alibi": ("alibi",)}


def suite_models(args, budget):
    """{fine-tune name: its checkpoints}: the task suite's sources fine-tuned, under
    --task_runs/extension."""
    runs = Path(args.task_runs) / "extension"
    models = {}
    for name, source, _ in FINE_TUNES:
        if source in SUITE_SOURCES and source in budget["schemes"]:
            models[name] = [runs / f"{name}_s{seed}" / "ckpt.pt" for seed in SUITE_SEEDS]
    return models


def suite_jobs(args, budget):
    """The task data and the suite's sources (the task suite's own jobs: a finished one is
    kept), the task records again at 4l for the fine-tunes (train.py trains on records of its
    own block_size), the fine-tunes, and the task probe of each at the suite's distances."""
    task_budget = budget["task_budget"]
    recipe = task_budget["recipe"]
    l = recipe["block_size"]
    data, runs = Path(args.task_data), Path(args.task_runs)
    long_data = Path(f"{args.task_data}_{4 * l}")
    raw = Path(args.results) / "raw"
    jobs = []
    for folder, length, records in ((data, l, task_budget["records"]),
                                    (long_data, 4 * l, task_budget["records"] // 4)):
        name = "prepare task data" if length == l else f"prepare task data at {length}"
        jobs.append(Job(name, "prepare", folder / "meta.json",
                        [PY, "prepare_data.py", "--dataset", "task", "--tasks", "all",
                         "--block_size", str(length), "--records", str(records),
                         "--out_dir", str(folder)]))
    overrides = {}
    for name, settings, _ in schemes_of("retrieval"):
        overrides[name] = scheme_settings(settings, recipe)
    models = suite_models(args, budget)
    for source in [s for s in SUITE_ZERO_SHOT if s in budget["schemes"]]:
        for seed in SUITE_SEEDS:
            ckpt = runs / f"{source}_s{seed}" / "ckpt.pt"
            settings = dict(overrides[source], **task_budget["train"], seed=seed,
                            out_dir=str(ckpt.parent), data_dir=str(data), device=args.device)
            jobs.append(train_job(f"train suite {source}_s{seed}", RETRIEVAL_CONFIG, ckpt,
                                  settings, recipe, max_iters=recipe["max_iters"]))
    tuned = fine_tune_settings(args, task_budget, SUITE_FINE_TUNE_BUDGETS)
    # the suite's own distances (eval_retrieval.py's DISTANCES x l), not the fine-tune's, whose
    # block_size is 4l; lengths from 4l on, since the probe scores a length at half its l
    distances = ",".join(str(round(k * l)) for k in SUITE_DISTANCES)
    lengths = ",".join(str(k * l) for k in (4, 8, 16))
    task_probe = ["--data_dir", str(long_data), "--device", args.device, "--probe", "task",
                  "--task", SUITE_TASKS, "--distances", distances, "--lengths", lengths,
                  "--sequences", str(task_budget["sequences"])]
    zero_shot = [s for s in SUITE_ZERO_SHOT if s in budget["schemes"]]
    for source in zero_shot:  # the sources zero-shot, on the instances the fine-tunes get
        out = raw / f"{source}.tasks.json"
        ckpts = [runs / f"{source}_s{seed}" / "ckpt.pt" for seed in SUITE_SEEDS]
        jobs.append(Job(f"tasks {source}", "tasks", out,
                        [PY, "study/eval_retrieval.py", *ckpt_flags(ckpts), *task_probe,
                         *EXTENSION_RULES[source], "--json", str(out)], inputs=ckpts))
    for name, source, scaling in FINE_TUNES:
        if name not in models:
            continue
        for seed, ckpt in zip(SUITE_SEEDS, models[name]):
            src = runs / f"{source}_s{seed}" / "ckpt.pt"
            settings = dict(overrides[source], **task_budget["train"])
            settings.update(tuned, **scaling, seed=seed, init_from=str(src),
                            out_dir=str(ckpt.parent), data_dir=str(long_data),
                            device=args.device)
            jobs.append(train_job(f"fine-tune suite {name}_s{seed}", RETRIEVAL_CONFIG, ckpt,
                                  settings, recipe, inputs=[src],
                                  max_iters=tuned["max_iters"]))
        out = raw / f"{name}.tasks.json"
        jobs.append(Job(f"tasks {name}", "tasks", out,
                        [PY, "study/eval_retrieval.py", *ckpt_flags(models[name]), *task_probe,
                         *EXTENSION_RULES[name], "--json", str(out)],
                        inputs=models[name]))
    return jobs


def fine_tunes_and_scores(args, budget):
    """The extension's own jobs: its plan less the study's training jobs (the study counts
    those)."""
    jobs = extension_plan(args, budget)
    return [job for job in jobs if not job.name.startswith("train ")]


# ------------------------------------------------------------------------------------------
# The context extension


def extension_rows(args, budget, name, suffix):
    """The rows of raw/<name><suffix> measured on the model's own checkpoints
    (extension_models), each with its seed's place; the others are noted and left out."""
    path = Path(args.results) / "raw" / f"{name}{suffix}"
    result = read_result(path) if path.exists() else None
    models = extension_models(args, budget)
    ckpts = models[name] if name in models else rescored_models(args, budget)[name][0]
    own = {os.path.normpath(c): i for i, c in enumerate(ckpts)}
    rows = []
    for row in (result or {}).get("rows", []):
        where = own.get(os.path.normpath(str(row["ckpt"])))
        if where is None:
            note(f"note: {path}: the rows of {row['ckpt']} are left out: "
                 "not one of this suite's checkpoints")
            continue
        rows.append((where, row))
    return rows


def extension_report(args, budget, measured=True):
    """results/extension/summary.json and tables.md: each model and rule's extra training
    tokens, perplexity at each length and gain from context beyond its training length, mean
    ± std over seeds with each seed's value."""
    results = Path(args.results)
    check_outputs(results, "extension")
    check_raw(results)
    l = budget["recipe"]["block_size"]
    values = {}  # row name: column: {seed place: value}
    control = [name for name, _ in CONTROL_FINE_TUNES]
    model_of = {name: name for name in extension_models(args, budget)}
    model_of.update({name: model for name, model, _ in rescored(args, budget)
                     if name in rescored_models(args, budget)})
    for name, model in model_of.items():
        tuned = model not in EXTENSION_SOURCES
        prefix = "fine-tuned at 4l: " if tuned else "zero-shot: "
        if name in control:
            prefix = "fine-tuned at l (control): "
        for suffix, field in ((".ppl.json", "ppl"), (".context.json", "gain")):
            for seed, row in extension_rows(args, budget, name, suffix):
                value = row.get(field)
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                column = str(row["length"]) if field == "ppl" else "context gain"
                by_column = values.setdefault(prefix + row["label"], {})
                by_column.setdefault(column, {})[seed] = value
        tokens = extra_tokens(fine_tune_settings(args, budget)) if tuned else 0
        for label in [k for k in values if k.startswith(prefix)]:
            values[label].setdefault("extra tokens", {0: tokens})
    seeds = range(len(SEEDS))  # a seed without a value shows as "(n of N)"
    table = {}
    for row, columns in values.items():
        table[row] = {}
        for column, by_seed in columns.items():
            if column == "extra tokens":
                table[row][column] = spread(list(by_seed.values()))
            else:
                table[row][column] = spread([by_seed.get(s) for s in seeds])
    suite = suite_table(args, budget)
    if not values and not suite and any((results / "raw").glob("*.json")):
        raise UserError(f"--results {results}: no row of its raw/ was measured on this suite's "
                        f"checkpoints (under --runs {args.runs} and --task_runs "
                        f"{args.task_runs}; the notes above name theirs): give the --runs and "
                        "--task_runs of the run that measured them; nothing was written")
    task_budget = budget["task_budget"]
    fine_tune = fine_tune_settings(args, task_budget, SUITE_FINE_TUNE_BUDGETS)
    task_suite = {"recipe": task_budget["recipe"], "seeds": list(SUITE_SEEDS),
                  "runs": str(args.task_runs),  # a report's default --task_runs
                  "fine_tune": fine_tune, "extra_tokens": extra_tokens(fine_tune),
                  "table": suite}
    summary = {"suite": "extension", "budget": args.budget, "recipe": budget["recipe"],
               "fine_tune": fine_tune_settings(args, budget),
               "extra_tokens": extra_tokens(fine_tune_settings(args, budget)),
               "seeds": list(SEEDS),
               "lengths": [m * l for m in EXTENSION_MULTIPLES],
               "wall_time": wall_time(args, budget, fine_tunes_and_scores),
               "machine": machine_of(args, measured), "table": table, "task_suite": task_suite}
    yarn = yarn_tuning(args, budget)
    if yarn:
        summary["yarn"] = yarn
    summary = write_summary(results / "summary.json", summary)
    (results / "tables.md").write_text(extension_markdown(summary))
    print(f"wrote {results / 'tables.md'}")


def suite_rows(path, ckpt, labels=None):
    """The rows of one checkpoint in a task probe's raw result (by label, if given); the rows of
    another checkpoint are noted and left out."""
    result = read_result(path) if Path(path).exists() else None
    rows = []
    for row in (result or {}).get("rows", []):
        if os.path.normpath(str(row["ckpt"])) != os.path.normpath(str(ckpt)):
            note(f"note: {path}: the rows of {row['ckpt']} are left out: "
                 "not one of this suite's checkpoints")
        elif labels is None or row["label"] in labels:
            rows.append(row)
    return rows


def suite_table(args, budget):
    """{row: {task: {"within": acc, "past": acc}}}: each model's mean task accuracy over the
    task probe's distances up to the fine-tuning length 4l and past it, on the suite's first
    seed, zero-shot and fine-tuned, from this directory's raw/ alone."""
    l = budget["task_budget"]["recipe"]["block_size"]
    seed = SUITE_SEEDS[0]
    found = []  # (row name, rows)
    for scheme, labels in SUITE_ZERO_SHOT.items():
        if scheme not in budget["schemes"]:
            continue
        ckpt = Path(args.task_runs) / f"{scheme}_s{seed}" / "ckpt.pt"
        rows = suite_rows(Path(args.results) / "raw" / f"{scheme}.tasks.json", ckpt, labels)
        for label in labels:
            found.append((f"zero-shot: {label}", [r for r in rows if r["label"] == label]))
    for name, ckpts in suite_models(args, budget).items():
        rows = suite_rows(Path(args.results) / "raw" / f"{name}.tasks.json", ckpts[0])
        for label in dict.fromkeys(r["label"] for r in rows):
            found.append((f"fine-tuned at 4l: {label}", [r for r in rows if r["label"] == label]))
    table = {}
    for name, rows in found:
        cells = {}
        for task in SUITE_TASKS.split(","):
            by_distance = [r for r in rows if r["task"] == task and r["kind"] == "distance"]
            within = [r["accuracy"] for r in by_distance if r["d"] <= 4 * l]
            past = [r["accuracy"] for r in by_distance if r["d"] > 4 * l]
            if within or past:
                cells[task] = {"within": mean_or_none(within), "past": mean_or_none(past),
                               "distances": sorted(r["d"] for r in by_distance)}
        if cells:
            table[name] = cells
    return table


def mean_or_none(values):
    return sum(values) / len(values) if values else None
