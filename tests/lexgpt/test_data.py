"""Tests for data.py: datasets checked on open, and a checkpoint's dataset checked
for its tokenizer."""

import json
import shutil

import numpy as np
import pytest

from conftest import make_checkpoint
from lexgpt import checkpoint, data
from lexgpt.cli import UserError
from lexgpt.dataset_writer import write_dataset


def dataset(root, seed=0, vocab="abcdefghijk", n_train=500, n_val=75):
    rng = np.random.default_rng(seed)
    train = rng.integers(0, len(vocab), n_train).astype(np.uint16)
    val = rng.integers(0, len(vocab), n_val).astype(np.uint16)
    meta = dict(tokenizer="char", vocab_size=len(vocab), dtype="uint16", chars=list(vocab),
                eot_token=None)
    write_dataset(root, {"train": (train, [[0, n_train]], ["t"]),
                         "val": (val, [[0, n_val]], ["v"])}, meta)
    return root


def read_meta(root):
    return json.loads((root / "meta.json").read_text())


def edit_meta(root, **changes):
    (root / "meta.json").write_text(json.dumps(dict(read_meta(root), **changes)))


def file_of(root, split):
    return root / json.loads((root / "meta.json").read_text())["files"][split]["file"]


def error(fn, *args, **kwargs):
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def test_load_meta_accepts_a_complete_dataset(tmp_path):
    meta = data.load_meta(dataset(tmp_path / "a"))
    assert meta["files"]["train"]["tokens"] == 500
    assert len(data.read_tokens(tmp_path / "a", "val", meta).tokens) == 75


def test_read_tokens_gives_the_split_and_what_its_batches_need(tmp_path):
    """A token file: the ids written (regenerated from the same seed), read-only; vocab_size from
    meta.json; no record or answers outside a task dataset; and nothing more can be hung on it."""
    import dataclasses

    meta = data.load_meta(dataset(tmp_path / "a", seed=3))
    rng = np.random.default_rng(3)
    written = {"train": rng.integers(0, 11, 500), "val": rng.integers(0, 11, 75)}
    for split, want in written.items():
        split_file = data.read_tokens(tmp_path / "a", split, meta)
        assert split_file.tokens.tolist() == want.tolist() and not split_file.tokens.flags.writeable
        assert (split_file.vocab_size, split_file.record, split_file.answers) == (11, None, None)
        assert split_file.path == file_of(tmp_path / "a", split)
        with pytest.raises(dataclasses.FrozenInstanceError):
            split_file.record = 97


def test_mixed_directory_assembled_by_hand_is_refused(tmp_path):
    a, b = dataset(tmp_path / "a", seed=0), dataset(tmp_path / "b", seed=1)
    shutil.copy(file_of(b, "val"), file_of(a, "val"))  # same size, other content, under a's name
    assert "do not belong together" in error(data.load_meta, a)
    c = dataset(tmp_path / "c", seed=2, n_train=600)
    shutil.copy(file_of(b, "train"), file_of(c, "train"))  # another token count
    assert "(500 tokens, 600 recorded" in error(data.load_meta, c)
    shutil.copy(b / "meta.json", c / "meta.json")  # b's meta.json names files that are not in c
    assert "is missing: the dataset" in error(data.load_meta, c)


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "meta.json").write_text("{not json"), "meta.json is corrupt"),
    (lambda d: (d / "meta.json").write_bytes(b"\xff\xfe"), "meta.json is corrupt"),
    (lambda d: (d / "meta.json").write_text(json.dumps({"tokenizer": "char"})),
     "corrupt: no vocab_size, dtype, files"),
    (lambda d: (d / "meta.json").write_text("[1, 2]"), "corrupt: not a JSON object"),
    (lambda d: edit_meta(d, vocab_size="11"), "corrupt: vocab_size='11' is not allowed"),
    (lambda d: edit_meta(d, chars=list("abc")), "corrupt: chars=['a', 'b', 'c'] is not allowed"),
    (lambda d: edit_meta(d, files={"train": {"file": 5, "tokens": 1, "ends_sha256": ""}}),
     "corrupt: files="),
    (lambda d: edit_meta(d, files=dict(read_meta(d)["files"],
                                       val=dict(read_meta(d)["files"]["val"], tokens="75"))),
     "corrupt: files="),
    (lambda d: file_of(d, "train").write_bytes(b""), "is empty (0 tokens)"),
    (lambda d: file_of(d, "val").unlink(), "is missing"),
    (lambda d: (d / "meta.json").unlink(), "missing meta.json"),
])
def test_damaged_datasets_are_one_line_errors(tmp_path, damage, message):
    d = dataset(tmp_path / "d")
    damage(d)
    assert message in error(data.load_meta, d)


