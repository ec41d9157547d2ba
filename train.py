"""
Train a lex-gpt model, on one device or with DDP under torchrun, with nanoGPT's usage and keys:

    python train.py config/shakespeare_char.py --pos=rope --max_iters=500
    torchrun --standalone --nproc_per_node=8 train.py config/paper_lex_350m.py

The configuration: TrainConfig's defaults, then each config file, then each --key=value
(configurator.py). Training is plain causal language modelling at block_size, the paper's §4.1
recipe; the evaluation scripts apply blockwise causal attention (§3.3) to the checkpoints this
writes. Every global batch is drawn from np.random.default_rng([seed, 0, iter]) and cut into
per-rank micro-batches: 1 and N processes, and a resumed run, see the same batches.
"""

import json
import math
import os
import signal
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from alternatives import TRAINED_SCALINGS
from lexgpt.checkpoint import CHECKPOINT_FORMAT, load_checkpoint, load_weights, save_checkpoint
from lexgpt.cli import UserError, error_exit, exit_interrupted
from lexgpt.configurator import (
    AT_LEAST_ONE,
    COUNT,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    SEED,
    configure,
    key_help,
)
from lexgpt.data import get_batch, read_tokens, sample_offsets, tokenizer_identity
from lexgpt.distributed import DTYPES, all_reduce_sum, autocast, teardown_distributed
from lexgpt.mfu import peak_flops, train_flops_per_token
from lexgpt.run_dir import clear_run_dir, keep_checkpoint, open_log, release_run_dirs, remove_debris
from lexgpt.train_setup import TrainRun, setup
from model import GPT


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"  # the run's directory: ckpt.pt and log.jsonl
    log_interval: int = 10  # log a training step this often
    init_from: str = "scratch"  # scratch | resume (out_dir/ckpt.pt) | a checkpoint to fine-tune
    eval_interval: int = 250  # evaluate and write the checkpoint this often, and at the end
    keep_checkpoints: int = 0  # K >= 1: also keep the last K as ckpt_<iter>.pt, the best too
    checkpoint_minutes: float = 0.0  # > 0: also write the checkpoint this often (at log steps)
    eval_iters: int = 20  # batches per split per evaluation, shared out among the ranks
    wandb_log: bool = False  # also log to Weights & Biases (pip install wandb), from rank 0
    wandb_project: str = "lex-gpt"  # the wandb project
    wandb_run_name: str = ""  # empty: wandb picks one
    # data
    data_dir: str = "data/shakespeare_char"  # a dataset prepare_data.py wrote
    batch_size: int = 16  # sequences per micro-step per rank
    gradient_accumulation_steps: int = 1  # global micro-steps per iteration, over all ranks
    # model (GPTConfig; vocab_size comes from data_dir/meta.json)
    block_size: int = 256  # the training length, in tokens
    n_layer: int = 6  # layers
    n_head: int = 6  # attention heads
    n_embd: int = 384  # the width
    dropout: float = 0.0  # the dropout probability
    bias: bool = True  # biases in Linears and LayerNorms, as in GPT-2
    pos: str = "xpos"  # learned | sinusoidal | rope | alibi | xpos (paper §3.2) | none
    rope_base: float = 10000.0  # theta_j = rope_base^(-2j/d), for rope and xpos
    xpos_gamma: float = 0.4  # zeta_j = (2j + gamma*d) / ((1 + gamma)*d), paper Eq. 9
    xpos_scale_base: float = 512.0  # xPos's decay zeta^(n / scale_base); inf: none
    xpos_rotate: bool = True  # False: xPos without rotation, decay only (Table 4)
    rope_scaling: str = "none"  # none | pi | ntk | yarn: RoPE interpolation in training
    rope_factor: float = 1.0  # its s > 1
    rope_original_length: int = 0  # its unscaled length; 0: a fine-tune source's, else ours
    yarn_alpha: float = 1.0  # YaRN's ramp ends alpha < beta, in turns over that length
    yarn_beta: float = 32.0  # (its LLaMA defaults; pi and ntk have none)
    # AdamW
    learning_rate: float = 1e-3  # the peak learning rate
    max_iters: int = 5000  # the iterations to train
    weight_decay: float = 0.1  # on matrices and embeddings
    beta1: float = 0.9  # Adam's beta1
    beta2: float = 0.95  # Adam's beta2
    adam_eps: float = 1e-8  # Adam's epsilon
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 disables
    # learning rate: linear warmup, then cosine or polynomial (the paper's, §4.1) decay to min_lr
    decay_lr: bool = True  # False: learning_rate throughout
    warmup_iters: int = 100  # iterations of linear warmup
    lr_decay_iters: int = 5000  # the iteration the decay reaches min_lr
    min_lr: float = 1e-4  # the learning rate the decay ends at
    lr_schedule: str = "cosine"  # cosine | polynomial
    lr_power: float = 1.0  # polynomial decay power (1 = linear, fairseq's default)
    # system
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto: bf16 on sm80+, fp16 + GradScaler on older CUDA, fp32 on CPU
    compile: bool = False  # torch.compile the model
    seed: int = 1337  # the initial weights', the batches' and dropout's
    ddp_timeout_minutes: float = 30.0  # a rank's wait in a collective (rank 0 saving, say)
    ddp_rendezvous_minutes: float = 10.0  # the processes' wait for each other at the start
    grad_checkpoint: bool = False  # recompute activations in the backward pass: less memory
    overwrite: bool = False  # init_from=scratch over an out_dir with ckpt.pt: refused unless True


