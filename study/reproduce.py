"""
The small-scale study of the paper's claims, in one resumable command:

    python study/reproduce.py            # the whole study: data, training, evaluation, results/char
    python study/reproduce.py --plan     # the jobs and what is finished, without running anything
    python study/reproduce.py --report   # redraw the tables and plots from results/char alone
    python study/reproduce.py --variant gpt2 --device cuda   # GPT-2 BPE tokens, for a GPU
    python study/reproduce.py --budget toy --results /tmp/r --runs /tmp/o  # the pipeline in minutes

Every scheme trains on the same data with the same recipe (config/study_<variant>.py), token
budget and seeds; only the position scheme changes. Each trained model is then measured with
the repository's own scripts, run as subprocesses with the flags printed: eval_extrapolate.py
(the lex protocol, 1/4 to 16 x the training length, under causal attention, BCA, a sliding
window and sinks, and for RoPE and xPos PI, NTK, dynamic NTK and YaRN), resolution.py (Table 3
at 1 and 2 x the training length, with and without BCA, and Figure 2's theory curves) and
eval_retrieval.py (the repeat probe for every model and rule; passkey grids for RoPE, ALiBi and
xPos trained with the passkey mix). Finally the tables and plots are drawn from those JSON
files (report.py). What runs is planned in jobs.py.

Resumable: every job writes one file (JSON, or a checkpoint that has reached max_iters) and a
job whose file is there is skipped; a training run that was stopped resumes from its last
checkpoint, and a result older than one of its checkpoints (a run trained again) is measured
again. So the study can run in pieces. A checkpoint trained with other settings than those the
recipe's config file and overrides name is neither skipped nor resumed: reproduce.py stops
with a one-line error naming them, and the run directory must be moved aside. The results
directory records its recipe (recipe.json) and takes no results of another. Progress lines
carry an estimate of the time left, from the durations of the jobs finished so far (kept in
the results directory across pieces, timings.json). With the study finished, a run only
redraws the tables and plots; --report does just that from the results directory alone (a
checkout holds the results but neither the data nor the checkpoints).

One study at a time: on Linux a job dies with reproduce.py, even with a kill -9 of
reproduce.py alone (the kernel sends it SIGKILL: prctl's PR_SET_PDEATHSIG), so that no
orphaned train.py goes on writing a run that the study, run again, would start a second time;
the run resumes from its last checkpoint. A training job whose run directory another process
owns (train.py's lock on out_dir) is never started: reproduce.py stops with a one-line error
naming that process (it does not wait); run it again once that process has ended.
"""

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python study/reproduce.py`: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from lexgpt.checkpoint import load_checkpoint
from lexgpt.cli import ArgumentParser, UserError, die_with_parent, exit_interrupted
from lexgpt.outputs import OUTPUT_MARK, earlier_output, writable_dir, write_json
from lexgpt.run_dir import own_run_dir, release_run_dirs, run_dir_owner
from study.control import CONTROL_BUDGETS, CONTROL_MODELS, control_plan, control_report
from study.extension import EXTENSION_SOURCES, extension_plan, extension_report
from study.files import check_outputs, compact_raw
from study.jobs import (
    BUDGETS,
    NOT_RECIPE,
    PY,
    RETRIEVAL_BUDGETS,
    RETRIEVAL_CONFIG,
    SCHEMES,
    SEEDS,
    SUITES,
    TUNE_FACTORS,
    TUNE_SCHEMES,
    VARIANTS,
    Job,
    expected_seconds,
    plan,
    prepare_job,
    read_recipe,
    read_timings,
    retrieval_plan,
    scheme_settings,
    schemes_of,
    settings_text,
    train_job,
)
from study.report import report, retrieval_report
from study.tables import clock

HERE = Path(__file__).resolve().parents[1]  # the scripts and config files; the rest under the cwd
REPORTS = {"study": report, "retrieval": retrieval_report, "extension": extension_report,
           "control": control_report}
PLANS = {"study": plan, "retrieval": retrieval_plan, "extension": extension_plan,
         "control": control_plan}
RUNNING = None  # the name of the job running now, for Ctrl-C's line


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="study", choices=SUITES,
                   help="study: the paper's claims (the default); retrieval: the long-range "
                   "task suite (retrieval_tasks.py), results/retrieval; extension: the study's "
                   "models fine-tuned at 4l (RoPE with PI and YaRN, xPos) against zero-shot, "
                   "results/extension")
    p.add_argument("--variant", default="char", choices=tuple(VARIANTS),
                   help="char: Shakespeare characters on CPU; gpt2: GPT-2 BPE tokens "
                   "(config/study_gpt2.py), for a GPU")
    p.add_argument("--budget", choices=tuple(BUDGETS),
                   help="full (the default) or toy: a tiny model and a few iterations, to check "
                   "the pipeline end to end; --report: the results directory's own")
    p.add_argument("--results", help="tables, plots and JSON (default: results/VARIANT; toy: "
                   "out/study_VARIANT_toy/results)")
    p.add_argument("--runs", help="checkpoints (default: out/study_VARIANT[_toy])")
    p.add_argument("--data", help="prepared data (default: data/study_VARIANT; the passkey "
                   "mix goes to ..._passkey)")
    p.add_argument("--schemes", help="comma-separated: a part of the study (default: all of "
                   "it; the suite also has xpos_4layer)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--task_runs", help="--suite extension: the task suite's checkpoints, and "
                   "its fine-tunes under extension/ (default: out/retrieval[_toy])")
    p.add_argument("--task_data", help="--suite extension: the task suite's data (default: "
                   "data/task_char[_toy])")
    p.add_argument("--plan", action="store_true",
                   help="list the jobs and which are finished; run nothing")
    factors = ", ".join(f"{f:g}" for f in TUNE_FACTORS)
    p.add_argument("--tune", action="store_true",
                   help="instead of the study: the learning-rate check behind the recipe "
                   f"({', '.join(TUNE_SCHEMES)} at {factors} x its learning_rate), "
                   "results/VARIANT/tuning.json")
    p.add_argument("--report", action="store_true",
                   help="only redraw summary.json, tables.md and the plots from the results "
                   "directory (raw/, timings.json), running no job: for a checkout, which "
                   "holds the results but neither the data nor the checkpoints")
    p.add_argument("--verbose", action="store_true", help="show each job's own output")
    args = p.parse_args(argv)
    set_folders(args)
    return args


def set_folders(args):
    """The budget (--report: the one the results directory records) and the suite's default
    results, runs and data folders, where not given."""
    recorded = recorded_budget(args.results) if args.report and args.results else None
    if recorded and args.budget and args.budget != recorded:
        raise UserError(f"--results {args.results} holds the {recorded} budget's results, not "
                        f"--budget {args.budget}'s: give --budget {recorded}, or none")
    args.budget = args.budget or recorded or "full"
    toy = "_toy" if args.budget == "toy" else ""
    if args.suite != "study" and (args.variant != "char" or args.tune):
        if args.suite == "retrieval":
            raise UserError("--suite retrieval has its own data and recipe "
                            "(config/retrieval.py): --variant and --tune do not apply")
        if args.suite == "control":
            raise UserError("--suite control has its own corpus (numpy's sources, characters): "
                            "--variant and --tune do not apply")
        raise UserError("--suite extension fine-tunes the char study's models: --variant "
                        "and --tune do not apply")
    if args.suite == "retrieval":
        args.results = args.results or default_results("retrieval", toy)
        args.runs = args.runs or f"out/retrieval{toy}"
        args.data = args.data or f"data/task_char{toy}"
    if args.suite == "control":
        args.results = args.results or default_results("control", toy)
        args.runs = args.runs or f"out/control{toy}"
        args.data = args.data or "data/code_char"
    if args.suite == "extension":
        args.results = args.results or default_results("extension", toy)
        args.task_runs = (args.task_runs or recorded_task_runs(args.results)
                          or f"out/retrieval{toy}")
        args.task_data = args.task_data or f"data/task_char{toy}"
    elif args.task_runs or args.task_data:
        raise UserError("--task_runs and --task_data are for --suite "
                        "extension (its task-suite part)")
    if toy:
        args.results = args.results or f"out/study_{args.variant}_toy/results"
    args.results = args.results or f"results/{args.variant}"
    args.runs = args.runs or f"out/study_{args.variant}{toy}"
    args.data = args.data or f"data/study_{args.variant}"


def recorded(results, *keys):
    """What a results directory's summary.json records under keys (None when it does not)."""
    try:
        found = json.loads(Path(results, "summary.json").read_text(encoding="utf-8"))
        for key in keys:
            found = found[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found


def recorded_budget(results):
    found = recorded(results, "budget")
    return found if isinstance(found, str) and found in BUDGETS else None


def recorded_task_runs(results):
    """The task suite's checkpoints an extension results directory's rows were measured on."""
    found = recorded(results, "task_suite", "runs")
    return found if isinstance(found, str) else None


def recorded_schemes(results):
    """The schemes a task suite's results directory was drawn for."""
    found = recorded(results, "schemes")
    return list(found) if isinstance(found, dict) and found else None


def default_results(suite, toy):
    if toy:
        return f"out/{suite}_toy/results"
    return f"results/{suite}"


def budget_for(args):
    """The budget's settings, with the recipe its models train with: the config file and the
    budget's overrides."""
    if args.suite == "extension":
        known = list(EXTENSION_SOURCES)
    elif args.suite == "control":
        known = [name for name, _ in CONTROL_MODELS]
    else:
        known = [s for s, _, _ in schemes_of(args.suite)]
    schemes = args.schemes.split(",") if args.schemes is not None else known
    recorded = recorded_schemes(args.results) if args.report else None
    if args.schemes is None and recorded:  # a report draws the schemes its summary names
        schemes = [s for s in recorded if s in known]
    if not all(schemes):
        raise UserError(f"--schemes {args.schemes!r}: an empty name is not allowed; the "
                        f"{args.suite}'s schemes are " + ", ".join(known))
    unknown = set(schemes) - set(known)
    if unknown:
        raise UserError(f"--schemes {args.schemes}: unknown {', '.join(sorted(unknown))}; "
                        f"the {args.suite}'s schemes are " + ", ".join(known))
    if args.suite == "retrieval":
        budget = dict(RETRIEVAL_BUDGETS[args.budget], schemes=schemes, suite=args.suite)
        config = RETRIEVAL_CONFIG
    elif args.suite == "control":  # the study's recipe on the code corpus
        budget = dict(CONTROL_BUDGETS[args.budget], schemes=schemes, suite=args.suite)
        config = VARIANTS["char"]["config"]
    else:
        budget = dict(BUDGETS[args.budget], schemes=schemes, suite=args.suite)
        config = VARIANTS[args.variant]["config"]
    budget["recipe"] = dict(read_recipe(HERE / config), **budget["train"])
    if args.suite == "extension":  # its part on the task suite's models
        task_budget = dict(RETRIEVAL_BUDGETS[args.budget], suite="retrieval")
        task_recipe = read_recipe(HERE / RETRIEVAL_CONFIG)
        task_budget["recipe"] = dict(task_recipe, **task_budget["train"])
        budget["task_budget"] = task_budget
    return budget


def jobs_for(args, budget):
    """The suite's jobs (or --tune's), then its report: cheap, so always drawn again."""
    results = Path(args.results)
    if args.tune:
        return tune_plan(args, budget) + [Job("tuning table", "report", results / "tuning.json")]
    name = "extension table" if args.suite == "extension" else "tables and plots"
    jobs = PLANS[args.suite](args, budget)
    return jobs + [Job(name, "report", results / "summary.json")]


# ------------------------------------------------------------------------------------------
# The results directory's recipe


def results_recipe(args, recipe):
    """The recipe of the results directory's models: recipe.json, written by the first run
    into it (a directory from before recipe.json was written: its summary's or tuning
    table's recipe). A results directory holds one recipe's results, never two mixed: a run
    with other settings stops with a one-line error; --report (which may run on a checkout
    without the config that trained them) draws with the recorded one."""
    path = Path(args.results) / "recipe.json"
    recorded = recorded_recipe(path) if path.exists() else None
    for source in ("summary.json", "tuning.json"):
        source = Path(args.results) / source
        if recorded is None and source.exists():
            try:
                recorded = recorded_recipe(source)
            except UserError:  # a damaged summary is redrawn; only recipe.json binds
                continue
    if args.report:
        return recorded or recipe
    if recorded is not None:
        # max_iters counts here: a results directory holds finished models, all trained
        # to the same end
        keys = set(recipe) | set(recorded)
        differ = sorted(k for k in keys if (k not in NOT_RECIPE or k == "max_iters")
                        and recorded.get(k) != recipe.get(k))
        if differ:
            raise UserError(f"--results {args.results} holds results trained with "
                            f"{settings_text(differ, recorded)}, not this recipe's "
                            f"{settings_text(differ, recipe)}: give another --results")
    if not path.exists() and not args.plan:
        writable_dir(path.parent, "--results")
        write_json(path, recipe, quiet=True)
    return recipe


RECIPE_KEYS = ("block_size", "n_layer", "n_head", "n_embd", "max_iters", "learning_rate")
WHOLE_KEYS = RECIPE_KEYS[:-1]


def recorded_recipe(path):
    """The recipe recorded in a results directory's file (recipe.json itself, or a summary's
    "recipe"), checked: a JSON object of plain values naming at least the settings the
    tables are drawn with."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
        if path.name != "recipe.json":
            found = found.get("recipe")
        found = {k: v for k, v in found.items() if k not in OUTPUT_MARK}
    except (OSError, ValueError, AttributeError):
        found = None
    plain = (str, int, float, bool)
    if not found or any(k not in found for k in RECIPE_KEYS) \
            or not all(v is None or isinstance(v, plain) for v in found.values()):
        raise UserError(f"{path} is damaged (no recipe with block_size, n_layer, n_head, "
                        "n_embd, max_iters and learning_rate): write the settings its results "
                        "were trained with into recipe.json, or give another --results")
    bad = [k for k in WHOLE_KEYS if not is_whole(found[k])]
    lr = found["learning_rate"]
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0:
        bad.append("learning_rate")
    if bad or found["block_size"] % 2 or found["n_embd"] % found["n_head"]:
        what = ", ".join(f"{k}={found[k]!r}" for k in bad) or "its shape"
        raise UserError(f"{path} is damaged: {what} is not a recipe a model trains with (whole "
                        "numbers >= 1, an even block_size, n_embd divisible by n_head, a "
                        "positive learning_rate): write the settings its results were trained "
                        "with, or give another --results")
    return found


def is_whole(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ------------------------------------------------------------------------------------------
# --tune: the recipe's learning rate


def tune_plan(args, budget):
    """--tune: each of TUNE_SCHEMES trained (first seed) at each learning rate factor. The
    factor 1 runs are the study's own first-seed runs."""
    recipe, data = budget["recipe"], Path(args.data)
    overrides = {name: o for name, o, _ in SCHEMES}
    config = VARIANTS[args.variant]["config"]
    jobs = [prepare_job(args, data)]
    for scheme in TUNE_SCHEMES:
        for factor in TUNE_FACTORS:
            out_dir = tune_dir(args, budget, scheme, factor)
            settings = scheme_settings(overrides[scheme], recipe)
            settings.update(budget["train"], seed=SEEDS[0], out_dir=str(out_dir),
                            data_dir=str(data), device=args.device,
                            learning_rate=recipe["learning_rate"] * factor,
                            min_lr=recipe["min_lr"] * factor)
            name = f"tune {scheme} at {factor} x learning_rate"
            jobs.append(train_job(name, config, out_dir / "ckpt.pt", settings, recipe))
    return jobs


def tune_dir(args, budget, scheme, factor):
    """Factor 1 is the study's own first-seed run; the others are named by their learning
    rate, so that a changed recipe never reuses a run trained at another rate."""
    if factor == 1:
        return Path(args.runs) / f"{scheme}_s{SEEDS[0]}"
    lr = budget["recipe"]["learning_rate"] * factor
    return Path(args.runs) / f"tune/{scheme}_lr{lr:g}"



def tune_report(args, budget):
    """results/VARIANT/tuning.json and a table: each run's last validation loss (from its
    log.jsonl)."""
    lr = budget["recipe"]["learning_rate"]
    table = {}
    for scheme in TUNE_SCHEMES:
        for factor in TUNE_FACTORS:
            log = tune_dir(args, budget, scheme, factor) / "log.jsonl"
            entries = map(json.loads, log.read_text().splitlines())
            losses = [e["val_loss"] for e in entries if "val_loss" in e]
            table.setdefault(scheme, {})[f"{lr * factor:g}"] = losses[-1]
    write_json(Path(args.results) / "tuning.json", {"recipe": budget["recipe"], "val_loss": table})
    print("final validation loss by learning rate (first seed)\n")
    print("| scheme | " + " | ".join(f"lr {lr * f:g}" for f in TUNE_FACTORS) + " |")
    print("|---" * (len(TUNE_FACTORS) + 1) + "|")
    for scheme, row in table.items():
        print(f"| {scheme} | " + " | ".join(f"{v:.4f}" for v in row.values()) + " |")


# ------------------------------------------------------------------------------------------
# Running the jobs


def run_jobs(args, budget, jobs):
    """Run the jobs that are not finished, in order, with progress lines; with --plan only
    list them. Each job's duration goes to timings.json, for the estimates."""
    timings_path = Path(args.results) / "timings.json"
    timings = read_timings(timings_path)
    todo = [job for job in jobs if not job.done(budget["recipe"]["max_iters"])]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} jobs finished already; {len(todo)} to run")
    if args.plan:
        for job in jobs:
            mark = " " if job in todo else "x"
            what = f"writes {job.output}"
            if job.command:
                what = " ".join(job.command[1:])
            print(f"  [{mark}] {job.name}: {what}")
        return
    start = time.time()
    global RUNNING
    for i, job in enumerate(todo):
        RUNNING = job.name
        left = sum(expected_seconds(j, timings, args.budget) for j in todo[i:])
        print(f"\n[{i + 1}/{len(todo)}] {job.name} ({clock(time.time() - start)} so far, "
              f"about {clock(left)} left)", flush=True)
        began = time.time()
        if job.kind == "report":
            draw(args, budget, measured=i > 0)  # (the report comes last)
            share = 1
        else:
            share = run(args, budget, job)
        # a resumed training run: its whole duration, at the rate of the part measured
        seconds = (time.time() - began) / share
        timings[job.name] = dict(kind=job.kind, seconds=round(seconds, 1))
        write_json(timings_path, timings, quiet=True)
    print(f"\nall {len(jobs)} jobs are finished: {args.results} "
          f"({clock(time.time() - start)} in this piece)")


def draw(args, budget, measured):
    """The report of what has finished: the tuning table, or the suite's summary, tables and
    plots (measured: whether this run measured anything)."""
    if args.tune:
        tune_report(args, budget)
    else:
        REPORTS[args.suite](args, budget, measured)


def run(args, budget, job):
    """Run one job's command; returns the share of the job's work it did (a training run
    resumed from its checkpoint does only the rest)."""
    command = job.command[1:]
    share = 1
    if job.kind == "train":
        owner = run_dir_owner(job.output.parent)
        if owner:
            raise UserError(f"{job.name}: its run directory {job.output.parent} is in use by "
                            f"{owner}; run reproduce.py again once that process has ended "
                            "(finished jobs are kept)")
        if job.output.exists():  # stopped before max_iters: go on from its checkpoint
            command = command + ["--init_from=resume"]
            max_iters = job.max_iters or budget["recipe"]["max_iters"]
            resumed_at = load_checkpoint(job.output, mmap=True)["iter_num"]
            share = (max_iters - resumed_at) / max_iters
    elif job.kind != "prepare" and job.output.exists():
        if not earlier_output(job.output, plot=False):
            job.output.unlink()  # damaged, or unmarked: the script replaces only its own
    print("$ " + " ".join(command), flush=True)
    argv = [PY] + [script_path(a) for a in command]
    stdout = None if args.verbose else subprocess.DEVNULL
    # on Linux the kernel kills the job when this process dies, however it dies, so that no
    # job outlives the study (a run resumes from its last checkpoint)
    preexec = functools.partial(die_with_parent, os.getpid())
    with subprocess.Popen(argv, stdout=stdout, preexec_fn=preexec) as process:
        try:
            returncode = process.wait()
        except KeyboardInterrupt:
            stop_job(process)
            raise
    if returncode != 0:
        raise UserError(f"{job.name} failed (exit {returncode}); its command is above. "
                        "Finished jobs are kept: fix the cause and run reproduce.py again to go on")
    if job.output.parent == Path(args.results) / "raw":
        compact_raw(job.output)
    return share


def stop_job(process):
    """Ctrl-C: the job, in our process group, has its own Ctrl-C and stops with its one line (a
    run keeps its last checkpoint); a SIGINT sent to reproduce.py alone is passed on to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback here
    try:
        process.wait(timeout=2)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def script_path(arg):
    """A script of this repository by its full path (the study may run from another cwd)."""
    if arg.endswith(".py") and (HERE / arg).is_file():
        return str(HERE / arg)
    return arg


def main(argv=None):
    try:
        args = parse_args(argv)
        budget = budget_for(args)
        budget["recipe"] = results_recipe(args, budget["recipe"])
        # the rows of models trained at another block_size are left out
        args.block_size = budget["recipe"]["block_size"]
        if args.report:
            return redraw(args, budget)
        raw = Path(args.results, "raw")
        # the folders the check below makes, deepest first: --plan only looks, so they go again
        made = [p for p in (raw, *raw.parents) if not (p.exists() or p.is_symlink())]
        writable_dir(raw, "--results")
        if args.plan:
            for folder in made:
                folder.rmdir()
        if not args.plan:  # one study at a time in a results directory
            own_run_dir(args.results, "--results", "or give another --results")
        if not args.tune and not args.plan:  # another suite's results: refused before any job
            check_outputs(Path(args.results), args.suite)
        jobs = jobs_for(args, budget)
        run_jobs(args, budget, jobs)
        # a plan that grows as its jobs finish (the extension's rows under YaRN's tuned ends,
        # once its sweep has chosen them) is run again
        while not args.plan and [j.name for j in jobs_for(args, budget)] != [j.name for j in jobs]:
            jobs = jobs_for(args, budget)
            run_jobs(args, budget, jobs)
    except UserError as e:
        sys.exit(f"reproduce.py: error: {e}")
    except KeyboardInterrupt:
        exit_interrupted("reproduce.py", interrupted)
    finally:
        release_run_dirs()


def interrupted():
    """What Ctrl-C keeps: every finished job; the one running stopped."""
    if RUNNING is None:
        return "no job had started"
    return (f"{RUNNING} stopped; every finished job is kept (a training run keeps its last "
            "checkpoint): run reproduce.py again to go on")


def redraw(args, budget):
    """--report: the suite's summary, tables and plots from the results directory alone."""
    if args.tune or args.plan:
        raise UserError("--report redraws the study's tables alone: give it without --tune "
                        "and --plan")
    if not Path(args.results, "raw").is_dir():
        raise UserError(f"--report: {Path(args.results, 'raw')} does not exist; "
                        "nothing to draw from")
    own_run_dir(args.results, "--results", "or give another --results")
    REPORTS[args.suite](args, budget, measured=False)


if __name__ == "__main__":
    main()
