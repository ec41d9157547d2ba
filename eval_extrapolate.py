r"""
Perplexity against evaluation length, the paper's Table 2 (and Table 5 with --bca both), for any
checkpoints, and against what people use instead: windows (sliding, attention sinks) and RoPE
interpolation (PI, NTK, YaRN).

    python eval_extrapolate.py --ckpt out/a/ckpt.pt [--ckpt out/b/ckpt.pt ...] \
        --lengths 256,512,1024,2048,4096 \
        [--bca auto|on|off|both | --attention causal,bca,sliding,sinks [--window W] [--sinks S]] \
        [--rope_scaling none,pi,ntk,dynamic_ntk,yarn [--rope_factor F]] \
        [--protocol lex|chunks|sliding] [--max_len N] [--spans first|all|K] [--stride S] \
        [--data_dir D] [--json out.json] [--plot out.png] [--plot_positions pos.png]

Protocols, all on the validation split:
- lex (paper §4.2, default): every validation document with at least max_len+1 tokens contributes
  its first max_len predicted tokens, cut into pieces of each length (the last one shorter when the
  length does not divide max_len); every token is scored, so all lengths score the same tokens.
  Shorter documents are skipped and counted. max_len defaults to the largest length. A corpus of
  few long documents gives the paper's protocol too few tokens to tell 1% apart: --spans all takes
  every whole max_len span of each document instead of its first (a deviation from the paper, said
  in the output), and --spans K takes K of those, evenly spread.
- chunks: non-overlapping chunks of the length over the whole validation stream (ALiBi's tables).
- sliding: windows of the length every S tokens (default length/2); each window scores only the
  tokens the previous windows did not (the last S), so every token is scored once, and every token
  after the first window with at least length-S tokens of context (the first window's tokens have
  less, as in any protocol).
BCA: auto uses it only for lengths beyond the checkpoint's block_size (the paper's Table 2); on/off
force it; both reports every checkpoint and length with and without it (Table 5). --attention and
--rope_scaling take comma-separated lists instead: one row per checkpoint x attention rule x
interpolation, and the combinations that make no sense (interpolation on ALiBi or learned
positions, or where no query sees past block_size) are skipped and listed; a run with nothing left
to score is an error. --rope_factor on a fine-tuned checkpoint counts over the original length it
stores, as its own scaling does (each row's rope_original_length); without it, s follows the
length from there (YaRN's dynamic rule, docs/alternatives.md). --yarn_alpha and --yarn_beta move
YaRN's ramp. Runs under torchrun too: pieces are shared out among the
ranks and the sums all-reduced. Every checkpoint, dataset, rule and length is checked before the
first one is scored; a non-finite NLL stops with an error instead of a NaN in the table.
"""

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from lexgpt.checkpoint import load_checkpoint, load_model, model_config
from lexgpt.cli import ArgumentParser, UserError, error_exit, exit_interrupted
from lexgpt.data import TokenFile, checked, checkpoint_dataset, documents, read_tokens
from lexgpt.inference_options import (
    BCA_MODES,
    RULE_FIELDS,
    Runtime,
    Variant,
    add_checkpoint_args,
    attention_options,
    checked_variants,
    curves_figure,
    finish_curves,
    learned_length_check,
    lex_documents,
    rule_fields,
    rule_label,
)
from lexgpt.outputs import output_path, write_json
from model import GPT, AttentionRule, RopeScaling


def parse_lengths(text):
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--lengths {text!r} must be comma-separated integers, "
                        "e.g. 256,512,1024") from None
    if not lengths or min(lengths) < 1:
        raise UserError(f"--lengths {text!r} must be positive")
    return sorted(set(lengths))


def cut_pieces(protocol, length, n_tokens, docs, max_len, stride):
    """(start, size, first_scored): inputs stream[start : start+size] predict
    stream[start+1 : start+size+1], and positions first_scored .. size-1 of the window are
    scored."""
    if protocol == "lex":
        return [(d["start"] + i, min(length, max_len - i), 0)
                for d in docs for i in range(0, max_len, length)]
    if protocol == "chunks":
        return [(i, length, 0) for i in range(0, n_tokens - length, length)]
    out = []
    scored_until = 0  # the sliding protocol: targets up to index scored_until are done
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + length, n_tokens - 1)
        out.append((begin, end - begin, scored_until - begin if scored_until > begin else 0))
        scored_until = end
        if end == n_tokens - 1:
            break
    return out