# dynamic NTK recomputes its factor at every pass: a model is fine-tuned with a fixed one
CHOICES = dict(lr_schedule=("cosine", "polynomial"), dtype=DTYPES, rope_scaling=TRAINED_SCALINGS)
CLIP = (NON_NEGATIVE[0], "a finite number >= 0 (0 disables clipping)")
LIMITS = dict(  # numeric keys, checked once the whole configuration is known
    learning_rate=POSITIVE, min_lr=NON_NEGATIVE, weight_decay=NON_NEGATIVE, beta1=FRACTION,
    beta2=FRACTION, adam_eps=POSITIVE, grad_clip=CLIP, lr_power=POSITIVE,
    checkpoint_minutes=NON_NEGATIVE, ddp_timeout_minutes=POSITIVE,
    ddp_rendezvous_minutes=POSITIVE, seed=SEED, max_iters=COUNT, warmup_iters=COUNT,
    lr_decay_iters=COUNT, keep_checkpoints=COUNT, eval_interval=AT_LEAST_ONE,
    eval_iters=AT_LEAST_ONE, log_interval=AT_LEAST_ONE, batch_size=AT_LEAST_ONE,
    gradient_accumulation_steps=AT_LEAST_ONE)


def load_config(argv: list[str], given: set | None = None) -> TrainConfig:
    """The configuration argv makes; given, a set, gets the keys it set."""
    return TrainConfig(**configure(asdict(TrainConfig()), argv, CHOICES, LIMITS, given))


def help_text() -> str:
    """--help: the usage, and every key with its default and meaning, from TrainConfig itself."""
    return "\n".join([
        "usage: python train.py [config_file.py ...] [--key=value ...]", "",
        "Train a lex-gpt model (docs/training.md). The configuration: the defaults below, then",
        "each config file (Python assignments) and each --key=value, in order.",
        *key_help(TrainConfig)])


def get_lr(it: int, cfg: TrainConfig) -> float:
    """Linear warmup (non-zero at step 0), then cosine or polynomial decay to min_lr at
    lr_decay_iters."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    if cfg.lr_schedule == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        coeff = (1.0 - progress) ** cfg.lr_power
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


# -------------------------------------------------------------------------------------------------
# The model, AdamW and the GradScaler, and the checkpoint that saves them


@dataclass
class Trainer:
    """What the steps run and update. model is raw_model compiled and DDP-wrapped as asked; a
    checkpoint saves raw_model's weights, under their own names."""
    model: torch.nn.Module
    raw_model: GPT
    optimizer: torch.optim.AdamW
    scaler: torch.amp.GradScaler


