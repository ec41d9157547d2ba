r"""
Does the model use the longer context? Retrieval probes for any checkpoints, under every attention
rule and RoPE interpolation that eval_extrapolate.py has.

    python study/eval_retrieval.py --ckpt CKPT [--ckpt ...] --probe repeat [--span 32] \
        [--distances 0,64,...] [--sequences 64] [--seed 0] [--attention ...] \
        [--rope_scaling ...] [--json F] [--plot F]
    python study/eval_retrieval.py --ckpt CKPT [--ckpt ...] --probe passkey \
        [--lengths 128,256,...] [--depths 0,0.25,0.5,0.75,1] [--sequences 64] [--attention ...] \
        [--rope_scaling ...] [--json F] [--plot F]
    python study/eval_retrieval.py --ckpt CKPT [--ckpt ...] --probe task [--task copy,mqar,...] \
        [--distances ...] [--lengths ...] [--sweep] [--sequences 64] [--attention ...] \
        [--rope_scaling ...] [--json F] [--plot F]
    python study/eval_retrieval.py --ckpt CKPT [--ckpt ...] --probe context [--lengths 2048] \
        [--sequences 64] [--stride 16] [--attention ...] [--json F] [--plot F]

Repeat probe (no training change): each sequence is a span of r validation tokens, d tokens of
filler from other validation text, then the same span again. Its control is the same sequence with
the first copy replaced by other text of the same length, so everything but the chance to copy is
the same. The loss is the mean NLL of the second copy's tokens after its first (those a model can
predict by copying); the retrieval gain at distance d is 1 - loss / control loss, with its standard
error over the sequences (the delta method on the paired losses). The effective context is the
largest d before the gain first falls below half its value at the shortest distance. Under BCA
information travels back at most one segment per layer: changing a token before
(t//H - n_layer)*H cannot change the logits at t, so the gain must vanish by about
n_layer * block_size / 2, which is printed beside it (n_layer * (W - 1) for a sliding window; sinks
also keep the first S tokens in sight).

Span, filler and the control's text are drawn (seeded) from the validation stream at non-overlapping
places, so the second copy can only be predicted from the first. A distance needs 2 * (2r + d)
validation tokens.

Passkey retrieval (Mohtashami & Jaggi 2023; a model trained with prepare_data.py --passkey knows the
format): documents of each total length (default 1 .. 16 x block_size), validation filler with "The
pass key is NNNNN. Remember it." at each depth (0 = the start, 1 = just before the question), then
"What is the pass key? The pass key is". The model decodes greedily as many tokens as the answer
has; a document counts when they spell the key. Accuracy over the length x depth grid: printed, as
JSON, and as a heatmap (--plot).

Task probe (a model trained on the long-range task suite, prepare_data.py --dataset task;
retrieval_tasks.py): per task, accuracy at the answers by distance (default 1/4 .. 16 x block_size)
and by total length (1 .. 16 x block_size, the answers at a distance of block_size/2), --sequences
instances a cell. The retrieval reach is the largest distance up to which accuracy stays at least
90% of its value at 1 x (the mean over the distances whose whole instance fits in a training record,
block_size + 1 tokens); none where that value is not half way from chance to 1 (no retrieval even
within the training length). MQAR is also scored per query, first to last: accuracy that climbs
across the queries as 1/(n - i) is elimination among the values not yet asked for, not recall. The
reach bound of each rule is printed beside it and drawn on the plot (one per task: --plot F writes
F_<task>).

Up to T = block_size every window rule is causal attention, so the grids above test BCA only where
it does not act. --sweep places each instance after 2 x block_size of noise, with the query of its
first answer at a phase drawn uniformly in its segment of H = block_size/2, at distances every
H/8 up to (n_layer + 1.5) x H. Under BCA a query at t sees H + (t mod H) tokens back, and through
n_layer layers n_layer x H + (t mod H): the reach bound is a range,
n_layer x H .. (n_layer + 1) x H - 1 over the phases. Each answer is counted in its zone, by where
its source lies for its own query: direct (one layer's window holds it), relay (only a path through
the layers reaches it) or beyond; and by the phase of the first answer's query.

Context probe (natural text, no training change): does the model use context beyond its training
length l? For --sequences spans of T validation tokens (default 16 x block_size; K whole spans
evenly spread, as eval_extrapolate.py --spans K), the gain at position p >= l is the NLL of its
token given only the l tokens before it (that window alone, causal) minus its NLL given everything
the rule shows (the span in one pass): positive means context beyond l is used. Every --stride-th
position from l on is scored (default: the first from l/8 up that shares no factor with BCA's
segment length, so that every phase of the segments is scored equally often), and the gain is
reported in bins [l, 2l), [2l, 4l), ... with one standard error over spans. Each row
also has matched_gain, against a reference matched to the rule: under BCA the window of the
query's own and the previous segment (what one layer attends to, in BCA's alignment), so that the
gain is only what relays through the layers from further back; under an interpolation whose s
follows the length, the last l tokens at the s of the rule's pass, so that the interpolation's
cost inside the window is not counted as context unused. It also splits the lex protocol's fall
from length l to T (chunks of l against the whole span, on the same spans) exactly into the
context used, (T - l)/T x gain, and the rest, which only fewer tokens with little context explain
(Press et al. 2021, the early-token curse; LongPPL, Fang et al. 2024, scores the tokens that need
long context in the same spirit).
"""

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

# run as `python study/eval_retrieval.py`: import from the repository root
if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from alternatives import scaling_of
from lexgpt import retrieval_tasks
from lexgpt.checkpoint import load_checkpoint, load_model, model_config
from lexgpt.cli import ArgumentParser, UserError, check_seed, error_exit, exit_interrupted
from lexgpt.data import (
    Tokenizer,
    checked,
    checkpoint_dataset,
    documents,
    passkey_document,
    passkey_parts,
    read_tokens,
    tokenizer_from_meta,
)
from lexgpt.inference_options import (
    RULE_FIELDS,
    Runtime,
    Variant,
    add_checkpoint_args,
    attention_options,
    checked_variants,
    curves_figure,
    default_batch_tokens,
    finish_curves,
    learned_length_check,
    lex_documents,
    rule_fields,
    rule_label,
    save_figure,
    scaling_label,
)
from lexgpt.outputs import distinct_outputs, output_path, pyplot, write_json
from model import GPT, AttentionPlan, GPTConfig, RopeScaling

PROBES = ("repeat", "passkey", "task", "context")
DIGITS = 5  # the passkey's digits, as prepare_data.py --passkey writes them by default
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # passkey: default depths of the key in the filler
# task probe: default distances, x block_size
DISTANCES = (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16)
# The task probe builds its instances before scoring them: a bound on their length keeps a mistyped
# --lengths from taking all memory (2^20 tokens: 1,024 x l for GPT-2's l, far past any length the
# study scores)
MAX_TASK_TOKENS = 2**20
# reach: accuracy >= 90% of that at 1 x, which must be half way from chance to 1
REACH_SHARE, RETRIEVES = 0.9, 0.5
# The tokens a probe's sequences (or a task's instances) may hold at once, built before they are
# scored: 2^25 int64 ids are 256 MiB, with the repeat probe's controls 512 MiB
MAX_PROBE_TOKENS = 2**25
ZONES = ("direct", "relay", "beyond")
PHASE_BINS = 8  # the sweep's accuracy by phase: the segment in eighths
NOT_APPLICABLE = {  # the flags a probe does not read: given, they are errors
    "repeat": ("lengths", "depths", "task", "stride", "beyond"),
    "passkey": ("distances", "span", "task", "stride", "beyond"),
    "task": ("span", "depths", "stride", "beyond"),
    "context": ("distances", "span", "task", "depths"),
}


# -------------------------------------------------------------------------------------------------
# Shared by the probes.


class Preflight(NamedTuple):
    """One checkpoint, checked before any checkpoint is scored: what the probe will score."""

    path: str
    config: GPTConfig
    data_dir: Path
    meta: dict
    sizes: object  # the probe's: distances, lengths, {task: grid}, task names or (length, spans)
    variants: list[Variant]  # the ways it is scored
    skipped: list[str]  # a line for each combination that makes no sense


def preflight(args: argparse.Namespace, path: str, rules: list, scalings: list,
              sizing: Callable) -> Preflight:
    """One checkpoint's checks before any scoring: model, dataset, the probe's sizes (from
    sizing, which returns them and the longest sequence they need) and the rules."""
    ckpt = load_checkpoint(path, mmap=True)  # lazily: the weights are read when it is scored
    config = model_config(ckpt, path)
    data_dir, meta = checkpoint_dataset(ckpt, path, args.data_dir)
    sizes, longest = sizing(args, path, config, data_dir, meta)
    if args.probe != "context" and args.sequences * longest > MAX_PROBE_TOKENS:
        raise UserError(f"--sequences {args.sequences} is not allowed for {path}: "
                        f"{args.sequences:,} sequences of up to {longest:,} tokens are more than "
                        f"{MAX_PROBE_TOKENS:,} tokens at once; at most "
                        f"{MAX_PROBE_TOKENS // longest:,}")
    learned_length_check(config, longest, path)
    variants, skipped = checked_variants(config, rules, scalings, longest, path,
                                         args.batch_tokens)
    return Preflight(path, config, data_dir, meta, sizes, variants, skipped)


def loaded(preflights: list[Preflight], device: str):
    """Each checkpoint with its model and its validation tokens, loaded in turn."""
    for pf in preflights:
        model, _ = load_model(pf.path, device)
        tokens = read_tokens(pf.data_dir, "val", pf.meta)
        # read whole, so checked whole
        stream = checked(np.asarray(tokens.tokens)[None], tokens, [0])[0]
        yield pf, model, stream


