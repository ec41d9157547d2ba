"""
What reproduce.py runs: the schemes, seeds and budgets of its three suites (the study, the
long-range task suite, the context extension), and the jobs that train and measure them.

Each job is one command that writes one file. A job is finished when its file is there, newer
than the checkpoints it measures, and reads as a result; a training job when its checkpoint has
reached max_iters with the recipe's settings (Job.done). reproduce.py runs the jobs that are not.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from lexgpt.checkpoint import load_checkpoint
from lexgpt.cli import UserError
from lexgpt.configurator import run_config_file

PY = sys.executable
SEEDS = (1337, 1338, 1339)
# (run name, train.py overrides, seeds). xPos's decay strength depends on
# block_size / scale_base: the paper trains 1024 tokens with scale_base 512, so
# zeta^(l / scale_base) at the window's edge is far below what the official default
# 512 gives at 128 tokens (nearly RoPE). "xpos" keeps the paper's ratio
# (scale_base = block_size / 2); "xpos_sb512" keeps the official constant.
# "xpos_norot" is Table 4's ablation: the decay without the rotation.
XPOS_HALF = dict(pos="xpos", xpos_scale_base="half")
SCHEMES = (
    ("learned", dict(pos="learned"), 1),
    ("sinusoidal", dict(pos="sinusoidal"), 1),
    ("rope", dict(pos="rope"), 3),
    ("alibi", dict(pos="alibi"), 3),
    ("xpos", XPOS_HALF, 3),
    ("xpos_norot", dict(XPOS_HALF, xpos_rotate=False), 1),
    ("none", dict(pos="none"), 1),
    ("xpos_sb512", dict(pos="xpos", xpos_scale_base=512.0), 3),
)
# The task suite's schemes: the study's, and one deeper model, to see whether BCA's relay
# through the layers appears with depth (4 layers: a reach bound of 256 to 319 at l = 128,
# against 128 to 191 with the recipe's 2).
SUITE_SCHEMES = SCHEMES + (("xpos_4layer", dict(XPOS_HALF, n_layer=4), 1),)
# --tune: the recipe's learning rate, chosen on the first three (the schemes most apart)
# and checked on the two that train worst under it
TUNE_SCHEMES = ("learned", "rope", "xpos", "sinusoidal", "none")
TUNE_FACTORS = (0.5, 1, 2, 4)  # x the recipe's learning_rate (and min_lr)
PASSKEY_SCHEMES = ("rope", "alibi", "xpos")  # trained again on the passkey mix, one seed
INTERPOLATED = ("rope", "xpos", "xpos_sb512")  # PI, NTK, dynamic NTK and YaRN scale rotations
WINDOW_RULES = "causal,bca,sliding,sinks"
SCALINGS = "none,pi,ntk,dynamic_ntk,yarn"  # each beside the plain model on the same text
BOUNDED = ("learned",)  # no position past block_size exists
VARIANTS = {
    "char": dict(config="config/study_char.py",
                 prepare=["--dataset", "shakespeare", "--tokenizer", "char"]),
    "gpt2": dict(config="config/study_gpt2.py",
                 prepare=["--dataset", "shakespeare", "--tokenizer", "gpt2"]),
}
PASSKEY_TOKENS = 96  # the passkey documents' length, at least
PASSKEY_MIX = ["--passkey", "0.5", "--passkey_tokens", str(PASSKEY_TOKENS)]
# train.py overrides, evaluation lengths (multiples of the training length l) and sizes.
# The interpolations are measured on a quarter of the text: dynamic NTK decodes token by
# token past l, which at full size took half the study's time, and the interpolations
# differ from each other and from BCA by far more than 1%. The repeat probe takes 32
# sequences per distance (8 interpolated): the study stays within about 2.5 hours on 2 CPU
# cores, and its standard error (about 0.01) far below the gain of a model that copies.
BUDGETS = {
    "full": dict(train={}, multiples=(0.25, 0.5, 1, 2, 4, 8, 16), spans="64",
                 repeat_sequences=32, scaled_spans="16", scaled_sequences=8,
                 passkey_sequences=20, texts=8, context_spans=64),
    "toy": dict(train=dict(max_iters=2, lr_decay_iters=2, warmup_iters=1, n_layer=2, n_head=2,
                           n_embd=16, block_size=16, batch_size=2, gradient_accumulation_steps=1,
                           eval_iters=1, eval_interval=2, log_interval=1),
                multiples=(0.25, 1, 2, 4), spans="2", repeat_sequences=2, scaled_spans="2",
                scaled_sequences=2, passkey_sequences=1, texts=1, context_spans=1),
}
# --suite retrieval (retrieval_tasks.py): every scheme trained on the task suite with
# config/retrieval.py, the same seeds as the study (one for learned, sinusoidal, none and
# xPos without rotation: three each would take the suite past 3 hours on 2 cores), then
# eval_retrieval.py --probe task under every rule and, for the rotary schemes, every
# interpolation.
SUITES = ("study", "retrieval", "extension", "control")
# the context extension's fine-tunes (extension.py)
FINE_TUNES = (  # (name, source scheme, train.py overrides)
    ("rope_pi", "rope", dict(rope_scaling="pi", rope_factor=4.0)),
    ("rope_yarn", "rope", dict(rope_scaling="yarn", rope_factor=4.0)),
    ("xpos_long", "xpos", {}),
)
# The sweep, where the windows act: the three retrieval tasks under the three window rules
# (flip-flop and the passkey's second filler are left out for time)
SWEEP_TASKS = "copy,mqar,passkey"
SWEEP_RULES = "bca,sliding,sinks"
RETRIEVAL_CONFIG = "config/retrieval.py"
RETRIEVAL_BUDGETS = {
    "full": dict(train={}, records=200000, sequences=32, sweep_sequences=128),
    "toy": dict(train=dict(max_iters=2, lr_decay_iters=2, warmup_iters=1, n_layer=1, n_head=2,
                           n_embd=16, block_size=96, batch_size=2, eval_iters=1, eval_interval=2,
                           log_interval=1),
                records=50, sequences=2, sweep_sequences=2),
}
# Settings that do not change the weights trained: where the run and its data lie (which
# records the data holds is the prepare job's), the device, compilation, and how often it
# is evaluated and logged (batches are drawn from (seed, iteration) alone). A fine-tune
# resumed records init_from=resume; its source is in its checkpoint's "init".
NOT_RECIPE = ("out_dir", "data_dir", "device", "compile", "max_iters", "eval_interval",
              "eval_iters", "log_interval", "init_from")
# Seconds a job of each kind takes, until one has run here (the progress lines' estimate)
GUESS_SECONDS = dict(prepare=10, train=300, extrapolate=240, scalings=240, resolution=20,
                     theory=5, repeat=120, repeat_scaled=120, passkey=300, tasks=300,
                     context=200, sweep=300, report=10)


def schemes_of(suite):
    if suite == "retrieval":
        return SUITE_SCHEMES
    return SCHEMES


@dataclass
class Job:
    """One step: a command that writes `output`, from the checkpoints in `inputs`."""

    name: str
    kind: str
    output: Path
    command: list = None
    inputs: list = field(default_factory=list)
    settings: dict = None  # a training job's: its recipe file and overrides
    max_iters: int = None  # a training job's own, where not the recipe's (a fine-tune's)

    def __post_init__(self):
        self.output = Path(self.output)
        self.inputs = [Path(p) for p in self.inputs]

    def done(self, max_iters=None):
        """Whether the job's output is finished. As make does, a result older than one of
        its checkpoints (a run trained again) counts as missing, and so does one whose
        checkpoint is missing (this run trains it) or that does not read as a result."""
        if self.kind == "report":
            return False  # cheap: always redrawn from whatever is finished
        if not self.output.exists():
            return False
        if self.kind == "train":
            return self.trained(self.max_iters or max_iters)
        made = self.output.stat().st_mtime
        for ckpt in self.inputs:
            if not ckpt.exists() or ckpt.stat().st_mtime > made:
                return False
        return self.kind == "prepare" or read_result(self.output) is not None

    def trained(self, max_iters):
        newer = [p for p in self.inputs if p.exists() and is_newer(p, self.output)]
        if newer:  # a fine-tune whose source was trained again since
            raise UserError(f"{self.name}: {self.output} was fine-tuned from an earlier "
                            f"{newer[0]}; move {self.output.parent} aside to fine-tune it again")
        checkpoint = load_checkpoint(self.output, mmap=True)
        self.check_recipe(checkpoint["config"], checkpoint["iter_num"], max_iters)
        return checkpoint["iter_num"] >= max_iters

    def check_recipe(self, trained, iter_num, max_iters):
        """A checkpoint trained with other settings than this job's is neither finished nor
        resumed: either would put two recipes in one table. Settings that leave the weights
        as they are do not count; nor does max_iters (a run stopped early and resumed trains
        as one that was not), unless it went past this job's."""
        settings = self.settings or {}
        differ = [k for k, v in settings.items() if k not in NOT_RECIPE and trained.get(k) != v]
        aside = f"move {self.output.parent} aside (or give another --runs) to train it again"
        if differ:
            was = settings_text(differ, trained)
            now = settings_text(differ, settings)
            raise UserError(f"{self.name}: {self.output} was trained with {was}, "
                            f"not this recipe's {now}; {aside}")
        if settings and iter_num > max_iters:
            raise UserError(f"{self.name}: {self.output} was trained to iteration {iter_num}, "
                            f"past this recipe's max_iters={max_iters}; {aside}")


