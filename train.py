"""
Train a lex-gpt model, on one device or with DDP under torchrun. nanoGPT's usage and key names:

    python train.py config/shakespeare_char.py --pos=rope --max_iters=500
    torchrun --standalone --nproc_per_node=8 train.py config/paper_lex_350m.py            # one node
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST --master_port=29500 train.py ...

Configuration: the defaults below, then each config file in order, then --key=value (configurator.py).

Training is plain causal language modelling at block_size, the paper's §4.1 recipe: the LeX Transformer's claim (§3)
is that xPos (§3.2) trained short extrapolates at inference with blockwise causal attention (§3.3), which the
evaluation scripts apply to the checkpoints this writes.

Every global batch is drawn from np.random.default_rng([seed, 0, iter]) and cut into per-rank micro-batches, so 1 and
N processes see the same batches, and a resumed run those the uninterrupted run would have seen. Rank 0 logs to the
console, out_dir/log.jsonl and, with --wandb_log=True, Weights & Biases (pip install wandb); MFU (model FLOPs
utilization) is PaLM's FLOPs estimate over the device's peak in the dtype used.
"""

import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields, replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (CHECKPOINT_FORMAT, DTYPES, UserError, agree_on_error, all_reduce_sum, autocast,
                    catch_stop_signals, checkpoint_path, error_exit, exit_interrupted, keep_checkpoint,
                    load_checkpoint, load_weights, model_config, open_log, own_run_dir, peak_flops, release_run_dirs,
                    resolve_dtype, save_checkpoint, setup_distributed, teardown_distributed, train_flops_per_token,
                    writable_dir)
from configurator import AT_LEAST_ONE, COUNT, FRACTION, NON_NEGATIVE, POSITIVE, SEED, configure
from data import check_tokenizer, get_batch, load_meta, read_tokens, sample_offsets, tokenizer_identity
from model import GPT, GPTConfig

DEFAULTS = dict(
    # I/O
    out_dir="out", log_interval=10,
    init_from="scratch",  # scratch | resume (from out_dir/ckpt.pt) | the path of another run's checkpoint: a new run
    # from its weights (fine-tuning; at another block_size too, FINE_TUNED_KEYS), with a fresh optimizer and schedule
    eval_interval=250,  # evaluate and write the checkpoint every this many iterations, and at the end
    keep_checkpoints=0,  # K >= 1: also keep the last K checkpoints as ckpt_<iter>.pt, and the best as ckpt_best.pt
    checkpoint_minutes=0.0,  # > 0: also write the checkpoint this often (checked at log steps); 0 turns it off
    eval_iters=20,  # batches per split per evaluation, shared out among the ranks
    wandb_log=False,  # also log to Weights & Biases (pip install wandb), from rank 0
    wandb_project="lex-gpt", wandb_run_name="",  # empty run name: wandb picks one
    # data
    data_dir="data/shakespeare_char",
    batch_size=16,  # sequences per micro-step per rank
    gradient_accumulation_steps=1,  # global micro-steps per iteration, divided among the ranks
    # model (GPTConfig; vocab_size comes from data_dir/meta.json)
    block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.0, bias=True,
    pos="xpos",  # learned | sinusoidal | rope | alibi | xpos (paper §3.2) | none
    rope_base=10000.0, xpos_gamma=0.4, xpos_scale_base=512.0, xpos_rotate=True,
    rope_scaling="none",  # none | pi | ntk | yarn: RoPE interpolation in training, kept in the model (GPTConfig)
    rope_factor=1.0,  # its s > 1
    rope_original_length=0,  # the length YaRN's ramp counts from; 0: a fine-tune's source's block_size, else block_size
    # AdamW
    learning_rate=1e-3, max_iters=5000, weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-8,
    grad_clip=1.0,  # 0 disables
    # learning-rate schedule: linear warmup, then cosine or polynomial (the paper's, §4.1) decay to min_lr
    decay_lr=True, warmup_iters=100, lr_decay_iters=5000, min_lr=1e-4,
    lr_schedule="cosine",  # cosine | polynomial
    lr_power=1.0,  # polynomial decay power (1 = linear, fairseq's default)
    # system
    device="auto",  # auto | cpu | cuda | cuda:N | mps
    dtype="auto",  # auto (bf16 on sm80+, fp16 + GradScaler on older CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    compile=False, seed=1337,
    ddp_timeout_minutes=30.0,  # how long a rank waits in a collective (e.g. while rank 0 writes the checkpoint)
    ddp_rendezvous_minutes=10.0,  # how long the processes wait for each other at the start (torchrun's RANK etc.)
    grad_checkpoint=False,  # recompute each block's activations in the backward pass: less memory, more compute
    overwrite=False,  # init_from=scratch in an out_dir that holds ckpt.pt: refused unless this is True
)
CHOICES = dict(lr_schedule=("cosine", "polynomial"), dtype=DTYPES, rope_scaling=("none", "pi", "ntk", "yarn"))
LIMITS = dict(  # numeric keys, checked once the whole configuration is known
    learning_rate=POSITIVE, min_lr=NON_NEGATIVE, weight_decay=NON_NEGATIVE, beta1=FRACTION, beta2=FRACTION,
    adam_eps=POSITIVE, grad_clip=(NON_NEGATIVE[0], "a finite number >= 0 (0 disables clipping)"), lr_power=POSITIVE,
    checkpoint_minutes=NON_NEGATIVE, ddp_timeout_minutes=POSITIVE, ddp_rendezvous_minutes=POSITIVE, seed=SEED,
    **dict.fromkeys(("max_iters", "warmup_iters", "lr_decay_iters", "keep_checkpoints"), COUNT),
    **dict.fromkeys(("eval_interval", "eval_iters", "log_interval", "batch_size", "gradient_accumulation_steps"),
                    AT_LEAST_ONE),
)
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != "vocab_size"]
FINE_TUNED_KEYS = ("block_size", "dropout", "rope_scaling", "rope_factor", "rope_original_length")  # a fine-tune's
# own model settings; the others are its source's