def result_row(pf: Preflight, variant: Variant, resolved_at: int, probe: str, label: str,
               **fields) -> dict:
    """A row of results: the checkpoint, its scheme, the rule's fields (resolved for sequences of
    resolved_at tokens), and the probe's fields."""
    config = pf.config
    rule_part = rule_fields(variant.rule, variant.scaling, config.block_size, resolved_at)
    return dict(ckpt=str(pf.path), pos=config.pos, **rule_part, probe=probe, label=label,
                **fields)


def finish(args, json_path, rows, notes, fields, **settings):
    """The notes, printed after the tables; with --json, the run's settings, each row's fields
    (and MQAR's by_query) and the skipped runs, written."""
    print("\n" + "\n".join(notes))
    if not json_path:
        return
    keys = ("ckpt", "pos", *RULE_FIELDS, "probe", *fields, "label")
    kept = []
    for r in rows:
        kept.append({k: r[k] for k in keys})
        if "by_query" in r:  # MQAR's rows
            kept[-1]["by_query"] = r["by_query"]
    skipped = [n for n in notes if ": skipped " in n]
    write_json(json_path, {"probe": args.probe, "sequences": args.sequences, "seed": args.seed,
                           **settings, "rows": kept, "skipped": skipped})


def parse_list(text, flag, kind, default):
    if text is None:
        return default
    try:
        return sorted({kind(x) for x in text.split(",")})
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise UserError(f"{flag} {text!r} must be comma-separated {what}") from None


def model_name(rows):
    """A function naming a row in tables and plots: its label, and its run's folder where several
    checkpoints were scored (their seeds would share a label), or the whole path where two share
    a folder name."""
    paths = {r["ckpt"] for r in rows}
    by_folder = len({Path(p).parent.name for p in paths}) == len(paths)

    def name(row):
        if len(paths) == 1:
            return row["label"]
        where = Path(row["ckpt"]).parent.name if by_folder else row["ckpt"]
        return f"{row['label']} [{where}]"

    return name


def dash(value):
    return "–" if value is None else str(value)


def bound_cell(row):
    """A sweep row's reach bound over the phases, as a table cell."""
    if not row["reach_bound"]:
        return "–"
    return f"{row['reach_bound']}–{row['reach_bound_max']}"


def sight(config, rule, phase):
    """(one layer, n_layer layers): how many tokens back a query at `phase` = t mod H sees under a
    window rule, past the first blocks; (None, None) under causal attention, which sees
    everything. BCA: query t sees from (t//H - 1) * H, H + phase back; a key there sees H further
    in the next layer down, so through n_layer layers n_layer * H + phase, from n_layer * H to
    (n_layer + 1) * H - 1 over the phases. A window sees W - 1 back (W - S - 1 for the sinks'
    recent keys) at every phase, n_layer times that through the layers."""
    if rule.name == "bca":
        H = rule.window // 2
        return H + phase, config.n_layer * H + phase
    if rule.name == "sliding":
        back = rule.window - 1
        return back, config.n_layer * back
    if rule.name == "sinks":
        back = rule.window - rule.sinks - 1
        return back, config.n_layer * back
    return None, None


def reach_bound(config, rule):
    """How far back information can travel through the layers under a window rule, at least
    (None: unbounded): for BCA n_layer * H, reached by a query at the start of its segment."""
    return sight(config, rule, 0)[1]


def zone(config, rule, phase, back):
    """Where a key `back` tokens before a query at `phase` lies: direct (one layer's window holds
    it), relay (only a path through the layers reaches it) or beyond (no path does)."""
    one, through = sight(config, rule, phase)
    if one is None or back <= one:
        return "direct"
    if back <= through:
        return "relay"
    return "beyond"


# -------------------------------------------------------------------------------------------------
# The repeat probe.


def disjoint_starts(rng, n_tokens, sizes, tries=1000):
    """Random starts for stretches of the given sizes in a stream of n_tokens, pairwise
    non-overlapping."""
    for _ in range(tries):
        starts = [int(rng.integers(0, n_tokens - size + 1)) for size in sizes]
        spans = sorted(zip(starts, sizes))
        if all(a + size <= b for (a, size), (b, _) in zip(spans, spans[1:])):
            return starts
    raise UserError(f"could not place stretches of {sizes} tokens apart in {n_tokens} "
                    "validation tokens")


def as_batch(sequences):
    return torch.from_numpy(np.stack(sequences).astype(np.int64))


def repeat_sequences(stream, span, distance, n, seed):
    """(probe, control), each (n, 2*span + distance) int64: [span][filler][span] and
    [other][filler][span]."""
    rng = np.random.default_rng([seed, distance])
    probe, control = [], []
    for _ in range(n):
        a, b, c = disjoint_starts(rng, len(stream), (span, distance, span))
        first, filler = stream[a : a + span], stream[b : b + distance]
        other = stream[c : c + span]
        probe.append(np.concatenate((first, filler, first)))
        control.append(np.concatenate((other, filler, first)))
    return as_batch(probe), as_batch(control)


def repeat_sweep_sequences(stream, span, distance, n, seed, l):
    """(probe, control, start): as repeat_sequences, each after a prefix of validation text at
    least 2l long and as much longer (< H = l/2) as puts the query of the second copy's first
    scored token at a phase drawn uniformly in its segment, then that text continued to one
    length for all (what follows cannot change what comes before); start: where each second copy
    begins."""
    H, rng = l // 2, np.random.default_rng([seed, distance, 1])
    around = 2 * l + H - 1  # the prefix and what follows the second copy, together
    probe, control, starts = [], [], []
    for _ in range(n):
        sizes = (span, distance, span, around)
        a, b, c, e = disjoint_starts(rng, len(stream), sizes)
        first, filler = stream[a : a + span], stream[b : b + distance]
        other, text = stream[c : c + span], stream[e : e + around]
        prefix = 2 * l + (int(rng.integers(0, H)) - (2 * l + span + distance)) % H
        before, after = text[:prefix], text[prefix:]
        starts.append(prefix + span + distance)
        probe.append(np.concatenate((before, first, filler, first, after)))
        control.append(np.concatenate((before, other, filler, first, after)))
    return as_batch(probe), as_batch(control), starts