@torch.no_grad()
def score(model: GPT, stream: TokenFile, pieces: list[tuple[int, int, int]], length: int,
          variant: Variant, runtime: Runtime) -> torch.Tensor:
    """Sum of NLL, tokens scored, and per-position sums and counts, over this rank's share of
    pieces, summed over the ranks. Memory: at most variant.batch_tokens tokens per forward pass; a
    longer sequence is streamed through the KV cache batch_tokens tokens at a time, which under
    BCA keeps memory flat at any length."""
    device, batch_tokens = runtime.device, variant.batch_tokens
    # nll, tokens, pos_nll[L], pos_count[L]
    sums = torch.zeros(2 + 2 * length, dtype=torch.float64, device=device)
    mine = pieces[runtime.rank :: runtime.world]
    by_size = {}
    for seg in mine:
        by_size.setdefault(seg[1], []).append(seg)
    for size, group in by_size.items():
        per_batch = max(1, batch_tokens // size)
        for b in range(0, len(group), per_batch):
            batch = group[b : b + per_batch]
            starts = np.array([s for s, _, _ in batch])
            rows = np.stack([stream.tokens[s : s + size + 1] for s in starts])
            xy = checked(rows, stream, starts).astype(np.int64)
            x, y = torch.from_numpy(xy[:, :-1]).to(device), torch.from_numpy(xy[:, 1:])
            with runtime.ctx:
                nll = model.token_nll(x, y.to(device), attention=variant.rule,
                                      rope_scaling=variant.scaling, chunk_tokens=batch_tokens)
            first_scored = torch.tensor([f for _, _, f in batch], device=device)
            scored = torch.arange(size, device=device)[None, :] >= first_scored[:, None]
            nll = nll.double() * scored
            sums[0] += nll.sum()
            sums[1] += scored.sum()
            sums[2 : 2 + size] += nll.sum(0)
            sums[2 + length : 2 + length + size] += scored.sum(0)
    return runtime.all_reduce_sum(sums).cpu()


def markdown_table(rows, lengths):
    """Rows: checkpoint's scheme with its attention rule and interpolation, columns: lengths; an
    up-arrow where perplexity rises."""
    header = "| model | " + " | ".join(str(n) for n in lengths) + " |"
    lines = [header, "|---" * (len(lengths) + 1) + "|"]
    for label in dict.fromkeys(r["label"] for r in rows):
        ppl = {r["length"]: r["ppl"] for r in rows if r["label"] == label}
        cells = []
        previous = None
        for n in lengths:  # a length not scored (a run stopped early) is left blank
            rise = previous is not None and n in ppl and ppl[n] > previous
            cells.append(f"{ppl[n]:.3f}{' ↑' if rise else ''}" if n in ppl else "")
            previous = ppl.get(n)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, lengths, block_sizes, path):
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = curves_figure(len(labels))
    for label in labels:
        ppl = [next(r["ppl"] for r in rows if r["label"] == label and r["length"] == n)
               for n in lengths]
        ax.plot(lengths, ppl, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    finish_curves(fig, ax, len(labels), block_sizes, path)


def plot_positions(rows, curves, block_sizes, path):
    """Mean loss against position within the sequence, at the largest length, per row label: does
    the loss keep falling past block_size? Positions are averaged in bins evenly spaced on the log
    axis (each position alone is a mean over few pieces, and noisy)."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = curves_figure(len(labels))
    longest = max(c["length"] for c in curves)
    for label, curve in zip((r["label"] for r in rows), curves):
        if curve["length"] != longest:
            continue
        nll = np.array(curve["mean_nll"])
        edges = np.unique(np.geomspace(1, longest + 1, 48).astype(int))
        centres = [(a + b - 1) / 2 for a, b in zip(edges, edges[1:])]
        means = [nll[a - 1 : b - 1].mean() for a, b in zip(edges, edges[1:])]
        ax.plot(centres, means, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"position in the sequence (pieces of {longest} tokens)")
    ax.set_ylabel("mean loss (nats per token)")
    finish_curves(fig, ax, len(labels), block_sizes, path)


class Request(NamedTuple):
    """What the command line asks for, checked before any checkpoint is read (check_args)."""

    lengths: list[int]
    max_len: int
    rules: list[AttentionRule]
    scalings: list[RopeScaling | None]  # None: each checkpoint's own
    json_path: Path | None
    plot_path: Path | None
    positions_path: Path | None


def check_args(args: argparse.Namespace) -> Request:
    """Everything about the command line that can be checked before a checkpoint is read."""
    lengths = parse_lengths(args.lengths)
    for flag in ("max_len", "batch_tokens", "stride"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag} {getattr(args, flag)} is not allowed: must be >= 1")
    max_len = args.max_len or lengths[-1]
    if args.protocol == "lex" and lengths[-1] > max_len:
        raise UserError(f"length {lengths[-1]} is above --max_len {max_len}: the lex protocol cuts "
                        "each document's first max_len tokens into pieces")
    # isdigit() alone takes "²"
    whole_number = args.spans.isascii() and args.spans.isdigit() and int(args.spans) >= 1
    if args.spans not in ("first", "all") and not whole_number:
        raise UserError(f"--spans {args.spans!r} is not allowed: first, all, "
                        "or a whole number >= 1")
    if args.spans != "first" and args.protocol != "lex":
        raise UserError(f"--spans {args.spans} applies to the lex protocol only, "
                        f"not --protocol {args.protocol}")
    if args.stride is not None and args.stride > lengths[0]:
        raise UserError(f"--stride {args.stride} is longer than length {lengths[0]}")
    rules, scalings = attention_options(args, several=True)
    outputs = (output_path(args.json, "--json"), output_path(args.plot, "--plot", plot=True),
               output_path(args.plot_positions, "--plot_positions", plot=True))
    named = [o.resolve() for o in outputs if o is not None]
    if len(set(named)) < len(named):
        raise UserError(f"--json, --plot and --plot_positions name the same file "
                        f"({', '.join(map(str, named))}): "
                        "each needs its own, or the last would replace the others")
    return Request(lengths, max_len, rules, scalings, *outputs)


class Preflight(NamedTuple):
    """One checkpoint, checked before any checkpoint is scored: what will be scored, on which
    text."""

    path: str
    data_dir: Path
    meta: dict
    docs: list[dict] | None  # the lex protocol's spans (None under the others)
    short_docs: int  # the documents too short for the lex protocol
    variants: list[Variant]
    skipped: list[str]  # a line per combination that makes no sense, and why


def preflight(args: argparse.Namespace, request: Request, ckpt_path: str) -> Preflight:
    """One checkpoint's checks, before any scoring: its model, its dataset, every rule and every
    length."""
    lengths, max_len = request.lengths, request.max_len
    # lazily: the weights are read when the model is scored
    ckpt = load_checkpoint(ckpt_path, mmap=True)
    config = model_config(ckpt, ckpt_path)
    learned_length_check(config, lengths[-1], ckpt_path)
    variants, skipped = checked_variants(config, request.rules, request.scalings, lengths[-1],
                                         ckpt_path, args.batch_tokens)
    data_dir, meta = checkpoint_dataset(ckpt, ckpt_path, args.data_dir)
    n_tokens = meta["files"]["val"]["tokens"]
    if args.protocol != "lex" and lengths[-1] >= n_tokens:
        raise UserError(f"length {lengths[-1]} needs {lengths[-1] + 1} validation tokens, "
                        f"but {data_dir} has {n_tokens}: lower --lengths")
    if args.protocol == "lex":
        docs, short = lex_documents(documents(data_dir, "val", meta), max_len, args.spans)
    else:
        docs, short = None, 0
    return Preflight(ckpt_path, data_dir, meta, docs, short, variants, skipped)


@dataclass
class Results:
    """What a run has measured so far (report prints it): a row and a per-position curve per
    checkpoint, variant and length, and the lines printed above the table."""

    skipped: list[str]  # every checkpoint's Preflight.skipped
    rows: list[dict] = field(default_factory=list)
    curves: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # a line per checkpoint scored: its text


def evaluate(args: argparse.Namespace) -> list[dict]:
    request = check_args(args)
    lengths, max_len = request.lengths, request.max_len
    runtime = Runtime.joined(args.device, args.dtype)
    dtype = runtime.dtype
    preflights = [preflight(args, request, ckpt_path) for ckpt_path in args.ckpt]
    results = Results(skipped=[line for pf in preflights for line in pf.skipped])
    if not any(pf.variants for pf in preflights):  # else an empty table, status 0
        raise UserError("nothing to score: every combination is skipped: "
                        + "; ".join(results.skipped))
    rows, curves = results.rows, results.curves
    block_sizes = set()
    for pf in preflights:
        ckpt_path = pf.path
        model, ckpt = load_model(ckpt_path, runtime.device)
        cfg = model.config
        block_sizes.add(cfg.block_size)
        stream = read_tokens(pf.data_dir, "val", pf.meta)
        if args.protocol == "lex":
            if args.spans == "first":
                what = "validation documents"
            else:
                what = (f"spans of validation documents (--spans {args.spans}: not only each "
                        "document's first, as the paper)")
            results.notes.append(f"{ckpt_path}: lex protocol, {len(pf.docs)} {what} x "
                                 f"{max_len} tokens ({pf.short_docs} documents shorter than "
                                 f"{max_len + 1} skipped)")
        for variant in pf.variants:
            rule, scaling = variant.rule, variant.scaling
            label = rule_label(cfg.pos, rule, scaling, cfg.block_size)
            for length in lengths:
                stride = args.stride or max(1, length // 2)
                pieces = cut_pieces(args.protocol, length, len(stream.tokens), pf.docs, max_len,
                                    stride)
                # positional: tests/hostile.py holds score with a wrapper of *args alone
                sums = score(model, stream, pieces, length, variant, runtime)
                nll = (sums[0] / sums[1]).item()
                # all-reduced: every rank stops here together; the rows so far are kept
                if not math.isfinite(nll):
                    kept = ""
                    if runtime.rank == 0 and rows:
                        kept = report(args, request, dtype, results)
                    runtime.teardown()
                    raise UserError(f"non-finite NLL ({nll}) for {ckpt_path} at length {length} "
                                    f"in {dtype} ({label}): "
                                    f"{non_finite_cause(model, dtype)}{kept}")
                fields = rule_fields(rule, scaling, cfg.block_size, length)
                row = dict(ckpt=str(ckpt_path), pos=cfg.pos, **fields, length=length,
                           ppl=math.exp(nll), nll=nll, tokens=int(sums[1]), label=label)
                rows.append(row)
                counts = sums[2 + length :]
                curve = (sums[2 : 2 + length] / counts.clamp(min=1)).tolist()
                keys = ("ckpt", "pos", *RULE_FIELDS, "length")
                curves.append({k: row[k] for k in keys} | {"mean_nll": curve})
                if runtime.rank == 0 and args.verbose:
                    print(f"{row['label']:>24} {length:>6}: ppl {row['ppl']:.3f} "
                          f"over {row['tokens']:,} tokens", file=sys.stderr)
    if runtime.rank == 0:
        report(args, request, dtype, results)
        if request.plot_path:
            plot(rows, lengths, block_sizes, request.plot_path)
        if request.positions_path:
            plot_positions(rows, curves, block_sizes, request.positions_path)
    runtime.teardown()
    return rows


def report(args: argparse.Namespace, request: Request, dtype: str, results: Results) -> str:
    """Print the table of the rows scored (and write them to --json); what to add to an error that
    stops early."""
    rows, json_path = results.rows, request.json_path
    print("\n".join(results.notes))
    print("\n".join(results.skipped))
    print(f"perplexity ({args.protocol} protocol, {dtype}; ↑ = higher than at the previous "
          "length)\n")
    print(markdown_table(rows, request.lengths))
    if json_path:
        keys = ("ckpt", "pos", *RULE_FIELDS, "length", "ppl", "nll", "tokens", "label")
        write_json(json_path, {"protocol": args.protocol, "max_len": request.max_len,
                               "spans": args.spans,
                               "rows": [{k: r[k] for k in keys} for r in rows],
                               "curves": results.curves, "skipped": results.skipped})
    kept = f"; the {len(rows)} rows scored before it are printed above"
    if json_path:
        kept += f" and in {json_path}"
    return kept


def non_finite_cause(model, dtype):
    """Why a score came out inf or NaN: the weights, or an activation past the evaluation dtype's
    range."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        more = ", ..." if len(bad) > 3 else ""
        return f"the checkpoint's weights hold inf or NaN ({', '.join(bad[:3])}{more})"
    if dtype != "float32":
        return (f"the weights are finite, so an activation passed {dtype}'s range: evaluate in "
                "float32 (--dtype float32)")
    return ("the weights are finite and so are xPos's factors at any length: an overflow in "
            "float32, please report it")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", action="append", required=True,
                   help="a checkpoint; repeat to compare several")
    p.add_argument("--lengths", default="256,512,1024,2048,4096")
    p.add_argument("--protocol", default="lex", choices=("lex", "chunks", "sliding"))
    p.add_argument("--max_len", type=int,
                   help="lex: tokens taken from each document (default: the largest length)")
    p.add_argument("--spans", default="first",
                   help="lex: each long enough document's first max_len span (first, the "
                   "paper's), every whole span (all), or K of those, evenly spread")
    p.add_argument("--stride", type=int, help="sliding: tokens between windows (default: length/2)")
    p.add_argument("--batch_tokens", type=int,
                   help="tokens per forward pass: short sequences are batched up to it, "
                   "a longer one is streamed through the KV cache in chunks of it (default: 16384, "
                   "fewer for large vocabularies so that one chunk of float32 logits stays under "
                   "512 MiB)")
    add_checkpoint_args(p, bca=tuple(BCA_MODES), several=True)
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--plot_positions",
                   help="draw the mean loss against position within the sequence at the largest "
                   "length (from the per-position curves), block_size marked")
    p.add_argument("--verbose", action="store_true",
                   help="a line per (model, length) as it finishes")
    return p.parse_args(argv)


def interrupted():
    return ("nothing was written (the table, --json and the plots come once every row is "
            "measured); run the command again")


def main(argv=None):
    try:
        return evaluate(parse_args(argv))
    except UserError as e:
        error_exit("eval_extrapolate.py", e)  # once under torchrun, from rank 0
    except KeyboardInterrupt:
        exit_interrupted("eval_extrapolate.py", interrupted)


if __name__ == "__main__":
    main()
