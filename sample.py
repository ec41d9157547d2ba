r"""
Sample from a trained checkpoint with model.py's cached generate; past block_size with every scheme
but learned.

    python sample.py --ckpt out/shakespeare_char_xpos/ckpt.pt --start "ROMEO:" --max_new_tokens 2000
    python sample.py --ckpt CKPT --start FILE:prompt.txt --num_samples 3 --temperature 0.8 \
        --top_k 50 --seed 7

--bca auto (default) switches blockwise causal attention on once the text is longer than
block_size; --attention sliding|sinks (with --window, --sinks) and --rope_scaling
pi|ntk|dynamic_ntk|yarn (with --rope_factor) decode with those instead (model.py's AttentionRule
and RopeScaling). As in eval_extrapolate.py, --rope_factor on a fine-tuned checkpoint counts over
the original length it stores, as its own scaling does; without it s follows the length (the
cache's) from there.

One process: under torchrun (RANK set) every rank would print every sample, so sample.py refuses it
with a one-line error (printed once).
"""

import argparse
import math
import os
from pathlib import Path

import torch

from lexgpt.checkpoint import load_model
from lexgpt.cli import ArgumentParser, UserError, check_seed, error_exit, exit_interrupted
from lexgpt.data import checkpoint_dataset, tokenizer_from_meta
from lexgpt.inference_options import (
    Runtime,
    add_checkpoint_args,
    attention_options,
    check_rule,
    checkpoint_scaling,
    learned_length_check,
    pointless,
)

MIN_TEMPERATURE = 1e-4  # logits / temperature stays within float32 for logits up to 10^34


def read_prompt(path):
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"--start FILE:{path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"--start FILE:{path} is a directory") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--start FILE:{path} is not UTF-8 text (byte {e.start}): "
                        "give a text file") from None
    except OSError as e:  # unreadable: permissions, a name too long, an I/O error
        raise UserError(f"--start FILE:{path} is not readable: {e.strerror}") from None


def sample(args):
    if "RANK" in os.environ:  # torchrun: each rank would print every sample
        raise UserError(f"RANK={os.environ['RANK']} is set (torchrun?): sample.py runs as one "
                        "process; run it with python, not torchrun")
    runtime = Runtime.local(args.device, args.dtype)
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UserError("--max_new_tokens and --num_samples must be >= 1")
    # logits / 1e-40 overflow float32, and softmax gives NaN
    if not MIN_TEMPERATURE <= args.temperature < math.inf:
        raise UserError(f"--temperature {args.temperature} must be > 0: "
                        f"a finite number >= {MIN_TEMPERATURE} (use --top_k 1 for greedy decoding)")
    check_seed(args.seed)
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top_k {args.top_k} must be >= 1")
    (rule,), (scaling,) = attention_options(args)
    model, ckpt = load_model(args.ckpt, runtime.device)
    scaling = checkpoint_scaling(model.config, scaling)
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise UserError(f"checkpoint {args.ckpt} holds non-finite weights (inf or NaN): "
                        "it cannot be sampled from")
    why = pointless(model.config, rule, scaling)
    if why:
        raise UserError(f"{args.ckpt}: {why}")
    tokenizer = tokenizer_from_meta(checkpoint_dataset(ckpt, args.ckpt, args.data_dir)[1])
    start = args.start
    if start.startswith("FILE:"):
        start = read_prompt(Path(start[5:]))
    ids = tokenizer.encode(start)
    if not ids:
        if tokenizer.eot is not None:
            ids = [tokenizer.eot]
        else:
            ids = [tokenizer.encode("\n")[0]]
    learned_length_check(model.config, len(ids) + args.max_new_tokens - 1, args.ckpt)
    check_rule(rule, len(ids) + args.max_new_tokens - 1, model.config.block_size, args.ckpt)
    torch.manual_seed(args.seed)
    x = torch.tensor([ids], dtype=torch.long, device=runtime.device)
    with torch.no_grad(), runtime.ctx:
        for k in range(args.num_samples):
            try:
                y = model.generate(x, args.max_new_tokens, args.temperature, args.top_k,
                                   attention=rule, rope_scaling=scaling)
            except RuntimeError as e:
                # finite weights can still overflow: torch.multinomial refuses NaN
                if "probability tensor" not in str(e):
                    raise
                raise UserError(f"{args.ckpt}: the next-token probabilities are not finite "
                                f"(inf or NaN) in {runtime.dtype}: "
                                "try --dtype float32 or a higher --temperature") from None
            print(tokenizer.decode(y[0].tolist()))
            print("-" * 40 if k + 1 < args.num_samples else "", flush=True)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--start", default="\n", help="the prompt, or FILE:path to read it from a file")
    p.add_argument("--max_new_tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=1337)
    add_checkpoint_args(p)
    return p.parse_args(argv)


def interrupted():
    return "nothing was written; run the command again"


def main(argv=None):
    try:
        sample(parse_args(argv))
    except UserError as e:
        error_exit("sample.py", e)  # once under torchrun, from rank 0
    except KeyboardInterrupt:
        exit_interrupted("sample.py", interrupted)


if __name__ == "__main__":
    main()