def load_config(argv):
    return configure(DEFAULTS, argv, CHOICES, LIMITS)


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


@torch.no_grad()
def evaluate(run, c):
    """Mean loss over eval_iters fixed batches per split; batch k runs on rank k % world, sums all-reduced."""
    run.model.eval()
    out = {}
    for stream, split in ((1, "train"), (2, "val")):
        data = read_tokens(c["data_dir"], split, run.meta)
        total = torch.zeros(2, device=run.device)
        for k in range(run.rank, c["eval_iters"], run.world):
            offsets = sample_offsets(c["seed"], stream, k, data, c["batch_size"], c["block_size"])
            x, y = get_batch(data, offsets, c["block_size"], run.device)
            with run.ctx:
                _, loss = run.model(x, y)
            total += torch.stack((loss.float(), torch.ones((), device=run.device)))
        total = all_reduce_sum(total, run.ddp)
        out[split] = (total[0] / total[1]).item()
    run.model.train()
    return out


def setup(c):
    """Processes, device, precision, and every check that can fail before any work: wandb, out_dir (taken for this
    run: own_run_dir), the dataset, the checkpoint and the model's configuration (the checkpoint's on resume). Returns
    the shared state and checkpoint."""
    ddp, rank, world, device = setup_distributed(c["device"], c["ddp_timeout_minutes"], c["ddp_rendezvous_minutes"])
    try:
        run, problem = check_run(c, ddp, rank, world, device), None
    except UserError as e:
        run, problem = None, e
    agree_on_error(problem, ddp, device)  # rank 0 alone takes out_dir: all stop together if it cannot
    if ddp and c["init_from"] == "resume":  # rank 0 writes the checkpoints: every rank must see the same out_dir
        seen = int(all_reduce_sum(torch.tensor(float(run.ckpt_path.exists()), device=device), ddp))
        if 0 < seen < world:
            raise UserError(f"{run.ckpt_path} exists on {seen} of {world} processes: out_dir (and data_dir) must be "
                            "on a filesystem every node shares")
    # memory-mapped: the ranks of a node share one copy of the file in the page cache instead of each holding it
    ckpt = load_checkpoint(run.ckpt_path, mmap=True, verify=True) if c["init_from"] == "resume" else None
    if ckpt:  # a training checkpoint for this dataset's tokenizer, whose architecture wins over the config's
        run.source = ckpt.get("init")  # a fine-tune's source, kept in every checkpoint
        missing = [k for k in ("optimizer", "scaler", "iter_num", "best_val_loss", "rng") if k not in ckpt]
        if missing:
            raise UserError(f"checkpoint {run.ckpt_path} cannot be resumed: it has no {', '.join(missing)}")
        run.gpt_config = model_config(ckpt, run.ckpt_path)
        check_tokenizer(ckpt, run.ckpt_path, run.meta, c["data_dir"])
        for k in MODEL_KEYS:
            if getattr(run.gpt_config, k) != c[k] and run.master:
                print(f"note: {k}={c[k]!r} ignored, the checkpoint has {getattr(run.gpt_config, k)!r}")
            c[k] = getattr(run.gpt_config, k)
    record = run.meta.get("record")  # a task dataset's record: one training sequence
    if record and record != c["block_size"] + 1:
        trained = f", and {run.ckpt_path} was trained at block_size={c['block_size']}" if ckpt else ""
        fix = (f"resume on the data it was trained on ({ckpt['config']['data_dir']})" if ckpt else
               f"train with --block_size={record - 1}, or prepare the tasks again with --block_size {c['block_size']}")
        raise UserError(f"{c['data_dir']} holds task records of {record} tokens, made for block_size {record - 1}"
                        f"{trained}: {fix}")
    for split in ("train", "val"):
        n = run.meta["files"][split]["tokens"]
        if n <= c["block_size"]:
            raise UserError(f"the {split} split of {c['data_dir']} has {n} tokens, not more than block_size="
                            f"{c['block_size']}")
    run.start_iter = ckpt["iter_num"] if ckpt else 0
    return run, ckpt


