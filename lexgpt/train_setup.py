"""
train.py's setup: the processes; every check that can fail before any work (the configuration,
out_dir, the dataset, a checkpoint to resume or to fine-tune from), so that a mistake is one line
before training starts, never an error hours into it; then what the first iteration starts from:
the model, AdamW and the GradScaler (fresh, from a fine-tune's source, or resumed), and the log.
"""

import os
import shutil
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lexgpt.checkpoint import checkpoint_path, load_checkpoint, load_weights, model_config
from lexgpt.cli import UserError, rank_error
from lexgpt.data import check_tokenizer, load_meta
from lexgpt.distributed import all_reduce_sum, resolve_dtype, setup_distributed, teardown_distributed
from model import GPT, GPTConfig
from lexgpt.outputs import writable_dir
from lexgpt.run_dir import Log, clear_run_dir, kept_checkpoints, open_log, own_run_dir

MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != "vocab_size"]
# a fine-tune's own model settings; the others are its source's
FINE_TUNED_KEYS = ("block_size", "dropout", "rope_scaling", "rope_factor", "rope_original_length")


@dataclass(frozen=True)
class Run:
    """What setup decides once, before any work: the processes, precision, data and model."""
    ddp: bool
    rank: int
    world: int
    device: str
    dtype: str
    meta: dict  # the dataset's meta.json
    ckpt_path: Path
    gpt_config: GPTConfig  # None until a resumed checkpoint's is read
    source: dict  # a fine-tune's source, recorded in every checkpoint; else None
    start_iter: int = 0

    @property
    def master(self):
        return self.rank == 0

    @property
    def device_type(self):
        return self.device.split(":")[0]


def setup(cfg):
    """Processes, device, precision, and every check that can fail before any work: wandb, out_dir
    (taken for this run: own_run_dir), the dataset, the checkpoint and the model's configuration
    (the checkpoint's on resume). Returns (cfg, run, checkpoint, a fine-tune's source weights)."""
    ddp, rank, world, device = setup_distributed(cfg.device, cfg.ddp_timeout_minutes,
                                                 cfg.ddp_rendezvous_minutes)
    problem = None
    try:
        cfg, run, weights = check_run(cfg, ddp, rank, world, device)
    except UserError as e:
        problem = e
    agree_on_error(problem, ddp, device)  # rank 0 alone takes out_dir: all stop if it cannot
    resume = cfg.init_from == "resume"
    if ddp and resume:  # rank 0 writes the checkpoints: every rank must see the same out_dir
        here = torch.tensor(float(run.ckpt_path.exists()), device=device)
        seen = int(all_reduce_sum(here, ddp))
        if 0 < seen < world:
            raise UserError(f"{run.ckpt_path} exists on {seen} of {world} processes: out_dir (and "
                            "data_dir) must be on a filesystem every node shares")
    ckpt = None
    if resume:  # memory-mapped: the ranks of a node share one copy of it in the page cache
        ckpt = load_checkpoint(run.ckpt_path, mmap=True, verify=True)
        cfg, run = resumed(cfg, run, ckpt)
    check_data(cfg, run.meta, ckpt, run.ckpt_path)
    return cfg, run, ckpt, weights