def build(cfg: TrainConfig, run: TrainRun, ckpt: dict | None, weights: dict | None) -> Trainer:
    """The model, AdamW and the GradScaler: fresh, from a fine-tune's source weights, or as the
    checkpoint left them."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts them too)
    raw_model = GPT(run.gpt_config).to(run.device)
    raw_model.grad_checkpoint = cfg.grad_checkpoint
    # AdamW, weight decay on matrices and embeddings only. The fused kernel (one pass over each
    # parameter) where torch has it, CUDA and CPU, is safe with float16's GradScaler
    # (docs/engineering_notes.md); MPS keeps the default.
    params = [p for p in raw_model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                                  eps=cfg.adam_eps, fused=run.device_type in ("cuda", "cpu"))
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.dtype == "float16")
    torch.manual_seed(cfg.seed + run.rank)  # dropout differs between ranks
    if weights is not None:  # a fine-tune: the source's weights, nothing else of its state
        load_weights(raw_model, weights, run.init["path"])
    if ckpt:
        restore(ckpt, run, raw_model, optimizer, scaler)
    model = raw_model
    if cfg.compile:
        model = torch.compile(model)
    if run.ddp:
        device_ids = [torch.device(run.device)] if run.device_type == "cuda" else None
        model = DDP(model, device_ids=device_ids)
    return Trainer(model, raw_model, optimizer, scaler)


def restore(ckpt: dict, run: TrainRun, model: GPT, optimizer: torch.optim.AdamW,
            scaler: torch.amp.GradScaler) -> None:
    """The state a checkpoint left (save): weights, AdamW's and the GradScaler's state, each rank's
    RNG."""
    fused = optimizer.defaults["fused"]
    load_weights(model, ckpt["model"], run.ckpt_path)
    for group in ckpt["optimizer"]["param_groups"]:  # the saved choice may be another device's:
        group["fused"] = fused  # this run's, set before loading, places the state to suit it
    optimizer.load_state_dict(ckpt["optimizer"])
    if scaler.is_enabled() and ckpt["scaler"]:  # a bfloat16/float32 run saved none: start afresh
        scaler.load_state_dict(ckpt["scaler"])
    rngs = ckpt["rng"]  # each rank's
    if len(rngs) == run.world:
        torch.set_rng_state(rngs[run.rank]["torch"])
        if run.device_type == "cuda" and rngs[run.rank]["cuda"] is not None:
            torch.cuda.set_rng_state(rngs[run.rank]["cuda"], run.device)
    elif run.master:
        print(f"note: checkpoint from {len(rngs)} processes, resuming on {run.world}: dropout "
              "RNG reseeded")


def save(cfg: TrainConfig, run: TrainRun, trainer: Trainer, iter_num: int, best_val_loss: float,
         best: bool = False) -> float:
    """Write ckpt.pt, the state before iteration iter_num, with every rank's RNG state (atomically:
    a kill mid-write leaves the previous one), and with keep_checkpoints=K keep it beside the K
    latest and the best (keep_checkpoint). Returns when (time.monotonic())."""
    rng = {"torch": torch.get_rng_state(), "cuda": None}
    if run.device_type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    rngs = [rng]
    if run.ddp:
        rngs = [None] * run.world
        dist.all_gather_object(rngs, rng)
    saved = time.monotonic()
    if not run.master:
        return saved
    sampler = {"sampler": "np.random.default_rng([seed, 0, iter])", "seed": cfg.seed,
               "next_iter": iter_num}
    ckpt = {"model": trainer.raw_model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scaler": trainer.scaler.state_dict(), "model_args": asdict(run.gpt_config),
            "format": CHECKPOINT_FORMAT, "tokenizer": tokenizer_identity(run.meta),
            "cwd": os.getcwd(),  # what the config's relative paths (data_dir) are relative to
            "iter_num": iter_num, "best_val_loss": best_val_loss, "config": asdict(cfg),
            "rng": rngs, "data": sampler}
    if run.init:
        ckpt["init"] = run.init
    save_checkpoint(ckpt, run.ckpt_path)
    if cfg.keep_checkpoints:
        keep_checkpoint(run.ckpt_path, iter_num, cfg.keep_checkpoints, best)
    return saved


# -------------------------------------------------------------------------------------------------
# The log: log.jsonl, wandb and the console


def finite_or_none(v: float) -> float | None:
    """v, or None (JSON's null) where it is not finite."""
    if math.isfinite(v):
        return v
    return None


class Log:
    """Rank 0's record of the run: log.jsonl, the same numbers under nanoGPT's names to wandb
    when it is on, and the console. The other ranks' writes nothing."""

    def __init__(self, file: TextIO | None = None, wandb_run=None):
        self.file = file
        self.wandb = wandb_run

    def write(self, entry: dict, wandb_entry: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log(wandb_entry)

    def evaluation(self, iter_num: int, losses: dict, lr: float) -> None:
        if self.file is None:
            return
        train_loss, val_loss = losses["train"], losses["val"]
        self.write({"iter": iter_num, "val_loss": val_loss, "train_loss": train_loss},
                   {"iter": iter_num, "train/loss": train_loss, "val/loss": val_loss, "lr": lr})
        print(f"iter {iter_num}: train loss {train_loss:.4f}, val loss {val_loss:.4f}")

    def step(self, entry: dict) -> None:
        """A training step: a loss or norm that is not finite (a step the GradScaler skipped) is
        logged as null."""
        if self.file is None:
            return
        logged = dict(entry, loss=finite_or_none(entry["loss"]),
                      grad_norm=finite_or_none(entry["grad_norm"]))
        names = ("iter", "loss", "lr", "mfu", "grad_norm", "data_wait", "peak_mem_gib")
        self.write(logged, {k: logged[k] for k in names if k in logged})
        extra = ""
        if "grad_scale" in entry:
            extra += f", scale {entry['grad_scale']:g}, skipped {entry['skipped_steps']}"
        if "peak_mem_gib" in entry:
            extra += f", peak mem {entry['peak_mem_gib']:.2f} GiB"
        mfu = "n/a"
        if "mfu" in entry:
            mfu = f"{entry['mfu']:.2%}"
        print(f"iter {entry['iter']}: loss {entry['loss']:.4f}, lr {entry['lr']:.2e}, "
              f"{entry['ms_per_iter']:.0f} ms, {entry['tokens_per_s']:,.0f} tok/s, "
              f"grad norm {entry['grad_norm']:.3g}, data {entry['data_wait']:.0%}, "
              f"mfu {mfu}{extra}")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb:
            self.wandb.finish()


def start_log(cfg: TrainConfig, run: TrainRun, model: GPT) -> Log:
    """Rank 0: log.jsonl (on resume, without the entries the resumed run writes again:
    open_log), the wandb run and the run's first line."""
    if not run.master:
        return Log()
    fresh = cfg.init_from != "resume"
    clear_run_dir(run.ckpt_path, fresh)
    file = open_log(run.ckpt_path.with_name("log.jsonl"), run.start_iter)
    if run.init and fresh:
        print(f"fine-tuning {run.init['path']} (iter {run.init['iter_num']}) at "
              f"block_size={cfg.block_size}, rope_scaling={cfg.rope_scaling}")
    wandb_run = None
    if cfg.wandb_log:
        import wandb
        name = cfg.wandb_run_name or None
        wandb_run = wandb.init(project=cfg.wandb_project, name=name, config=asdict(cfg))
    n_params = sum(p.numel() for p in model.parameters())
    batch = cfg.batch_size * cfg.gradient_accumulation_steps
    print(f"{n_params / 1e6:.2f}M parameters, pos={cfg.pos}, {run.device} {run.dtype}, "
          f"{run.world} process(es), global batch {batch} x {cfg.block_size} tokens, "
          f"iterations {run.start_iter} -> {cfg.max_iters}")
    return Log(file, wandb_run)


# -------------------------------------------------------------------------------------------------
# The steps


@torch.no_grad()
def evaluate(model: torch.nn.Module, cfg: TrainConfig, run: TrainRun,
             ctx: AbstractContextManager) -> dict:
    """Mean loss over eval_iters fixed batches per split; batch k runs on rank k % world."""
    model.eval()
    out = {}
    for stream, split in ((1, "train"), (2, "val")):
        data = read_tokens(cfg.data_dir, split, run.meta)
        total = torch.zeros(2, device=run.device)
        for k in range(run.rank, cfg.eval_iters, run.world):
            offsets = sample_offsets(cfg.seed, stream, k, data, cfg.batch_size, cfg.block_size)
            x, y = get_batch(data, offsets, cfg.block_size, run.device)
            with ctx:
                _, loss = model(x, y)
            total += torch.stack((loss.float(), torch.ones((), device=run.device)))
        total = all_reduce_sum(total, run.ddp)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out


def train_step(trainer: Trainer, cfg: TrainConfig, run: TrainRun, ctx: AbstractContextManager,
               iter_num: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """This rank's micro-steps of the global batch, then AdamW through the GradScaler (a no-op
    unless float16). Returns the summed loss and the gradient norm before clipping, unread on the
    device (reading makes the host wait), and the seconds spent reading batches."""
    model, optimizer, scaler = trainer.model, trainer.optimizer, trainer.scaler
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num, cfg)
    micro_steps = cfg.gradient_accumulation_steps // run.world
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    data = read_tokens(cfg.data_dir, "train", run.meta)  # opened each step: a kept memmap leaks
    offsets = sample_offsets(cfg.seed, 0, iter_num, data, global_batch, cfg.block_size)
    loss_sum = torch.zeros((), device=run.device)
    data_seconds = 0.0
    for micro in range(micro_steps):
        first = (run.rank * micro_steps + micro) * cfg.batch_size
        t0 = time.perf_counter()
        batch = offsets[first : first + cfg.batch_size]
        x, y = get_batch(data, batch, cfg.block_size, run.device)
        data_seconds += time.perf_counter() - t0
        sync = nullcontext()
        if run.ddp and micro < micro_steps - 1:  # gradients all-reduced at the last one only
            sync = model.no_sync()
        with sync, ctx:
            _, loss = model(x, y)
        loss_sum += loss.detach()  # float32: the model's loss always is, autocast or not
        scaler.scale(loss / micro_steps).backward()
    scaler.unscale_(optimizer)  # a no-op unless float16: the norm and clipping see true gradients
    params = list(model.parameters())
    if cfg.grad_clip:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    else:  # the norm alone
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, data_seconds


def memory_and_scaler(run: TrainRun, trainer: Trainer, iter_num: int) -> dict:
    """Peak GPU memory, and the GradScaler's scale and the steps it skipped, which AdamW did not
    count, since the run started."""
    optimizer, scaler = trainer.optimizer, trainer.scaler
    state = {}
    if run.device_type == "cuda":
        state["peak_mem_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    if scaler.is_enabled():
        adam = optimizer.state.get(optimizer.param_groups[0]["params"][0])
        updates = int(adam["step"]) if adam else 0
        state["grad_scale"] = scaler.get_scale()
        state["skipped_steps"] = iter_num + 1 - updates
    return state


def catch_stop_signals() -> list[str]:
    """SIGTERM (a scheduler preempting the job; torchrun passes it on to every rank) and SIGUSR1
    (SLURM's --signal=USR1@120 warning, say) ask for a checkpoint and a clean stop at the next log
    step, where the ranks agree on it. Returns the list the names of the caught signals go to."""
    caught = []

    def catch(signum, frame):
        caught.append(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, catch)
    return caught


def finish(log: Log, run: TrainRun) -> None:
    log.close()
    teardown_distributed(run.ddp)


def stop(log: Log, run: TrainRun, problem: str) -> None:
    """Stop on a non-finite loss: every rank gets here at the same iteration (all-reduced)."""
    finish(log, run)
    raise UserError(f"{problem}; stopped, the last good checkpoint ({run.ckpt_path}) is kept")


def train(cfg: TrainConfig, given: frozenset | None = None) -> None:
    """The run cfg describes; given: the keys the user set (None: all), for setup's notes."""
    cfg, run, ckpt, weights = setup(cfg, given)
    if run.start_iter >= cfg.max_iters:
        if run.master:
            print(f"nothing to train: at iteration {run.start_iter}, max_iters={cfg.max_iters}; "
                  "no checkpoint written")
        teardown_distributed(run.ddp)
        return
    trainer = build(cfg, run, ckpt, weights)
    best_val_loss = ckpt["best_val_loss"] if ckpt else float("inf")
    ckpt = weights = None  # free their memory: the model and optimizer hold their state now
    log = start_log(cfg, run, trainer.raw_model)
    ctx = autocast(run.device, run.dtype)
    tokens = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size  # an iteration's
    flops_per_token = train_flops_per_token(run.gpt_config)
    peak = peak_flops(run.device, run.dtype)  # per device; None where unknown (a CPU)
    stop_signals = catch_stop_signals()
    # the first iteration whose loss was not finite, kept on the device until a log step reads it
    first_nonfinite = torch.full((), -1, device=run.device)
    iter_num = run.start_iter
    last_save = time.monotonic()
    t0 = time.perf_counter()
    while True:
        # evaluate, and write the checkpoint (unless this process has not trained yet: at its
        # first iteration the checkpoint, if any, is already this state)
        if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters:
            losses = evaluate(trainer.model, cfg, run, ctx)
            if not math.isfinite(losses["val"]):
                stop(log, run, f"non-finite val loss {losses['val']} at iter {iter_num}")
            best = losses["val"] < best_val_loss
            best_val_loss = min(best_val_loss, losses["val"])
            log.evaluation(iter_num, losses, get_lr(iter_num, cfg))
            if iter_num > run.start_iter:
                last_save = save(cfg, run, trainer, iter_num, best_val_loss, best)
            t0 = time.perf_counter()  # evaluation is not training time
        if iter_num >= cfg.max_iters:
            break

        loss_sum, grad_norm, data_seconds = train_step(trainer, cfg, run, ctx, iter_num)
        if not trainer.scaler.is_enabled():  # float16's GradScaler skips such a step: no error
            first = (first_nonfinite < 0) & ~torch.isfinite(loss_sum)
            first_nonfinite = torch.where(first, iter_num, first_nonfinite)
        t1 = time.perf_counter()  # before the loss is read, as nanoGPT: no wait for the device
        dt, t0 = t1 - t0, t1

        if iter_num % cfg.log_interval == 0:
            # one all-reduce reads the loss and decides, for every rank alike, whether to stop
            # (a loss not finite, a signal caught) and whether to write the checkpoint now
            elapsed = time.monotonic() - last_save
            due = cfg.checkpoint_minutes > 0 and elapsed >= 60 * cfg.checkpoint_minutes
            values = torch.stack((loss_sum, (first_nonfinite >= 0).float(), grad_norm.float()))
            flags = torch.tensor([float(bool(stop_signals)), float(due)], device=run.device)
            total = all_reduce_sum(torch.cat((values, flags)), run.ddp).tolist()
            loss_total, nonfinite, norm_total, stopping, due = total  # sums over the ranks
            if nonfinite:
                first = int(first_nonfinite)
                problem = f"non-finite loss at iter {first}"
                if first < 0:
                    after = iter_num - cfg.log_interval
                    problem = f"non-finite loss on another rank, after iter {after}"
                stop(log, run, problem)
            if run.master:
                entry = {"iter": iter_num, "loss": loss_total / cfg.gradient_accumulation_steps,
                         "lr": get_lr(iter_num, cfg), "ms_per_iter": dt * 1e3,
                         "tokens_per_s": tokens / dt, "grad_norm": norm_total / run.world,
                         "data_wait": data_seconds / dt}
                if peak:  # the global batch ran on world devices, each with this peak
                    entry["mfu"] = flops_per_token * tokens / dt / (run.world * peak)
                entry.update(memory_and_scaler(run, trainer, iter_num))
                log.step(entry)
            next_iter = iter_num + 1
            evaluates = next_iter % cfg.eval_interval == 0 or next_iter == cfg.max_iters
            if stopping or (due and not evaluates):  # (else at the evaluation just below)
                last_save = save(cfg, run, trainer, next_iter, best_val_loss)
                t0 = time.perf_counter()
            if stopping:
                caught = (stop_signals or ["a signal on another rank"])[0]
                finish(log, run)
                raise UserError(f"stopped by {caught} after iter {iter_num}: {run.ckpt_path} "
                                "holds the state to continue from (--init_from=resume)")
        iter_num += 1

    finish(log, run)
    if run.master:
        print(f"done: {run.ckpt_path} (iter {iter_num}, best val loss {best_val_loss:.4f})")


def kept(cfg: TrainConfig | None) -> str:
    """What a Ctrl-C leaves behind, for its one line: the last checkpoint, to go on from."""
    if cfg is None:
        return "no checkpoint was written"
    path = Path(cfg.out_dir) / "ckpt.pt"
    if not path.is_file():
        return "no checkpoint was written"
    try:
        iter_num = load_checkpoint(path, mmap=True)["iter_num"]
    except UserError as e:
        return str(e)
    return f"{path} (iter {iter_num}) is kept: continue with --init_from=resume"


def main(argv: list[str] | None = None) -> None:
    cfg, made, failed = None, False, True
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return
    try:
        given = set()
        cfg = load_config(argv, given)
        made = not os.path.lexists(cfg.out_dir)
        train(cfg, frozenset(given))
        failed = False
    except UserError as e:
        error_exit("train.py", e)
    except KeyboardInterrupt:  # checkpoints are written by a rename: the last one is whole
        exit_interrupted("train.py", partial(kept, cfg))
    except Exception as e:  # torch.compile's own errors (dynamo, inductor) run to a hundred lines
        compiler = type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))
        if not (cfg and cfg.compile and compiler):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        error_exit("train.py", UserError(f"torch.compile failed ({type(e).__name__}: "
                                         f"{first[:200]}); train with --compile=False"))
    finally:
        try:
            if failed and cfg:
                remove_debris(cfg.out_dir, made)
        finally:
            release_run_dirs()


if __name__ == "__main__":
    main()
