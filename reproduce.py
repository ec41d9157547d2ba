"""
The small-scale study of the paper's claims, in one resumable command:

    python reproduce.py                      # the whole study: data, training, evaluation, results/char
    python reproduce.py --plan               # the jobs and what is finished, without running anything
    python reproduce.py --report             # redraw the tables and plots from results/char alone
    python reproduce.py --variant gpt2 --device cuda   # GPT-2 BPE tokens, for a GPU (config/study_gpt2.py)
    python reproduce.py --budget toy --results /tmp/r --runs /tmp/o   # the whole pipeline in a minute or two

Every scheme trains on the same data with the same recipe (config/study_<variant>.py), token budget and seeds; only
the position scheme changes. Each trained model is then measured with the repository's own scripts, run as
subprocesses with the flags printed: eval_extrapolate.py (the lex protocol, 1/4 to 16 x the training length, under
causal attention, BCA, a sliding window and sinks, and for RoPE and xPos PI, NTK, dynamic NTK and YaRN),
resolution.py (Table 3 at 1 and 2 x the training length, with and without BCA, and Figure 2's theory curves) and
eval_retrieval.py (the repeat probe for every model and rule; passkey grids for RoPE, ALiBi and xPos trained with
the passkey mix). Finally the tables and plots are drawn from those JSON files.

Resumable: every job writes one file (JSON, or a checkpoint that has reached max_iters) and a job whose file is
there is skipped; a training run that was stopped resumes from its last checkpoint, and a result older than one of
its checkpoints (a run trained again) is measured again. So the study can run in pieces. A checkpoint trained with
other settings than those the recipe's config file and overrides name is neither skipped nor resumed: reproduce.py
stops with a one-line error naming them, and the run directory must be moved aside. The results directory records
its recipe (recipe.json) and takes no results of another. Progress lines carry an estimate of the time left, from
the durations of the jobs finished so far (kept in the results directory across pieces). With the study finished,
a run only redraws the tables and plots; --report does just that from the results directory alone (a checkout
holds the results but neither the data nor the checkpoints).

One study at a time: on Linux a job dies with reproduce.py, even with a kill -9 of reproduce.py alone (the kernel
sends it SIGKILL: prctl's PR_SET_PDEATHSIG), so that no orphaned train.py goes on writing a run that the study, run
again, would start a second time; the run resumes from its last checkpoint. A training job whose run directory
another process owns (train.py's lock on out_dir) is never started: reproduce.py stops with a one-line error naming
that process (it does not wait); run it again once that process has ended.

The results directory keeps each job's JSON compact (raw/): numbers rounded far below the printed decimals, one row
per line, and without the per-position curves that no table or plot here draws (eval_extrapolate.py's "curves",
resolution.py's s_hat, s_hat_heads and pairs); the scripts run by hand with --json still write them in full.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from configurator import run_config_file
from checkpoint import load_checkpoint
from cli import LIBC, ArgumentParser, UserError, die_with_parent
from outputs import OUTPUT_MARK, earlier_output, writable_dir, write_json
from run_dir import run_dir_owner
from retrieval_tasks import PAIR_COUNT, SPAN, TASKS, by_elimination

PY = sys.executable
HERE = Path(__file__).resolve().parent  # the scripts and config files; data, runs and results are under the cwd
SEEDS = (1337, 1338, 1339)
# (run name, train.py overrides, seeds). xPos's decay strength depends on block_size / scale_base: the paper trains
# 1024 tokens with scale_base 512, so zeta^(l / scale_base) at the window's edge is far below what the official
# default 512 gives at 128 tokens (nearly RoPE). "xpos" keeps the paper's ratio (scale_base = block_size / 2);
# "xpos_sb512" keeps the official constant. "xpos_norot" is Table 4's ablation: the decay without the rotation.
SCHEMES = (
    ("learned", dict(pos="learned"), 1),
    ("sinusoidal", dict(pos="sinusoidal"), 1),
    ("rope", dict(pos="rope"), 3),
    ("alibi", dict(pos="alibi"), 3),
    ("xpos", dict(pos="xpos", xpos_scale_base="half"), 3),
    ("xpos_norot", dict(pos="xpos", xpos_scale_base="half", xpos_rotate=False), 1),
    ("none", dict(pos="none"), 1),
    ("xpos_sb512", dict(pos="xpos", xpos_scale_base=512.0), 3),
)
# The task suite's schemes: the study's, and one deeper model, to see whether BCA's relay through the layers appears
# with depth (4 layers: a reach bound of 256 to 319 at l = 128, against 128 to 191 with the recipe's 2).
SUITE_SCHEMES = SCHEMES + (("xpos_4layer", dict(pos="xpos", xpos_scale_base="half", n_layer=4), 1),)


def schemes_of(suite):
    return SUITE_SCHEMES if suite == "retrieval" else SCHEMES


# --tune: the recipe's learning rate, chosen on the first three (the schemes most apart) and checked on the two that
# train worst under it, to see whether another rate would serve them better
TUNE_SCHEMES = ("learned", "rope", "xpos", "sinusoidal", "none")
TUNE_FACTORS = (0.5, 1, 2, 4)  # x the recipe's learning_rate (and min_lr)
PASSKEY_SCHEMES = ("rope", "alibi", "xpos")  # trained again on the passkey mix, one seed
INTERPOLATED = ("rope", "xpos", "xpos_sb512")  # PI, NTK, dynamic NTK and YaRN scale rotations only
WINDOW_RULES = "causal,bca,sliding,sinks"
SCALINGS = "pi,ntk,dynamic_ntk,yarn"
BOUNDED = ("learned",)  # no position past block_size exists
VARIANTS = {
    "char": dict(config="config/study_char.py", prepare=["--dataset", "shakespeare", "--tokenizer", "char"]),
    "gpt2": dict(config="config/study_gpt2.py", prepare=["--dataset", "shakespeare", "--tokenizer", "gpt2"]),
}
PASSKEY_MIX = ["--passkey", "0.5", "--passkey_tokens", "96"]
# train.py overrides, evaluation lengths (multiples of the training length l) and sizes. The interpolations are
# measured on a quarter of the text: dynamic NTK decodes token by token past l (a pass per token), which at full
# size took half the study's time, and the interpolations differ from each other and from BCA by far more than 1%.
# The repeat probe takes 32 sequences per distance (8 interpolated), which keeps the study within about 2.5 hours on
# 2 CPU cores; its standard error (about 0.01) stays far below the gain of a model that copies (near 1).
BUDGETS = {
    "full": dict(train={}, multiples=(0.25, 0.5, 1, 2, 4, 8, 16), spans="64", repeat_sequences=32, scaled_spans="16",
                 scaled_sequences=8, passkey_sequences=20, texts=8, context_spans=64),
    "toy": dict(train=dict(max_iters=2, lr_decay_iters=2, warmup_iters=1, n_layer=2, n_head=2, n_embd=16,
                           block_size=16, batch_size=2, gradient_accumulation_steps=1, eval_iters=1, eval_interval=2,
                           log_interval=1),
                multiples=(0.25, 1, 2, 4), spans="2", repeat_sequences=2, scaled_spans="2", scaled_sequences=2,
                passkey_sequences=1, texts=1, context_spans=1),
}
# Compact raw results: the fields dropped (per-position curves that no table or plot reads), and the significant
# digits kept: 10 move a mean over seeds by about 1e-10 of itself, far below the 2-3 decimals the tables print, and
# leave the plots drawn from these files unchanged to the pixel (at 7, Figure 2's theory curves already move).
RAW_DROPPED = ("curves", "s_hat", "s_hat_heads", "pairs")
RAW_DIGITS = 10
GUESS_SECONDS = dict(prepare=10, train=300, extrapolate=240, scalings=240, resolution=20, theory=5, repeat=120,
                     repeat_scaled=120, passkey=300, tasks=300, context=200, sweep=900,
                     report=10)  # until a job of the kind has run here
# --suite retrieval (tasks.py): every scheme trained on the long-range task suite with config/retrieval.py, the same
# seeds as the study (three for the schemes the claims compare, one for learned, sinusoidal, none and xPos without
# rotation: three each would take the suite past its 3-hour budget on 2 cores), then eval_retrieval.py --probe task
# under every rule and, for the rotary schemes, every interpolation.
SUITES = ("study", "retrieval", "extension")
# The sweep, where the windows act: the three retrieval tasks under the three window rules (plain causal attention
# past 2l is another question, extrapolation; flip-flop and the passkey's second filler are left out for time)
SWEEP_TASKS, SWEEP_RULES = "copy,mqar,passkey", "bca,sliding,sinks"
RETRIEVAL_CONFIG = "config/retrieval.py"
RETRIEVAL_BUDGETS = {
    "full": dict(train={}, records=200000, sequences=32, sweep_sequences=128),
    "toy": dict(train=dict(max_iters=2, lr_decay_iters=2, warmup_iters=1, n_layer=1, n_head=2, n_embd=16,
                           block_size=96, batch_size=2, eval_iters=1, eval_interval=2, log_interval=1),
                records=50, sequences=2, sweep_sequences=2),
}


class Job:
    """One step of the study: a command that writes `output` (or a Python function, for the report), from the
    checkpoints in `inputs`."""

    def __init__(self, name, kind, output, command=None, action=None, inputs=(), settings=None, max_iters=None):
        self.name, self.kind, self.output, self.command, self.action = name, kind, Path(output), command, action
        self.inputs = [Path(p) for p in inputs]
        self.settings = settings  # a training job's: what train.py will run with (recipe file and overrides)
        self.max_iters = max_iters  # a training job's own, where it is not the recipe's (a fine-tune's)

    def done(self, max_iters=None):
        max_iters = self.max_iters or max_iters
        if self.kind == "train":
            if not self.output.exists():
                return False
            newer = [p for p in self.inputs if p.exists() and p.stat().st_mtime > self.output.stat().st_mtime]
            if newer:  # a fine-tune whose source was trained again since
                raise UserError(f"{self.name}: {self.output} was fine-tuned from an earlier {newer[0]}; move "
                                f"{self.output.parent} aside to fine-tune it again")
            checkpoint = load_checkpoint(self.output, mmap=True)
            self.check_recipe(checkpoint["config"], checkpoint["iter_num"], max_iters)
            return checkpoint["iter_num"] >= max_iters
        if self.kind == "report":
            return False  # cheap: always redrawn from whatever is finished
        # as make does: a result older than one of its checkpoints (a run trained again) is measured again, and so
        # is one that does not read as a result (damaged): as if missing. So is one whose checkpoint is missing: this
        # run trains it, and the result (of another checkpoint) would otherwise stand beside the new ones
        return self.output.exists() and all(p.exists() and self.output.stat().st_mtime >= p.stat().st_mtime
                                            for p in self.inputs) and (self.kind == "prepare"
                                                                       or read_result(self.output))

    def check_recipe(self, trained, iter_num, max_iters):
        """A checkpoint trained with other settings than this job's (those its config file and overrides name) is
        neither finished nor resumed: either would put two recipes in one table. Settings that leave the weights as
        they are do not count; nor does max_iters, since a run stopped early and resumed trains as one that was not
        (the schedule is lr_decay_iters'), unless it went past this job's."""
        differ = [k for k, v in (self.settings or {}).items() if k not in NOT_RECIPE and trained.get(k) != v]
        if differ:
            was, now = settings_text(differ, trained), settings_text(differ, self.settings)
            raise UserError(f"{self.name}: {self.output} was trained with {was}, not this recipe's {now}; move "
                            f"{self.output.parent} aside (or give another --runs) to train it again")
        if self.settings and iter_num > max_iters:
            raise UserError(f"{self.name}: {self.output} was trained to iteration {iter_num}, past this recipe's "
                            f"max_iters={max_iters}; move {self.output.parent} aside (or give another --runs) to "
                            "train it again")


# Settings that do not change the weights trained: where the run and its data lie (the data's folder is not compared:
# which records it holds is the prepare job's), the device, compilation, and how often it is evaluated and logged
# (batches are drawn from (seed, iteration) alone).
NOT_RECIPE = ("out_dir", "data_dir", "device", "compile", "max_iters", "eval_interval", "eval_iters", "log_interval",
              "init_from")  # (a fine-tune resumed records init_from=resume; its source is in its checkpoint's "init")


def settings_text(keys, settings):
    return ", ".join(f"{k}={settings[k]!r}" if k in settings else f"{k} not recorded" for k in keys)


def results_recipe(args, recipe):
    """The recipe of the results directory's models: recipe.json, written by the first run into it (a directory from
    before recipe.json was written: its summary's or tuning table's recipe). A results directory holds one recipe's
    results, never two mixed: a run with other settings stops with a one-line error; --report (which may run on a
    checkout without the config that trained them) draws with the recorded one."""
    path = Path(args.results) / "recipe.json"
    recorded = recorded_recipe(path) if path.exists() else None
    for source in (Path(args.results) / "summary.json", Path(args.results) / "tuning.json"):
        if recorded is None and source.exists():
            try:
                recorded = recorded_recipe(source)
            except UserError:  # a damaged summary is redrawn, as before recipe.json existed; only recipe.json binds
                continue
    if args.report:
        return recorded or recipe
    # max_iters counts here: a results directory holds finished models, all trained to the same end
    differ = sorted(k for k in set(recipe) | set(recorded or {}) if (k not in NOT_RECIPE or k == "max_iters")
                    and recorded is not None and recorded.get(k) != recipe.get(k))
    if differ:
        was, now = settings_text(differ, recorded), settings_text(differ, recipe)
        raise UserError(f"--results {args.results} holds results trained with {was}, not this recipe's {now}: give "
                        "another --results")
    if not path.exists() and not args.plan:
        writable_dir(path.parent, "--results")
        write_json(path, recipe, quiet=True)
    return recipe


def recorded_recipe(path):
    """The recipe recorded in a results directory's file (recipe.json itself, or a summary's "recipe"), checked: a
    JSON object of plain values naming at least the settings the tables are drawn with."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
        found = found if path.name == "recipe.json" else found.get("recipe")
        found = {k: v for k, v in found.items() if k not in OUTPUT_MARK}
    except (OSError, ValueError, AttributeError):
        found = None
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1
    if not found or any(k not in found for k in ("block_size", "n_layer", "n_head", "n_embd", "max_iters",
                                                  "learning_rate")) or not all(
            v is None or isinstance(v, (str, int, float, bool)) for v in found.values()):
        raise UserError(f"{path} is damaged (no recipe with block_size, n_layer, n_head, n_embd, max_iters and "
                        "learning_rate): write the settings its results were trained with into recipe.json, or give "
                        "another --results")
    bad = [k for k in ("block_size", "n_layer", "n_head", "n_embd", "max_iters") if not whole(found[k])]
    bad += [] if isinstance(found["learning_rate"], (int, float)) and not isinstance(found["learning_rate"], bool) \
        and found["learning_rate"] > 0 else ["learning_rate"]
    if bad or found["block_size"] % 2 or found["n_embd"] % found["n_head"]:
        raise UserError(f"{path} is damaged: {', '.join(f'{k}={found[k]!r}' for k in bad) or 'its shape'} is not a "
                        "recipe a model trains with (whole numbers >= 1, an even block_size, n_embd divisible by "
                        "n_head, a positive learning_rate): write the settings its results were trained with, or "
                        "give another --results")
    return found