def test_tokenizer_mismatch_names_both(tmp_path):
    a = dataset(tmp_path / "a")
    small = dataset(tmp_path / "small", vocab="abcdefghijklmnop")  # 16 characters
    ckpt_path = tmp_path / "m.pt"
    make_checkpoint(ckpt_path, a)
    ckpt = checkpoint.load_checkpoint(ckpt_path)
    assert ckpt["tokenizer"]["vocab_size"] == 11
    message = error(data.checkpoint_dataset, ckpt, ckpt_path, small)
    assert "vocab_size 11" in message and "vocab_size 16" in message and "--data_dir" in message
    # 11 other characters: only the hash differs
    same_size = dataset(tmp_path / "same", vocab="ABCDEFGHIJK")
    assert "chars_sha256" in error(data.checkpoint_dataset, ckpt, ckpt_path, same_size)
    assert data.checkpoint_dataset(ckpt, ckpt_path)[0] == str(a)  # the training data_dir by default
    del ckpt["tokenizer"]  # older checkpoints: the vocabulary size is still compared
    assert "vocab_size 11" in error(data.checkpoint_dataset, ckpt, ckpt_path, small)


def test_documents_from_the_offsets_file_and_from_an_older_meta_json(tmp_path):
    d = dataset(tmp_path / "d")
    meta = data.load_meta(d)
    assert (data.documents(d, "val", meta).tolist() == [[0, 75]]
            and data.document_names(d, "val", meta) == ["v"])
    # the previous format: documents listed in meta.json, no offsets files
    old = read_meta(d)
    for split, name, n in (("train", "t", 500), ("val", "v", 75)):
        (d / old["files"].pop(f"{split}_docs")["file"]).unlink()
        (d / old["files"].pop(f"{split}_names")["file"]).unlink()
        old[f"{split}_documents"] = [{"name": name, "start": 0, "end": n}]
    (d / "meta.json").write_text(json.dumps(old))
    meta = data.load_meta(d)
    assert data.documents(d, "train", meta).tolist() == [[0, 500]]
    assert (data.documents(d, "train", meta).dtype == np.int64
            and data.document_names(d, "val", meta) == ["v"])
    del old["val_documents"]  # neither format
    (d / "meta.json").write_text(json.dumps(old))
    assert "no document offsets" in error(data.load_meta, d)


def test_offsets_file_from_another_dataset_is_refused(tmp_path):
    tokens = np.arange(75, dtype=np.uint16) % 11
    meta = dict(tokenizer="char", vocab_size=11, dtype="uint16", chars=list("abcdefghijk"),
                eot_token=None)
    for name, cut in (("a", 40), ("b", 30)):
        write_dataset(tmp_path / name, {"train": (tokens, [[0, 75]], None),
                                        "val": (tokens, [[0, cut], [cut, 75]], None)}, meta)
    def docs(d):
        return d / read_meta(d)["files"]["val_docs"]["file"]
    shutil.copy(docs(tmp_path / "b"), docs(tmp_path / "a"))  # same size, other offsets
    assert ("val_docs-" in error(data.load_meta, tmp_path / "a")
            and "do not belong together" in error(data.load_meta, tmp_path / "a"))


# --- damage inside a token file (issue 22): full checksums, token ids checked against vocab_size --


def big_dataset(root, n_train=3 << 20):
    """A train file of 6 MiB: damage in its middle is outside the first and last MiB the
    ends' checksum reads."""
    return dataset(root, n_train=n_train)


def overwrite(path, at_token, values):
    with open(path, "r+b") as f:
        f.seek(at_token * 2)
        f.write(np.asarray(values, dtype=np.uint16).tobytes())


