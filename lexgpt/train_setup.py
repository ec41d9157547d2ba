"""
train.py's setup: the processes, and every check that can fail before any work (the configuration,
out_dir, the dataset, a checkpoint to resume or to fine-tune from), so that a mistake is one line
before training starts, never an error hours into it. What it decides is a TrainRun; the model,
AdamW, the log and the steps are train.py's.
"""

import os
import shutil
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from alternatives import YARN_ALPHA, YARN_BETA
from lexgpt.checkpoint import checkpoint_path, load_checkpoint, model_config
from lexgpt.cli import UserError, rank_error
from lexgpt.data import check_tokenizer, load_meta, same_dir, trained_data_dir
from lexgpt.distributed import (
    all_reduce_sum,
    resolve_dtype,
    setup_distributed,
    teardown_distributed,
)
from lexgpt.outputs import writable_dir
from lexgpt.run_dir import kept_checkpoints, own_run_dir
from model import GPTConfig

# train.py's TrainConfig: the package never imports a script
TrainConfig = Any
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != "vocab_size"]
# a fine-tune's own model settings; the others are its source's
FINE_TUNED_KEYS = ("block_size", "dropout", "rope_scaling", "rope_factor", "rope_original_length",
                   "yarn_alpha", "yarn_beta")
# the RoPE scaling's settings, and their values without one
SCALING_KEYS = {"rope_factor": 1.0, "rope_original_length": 0, "yarn_alpha": YARN_ALPHA,
                "yarn_beta": YARN_BETA}


@dataclass(frozen=True)
class TrainRun:
    """What setup decides once, before any work: the processes, precision, data and model. Plain
    fields, read as they are by every step."""
    ddp: bool
    rank: int
    world: int
    device: str  # cpu, cuda:N or mps
    device_type: str  # the device without its index
    master: bool  # rank 0, which writes the checkpoints and the log
    dtype: str
    meta: dict  # the dataset's meta.json
    ckpt_path: Path
    gpt_config: GPTConfig | None  # None until a resumed checkpoint's is read
    init: dict | None  # a fine-tune's source (path, iter_num, config, model_args), else None
    start_iter: int = 0


def setup(cfg: TrainConfig, given: frozenset | None = None
          ) -> tuple[TrainConfig, TrainRun, dict | None, dict | None]:
    """Processes, device, precision, and every check that can fail before any work: wandb, out_dir
    (taken for this run: own_run_dir), the dataset, the checkpoint and the model's configuration
    (the checkpoint's on resume). given: the keys the user set (None: all), the only ones a note
    says are overridden. Returns (cfg, run, the checkpoint to resume, a fine-tune's source
    weights)."""
    ddp, rank, world, device = setup_distributed(cfg.device, cfg.ddp_timeout_minutes,
                                                 cfg.ddp_rendezvous_minutes)
    problem = None
    try:
        cfg, run, weights = check_run(cfg, ddp, rank, world, device, given)
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
        cfg, run = resumed(cfg, run, ckpt, given)
    check_data(cfg, run.meta, ckpt, run.ckpt_path)
    return cfg, run, ckpt, weights


def agree_on_error(problem: UserError | None, ddp: bool, device: str) -> None:
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


def check_run(cfg: TrainConfig, ddp: bool, rank: int, world: int, device: str,
              given: frozenset | None = None) -> tuple[TrainConfig, TrainRun, dict | None]:
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
    if cfg.init_from != "resume" and cfg.rope_scaling == "none":  # (resume: the checkpoint's)
        for key, unscaled in SCALING_KEYS.items():
            if getattr(cfg, key) != unscaled:
                methods = "yarn" if key.startswith("yarn") else "pi, ntk or yarn"
                raise UserError(f"{key}={getattr(cfg, key)!r} applies to rope_scaling {methods} "
                                "only: give --rope_scaling too")
    meta = run_dataset(cfg, ckpt_path)
    gpt_config, weights, init = None, None, None
    if cfg.init_from == "scratch":  # a bad configuration: one line before out_dir is made
        try:
            gpt_config = GPTConfig(vocab_size=meta["vocab_size"],
                                   **{k: getattr(cfg, k) for k in MODEL_KEYS})
        except ValueError as e:
            raise UserError(str(e)) from None
    elif cfg.init_from != "resume":
        cfg, gpt_config, weights, init = fine_tune_source(cfg, meta, rank == 0, given)
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
    run = TrainRun(ddp=ddp, rank=rank, world=world, device=device,
                   device_type=device.split(":")[0], master=rank == 0, dtype=dtype, meta=meta,
                   ckpt_path=ckpt_path, gpt_config=gpt_config, init=init)
    return cfg, run, weights


def adopt(cfg: TrainConfig, gpt_config: GPTConfig, where: str | Path, master: bool,
          own: dict | tuple = (), given: frozenset | None = None) -> TrainConfig:
    """cfg with the model's settings, noting each one the user set (given; None: all) that it
    overrides (but this run's own): a default is nobody's choice."""
    for k in MODEL_KEYS:
        ours, theirs = getattr(cfg, k), getattr(gpt_config, k)
        if ours != theirs and k not in own and (given is None or k in given) and master:
            print(f"note: {k}={ours!r} ignored, {where} has {theirs!r}")
    return replace(cfg, **{k: getattr(gpt_config, k) for k in MODEL_KEYS})


