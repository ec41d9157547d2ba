"""
Train a lex-gpt model, on one device or with DDP under torchrun. nanoGPT's usage and key names:

    python train.py config/shakespeare_char.py --pos=rope --max_iters=500
    torchrun --standalone --nproc_per_node=8 train.py config/paper_lex_350m.py            # one node
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST --master_port=29500 train.py ...

Configuration: the defaults below, then each config file in order (plain Python assignments), then --key=value.
An unknown key or a value of the wrong type stops with a one-line error naming the key.

Data sampling is a pure function of (seed, iteration): every global batch is drawn from np.random.default_rng
([seed, 0, iter]) and cut into per-rank micro-batches, so 1 and N processes see the same global batch, and a
resumed run sees exactly the batches the uninterrupted run would have seen.
"""

import json
import math
import os
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import asdict, fields
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (CHECKPOINT_FORMAT, UserError, all_reduce_sum, autocast, check_tokenizer, load_checkpoint,
                    load_meta, load_weights, model_config, read_tokens, resolve_dtype, save_checkpoint,
                    setup_distributed, teardown_distributed, tokenizer_identity, writable_dir)
from model import GPT, GPTConfig

DEFAULTS = dict(
    # I/O
    out_dir="out",
    init_from="scratch",  # scratch | resume (from out_dir/ckpt.pt)
    eval_interval=250,  # evaluate and write the checkpoint every this many iterations, and at the end
    eval_iters=20,  # batches per split per evaluation, shared out among the ranks
    log_interval=10,
    # data
    data_dir="data/shakespeare_char",
    batch_size=16,  # sequences per micro-step per rank
    gradient_accumulation_steps=1,  # global micro-steps per iteration, divided among the ranks
    # model (GPTConfig; vocab_size comes from data_dir/meta.json)
    block_size=256,
    n_layer=6,
    n_head=6,
    n_embd=384,
    dropout=0.0,
    bias=True,
    pos="xpos",  # learned | sinusoidal | rope | alibi | xpos | none
    rope_base=10000.0,
    xpos_gamma=0.4,
    xpos_scale_base=512.0,
    xpos_rotate=True,
    # AdamW
    learning_rate=1e-3,
    max_iters=5000,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    adam_eps=1e-8,
    grad_clip=1.0,  # 0 disables
    # learning-rate schedule: linear warmup, then cosine or polynomial (the paper's) decay to min_lr
    decay_lr=True,
    lr_schedule="cosine",  # cosine | polynomial
    lr_power=1.0,  # polynomial decay power (1 = linear, fairseq's default)
    warmup_iters=100,
    lr_decay_iters=5000,
    min_lr=1e-4,
    # system
    device="auto",  # auto | cpu | cuda | cuda:N | mps
    dtype="auto",  # auto (bf16 on sm80+, fp16 + GradScaler on older CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    compile=False,
    seed=1337,
    overwrite=False,  # init_from=scratch in an out_dir that holds ckpt.pt: refused unless this is True
)
CHOICES = dict(init_from=("scratch", "resume"), lr_schedule=("cosine", "polynomial"),
               dtype=("auto", "float32", "bfloat16", "float16"))
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != "vocab_size"]
finite = lambda low, high=math.inf: lambda v: math.isfinite(v) and low <= v < high  # NaN fails every comparison
LIMITS = dict(  # numeric keys, checked once the whole configuration is known
    learning_rate=(lambda v: finite(0)(v) and v > 0, "a finite number > 0"),
    min_lr=(finite(0), "a finite number >= 0"),
    weight_decay=(finite(0), "a finite number >= 0"),
    beta1=(finite(0, 1), "in [0, 1)"),
    beta2=(finite(0, 1), "in [0, 1)"),
    adam_eps=(lambda v: finite(0)(v) and v > 0, "a finite number > 0"),
    grad_clip=(finite(0), "a finite number >= 0 (0 disables clipping)"),
    lr_power=(lambda v: finite(0)(v) and v > 0, "a finite number > 0"),
    **{k: (lambda v: v >= 0, "an integer >= 0") for k in ("max_iters", "warmup_iters", "lr_decay_iters")},
    **{k: (lambda v: v >= 1, "an integer >= 1") for k in ("eval_interval", "eval_iters", "log_interval", "batch_size",
                                                          "gradient_accumulation_steps")},
)


# ---------------------------------------------------------------------------------------------------------------
# Configuration