def test_meta_json_records_full_checksums(tmp_path):
    import hashlib

    d = dataset(tmp_path / "d")
    for entry in read_meta(d)["files"].values():
        assert entry["sha256"] == hashlib.sha256((d / entry["file"]).read_bytes()).hexdigest()


def test_damage_in_the_middle_of_a_token_file_is_refused_on_open(tmp_path):
    d = big_dataset(tmp_path / "d")
    middle = (3 << 20) // 2
    # a MiB of in-vocabulary ids
    overwrite(file_of(d, "train"), middle, np.zeros(1 << 19, np.uint16))
    message = error(data.load_meta, d)
    assert f"{file_of(d, 'train')} is damaged" in message and "SHA-256" in message
    # an id outside the vocabulary: named with its offset
    overwrite(file_of(d, "train"), middle + 5, [60000])
    message = error(data.load_meta, d)
    assert f"{file_of(d, 'train')} is damaged" in message
    assert f"token id 60000 at token offset {middle + 5} is not below its vocab_size 11" in message


def test_files_over_the_full_check_limit_are_checked_per_batch(tmp_path, monkeypatch):
    d = big_dataset(tmp_path / "d")
    middle = (3 << 20) // 2
    # 11: one past the last id of the 11-character vocabulary
    overwrite(file_of(d, "train"), middle, [7, 11])
    # as if the 6 MiB file were over the limit
    monkeypatch.setattr(data, "FULL_CHECK_BYTES", 1 << 20)
    meta = data.load_meta(d)  # its ends are intact: accepted on open
    tokens = data.read_tokens(d, "train", meta)
    x, y = data.get_batch(tokens, np.array([0, 100]), 16, "cpu")  # elsewhere: fine
    assert int(x.max()) < 11
    message = error(data.get_batch, tokens, np.array([0, middle - 3]), 16, "cpu")
    assert (f"{file_of(d, 'train')}: token id 11 at token offset {middle + 1} is not below its "
            "vocab_size" in message)
    # under the limit: refused on open, the offset named
    monkeypatch.setattr(data, "FULL_CHECK_BYTES", 1 << 30)
    assert f"token id 11 at token offset {middle + 1} is not below" in error(data.load_meta, d)


