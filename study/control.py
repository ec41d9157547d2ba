"""
reproduce.py --suite control: the context probe's positive control. The probe's verdict that
context beyond the training length l is not used under BCA means something only where the probe
can see a gain that exists. On the study's corpus (Shakespeare, characters) even models trained
at 4l gain nothing measurable from context beyond l inside their own length, so the control is
run on a corpus with long-range structure, the Python sources of the pinned numpy (characters;
identifiers recur far apart), at a shorter l (CONTROL_L). A model trained at 4l under causal
attention must gain from context beyond l there, with a t interval over seeds that excludes 0;
then BCA's question is asked on the same corpus: models trained at l, xPos and RoPE, scored past
l with BCA.
"""

import sysconfig
from pathlib import Path

from lexgpt.cli import UserError
from study.files import check_outputs, check_raw, write_summary
from study.jobs import (
    PY,
    SEEDS,
    VARIANTS,
    XPOS_HALF,
    Job,
    ckpt_flags,
    read_result,
    scheme_settings,
    train_job,
)
from study.report import machine_of, note, spread, t_interval, wall_time

# The corpus: every .py file of the installed numpy (requirements.txt pins its version), as
# characters; validation documents held out with the study's first seed
CONTROL_CORPUS = "numpy/**/*.py"
# The training length l: 64, not the study's 128. At this size a model trained at 512 on this
# corpus uses context up to about 128 characters back and none beyond (its gain from context
# beyond 128 is -0.0014 +- 0.0026 nats, beyond 64 +0.0198 +- 0.0053: one seed, 64 spans), so
# only at l = 64 is there context beyond l for a model to use. The study's recipe otherwise, with
# as many tokens an iteration (4,096: 64 sequences of 64).
CONTROL_L = 64
# (name, train.py overrides): the control, RoPE trained at 4l (16 sequences of 256), and at 8l
# (8 of 512); RoPE and xPos at l
CONTROL_MODELS = (
    ("long", dict(pos="rope")),
    ("long8", dict(pos="rope")),
    ("rope", dict(pos="rope")),
    ("xpos", XPOS_HALF),
)
# Every model's probe, on 512 spans (with 64, each seed's gain has a standard error about half
# the gain, too much for a t interval over 3 seeds): the gain from context beyond l at every
# 15th position (15 and H = 32 share no factor, so every phase of BCA's segments is scored
# equally often), under causal
# attention for the control inside its own length (4l), and past l for the models trained at l,
# causal and under BCA
CONTROL_STRIDE = 15
CONTROL_PROBES = {"long": ("causal", 4), "long8": ("causal", 8), "rope": ("causal,bca", 16),
                  "xpos": ("causal,bca", 16)}
CONTROL_BUDGETS = {
    "full": dict(train=dict(block_size=CONTROL_L, batch_size=64, gradient_accumulation_steps=1),
                 spans=512),
    "toy": dict(train=dict(max_iters=2, lr_decay_iters=2, warmup_iters=1, n_layer=1, n_head=2,
                           n_embd=16, batch_size=8, gradient_accumulation_steps=1, eval_iters=1,
                           eval_interval=2, log_interval=1), spans=1),
}


def corpus_glob():
    """The corpus's --path: the installed numpy's sources, under this interpreter's
    site-packages."""
    return str(Path(sysconfig.get_paths()["purelib"]) / CONTROL_CORPUS)