def check_run(c, ddp, rank, world, device):
    """The checks each rank makes alone, with no collective (setup agrees on their outcome), and out_dir's lock."""
    if c["gradient_accumulation_steps"] % world:
        raise UserError(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be divisible by the "
                        f"number of processes ({world}): it is the global number of micro-steps per iteration")
    dtype = resolve_dtype(c["dtype"], device)
    run = SimpleNamespace(ddp=ddp, rank=rank, world=world, device=device, device_type=device.split(":")[0],
                          master=rank == 0, micro_steps=c["gradient_accumulation_steps"] // world, dtype=dtype,
                          ctx=autocast(device, dtype), ckpt_path=checkpoint_path(c["out_dir"]),
                          global_batch=c["batch_size"] * c["gradient_accumulation_steps"], wandb=None,
                          source=None, source_weights=None)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if c["wandb_log"]:  # checked on every rank, so that all stop together
        try:
            import wandb
        except ImportError:
            raise UserError("wandb_log=True needs the wandb package: pip install wandb") from None
        if run.master:
            run.wandb = wandb  # the module; start_logging replaces it with the run

    run.meta = load_meta(c["data_dir"])
    if c["init_from"] == "scratch":  # a bad configuration is one line before out_dir is made (on resume: setup)
        try:
            run.gpt_config = GPTConfig(vocab_size=run.meta["vocab_size"], **{k: c[k] for k in MODEL_KEYS})
        except ValueError as e:
            raise UserError(str(e)) from None
    elif c["init_from"] != "resume":
        run.gpt_config, run.source_weights, run.source = fine_tune_source(c, run.meta, run.master)
    if c["compile"]:
        check_compiler(run.device_type)
    if run.master:  # which writes the checkpoints: the one owner of out_dir, before anything in it is touched
        writable_dir(c["out_dir"], "out_dir")
        own_run_dir(c["out_dir"])
    fresh = c["init_from"] != "resume"
    if fresh and run.ckpt_path.exists() and not c["overwrite"]:
        raise UserError(f"{run.ckpt_path} exists and init_from={c['init_from']} would replace it: continue it with "
                        "--init_from=resume, or start over with --overwrite=True")
    kept = kept_checkpoints(run.ckpt_path)
    if fresh and kept and not c["overwrite"]:
        raise UserError(f"{c['out_dir']} holds an earlier run's {', '.join(p.name for p in kept)}, which "
                        f"init_from={c['init_from']} would remove: start over with --overwrite=True, or give another "
                        "out_dir")
    return run