def agree_on_error(problem, ddp, device):
    """Under torchrun, after checks that may fail on some ranks only (rank 0's out_dir, a file one
    node cannot see): every rank learns whether any failed and all stop together, instead of the
    others waiting in their next collective; the lowest failing rank prints its error, the others
    exit quietly. Alone: raise problem, if any."""
    if not ddp:
        if problem:
            raise problem
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    first = torch.tensor(float(rank if problem else world), device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    if first.item() < world:
        teardown_distributed(ddp)
        raise rank_error(problem or "another rank failed", quiet=rank != int(first.item()))


def check_run(cfg, ddp, rank, world, device):
    """The checks each rank makes alone, with no collective (setup agrees on their outcome), and
    out_dir's lock. Returns (cfg, run, a fine-tune's source weights or None)."""
    steps = cfg.gradient_accumulation_steps
    if steps % world:
        raise UserError(f"gradient_accumulation_steps={steps} must be divisible by the number of "
                        f"processes ({world}): it is the global number of micro-steps per "
                        "iteration")
    dtype = resolve_dtype(cfg.dtype, device)
    ckpt_path = checkpoint_path(cfg.out_dir)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if cfg.wandb_log:  # checked on every rank, so that all stop together
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError("wandb_log=True needs the wandb package: pip install wandb") from None
    meta = load_meta(cfg.data_dir)
    gpt_config, weights, source = None, None, None
    if cfg.init_from == "scratch":  # a bad configuration: one line before out_dir is made
        try:
            gpt_config = GPTConfig(vocab_size=meta["vocab_size"],
                                   **{k: getattr(cfg, k) for k in MODEL_KEYS})
        except ValueError as e:
            raise UserError(str(e)) from None
    elif cfg.init_from != "resume":
        cfg, gpt_config, weights, source = fine_tune_source(cfg, meta, rank == 0)
    if cfg.compile:
        check_compiler(device.split(":")[0])
    if rank == 0:  # which writes the checkpoints: out_dir's one owner, before anything in it
        writable_dir(cfg.out_dir, "out_dir")
        own_run_dir(cfg.out_dir)
    fresh = cfg.init_from != "resume"
    if fresh and ckpt_path.exists() and not cfg.overwrite:
        raise UserError(f"{ckpt_path} exists and init_from={cfg.init_from} would replace it: "
                        "continue it with --init_from=resume, or start over with --overwrite=True")
    kept = kept_checkpoints(ckpt_path)
    if fresh and kept and not cfg.overwrite:
        raise UserError(f"{cfg.out_dir} holds an earlier run's {', '.join(p.name for p in kept)}, "
                        f"which init_from={cfg.init_from} would remove: start over with "
                        "--overwrite=True, or give another out_dir")
    run = Run(ddp, rank, world, device, dtype, meta, ckpt_path, gpt_config, source)
    return cfg, run, weights


def adopt(cfg, gpt_config, where, master, own=()):
    """cfg with the model's settings, noting each given one it overrides (but this run's own)."""
    for k in MODEL_KEYS:
        given, theirs = getattr(cfg, k), getattr(gpt_config, k)
        if given != theirs and k not in own and master:
            print(f"note: {k}={given!r} ignored, {where} has {theirs!r}")
    return replace(cfg, **{k: getattr(gpt_config, k) for k in MODEL_KEYS})


def resumed(cfg, run, ckpt):
    """A training checkpoint for this dataset's tokenizer, whose architecture wins over cfg's."""
    path = run.ckpt_path
    missing = [k for k in ("optimizer", "scaler", "iter_num", "best_val_loss", "rng")
               if k not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} cannot be resumed: it has no {', '.join(missing)}")
    gpt_config = model_config(ckpt, path)
    check_tokenizer(ckpt, path, run.meta, cfg.data_dir)
    cfg = adopt(cfg, gpt_config, "the checkpoint", run.master)
    # a fine-tune's source is kept in every checkpoint
    run = replace(run, gpt_config=gpt_config, source=ckpt.get("init"),
                  start_iter=ckpt["iter_num"])
    return cfg, run


def check_data(cfg, meta, ckpt, ckpt_path):
    """Task records made for this block_size, and splits longer than it."""
    record = meta.get("record")  # a task dataset's record: one training sequence
    if record and record != cfg.block_size + 1:
        trained = ""
        fix = (f"train with --block_size={record - 1}, or prepare the tasks again with "
               f"--block_size {cfg.block_size}")
        if ckpt:
            trained = f", and {ckpt_path} was trained at block_size={cfg.block_size}"
            fix = f"resume on the data it was trained on ({ckpt['config']['data_dir']})"
        raise UserError(f"{cfg.data_dir} holds task records of {record} tokens, made for "
                        f"block_size {record - 1}{trained}: {fix}")
    for split in ("train", "val"):
        n = meta["files"][split]["tokens"]
        if n <= cfg.block_size:
            raise UserError(f"the {split} split of {cfg.data_dir} has {n} tokens, not more than "
                            f"block_size={cfg.block_size}")


def fine_tune_source(cfg, meta, master):
    """init_from=<checkpoint>: (cfg, the model's configuration, the source's weights, the source's
    record). The model is the source's but for FINE_TUNED_KEYS, which are this run's (a RoPE
    scaling's original length, unless given, the source's training length); nothing else in the
    state_dict depends on the length, so the weights fit at any block_size but learned
    positions'."""
    path = Path(cfg.init_from)
    try:
        found = path.is_file()
    except OSError as e:  # a name too long, a directory that cannot be read
        raise UserError(f"init_from={cfg.init_from!r} cannot be read: {e.strerror}") from None
    if not found:
        raise UserError(f"init_from={cfg.init_from!r} is not allowed: scratch, resume, or the "
                        "path of a checkpoint file to fine-tune from (there is no such file)")
    if path.resolve().parent == Path(cfg.out_dir).resolve():
        raise UserError(f"init_from={cfg.init_from} is in out_dir {cfg.out_dir}, whose "
                        "checkpoints a new run replaces: give the fine-tune its own out_dir")
    ckpt = load_checkpoint(path, mmap=True, verify=True)
    source = model_config(ckpt, path)
    check_tokenizer(ckpt, path, meta, cfg.data_dir)
    if source.pos == "learned" and cfg.block_size != source.block_size:
        raise UserError(f"{path} has pos='learned', a table of {source.block_size} positions: it "
                        f"cannot be fine-tuned at block_size={cfg.block_size} (the other schemes "
                        "can)")
    own = {k: getattr(cfg, k) for k in FINE_TUNED_KEYS}
    if cfg.rope_scaling != "none" and not cfg.rope_original_length:
        own["rope_original_length"] = source.rope_original_length or source.block_size
    try:
        config = replace(source, **own)
    except ValueError as e:
        raise UserError(str(e)) from None
    cfg = adopt(cfg, config, path, master, own)
    if source.rope_scaling != config.rope_scaling and master:  # a scaled source, unscaled here
        print(f"note: {path} was trained with rope_scaling={source.rope_scaling!r}; this run "
              f"trains with {config.rope_scaling!r} (give --rope_scaling to keep it)")
    record = {"path": str(path.resolve()), "iter_num": ckpt.get("iter_num", 0),
              "config": ckpt.get("config"), "model_args": ckpt["model_args"],
              "init": ckpt.get("init")}
    return cfg, config, ckpt["model"], record


def check_compiler(device_type):
    """torch.compile builds its kernels with a C++ compiler on CPU, and Triton's launcher with a C
    compiler on CUDA: without one it fails only at the first step, in a long traceback."""
    if device_type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler
        try:
            get_cpp_compiler()
        except Exception:
            raise UserError("compile=True on CPU needs a C++ compiler (g++, or $CXX) on PATH and "
                            "none works here: install one, or train with --compile=False") from None
    compilers = [cc for cc in (os.environ.get("CC"), "cc", "gcc", "clang") if cc]
    if device_type == "cuda" and not any(shutil.which(cc) for cc in compilers):
        raise UserError("compile=True on CUDA needs a C compiler (cc, gcc or clang, or $CC) on "
                        "PATH for Triton and none is there: install one, or train with "
                        "--compile=False")


def build(cfg, run, ckpt, weights):
    """The model (and it compiled and DDP-wrapped as asked), AdamW and the GradScaler: fresh, from
    a fine-tune's source weights, or as the checkpoint left them."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts them too)
    model = GPT(run.gpt_config).to(run.device)
    model.grad_checkpoint = cfg.grad_checkpoint
    # AdamW, weight decay on matrices and embeddings only. The fused kernel (one pass over each
    # parameter) where torch has it, CUDA and CPU, is safe with float16's GradScaler
    # (docs/engineering_notes.md); MPS keeps the default.
    fused = run.device_type in ("cuda", "cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                                  eps=cfg.adam_eps, fused=fused)
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.dtype == "float16")
    torch.manual_seed(cfg.seed + run.rank)  # dropout differs between ranks
    if weights is not None:  # a fine-tune: the source's weights, nothing else of its state
        load_weights(model, weights, run.source["path"])
    if ckpt:
        restore(ckpt, run, model, optimizer, scaler)
    wrapped = model
    if cfg.compile:
        wrapped = torch.compile(wrapped)
    if run.ddp:
        device_ids = [torch.device(run.device)] if run.device_type == "cuda" else None
        wrapped = DDP(wrapped, device_ids=device_ids)
    return model, wrapped, optimizer, scaler


def restore(ckpt, run, model, optimizer, scaler):
    """The state a checkpoint left: weights, AdamW's and the GradScaler's state, each rank's RNG."""
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


def start_log(cfg, run, model):
    """Rank 0: log.jsonl (on resume, without the entries the resumed run writes again:
    open_log), the wandb run and the run's first line."""
    if not run.master:
        return Log()
    fresh = cfg.init_from != "resume"
    clear_run_dir(run.ckpt_path, fresh)
    file = open_log(run.ckpt_path.with_name("log.jsonl"), run.start_iter)
    if run.source and fresh:
        print(f"fine-tuning {run.source['path']} (iter {run.source['iter_num']}) at "
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