def is_newer(path, than):
    return path.stat().st_mtime > than.stat().st_mtime


def settings_text(keys, settings):
    texts = []
    for k in keys:
        if k in settings:
            texts.append(f"{k}={settings[k]!r}")
        else:
            texts.append(f"{k} not recorded")
    return ", ".join(texts)


def has_keys(items, *keys):
    """Whether items is a list of dicts that each hold every key."""
    if not isinstance(items, list):
        return False
    return all(isinstance(x, dict) and all(k in x for k in keys) for x in items)


def read_result(path):
    """A job's JSON result, its rows in full (expanded), or None when it is missing, unreadable
    or not shaped as one (rows of an evaluation, modes of a resolution, the theory's curves): a
    damaged result counts as missing, and is measured again."""
    try:
        result = expanded(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict):
        return None
    rows = "rows" in result and has_keys(result["rows"], "ckpt", "pos", "label")
    modes = "modes" in result and "pos" in result
    modes = modes and has_keys(result["modes"], "label", "R", "R_shared")
    theory = has_keys([result.get("rope"), result.get("xpos")], "g")
    if rows or modes or theory:
        return result
    return None


def expanded(result):
    """A result's rows in full. A compact raw file (files.hoisted) writes once, in
    "row_defaults", the value most of its rows share for a field, and in each row only the
    fields where it differs; every reader goes through read_result, so sees full rows. A
    result in any other form is returned as it is."""
    defaults = result.get("row_defaults") if isinstance(result, dict) else None
    if not isinstance(defaults, dict) or not isinstance(result.get("rows"), list):
        return result

    def full(row):  # its own fields first, in its order (as hoisted keeps them), then the rest
        return {**row, **{k: v for k, v in defaults.items() if k not in row}}
    rows = [full(row) if isinstance(row, dict) else row for row in result["rows"]]
    return {k: rows if k == "rows" else v for k, v in result.items() if k != "row_defaults"}