def read_result(path):
    """A job's JSON result, or None when it is missing, unreadable or not shaped as one (rows of an evaluation, modes
    of a resolution, the theory's curves): a damaged result counts as missing, and is measured again."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    has = lambda items, *keys: isinstance(items, list) and all(isinstance(x, dict) and all(k in x for k in keys)
                                                               for x in items)
    shaped = isinstance(result, dict) and ("rows" in result and has(result["rows"], "ckpt", "pos", "label")
                                           or "modes" in result and has(result["modes"], "label", "R", "R_shared")
                                           and "pos" in result or has([result.get("rope"), result.get("xpos")], "g"))
    return result if shaped else None


def read_recipe(path):
    """The recipe file's settings, as train.py's configurator reads them."""
    return {k: v for k, v in run_config_file(path).items() if not k.startswith("_") and not isinstance(v, ModuleType)}


def study_runs(budget):
    """{scheme: [(run name, seed, passkey?, train.py overrides)]} for every model the study trains."""
    recipe = budget["recipe"]
    runs = {}
    for name, overrides, n_seeds in schemes_of(budget.get("suite")):
        if name not in budget["schemes"]:
            continue
        overrides = scheme_settings(overrides, recipe)
        runs[name] = [(f"{name}_s{seed}", seed, False, overrides) for seed in SEEDS[:n_seeds]]
        if name in PASSKEY_SCHEMES:
            runs[name].append((f"{name}_passkey", SEEDS[0], True, overrides))
    return runs


def scheme_settings(overrides, recipe):
    """A scheme's train.py overrides, "half" read as half the training length (xPos's default scale_base)."""
    return {k: (recipe["block_size"] / 2 if v == "half" else v) for k, v in overrides.items()}


def train_job(name, config_file, ckpt, settings, recipe, **kw):
    """A train.py job: the config file, then each setting as --key=value; the recipe guard compares the recipe with
    those settings over it (Job.check_recipe)."""
    return Job(name, "train", ckpt, [PY, "train.py", config_file] + [f"--{k}={v}" for k, v in settings.items()],
               settings=dict(recipe, **settings), **kw)


def prepare_job(args, data, extra=()):
    name = "prepare passkey data" if extra else "prepare data"
    return Job(name, "prepare", Path(data) / "meta.json",
               [PY, "prepare_data.py", *VARIANTS[args.variant]["prepare"], *extra, "--out_dir", str(data)])


def plan(args, budget):
    """Every job, in the order they run: the data, then per scheme its training runs and their measurements (one
    job per scheme where a script takes several checkpoints), then the passkey models and their grids, then the
    tables."""
    variant, recipe = VARIANTS[args.variant], budget["recipe"]
    l = recipe["block_size"]
    data, raw = Path(args.data), Path(args.results) / "raw"
    device = ["--device", args.device]
    passkey_jobs = []  # the passkey models, trained and measured after the rest
    jobs = [prepare_job(args, data), prepare_job(args, f"{data}_passkey", PASSKEY_MIX)]
    for suffix, scale_base in (("", l / 2), ("_sb512", 512.0)):  # Figure 2 for both of the study's xPos settings
        jobs.append(Job(f"Figure 2 theory, scale_base {scale_base:g}", "theory", raw / f"theory{suffix}.json",
                        [PY, "resolution.py", "--theory", "--head_dim", str(recipe["n_embd"] // recipe["n_head"]),
                         "--scale_base", str(scale_base), "--max_dist", str(16 * l),
                         "--json", str(raw / f"theory{suffix}.json"),
                         "--plot", str(Path(args.results) / f"figure2_theory{suffix}.png")]))
    for scheme, runs in study_runs(budget).items():
        ckpts = {run: Path(args.runs) / run / "ckpt.pt" for run, _, _, _ in runs}
        for run, seed, passkey, overrides in runs:
            settings = dict(overrides, **budget["train"], seed=seed, out_dir=str(ckpts[run].parent),
                            data_dir=f"{data}_passkey" if passkey else str(data), device=args.device)
            train = train_job(f"train {run}", variant["config"], ckpts[run], settings, recipe)
            (passkey_jobs if passkey else jobs).append(train)
        # learned positions stop at block_size (the model refuses more): that scheme is measured up to l only
        bounded = scheme in BOUNDED
        lengths = ",".join(str(n) for n in study_lengths(budget) if n <= l or not bounded)
        distances = ["--distances", ",".join(str(d) for d in (0, l // 8, l // 4, l // 2))] if bounded else []
        seeded = [a for run, _, passkey, _ in runs if not passkey for a in ("--ckpt", str(ckpts[run]))]
        common = ["--data_dir", str(data), *device]
        out = lambda what: ["--json", str(raw / f"{scheme}.{what}.json")]
        mine = [p for run, p in ckpts.items() if not run.endswith("_passkey")]
        jobs.append(Job(f"perplexity {scheme}", "extrapolate", raw / f"{scheme}.ppl.json",
                        [PY, "eval_extrapolate.py", *seeded, *common, "--lengths", lengths, "--spans",
                         budget["spans"], "--attention", WINDOW_RULES, *out("ppl")], inputs=mine))
        if scheme in INTERPOLATED:
            jobs.append(Job(f"interpolation {scheme}", "scalings", raw / f"{scheme}.scaled.json",
                            [PY, "eval_extrapolate.py", *seeded, *common, "--lengths", lengths, "--spans",
                             budget["scaled_spans"], "--attention", "causal", "--rope_scaling", "none," + SCALINGS,
                             *out("scaled")],
                            inputs=mine))
        for run, _, passkey, _ in runs:
            for m in (1, 2) if not passkey and not bounded else (1,) if not passkey else ():
                jobs.append(Job(f"resolution {run} at {m}l", "resolution", raw / f"{run}.resolution{m}.json",
                                [PY, "resolution.py", "--ckpt", str(ckpts[run]), *common, "--length", str(m * l),
                                 "--bca", "both", "--texts", str(budget["texts"]),
                                 "--json", str(raw / f"{run}.resolution{m}.json")], inputs=[ckpts[run]]))
        probe = [PY, "eval_retrieval.py", *seeded, *common, "--probe", "repeat", "--span", str(l // 4), *distances]
        jobs.append(Job(f"repeat probe {scheme}", "repeat", raw / f"{scheme}.repeat.json",
                        [*probe, "--sequences", str(budget["repeat_sequences"]), "--attention", WINDOW_RULES,
                         *out("repeat")], inputs=mine))
        if scheme in INTERPOLATED:
            jobs.append(Job(f"repeat probe {scheme}, interpolated", "repeat_scaled",
                            raw / f"{scheme}.repeat_scaled.json",
                            [*probe, "--sequences", str(budget["scaled_sequences"]), "--attention", "causal",
                             "--rope_scaling", "none," + SCALINGS, *out("repeat_scaled")],
                            inputs=mine))
        if not bounded:  # is context beyond l used? (learned positions have none)
            jobs.append(Job(f"context {scheme}", "context", raw / f"{scheme}.context.json",
                            [PY, "eval_retrieval.py", *seeded, *common, "--probe", "context", "--lengths",
                             str(study_lengths(budget)[-1]), "--sequences", str(budget["context_spans"]),
                             "--attention", WINDOW_RULES, *out("context")], inputs=mine))
        if scheme in PASSKEY_SCHEMES:
            passkey_jobs.append(Job(f"passkey {scheme}", "passkey", raw / f"{scheme}.passkey.json",
                                    [PY, "eval_retrieval.py", "--ckpt", str(ckpts[f"{scheme}_passkey"]), *common,
                                     "--probe", "passkey", "--lengths", ",".join(map(str, passkey_lengths(budget))),
                                     "--attention", WINDOW_RULES, "--sequences", str(budget["passkey_sequences"]),
                                     *out("passkey"), "--plot", str(Path(args.results) / f"passkey_{scheme}.png")],
                                    inputs=[ckpts[f"{scheme}_passkey"]]))
    jobs += passkey_jobs
    jobs.append(Job("tables and plots", "report", Path(args.results) / "summary.json",
                    action=lambda measured: report(args, budget, measured)))
    return jobs


def study_lengths(budget):
    return [max(1, int(m * budget["recipe"]["block_size"])) for m in budget["multiples"]]


def passkey_lengths(budget):
    """The evaluation lengths from l on that hold a passkey document (at least the training documents' length)."""
    shortest = int(PASSKEY_MIX[PASSKEY_MIX.index("--passkey_tokens") + 1])
    l = budget["recipe"]["block_size"]
    return [n for n in study_lengths(budget) if n >= l and n >= shortest] or [shortest]


def tune_plan(args, budget):
    """--tune: each of TUNE_SCHEMES trained (first seed) at each learning rate factor, then a table of the final
    validation losses. The factor 1 runs are the study's own first-seed runs."""
    recipe, data = budget["recipe"], Path(args.data)
    jobs = [prepare_job(args, data)]
    overrides = {name: o for name, o, _ in SCHEMES}
    for scheme in TUNE_SCHEMES:
        for factor in TUNE_FACTORS:
            out_dir = tune_dir(args, budget, scheme, factor)
            settings = scheme_settings(overrides[scheme], recipe)
            settings.update(budget["train"], seed=SEEDS[0], out_dir=str(out_dir), data_dir=str(data),
                            device=args.device, learning_rate=recipe["learning_rate"] * factor,
                            min_lr=recipe["min_lr"] * factor)
            jobs.append(train_job(f"tune {scheme} at {factor} x learning_rate", VARIANTS[args.variant]["config"],
                                  out_dir / "ckpt.pt", settings, recipe))
    jobs.append(Job("tuning table", "report", Path(args.results) / "tuning.json",
                    action=lambda measured: tune_report(args, budget)))
    return jobs


def tune_dir(args, budget, scheme, factor):
    """Factor 1 is the study's own first-seed run; the others are named by their learning rate, so that a changed
    recipe never reuses a run trained at another rate."""
    lr = budget["recipe"]["learning_rate"] * factor
    return Path(args.runs) / (f"{scheme}_s{SEEDS[0]}" if factor == 1 else f"tune/{scheme}_lr{lr:g}")


def tune_report(args, budget):
    """results/tuning.json and a table: each run's last validation loss (from its log.jsonl)."""
    lr = budget["recipe"]["learning_rate"]
    table = {}
    for scheme in TUNE_SCHEMES:
        for factor in TUNE_FACTORS:
            log = tune_dir(args, budget, scheme, factor) / "log.jsonl"
            losses = [e["val_loss"] for e in map(json.loads, log.read_text().splitlines()) if "val_loss" in e]
            table.setdefault(scheme, {})[f"{lr * factor:g}"] = losses[-1]
    write_json(Path(args.results) / "tuning.json", {"recipe": budget["recipe"], "val_loss": table})
    print("final validation loss by learning rate (first seed)\n")
    print("| scheme | " + " | ".join(f"lr {lr * f:g}" for f in TUNE_FACTORS) + " |\n"
          + "|---" * (len(TUNE_FACTORS) + 1) + "|")
    for scheme, row in table.items():
        print(f"| {scheme} | " + " | ".join(f"{v:.4f}" for v in row.values()) + " |")


def retrieval_plan(args, budget):
    """--suite retrieval: the task records, then per scheme its training runs and one eval_retrieval.py job over
    its seeds (every rule; for the rotary schemes every interpolation too), then the tables."""
    recipe = budget["recipe"]
    data, raw = Path(args.data), Path(args.results) / "raw"
    jobs = [Job("prepare task data", "prepare", data / "meta.json",
                [PY, "prepare_data.py", "--dataset", "task", "--tasks", "all", "--block_size",
                 str(recipe["block_size"]), "--records", str(budget["records"]), "--out_dir", str(data)])]
    for scheme, runs in study_runs(budget).items():
        runs = [r for r in runs if not r[2]]  # no passkey mix here: the suite has its own passkey
        ckpts = [Path(args.runs) / run / "ckpt.pt" for run, _, _, _ in runs]
        for (run, seed, _, overrides), ckpt in zip(runs, ckpts):
            settings = dict(overrides, **budget["train"], seed=seed, out_dir=str(ckpt.parent), data_dir=str(data),
                            device=args.device)
            jobs.append(train_job(f"train {run}", RETRIEVAL_CONFIG, ckpt, settings, recipe))
        scalings = ["--rope_scaling", "none," + SCALINGS] if scheme in INTERPOLATED else []
        jobs.append(Job(f"tasks {scheme}", "tasks", raw / f"{scheme}.tasks.json",
                        [PY, "eval_retrieval.py", *[a for c in ckpts for a in ("--ckpt", str(c))], "--data_dir",
                         str(data), "--device", args.device, "--probe", "task", "--sequences",
                         str(budget["sequences"]), "--attention", WINDOW_RULES, *scalings,
                         "--json", str(raw / f"{scheme}.tasks.json")], inputs=ckpts))
        if scheme not in BOUNDED:  # BCA, the windows and sinks where they act, every phase (learned stops at l)
            jobs.append(Job(f"sweep {scheme}", "sweep", raw / f"{scheme}.sweep.json",
                            [PY, "eval_retrieval.py", *[a for c in ckpts for a in ("--ckpt", str(c))], "--data_dir",
                             str(data), "--device", args.device, "--probe", "task", "--sweep", "--task",
                             SWEEP_TASKS, "--sequences", str(budget["sweep_sequences"]), "--attention",
                             SWEEP_RULES, "--json", str(raw / f"{scheme}.sweep.json")], inputs=ckpts))
    jobs.append(Job("tables and plots", "report", Path(args.results) / "summary.json",
                    action=lambda measured: retrieval_report(args, budget, measured)))
    return jobs


# ---------------------------------------------------------------------------------------------------------------
# --suite extension: context extension by fine-tuning the study's models, against the zero-shot methods. RoPE is
# fine-tuned at 4l with PI and with YaRN (s = 4), xPos at 4l with no scaling (fine-tuning at a longer length helps any
# scheme, so xPos gets it too), each for the same budget (FINE_TUNE_BUDGETS).
FINE_TUNES = (  # (name, source scheme, train.py overrides)
    ("rope_pi", "rope", dict(rope_scaling="pi", rope_factor=4.0)),
    ("rope_yarn", "rope", dict(rope_scaling="yarn", rope_factor=4.0)),
    ("xpos_long", "xpos", {}),
)
EXTENSION_SOURCES = ("rope", "xpos", "alibi")
# (perplexity flags, context probe rules) of each model: the sources zero-shot under their rules (RoPE + YaRN at
# inference too), the fine-tunes under causal attention with their own scaling (the checkpoint's, by default), and
# xPos with BCA past its new length too
ROPE_ZERO_SHOT = ["--attention", "causal,bca", "--rope_scaling", "none,yarn"]
EXTENSION_RULES = {name: (flags, flags) for name, flags in (
    ("rope", ROPE_ZERO_SHOT), ("xpos", ["--attention", "causal,bca"]), ("alibi", ["--attention", "causal"]),
    ("rope_pi", ["--attention", "causal"]), ("rope_yarn", ["--attention", "causal"]),
    ("xpos_long", ["--attention", "causal,bca"]))}
# The fine-tuning budget: 50 iterations of 8 sequences of 4l = 512 tokens, 205k tokens, 5% of pre-training's 4.1M.
# YaRN's paper fine-tuned on about 0.1% of pre-training's tokens, which here is 2 iterations: too few to mean anything.
# The rate starts at pre-training's last (min_lr) after a short warmup and decays tenfold.
FINE_TUNE_BUDGETS = {
    "full": dict(multiple=4, batch_size=8, gradient_accumulation_steps=1, max_iters=50, lr_decay_iters=50,
                 warmup_iters=5, learning_rate=4e-4, min_lr=4e-5, eval_interval=25, eval_iters=10, log_interval=5),
    "toy": dict(multiple=4, batch_size=2, gradient_accumulation_steps=1, max_iters=2, lr_decay_iters=2,
                warmup_iters=1, learning_rate=4e-4, min_lr=4e-5, eval_interval=2, eval_iters=1, log_interval=1),
}
EXTENSION_MULTIPLES = (1, 4, 8, 16)  # x l: the evaluation lengths, to the fine-tuning length 4l and past it
EXTENSION_SPANS = {"full": "32", "toy": "1"}


def fine_tune_settings(args, budget):
    """train.py's settings of every fine-tune: FINE_TUNE_BUDGETS with block_size = multiple x l."""
    settings = dict(FINE_TUNE_BUDGETS[args.budget])
    settings["block_size"] = settings.pop("multiple") * budget["recipe"]["block_size"]
    return settings


def extra_tokens(args, budget):
    """The tokens a fine-tune trains on: iterations x sequences x length."""
    s = fine_tune_settings(args, budget)
    return s["max_iters"] * s["batch_size"] * s["gradient_accumulation_steps"] * s["block_size"]


def extension_models(args, budget):
    """{model name: its checkpoints, in seed order}: the sources' study runs, the fine-tunes under runs/extension."""
    runs, sources = Path(args.runs), [s for s in EXTENSION_SOURCES if s in budget["schemes"]]
    models = {scheme: [runs / f"{scheme}_s{seed}" / "ckpt.pt" for seed in SEEDS] for scheme in sources}
    models.update({name: [runs / "extension" / f"{name}_s{seed}" / "ckpt.pt" for seed in SEEDS]
                   for name, source, _ in FINE_TUNES if source in sources})
    return models


def extension_plan(args, budget):
    """--suite extension: the study's data and its rope, xpos and alibi models (the study's own training jobs: a
    finished one is kept), the fine-tunes from them, then perplexity from l to 16l and the context probe at 16l of
    every model, then the table."""
    recipe, l = budget["recipe"], budget["recipe"]["block_size"]
    data, raw = Path(args.data), Path(args.results) / "raw"
    models = extension_models(args, budget)
    jobs = [prepare_job(args, data)]  # then the study's own training jobs of the sources (not the passkey mix)
    jobs += [job for job in plan(args, budget) if job.kind == "train" and not job.name.endswith("_passkey")]
    overrides = {scheme: runs[0][3] for scheme, runs in study_runs(budget).items()}
    tuned = fine_tune_settings(args, budget)
    for name, source, scaling in FINE_TUNES:
        if name not in models:  # its source is not among --schemes
            continue
        for seed, src, ckpt in zip(SEEDS, models[source], models[name]):
            settings = dict(overrides[source], **budget["train"])  # the source's model, then the fine-tune's own
            settings.update(tuned, **scaling, seed=seed, init_from=str(src), out_dir=str(ckpt.parent),
                            data_dir=str(data), device=args.device)
            jobs.append(train_job(f"fine-tune {name}_s{seed}", VARIANTS[args.variant]["config"], ckpt, settings,
                                  recipe, inputs=[src], max_iters=tuned["max_iters"]))
    lengths = ",".join(str(m * l) for m in EXTENSION_MULTIPLES)
    for name, ckpts in models.items():
        flags, rules = EXTENSION_RULES[name]
        common = [a for c in ckpts for a in ("--ckpt", str(c))] + ["--data_dir", str(data), "--device", args.device]
        jobs.append(Job(f"perplexity {name}", "extrapolate", raw / f"{name}.ppl.json",
                        [PY, "eval_extrapolate.py", *common, *flags, "--lengths", lengths, "--spans",
                         EXTENSION_SPANS[args.budget], "--json", str(raw / f"{name}.ppl.json")], inputs=ckpts))
        jobs.append(Job(f"context {name}", "context", raw / f"{name}.context.json",  # beyond l, fine-tuned or not
                        [PY, "eval_retrieval.py", *common, *rules, "--probe", "context", "--beyond", str(l),
                         "--lengths", str(EXTENSION_MULTIPLES[-1] * l), "--sequences", EXTENSION_SPANS[args.budget],
                         "--json", str(raw / f"{name}.context.json")], inputs=ckpts))
    jobs.append(Job("extension table", "report", Path(args.results) / "summary.json",
                    action=lambda measured: extension_report(args, budget, measured)))
    return jobs


def fine_tunes_and_scores(args, budget):
    """The extension's own jobs: its plan less the study's training jobs it reuses (the study counts those)."""
    return [job for job in extension_plan(args, budget) if not job.name.startswith("train ")]


def extension_rows(args, budget, name, suffix):
    """The rows of raw/<name><suffix> measured on the model's own checkpoints (extension_models), each with its
    seed's place; the others are noted and left out."""
    path = Path(args.results) / "raw" / f"{name}{suffix}"
    result = read_result(path) if path.exists() else None
    own = {os.path.normpath(c): i for i, c in enumerate(extension_models(args, budget)[name])}
    rows = []
    for row in (result or {}).get("rows", []):
        where = own.get(os.path.normpath(str(row["ckpt"])))
        if where is None:
            note = f"note: {path}: the rows of {row['ckpt']} are left out: not one of this suite's checkpoints"
            if note not in NOTED:
                NOTED.add(note)
                print(note)
            continue
        rows.append((where, row))
    return rows


def extension_report(args, budget, measured=True):
    """results/extension/summary.json and tables.md: each model and rule's extra training tokens, perplexity at each
    length and gain from context beyond its training length, mean ± std over seeds with each seed's value."""
    results = Path(args.results)
    check_outputs(results, "extension")
    check_raw(results)
    ran_on = None if measured else previous_machine(results / "summary.json")
    l = budget["recipe"]["block_size"]
    values = {}  # row name: column: {seed place: value}
    for name in extension_models(args, budget):
        tuned = name not in EXTENSION_SOURCES
        prefix = "fine-tuned at 4l: " if tuned else "zero-shot: "
        for suffix, column_of, field in ((".ppl.json", lambda r: str(r["length"]), "ppl"),
                                         (".context.json", lambda r: "context gain", "gain")):
            for seed, row in extension_rows(args, budget, name, suffix):
                value = row.get(field)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    values.setdefault(prefix + row["label"], {}).setdefault(column_of(row), {})[seed] = value
        for label in [k for k in values if k.startswith(prefix)]:
            values[label].setdefault("extra tokens", {0: extra_tokens(args, budget) if tuned else 0})
    seeds = range(len(SEEDS))  # a seed without a value shows as "(n of N)"
    table = {row: {column: spread(list(by_seed.values()) if column == "extra tokens" else
                                  [by_seed.get(s) for s in seeds]) for column, by_seed in columns.items()}
             for row, columns in values.items()}
    summary = {"suite": "extension", "budget": args.budget, "recipe": budget["recipe"],
               "fine_tune": fine_tune_settings(args, budget), "extra_tokens": extra_tokens(args, budget),
               "seeds": list(SEEDS), "lengths": [m * l for m in EXTENSION_MULTIPLES],
               "wall_time": wall_time(args, budget, fine_tunes_and_scores), "machine": ran_on or machine(args.device),
               "table": table}
    write_summary(results / "summary.json", summary)
    summary = json.loads((results / "summary.json").read_text())  # what the table shows is what the file holds
    (results / "tables.md").write_text(extension_markdown(summary))
    print(f"wrote {results / 'tables.md'}")


def extension_markdown(summary):
    """The extension's table from its summary.json."""
    l, tuned, wall = summary["recipe"]["block_size"], summary["fine_tune"], summary["wall_time"]
    head = (f"Context extension: the study's models (training length l = {l}, seeds "
            f"{', '.join(map(str, summary['seeds']))}) zero-shot, and fine-tuned at {tuned['block_size']} tokens for "
            f"{tuned['max_iters']} iterations of {tuned['batch_size'] * tuned['gradient_accumulation_steps']} "
            f"sequences ({summary['extra_tokens']:,} tokens, learning rate {tuned['learning_rate']:g} to "
            f"{tuned['min_lr']:g}); {summary['budget']} budget, wall time {clock(wall['seconds'])} "
            f"({wall['measured']} of its {wall['jobs']} jobs measured), on {summary['machine']}.\n")
    columns = [str(n) for n in summary["lengths"]]
    lines = ["### Perplexity against length (lex protocol) and the gain from context beyond l (the context probe at "
             "16l, nats per token), mean ± std over seeds [each seed]",
             "", "| model | extra tokens | " + " | ".join(columns) + " | context gain beyond l |",
             "|---" * (len(columns) + 3) + "|"]
    for name, row in summary["table"].items():
        tokens = row.get("extra tokens")
        tokens = f"{int(tokens['mean']):,}" if tokens else "–"
        lines.append(f"| {name} | {tokens} | " + " | ".join(cell(row.get(c), 3) for c in columns)
                     + f" | {cell(row.get('context gain'), 4)} |")
    return head + "\n" + "\n".join(lines) + "\n"


def check_outputs(results, suite):
    """Before a report writes anything: the results directory holds this suite's raw results, not the other's, and
    every file the report writes that is already there is one a report wrote (summary.json marked, tables.md with its
    heading, plots by their signature); anything else is refused with one line and kept."""
    others = {"study": [("tasks", "the task suite's (raw/*.tasks.json): give --suite retrieval"),
                        *((f"{name}.ppl", f"the context extension's (raw/{name}.ppl.json): give --suite extension")
                          for name, _, _ in FINE_TUNES)],
              "retrieval": [("ppl", "the study's (raw/*.ppl.json): drop --suite retrieval")],
              "extension": [("tasks", "the task suite's (raw/*.tasks.json): give --suite retrieval"),
                            ("repeat", "the study's (raw/*.repeat.json): drop --suite extension")]}[suite]
    for kind, whose in others:
        if any((results / "raw").glob(f"*.{kind}.json") if "." not in kind else (results / "raw").glob(f"{kind}.json")):
            raise UserError(f"--results {results} holds {whose}")
    names = {"study": ["summary.json", "tables.md", "perplexity.png", "effective_context.png"],
             "retrieval": ["summary.json", "tables.md", *(f"{p}{t}.png" for t in TASKS for p in ("", "sweep_"))],
             "extension": ["summary.json", "tables.md"]}[suite]
    for name in names:
        path = results / name
        if not (path.exists() or path.is_symlink()):
            continue
        ours = earlier_output(path, plot=name.endswith(".png")) if not name.endswith(".md") else \
            not path.is_symlink() and path.is_file() and path.read_bytes()[:40].startswith(
                (b"Study: ", b"Long-range task suite: ", b"Context extension: "))
        if not ours:
            raise UserError(f"{path} exists and is not one a report of reproduce.py wrote: refusing to replace it; "
                            "move it aside, or give another --results")


def retrieval_report(args, budget, measured=True):
    """The suite's summary.json, then tables.md and one plot per task drawn from it alone."""
    results = Path(args.results)
    check_outputs(results, "retrieval")
    check_raw(results)
    ran_on = None if measured else previous_machine(results / "summary.json")
    panels = {}
    by_distance = lambda r: r["kind"] == "distance"
    reach = gather(args, ".tasks.json", lambda r: r["task"] if by_distance(r) else None,
                   lambda r: r["retrieval_reach"], panels)
    for key, field in (("{} at 1x", "accuracy_1x"), ("{} bound", "reach_bound")):
        for name, by_key in gather(args, ".tasks.json", lambda r: key.format(r["task"]) if by_distance(r) else None,
                                   lambda r: r[field]).items():
            reach.setdefault(name, {}).update(by_key)
    curves = gather(args, ".tasks.json",
                    lambda r: f"{r['task']} {r['kind']} {r['d'] if by_distance(r) else r['length']}",
                    lambda r: r["accuracy"])
    summary = {"suite": "retrieval", "budget": args.budget, "recipe": budget["recipe"], "seeds": list(SEEDS),
               "wall_time": wall_time(args, budget, retrieval_plan), "machine": ran_on or machine(args.device),
               "tasks": list(TASKS), "reach": reach, "accuracy": curves, "panels": panels,
               "mqar_by_query": mqar_by_query(args, budget["recipe"]["block_size"]),
               "area": gather_area(args)}
    sweep, sweep_curves = gather_sweep(args)
    if sweep:  # (a suite scored before the sweep existed has none)
        summary.update(sweep=sweep, sweep_accuracy=sweep_curves)
    write_summary(results / "summary.json", summary)
    summary = json.loads((results / "summary.json").read_text())
    (results / "tables.md").write_text(retrieval_markdown(summary))
    for task in summary["tasks"]:
        plot_task(summary, task, results / f"{task}.png")
        if any(k.startswith(f"{task} ") for row in summary.get("sweep_accuracy", {}).values() for k in row):
            plot_task(summary, task, results / f"sweep_{task}.png", sweep=True)
    print(f"wrote {results / 'tables.md'}")


def raw_rows(args, suffix):
    """(scheme, row) for every row of raw/<scheme><suffix> that reads as a result (a damaged file is noted by
    check_raw and left out) and was measured on this study's own checkpoints (scheme_rows)."""
    for scheme, _, _ in SUITE_SCHEMES:  # (the study's are among them)
        for row in scheme_rows(args, scheme, suffix):
            yield scheme, row


NOTED = set()  # the notes scheme_rows has printed: each once, however many tables read the file


def scheme_rows(args, scheme, suffix):
    """The rows of raw/<scheme><suffix> (none where it is missing or damaged) measured on the scheme's checkpoints
    under --runs, at the results' block_size where the checkpoint is there to say: rows of another results directory's
    models (a file copied in) would otherwise be averaged in as more seeds. The rows left out are noted."""
    path = Path(args.results) / "raw" / f"{scheme}{suffix}"
    rows = ((read_result(path) if path.exists() else None) or {}).get("rows", [])
    runs = [f"{scheme}_s{seed}" for seed in SEEDS] + [f"{scheme}_passkey"]
    own = {os.path.normpath(Path(args.runs) / run / "ckpt.pt") for run in runs}
    l, foreign = getattr(args, "block_size", None), {}
    for ckpt in {row["ckpt"] for row in rows if isinstance(row["ckpt"], str)}:
        if os.path.normpath(ckpt) not in own:
            foreign[ckpt] = f"not one of {args.runs}/{scheme}_s<seed>/ckpt.pt (give the --runs it was measured with)"
        elif l is not None and Path(ckpt).is_file():
            try:
                trained = load_checkpoint(ckpt, mmap=True, verify=())["config"].get("block_size", l)
            except UserError:  # unreadable: it cannot say, and the result stands as measured
                trained = l
            if trained != l:
                foreign[ckpt] = f"trained at block_size {trained}, not the results' {l}"
    for ckpt, why in sorted(foreign.items()):
        note = f"note: {path}: the rows of {ckpt} are left out of the tables: {why}"
        if note not in NOTED:
            NOTED.add(note)
            print(note)
    return [row for row in rows if isinstance(row["ckpt"], str) and row["ckpt"] not in foreign]


def area(curve, rng=None, draws=1):
    """The area under accuracy against log2 distance over the grid, divided by its width: the mean accuracy over
    log distance, every cell counted (curve: sorted [(d, accuracy, instances)]). With a numpy Generator, `draws`
    areas with each cell's accuracy drawn again as a binomial share of its instances (the bootstrap over instances;
    taking an instance as all right or all wrong makes the interval wider than the truth, never narrower)."""
    import numpy as np
    d, acc, n = (np.array(x, dtype=float) for x in zip(*curve))
    acc = acc[None] if rng is None else rng.binomial(n.astype(int), np.clip(acc, 0, 1), (draws, len(n))) / n
    x = np.log2(d)
    found = ((acc[:, 1:] + acc[:, :-1]) / 2 * np.diff(x)).sum(1) / (x[-1] - x[0])
    return float(found[0]) if rng is None else found


def t_interval(values):
    """The 95% t interval of the mean of a few values (None for one): for paired differences over seeds, whose
    spread already holds each seed's instance noise."""
    import numpy as np
    if len(values) < 2:
        return None
    t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}.get(
        len(values), 2.262)  # Student's t, 97.5%, n - 1 degrees (past 10 values, 9 degrees': wider, never narrower)
    half = t * float(np.std(values, ddof=1)) / len(values) ** 0.5
    return [float(np.mean(values)) - half, float(np.mean(values)) + half]