def fine_tune_source(c, meta, master):
    """init_from=<checkpoint>: (the model's configuration, the source's weights, the source's record). The model is
    the source's but for FINE_TUNED_KEYS, which are this run's (a RoPE scaling's original length, unless given, the
    source's training length); nothing else in the state_dict depends on the length, so the weights fit at any
    block_size but learned positions'."""
    path = Path(c["init_from"])
    try:
        found = path.is_file()
    except OSError as e:  # a name too long, a directory that cannot be read
        raise UserError(f"init_from={c['init_from']!r} cannot be read: {e.strerror}") from None
    if not found:
        raise UserError(f"init_from={c['init_from']!r} is not allowed: scratch, resume, or the path of a checkpoint "
                        "file to fine-tune from (there is no such file)")
    if path.resolve().parent == Path(c["out_dir"]).resolve():
        raise UserError(f"init_from={c['init_from']} is in out_dir {c['out_dir']}, whose checkpoints a new run "
                        "replaces: give the fine-tune its own out_dir")
    ckpt = load_checkpoint(path, mmap=True, verify=True)
    source = model_config(ckpt, path)
    check_tokenizer(ckpt, path, meta, c["data_dir"])
    if source.pos == "learned" and c["block_size"] != source.block_size:
        raise UserError(f"{path} has pos='learned', a table of {source.block_size} positions: it cannot be "
                        f"fine-tuned at block_size={c['block_size']} (the other schemes can)")
    own = {k: c[k] for k in FINE_TUNED_KEYS}
    if c["rope_scaling"] != "none" and not c["rope_original_length"]:
        own["rope_original_length"] = source.rope_original_length or source.block_size
    try:
        config = replace(source, **own)
    except ValueError as e:
        raise UserError(str(e)) from None
    for k in MODEL_KEYS:
        if getattr(config, k) != c[k] and k not in own and master:
            print(f"note: {k}={c[k]!r} ignored, {path} has {getattr(config, k)!r}")
        c[k] = getattr(config, k)
    if source.rope_scaling != config.rope_scaling and master:  # a scaled source fine-tuned without it, say
        print(f"note: {path} was trained with rope_scaling={source.rope_scaling!r}; this run trains with "
              f"{config.rope_scaling!r} (give --rope_scaling to keep it)")
    record = {"path": str(path.resolve()), "iter_num": ckpt.get("iter_num", 0), "config": ckpt.get("config"),
              "model_args": ckpt["model_args"], "init": ckpt.get("init")}
    return config, ckpt["model"], record


def check_compiler(device_type):
    """torch.compile builds its kernels with a C++ compiler on CPU, and Triton's launcher with a C compiler on CUDA:
    without one it fails only at the first step, in a long traceback."""
    if device_type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler
        try:
            get_cpp_compiler()
        except Exception:
            raise UserError("compile=True on CPU needs a C++ compiler (g++, or $CXX) on PATH and none works here: "
                            "install one, or train with --compile=False") from None
    elif device_type == "cuda" and not any(shutil.which(cc) for cc in (os.environ.get("CC"), "cc", "gcc", "clang")
                                           if cc):
        raise UserError("compile=True on CUDA needs a C compiler (cc, gcc or clang, or $CC) on PATH for Triton and "
                        "none is there: install one, or train with --compile=False")


def kept_checkpoints(ckpt_path):
    """The checkpoints keep_checkpoints writes beside ckpt.pt (ckpt_<iter>.pt, ckpt_best.pt); any other file in
    out_dir, a ckpt_backup.pt included, is the user's and never removed."""
    return sorted(p for p in ckpt_path.parent.glob("ckpt_*.pt") if p.stem[5:] == "best" or
                  (len(p.stem) == 12 and p.stem[5:].isdigit()))