def read_recipe(path):
    """The recipe file's settings, as train.py's configurator reads them."""
    settings = run_config_file(path).items()
    return {k: v for k, v in settings if not k.startswith("_") and not isinstance(v, ModuleType)}


def read_timings(path):
    """{job name: {"kind", "seconds"}}, the latest run of each job (entries of an older layout,
    or damaged, are dropped). A damaged file only costs the estimates: it is noted, and the
    durations are measured again."""
    try:
        timings = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, ValueError):
        timings = None
    if not isinstance(timings, dict):
        print(f"note: {path} is not readable JSON: the job durations "
              "(for the time estimates) start afresh")
        return {}
    kept = {}
    for name, t in timings.items():
        if isinstance(t, dict) and isinstance(t.get("kind"), str) \
                and isinstance(t.get("seconds"), (int, float)):
            kept[name] = t
    return kept


def expected_seconds(job, timings, budget):
    """Its own measured duration, else the mean of the jobs of its kind measured so far,
    else a guess for the full budget before any has run here."""
    if job.name in timings:
        return timings[job.name]["seconds"]
    done = [t["seconds"] for t in timings.values() if t["kind"] == job.kind]
    if done:
        return sum(done) / len(done)
    return GUESS_SECONDS[job.kind] * (budget == "full")


