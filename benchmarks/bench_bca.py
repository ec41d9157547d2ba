"""
Benchmark: forward time and peak memory of blockwise causal attention (BCA) against plain causal attention as the
sequence grows. BCA should cost O(T * block_size): time per token roughly flat, memory linear in T.

    python benchmarks/bench_bca.py [--device cpu|cuda] [--block_size 256] [--max_mult 32] [--pos xpos]

Each measurement runs in a fresh process. Memory is the CUDA allocator's peak on GPU, and on CPU the growth of the
process's peak RSS over the forward passes (weights and the interpreter excluded).
"""

import argparse
import multiprocessing
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import GPT, GPTConfig  # noqa: E402


def peak_mib(device):
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def build(args):
    torch.manual_seed(0)
    config = GPTConfig(block_size=args.block_size, vocab_size=256, n_layer=4, n_head=4, n_embd=256, pos=args.pos)
    return GPT(config).to(args.device).eval()


def measure(args, T, bca):
    torch.set_num_threads(args.threads)
    model, device, repeats = build(args), args.device, args.repeats
    idx = torch.randint(0, model.config.vocab_size, (1, T), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = peak_mib(device)
    with torch.no_grad():
        model(idx, bca=bca)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            model(idx, bca=bca)
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    return seconds, peak_mib(device) - (0 if device == "cuda" else before)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--max_mult", type=int, default=32, help="longest sequence, in multiples of block_size")
    p.add_argument("--plain_max_mult", type=int, default=16, help="longest plain-attention run (it is O(T^2))")
    p.add_argument("--pos", default="xpos")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.threads = torch.get_num_threads()
    spawn = multiprocessing.get_context("spawn")
    print(f"# {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}), torch "
          f"{torch.__version__}, {args.pos}, 4 layers x 256 wide, block_size {args.block_size}, batch 1")
    print("| attention | T | T/block | ms | us/token | peak MiB |")
    print("|---|---|---|---|---|---|")
    for bca, label, top in ((True, "BCA", args.max_mult), (False, "plain causal", args.plain_max_mult)):
        mult = 1
        while mult <= top:
            T = mult * args.block_size
            with spawn.Pool(1) as pool:
                seconds, mib = pool.apply(measure, (args, T, bca))
            print(f"| {label} | {T} | {mult} | {seconds * 1e3:.1f} | {seconds * 1e6 / T:.1f} | {mib:.0f} |")
            mult *= 2


if __name__ == "__main__":
    main()