def test_a_damaged_dataset_stops_training_with_one_line(tmp_path):
    import train as train_script
    from test_train import tiny_args

    # the issue's case: damage in the middle, where the ends' checksum cannot see it
    d = big_dataset(tmp_path / "d")
    overwrite(file_of(d, "train"), 2000000, [200])
    with pytest.raises(SystemExit) as e:
        train_script.main(tiny_args(d, tmp_path / "run", max_iters=2, eval_interval=2, eval_iters=1,
                                    lr_decay_iters=2, warmup_iters=1))
    assert "token id 200 at token offset 2000000 is not below" in str(e.value.code)
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_verify_checks_every_file_in_full(tmp_path, capsys):
    import prepare_data

    d = big_dataset(tmp_path / "d")
    prepare_data.main(["--verify", str(d)])
    assert capsys.readouterr().out.startswith(f"{d}: OK: its 6 files")
    # in the vocabulary, in the middle: only the full hash sees it
    overwrite(file_of(d, "train"), 1 << 20, [3])
    with pytest.raises(SystemExit) as e:
        prepare_data.main(["--verify", str(d)])
    assert (f"{file_of(d, 'train')} is damaged" in str(e.value.code)
            and "\n" not in str(e.value.code))
    old = read_meta(d)  # a dataset from before full checksums: nothing to verify against
    for entry in old["files"].values():
        del entry["sha256"]
    (d / "meta.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit) as e:
        prepare_data.main(["--verify", str(d)])
    assert "records no full checksum" in str(e.value.code)


def test_evaluation_readers_check_the_ids_they_read(tmp_path):
    """eval_extrapolate's scoring and resolution's texts read validation tokens themselves (a file
    over the full-check limit is not read whole on open): an id past vocab_size is one line naming
    the file and the token offset."""
    import eval_extrapolate
    import resolution
    from lexgpt.inference_options import Runtime, Variant
    from model import AttentionRule

    d = tmp_path / "d"
    shutil.copytree(dataset(tmp_path / "src"), d)
    # read, not checked: the damage below stands for one the checks on open cannot see
    meta = read_meta(d)
    overwrite(file_of(d, "val"), 40, [200])
    model = make_checkpoint(tmp_path / "m.pt", tmp_path / "src", vocab="abcdefghijk")
    want = f"{file_of(d, 'val')}: token id 200 at token offset 40 is not below its vocab_size 11"
    message = error(eval_extrapolate.score, model, data.read_tokens(d, "val", meta), [(32, 16, 0)],
                    16, Variant(AttentionRule("causal"), None, 64), Runtime("cpu"))
    assert message.startswith(want)
    assert error(resolution.texts_from, meta, d, 16, 8).startswith(want)


# --- a checkpoint that records no tokenizer, or a relative data_dir (issue 45, items 12 and 23) ---


def test_a_checkpoint_without_a_tokenizer_has_its_datasets(tmp_path):
    """A checkpoint from before tokenizer records (or re-saved without one) has the tokenizer of
    the dataset it was trained on: another dataset of the same vocab_size but other characters is
    refused; with that dataset gone (or changed) nothing can vouch for one, and every dataset is
    refused."""
    a = dataset(tmp_path / "a")
    copy = shutil.copytree(a, tmp_path / "copy")  # the same tokenizer, elsewhere
    same_size = dataset(tmp_path / "same", vocab="ABCDEFGHIJK")
    ckpt_path = tmp_path / "m.pt"
    make_checkpoint(ckpt_path, a, vocab="abcdefghijk")
    ckpt = checkpoint.load_checkpoint(ckpt_path)
    del ckpt["tokenizer"]
    message = error(data.checkpoint_dataset, ckpt, ckpt_path, same_size)
    assert "chars_sha256" in message and str(a) in message and str(same_size) in message
    assert data.checkpoint_dataset(ckpt, ckpt_path, copy)[0] == copy
    assert data.checkpoint_dataset(ckpt, ckpt_path)[0] == str(a)
    ckpt["config"]["data_dir"] = str(tmp_path / "gone")
    message = error(data.checkpoint_dataset, ckpt, ckpt_path, copy)
    assert "records no tokenizer" in message and str(tmp_path / "gone") in message
    ckpt["config"]["data_dir"] = str(dataset(tmp_path / "grown", vocab="abcdefghijkl"))
    message = error(data.checkpoint_dataset, ckpt, ckpt_path, copy)
    assert "vocab_size 12" in message and "its model's 11" in message


def test_a_relative_data_dir_from_a_checkpoint_that_records_no_directory(tmp_path, monkeypatch):
    """A checkpoint's relative data_dir is relative to the directory its run was made in; where the
    checkpoint records none (an older one) and the path is not there from here, the error says
    so, not "run prepare_data.py first"."""
    dataset(tmp_path / "a" / "data")
    ckpt_path = tmp_path / "m.pt"
    monkeypatch.chdir(tmp_path / "a")
    make_checkpoint(ckpt_path, "data", vocab="abcdefghijk")
    ckpt = checkpoint.load_checkpoint(ckpt_path)
    assert data.checkpoint_dataset(ckpt, ckpt_path)[0] == "data"  # from where it was made
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    message = error(data.checkpoint_dataset, ckpt, ckpt_path)
    assert ("relative to the directory its run was made in" in message
            and "prepare_data.py" not in message and "--data_dir" in message)
    tokenizer = ckpt.pop("tokenizer")  # no record: its dataset, not found, cannot tell it
    message = error(data.checkpoint_dataset, ckpt, ckpt_path, tmp_path / "a" / "data")
    assert "records no tokenizer" in message and "does not record: run from there" in message
    ckpt["cwd"] = str(tmp_path / "a")  # recorded: found from anywhere
    assert data.checkpoint_dataset(ckpt, ckpt_path)[0] == str(tmp_path / "a" / "data")
    ckpt["tokenizer"] = tokenizer
    assert data.checkpoint_dataset(ckpt, ckpt_path)[0] == str(tmp_path / "a" / "data")