def build(run, c, ckpt):
    """The model (run.raw_model; run.model is it compiled and DDP-wrapped as asked), AdamW and the GradScaler: fresh,
    or as the checkpoint left them."""
    torch.manual_seed(c["seed"])  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    run.raw_model = GPT(run.gpt_config).to(run.device)
    run.raw_model.grad_checkpoint = c["grad_checkpoint"]
    # AdamW, weight decay on matrices and embeddings only. The fused kernel (one pass over each parameter) where torch
    # has it, CUDA and CPU, is safe with float16's GradScaler (docs/engineering_notes.md); MPS keeps the default.
    fused = run.device_type in ("cuda", "cpu")
    params = [p for p in run.raw_model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    run.optimizer = torch.optim.AdamW(groups, lr=c["learning_rate"], betas=(c["beta1"], c["beta2"]),
                                      eps=c["adam_eps"], fused=fused)
    run.scaler = torch.amp.GradScaler(run.device_type, enabled=run.dtype == "float16")
    run.first_nonfinite = torch.full((), -1, device=run.device)  # see train_step
    run.best_val_loss = ckpt["best_val_loss"] if ckpt else float("inf")
    torch.manual_seed(c["seed"] + run.rank)  # dropout differs between ranks
    if ckpt:  # weights, optimizer and GradScaler state, best val loss, and each rank's RNG state
        load_weights(run.raw_model, ckpt["model"], run.ckpt_path)
        for group in ckpt["optimizer"]["param_groups"]:  # the saved choice may be another device's: this run's,
            group["fused"] = fused  # set before loading, places the state to suit this device
        run.optimizer.load_state_dict(ckpt["optimizer"])
        if run.scaler.is_enabled() and ckpt["scaler"]:  # a bfloat16/float32 run saved none: float16 starts afresh
            run.scaler.load_state_dict(ckpt["scaler"])
        if len(ckpt["rng"]) == run.world:
            torch.set_rng_state(ckpt["rng"][run.rank]["torch"])
            if run.device_type == "cuda" and ckpt["rng"][run.rank]["cuda"] is not None:
                torch.cuda.set_rng_state(ckpt["rng"][run.rank]["cuda"], run.device)
        elif run.master:
            print(f"note: checkpoint from {len(ckpt['rng'])} processes, resuming on {run.world}: dropout RNG reseeded")
    elif run.source_weights is not None:  # a fine-tune: the source's weights, nothing else of its state
        load_weights(run.raw_model, run.source_weights, run.source["path"])
        run.source_weights = None
    run.model = torch.compile(run.raw_model) if c["compile"] else run.raw_model
    if run.ddp:
        run.model = DDP(run.model, device_ids=[torch.device(run.device)] if run.device_type == "cuda" else None)


def start_logging(run, c):
    """Rank 0: log.jsonl, the wandb run, MFU's constants, and the run's first line. Debris of killed runs goes first:
    a stale ckpt.pt.tmp, and (on resume) every log entry from the checkpoint's iteration on, which the resumed run
    writes again, so that after any number of kills and resumes the log equals the uninterrupted run's. A fresh run
    starts a fresh log, and drops an overwritten run's checkpoint at once, so the directory never pairs the new log
    with the old checkpoint."""
    if not run.master:
        return
    run.ckpt_path.with_name("ckpt.pt.tmp").unlink(missing_ok=True)
    if c["init_from"] != "resume":
        for old in [run.ckpt_path, *kept_checkpoints(run.ckpt_path)]:  # the latest, the kept ones, the best
            old.unlink(missing_ok=True)
    run.log = open_log(run.ckpt_path.with_name("log.jsonl"), run.start_iter if c["init_from"] == "resume" else 0)
    if run.source and c["init_from"] != "resume":
        print(f"fine-tuning {run.source['path']} (iter {run.source['iter_num']}) at block_size={c['block_size']}, "
              f"rope_scaling={c['rope_scaling']}")
    if run.wandb:
        run.wandb = run.wandb.init(project=c["wandb_project"], name=c["wandb_run_name"] or None, config=c)
    run.flops_per_token = train_flops_per_token(run.gpt_config)
    run.peak_flops = peak_flops(run.device, run.dtype)  # per device; None where unknown (CPU: measured)
    n_params = sum(p.numel() for p in run.raw_model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters, pos={c['pos']}, {run.device} {run.dtype}, "
          f"{run.world} process(es), global batch {run.global_batch} x {c['block_size']} tokens, "
          f"iterations {run.start_iter} -> {c['max_iters']}")


def record(run, entry, wandb_entry):
    """Rank 0: a line of log.jsonl, and the numbers under nanoGPT's names to wandb when it is on."""
    if run.master:
        run.log.write(json.dumps(entry) + "\n")
        run.log.flush()
        if run.wandb:
            run.wandb.log(wandb_entry)


def finish(run):
    """Close log.jsonl and the wandb run (rank 0), and leave the process group."""
    if run.master:
        run.log.close()
        if run.wandb:
            run.wandb.finish()
    teardown_distributed(run.ddp)


def stop(run, problem):
    """Stop on a non-finite loss. Every rank gets here at the same iteration, since the check was all-reduced."""
    finish(run)
    raise UserError(f"{problem}; stopped, the last good checkpoint ({run.ckpt_path}) is kept")


def train_step(run, c, iter_num):
    """One iteration: this rank's micro-steps of the global batch, gradient clipping, and the optimizer step through
    the GradScaler (a no-op unless float16). Returns the summed loss unread, since reading it makes the host wait for
    the device, and the seconds spent reading batches; the gradient norm and the first iteration with a non-finite
    loss stay on the device for the next log step."""
    for group in run.optimizer.param_groups:
        group["lr"] = get_lr(iter_num, c)
    data = read_tokens(c["data_dir"], "train", run.meta)  # re-opened each step: a long-lived memmap leaks
    offsets = sample_offsets(c["seed"], 0, iter_num, data, run.global_batch, c["block_size"])
    loss_sum, data_seconds = torch.zeros((), device=run.device), 0.0
    for micro in range(run.micro_steps):
        first = (run.rank * run.micro_steps + micro) * c["batch_size"]
        t0 = time.perf_counter()
        x, y = get_batch(data, offsets[first : first + c["batch_size"]], c["block_size"], run.device)
        data_seconds += time.perf_counter() - t0
        sync = not run.ddp or micro == run.micro_steps - 1  # gradients all-reduced on the last micro-step only
        with (nullcontext() if sync else run.model.no_sync()), run.ctx:
            _, loss = run.model(x, y)
        loss_sum += loss.detach()  # float32: the model's loss always is, autocast or not
        run.scaler.scale(loss / run.micro_steps).backward()
    run.scaler.unscale_(run.optimizer)  # a no-op unless float16: the norm and clipping see the true gradients
    params = run.raw_model.parameters()
    run.grad_norm = torch.nn.utils.clip_grad_norm_(params, c["grad_clip"]) if c["grad_clip"] else \
        torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])  # before clipping
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    if not run.scaler.is_enabled():  # float16's GradScaler skips such a step itself: no error there
        first = (run.first_nonfinite < 0) & ~torch.isfinite(loss_sum)
        run.first_nonfinite = torch.where(first, iter_num, run.first_nonfinite)
    return loss_sum, data_seconds


