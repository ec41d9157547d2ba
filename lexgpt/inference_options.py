"""
Shared by the scripts that read checkpoints (eval_extrapolate.py, eval_retrieval.py, resolution.py,
sample.py): the flags that choose how a trained model attends at inference (the attention rule,
such as the paper's blockwise causal attention, §3.3, and RoPE interpolation), with one meaning in
every script and checked before any work; where and in what precision they compute (Runtime); the
fields and labels of their results; and their plots. Extrapolation is judged by these runs (paper
§4.2), so every script must mean the same thing by the same flags.
"""

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from alternatives import TRAINED_SCALINGS, YARN_ALPHA, YARN_BETA, scaling_of
from lexgpt.cli import UserError
from lexgpt.distributed import (
    DTYPES,
    all_reduce_sum,
    autocast,
    resolve_device,
    resolve_dtype,
    setup_distributed,
    teardown_distributed,
)
from lexgpt.outputs import pyplot, save_plot
from model import (
    ATTENTION_RULES,
    ROPE_SCALINGS,
    AttentionPlan,
    AttentionRule,
    GPTConfig,
    RopeScaling,
)


@dataclass(frozen=True)
class Runtime:
    """Where an evaluation script computes: its device, its dtype (autocast's, applied by ctx) and
    its place among torchrun's ranks (rank 0 of 1 without torchrun). One object for what every
    scoring function needs besides the model and its inputs."""

    device: str
    dtype: str = "float32"
    rank: int = 0
    world: int = 1
    ddp: bool = False  # in a process group: sums are all-reduced

    @classmethod
    def local(cls, device: str, dtype: str = "float32") -> "Runtime":
        """One process: --device and --dtype resolved (distributed.resolve_device and
        resolve_dtype)."""
        device = resolve_device(device)
        return cls(device, resolve_dtype(dtype, device))

    @classmethod
    def joined(cls, device: str, dtype: str) -> "Runtime":
        """Under torchrun, this rank in the process group (distributed.setup_distributed); else
        local's. Leave the group with teardown."""
        ddp, rank, world, device = setup_distributed(device)
        return cls(device, resolve_dtype(dtype, device), rank, world, ddp)

    @property
    def ctx(self) -> AbstractContextManager:
        """The autocast context of dtype (none in float32), as nanoGPT names it."""
        return autocast(self.device, self.dtype)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, self.ddp)

    def teardown(self) -> None:
        teardown_distributed(self.ddp)


class Variant(NamedTuple):
    """One way a checkpoint is scored: which keys a query sees, the RoPE interpolation (resolved
    against the checkpoint, checkpoint_scaling), and the tokens per forward pass (--batch_tokens, or
    default_batch_tokens, which depends on the interpolation): they bound memory, and leave the
    scores as they are up to rounding."""

    rule: AttentionRule
    scaling: RopeScaling
    batch_tokens: int