# ------------------------------------------------------------------------------------------
# The study (and the task suite's) training runs


def study_runs(budget):
    """{scheme: [(run name, seed, passkey?, train.py overrides)]} for every model trained."""
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
    """A scheme's train.py overrides, "half" read as half the training length."""
    settings = dict(overrides)
    for k, v in overrides.items():
        if v == "half":
            settings[k] = recipe["block_size"] / 2
    return settings


def train_job(name, config_file, ckpt, settings, recipe, **kw):
    """A train.py job: the config file, then each setting as --key=value; the recipe guard
    compares the recipe with those settings over it (Job.check_recipe)."""
    flags = [f"--{k}={v}" for k, v in settings.items()]
    return Job(name, "train", ckpt, [PY, "train.py", config_file, *flags],
               settings=dict(recipe, **settings), **kw)


def prepare_job(args, data, extra=()):
    name = "prepare passkey data" if extra else "prepare data"
    prepare = VARIANTS[args.variant]["prepare"]
    return Job(name, "prepare", Path(data) / "meta.json",
               [PY, "prepare_data.py", *prepare, *extra, "--out_dir", str(data)])


def study_lengths(budget):
    l = budget["recipe"]["block_size"]
    return [max(1, int(m * l)) for m in budget["multiples"]]


def passkey_lengths(budget):
    """The evaluation lengths from l on that hold a passkey document (at least the training
    documents' length)."""
    l = budget["recipe"]["block_size"]
    shortest = PASSKEY_TOKENS
    found = [n for n in study_lengths(budget) if n >= l and n >= shortest]
    return found or [shortest]


def ckpt_flags(ckpts):
    return [a for c in ckpts for a in ("--ckpt", str(c))]


def plan(args, budget):
    """Every job of the study, in the order they run: the data, Figure 2's theory, then per
    scheme its training runs and their measurements (one job per scheme where a script takes
    several checkpoints), then the passkey models and their grids."""
    data = Path(args.data)
    jobs = [prepare_job(args, data), prepare_job(args, f"{data}_passkey", PASSKEY_MIX)]
    jobs += theory_jobs(args, budget)
    passkey_jobs = []  # the passkey models, trained and measured after the rest
    for scheme, runs in study_runs(budget).items():
        ckpts = {run: Path(args.runs) / run / "ckpt.pt" for run, _, _, _ in runs}
        for run, seed, passkey, overrides in runs:
            job = study_train_job(args, budget, run, seed, passkey, overrides)
            if passkey:
                passkey_jobs.append(job)
            else:
                jobs.append(job)
        jobs += scheme_jobs(args, budget, scheme, runs, ckpts)
        if scheme in PASSKEY_SCHEMES:
            passkey_jobs.append(passkey_job(args, budget, scheme, ckpts[f"{scheme}_passkey"]))
    return jobs + passkey_jobs


