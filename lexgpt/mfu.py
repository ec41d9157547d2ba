"""
Model FLOPs utilization (MFU): a GPT's training FLOPs per token, by PaLM's count, over the peak
matmul FLOP/s of the device in the dtype used.
"""

import functools
import statistics
import time

import torch
import torch.nn.functional as F


def train_flops_per_token(config):
    """Training FLOPs per token of a GPT of this config (n_layer, n_head, n_embd, block_size,
    vocab_size, pos, bias), by PaLM's appendix B as nanoGPT's estimate_mfu counts them: 6N for the
    parameters' matmuls forward and backward, plus 12 L H Q T for attention's scores and weighted
    sums over T = block_size keys.

    N is counted from the config, as model.GPT lays it out: the token embedding once (it is tied
    to the output layer, whose matmul it is), per block 12 n_embd^2 weights, 2 LayerNorm scales and
    11 n_embd biases when bias=True, and the final LayerNorm. A learned position table is a lookup,
    not a matmul: not counted, as in nanoGPT."""
    L, C, T, V = config.n_layer, config.n_embd, config.block_size, config.vocab_size
    bias = int(config.bias)
    n_params = V * C + L * (12 * C * C + (2 + 11 * bias) * C) + (1 + bias) * C
    return 6 * n_params + 12 * L * config.n_head * (C // config.n_head) * T


# Peak dense matmul FLOP/s per GPU by dtype, first name match wins (torch.cuda.get_device_name,
# e.g. "NVIDIA H100 80GB HBM3"). float32 has two entries: TF32 tensor cores, which float32 matmuls
# use when torch.backends.cuda.matmul.allow_tf32 is on (train.py turns it on), and plain float32.
# V100 has neither bfloat16 nor TF32: bfloat16 is counted at its float32 peak. Vendor figures,
# dense (no 2:4 sparsity), SXM boards: a PCIe H100 peaks lower and has its own entry; a PCIe V100
# or A100 is counted at its SXM figures (a few % off for V100).
GPU_PEAK_FLOPS = (  # name substring, {bfloat16, float16, tf32, float32}
    ("H100 PCIe", dict(bfloat16=756e12, float16=756e12, tf32=378e12, float32=51e12)),
    ("H100", dict(bfloat16=989e12, float16=989e12, tf32=494e12, float32=67e12)),
    # H200: H100 SXM's compute, more memory
    ("H200", dict(bfloat16=989e12, float16=989e12, tf32=494e12, float32=67e12)),
    ("A100", dict(bfloat16=312e12, float16=312e12, tf32=156e12, float32=19.5e12)),
    ("V100", dict(bfloat16=15.7e12, float16=125e12, tf32=15.7e12, float32=15.7e12)),
)


def peak_flops(device, dtype):
    """Peak matmul FLOP/s of one device in dtype ("float32", "bfloat16", "float16"), the
    denominator of MFU: the table above for GPUs; None where no trustworthy peak is known (a GPU
    not in it, MPS, and a CPU, whose cores other work may share: a peak measured then reads low and
    MFU impossibly high), and MFU is then not reported."""
    if device.split(":")[0] != "cuda":
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
    """This CPU's matmul FLOP/s in dtype, measured once per process (a CPU has no vendor peak to
    divide by): the median of 3 timed n x n F.linear calls (the op nn.Linear runs), n doubled from
    256 until one takes 10 ms, so that every core is busy, or n reaches 2048. A machine busy with
    other work measures low, and MFU then reads high."""
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