def learned_length_check(config, length, path):
    """model.py's rule that learned positions stop at block_size, before any work, as a one-line
    error (only a learned model's plan is built here: the others' grow with length, which may be
    past memory)."""
    if config.pos != "learned":
        return
    try:
        AttentionPlan(config, length, "causal")
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def lex_documents(offsets, max_len, spans="first", flags=("--max_len or --lengths", "--spans")):
    """The lex protocol's spans of max_len + 1 validation tokens, as {"start", "end"}, from the
    documents' (n, 2) [start, end) offsets (data.documents): each long enough document's first
    (spans="first", the paper's), all its whole spans ("all"), or K of all, evenly spread (an
    integer); and how many documents were too short. flags: the script's names for the length
    and the number of spans, for its errors."""
    long_enough = offsets[offsets[:, 1] - offsets[:, 0] >= max_len + 1]
    usable = [{"start": int(s), "end": int(e)} for s, e in long_enough]
    if not usable:
        longest = int((offsets[:, 1] - offsets[:, 0]).max())
        raise UserError(f"no validation document has max_len+1 = {max_len + 1} tokens "
                        f"(the longest has {longest}): lower {flags[0]}")
    if spans == "first":
        found = [{"start": d["start"], "end": d["start"] + max_len + 1} for d in usable]
    else:
        # consecutive spans share one token: the last target of one is the first input of the next
        found = [{"start": d["start"] + i, "end": d["start"] + i + max_len + 1}
                 for d in usable
                 for i in range(0, d["end"] - d["start"] - max_len, max_len)]
    if spans not in ("first", "all"):
        if int(spans) > len(found):
            raise UserError(f"{flags[1]} {spans}: the validation text has only {len(found)} "
                            f"whole spans of max_len+1 = {max_len + 1} tokens")
        found = [found[i * len(found) // int(spans)] for i in range(int(spans))]
    return found, len(offsets) - len(usable)


# -------------------------------------------------------------------------------------------------
# Command-line flags

# --bca as --attention
BCA_MODES = {"auto": ["auto"], "on": ["bca"], "off": ["causal"], "both": ["causal", "bca"]}
# the interpolations that take --rope_factor: a fixed s, counted over the training length
FIXED_FACTOR = tuple(m for m in TRAINED_SCALINGS if m != "none")


def add_checkpoint_args(parser, bca=("auto", "on", "off"), bca_default="auto", dtype=True,
                        several=False):
    """--bca, --attention, --window, --sinks, --rope_scaling, --rope_factor, --data_dir, --device
    and --dtype, with one meaning in every script. several: --attention and --rope_scaling take
    comma-separated lists."""
    meaning = dict(auto="only past the checkpoint's block_size", on="always", off="never",
                   both="each way")
    choices = "; ".join(f"{choice} = {meaning[choice]}" for choice in bca)
    parser.add_argument("--bca", choices=bca,
                        help="blockwise causal attention: " + choices
                        + f" (default: {bca_default}; a shorthand for --attention)")
    parser.set_defaults(bca_default=bca_default)
    lists = " (comma-separated: each)" if several else ""
    parser.add_argument("--attention",
                        help=f"which keys a query sees{lists}: {' | '.join(ATTENTION_RULES)} "
                        "(model.py's rule table); default: from --bca")
    parser.add_argument("--window", type=int,
                        help="W, the keys a query sees under sliding and sinks "
                        "(default: block_size)")
    parser.add_argument("--sinks", type=int,
                        help="S, the attention sinks kept under sinks (default: 4)")
    parser.add_argument("--rope_scaling",
                        help=f"RoPE interpolation for rope and xpos{lists}: "
                        f"{' | '.join(ROPE_SCALINGS)} (default: the checkpoint's own, "
                        "none unless it was fine-tuned with one)")
    parser.add_argument("--rope_factor", type=float,
                        help="s for pi, ntk and yarn, over the checkpoint's original length l "
                        "where it stores one (a fine-tune's), else block_size; default: s "
                        "follows the length, max(most positions a query sees, block_size) / l "
                        "(YaRN's dynamic scaling); every method is the identity at s <= 1")
    parser.add_argument("--yarn_alpha", type=float,
                        help="YaRN's ramp ends alpha < beta, in turns over the training length: "
                        "pairs below alpha turns are interpolated, above beta kept (default: "
                        f"the checkpoint's own, else {YARN_ALPHA:g})")
    parser.add_argument("--yarn_beta", type=float,
                        help=f"see --yarn_alpha (default: the checkpoint's own, else "
                        f"{YARN_BETA:g})")
    parser.add_argument("--data_dir",
                        help="the dataset (its meta.json); "
                        "default: the one the checkpoint was trained on")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    if dtype:
        parser.add_argument("--dtype", default="auto", choices=DTYPES,
                            help="auto: bfloat16 on GPUs of compute capability >= 8.0, "
                            "float16 on older ones, float32 on CPU "
                            "(see distributed.resolve_dtype)")


def parse_names(text, flag, allowed, several):
    names = [x.strip() for x in text.split(",")]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise UserError(f"{flag} {text!r} is not allowed: "
                        f"must be one of {', '.join(allowed)}"
                        + (", comma-separated" if several else ""))
    if len(names) > 1 and not several:
        raise UserError(f"{flag} {text!r}: this script takes one value")
    return list(dict.fromkeys(names))


def attention_options(args, several=False):
    """The AttentionRules and RopeScalings a run covers, from --attention (or --bca), --window,
    --sinks, --rope_scaling and --rope_factor, checked before any work."""
    if args.attention is None:
        names = BCA_MODES[args.bca or args.bca_default]
    elif args.bca is not None:
        raise UserError(f"--bca {args.bca} and --attention {args.attention} both given: "
                        "use --attention alone "
                        "(--bca on is --attention bca, off is causal, both is causal,bca)")
    else:
        names = parse_names(args.attention, "--attention", ATTENTION_RULES, several)
    for flag, rules in (("--window", ("sliding", "sinks")), ("--sinks", ("sinks",))):
        value = getattr(args, flag[2:])
        if value is not None and not set(rules) & set(names):
            raise UserError(f"{flag} {value} applies to --attention {' or '.join(rules)} only")
    own = args.rope_scaling is None  # the checkpoint's own scaling (checked_variants, scaling_of)
    if own:
        methods = []
    else:
        methods = parse_names(args.rope_scaling, "--rope_scaling", ROPE_SCALINGS, several)
    takes_factor = [m for m in methods if m in FIXED_FACTOR]
    if args.rope_factor is not None and not takes_factor:
        raise UserError(f"--rope_factor {args.rope_factor} applies to --rope_scaling pi, ntk "
                        "or yarn only")
    ends = (getattr(args, "yarn_alpha", None), getattr(args, "yarn_beta", None))
    for flag, value in zip(("--yarn_alpha", "--yarn_beta"), ends):
        if value is not None and "yarn" not in methods:
            raise UserError(f"{flag} {value:g} applies to --rope_scaling yarn only")
    try:
        sinks = 4 if args.sinks is None else args.sinks
        rules = [AttentionRule(n, args.window if n in ("sliding", "sinks") else None, sinks)
                 for n in names]
        scalings = [RopeScaling(m, args.rope_factor if m in takes_factor else None,
                                **(dict(alpha=ends[0], beta=ends[1]) if m == "yarn" else {}))
                    for m in methods]
    except ValueError as e:
        raise UserError(str(e)) from None
    return rules, [None] if own else scalings


def check_rule(rule, length, block_size, path):
    """AttentionRule.resolve's checks (sinks < window) for a checkpoint, as a one-line error."""
    try:
        rule.resolve(length, block_size)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def checkpoint_scaling(config: GPTConfig, scaling: RopeScaling | None) -> RopeScaling:
    """The RopeScaling a checkpoint is run with: its own (scaling_of) where none is asked for. One
    asked for (pi, ntk, yarn) counts over the original length the checkpoint stores
    (GPTConfig.rope_original_length: a fine-tune's source's block_size), as its own does: with a
    factor, its own method and factor given explicitly are the same model; without one, s follows
    the length from there (RopeScaling.factor_at). YaRN's ramp ends not asked for are the
    checkpoint's own when it was fine-tuned with YaRN."""
    scaling = scaling_of(config, scaling)
    length = config.rope_original_length
    if scaling.method in FIXED_FACTOR and length and scaling.original_length is None:
        scaling = replace(scaling, original_length=length)
    if scaling.method == "yarn" and config.rope_scaling == "yarn":
        own = scaling_of(config)
        try:
            scaling = replace(scaling, alpha=own.alpha if scaling.alpha is None else scaling.alpha,
                              beta=own.beta if scaling.beta is None else scaling.beta)
        except ValueError as e:  # one end asked for, the other the checkpoint's
            raise UserError(f"{e}; the checkpoint's own are yarn_alpha={config.yarn_alpha:g}, "
                            f"yarn_beta={config.yarn_beta:g}") from None
    return scaling


def pointless(config, rule, scaling):
    """Why a combination of scheme, attention rule and RoPE interpolation (checkpoint_scaling's)
    makes no sense (None if it does)."""
    if scaling.method == "none":
        return None
    if not (config.pos == "rope" or config.pos == "xpos" and config.xpos_rotate):
        without = " without rotation" if config.pos == "xpos" else ""
        return f"{scaling.method} rescales rotary angles, and pos={config.pos}{without} has none"
    if scaling.factor is not None and scaling.factor <= 1:
        return (f"{scaling.method} at s = {scaling.factor:g} is the identity: "
                "every method is, at s <= 1")
    fixed = scaling.method in FIXED_FACTOR
    stored = config.rope_original_length
    if fixed and scaling.factor is None and config.rope_scaling != "none":
        # dynamic: s = max(L, block_size) / l, the checkpoint's own s up to block_size only
        # where that is block_size / l, as YaRN's dynamic scaling assumes
        own, l = scaling_of(config), stored or config.block_size
        if not math.isclose(own.factor, config.block_size / l):
            return (f"{scaling.method} without --rope_factor takes s = max(L, block_size) / "
                    f"{l}, {config.block_size / l:g} up to block_size ({config.block_size}), "
                    f"not the {scaling_label(own)} this checkpoint was trained with: give "
                    f"--rope_factor, or leave out --rope_scaling for its own")
    if fixed and stored and scaling.original_length is None:
        return (f"{scaling_label(scaling)} would count over block_size ({config.block_size}), "
                f"not the original length ({stored}) this checkpoint stores: "
                "resolve it with inference_options.checkpoint_scaling")
    window = rule.window or config.block_size
    short = rule.name in ("auto", "bca") or window <= config.block_size
    # without a factor, s = max(L, block_size) / l: 1 for a model never scaled (l = block_size)
    unscaled = scaling.original_length is None
    if scaling.factor is None and rule.name != "causal" and short and unscaled:
        force = " (--rope_factor forces a factor)" if scaling.method != "dynamic_ntk" else ""
        return (f"{scaling.method} is the identity under {rule.name}: "
                f"no query sees more than block_size ({config.block_size}) positions, "
                f"so s <= 1{force}")
    return None


def checked_variants(config: GPTConfig, rules: list[AttentionRule],
                     scalings: list[RopeScaling | None], longest: int, path: str,
                     batch_tokens: int | None = None) -> tuple[list[Variant], list[str]]:
    """The Variants a checkpoint is scored with, every rule checked up to the longest length
    (batch_tokens: --batch_tokens, None for default_batch_tokens), and a line for each
    combination skipped because it makes no sense (pointless)."""
    variants = []
    skipped = []
    for rule in rules:
        check_rule(rule, longest, config.block_size, path)
        for scaling in (checkpoint_scaling(config, s) for s in scalings):
            why = pointless(config, rule, scaling)
            if why:
                label = rule_label(config.pos, rule, scaling, config.block_size)
                skipped.append(f"{path}: skipped {label}: {why}")
            else:
                tokens = batch_tokens or default_batch_tokens(config, scaling)
                variants.append(Variant(rule, scaling, tokens))
    return variants, skipped


# the keys of rule_fields (rows written before rope_original_length lack it)
RULE_FIELDS = ("attention", "bca", "window", "sinks", "rope_scaling", "rope_factor",
               "rope_original_length", "yarn_alpha", "yarn_beta")


def rule_fields(rule, scaling, block_size, length):
    """The attention/scaling fields of a result row: attention, bca, window, sinks, rope_scaling,
    rope_factor (None: it follows the length), rope_original_length, the training length the
    scaling counts over (a fine-tune's stored original length, else block_size; None unscaled):
    the same method and factor over another length is another model; and YaRN's ramp ends
    (None but for yarn)."""
    resolved = rule.resolve(length, block_size)
    scaled = scaling.method != "none"
    return dict(attention=rule.name,
                bca="auto" if rule.name == "auto" else rule.name == "bca",
                window=resolved.window,
                sinks=resolved.sinks if resolved.name == "sinks" else None,
                rope_scaling=scaling.method,
                rope_factor=scaling.factor,
                rope_original_length=(scaling.original_length or block_size) if scaled else None,
                yarn_alpha=yarn_ends(scaling)[0], yarn_beta=yarn_ends(scaling)[1])


def yarn_ends(scaling):
    """(alpha, beta) of a YaRN scaling, (None, None) for the others."""
    if scaling.method != "yarn":
        return None, None
    return (YARN_ALPHA if scaling.alpha is None else scaling.alpha,
            YARN_BETA if scaling.beta is None else scaling.beta)


def rule_label(pos, rule, scaling, block_size):
    """A scheme's name with its attention rule and RoPE interpolation, for tables and legends."""
    window = rule.window or block_size
    label = pos + {"auto": f" (BCA > {block_size})", "causal": "", "bca": " + BCA",
                   "sliding": f" + sliding W={window}",
                   "sinks": f" + sinks S={rule.sinks} W={window}"}[rule.name]
    if scaling.method != "none":
        label += f" + {scaling_label(scaling)}"
    return label


def scaling_label(scaling):
    """A RoPE interpolation's method, its factor (none: dynamic, s from the length) and, a
    fine-tuned model's, its original length; YaRN's ramp ends where they are not its defaults."""
    label = scaling.method
    if scaling.factor is not None:
        label += f" s={scaling.factor:g}"
    elif scaling.original_length and scaling.method in FIXED_FACTOR:
        label += " dynamic"
    if scaling.original_length:
        label += f" from {scaling.original_length}"
    ends = yarn_ends(scaling)
    if scaling.method == "yarn" and ends != (YARN_ALPHA, YARN_BETA):
        label += f" a={ends[0]:g} b={ends[1]:g}"
    return label


def default_batch_tokens(config, scaling):
    """Tokens per forward pass for the evaluation scripts: 16,384 (fewer for a large vocabulary,
    whose float32 logits take 4 bytes each). Dynamic NTK decodes token by token past block_size
    (GPT.token_nll), where a step costs little per sequence, so it batches as many sequences as a
    1 GiB KV cache holds (keys and values, float32, every layer)."""
    tokens = min(16384, 2**27 // config.vocab_size)
    if scaling.method == "dynamic_ntk":
        tokens = max(tokens, 2**30 // (config.n_layer * 2 * config.n_embd * 4))
    return tokens


# -------------------------------------------------------------------------------------------------
# Plots


def curves_figure(n_curves):
    """A figure for one curve per label: wider when there are many, so the legend fits beside the
    axes."""
    return pyplot().subplots(figsize=(6 + 2.5 * (n_curves > 4), 4))


def finish_curves(fig, ax, n_curves, block_sizes, path):
    """Each training length marked, the legend (beside the axes when there are many curves), a grid;
    saved."""
    for block_size in sorted(block_sizes):
        ax.axvline(block_size, color="grey", ls="--", lw=1)
        ax.annotate(f"trained at {block_size}", (block_size, 0.98),
                    xycoords=("data", "axes fraction"),
                    ha="right", va="top", rotation=90, fontsize=8, color="grey")
    if n_curves > 4:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def save_figure(fig, path):
    fig.tight_layout()
    save_plot(fig, path, quiet=False)
