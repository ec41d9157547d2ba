"""
lex-gpt checkpoints: written atomically with a CRC-32 of each tensor-holding part, and checked on
load (a damaged or foreign file is a one-line error, never silently wrong weights).
"""

import os
import zlib
from pathlib import Path

import torch

from lexgpt.cli import UserError
from model import GPT, GPTConfig

# Format 2 (this version) records the tokenizer's identity, and goes with pos="sinusoidal" models
# whose token embeddings are scaled by sqrt(n_embd): an older sinusoidal checkpoint would be scored
# with the wrong input scale.
CHECKPOINT_FORMAT = 2


def save_checkpoint(obj, path):
    """torch.save to a temporary file, then rename: a crash mid-write never leaves a truncated
    checkpoint, and a failed write (a full disk) is a one-line error that leaves the previous
    checkpoint in place. The checkpoint carries a CRC-32 of each tensor-holding part
    (tensor_checksums), which load_checkpoint verifies."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    kept = "the previous one, if any, is kept"
    try:
        torch.save(dict(obj, checksums=tensor_checksums(obj)), tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"could not write checkpoint {path}: {e.strerror or e}; {kept}") from None
    except RuntimeError as e:  # how torch's zip writer reports a refused write (ENOSPC, EFBIG)
        tmp.unlink(missing_ok=True)
        if "unexpected pos" not in str(e) and "failed writing" not in str(e):
            raise
        raise UserError(f"could not write checkpoint {path}: the write stopped short (a full "
                        f"disk, or a file size limit); {kept}") from None


def children(value):
    """(key, value) pairs of a dict, list or tuple; none for anything else."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    return []


def has_tensor(value):
    if isinstance(value, torch.Tensor):
        return True
    return any(has_tensor(v) for _, v in children(value))


def crc(value, key, acc):
    """CRC-32 over the names, dtypes, shapes and bytes of every tensor in value, from acc."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        acc = zlib.crc32(f"{key}:{t.dtype}:{tuple(value.shape)}".encode(), acc)
        if not t.numel():
            return zlib.crc32(b"", acc)
        return zlib.crc32(t.view(torch.uint8).numpy(), acc)
    for k, v in children(value):
        acc = crc(v, f"{key}.{k}", acc)
    return acc


def tensor_checksums(obj, parts=None):
    """{part: CRC-32} for each top-level part of obj (model, optimizer, rng, ...) that holds
    tensors. torch.load does not check the zip's own CRCs, so a damaged record would otherwise load
    as silently wrong weights; CRC-32 runs at about the speed of reading the bytes from memory."""
    return {k: crc(v, k, 0) for k, v in obj.items()
            if (parts is None or k in parts) and has_tensor(v)}


def checkpoint_path(out_dir):
    """out_dir/ckpt.pt, checked before any work: a path the operating system takes (no name over
    its limit), and no directory in the checkpoint's place (which the first save would fail on,
    after the first evaluation)."""
    path = Path(out_dir) / "ckpt.pt"
    try:
        if path.is_dir():
            raise UserError(f"{path} is a directory, not a checkpoint: remove it or give another "
                            "out_dir")
    except OSError as e:
        raise UserError(f"out_dir {out_dir} is not usable: {e.strerror}") from None
    return path


def load_checkpoint(path, map_location="cpu", mmap=False, verify=("model",)):
    """A lex-gpt checkpoint, checked. mmap=True reads lazily: cheap for checks that do not need the
    weights. verify: the parts whose checksum is checked (True: every part that has one), the
    model's by default: a checksum reads its part in full. A checkpoint from before checksums were
    recorded loads unchecked."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable (truncated or corrupt?): "
                        f"{type(e).__name__}") from e
    missing = ["model"]
    if isinstance(ckpt, dict):
        missing = [k for k in ("model", "model_args", "config") if k not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} is not a lex-gpt checkpoint (no {'/'.join(missing)})")
    config = ckpt["config"]
    if not isinstance(config, dict) or "data_dir" not in config \
            or not isinstance(ckpt["model_args"], dict):
        raise UserError(f"checkpoint {path} is not a lex-gpt checkpoint (no config.data_dir, or "
                        "model_args not a dict)")
    iter_num = ckpt.get("iter_num", 0)
    if not isinstance(iter_num, int) or isinstance(iter_num, bool) or iter_num < 0:
        raise UserError(f"checkpoint {path} is damaged: its iter_num {iter_num!r} is not an "
                        "integer >= 0")
    sinusoidal = ckpt["model_args"].get("pos") == "sinusoidal"
    if sinusoidal and ckpt.get("format", 1) < CHECKPOINT_FORMAT:
        raise UserError(f"checkpoint {path} is a sinusoidal model from before token embeddings "
                        "were scaled by sqrt(n_embd): retrain it with this version")
    verify_checksums(ckpt, path, verify)
    return ckpt


def verify_checksums(ckpt, path, parts):
    recorded = ckpt.get("checksums", {})
    if not isinstance(recorded, dict):
        raise UserError(f"checkpoint {path} is damaged: its checksums field is a "
                        f"{type(recorded).__name__}")
    parts = [k for k in recorded if parts is True or k in parts]
    if not parts:
        return
    try:
        found = tensor_checksums(ckpt, parts)
    except Exception as e:  # a damaged record can fail to read at all
        raise UserError(f"checkpoint {path} is damaged: reading its tensors failed "
                        f"({type(e).__name__})") from None
    bad = [k for k in parts if found.get(k) != recorded[k]]
    if bad:
        raise UserError(f"checkpoint {path} is damaged: the checksum of its {', '.join(bad)} "
                        "tensors does not match the one recorded when it was written (one edited "
                        "on purpose: save it with save_checkpoint)")


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
        raise UserError(f"checkpoint {path}: the weights do not fit its model_args "
                        f"({detail[:300]})") from None


def load_model(path, device="cpu"):
    """The checkpoint's model, uncompiled, in eval mode on device, and the checkpoint's other
    fields. The file is read through a memory map and only the weights reach the device: AdamW's
    state, twice the weights, stays on disk."""
    ckpt = load_checkpoint(path, mmap=True)
    model = GPT(model_config(ckpt, path))
    load_weights(model, ckpt["model"], path)
    state = ("model", "optimizer", "scaler", "rng")
    return model.to(device).eval(), {k: v for k, v in ckpt.items() if k not in state}
