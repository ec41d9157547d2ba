"""Shared fixtures: a tiny synthetic character dataset with known documents, and
checkpoints made from it."""

import signal
from dataclasses import asdict

import numpy as np
import pytest
import torch

from lexgpt.checkpoint import CHECKPOINT_FORMAT, save_checkpoint
from lexgpt.data import load_meta, tokenizer_identity
from lexgpt.dataset_writer import write_dataset
from model import GPT, GPTConfig

CHARS = list("abcdefghijk")
VAL_DOC_LENGTHS = (40, 25, 10)  # validation documents, in stream order


@pytest.fixture(autouse=True)
def sigint_as_it_was():
    """A script's Ctrl-C, tested in this process, ignores SIGINT from then on (exit_interrupted: a
    second Ctrl-C prints no traceback): each test leaves SIGINT's handler as it found it."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_data")
    rng = np.random.default_rng(0)
    val = rng.integers(0, len(CHARS), sum(VAL_DOC_LENGTHS)).astype(np.uint16)
    train = rng.integers(0, len(CHARS), 500).astype(np.uint16)
    starts = np.cumsum((0,) + VAL_DOC_LENGTHS)
    meta = dict(tokenizer="char", vocab_size=len(CHARS), dtype="uint16", chars=CHARS,
                eot_token=None)
    val_docs = np.stack([starts[:-1], starts[1:]], axis=1)
    write_dataset(root, {"train": (train, [[0, len(train)]], ["train"]),
                         "val": (val, val_docs, [f"doc{i}" for i in range(len(VAL_DOC_LENGTHS))])},
                  meta)
    return root


def make_checkpoint(path, data_dir, pos="xpos", block_size=8, zero=False, seed=0, n_layer=2,
                    vocab=CHARS, **config):
    """A checkpoint as train.py writes it (the fields the other scripts read); zero=True gives
    uniform predictions; config: more GPTConfig fields."""
    torch.manual_seed(seed)
    config = GPTConfig(block_size=block_size, vocab_size=len(vocab), n_layer=n_layer, n_head=2,
                       n_embd=16, pos=pos, **config)
    model = GPT(config)
    if zero:
        for p in model.parameters():
            torch.nn.init.zeros_(p)
    save_checkpoint({"model": model.state_dict(), "model_args": asdict(config),
                     "config": {"data_dir": str(data_dir)}, "format": CHECKPOINT_FORMAT,
                     "tokenizer": tokenizer_identity(load_meta(data_dir)), "iter_num": 0},
                    path)
    return model.eval()