def second_copy_nll(model: GPT, seqs: torch.Tensor, span: int, variant: Variant,
                    runtime: Runtime) -> torch.Tensor:
    """Per sequence, the mean NLL of the second copy's tokens after its first (predicted from
    inside the copy)."""
    T = seqs.size(1) - 1
    per_batch = max(1, variant.batch_tokens // T)
    out = []
    for i in range(0, len(seqs), per_batch):
        batch = seqs[i : i + per_batch].to(runtime.device)
        with torch.no_grad(), runtime.ctx:
            nll = model.token_nll(batch[:, :-1], batch[:, 1:], attention=variant.rule,
                                  rope_scaling=variant.scaling, chunk_tokens=variant.batch_tokens)
        # targets: the second copy's tokens 1 .. span-1
        out.append(nll[:, T - span + 1 :].double().mean(1).cpu())
    return torch.cat(out)


def second_copy_token_nll(model: GPT, seqs: torch.Tensor, starts: list[int], span: int,
                          variant: Variant, runtime: Runtime) -> torch.Tensor:
    """(n, span - 1): the NLL of each token of the second copy after its first, the copy starting
    at `starts`."""
    T = seqs.size(1) - 1
    per_batch, out = max(1, variant.batch_tokens // T), []
    for i in range(0, len(seqs), per_batch):
        batch = seqs[i : i + per_batch].to(runtime.device)
        with torch.no_grad(), runtime.ctx:
            nll = model.token_nll(batch[:, :-1], batch[:, 1:], attention=variant.rule,
                                  rope_scaling=variant.scaling, chunk_tokens=variant.batch_tokens)
        nll = nll.double().cpu()
        for j, start in enumerate(starts[i : i + per_batch]):
            out.append(nll[j, start : start + span - 1])
    return torch.stack(out)


def retrieval_gain(loss, control):
    """1 - mean(loss) / mean(control) and its standard error (delta method on the paired
    per-sequence losses)."""
    ratio = loss.mean() / control.mean()
    n = len(loss)
    stderr = math.nan
    if n > 1:
        residual = loss - ratio * control
        stderr = residual.std(unbiased=True) / (math.sqrt(n) * control.mean())
    return float(1 - ratio), float(stderr)


def effective_context(rows):
    """The largest d before the gain first falls below half its value at the shortest distance
    (rows sorted by d); None when the gain at the shortest distance is not positive."""
    g0 = rows[0]["gain"]
    if not g0 > 0:
        return None
    reach = rows[0]["d"]
    for row in rows[1:]:
        if row["gain"] < g0 / 2:
            break
        reach = row["d"]
    return reach


def check_finite_gain(gain, path, d, dtype, label):
    if not math.isfinite(gain):
        raise UserError(f"non-finite loss for {path} at d = {d} in {dtype} ({label}): evaluate "
                        "in float32 (--dtype float32)")


def repeat_rows(args: argparse.Namespace, pf: Preflight, model: GPT, stream: np.ndarray,
                runtime: Runtime, notes: list[str]) -> list[dict]:
    """The repeat probe's rows for one checkpoint, and a note per variant on its effective
    context."""
    path, config, distances = pf.path, pf.config, pf.sizes
    sequences = {d: repeat_sequences(stream, args.span, d, args.sequences, args.seed)
                 for d in distances}
    rows = []
    for variant in pf.variants:
        rule = variant.rule
        label = rule_label(config.pos, rule, variant.scaling, config.block_size)
        mine = []
        for d in distances:
            probe, control = (second_copy_nll(model, s, args.span, variant, runtime)
                              for s in sequences[d])
            gain, stderr = retrieval_gain(probe, control)
            check_finite_gain(gain, path, d, runtime.dtype, label)
            mine.append(result_row(pf, variant, 2 * args.span + d, "repeat", label, d=d,
                                   gain=gain, gain_stderr=stderr, n=len(probe),
                                   loss=float(probe.mean()),
                                   control_loss=float(control.mean())))
            if args.verbose:
                print(f"{label:>32} d={d:>6}: gain {gain:.3f} ± {stderr:.3f}", file=sys.stderr)
        reach = effective_context(mine)
        longest = rule.resolve(2 * args.span + distances[-1], config.block_size)
        bound = reach_bound(config, longest)
        notes.append(effective_context_note(label, reach, distances, longest.name, bound))
        for row in mine:
            row["effective_context"], row["reach_bound"] = reach, bound
        rows += mine
    return rows


def effective_context_note(label, reach, distances, rule_name, bound):
    if reach is None:
        context = "none (no gain at the shortest distance)"
    elif reach == distances[-1]:
        context = f">= {reach} tokens"
    else:
        context = f"{reach} tokens"
    note = f"{label}: effective context {context}"
    if bound:
        per_layer = {"bca": "block_size/2", "sliding": "(W - 1)",
                     "sinks": "(W - S - 1), and the sinks"}[rule_name]
        note += f"; reach bound n_layer x {per_layer} = {bound} tokens"
    return note


def repeat_sweep_rows(args: argparse.Namespace, pf: Preflight, model: GPT, stream: np.ndarray,
                      runtime: Runtime) -> list[dict]:
    """The repeat probe where the rule acts: per variant and distance, the gain over every scored
    token and by zone (the first copy's token direct, relayed or beyond for the query that
    predicts the second copy's)."""
    config = pf.config
    l, H, rows = config.block_size, config.block_size // 2, []
    for d in pf.sizes:
        probe, control, starts = repeat_sweep_sequences(stream, args.span, d, args.sequences,
                                                        args.seed, l)
        T = probe.size(1) - 1
        for variant in pf.variants:
            label = rule_label(config.pos, variant.rule, variant.scaling, l)
            loss, ctrl = (second_copy_token_nll(model, x, starts, args.span, variant, runtime)
                          for x in (probe, control))
            gain, stderr = retrieval_gain(loss.mean(1), ctrl.mean(1))
            check_finite_gain(gain, pf.path, d, runtime.dtype, label)
            resolved = variant.rule.resolve(T, l)
            zones = {z: [0.0, 0.0, 0] for z in ZONES}  # [loss, control loss, tokens]
            for j, start in enumerate(starts):
                for i in range(args.span - 1):  # the token at start + i + 1, from the query before
                    count = zones[zone(config, resolved, (start + i) % H, args.span + d - 1)]
                    count[0] += float(loss[j, i])
                    count[1] += float(ctrl[j, i])
                    count[2] += 1
            rows.append(result_row(pf, variant, T, "repeat", label, kind="sweep",
                                   d=d, gain=gain, gain_stderr=stderr, n=len(loss),
                                   loss=float(loss.mean()), control_loss=float(ctrl.mean()),
                                   zones=zones, reach_bound=sight(config, resolved, 0)[1],
                                   reach_bound_max=sight(config, resolved, H - 1)[1]))
            if args.verbose:
                print(f"{label:>32} sweep d={d:>6}: gain {gain:.3f} ± {stderr:.3f}",
                      file=sys.stderr)
    return rows


def gain_table(rows, distances):
    lines = ["| model | " + " | ".join(f"d={d}" for d in distances) + " |",
             "|---" * (len(distances) + 1) + "|"]
    for label in dict.fromkeys(r["label"] for r in rows):
        gain = {r["d"]: r for r in rows if r["label"] == label}
        cells = [f"{gain[d]['gain']:.3f} ± {gain[d]['gain_stderr']:.3f}" for d in distances]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def zone_gain_cell(pooled):
    """A zone's gain from its pooled [loss, control loss, tokens], and its tokens."""
    loss, control, tokens = pooled
    if not tokens:
        return "–"
    return f"{1 - loss / control:.3f} [{tokens}]"


def repeat_sweep_table(rows):
    """The gain by zone (pooled over distances) and by distance, a row per model and rule."""
    distances, name = sorted({r["d"] for r in rows}), model_name(rows)
    lines = ["| model | direct | relay | beyond | bound | "
             + " | ".join(f"d={d}" for d in distances) + " |",
             "|---" * (len(distances) + 5) + "|"]
    for label in dict.fromkeys(name(r) for r in rows):
        mine = {r["d"]: r for r in rows if name(r) == label}
        zones = []
        for z in ZONES:
            pooled = [sum(r["zones"][z][i] for r in mine.values()) for i in range(3)]
            zones.append(zone_gain_cell(pooled))
        gains = [f"{mine[d]['gain']:.3f}" if d in mine else "–" for d in distances]
        bound = bound_cell(next(iter(mine.values())))
        lines.append(f"| {label} | " + " | ".join(zones) + f" | {bound} | "
                     + " | ".join(gains) + " |")
    return "\n".join(lines)


def plot_gain(rows, block_sizes, path):
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = curves_figure(len(labels))
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        ax.errorbar([r["d"] for r in mine], [r["gain"] for r in mine],
                    yerr=[r["gain_stderr"] for r in mine], marker="o", capsize=2, label=label)
    smallest = min((r["d"] for r in rows if r["d"] > 0), default=1)
    ax.set_xscale("symlog", base=2, linthresh=smallest)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("distance d between the two copies (tokens)")
    ax.set_ylabel("retrieval gain 1 - loss / control")
    finish_curves(fig, ax, len(labels), block_sizes, path)


def checked_distances(args, data_dir, meta, grid, prefix):
    """--distances (default: grid), each placed with span, filler and control (and `prefix`
    tokens more) apart in the validation tokens: (distances, the longest sequence)."""
    distances = parse_list(args.distances, "--distances", int, grid)
    if distances[0] < 0:
        raise UserError(f"--distances {args.distances!r} must be >= 0")
    longest = 2 * args.span + distances[-1] + prefix
    n_tokens = meta["files"]["val"]["tokens"]
    if 2 * longest > n_tokens:
        pieces = "span, filler, control" + (" and prefix" if prefix else "")
        raise UserError(f"distance {distances[-1]} needs 2 x {longest} = {2 * longest} validation "
                        f"tokens to draw {pieces} apart, but {data_dir} has {n_tokens}: lower "
                        "--distances or --span")
    return distances, longest


def repeat_distances(args, path, config, data_dir, meta):
    l = config.block_size
    grid = [0] + [l * k // 8 for k in (1, 2, 4, 8, 16, 32, 64, 128)]
    return checked_distances(args, data_dir, meta, grid, prefix=0)


def repeat_sweep_distances(args, path, config, data_dir, meta):
    l, H = config.block_size, config.block_size // 2
    grid = list(range(0, (config.n_layer + 1) * H + H // 2 + 1, max(1, H // 8)))
    return checked_distances(args, data_dir, meta, grid, prefix=2 * l + H - 1)


def repeat_probe(args: argparse.Namespace, preflights: list[Preflight], runtime: Runtime,
                 json_path: Path | None, plot_path: Path | None) -> list[dict]:
    """The repeat probe: per checkpoint, rule and distance, the retrieval gain on the second
    copy; the effective context of each rule."""
    rows, notes = [], []
    for pf, model, stream in loaded(preflights, runtime.device):
        notes += pf.skipped
        rows += repeat_rows(args, pf, model, stream, runtime, notes)
    print(f"repeat probe: retrieval gain 1 - loss/control on the second copy ({args.span}-token "
          f"spans, {args.sequences} sequences per distance, seed {args.seed}, {runtime.dtype}; "
          "± one standard error)\n")
    print(gain_table(rows, sorted({r["d"] for r in rows})))
    fields = ("d", "gain", "gain_stderr", "n", "loss", "control_loss", "effective_context",
              "reach_bound")
    finish(args, json_path, rows, notes, fields, span=args.span)
    if plot_path:
        plot_gain(rows, {pf.config.block_size for pf in preflights}, plot_path)
    return rows


def repeat_sweep_probe(args: argparse.Namespace, preflights: list[Preflight], runtime: Runtime,
                       json_path: Path | None, plot_path: Path | None) -> list[dict]:
    """The repeat probe where the rule acts (--sweep): the gain by zone and by distance."""
    rows, notes = [], []
    for pf, model, stream in loaded(preflights, runtime.device):
        notes += pf.skipped
        rows += repeat_sweep_rows(args, pf, model, stream, runtime)
    print(f"repeat probe, where the rule acts (after 2 x block_size, phases uniform): retrieval "
          f"gain 1 - loss/control on the second copy by zone [tokens] and by distance "
          f"({args.span}-token spans, {args.sequences} sequences per distance, seed {args.seed}, "
          f"{runtime.dtype})\n")
    print(repeat_sweep_table(rows))
    fields = ("kind", "d", "gain", "gain_stderr", "n", "loss", "control_loss", "zones",
              "reach_bound", "reach_bound_max")
    finish(args, json_path, rows, notes, fields, span=args.span)
    if plot_path:
        plot_gain(rows, set(), plot_path)
    return rows


# -------------------------------------------------------------------------------------------------
# The passkey probe.


def passkey_batches(stream, tokenizer, length, depth, n, seed):
    """n passkey documents of `length` tokens in all (prompt and answer), at one depth, filler
    from the validation stream, seeded: a list of (prompts (b, T), answers (b, A), keys) batches,
    grouped by prompt and answer length (they differ only where a BPE tokenizer spells two keys
    in different numbers of tokens)."""
    rng = np.random.default_rng([seed, length, round(depth * 1000)])
    groups = {}
    for _ in range(n):
        key = "".join(str(d) for d in rng.integers(0, 10, size=DIGITS))
        fixed = sum(len(part) for part in passkey_parts(tokenizer, key))
        start = int(rng.integers(0, len(stream) - (length - fixed) + 1))
        filler = stream[start : start + length - fixed].tolist()
        prompt, answer = passkey_document(tokenizer, filler, depth, key)
        groups.setdefault((len(prompt), len(answer)), []).append((prompt, answer, key))
    batches = []
    for group in groups.values():
        prompts, answers, keys = zip(*group)
        batches.append((torch.tensor(prompts), torch.tensor(answers), list(keys)))
    return batches


def passkey_accuracy(model: GPT, tokenizer: Tokenizer, batches: list, variant: Variant,
                     runtime: Runtime) -> tuple[float, int]:
    """Exact-match accuracy of greedy decoding: the decoded answer tokens must begin with the
    key."""
    right = total = 0
    for prompts, answers, keys in batches:
        with torch.no_grad(), runtime.ctx:
            out = model.generate(prompts.to(runtime.device), answers.size(1), top_k=1,
                                 attention=variant.rule, rope_scaling=variant.scaling)
        for generated, key in zip(out[:, prompts.size(1) :].tolist(), keys):
            right += tokenizer.decode(generated).strip().startswith(key)
        total += len(keys)
    return right / total, total


def passkey_rows(args: argparse.Namespace, pf: Preflight, model: GPT, stream: np.ndarray,
                 depths: list[float], runtime: Runtime) -> list[dict]:
    """The passkey probe's rows for one checkpoint: accuracy per variant, length and depth."""
    config, lengths, tokenizer = pf.config, pf.sizes, tokenizer_from_meta(pf.meta)
    batches = {(n, d): passkey_batches(stream, tokenizer, n, d, args.sequences, args.seed)
               for n in lengths for d in depths}
    rows = []
    for variant in pf.variants:
        label = rule_label(config.pos, variant.rule, variant.scaling, config.block_size)
        for n in lengths:
            for d in depths:
                accuracy, count = passkey_accuracy(model, tokenizer, batches[n, d], variant,
                                                   runtime)
                rows.append(result_row(pf, variant, n, "passkey", label, length=n, depth=d,
                                       accuracy=accuracy, n=count))
                if args.verbose:
                    print(f"{label:>32} length {n:>6} depth {d:.2f}: {accuracy:.2f}",
                          file=sys.stderr)
    return rows


def accuracy_tables(rows, lengths, depths):
    """Accuracy averaged over depths per model and length, then the whole grid per model."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cell = {(r["label"], r["length"], r["depth"]): r["accuracy"] for r in rows}
    columns = " | ".join(str(n) for n in lengths)
    separator = "|---" * (len(lengths) + 1) + "|"
    lines = [f"| model (mean over depths) | {columns} |", separator]
    for label in labels:
        means = [f"{np.mean([cell[label, n, d] for d in depths]):.2f}" for n in lengths]
        lines.append(f"| {label} | " + " | ".join(means) + " |")
    for label in labels:
        lines += ["", f"| {label}: depth \\ length | {columns} |", separator]
        for d in depths:
            lines.append(f"| {d:.2f} | "
                         + " | ".join(f"{cell[label, n, d]:.2f}" for n in lengths) + " |")
    return "\n".join(lines)


def plot_heatmaps(rows, lengths, depths, path):
    plt = pyplot()
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cols = min(4, len(labels))
    n_rows = -(-len(labels) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(3.2 * cols, 2.8 * n_rows), squeeze=False)
    cell = {(r["label"], r["length"], r["depth"]): r["accuracy"] for r in rows}
    for ax, label in zip(axes.flat, labels):
        grid = np.array([[cell[label, n, d] for n in lengths] for d in depths])
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            color = "white" if v < 0.6 else "black"
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color=color)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("length (tokens)", fontsize=7)
        ax.set_ylabel("key depth", fontsize=7)
    for ax in list(axes.flat)[len(labels) :]:
        ax.axis("off")
    save_figure(fig, path)


def passkey_depths(args):
    depths = parse_list(args.depths, "--depths", float, list(DEPTHS))
    if not all(0 <= d <= 1 for d in depths):  # (NaN fails both comparisons)
        raise UserError(f"--depths {args.depths!r} must lie in [0, 1] (0: the key first, 1: just "
                        "before the question)")
    return depths


def passkey_lengths(args, path, config, data_dir, meta):
    """--lengths (default 1 .. 16 x block_size), each checked to hold a passkey document and its
    filler: (lengths, the longest)."""
    l = config.block_size
    lengths = parse_list(args.lengths, "--lengths", int, [l * k for k in (1, 2, 4, 8, 16)])
    parts = passkey_parts(tokenizer_from_meta(meta), "9" * DIGITS)
    fixed = sum(len(part) for part in parts)
    if lengths[0] <= fixed:
        raise UserError(f"--lengths: {lengths[0]} tokens cannot hold a passkey document (its key "
                        f"sentence, question and answer take {fixed})")
    n_tokens = meta["files"]["val"]["tokens"]
    if lengths[-1] - fixed > n_tokens:
        raise UserError(f"length {lengths[-1]} needs {lengths[-1] - fixed} validation tokens of "
                        f"filler, but {data_dir} has {n_tokens}: lower --lengths")
    return lengths, lengths[-1]


def passkey_probe(args: argparse.Namespace, preflights: list[Preflight], runtime: Runtime,
                  json_path: Path | None, plot_path: Path | None) -> list[dict]:
    """Passkey retrieval: per checkpoint and rule, accuracy over the length x depth grid."""
    rows, notes = [], []
    depths = passkey_depths(args)
    for pf, model, stream in loaded(preflights, runtime.device):
        notes += pf.skipped
        rows += passkey_rows(args, pf, model, stream, depths, runtime)
    print(f"passkey retrieval: exact-match accuracy of greedy decoding ({args.sequences} "
          f"documents per cell, seed {args.seed}, {runtime.dtype})\n")
    lengths = sorted({r["length"] for r in rows})
    print(accuracy_tables(rows, lengths, depths))
    finish(args, json_path, rows, notes, ("length", "depth", "accuracy", "n"), depths=depths)
    if plot_path:
        plot_heatmaps(rows, lengths, depths, plot_path)
    return rows


# -------------------------------------------------------------------------------------------------
# The task probe (retrieval_tasks.py's suite).


def task_distance(task, d):
    """d raised to the task's shortest distance, and even for flip-flop (whose instructions are
    pairs)."""
    d = max(d, retrieval_tasks.layout(task)[0])
    if task == "flipflop":
        return d + d % 2
    return d


def task_sizes(args, l, names, limit=None):
    """{task: (distances, total lengths, the distance scored at each length)}: the distances
    raised to the task's shortest (task_distance), the lengths checked to hold the task; with a
    limit (learned positions stop at block_size), only what fits in it."""
    sizes = {}
    grid = [round(k * l) for k in DISTANCES]
    for task in names:
        extra = retrieval_tasks.layout(task)[1]
        distances = parse_list(args.distances, "--distances", int, grid)
        distances = sorted({task_distance(task, d) for d in distances})
        lengths = parse_list(args.lengths, "--lengths", int, [l * k for k in (1, 2, 4, 8, 16)])
        ends = [retrieval_tasks.PREFIX + d + extra for d in distances]
        too_long = [d for d, end in zip(distances, ends) if end > MAX_TASK_TOKENS]
        check_task_tokens("--distances", too_long)
        check_task_tokens("--lengths", [n for n in lengths if n > MAX_TASK_TOKENS])
        at = task_distance(task, l // 2)
        if limit:
            distances = [d for d, end in zip(distances, ends) if end <= limit]
            lengths = [n for n in lengths if n <= limit]
        if lengths and lengths[0] < at + extra:
            raise UserError(f"--lengths {lengths[0]} cannot hold {task} at distance {at} (it "
                            f"needs {at + extra} tokens)")
        sizes[task] = (distances, lengths, at)
    return sizes


def check_task_tokens(flag, too_long):
    if too_long:
        raise UserError(f"{flag} {too_long[-1]} is not allowed: the task probe's instances hold "
                        f"at most {MAX_TASK_TOKENS:,} tokens")


def row_distance(row):
    """A distance row's d, to sort rows by."""
    return row["d"]


def retrieval_reach(rows, block_size, chance):
    """(reach, accuracy at 1 x): the largest distance up to which accuracy stays >= REACH_SHARE
    of its mean over the distances whose whole instance fits in a training record (block_size +
    1 tokens, as train.py reads them), 0 if the shortest fails already; None where that mean is
    not RETRIEVES of the way from chance to 1 (the model does not retrieve within its training
    length); (None, None) without such distances."""
    rows = sorted(rows, key=row_distance)
    within = [r["accuracy"] for r in rows if r["length"] <= block_size + 1]
    if not within:
        return None, None
    at_1x = float(np.mean(within))
    if not at_1x >= chance + RETRIEVES * (1 - chance):
        return None, at_1x
    reach = 0
    for row in rows:
        if row["accuracy"] < REACH_SHARE * at_1x:
            break
        reach = row["d"]
    return reach, at_1x


def task_cells(args, task, distances, lengths, at):
    """The task probe's cells, (kind, distance, instances): by distance, then by total length,
    --sequences instances each, seeded by the task's name and the cell (the same for any --task
    list)."""
    index, n = retrieval_tasks.TASKS.index(task), args.sequences
    cells = []
    for d in distances:
        rng = np.random.default_rng([args.seed, index, 0, d])
        instances = [retrieval_tasks.at_distance(task, rng, d) for _ in range(n)]
        cells.append(("distance", d, instances))
    for length in lengths:
        rng = np.random.default_rng([args.seed, index, 1, length])
        instances = [retrieval_tasks.at_length(task, rng, length, at) for _ in range(n)]
        cells.append(("length", at, instances))
    return cells


def score_cell(model: GPT, task: str, instances: list, variant: Variant,
               runtime: Runtime) -> tuple[float, int, list[float]]:
    """(accuracy, answers scored, accuracy by query) over a cell's instances, batched by
    variant.batch_tokens."""
    per_batch = max(1, variant.batch_tokens // len(instances[0][0]))
    scored = []
    for i in range(0, len(instances), per_batch):
        batch = instances[i : i + per_batch]
        scored.append(retrieval_tasks.accuracy(model, task, batch, variant.rule, variant.scaling,
                                               runtime.device, runtime.ctx))
    count = sum(c for _, c, _ in scored)
    accuracy = sum(a * c for a, c, _ in scored) / count
    per_query = zip(*(places for _, _, places in scored))  # each query's (right, scored) by batch
    by_query = [sum(r for r, _ in q) / sum(c for _, c in q) for q in per_query]
    return accuracy, count, by_query


def reach_note(label, task, at_1x, reach, distances, bound):
    """The note on one task's retrieval reach under one rule."""
    note = f"{label}: {task}: "
    if at_1x is not None:
        note += f"accuracy {at_1x:.2f} at 1 x; "
    if at_1x is None:
        note += "retrieval reach no instance that fits in a training record scored"
    elif reach is None:
        note += ("retrieval reach none (not half way from chance to 1 within the training "
                 "length)")
    elif reach == distances[-1]:
        note += f"retrieval reach >= {reach}"
    else:
        note += f"retrieval reach {reach}"
    if bound:
        note += f"; reach bound {bound}"
    return note


def by_query_note(label, rows, l):
    """MQAR's accuracy by query at 1 x beside what picking by elimination scores; None without
    such rows. The distances are weighted alike: each scores the same number of instances."""
    within = [r["by_query"] for r in rows
              if "by_query" in r and r["kind"] == "distance" and r["length"] <= l + 1]
    if not within:
        return None
    found = " ".join(f"{a:.2f}" for a in np.mean(within, axis=0))
    guess = " ".join(f"{a:.2f}" for a in retrieval_tasks.by_elimination(len(within[0])))
    return (f"{label}: mqar: accuracy by query, 1st to last, at 1 x: {found} (picking among the "
            f"values not yet asked for: {guess})")


def task_rows(args: argparse.Namespace, pf: Preflight, model: GPT, runtime: Runtime,
              notes: list[str]) -> list[dict]:
    """The task probe's rows for one checkpoint (accuracy by distance and by length, per task and
    variant), and a note per task and variant on its retrieval reach."""
    config = pf.config
    l, rows = config.block_size, []
    for task, (distances, lengths, at) in pf.sizes.items():
        cells = task_cells(args, task, distances, lengths, at)
        if not cells:
            notes.append(f"{pf.path}: {task}: skipped: no distance or length of it fits in {l} "
                         "positions")
            continue
        for variant in pf.variants:
            rule = variant.rule
            label = rule_label(config.pos, rule, variant.scaling, l)
            mine = []
            for kind, d, instances in cells:
                n = len(instances[0][0])
                accuracy, count, by_query = score_cell(model, task, instances, variant, runtime)
                mine.append(result_row(pf, variant, n, "task", label, task=task, kind=kind, d=d,
                                       length=n, n=count, accuracy=accuracy))
                if task == "mqar":  # which queries are right tells lookup from elimination
                    mine[-1]["by_query"] = by_query
                if args.verbose:
                    print(f"{label:>32} {task} {kind} d={d} length {n}: {accuracy:.2f}",
                          file=sys.stderr)
            by_distance = [r for r in mine if r["kind"] == "distance"]
            chance = retrieval_tasks.CHANCE[task]
            reach, at_1x = retrieval_reach(by_distance, l, chance)
            bound = reach_bound(config, rule.resolve(max(r["length"] for r in mine), l))
            for row in mine:
                row.update(accuracy_1x=at_1x, retrieval_reach=reach, reach_bound=bound)
            notes.append(reach_note(label, task, at_1x, reach, distances, bound))
            mqar = by_query_note(label, mine, l)
            if mqar:
                notes.append(mqar)
            rows += mine
    return rows


def task_table(rows, name, task, kind):
    """One task's accuracy by distance (with reach and bound) or by total length, a row per
    model."""
    by_distance = kind == "distance"
    key, letter = ("d", "d") if by_distance else ("length", "L")
    sizes = sorted({r[key] for r in rows})
    cell = {(name(r), r[key]): r for r in rows}
    title = f"{task}, by {kind}"
    if not by_distance:
        title += f" (answers at distance {', '.join(map(str, sorted({r['d'] for r in rows})))})"
    head = "| model | " + " | ".join(f"{letter}={n}" for n in sizes)
    head += " | reach | bound |" if by_distance else " |"
    lines = [title, "", head, "|---" * (len(sizes) + 1 + 2 * by_distance) + "|"]
    for label in dict.fromkeys(name(r) for r in rows):
        first = next(r for r in rows if name(r) == label)
        cells = []
        for n in sizes:
            cells.append(f"{cell[label, n]['accuracy']:.2f}" if (label, n) in cell else "–")
        tail = " |"
        if by_distance:
            tail = f" | {dash(first['retrieval_reach'])} | {dash(first['reach_bound'])} |"
        lines.append(f"| {label} | " + " | ".join(cells) + tail)
    return lines


def task_tables(rows):
    """Per task: accuracy by distance (with reach and bound) and by total length, a row per
    model."""
    out, name = [], model_name(rows)
    for task in dict.fromkeys(r["task"] for r in rows):
        for kind in ("distance", "length"):
            mine = [r for r in rows if r["task"] == task and r["kind"] == kind]
            if mine:
                out += [""] + task_table(mine, name, task, kind)
    return "\n".join(out[1:])


def task_path(path, task, n_tasks):
    """--plot F for one task of several: F with _<task> before its suffix."""
    if n_tasks == 1:
        return path
    return path.with_name(f"{path.stem}_{task}{path.suffix}")


def plot_tasks(rows, block_sizes, path):
    """One figure per task: accuracy against distance, a curve per model; the training length
    and each curve's reach bound (dotted, in its colour) marked."""
    names, name = list(dict.fromkeys(r["task"] for r in rows)), model_name(rows)
    for task in names:
        mine = [r for r in rows if r["task"] == task and r["kind"] == "distance"]
        labels = list(dict.fromkeys(name(r) for r in mine))
        fig, ax = curves_figure(len(labels))
        for label in labels:
            curve = sorted((r for r in mine if name(r) == label), key=row_distance)
            line, = ax.plot([r["d"] for r in curve], [r["accuracy"] for r in curve], marker="o",
                            label=label)
            if curve[0]["reach_bound"]:
                ax.axvline(curve[0]["reach_bound"], color=line.get_color(), ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("distance from the answer to its source (tokens); dotted: each rule's "
                      "reach bound")
        ax.set_ylabel(f"{task} accuracy")
        ax.set_title(task)
        finish_curves(fig, ax, len(labels), block_sizes, task_path(path, task, len(names)))


def check_task_data(path, data_dir, meta):
    if meta.get("chars") != retrieval_tasks.CHARS:
        raise UserError(f"{path} was not trained on the task suite ({data_dir} is not a "
                        "prepare_data.py --dataset task dataset): --probe task scores task "
                        "models only")


def task_names(args, meta):
    """--task, or the tasks the checkpoint's dataset holds."""
    return args.task or meta.get("tasks") or list(retrieval_tasks.TASKS)


def task_grid(args, path, config, data_dir, meta):
    """The task probe's cells per task (task_sizes), and the longest instance they hold."""
    check_task_data(path, data_dir, meta)
    l = config.block_size
    limit = l if config.pos == "learned" else None
    sizes = task_sizes(args, l, task_names(args, meta), limit)
    ends = []  # the longest instance by distance, and by length
    for task, (distances, lengths, _) in sizes.items():
        if distances:
            ends.append(retrieval_tasks.PREFIX + distances[-1] + retrieval_tasks.layout(task)[1])
        if lengths:
            ends.append(lengths[-1])
    longest = max(ends, default=0)
    if not longest:
        raise UserError(f"{path}: no distance or length of --probe task fits its {l} positions")
    return sizes, longest


def task_probe(args: argparse.Namespace, preflights: list[Preflight], runtime: Runtime,
               json_path: Path | None, plot_path: Path | None) -> list[dict]:
    """The task probe: per checkpoint, task and rule, accuracy by distance and by total length;
    the retrieval reach of each."""
    rows, notes = [], []
    for pf, model, _ in loaded(preflights, runtime.device):
        notes += pf.skipped
        rows += task_rows(args, pf, model, runtime, notes)
    print(f"task probe: accuracy at the answers, teacher-forced ({args.sequences} instances a "
          f"cell, seed {args.seed}, {runtime.dtype}; the passkey counts keys with every digit "
          "right)\n")
    print(task_tables(rows))
    fields = ("task", "kind", "d", "length", "accuracy", "n", "accuracy_1x", "retrieval_reach",
              "reach_bound")
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    finish(args, json_path, rows, notes, fields, tasks=tasks)
    if plot_path:
        plot_tasks(rows, {pf.config.block_size for pf in preflights}, plot_path)
    return rows


# -------------------------------------------------------------------------------------------------
# The task probe where the rule acts (--sweep).


def sweep_distances(args, config, task):
    """The sweep's distances: every H/8 (at least 1) up to H/2 past (n_layer + 1) * H, the
    farthest BCA can relay, raised to the task's shortest (task_distance)."""
    H = config.block_size // 2
    step = max(1, H // 8)
    default = list(range(step, (config.n_layer + 1) * H + H // 2 + 1, step))
    distances = parse_list(args.distances, "--distances", int, default)
    return sorted({task_distance(task, d) for d in distances})


def sweep_row(config, rule, task, d, instances, right):
    """One sweep cell's row from each instance's right answers: accuracy, and [right, scored] by
    zone and by phase."""
    H = config.block_size // 2
    zones = {z: [0, 0] for z in ZONES}
    phases = [[0, 0] for _ in range(PHASE_BINS)]
    for (text, answers), marks in zip(instances, right):
        found = retrieval_tasks.sources(task, text, answers, d)
        places = [zone(config, rule, (p - 1) % H, p - 1 - s) for p, s in zip(answers, found)]
        if len(marks) < len(places):  # the passkey's one mark needs every digit: it counts
            places = [max(places, key=ZONES.index)]  # where its worst one lies
        for place, ok in zip(places, marks):
            zones[place][0] += ok
            zones[place][1] += 1
        phase = phases[((answers[0] - 1) % H) * PHASE_BINS // H]
        phase[0] += sum(marks)
        phase[1] += len(marks)
    scored = sum(len(m) for m in right)
    return dict(task=task, kind="sweep", d=d, length=len(instances[0][0]), n=scored,
                accuracy=sum(map(sum, right)) / scored, zones=zones, by_phase=phases,
                reach_bound=sight(config, rule, 0)[1],
                reach_bound_max=sight(config, rule, H - 1)[1])


def task_sweep_rows(args: argparse.Namespace, pf: Preflight, model: GPT,
                    runtime: Runtime) -> list[dict]:
    """The sweep's rows for one checkpoint: per task, variant and distance, accuracy at instances
    placed where a window rule acts (after 2 x block_size of noise) with the first answer's
    query at a phase drawn uniformly modulo H; split by zone (direct, relay, beyond: each answer
    by where its source lies for its own query) and by the phase of the first answer's query, in
    PHASE_BINS bins."""
    config = pf.config
    l, H, rows = config.block_size, config.block_size // 2, []
    for task in pf.sizes:
        for d in sweep_distances(args, config, task):
            rng = np.random.default_rng([args.seed, retrieval_tasks.TASKS.index(task), 2, d])
            instances = []
            for _ in range(args.sequences):
                phase = int(rng.integers(0, H))
                instances.append(retrieval_tasks.at_phase(task, rng, d, 2 * l, H, phase))
            n = len(instances[0][0])
            for variant in pf.variants:
                rule, scaling = variant.rule, variant.scaling
                per_batch = max(1, variant.batch_tokens // n)
                right = []
                for i in range(0, len(instances), per_batch):
                    batch = instances[i : i + per_batch]
                    right += retrieval_tasks.right_answers(model, task, batch, rule, scaling,
                                                           runtime.device, runtime.ctx)
                label = rule_label(config.pos, rule, scaling, l)
                cell = sweep_row(config, rule.resolve(n, l), task, d, instances, right)
                rows.append(result_row(pf, variant, n, "task", label, **cell))
                if args.verbose:
                    print(f"{label:>32} {task} sweep d={d}: {cell['accuracy']:.2f}",
                          file=sys.stderr)
    return rows


def zone_accuracy_cell(total):
    """A zone's accuracy from its [right, scored], and its answers scored."""
    right, scored = total
    if not scored:
        return "–"
    return f"{right / scored:.2f} [{scored}]"


def sweep_tables(rows):
    """Per task: accuracy by zone, then by distance, a row per model and rule."""
    out, name = [], model_name(rows)
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        distances = sorted({r["d"] for r in mine})
        labels = list(dict.fromkeys(name(r) for r in mine))
        out += ["", f"{task}, where the rule acts (after 2 x block_size; phases drawn uniformly): "
                "accuracy by zone [answers scored], then by distance", "",
                "| model | direct | relay | beyond | bound |", "|---|---|---|---|---|"]
        for label in labels:
            cells = [r for r in mine if name(r) == label]
            zones = []
            for z in ZONES:
                total = [sum(r["zones"][z][i] for r in cells) for i in (0, 1)]
                zones.append(zone_accuracy_cell(total))
            out.append(f"| {label} | " + " | ".join(zones) + f" | {bound_cell(cells[0])} |")
        out += ["", "| model | " + " | ".join(f"d={d}" for d in distances) + " |",
                "|---" * (len(distances) + 1) + "|"]
        for label in labels:
            cell = {r["d"]: r["accuracy"] for r in mine if name(r) == label}
            accuracies = [f"{cell[d]:.2f}" if d in cell else "–" for d in distances]
            out.append(f"| {label} | " + " | ".join(accuracies) + " |")
    return "\n".join(out[1:])


def plot_sweep(rows, path):
    """One figure per task: accuracy against distance where the rule acts, a curve per model and
    rule; each rule's reach bound shaded over its range of phases."""
    names, name = list(dict.fromkeys(r["task"] for r in rows)), model_name(rows)
    for task in names:
        mine = [r for r in rows if r["task"] == task]
        labels = list(dict.fromkeys(name(r) for r in mine))
        fig, ax = curves_figure(len(labels))
        for label in labels:
            curve = sorted((r for r in mine if name(r) == label), key=row_distance)
            line, = ax.plot([r["d"] for r in curve], [r["accuracy"] for r in curve], marker=".",
                            label=label)
            first = curve[0]
            if first["reach_bound"]:
                ax.axvspan(first["reach_bound"], first["reach_bound_max"] + 1,
                           color=line.get_color(), alpha=0.1)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("distance from the answer to its source (tokens); shaded: each rule's "
                      "reach bound")
        ax.set_ylabel(f"{task} accuracy")
        ax.set_title(f"{task}, after 2 x block_size, phases uniform")
        finish_curves(fig, ax, len(labels), set(), task_path(path, task, len(names)))


def task_sweep_names(args, path, config, data_dir, meta):
    """The tasks the sweep scores, and its longest instance."""
    check_task_data(path, data_dir, meta)
    l, names = config.block_size, task_names(args, meta)
    longest = 0
    for task in names:
        extra = retrieval_tasks.layout(task)[1]
        farthest = sweep_distances(args, config, task)[-1]
        longest = max(longest, 2 * l + farthest + extra + l // 2 - 1)
    if longest > MAX_TASK_TOKENS:
        raise UserError(f"--distances {args.distances}: the sweep's instances would hold "
                        f"{longest:,} tokens, past the task probe's {MAX_TASK_TOKENS:,}")
    return names, longest


def task_sweep_probe(args: argparse.Namespace, preflights: list[Preflight], runtime: Runtime,
                     json_path: Path | None, plot_path: Path | None) -> list[dict]:
    """The task probe where the rule acts (--sweep): accuracy by zone and by distance."""
    rows, notes = [], []
    for pf, model, _ in loaded(preflights, runtime.device):
        notes += pf.skipped
        rows += task_sweep_rows(args, pf, model, runtime)
    print(f"task probe, where the rule acts: accuracy at the answers, teacher-forced "
          f"({args.sequences} instances a cell, seed {args.seed}, {runtime.dtype}; the passkey "
          "counts keys with every digit right)\n")
    print(sweep_tables(rows))
    fields = ("task", "kind", "d", "length", "accuracy", "n", "zones", "by_phase", "reach_bound",
              "reach_bound_max")
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    finish(args, json_path, rows, notes, fields, tasks=tasks, phase_bins=PHASE_BINS)
    if plot_path:
        plot_sweep(rows, plot_path)
    return rows


# -------------------------------------------------------------------------------------------------
# The context probe: is context beyond the training length used?


def last_l_nll(model: GPT, xy: torch.Tensor, positions: torch.Tensor, l: int,
               batch_tokens: int, runtime: Runtime) -> torch.Tensor:
    """(B, len(positions)): with inputs x = xy[:, :-1] and targets y = xy[:, 1:], the NLL of
    y[:, p] given only the l tokens x[:, p-l+1 .. p], each window a sequence of its own (positions
    0 .. l-1, causal attention, the model's own RoPE scaling: what it was trained with)."""
    x, y = xy[:, :-1], xy[:, 1:]
    windows = x.unfold(1, l, 1)[:, positions - l + 1].flatten(0, 1)  # (B * len(positions), l)
    targets = torch.full_like(windows, -1)
    targets[:, -1] = y[:, positions].flatten()
    per_batch, out = max(1, batch_tokens // l), []
    for i in range(0, len(windows), per_batch):
        inputs = windows[i : i + per_batch].to(runtime.device)
        wanted = targets[i : i + per_batch].to(runtime.device)
        with torch.no_grad(), runtime.ctx:
            nll = model.token_nll(inputs, wanted, attention="causal", chunk_tokens=batch_tokens)
        out.append(nll[:, -1].double().cpu())
    return torch.cat(out).view(len(x), len(positions))


def window_nll(model: GPT, xy: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor,
               scaling: RopeScaling, batch_tokens: int, runtime: Runtime) -> torch.Tensor:
    """(B, len(positions)): the NLL of y[:, p] given only x[:, start .. p] for each position p and
    its start, each window a sequence of its own under causal attention and `scaling`; windows
    of one length are batched together."""
    x, y = xy[:, :-1], xy[:, 1:]
    out = torch.empty(len(x), len(positions), dtype=torch.float64)
    sizes = positions - starts + 1
    for n in sorted(set(sizes.tolist())):
        at = (sizes == n).nonzero().flatten()
        windows = x.unfold(1, n, 1)[:, positions[at] - n + 1].flatten(0, 1)  # (B * len(at), n)
        targets = torch.full_like(windows, -1)
        targets[:, -1] = y[:, positions[at]].flatten()
        per_batch, nll = max(1, batch_tokens // n), []
        for i in range(0, len(windows), per_batch):
            with torch.no_grad(), runtime.ctx:
                piece = model.token_nll(windows[i : i + per_batch].to(runtime.device),
                                        targets[i : i + per_batch].to(runtime.device),
                                        attention="causal", rope_scaling=scaling,
                                        chunk_tokens=batch_tokens)
            nll.append(piece[:, -1].double().cpu())
        out[:, at] = torch.cat(nll).view(len(x), len(at))
    return out


def matched_reference(config: GPTConfig, variant: Variant, length: int,
                      positions: torch.Tensor, l: int):
    """(starts, scaling, what) of the reference matched to a rule, so that the gain is what the
    rule's pass adds beyond what one query sees directly: under BCA the window of its own and the
    previous segment (start = (p // w - 1) w, w = block_size / 2: the keys one layer attends to,
    in BCA's alignment), else the last l tokens; and an interpolation whose s follows the length
    fixed at the s of the rule's pass (dynamic NTK, whose s changes token by token, has none)."""
    plan = AttentionPlan(config, length, variant.rule, variant.scaling, torch.device("cpu"))
    scaling, what = variant.scaling, []
    if plan.rule.name == "bca":
        w = config.block_size // 2
        starts = ((positions // w - 1) * w).clamp(min=0)
        what.append("BCA's direct window, from the previous segment's start")
    else:
        starts = positions - l + 1
        what.append(f"the last {l} tokens")
    dynamic = scaling.method in ("pi", "ntk", "yarn") and scaling.factor is None
    if dynamic and plan.rope_factor > 1:
        scaling = RopeScaling(scaling.method, plan.rope_factor, scaling.original_length,
                              scaling.alpha, scaling.beta)
    if scaling.method == "dynamic_ntk":
        scaling = RopeScaling()
        what.append("unscaled (dynamic NTK's s changes token by token)")
    elif scaling != scaling_of(config):
        what.append(f"under {scaling_label(scaling)}")
    return starts, scaling, ", ".join(what)


def rule_nll(model: GPT, xy: torch.Tensor, length: int, variant: Variant,
             runtime: Runtime) -> torch.Tensor:
    """(B, T): the NLL at every position of the inputs xy[:, :-1] (targets xy[:, 1:]) cut into
    pieces of `length` (the lex protocol's), under the variant."""
    x, y = xy[:, :-1], xy[:, 1:]
    batch_tokens = variant.batch_tokens
    per_batch, out = max(1, batch_tokens // length), []
    for i in range(0, len(x), per_batch):
        row = []
        for j in range(0, x.size(1), length):
            inputs = x[i : i + per_batch, j : j + length].to(runtime.device)
            targets = y[i : i + per_batch, j : j + length].to(runtime.device)
            with torch.no_grad(), runtime.ctx:
                nll = model.token_nll(inputs, targets, attention=variant.rule,
                                      rope_scaling=variant.scaling, chunk_tokens=batch_tokens)
            row.append(nll.double().cpu())
        out.append(torch.cat(row, dim=1))
    return torch.cat(out)


def context_gain(ref, full, short, positions, l):
    """Per span: the gain from context beyond l, mean over the scored positions p >= l of
    ref[p] - full[p] (the NLL given only the last l tokens, minus that given everything the rule
    shows; positive: context beyond l is used); the same by bin [l, 2l), [2l, 4l), ...; and the
    lex protocol's fall from length l to the span's length T, mean(short) - mean(full), split
    exactly into the part that is context used, (T - l) / T x gain, and the rest: fewer tokens
    with little context (Press et al. 2021's early-token curse), estimated on the scored
    positions."""
    T = full.size(1)
    gain_at = ref - full[:, positions]
    gain = gain_at.mean(1)
    edges = [l * 2**k for k in range(int(math.log2(T // l)) + 1)] + [T]
    edges = sorted(set(e for e in edges if e <= T))
    bins, by_bin = [], []
    for a, b in zip(edges, edges[1:]):
        scored = (positions >= a) & (positions < b)
        if scored.any():
            bins.append((a, b))
            by_bin.append(gain_at[:, scored].mean(1))
    fall = short.mean(1) - full.mean(1)
    used = (T - l) / T * gain
    return dict(gain=gain, by_bin=torch.stack(by_bin, dim=1), bins=bins, fall=fall, used=used,
                early=fall - used)


def mean_and_stderr(values):
    n = len(values)
    stderr = math.nan
    if n > 1:
        stderr = float(values.std(unbiased=True) / math.sqrt(n))
    return float(values.mean()), stderr


def default_stride(l: int, block_size: int) -> int:
    """The context probe's default stride: the first from l/8 up that shares no factor with BCA's
    segment length block_size/2, so that every phase of the segments is scored equally often."""
    stride = max(1, l // 8)
    while math.gcd(stride, max(1, block_size // 2)) != 1:
        stride += 1
    return stride


def context_rows(args: argparse.Namespace, pf: Preflight, model: GPT, stream: np.ndarray,
                 runtime: Runtime, notes: list[str]) -> list[dict]:
    """The context probe's rows for one checkpoint: per variant, the gain from context beyond l
    per span, by bin, and the lex fall's split, from every --stride-th position from l on."""
    path, config, (length, spans) = pf.path, pf.config, pf.sizes
    l = config.block_size if args.beyond is None else args.beyond
    stride = args.stride or default_stride(l, config.block_size)
    positions = torch.arange(l, length, stride)
    xy = as_batch([stream[s["start"] : s["end"]] for s in spans])
    # every variant is batched as the reference is (the plain scaling's default)
    tokens = args.batch_tokens or default_batch_tokens(config, RopeScaling())
    ref = last_l_nll(model, xy, positions, l, tokens, runtime)
    rows = []
    for variant in (v._replace(batch_tokens=tokens) for v in pf.variants):
        label = rule_label(config.pos, variant.rule, variant.scaling, config.block_size)
        full = rule_nll(model, xy, length, variant, runtime)
        short = rule_nll(model, xy, l, variant, runtime)
        if not all(torch.isfinite(nll).all() for nll in (full, short, ref)):
            raise UserError(f"non-finite loss for {path} at length {length} ({label}): evaluate "
                            "in float32 (--dtype float32)")
        split = context_gain(ref, full, short, positions, l)
        row = result_row(pf, variant, length, "context", label, length=length, beyond=l,
                         stride=stride, spans=len(spans))
        for key in ("gain", "fall", "used", "early"):
            row[key], row[f"{key}_stderr"] = mean_and_stderr(split[key])
        row["by_bin"] = []
        for i, (start, end) in enumerate(split["bins"]):
            gain, stderr = mean_and_stderr(split["by_bin"][:, i])
            row["by_bin"].append(dict(start=start, end=end, gain=gain, gain_stderr=stderr))
        row["per_span"] = {k: split[k].tolist() for k in ("gain", "fall", "used", "early")}
        row["per_span"]["by_bin"] = split["by_bin"].tolist()
        # the gain against the reference matched to the rule (matched_reference)
        starts, scaling, what = matched_reference(config, variant, length, positions, l)
        matched = ref  # the last l tokens under the model's own scaling
        if what != f"the last {l} tokens":
            matched = window_nll(model, xy, positions, starts, scaling, tokens, runtime)
        if not torch.isfinite(matched).all():
            raise UserError(f"non-finite loss for {path} at length {length} ({label}): evaluate "
                            "in float32 (--dtype float32)")
        own = context_gain(matched, full, short, positions, l)
        row["matched_reference"] = what
        row["matched_gain"], row["matched_gain_stderr"] = mean_and_stderr(own["gain"])
        row["matched_by_bin"] = []
        for i, (start, end) in enumerate(own["bins"]):
            gain, stderr = mean_and_stderr(own["by_bin"][:, i])
            row["matched_by_bin"].append(dict(start=start, end=end, gain=gain,
                                              gain_stderr=stderr))
        row["per_span"]["matched_gain"] = own["gain"].tolist()
        row["per_span"]["matched_by_bin"] = own["by_bin"].tolist()
        rows.append(row)
        if args.verbose:
            print(f"{label:>32}: gain {row['gain']:.4f} ± {row['gain_stderr']:.4f}",
                  file=sys.stderr)
    notes.append(f"{path}: {len(spans)} spans of {length} validation tokens; the reference "
                 f"scores every {stride}th position from {l} on given only the {l} tokens "
                 "before it")
    return rows


def context_table(rows):
    bins = rows[0]["by_bin"] if rows else []
    head = ["gain, l .. T"] + [f"{b['start']} .. {b['end']}" for b in bins]
    head += ["lex fall l -> T", "context used", "fewer early tokens"]
    lines = ["| model | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    name = model_name(rows)
    for r in rows:
        cells = [f"{r['gain']:.4f} ± {r['gain_stderr']:.4f}"]
        cells += [f"{b['gain']:.4f}" for b in r["by_bin"]]
        cells += [f"{r[k]:.4f} ± {r[k + '_stderr']:.4f}" for k in ("fall", "used", "early")]
        lines.append(f"| {name(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_context(rows, path):
    """The gain from context beyond l by bin of position, a curve per model and rule, with one
    standard error."""
    labels, name = [], model_name(rows)
    fig, ax = curves_figure(len(rows))
    for r in rows:
        centres = [(b["start"] + b["end"]) / 2 for b in r["by_bin"]]
        ax.errorbar(centres, [b["gain"] for b in r["by_bin"]],
                    yerr=[b["gain_stderr"] for b in r["by_bin"]], marker="o", capsize=2,
                    label=name(r))
        labels.append(name(r))
    ax.set_xscale("log", base=2)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("NLL given the last l tokens - NLL under the rule")
    finish_curves(fig, ax, len(labels), set(), path)


def context_spans(args, path, config, data_dir, meta):
    """The context probe's one length (above l: block_size, or --beyond) and the spans of it
    scored: ((length, spans), length)."""
    l = config.block_size
    beyond = l if args.beyond is None else args.beyond
    if beyond < 2 or beyond > l:
        raise UserError(f"--beyond {args.beyond} is not allowed for {path}: from 2 to its "
                        f"block_size {l}")
    lengths = parse_list(args.lengths, "--lengths", int, [16 * l])
    if len(lengths) != 1 or lengths[0] <= beyond:
        above = f"block_size {l}" if args.beyond is None else f"--beyond {beyond}"
        raise UserError(f"--lengths {args.lengths!r}: --probe context takes one length, above "
                        f"{above}")
    length = lengths[0]
    offsets = documents(data_dir, "val", meta)
    spans = lex_documents(offsets, length, str(args.sequences), ("--lengths", "--sequences"))[0]
    return (length, spans), length


def context_probe(args: argparse.Namespace, preflights: list[Preflight], runtime: Runtime,
                  json_path: Path | None, plot_path: Path | None) -> list[dict]:
    """The context probe: per checkpoint and rule, the gain from context beyond l, by bin of
    position, and the split of the lex protocol's fall."""
    rows, notes = [], []
    for pf, model, stream in loaded(preflights, runtime.device):
        notes += pf.skipped
        rows += context_rows(args, pf, model, stream, runtime, notes)
    print(f"context probe: the gain from context beyond l (block_size, or --beyond), NLL given "
          f"only the last l tokens minus NLL under the rule (nats per token; ± one standard "
          f"error over spans; {runtime.dtype})\n")
    print(context_table(rows))
    fields = ("length", "beyond", "stride", "spans", "gain", "gain_stderr", "by_bin", "fall",
              "fall_stderr", "used", "used_stderr", "early", "early_stderr", "matched_reference",
              "matched_gain", "matched_gain_stderr", "matched_by_bin", "per_span")
    finish(args, json_path, rows, notes, fields)
    if plot_path:
        plot_context(rows, plot_path)
    return rows


# -------------------------------------------------------------------------------------------------
# The command.

# Per probe (and --sweep): what it checks of each checkpoint before any work, and what it runs.
PROBE_STEPS = {
    "repeat": (repeat_distances, repeat_probe),
    "repeat_sweep": (repeat_sweep_distances, repeat_sweep_probe),
    "passkey": (passkey_lengths, passkey_probe),
    "task": (task_grid, task_probe),
    "task_sweep": (task_sweep_names, task_sweep_probe),
    "context": (context_spans, context_probe),
}


def check_args(args):
    """The flags' own checks, before any work; args.task becomes a list and args.span gets its
    default."""
    if args.sweep and args.probe not in ("task", "repeat"):
        raise UserError(f"--sweep applies to --probe task and repeat only, not --probe "
                        f"{args.probe}")
    sweep = " --sweep" if args.sweep else ""
    for flag in NOT_APPLICABLE[args.probe] + (("lengths",) if args.sweep else ()):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag} does not apply to --probe {args.probe}{sweep}")
    for flag in ("stride", "batch_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag} {value} is not allowed: must be >= 1")
    if args.probe == "task" and args.distances is not None:
        if min(parse_list(args.distances, "--distances", int, [])) < 1:
            raise UserError(f"--distances {args.distances!r} is not allowed: distances from an "
                            "answer to its source are >= 1")
    if args.task is not None:
        try:
            args.task = retrieval_tasks.parse_tasks(args.task, "--task")
        except ValueError as e:
            raise UserError(str(e)) from None
    args.span = 32 if args.span is None else args.span
    if args.sequences < 1:
        raise UserError(f"--sequences {args.sequences} is not allowed: must be >= 1")
    if args.span < 2:
        raise UserError(f"--span {args.span} is not allowed: must be >= 2 (the second copy's "
                        "tokens after its first are scored)")
    check_seed(args.seed)
    passkey_depths(args)


def task_plot_path(args: argparse.Namespace, preflights: list[Preflight]) -> tuple[Path, list]:
    """--plot F of the task probe: F_<task> per task where there are several, each checked (F
    itself is never written); also the files written."""
    path = Path(args.plot)
    if not path.suffix:
        path = Path(args.plot + ".png")
    names = list(dict.fromkeys(t for pf in preflights for t in pf.sizes))
    files = [output_path(task_path(path, task, len(names)), "--plot", plot=True)
             for task in names]
    return path, files


def evaluate(args):
    check_args(args)
    name = args.probe + ("_sweep" if args.sweep else "")
    sizing, probe = PROBE_STEPS[name]
    per_task = args.probe == "task" and args.plot is not None  # F_<task> for several tasks
    json_path = output_path(args.json, "--json")
    plot_path = output_path(None if per_task else args.plot, "--plot", plot=True)
    rules, scalings = attention_options(args, several=True)
    preflights = [preflight(args, path, rules, scalings, sizing) for path in args.ckpt]
    if not any(pf.variants for pf in preflights):  # else an empty table, status 0
        raise UserError("nothing to score: every combination is skipped: "
                        + "; ".join(line for pf in preflights for line in pf.skipped))
    plots = [plot_path]
    if per_task:
        plot_path, plots = task_plot_path(args, preflights)
    distinct_outputs([("--json", json_path)] + [("--plot", p) for p in plots])
    runtime = Runtime.local(args.device, args.dtype)
    return probe(args, preflights, runtime, json_path, plot_path)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", action="append", required=True,
                   help="a checkpoint; repeat to compare several")
    p.add_argument("--probe", default="repeat", choices=PROBES)
    p.add_argument("--span", type=int, help="repeat: tokens in each copy (default: 32)")
    p.add_argument("--task", help="task: comma-separated, of " + ", ".join(retrieval_tasks.TASKS)
                   + " (default: those the checkpoint's dataset holds)")
    p.add_argument("--distances", help="repeat: filler lengths d (default: 0 and block_size/8 .. "
                   "16 x block_size); task: distances from answer to source (default: 1/4 .. 16 "
                   "x block_size)")
    p.add_argument("--sweep", action="store_true", help="task, repeat: where a window rule acts, "
                   "after 2 x block_size, the first scored token's query at a phase drawn "
                   "uniformly in its segment, at distances every H/8 to (n_layer + 1.5) x H; "
                   "accuracy (task) or gain (repeat) by zone (direct, relay, beyond); task: "
                   "instead of the distance and length grids")
    p.add_argument("--lengths", help="passkey, task: total lengths in tokens (default: 1 .. 16 x "
                   "block_size)")
    p.add_argument("--depths", help="passkey: where the key sits in the filler, 0 .. 1 (default: "
                   "0,0.25,0.5,0.75,1)")
    p.add_argument("--sequences", type=int, default=64, help="sequences per distance (repeat) or "
                   "per cell (passkey)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stride", type=int, help="context: score every S-th position from L "
                   "(--beyond) on against the last L tokens alone (default: the first from L/8 "
                   "up that shares no factor with block_size/2, so every phase of BCA's "
                   "segments is scored: 17 at L = 128)")
    p.add_argument("--beyond", type=int, help="context: the gain from context beyond L tokens "
                   "(default: block_size; a model fine-tuned longer against its original "
                   "length, say)")
    p.add_argument("--batch_tokens", type=int, help="repeat: tokens per forward pass (as in "
                   "eval_extrapolate.py)")
    add_checkpoint_args(p, several=True)
    p.add_argument("--json")
    p.add_argument("--plot", help="repeat: gain against distance; passkey: accuracy heatmaps; "
                   "task: accuracy against distance, a file per task")
    p.add_argument("--verbose", action="store_true", help="a line per result as it finishes")
    return p.parse_args(argv)


def interrupted():
    return ("nothing was written (the tables, --json and the plots come once every row is "
            "measured); run the command again")


def main(argv=None):
    try:
        return evaluate(parse_args(argv))
    except UserError as e:
        error_exit("eval_retrieval.py", e)  # once under torchrun, from rank 0
    except KeyboardInterrupt:
        exit_interrupted("eval_retrieval.py", interrupted)


if __name__ == "__main__":
    main()