def control_plan(args, budget):
    """The corpus, each model's three seeds, and each model's context probe."""
    recipe, data, runs = budget["recipe"], Path(args.data), Path(args.runs)
    raw = Path(args.results) / "raw"
    l = recipe["block_size"]
    jobs = [Job("prepare the code corpus", "prepare", data / "meta.json",
                [PY, "prepare_data.py", "--dataset", "files", "--path", corpus_glob(),
                 "--tokenizer", "char", "--seed", str(SEEDS[0]), "--out_dir", str(data)])]
    for name, overrides in CONTROL_MODELS:
        if name not in budget["schemes"]:
            continue
        ckpts = []
        for seed in SEEDS:
            ckpt = runs / f"{name}_s{seed}" / "ckpt.pt"
            settings = scheme_settings(overrides, recipe)
            settings.update(budget["train"], seed=seed, out_dir=str(ckpt.parent),
                            data_dir=str(data), device=args.device)
            if name.startswith("long"):  # at 4l (8l), as many tokens an iteration
                multiple = CONTROL_PROBES[name][1]
                settings.update(block_size=multiple * l,
                                batch_size=settings["batch_size"] // multiple)
            jobs.append(train_job(f"train {name}_s{seed}", VARIANTS["char"]["config"], ckpt,
                                  settings, recipe, max_iters=recipe["max_iters"]))
            ckpts.append(ckpt)
        rules, multiple = CONTROL_PROBES[name]
        out = raw / f"{name}.context.json"
        jobs.append(Job(f"context {name}", "context", out,
                        [PY, "study/eval_retrieval.py", *ckpt_flags(ckpts), "--data_dir",
                         str(data), "--device", args.device, "--probe", "context",
                         "--attention", rules, "--beyond", str(l), "--lengths",
                         str(multiple * l), "--stride", str(CONTROL_STRIDE), "--sequences",
                         str(budget["spans"]), "--json", str(out)], inputs=ckpts))
    return jobs


def control_rows(args, name):
    """{label: {seed place: row}} of raw/<name>.context.json, measured on this suite's own
    checkpoints; the others are noted and left out."""
    path = Path(args.results) / "raw" / f"{name}.context.json"
    result = read_result(path) if path.exists() else None
    own = {str(Path(args.runs) / f"{name}_s{seed}" / "ckpt.pt"): i for i, seed in enumerate(SEEDS)}
    found = {}
    for row in (result or {}).get("rows", []):
        place = own.get(str(Path(str(row["ckpt"]))))
        if place is None:
            note(f"note: {path}: the rows of {row['ckpt']} are left out: not one of this "
                 "suite's checkpoints")
            continue
        found.setdefault(row["label"], {})[place] = row
    return found


def control_report(args, budget, measured=True):
    """results/control/summary.json and tables.md: per model and rule, the gain from context
    beyond l (over l .. T and by bin), mean ± std over seeds with each seed's value, and the 95%
    t interval over seeds; the verdict of the control and of BCA read from the intervals."""
    results = Path(args.results)
    check_outputs(results, "control")
    check_raw(results)
    table = {}
    for name, _ in CONTROL_MODELS:
        for label, by_seed in control_rows(args, name).items():
            gains = [by_seed[s]["gain"] if s in by_seed else None for s in range(len(SEEDS))]
            row = {"gain": spread(gains), "gain interval": t_interval([g for g in gains
                                                                        if g is not None])}
            # against the reference matched to the rule (under BCA: relay alone)
            matched = [by_seed[s].get("matched_gain") if s in by_seed else None
                       for s in range(len(SEEDS))]
            if any(m is not None for m in matched):
                row["matched reference"] = next(r["matched_reference"] for r in by_seed.values())
                row["matched gain"] = spread(matched)
                row["matched gain interval"] = t_interval([m for m in matched if m is not None])
            bins = {}
            for place, r in by_seed.items():
                for b in r.get("by_bin", []):
                    bins.setdefault(f"gain {b['start']}..{b['end']}", {})[place] = b["gain"]
            for column, values in bins.items():
                row[column] = spread([values.get(s) for s in range(len(SEEDS))])
                row[column + " interval"] = t_interval(list(values.values()))
            table[f"{name}: {label}"] = row
    if not table and any((results / "raw").glob("*.json")):
        raise UserError(f"--results {results}: no row of its raw/ was measured on this suite's "
                        f"checkpoints (under --runs {args.runs}): give the --runs of the run "
                        "that measured them; nothing was written")
    summary = {"suite": "control", "budget": args.budget, "recipe": budget["recipe"],
               "corpus": CONTROL_CORPUS, "seeds": list(SEEDS), "stride": CONTROL_STRIDE,
               "wall_time": wall_time(args, budget, control_plan),
               "machine": machine_of(args, measured), "table": table}
    summary = write_summary(results / "summary.json", summary)
    (results / "tables.md").write_text(control_markdown(summary))
    print(f"wrote {results / 'tables.md'}")


def interval_text(interval):
    if interval is None:
        return "n/a"
    low, high = interval
    where = "excludes 0" if low > 0 or high < 0 else "holds 0"
    return f"[{low:.4f}, {high:.4f}] ({where})"


def control_markdown(summary):
    l = summary["recipe"]["block_size"]
    lines = [f"Context probe, positive control: the gain from context beyond l = {l} on the "
             f"Python sources of numpy (characters), nats per token, mean ± std over seeds "
             f"[each seed], 95% t interval over seeds; every {summary['stride']}th position; "
             f"{summary['budget']} budget, on {summary['machine']}.", "",
             "| model: rule | reference | gain | 95% t interval (seeds) |", "|---|---|---|---|"]
    for name, row in summary["table"].items():
        lines.append(f"| {name} | the last {l} tokens | {gain_text(row['gain'])} | "
                     f"{interval_text(row['gain interval'])} |")
        if row.get("matched reference", f"the last {l} tokens") != f"the last {l} tokens":
            lines.append(f"| {name} | {row['matched reference']} | "
                         f"{gain_text(row['matched gain'])} | "
                         f"{interval_text(row['matched gain interval'])} |")
    return "\n".join(lines) + "\n"


def gain_text(g):
    g = g or {}
    seeds = " / ".join("n/a" if v is None else f"{v:.4f}" for v in g.get("values", []))
    mean = "n/a" if g.get("mean") is None else f"{g['mean']:.4f} ± {g['std'] or 0:.4f}"
    return f"{mean} [{seeds}]"