def theory_jobs(args, budget):
    """Figure 2 for both of the study's xPos settings."""
    recipe = budget["recipe"]
    l = recipe["block_size"]
    raw, jobs = Path(args.results) / "raw", []
    for suffix, scale_base in (("", l / 2), ("_sb512", 512.0)):
        out = raw / f"theory{suffix}.json"
        plot = Path(args.results) / f"figure2_theory{suffix}.png"
        command = [PY, "resolution.py", "--theory",
                   "--head_dim", str(recipe["n_embd"] // recipe["n_head"]),
                   "--scale_base", str(scale_base), "--max_dist", str(16 * l),
                   "--json", str(out), "--plot", str(plot)]
        name = f"Figure 2 theory, scale_base {scale_base:g}"
        jobs.append(Job(name, "theory", out, command))
    return jobs


def study_train_job(args, budget, run, seed, passkey, overrides):
    data = str(Path(args.data))
    if passkey:
        data += "_passkey"
    out_dir = Path(args.runs) / run
    settings = dict(overrides, **budget["train"], seed=seed, out_dir=str(out_dir),
                    data_dir=data, device=args.device)
    config = VARIANTS[args.variant]["config"]
    return train_job(f"train {run}", config, out_dir / "ckpt.pt", settings, budget["recipe"])


def scheme_jobs(args, budget, scheme, runs, ckpts):
    """One scheme's measurements: perplexity against length under every rule (and every
    interpolation), attention resolution per run, the repeat probe, the context probe."""
    l = budget["recipe"]["block_size"]
    raw = Path(args.results) / "raw"
    # learned positions stop at block_size (the model refuses more): measured up to l only
    bounded = scheme in BOUNDED
    lengths = [n for n in study_lengths(budget) if n <= l or not bounded]
    lengths = ",".join(map(str, lengths))
    mine = [ckpts[run] for run, _, passkey, _ in runs if not passkey]
    common = [*ckpt_flags(mine), "--data_dir", str(Path(args.data)), "--device", args.device]

    def job(name, kind, what, script, *flags):
        out = raw / f"{scheme}.{what}.json"
        command = [PY, script, *common, *flags, "--json", str(out)]
        return Job(name, kind, out, command, inputs=mine)

    extrapolate = ["--lengths", lengths]
    interpolated = scheme in INTERPOLATED
    jobs = [job(f"perplexity {scheme}", "extrapolate", "ppl", "eval_extrapolate.py",
                *extrapolate, "--spans", budget["spans"], "--attention", WINDOW_RULES)]
    if interpolated:
        jobs.append(job(f"interpolation {scheme}", "scalings", "scaled", "eval_extrapolate.py",
                        *extrapolate, "--spans", budget["scaled_spans"], "--attention", "causal",
                        "--rope_scaling", SCALINGS))
    for run, _, passkey, _ in runs:
        jobs += resolution_jobs(args, budget, run, ckpts[run], passkey, bounded)
    probe = ["--probe", "repeat", "--span", str(l // 4)]
    if bounded:
        probe += ["--distances", ",".join(str(d) for d in (0, l // 8, l // 4, l // 2))]
    jobs.append(job(f"repeat probe {scheme}", "repeat", "repeat", "study/eval_retrieval.py", *probe,
                    "--sequences", str(budget["repeat_sequences"]),
                    "--attention", WINDOW_RULES))
    if interpolated:
        jobs.append(job(f"repeat probe {scheme}, interpolated", "repeat_scaled",
                        "repeat_scaled", "study/eval_retrieval.py", *probe,
                        "--sequences", str(budget["scaled_sequences"]), "--attention", "causal",
                        "--rope_scaling", SCALINGS))
    if not bounded:  # is context beyond l used? (learned positions have none)
        jobs.append(job(f"context {scheme}", "context", "context", "study/eval_retrieval.py",
                        "--probe", "context", "--lengths", str(study_lengths(budget)[-1]),
                        "--sequences", str(budget["context_spans"]),
                        "--attention", WINDOW_RULES))
    return jobs


def resolution_jobs(args, budget, run, ckpt, passkey, bounded):
    """Attention resolution of one run at 1 and 2 x l (1 x only for a bounded scheme)."""
    if passkey:
        return []
    l = budget["recipe"]["block_size"]
    jobs = []
    for m in (1,) if bounded else (1, 2):
        out = Path(args.results) / "raw" / f"{run}.resolution{m}.json"
        command = [PY, "resolution.py", "--ckpt", str(ckpt), "--data_dir", str(Path(args.data)),
                   "--device", args.device, "--length", str(m * l), "--bca", "both",
                   "--texts", str(budget["texts"]), "--json", str(out)]
        jobs.append(Job(f"resolution {run} at {m}l", "resolution", out, command, inputs=[ckpt]))
    return jobs


def passkey_job(args, budget, scheme, ckpt):
    out = Path(args.results) / "raw" / f"{scheme}.passkey.json"
    plot = Path(args.results) / f"passkey_{scheme}.png"
    lengths = ",".join(map(str, passkey_lengths(budget)))
    command = [PY, "study/eval_retrieval.py", "--ckpt", str(ckpt),
               "--data_dir", str(Path(args.data)), "--device", args.device,
               "--probe", "passkey", "--lengths", lengths,
               "--attention", WINDOW_RULES, "--sequences", str(budget["passkey_sequences"]),
               "--json", str(out), "--plot", str(plot)]
    return Job(f"passkey {scheme}", "passkey", out, command, inputs=[ckpt])


def retrieval_plan(args, budget):
    """--suite retrieval: the task records, then per scheme its training runs, each followed by
    the sweep where the windows act on that checkpoint (so that a sweep runs as soon as its
    model is trained), then one eval_retrieval.py job over its seeds (every rule; for the
    rotary schemes every interpolation too)."""
    recipe = budget["recipe"]
    data, raw = Path(args.data), Path(args.results) / "raw"
    jobs = [Job("prepare task data", "prepare", data / "meta.json",
                [PY, "prepare_data.py", "--dataset", "task", "--tasks", "all",
                 "--block_size", str(recipe["block_size"]), "--records", str(budget["records"]),
                 "--out_dir", str(data)])]
    for scheme, runs in study_runs(budget).items():
        runs = [r for r in runs if not r[2]]  # no passkey mix here: the suite has its own
        ckpts = [Path(args.runs) / run / "ckpt.pt" for run, _, _, _ in runs]
        common = ["--data_dir", str(data), "--device", args.device, "--probe", "task"]
        for (run, seed, _, overrides), ckpt in zip(runs, ckpts):
            settings = dict(overrides, **budget["train"], seed=seed, out_dir=str(ckpt.parent),
                            data_dir=str(data), device=args.device)
            jobs.append(train_job(f"train {run}", RETRIEVAL_CONFIG, ckpt, settings, recipe))
            if scheme in BOUNDED:  # learned stops at l
                continue
            # BCA, the windows and sinks where they act, every phase
            out = raw / f"{run}.sweep.json"
            jobs.append(Job(f"sweep {run}", "sweep", out,
                            [PY, "study/eval_retrieval.py", "--ckpt", str(ckpt), *common,
                             "--sweep", "--task", SWEEP_TASKS,
                             "--sequences", str(budget["sweep_sequences"]),
                             "--attention", SWEEP_RULES, "--json", str(out)],
                            inputs=[ckpt]))
        scalings = []
        if scheme in INTERPOLATED:
            scalings = ["--rope_scaling", SCALINGS]
        out = raw / f"{scheme}.tasks.json"
        jobs.append(Job(f"tasks {scheme}", "tasks", out,
                        [PY, "study/eval_retrieval.py", *ckpt_flags(ckpts), *common,
                         "--sequences", str(budget["sequences"]),
                         "--attention", WINDOW_RULES, *scalings, "--json", str(out)],
                        inputs=ckpts))
    return jobs