def log_step(run, c, iter_num, loss_sum, dt, data_seconds, stop_signals):
    """Read the loss (mean over micro-steps and ranks), stop if any loss since the last log step was not finite, and
    log it with the learning rate, the time since the previous iteration ended, the gradient norm before clipping, the
    share of that time spent reading the batch, MFU, peak GPU memory and the GradScaler's state. The same all-reduce
    decides, for every rank alike, whether to write the checkpoint now (checkpoint_minutes) and whether to stop (a
    SIGTERM or SIGUSR1 caught on any rank). Returns (save, signal name or None)."""
    due = c["checkpoint_minutes"] > 0 and time.monotonic() - run.last_save >= 60 * c["checkpoint_minutes"]
    flags = torch.tensor([float(bool(stop_signals)), float(due)], device=run.device)
    total = all_reduce_sum(torch.cat((torch.stack((loss_sum, (run.first_nonfinite >= 0).float(),
                                                   run.grad_norm.float())), flags)), run.ddp).tolist()
    loss, ranks_nonfinite, grad_norm = total[0] / (run.micro_steps * run.world), total[1], total[2] / run.world
    if ranks_nonfinite:
        first = int(run.first_nonfinite)
        stop(run, f"non-finite loss at iter {first}" if first >= 0 else
             f"non-finite loss on another rank, after iter {iter_num - c['log_interval']}")
    signal_name = (stop_signals or ["a signal on another rank"])[0] if total[3] else None
    if run.master:
        tokens = run.global_batch * c["block_size"]  # in the global batch
        finite = lambda v: v if math.isfinite(v) else None  # null: a step the GradScaler skipped
        entry = {"iter": iter_num, "loss": finite(loss), "lr": get_lr(iter_num, c), "ms_per_iter": dt * 1e3,
                 "tokens_per_s": tokens / dt, "grad_norm": finite(grad_norm), "data_wait": data_seconds / dt}
        if run.peak_flops:  # the global batch ran on world devices, each with this peak
            entry["mfu"] = run.flops_per_token * tokens / dt / (run.world * run.peak_flops)
        if run.device_type == "cuda":
            entry["peak_mem_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
        if run.scaler.is_enabled():  # a skipped step is one AdamW did not count
            state = run.optimizer.state.get(run.optimizer.param_groups[0]["params"][0])  # AdamW's count of updates
            entry.update(grad_scale=run.scaler.get_scale(),
                         skipped_steps=iter_num + 1 - int(state["step"] if state else 0))
        record(run, entry, {k: entry[k] for k in ("iter", "loss", "lr", "mfu", "grad_norm", "data_wait",
                                                    "peak_mem_gib") if k in entry})
        extra = f", scale {entry['grad_scale']:g}, skipped {entry['skipped_steps']}" if run.scaler.is_enabled() else ""
        extra += f", peak mem {entry['peak_mem_gib']:.2f} GiB" if "peak_mem_gib" in entry else ""
        mfu = f"{entry['mfu']:.2%}" if "mfu" in entry else "n/a"
        print(f"iter {iter_num}: loss {loss:.4f}, lr {entry['lr']:.2e}, {dt * 1e3:.0f} ms, "
              f"{entry['tokens_per_s']:,.0f} tok/s, grad norm {grad_norm:.3g}, data {entry['data_wait']:.0%}, "
              f"mfu {mfu}{extra}")
    return bool(total[4]) or signal_name is not None, signal_name


def evaluate_and_checkpoint(run, c, iter_num):
    """Evaluate, stop on a non-finite val loss, log, and write the checkpoint (unless this process has not trained
    yet: at its first iteration the checkpoint, if any, is already this state)."""
    losses = evaluate(run, c)
    if not math.isfinite(losses["val"]):
        stop(run, f"non-finite val loss {losses['val']} at iter {iter_num}")
    best = losses["val"] < run.best_val_loss
    run.best_val_loss = min(run.best_val_loss, losses["val"])
    record(run, {"iter": iter_num, "val_loss": losses["val"], "train_loss": losses["train"]},
           {"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": get_lr(iter_num, c)})
    if run.master:
        print(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    if iter_num > run.start_iter:
        save(run, c, iter_num, best)


def save(run, c, iter_num, best=False):
    """Write ckpt.pt, the state before iteration iter_num, with every rank's RNG state (atomically: a kill mid-write
    leaves the previous one), and with keep_checkpoints=K keep it beside the K latest and the best (keep_checkpoint)."""
    rng = {"torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state(run.device) if run.device_type == "cuda" else None}
    rngs = [None] * run.world if run.ddp else [rng]
    if run.ddp:
        dist.all_gather_object(rngs, rng)
    run.last_save = time.monotonic()
    if not run.master:
        return
    save_checkpoint({"model": run.raw_model.state_dict(), "optimizer": run.optimizer.state_dict(),
                     "scaler": run.scaler.state_dict(), "model_args": asdict(run.gpt_config),
                     "format": CHECKPOINT_FORMAT, "tokenizer": tokenizer_identity(run.meta), "iter_num": iter_num,
                     "best_val_loss": run.best_val_loss, "config": c, "rng": rngs,
                     "data": {"sampler": "np.random.default_rng([seed, 0, iter])", "seed": c["seed"],
                              "next_iter": iter_num}, **({"init": run.source} if run.source else {})}, run.ckpt_path)
    if c["keep_checkpoints"]:
        keep_checkpoint(run.ckpt_path, iter_num, c["keep_checkpoints"], best)


def train(c):
    run, ckpt = setup(c)
    if run.start_iter >= c["max_iters"]:
        if run.master:
            print(f"nothing to train: at iteration {run.start_iter}, max_iters={c['max_iters']}; no checkpoint written")
        teardown_distributed(run.ddp)
        return
    build(run, c, ckpt)
    ckpt = None  # free its memory: the model and optimizer hold their state now
    start_logging(run, c)
    stop_signals, run.last_save = catch_stop_signals(), time.monotonic()

    iter_num = run.start_iter
    t0 = time.perf_counter()
    while True:
        if iter_num % c["eval_interval"] == 0 or iter_num == c["max_iters"]:
            evaluate_and_checkpoint(run, c, iter_num)
            t0 = time.perf_counter()  # evaluation is not training time
        if iter_num >= c["max_iters"]:
            break
        loss_sum, data_seconds = train_step(run, c, iter_num)
        t1 = time.perf_counter()  # before the log step reads the loss, as nanoGPT: no wait for the device here
        dt, t0 = t1 - t0, t1
        iter_num += 1
        if (iter_num - 1) % c["log_interval"] == 0:
            due, caught = log_step(run, c, iter_num - 1, loss_sum, dt, data_seconds, stop_signals)
            if caught or due and iter_num % c["eval_interval"] and iter_num != c["max_iters"]:  # (else just below)
                save(run, c, iter_num)
                t0 = time.perf_counter()
            if caught:
                finish(run)
                raise UserError(f"stopped by {caught} after iter {iter_num - 1}: {run.ckpt_path} holds the state "
                                "to continue from (--init_from=resume)")

    finish(run)
    if run.master:
        print(f"done: {run.ckpt_path} (iter {iter_num}, best val loss {run.best_val_loss:.4f})")


def kept(c):
    """What a Ctrl-C leaves behind (for its one line): the last checkpoint, from which --init_from=resume goes on."""
    path = Path(c["out_dir"]) / "ckpt.pt" if c else None
    if path is None or not path.is_file():
        return "no checkpoint was written"
    try:
        return f"{path} (iter {load_checkpoint(path, mmap=True)['iter_num']}) is kept: continue with --init_from=resume"
    except UserError as e:
        return str(e)


def remove_debris(out_dir, made):
    """After a run failed before its first checkpoint: an empty log.jsonl (beside no checkpoint), and out_dir itself
    when this run made it and it is empty, so that a failed start leaves the directory as it found it."""
    if out_dir is None or os.environ.get("RANK", "0") != "0":  # rank 0 alone writes there
        return
    log = Path(out_dir) / "log.jsonl"
    try:  # best effort: an out_dir that cannot be read (a name too long, a loop) has nothing to clean
        if log.is_file() and log.stat().st_size == 0 and not (Path(out_dir) / "ckpt.pt").exists():
            log.unlink()
        if made and Path(out_dir).is_dir() and not any(Path(out_dir).iterdir()):
            Path(out_dir).rmdir()
    except OSError:
        pass


def main(argv=None):
    c, made, failed = None, False, True
    try:
        c = load_config(sys.argv[1:] if argv is None else argv)
        made = not os.path.lexists(c["out_dir"])
        train(c)
        failed = False
    except UserError as e:
        error_exit("train.py", e)
    except KeyboardInterrupt:  # the checkpoint is written by a rename: an interrupted save leaves the last one
        exit_interrupted("train.py", lambda: kept(c))
    except Exception as e:  # torch.compile's own errors (dynamo, inductor) run to a hundred lines
        if not (c and c["compile"] and type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        error_exit("train.py", UserError(f"torch.compile failed ({type(e).__name__}: {first[:200]}); train with "
                                         "--compile=False"))
    finally:
        release_run_dirs()
        if failed:
            remove_debris(c and c["out_dir"], made)


if __name__ == "__main__":
    main()