def resumed(cfg: TrainConfig, run: TrainRun, ckpt: dict,
            given: frozenset | None = None) -> tuple[TrainConfig, TrainRun]:
    """A training checkpoint for this dataset's tokenizer, whose architecture wins over cfg's."""
    path = run.ckpt_path
    missing = [k for k in ("optimizer", "scaler", "iter_num", "best_val_loss", "rng")
               if k not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} cannot be resumed: it has no {', '.join(missing)}")
    gpt_config = model_config(ckpt, path)
    check_tokenizer(ckpt, path, run.meta, cfg.data_dir)
    cfg = adopt(cfg, gpt_config, "the checkpoint", run.master, given=given)
    # a fine-tune's source is kept in every checkpoint
    run = replace(run, gpt_config=gpt_config, init=ckpt.get("init"),
                  start_iter=ckpt["iter_num"])
    return cfg, run


def check_data(cfg: TrainConfig, meta: dict, ckpt: dict | None, ckpt_path: Path) -> None:
    """Task records made for this block_size, and splits longer than it."""
    record = meta.get("record")  # a task dataset's record: one training sequence
    if record and record != cfg.block_size + 1:
        trained = ""
        fix = (f"train with --block_size={record - 1}, or prepare the tasks again with "
               f"--block_size {cfg.block_size}")
        if ckpt:
            trained = f", and {ckpt_path} was trained at block_size={cfg.block_size}"
            fix = f"resume on the data it was trained on ({trained_data_dir(ckpt)})"
        raise UserError(f"{cfg.data_dir} holds task records of {record} tokens, made for "
                        f"block_size {record - 1}{trained}: {fix}")
    for split in ("train", "val"):
        n = meta["files"][split]["tokens"]
        if n <= cfg.block_size:
            raise UserError(f"the {split} split of {cfg.data_dir} has {n} tokens, not more than "
                            f"block_size={cfg.block_size}")


def fine_tune_source(cfg: TrainConfig, meta: dict, master: bool, given: frozenset | None = None
                     ) -> tuple[TrainConfig, GPTConfig, dict, dict]:
    """init_from=<checkpoint>: (cfg, the model's configuration, the source's weights, the
    source's record: init, kept in every checkpoint). The model is the source's (source_config)
    but for FINE_TUNED_KEYS, which are this run's. A RoPE scaling's original length, unless given,
    is the length the source's unscaled angles were trained at: its own original length if it was
    scaled (so a chain of fine-tunes keeps the first one's, as Hugging Face keeps
    original_max_position_embeddings), else its block_size. Nothing else in the state_dict depends
    on the length, so the weights fit at any block_size but learned positions'."""
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
    source_config = model_config(ckpt, path)
    check_tokenizer(ckpt, path, meta, cfg.data_dir)
    if source_config.pos == "learned" and cfg.block_size != source_config.block_size:
        raise UserError(f"{path} has pos='learned', a table of {source_config.block_size} "
                        f"positions: it cannot be fine-tuned at block_size={cfg.block_size} (the "
                        "other schemes can)")
    own = {k: getattr(cfg, k) for k in FINE_TUNED_KEYS}
    if cfg.rope_scaling != "none" and not cfg.rope_original_length:
        own["rope_original_length"] = (source_config.rope_original_length
                                       or source_config.block_size)
        if cfg.block_size < own["rope_original_length"]:  # checked here, in the user's keys
            raise UserError(f"block_size={cfg.block_size} is below {path}'s original length "
                            f"{own['rope_original_length']}: rope_scaling={cfg.rope_scaling!r} "
                            "extends a model past the length it was trained at; fine-tune at a "
                            "block_size of at least that, or without rope_scaling")
    try:
        config = replace(source_config, **own)
    except ValueError as e:
        raise UserError(str(e)) from None
    cfg = adopt(cfg, config, path, master, own, given)
    trained = source_config.rope_scaling
    chosen = given is not None and "rope_scaling" in given
    if trained != config.rope_scaling and master and not chosen:  # a scaled source, unscaled here
        print(f"note: {path} was trained with rope_scaling={trained!r}; this run trains with "
              f"{config.rope_scaling!r} (give --rope_scaling to keep it)")
    init = {"path": str(path.resolve()), "iter_num": ckpt.get("iter_num", 0),
            "config": ckpt.get("config"), "model_args": ckpt["model_args"],
            "init": ckpt.get("init")}
    return cfg, config, ckpt["model"], init


def run_dataset(cfg: TrainConfig, ckpt_path: Path) -> dict:
    """data_dir's meta.json. Where there is none and the run continues a checkpoint (a resume, a
    fine-tune) whose dataset is elsewhere (a relative data_dir given in another directory than its
    run was made in, say), the error names that dataset instead of sending the user to build a
    second one here with prepare_data.py."""
    if cfg.init_from == "scratch" or (Path(cfg.data_dir) / "meta.json").is_file():
        return load_meta(cfg.data_dir)
    source = ckpt_path if cfg.init_from == "resume" else Path(cfg.init_from)
    try:
        ckpt = load_checkpoint(source, mmap=True, verify=())
    except (UserError, OSError):  # reported as such once the dataset is there
        return load_meta(cfg.data_dir)
    trained = trained_data_dir(ckpt)
    if (Path(trained) / "meta.json").is_file() and not same_dir(trained, cfg.data_dir):
        here = "" if Path(cfg.data_dir).is_absolute() else f", relative to {os.getcwd()}"
        trained = os.path.abspath(trained)
        raise UserError(f"no dataset at {cfg.data_dir} (no meta.json{here}); {source} was "
                        f"trained on {trained}: give --data_dir={trained}")
    return load_meta(cfg.data_dir)


def check_compiler(device_type: str) -> None:
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