def set_key(config, key, value, source):
    if key not in DEFAULTS:
        raise UserError(f"unknown config key {key!r} (from {source}); known keys: {', '.join(DEFAULTS)}")
    want = type(DEFAULTS[key])
    if isinstance(value, str) and want is not str:  # from the command line: parse by the default's type
        try:
            value = {"true": True, "false": False}[value.lower()] if want is bool else want(value)
        except (KeyError, ValueError):
            raise UserError(f"config key {key}={value!r} (from {source}) must be a {want.__name__}") from None
    if want is float and type(value) is int:
        value = float(value)
    if type(value) is not want:
        raise UserError(f"config key {key}={value!r} (from {source}) must be a {want.__name__}")
    if key in CHOICES and value not in CHOICES[key]:
        raise UserError(f"config key {key}={value!r} (from {source}) must be one of {', '.join(CHOICES[key])}")
    config[key] = value


def load_config(argv):
    config = dict(DEFAULTS)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            if not eq:
                raise UserError(f"expected --key=value, got {arg!r}")
            set_key(config, key, value, arg)
        else:
            for key, value in run_config_file(arg).items():
                if not key.startswith("_") and not isinstance(value, ModuleType):
                    set_key(config, key, value, arg)
    for key, (ok, allowed) in LIMITS.items():
        if not ok(config[key]):
            raise UserError(f"config key {key}={config[key]!r} is not allowed: must be {allowed}")
    return config


def run_config_file(path):
    """A config file's assignments; any error in it is reported as one line naming the file and the line."""
    if not Path(path).is_file():
        raise UserError(f"config file {path!r} does not exist")
    data = Path(path).read_bytes()
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(f"config file {path}, line {line}: byte 0x{data[e.start]:02x} is not UTF-8 text") from None
    namespace = {}
    try:
        exec(compile(source, path, "exec"), namespace)
    except SyntaxError as e:
        raise UserError(f"config file {e.filename}, line {e.lineno}: {e.msg}") from None
    except Exception as e:  # the deepest frame in a config file, not in Python or its packages
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if not f.filename.startswith(("<", sys.prefix, sys.base_prefix, __file__))]
        where = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else path
        raise UserError(f"config file {where}: {type(e).__name__}: {e}") from None
    return namespace


def get_lr(it, c):
    """Linear warmup (non-zero at step 0), then cosine or polynomial decay reaching min_lr at lr_decay_iters."""
    if not c["decay_lr"]:
        return c["learning_rate"]
    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    if it >= c["lr_decay_iters"]:
        return c["min_lr"]
    progress = (it - c["warmup_iters"]) / (c["lr_decay_iters"] - c["warmup_iters"])
    if c["lr_schedule"] == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        coeff = (1.0 - progress) ** c["lr_power"]
    return c["min_lr"] + coeff * (c["learning_rate"] - c["min_lr"])


# ---------------------------------------------------------------------------------------------------------------
# Data


def get_batch(data, offsets, block_size, device):
    x = torch.from_numpy(np.stack([data[i : i + block_size] for i in offsets]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1 : i + 1 + block_size] for i in offsets]).astype(np.int64))
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def sample_offsets(seed, stream, index, n_tokens, count, block_size):
    """Start offsets of `count` sequences, a pure function of (seed, stream, index): 0 = training, 1/2 = eval."""
    return np.random.default_rng([seed, stream, index]).integers(0, n_tokens - block_size, size=count)


@torch.no_grad()
def evaluate(model, c, meta, ctx, device, rank, world, ddp):
    """Mean loss over eval_iters fixed batches per split; batch k runs on rank k % world, sums all-reduced."""
    model.eval()
    out = {}
    for stream, split in ((1, "train"), (2, "val")):
        data = read_tokens(c["data_dir"], split, meta)
        total = torch.zeros(2, device=device)
        for k in range(rank, c["eval_iters"], world):
            offsets = sample_offsets(c["seed"], stream, k, len(data), c["batch_size"], c["block_size"])
            x, y = get_batch(data, offsets, c["block_size"], device)
            with ctx:
                _, loss = model(x, y)
            total += torch.stack((loss.float(), torch.ones((), device=device)))
        total = all_reduce_sum(total, ddp)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out


