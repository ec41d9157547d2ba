"""
Stress test for two-process (torchrun, gloo) runs, not part of the default suite: a rare teardown
crash at exit only shows up over many runs.

    python tests/stress_ddp.py --runs 50            # train.py and eval_extrapolate.py, 50 runs each
    python tests/stress_ddp.py --runs 50 --only train

Each run uses the DDP test's own tiny CPU settings. Prints every failure's last lines and a pass
count per script; the exit status is 1 unless every run passed.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# the DDP test's data and arguments
from test_train import tiny_args, words_dataset  # noqa: E402


def train_args(data_dir, out_dir):
    return ["train.py", *tiny_args(data_dir, out_dir, gradient_accumulation_steps=2,
                                   overwrite=True)]


def eval_args(ckpt, out_json):
    return ["eval_extrapolate.py", "--ckpt", str(ckpt), "--lengths", "8,16,64", "--max_len", "64",
            "--bca", "both", "--json", str(out_json)]


def torchrun(args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--only", choices=("train", "eval"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data_dir = words_dataset(root)
        ckpt_dir = root / "ckpt"
        if (torchrun(train_args(data_dir, ckpt_dir)).returncode
                and not (ckpt_dir / "ckpt.pt").is_file()):
            sys.exit("stress_ddp.py: could not train the checkpoint the eval runs need")
        jobs = {"train": lambda i: train_args(data_dir, root / f"run{i % 2}"),
                "eval": lambda i: eval_args(ckpt_dir / "ckpt.pt", root / f"eval{i % 2}.json")}
        passed = {}
        for name, job in jobs.items():
            if args.only and name != args.only:
                continue
            passed[name] = 0
            t0 = time.perf_counter()
            for i in range(args.runs):
                result = torchrun(job(i))
                if result.returncode == 0:
                    passed[name] += 1
                else:
                    tail = "\n    ".join((result.stdout + result.stderr).strip().splitlines()[-8:])
                    print(f"{name} run {i + 1}: exit status {result.returncode}\n    {tail}",
                          flush=True)
            print(f"{name}: {passed[name]}/{args.runs} passed ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    sys.exit(0 if all(n == args.runs for n in passed.values()) else 1)


if __name__ == "__main__":
    main()