def gather_area(args, draws=2000):
    """{row name: {task: spread of area over seeds, "<task> interval": bootstrap over seeds and instances,
    "<task> paired": spread of the row's area minus its scheme's plain causal row on the same checkpoints, and
    "<task> paired interval": its t interval over seeds}} from the distance grid of raw/<scheme>.tasks.json."""
    import numpy as np
    curves = {}
    for scheme, row in raw_rows(args, ".tasks.json"):
        try:
            if row["kind"] == "distance":
                units = {"copy": SPAN, "mqar": PAIR_COUNT}.get(row["task"], 1)  # answers per instance
                curves.setdefault((row_name(scheme, row), scheme, row["task"]), {}).setdefault(row["ckpt"], []).append(
                    (int(row["d"]), float(row["accuracy"]), max(1, int(row["n"]) // units)))
        except (KeyError, TypeError, ValueError):
            continue
    table, replicates = {}, {}
    for (name, scheme, task), by_ckpt in curves.items():
        by_ckpt = {c: sorted(v) for c, v in by_ckpt.items() if len(v) > 1}
        if not by_ckpt:
            continue
        plain = curves.get((scheme, scheme, task), {}) if name != scheme else {}
        paired = [area(by_ckpt[c]) - area(sorted(plain[c])) for c in by_ckpt if len(plain.get(c, ())) > 1]
        rng = np.random.default_rng(0)
        drawn = np.stack([area(v, rng, draws) for v in by_ckpt.values()])  # (checkpoints, draws)
        picks = rng.integers(0, len(drawn), (len(drawn), draws))  # seeds drawn with replacement, per draw
        total = replicates[name, task] = drawn[picks, np.arange(draws)].mean(0)
        row = table.setdefault(name, {})
        row[task] = spread([area(v) for v in by_ckpt.values()])
        row[f"{task} interval"] = [float(np.quantile(total, 0.025)), float(np.quantile(total, 0.975))]
        if paired:
            row[f"{task} paired"], row[f"{task} paired interval"] = spread(paired), t_interval(paired)
    for a, b in COMPARED:  # other models: the difference of the means, its interval from independent replicates
        for task in TASKS:
            if (a, task) in replicates and (b, task) in replicates:
                diff = replicates[a, task] - replicates[b, task]
                table.setdefault(f"{a} − {b}", {})[task] = {
                    "mean": table[a][task]["mean"] - table[b][task]["mean"],
                    "interval": [float(np.quantile(diff, 0.025)), float(np.quantile(diff, 0.975))]}
    return table


# Schemes compared by area (different models, the same data and seeds): xPos's decay against RoPE, and under YaRN
COMPARED = (("xpos", "rope"), ("xpos_sb512", "rope"), ("alibi", "rope"), ("xpos + yarn", "rope + yarn"),
            ("xpos_sb512 + yarn", "rope + yarn"), ("xpos_sb512 + yarn", "xpos + yarn"))


def gather_sweep(args):
    """From raw/<scheme>.sweep.json: ({row name: {"<task> <zone>": spread over seeds of the accuracy pooled over the
    distances, "<task> <zone> answers": answers scored a checkpoint, "bound": [least, most]}}, {row name:
    {"<task> <d>": spread of the accuracy}})."""
    zones, curves, counts, bounds = {}, {}, {}, {}
    for scheme, row in raw_rows(args, ".sweep.json"):
        try:
            name, task = row_name(scheme, row), row["task"]
            for zone, (right, n) in row["zones"].items():
                pooled = zones.setdefault(name, {}).setdefault(f"{task} {zone}", {}).setdefault(row["ckpt"], [0, 0])
                pooled[0], pooled[1] = pooled[0] + right, pooled[1] + n
            curves.setdefault(name, {}).setdefault(f"{task} {row['d']}", []).append(float(row["accuracy"]))
            bounds[name] = [row["reach_bound"], row["reach_bound_max"]]
        except (KeyError, TypeError, ValueError):
            continue
    table = {}
    for name, by_key in zones.items():
        table[name] = {key: spread([r / n if n else None for r, n in v.values()]) for key, v in by_key.items()}
        table[name].update({f"{key} answers": next(iter(v.values()))[1] for key, v in by_key.items()})
        table[name]["bound"] = bounds[name]
    return table, {name: {k: spread(v) for k, v in row.items()} for name, row in curves.items()}


def mqar_by_query(args, l):
    """{run: MQAR accuracy at each query, first to last}, at 1 x (the distances whose instance fits in l + 1 tokens,
    weighted alike) under plain causal attention, per checkpoint: a model that recalls is right at every query, one
    that picks among the values not yet asked for climbs as tasks.by_elimination does. Rows scored before by_query
    existed, or damaged, are left out."""
    found = {}
    for scheme, row in raw_rows(args, ".tasks.json"):
        try:
            if (row["task"], row["kind"], row_name(scheme, row)) == ("mqar", "distance", scheme) \
                    and row["length"] <= l + 1 and "by_query" in row:
                found.setdefault(Path(row["ckpt"]).parent.name, []).append([float(a) for a in row["by_query"]])
        except (KeyError, TypeError, ValueError):
            continue
    return {run: [sum(q) / len(q) for q in zip(*rows)] for run, rows in found.items()
            if len({len(r) for r in rows}) == 1}


def retrieval_markdown(summary):
    """The suite's tables from summary.json: retrieval reach per model and task, then accuracy by distance and by
    total length per task."""
    l, wall = summary["recipe"]["block_size"], summary["wall_time"]
    head = (f"Long-range task suite: {summary['budget']} budget, training length l = {l}, seeds "
            f"{', '.join(map(str, summary['seeds']))} (three for rope, alibi, xpos, xpos_sb512; one for the others); "
            f"wall time {clock(wall['seconds'])} ({wall['measured']} of its {wall['jobs']} jobs measured), on "
            f"{summary['machine']}.\n")
    names = summary["tasks"]
    reach = {name: {task: row.get(task) for task in names} | {"bound": next(
        (row[f"{t} bound"] for t in names if row.get(f"{t} bound")), None)} for name, row in summary["reach"].items()}
    at_1x = {name: {task: row.get(f"{task} at 1x") for task in names} for name, row in summary["reach"].items()}
    tables = [head, markdown("Retrieval reach (tokens; the largest distance up to which accuracy stays >= 90% of that "
                             "at 1 x, mean ± std over seeds; \"n of N\": only n checkpoints retrieve at 1 x) and the "
                             "rule's reach bound", reach, [*names, "bound"], digits=0),
              markdown("Accuracy at 1 x (mean over the distances whose whole instance fits in a training record, "
                       "l + 1 tokens)", at_1x, names)]
    by_query = summary.get("mqar_by_query") or {}
    if by_query:
        n = len(next(iter(by_query.values())))
        rows = {"picking among the values not yet asked for": by_elimination(n), **by_query}
        tables.append(markdown("mqar: accuracy by query, 1st to last, at 1 x under causal attention, per checkpoint",
                               {name: {str(i + 1): spread([a]) for i, a in enumerate(row)}
                                for name, row in rows.items()}, [str(i + 1) for i in range(n)], header="run"))
    tables += area_markdown(summary.get("area") or {}, names)
    tables += sweep_markdown(summary.get("sweep") or {}, summary.get("sweep_accuracy") or {}, names, l)
    for task in names:
        for kind in ("distance", "length"):
            table = {name: {int(k.split()[-1]): v for k, v in row.items() if k.startswith(f"{task} {kind} ")}
                     for name, row in summary["accuracy"].items()}
            table = {name: row for name, row in table.items() if row}
            columns = sorted({c for row in table.values() for c in row})
            if table:
                tables.append(markdown(f"{task}: accuracy by {kind}" + (
                    f" (the answers at distance {l // 2} or the task's shortest)" if kind == "length" else ""),
                    {n: {str(c): v for c, v in row.items()} for n, row in table.items()}, [str(c) for c in columns]))
    return "\n".join(tables)


def area_markdown(table, names):
    """Per task: the area under accuracy against log distance, with its interval, and paired with the plain causal
    row of the same checkpoints."""
    out = []
    differences = {name: row for name, row in table.items() if " − " in name}
    if differences:
        lines = ["### Area under accuracy against log2 distance: one scheme minus another (different models, the same "
                 "data and seeds), with the 95% bootstrap interval over seeds and instances", "",
                 "| difference | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for name, row in differences.items():
            lines.append(f"| {name} | " + " | ".join(f"{row[t]['mean']:.2f} {interval(row[t]['interval'], 2)}"
                                                   if t in row else "–" for t in names) + " |")
        out.append("\n".join(lines) + "\n")
    for task in names:
        rows = {name: row for name, row in table.items() if row.get(task) and " − " not in name}
        if not rows:
            continue
        lines = [f"### {task}: area under accuracy against log2 distance (the mean accuracy over log distance, every "
                 "cell of the grid counted), mean ± std over seeds [each seed], 95% bootstrap interval over seeds and "
                 "instances; paired: minus the plain causal row of the same checkpoints, with its 95% t interval "
                 "over seeds", "",
                 "| model | area | 95% interval | paired difference | 95% interval |", "|---|---|---|---|---|"]
        for name, row in rows.items():
            lines.append(f"| {name} | {cell(row[task])} | {interval(row.get(f'{task} interval'), 2)} | "
                         f"{cell(row.get(f'{task} paired'))} | {interval(row.get(f'{task} paired interval'), 2)} |")
        out.append("\n".join(lines) + "\n")
    return out


def sweep_markdown(sweep, curves, names, l):
    """Per task: accuracy where the rule acts by zone (direct, relay, beyond) with the reach bound's range, then by
    distance on the sweep's grid."""
    out = []
    for task in names:
        rows = {name: row for name, row in sweep.items() if any(k.startswith(f"{task} ") for k in row)}
        if not rows:
            continue
        lines = [f"### {task} where the rule acts (after {2 * l} tokens, the answer's phase drawn uniformly in its "
                 "half-block): accuracy by zone, pooled over the sweep's distances, mean ± std over seeds [each "
                 "seed], and in parentheses the answers a checkpoint scores in that zone", "",
                 "| model | direct | relay | beyond | reach bound |", "|---|---|---|---|---|"]
        for name, row in rows.items():
            zone = lambda z: cell(row.get(f"{task} {z}")) + (f" ({row[f'{task} {z} answers']})"
                                                             if row.get(f"{task} {z} answers") else "")
            bound = row.get("bound") or [None, None]
            lines.append(f"| {name} | " + " | ".join(zone(z) for z in ("direct", "relay", "beyond")) + " | "
                         + (f"{bound[0]}–{bound[1]}" if bound[0] else "–") + " |")
        out.append("\n".join(lines) + "\n")
        table = {name: {k.split()[-1]: v for k, v in row.items() if k.startswith(f"{task} ")}
                 for name, row in curves.items()}
        table = {name: row for name, row in table.items() if row}
        columns = sorted({c for row in table.values() for c in row}, key=int)
        out.append(markdown(f"{task} where the rule acts: accuracy by distance", table, columns))
    return out


def plot_task(summary, task, path, sweep=False):
    """Accuracy against distance, a panel per rule (and one for the interpolations), a curve per scheme (mean over
    seeds); the training length and each rule's reach bound marked."""
    from outputs import pyplot
    plt = pyplot()
    prefix = f"{task} " if sweep else f"{task} distance "  # the sweep's curves, or the distance grid's
    rows = {name: sorted((int(k.split()[-1]), v["mean"]) for k, v in row.items() if k.startswith(prefix) and v)
            for name, row in summary["sweep_accuracy" if sweep else "accuracy"].items()}
    panels = [p for p in ("causal", "bca", "sliding", "sinks", "interpolation")
              if any(summary["panels"].get(n) == p and rows[n] for n in rows)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True, squeeze=False)
    l = summary["recipe"]["block_size"]
    for ax, panel in zip(axes[0], panels):
        shown = [(name, curve) for name, curve in rows.items() if summary["panels"].get(name) == panel and curve]
        for i, (name, curve) in enumerate(shown):  # past matplotlib's ten colours, a dashed line tells them apart
            line, = ax.plot(*zip(*curve), marker="o", ms=3, ls="-" if i < 10 else "--", label=name)
            if sweep and (summary["sweep"].get(name, {}).get("bound") or [None])[0]:  # its range over the phases
                least, most = summary["sweep"][name]["bound"]
                ax.axvspan(least, most + 1, color=line.get_color(), alpha=0.1)
            bound = None if sweep else summary["reach"].get(name, {}).get(f"{task} bound")
            if bound:
                ax.axvline(bound["mean"], color=line.get_color(), ls=":", lw=1)
        ax.axvline(l, color="grey", ls="--", lw=1)
        if not sweep:
            ax.set_xscale("log", base=2)
        ax.set_title(f"{task}: {panel}" + (f", after {2 * l} tokens, every phase" if sweep else ""), fontsize=9)
        ax.set_xlabel("distance (tokens); grey dashed: l, " + ("shaded: reach bound" if sweep else
                                                               "dotted: reach bound"), fontsize=8)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def clock(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def run_jobs(args, budget, jobs):
    """Run the jobs that are not finished, in order, with progress lines; or with --plan only list them."""
    timings_path = Path(args.results) / "timings.json"
    timings = read_timings(timings_path)
    todo = [job for job in jobs if not job.done(budget["recipe"]["max_iters"])]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} jobs finished already; {len(todo)} to run")
    if args.plan:
        for job in jobs:
            print(f"  [{'x' if job not in todo else ' '}] {job.name}: "
                  + (" ".join(job.command[1:]) if job.command else f"writes {job.output}"))
        return
    start = time.time()
    for i, job in enumerate(todo):
        left = sum(expected_seconds(j, timings, args.budget) for j in todo[i:])
        print(f"\n[{i + 1}/{len(todo)}] {job.name} ({clock(time.time() - start)} so far, about {clock(left)} left)",
              flush=True)
        began = time.time()
        if job.action:
            job.action(i > 0)  # whether this run measured anything (the report comes last)
        else:
            command = job.command[1:]
            resumed_at = 0
            owner = run_dir_owner(job.output.parent) if job.kind == "train" else None
            if owner:
                raise UserError(f"{job.name}: its run directory {job.output.parent} is in use by {owner}; run "
                                "reproduce.py again once that process has ended (finished jobs are kept)")
            if job.kind not in ("train", "prepare") and job.output.exists() and not earlier_output(job.output,
                                                                                                      plot=False):
                job.output.unlink()  # damaged, or from before outputs were marked: the script replaces only its own
            if job.kind == "train" and job.output.exists():  # stopped before max_iters: go on from its checkpoint
                command = command + ["--init_from=resume"]
                resumed_at = load_checkpoint(job.output, mmap=True)["iter_num"]
            print("$ " + " ".join(command), flush=True)
            argv = [PY] + [str(HERE / a) if a.endswith(".py") and (HERE / a).is_file() else a for a in command]
            result = subprocess.run(argv, stdout=None if args.verbose else subprocess.DEVNULL,
                                    preexec_fn=die_with_this_process())
            if result.returncode != 0:
                raise UserError(f"{job.name} failed (exit {result.returncode}); its command is above. Finished jobs "
                                "are kept: fix the cause and run reproduce.py again to go on")
            if job.output.parent == Path(args.results) / "raw":
                compact_raw(job.output)
        seconds = time.time() - began
        if job.kind == "train":  # a resumed run: its whole duration, at the rate of the part measured
            max_iters = job.max_iters or budget["recipe"]["max_iters"]
            seconds *= max_iters / (max_iters - resumed_at)
        timings[job.name] = dict(kind=job.kind, seconds=round(seconds, 1))
        write_json(timings_path, timings, quiet=True)
    print(f"\nall {len(jobs)} jobs are finished: {args.results} ({clock(time.time() - start)} in this piece)")


def die_with_this_process():
    """A job's preexec_fn on Linux: the kernel sends the job SIGKILL when this process dies, however it dies, so that
    no job outlives the study (its checkpoints are written by a rename: the run resumes from the last). None
    elsewhere, where jobs die with reproduce.py's process group only (kill -- -PGID, or Ctrl-C)."""
    parent = os.getpid()
    return (lambda: die_with_parent(parent)) if LIBC is not None else None


def read_timings(path):
    """{job name: {"kind", "seconds"}}, the latest run of each job (entries of an older layout, or damaged, are
    dropped). A damaged file only costs the estimates: it is noted, and the durations are measured again."""
    try:
        timings = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, ValueError):
        timings = None
    if not isinstance(timings, dict):
        print(f"note: {path} is not readable JSON: the job durations (for the time estimates) start afresh")
        timings = {}
    return {name: t for name, t in timings.items() if isinstance(t, dict) and isinstance(t.get("kind"), str)
            and isinstance(t.get("seconds"), (int, float))}


def expected_seconds(job, timings, budget):
    """Its own measured duration, else the mean of the jobs of its kind measured so far, else a guess for the full
    budget before any has run here."""
    if job.name in timings:
        return timings[job.name]["seconds"]
    done = [t["seconds"] for t in timings.values() if t["kind"] == job.kind]
    return sum(done) / len(done) if done else GUESS_SECONDS[job.kind] * (budget == "full")


def compact_raw(path):
    """Rewrite a job's JSON compact (without RAW_DROPPED, RAW_DIGITS, one row per line), keeping its modification
    time: whether a result is finished, or older than its checkpoints, is judged by that time. A compact file is left
    as it is."""
    path = Path(path)
    text = path.read_text()
    try:
        result = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON ({e}): remove it and run reproduce.py again to measure it again") \
            from None
    compact = compact_json(compacted(result)) + "\n"
    if compact != text:
        stat = path.stat()
        partial = path.with_name(path.name + ".partial")  # one atomic rename, as outputs.write_json
        partial.write_text(compact)
        os.utime(partial, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        partial.replace(path)


def write_summary(path, summary):
    """summary.json as outputs.write_json writes it (marked, one atomic rename), one row per line (compact_json)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(compact_json({**OUTPUT_MARK, **summary}) + "\n")
    partial.replace(path)
    print(f"wrote {path}")


def compacted(value):
    """The value without RAW_DROPPED's fields, its floats rounded to RAW_DIGITS significant digits. Applied twice,
    it changes nothing more."""
    if isinstance(value, dict):
        return {k: compacted(v) for k, v in value.items() if k not in RAW_DROPPED}
    if isinstance(value, list):
        return [compacted(v) for v in value]
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{RAW_DIGITS}g}")
    return value


def compact_json(value, indent=0):
    """JSON with one row per line: a list of numbers, or a dict of numbers and such lists, on one line; any other
    dict or list one item per line."""
    def flat(v):
        return not isinstance(v, (dict, list)) or (isinstance(v, list) and not any(isinstance(x, (dict, list))
                                                                                     for x in v))
    if flat(value) or (isinstance(value, dict) and all(map(flat, value.values()))):
        return json.dumps(value)
    pad = " " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(str(k))}: {compact_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    return "[\n" + ",\n".join(pad + compact_json(v, indent + 1) for v in value) + "\n" + " " * indent + "]"


# ---------------------------------------------------------------------------------------------------------------
# Tables and plots from the JSON files.

# The paper's numbers (its 1024-token models on arXiv text) beside ours, row by row: (our row name, the paper's row
# name, the paper's values). Table 2: perplexity at 1/4, 1/2, 1, 2 and 4 x the training length; Table 3: attention
# resolution at 1 and 2 x (the "- BCA" row is xPos with plain causal attention); Table 4: perplexity at the
# training length; Table 5: perplexity at 2 and 4 x, with and without BCA. Our rows without a paper row have None.
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


def paper_tables(summary):
    """The paper's Tables 2-5 in its layout, each of our rows (mean ± std over seeds) followed by the paper's row.
    Lengths are multiples of the training length l: ours is summary["recipe"]["block_size"], the paper's 1024."""
    l = summary["recipe"]["block_size"]
    out = []
    for title, measure, multiples, digits, rows in PAPER_TABLES:
        columns = [f"{m:g}l" for m in multiples]
        lines = [f"### {title}", "", "| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for ours, theirs, values in rows:
            if measure == "perplexity":
                row = summary["perplexity"].get(ours, {})
                cells = [cell(row.get(str(int(m * l))), digits) for m in multiples]
            else:
                row = summary["resolution"].get(ours, {})
                cells = [cell(row.get(f"R at {m}l"), digits) + "; " + cell(row.get(f"R_shared at {m}l"), digits)
                         for m in multiples]
            lines.append(f"| {ours} (ours, l = {l}) | " + " | ".join(cells) + " |")
            if theirs:
                cells = [f"{v:g}" for v in values] + ["–"] * (len(multiples) - len(values))
                lines.append(f"| {theirs} (paper, l = 1024) | " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
    return out


def bootstrap(per_seed, draws=2000, seed=0):
    """A 95% percentile interval for the mean over seeds of each seed's mean over its units (spans, instances): seeds
    drawn with replacement, then each drawn seed's units with replacement; seeded, so a redraw gives the same.
    per_seed: one list of unit values a seed (one seed alone: its units only)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(v, dtype=float) for v in per_seed if len(v)]
    if not arrays:
        return None
    means = [np.mean([arrays[k][rng.integers(0, len(arrays[k]), len(arrays[k]))].mean()
                      for k in rng.integers(0, len(arrays), len(arrays))]) for _ in range(draws)]
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def interval(bounds, digits):
    return "–" if not bounds else f"[{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]"


def spread(values):
    """Mean, sample standard deviation (None for one value) and count n of the values that are not None, out of
    `of` (a repeat probe's effective context is None where the model gains nothing even at the shortest distance)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    n = len(present)
    mean = sum(present) / n
    std = (sum((v - mean) ** 2 for v in present) / (n - 1)) ** 0.5 if n > 1 else None
    return {"mean": mean, "std": std, "n": n, "of": len(values), "values": present}


def cell(stat, digits=2):
    """mean ± std [each checkpoint's value, in seed order], and "(n of N)" where only some checkpoints have one."""
    if stat is None:
        return "–"
    text = f"{stat['mean']:.{digits}f}" + (f" ± {stat['std']:.{digits}f}" if stat["std"] is not None else "")
    if stat["n"] > 1 and stat.get("values"):  # each seed's value beside the mean (a summary from before had none)
        text += " [" + " / ".join(f"{v:.{digits}f}" for v in stat["values"]) + "]"
    return text + partial(stat)


def partial(stat):
    """" (n of N)" where a spread rests on only n of its N checkpoints, else nothing."""
    return f" ({stat['n']} of {stat['of']})" if stat and stat["n"] < stat["of"] else ""


def row_name(scheme, row):
    """The study's scheme name (xPos has three) followed by the attention rule and interpolation of the label."""
    return scheme + row["label"][len(row["pos"]):]


def gather(args, suffix, key_of, value_of, panels=None, plain=""):
    """{row name: {key: spread over seeds}} from each scheme's raw/<scheme><suffix>, one value per checkpoint and key
    (key_of None skips a row); `panels`, if given, gets each row name's panel: its attention rule, or
    "interpolation" for a RoPE interpolation. plain: what sets a row without interpolation in an interpolation file
    apart from the same row measured on more text, e.g. " (16 spans)"; it shares the interpolations' panel."""
    values = {}
    for scheme, _, _ in SUITE_SCHEMES:  # (the study's are among them)
        path = Path(args.results) / "raw" / f"{scheme}{suffix}"
        try:
            found = [(row_name(scheme, row) + (plain if row["rope_scaling"] == "none" else ""), key_of(row),
                      row["ckpt"], row.get("depth"), value_of(row),
                      row["attention"] if row["rope_scaling"] == "none" and not plain else "interpolation")
                     for row in scheme_rows(args, scheme, suffix)]
        except (KeyError, TypeError, AttributeError):  # damaged, noted by report
            continue
        for name, key, ckpt, depth, value, panel in found:
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                print(f"note: {path}: {name}'s {key} is {value!r}, not a number: left out of the tables")
                continue
            if key is not None:
                # one value per checkpoint (and passkey depth): a repeat row per distance repeats its effective context
                values.setdefault(name, {}).setdefault(key, {})[ckpt, depth] = value
            if panels is not None:
                panels[name] = panel
    return {name: {key: spread(list(v.values())) for key, v in by_key.items()} for name, by_key in values.items()}


def markdown(title, table, columns, digits=2, header=None):
    """A markdown table of cells; `digits` is one number for every column, or {column: digits}."""
    places = digits if isinstance(digits, dict) else dict.fromkeys(columns, digits)
    lines = [f"### {title}", "", f"| {header or 'model'} | " + " | ".join(str(c) for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cell(row.get(c), places[c]) for c in columns) + " |"
              for name, row in table.items()]
    return "\n".join(lines) + "\n"


def plot_perplexity(summary, path):
    """Perplexity against length, one panel per attention rule (and one for the interpolations, under causal
    attention), the spread over seeds shaded (mean ± std)."""
    from outputs import pyplot
    plt = pyplot()
    table, panels = summary["perplexity"], summary["panels"]
    titles = dict(causal="causal", bca="BCA", sliding="sliding window", sinks="attention sinks",
                  interpolation="RoPE interpolation (causal)")
    shown = [p for p in titles if p in panels.values()]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4.5), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], shown):
        for name, row in table.items():
            if panels[name] != panel:
                continue
            xs = [n for n in summary["lengths"] if str(n) in row]
            mean = [row[str(n)]["mean"] for n in xs]
            std = [row[str(n)]["std"] or 0 for n in xs]
            ax.plot(xs, mean, marker="o", ms=3, label=name)
            ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
        ax.axvline(summary["recipe"]["block_size"], color="gray", ls=":")
        ax.set(xscale="log", yscale="log", title=titles[panel], xlabel="evaluation length (tokens)")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("perplexity (mean ± std over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_effective_context(summary, path):
    """The repeat probe's effective context per row (mean ± std over seeds) against its reach bound (the farthest
    a copy can be seen under the row's attention rule; none for plain causal attention)."""
    from outputs import pyplot
    plt = pyplot()
    rows = summary["effective_context"]
    names = list(rows)
    labels = [name + partial(rows[name].get("effective context")) for name in names]
    fig, ax = plt.subplots(figsize=(7, 0.25 * len(names) + 1.5))
    for i, name in enumerate(names):
        stat, bound = rows[name].get("effective context"), rows[name].get("reach bound")
        if stat is not None:
            ax.barh(i, stat["mean"], xerr=stat["std"] or 0, color="C0", alpha=0.7)
        if bound is not None:
            ax.plot(bound["mean"], i, "k|", ms=10)
    ax.set(yticks=range(len(names)), xlabel="effective context (tokens): bar; reach bound: |")
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args, budget, measured=True):
    """results/summary.json, then tables.md and the plots drawn from it alone, from whatever has finished. Its
    machine is this one where this run measured something, else the one the summary already names (a redraw)."""
    results = Path(args.results)
    check_outputs(results, "study")
    check_raw(results)
    ran_on = None if measured else previous_machine(results / "summary.json")
    panels = {}
    ppl = gather(args, ".ppl.json", lambda r: r["length"], lambda r: r["ppl"], panels)
    ppl.update(gather(args, ".scaled.json", lambda r: r["length"], lambda r: r["ppl"], panels,
                      plain=f" ({budget['scaled_spans']} spans)"))
    resolution = {}
    for m in (1, 2):
        for name, by_key in gather_resolution(args, budget, m).items():
            resolution.setdefault(name, {}).update(by_key)
    repeat = {}
    for suffix, plain in ((".repeat.json", ""), (".repeat_scaled.json", f" ({budget['scaled_sequences']} sequences)")):
        repeat.update(gather(args, suffix, lambda r: "gain at d=0" if r["d"] == 0 else None, lambda r: r["gain"],
                             plain=plain))
        for column, field in (("effective context", "effective_context"), ("reach bound", "reach_bound")):
            for name, by_key in gather(args, suffix, lambda r: column, lambda r: r[field], plain=plain).items():
                repeat.setdefault(name, {}).update(by_key)
    passkey = gather(args, ".passkey.json", lambda r: r["length"], lambda r: r["accuracy"])  # spread over depths
    summary = {"variant": args.variant, "budget": args.budget, "recipe": budget["recipe"], "seeds": list(SEEDS),
               "lengths": study_lengths(budget), "wall_time": wall_time(args, budget),
               "machine": ran_on or machine(args.device),
               "perplexity": ppl, "panels": panels, "resolution": resolution, "effective_context": repeat,
               "passkey_accuracy": passkey}
    context = gather_context(args)
    if context:  # (a summary drawn before the context probe existed has none)
        summary["context"] = context
    write_summary(results / "summary.json", summary)
    summary = json.loads((results / "summary.json").read_text())  # what the tables show is what the file holds
    (results / "tables.md").write_text(tables_markdown(summary))
    if ppl:
        plot_perplexity(summary, results / "perplexity.png")
    if repeat:
        plot_effective_context(summary, results / "effective_context.png")
    print(f"wrote {results / 'tables.md'}")


CONTEXT_FIELDS = ("gain", "fall", "used", "early")


def gather_context(args):
    """{row name: {column: spread over seeds}} from raw/<scheme>.context.json: each checkpoint's gain from context
    beyond l (its mean over spans, over l .. T and by bin), the lex fall from l to T and its two parts; and
    "gain interval", a bootstrap over seeds and spans. A damaged row is left out."""
    values, spans = {}, {}
    for scheme, _, _ in SUITE_SCHEMES:  # (the study's are among them)
        for row in scheme_rows(args, scheme, ".context.json"):
            try:
                found = {f: float(row[f]) for f in CONTEXT_FIELDS}
                found.update({f"gain {b['start']}..{b['end']}": float(b["gain"]) for b in row["by_bin"]})
                per_span = [float(v) for v in row["per_span"]["gain"]]
            except (KeyError, TypeError, ValueError):
                continue
            for key, value in found.items():
                values.setdefault(row_name(scheme, row), {}).setdefault(key, []).append(value)
            spans.setdefault(row_name(scheme, row), []).append(per_span)
    table = {name: {key: spread(v) for key, v in by_key.items()} for name, by_key in values.items()}
    for name, per_seed in spans.items():
        table[name]["gain interval"] = bootstrap(per_seed)
    return table


def context_markdown(context):
    """The context probe's table: gain from context beyond l with its interval and by bin, and the lex fall split."""
    bins = sorted({k for row in context.values() for k in row if k.startswith("gain ") and ".." in k},
                  key=lambda k: int(k.split()[1].split("..")[0]))
    columns = ["gain", "gain interval", *bins, "fall", "used", "early"]
    titles = {"gain": "gain, l .. T", "gain interval": "95% interval (seeds, spans)", "fall": "lex fall l -> T",
              "used": "of it: context used", "early": "of it: fewer early tokens"}
    lines = ["### Context beyond l: NLL given the last l tokens minus NLL under the rule (nats per token; mean ± std "
             "over seeds [each seed]); the lex protocol's fall from l to T split into context used and fewer early "
             "tokens", "", "| model | " + " | ".join(titles.get(c, c) for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for name, row in context.items():
        cells = [interval(row.get(c), 4) if c == "gain interval" else cell(row.get(c), 4) for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def check_raw(results):
    """Every raw result compact (some were put there by hand, or before they were kept compact); a damaged one noted,
    left out of the tables (gather) and measured again by the next run."""
    for path in sorted((results / "raw").glob("*.json")):
        if read_result(path) is None:
            print(f"note: {path} is damaged, left out of the tables (run reproduce.py to measure it again)")
        else:
            compact_raw(path)


def tables_markdown(summary):
    """Every table of the study, from summary.json: the paper's Tables 2-5 beside ours, then the full tables."""
    ppl, resolution, repeat, passkey = (summary[k] for k in ("perplexity", "resolution", "effective_context",
                                                             "passkey_accuracy"))
    wall = summary["wall_time"]
    head = (f"Study: {summary['variant']} variant, {summary['budget']} budget, training length "
            f"{summary['recipe']['block_size']}, seeds {', '.join(map(str, summary['seeds']))}; wall time "
            f"{clock(wall['seconds'])} ({wall['measured']} of its {wall['jobs']} jobs measured"
            + (", the others estimated from the jobs of their kind" if wall["measured"] < wall["jobs"] else "")
            + f"), on {summary['machine']}.\n")
    res_columns = [f"{what} at {m}l" for m in (1, 2) for what in ("R", "R_shared")]
    tables = [head, *paper_tables(summary),
              markdown("Perplexity against length (lex protocol), mean ± std over seeds", ppl,
                       [str(n) for n in summary["lengths"]]),
              markdown("Attention resolution (Eq. 3 on Eq. 11), layer average, heads averaged first", resolution,
                       res_columns, digits=3),
              markdown("Repeat probe: retrieval gain with the span repeated at once, effective context (tokens; "
                       "\"n of N\": only n checkpoints gain anything at d=0) and the reach bound", repeat,
                       ["gain at d=0", "effective context", "reach bound"],
                       digits={"gain at d=0": 3, "effective context": 0, "reach bound": 0}),
              markdown("Passkey accuracy against document length, mean ± std over the depths (one model)", passkey,
                       sorted({n for row in passkey.values() for n in row}, key=int)) if passkey else ""]
    if summary.get("context"):
        tables.append(context_markdown(summary["context"]))
    return "\n".join(tables)


def wall_time(args, budget, jobs_of=None):
    """The study's duration: the sum over its jobs of their measured durations (timings.json keeps the latest run
    of each job); a job not measured (run before timings were kept, or not yet) is estimated as in the progress
    lines."""
    timings = read_timings(Path(args.results) / "timings.json")
    jobs = [job for job in (jobs_of or plan)(args, budget) if job.kind != "report"]
    seconds = sum(expected_seconds(job, timings, args.budget) for job in jobs)
    return {"seconds": round(seconds, 1), "measured": sum(job.name in timings for job in jobs), "jobs": len(jobs)}


def previous_machine(path):
    """The machine an existing summary names (None without one: a missing or unreadable summary is drawn anew)."""
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
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return f"{os.cpu_count()} x {cpu}, torch {torch.__version__}"


def gather_resolution(args, budget, m):
    """{row name: {"R at ml": spread, "R_shared at ml": spread}} over seeds, from raw/<run>.resolution<m>.json."""
    values = {}
    for scheme, runs in study_runs(budget).items():
        for run, _, passkey, _ in runs:
            path = Path(args.results) / "raw" / f"{run}.resolution{m}.json"
            if passkey or not path.exists():
                continue
            try:
                result = read_result(path)
                found = [(scheme + mode["label"][len(result["pos"]):], what, mode[what]) for mode in result["modes"]
                         for what in ("R", "R_shared")]
            except (KeyError, TypeError, AttributeError):  # damaged, noted by report
                continue
            for name, what, value in found:
                values.setdefault(name, {}).setdefault(f"{what} at {m}l", []).append(value)
    return {name: {key: spread(v) for key, v in by_key.items()} for name, by_key in values.items()}


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="study", choices=SUITES, help="study: the paper's claims (the default); "
                   "retrieval: the long-range task suite (tasks.py), results/retrieval; extension: the study's models "
                   "fine-tuned at 4l (RoPE with PI and YaRN, xPos) against zero-shot, results/extension")
    p.add_argument("--variant", default="char", choices=tuple(VARIANTS), help="char: Shakespeare characters on CPU; "
                   "gpt2: GPT-2 BPE tokens (config/study_gpt2.py), for a GPU")
    p.add_argument("--budget", default="full", choices=tuple(BUDGETS), help="toy: a tiny model and a few "
                   "iterations, to check the pipeline end to end")
    p.add_argument("--results", help="tables, plots and JSON (default: results/VARIANT; toy: out/study_VARIANT_toy/"
                   "results)")
    p.add_argument("--runs", help="checkpoints (default: out/study_VARIANT[_toy])")
    p.add_argument("--data", help="prepared data (default: data/study_VARIANT; the passkey mix goes to ..._passkey)")
    p.add_argument("--schemes", help="comma-separated: a part of the study (default: all of it; the suite also has "
                   "xpos_4layer)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--plan", action="store_true", help="list the jobs and which are finished; run nothing")
    p.add_argument("--tune", action="store_true", help="instead of the study: the learning-rate check behind the "
                   f"recipe ({', '.join(TUNE_SCHEMES)} at {', '.join(f'{f:g}' for f in TUNE_FACTORS)} x its "
                   "learning_rate), results/VARIANT/tuning.json")
    p.add_argument("--report", action="store_true", help="only redraw summary.json, tables.md and the plots from the "
                   "results directory (raw/, timings.json), running no job: for a checkout, which holds the results "
                   "but neither the data nor the checkpoints")
    p.add_argument("--verbose", action="store_true", help="show each job's own output")
    args = p.parse_args(argv)
    toy = "_toy" if args.budget == "toy" else ""
    if args.suite == "retrieval":
        if args.variant != "char" or args.tune:
            raise UserError("--suite retrieval has its own data and recipe (config/retrieval.py): --variant and "
                            "--tune do not apply")
        args.results = args.results or ("out/retrieval_toy/results" if toy else "results/retrieval")
        args.runs, args.data = args.runs or f"out/retrieval{toy}", args.data or f"data/task_char{toy}"
    if args.suite == "extension":
        if args.variant != "char" or args.tune:
            raise UserError("--suite extension fine-tunes the char study's models: --variant and --tune do not apply")
        args.results = args.results or ("out/extension_toy/results" if toy else "results/extension")
    args.results = args.results or (f"out/study_{args.variant}_toy/results" if toy else f"results/{args.variant}")
    args.runs = args.runs or f"out/study_{args.variant}{toy}"
    args.data = args.data or f"data/study_{args.variant}"
    return args


def budget_for(args):
    """The budget's settings, with the recipe its models train with: the config file and the budget's overrides."""
    known = list(EXTENSION_SOURCES) if args.suite == "extension" else [s for s, _, _ in schemes_of(args.suite)]
    budget = dict(BUDGETS[args.budget], schemes=args.schemes.split(",") if args.schemes else known, suite=args.suite)
    unknown = set(budget["schemes"]) - set(known)
    if unknown:
        raise UserError(f"--schemes {args.schemes}: unknown {', '.join(sorted(unknown))}; the {args.suite}'s schemes "
                        "are " + ", ".join(known))
    if args.suite == "retrieval":
        budget = dict(RETRIEVAL_BUDGETS[args.budget], schemes=budget["schemes"], suite=args.suite)
        budget["recipe"] = dict(read_recipe(HERE / RETRIEVAL_CONFIG), **budget["train"])
    else:
        budget["recipe"] = dict(read_recipe(HERE / VARIANTS[args.variant]["config"]), **budget["train"])
    return budget


def jobs_for(args, budget):
    suite_plan = {"study": plan, "retrieval": retrieval_plan, "extension": extension_plan}[args.suite]
    return (tune_plan if args.tune else suite_plan)(args, budget)


def main(argv=None):
    try:
        args = parse_args(argv)
        budget = budget_for(args)
        budget["recipe"] = results_recipe(args, budget["recipe"])
        args.block_size = budget["recipe"]["block_size"]  # the rows of models trained at another are left out
        if args.report:
            if args.tune or args.plan:
                raise UserError("--report redraws the study's tables alone: give it without --tune and --plan")
            if not Path(args.results, "raw").is_dir():
                raise UserError(f"--report: {Path(args.results, 'raw')} does not exist; nothing to draw from")
            suite_report = {"study": report, "retrieval": retrieval_report, "extension": extension_report}
            return suite_report[args.suite](args, budget, measured=False)
        raw = Path(args.results, "raw")
        made = [p for p in (raw, *raw.parents) if not (p.exists() or p.is_symlink())]  # deepest first
        writable_dir(raw, "--results")
        for folder in made if args.plan else ():  # --plan only looks: what the check made goes again
            folder.rmdir()
        if not args.tune and not args.plan:  # a results directory of another suite: refused before any job runs
            check_outputs(Path(args.results), args.suite)
        run_jobs(args, budget, jobs_for(args, budget))
    except UserError as e:
        sys.exit(f"reproduce.py: error: {e}")


if __name__ == "__main__":
    main()