def make_optimizer(model, c, device_type, dtype):
    """AdamW; weight decay on matrices and embeddings only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=c["learning_rate"], betas=(c["beta1"], c["beta2"]), eps=c["adam_eps"],
                             fused=fused_adamw(device_type, dtype))


def fused_adamw(device_type, dtype):
    """Fused kernels only on CUDA without the float16 GradScaler (fused AdamW + GradScaler gave NaNs for nanoGPT
    users, pytorch#95781)."""
    return device_type == "cuda" and dtype != "float16"


# ---------------------------------------------------------------------------------------------------------------
# Training


def check_out_dir(c, ckpt_path, master):
    """Refuse, before any work, a fresh run over an existing one (every rank, so that all stop together), and an
    out_dir that cannot take checkpoints (rank 0, which writes them)."""
    if c["init_from"] == "scratch" and ckpt_path.exists() and not c["overwrite"]:
        raise UserError(f"{ckpt_path} exists and init_from=scratch would replace it: continue it with "
                        "--init_from=resume, or start over with --overwrite=True")
    return writable_dir(c["out_dir"], "out_dir") if master else Path(c["out_dir"])


def open_log(out_dir, resume_iter):
    """log.jsonl opened for appending. Debris of killed runs goes first: a stale ckpt.pt.tmp, and (on resume) every
    entry from the checkpoint's iteration on, which the resumed run writes again, so that after any number of kills
    and resumes the log equals the uninterrupted run's. A fresh run starts a fresh log, and drops an overwritten
    run's checkpoint at once, so the directory never pairs the new log with the old checkpoint."""
    (out_dir / "ckpt.pt.tmp").unlink(missing_ok=True)
    path = out_dir / "log.jsonl"
    kept = []
    if resume_iter is None:
        (out_dir / "ckpt.pt").unlink(missing_ok=True)
    elif path.is_file():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if isinstance(entry, dict) and entry.get("iter", resume_iter) < resume_iter:
                kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return open(path, "a")


def resume_state(ckpt, ckpt_path, meta, c):
    """Check a checkpoint before resuming from it: a lex-gpt training checkpoint for this dataset's tokenizer."""
    missing = [k for k in ("optimizer", "scaler", "iter_num", "best_val_loss", "rng") if k not in ckpt]
    if missing:
        raise UserError(f"checkpoint {ckpt_path} cannot be resumed: it has no {', '.join(missing)}")
    config = model_config(ckpt, ckpt_path)
    check_tokenizer(ckpt, ckpt_path, meta, c["data_dir"])
    return config


def train(c):
    ddp, rank, world, device = setup_distributed(c["device"])
    device_type = device.split(":")[0]
    if c["gradient_accumulation_steps"] % world:
        raise UserError(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be divisible by the "
                        f"number of processes ({world}): it is the global number of micro-steps per iteration")
    master = rank == 0
    micro_steps = c["gradient_accumulation_steps"] // world
    dtype = resolve_dtype(c["dtype"], device)
    ctx = autocast(device, dtype)
    ckpt_path = Path(c["out_dir"]) / "ckpt.pt"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    meta = load_meta(c["data_dir"])
    out_dir = check_out_dir(c, ckpt_path, master)
    ckpt = load_checkpoint(ckpt_path) if c["init_from"] == "resume" else None
    if ckpt:  # the architecture is the checkpoint's; note any key given differently this time
        gpt_config = resume_state(ckpt, ckpt_path, meta, c)
        for k in MODEL_KEYS:
            if getattr(gpt_config, k) != c[k] and master:
                print(f"note: {k}={c[k]!r} ignored, the checkpoint has {getattr(gpt_config, k)!r}")
            c[k] = getattr(gpt_config, k)
    else:
        try:
            gpt_config = GPTConfig(vocab_size=meta["vocab_size"], **{k: c[k] for k in MODEL_KEYS})
        except ValueError as e:
            raise UserError(str(e)) from None
    for split in ("train", "val"):
        n = meta["files"][split]["tokens"]
        if n <= c["block_size"]:
            raise UserError(f"the {split} split of {c['data_dir']} has {n} tokens, not more than block_size="
                            f"{c['block_size']}")
    iter_num = ckpt["iter_num"] if ckpt else 0
    if iter_num >= c["max_iters"]:
        if master:
            print(f"nothing to train: at iteration {iter_num}, max_iters={c['max_iters']}; no checkpoint written")
        teardown_distributed(ddp)
        return

    torch.manual_seed(c["seed"])  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    raw_model = GPT(gpt_config).to(device)
    optimizer = make_optimizer(raw_model, c, device_type, dtype)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
    best_val_loss = float("inf")
    torch.manual_seed(c["seed"] + rank)  # dropout differs between ranks
    if ckpt:
        load_weights(raw_model, ckpt["model"], ckpt_path)
        optimizer.load_state_dict(ckpt["optimizer"])
        for group in optimizer.param_groups:  # loading brings back the saved run's choice, maybe another precision's
            group["fused"] = fused_adamw(device_type, dtype)
        if scaler.is_enabled() and ckpt["scaler"]:  # a bfloat16/float32 run saved none: float16 starts a fresh one
            scaler.load_state_dict(ckpt["scaler"])
        best_val_loss = ckpt["best_val_loss"]
        if len(ckpt["rng"]) == world:
            torch.set_rng_state(ckpt["rng"][rank]["torch"])
            if device_type == "cuda" and ckpt["rng"][rank]["cuda"] is not None:
                torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"], device)
        elif master:
            print(f"note: checkpoint from {len(ckpt['rng'])} processes, resuming on {world}: dropout RNG reseeded")
        del ckpt
    model = torch.compile(raw_model) if c["compile"] else raw_model
    if ddp:
        model = DDP(model, device_ids=[torch.device(device)] if device_type == "cuda" else None)

    def checkpoint():
        rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device_type == "cuda"
               else None}
        rngs = [None] * world if ddp else [rng]
        if ddp:
            dist.all_gather_object(rngs, rng)
        if master:
            save_checkpoint({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "model_args": asdict(gpt_config),
                             "format": CHECKPOINT_FORMAT, "tokenizer": tokenizer_identity(meta), "iter_num": iter_num,
                             "best_val_loss": best_val_loss, "config": c, "rng": rngs,
                             "data": {"sampler": "np.random.default_rng([seed, 0, iter])", "seed": c["seed"],
                                      "next_iter": iter_num}}, ckpt_path)

    log = None
    if master:
        log = open_log(out_dir, iter_num if c["init_from"] == "resume" else None)
        print(f"{raw_model.get_num_params() / 1e6:.2f}M parameters, pos={c['pos']}, {device} {dtype}, "
              f"{world} process(es), global batch {c['batch_size'] * c['gradient_accumulation_steps']} x "
              f"{c['block_size']} tokens, iterations {iter_num} -> {c['max_iters']}")

    def record(entry):
        if master:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    global_batch = c["batch_size"] * c["gradient_accumulation_steps"]
    start_iter, skipped_steps = iter_num, 0
    t0 = time.perf_counter()
    while True:
        if iter_num % c["eval_interval"] == 0 or iter_num == c["max_iters"]:
            losses = evaluate(model, c, meta, ctx, device, rank, world, ddp)
            if not math.isfinite(losses["val"]):  # all-reduced: every rank stops here together
                teardown_distributed(ddp)
                raise UserError(f"non-finite val loss {losses['val']} at iter {iter_num}; stopped, "
                                f"the last good checkpoint ({ckpt_path}) is kept")
            best_val_loss = min(best_val_loss, losses["val"])
            record({"iter": iter_num, "val_loss": losses["val"], "train_loss": losses["train"]})
            if master:
                print(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if iter_num > start_iter:
                checkpoint()
            t0 = time.perf_counter()
        if iter_num >= c["max_iters"]:
            break

        lr = get_lr(iter_num, c)
        for group in optimizer.param_groups:
            group["lr"] = lr
        train_data = read_tokens(c["data_dir"], "train", meta)  # re-opened each step: a long-lived memmap leaks
        offsets = sample_offsets(c["seed"], 0, iter_num, len(train_data), global_batch, c["block_size"])
        loss_sum = torch.zeros((), device=device)
        for micro in range(micro_steps):
            first = (rank * micro_steps + micro) * c["batch_size"]
            x, y = get_batch(train_data, offsets[first : first + c["batch_size"]], c["block_size"], device)
            sync = not ddp or micro == micro_steps - 1  # gradients all-reduced on the last micro-step only
            with (nullcontext() if sync else model.no_sync()), ctx:
                _, loss = model(x, y)
            loss_sum += loss.detach().float()
            scaler.scale(loss / micro_steps).backward()
        if c["grad_clip"]:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), c["grad_clip"])
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped_steps += scaler.is_enabled() and scaler.get_scale() < scale  # inf/NaN grads: step skipped
        optimizer.zero_grad(set_to_none=True)

        loss_value = (all_reduce_sum(loss_sum, ddp) / (micro_steps * world)).item()
        if not math.isfinite(loss_value):  # all-reduced: every rank stops here together
            teardown_distributed(ddp)
            raise UserError(f"non-finite loss {loss_value} at iter {iter_num}; stopped, the last good checkpoint "
                            f"({ckpt_path}) is kept")
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        if iter_num % c["log_interval"] == 0:
            entry = {"iter": iter_num, "loss": loss_value, "lr": lr, "ms_per_iter": dt * 1e3,
                     "tokens_per_s": global_batch * c["block_size"] / dt}
            if scaler.is_enabled():
                entry.update(grad_scale=scaler.get_scale(), skipped_steps=skipped_steps)
            record(entry)
            if master:
                extra = f", scale {entry['grad_scale']:g}, skipped {skipped_steps}" if scaler.is_enabled() else ""
                print(f"iter {iter_num}: loss {loss_value:.4f}, lr {lr:.2e}, {dt * 1e3:.0f} ms, "
                      f"{entry['tokens_per_s']:,.0f} tok/s{extra}")
        iter_num += 1

    if master:
        log.close()
        print(f"done: {ckpt_path} (iter {iter_num}, best val loss {best_val_loss:.4f})")
    teardown_distributed(ddp)


def main(argv=None):
    try:
        train(load_config(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        sys.exit(f"train.py: error: {e}")


if __name__ == "__main__":
    main()
