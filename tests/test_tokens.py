"""`polytrain tokenize` and `--dataset tokens`: a corpus written as token shards, read through memory maps.

The shards hold exactly the ids the tokenizer gives each whole document, documents separated by the end-of-text
id, the last bytes held out; memory stays flat as the corpus grows; an interrupted run leaves nothing a reader
takes; the windows, their order, the rank slices and a resume equal the in-memory text path's on the same ids;
N ranks train as one (verify); bad input is one line each.
"""

import json
import shlex
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import polytrain_here
from processes import polytrain as run_polytrain

import polytrain
from polytrain.cli import main
from polytrain.commands import generate_text
from polytrain.data import corpus, load_dataset
from polytrain.data import tokenizer as tokenizers_file
from polytrain.data.text import TokenDataset, TokenLoader
from polytrain.data.token_shards import MappedTokens, load_token_shards
from polytrain.errors import DataError, UserError

SHAKESPEARE = corpus.Path(polytrain.__file__).with_name("data") / "shakespeare" / "input.txt"


def _documents(folder):
    """Three documents: a text file with runs of blank lines and spaces, and a .jsonl of two."""
    text = SHAKESPEARE.read_text()[:60_000]
    (folder / "a.txt").write_text(text.replace("\n\n", "\n\n\n  \n", 50))
    lines = [
        json.dumps({"text": "First doc.\n\nWith  two  lines é 中文"}),
        "",
        json.dumps({"text": text[:3000]}),
    ]
    (folder / "b.jsonl").write_text("\n".join(lines) + "\n")
    return [(folder / "a.txt").read_text(), json.loads(lines[0])["text"], json.loads(lines[2])["text"]]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A corpus of three documents tokenized with a tokenizer trained on it, in shards of 4,000 tokens."""
    root = tmp_path_factory.mktemp("tokens")
    (root / "corpus").mkdir()
    documents = _documents(root / "corpus")
    manifest = corpus.tokenize_corpus(
        [str(root / "corpus")],
        str(root / "out"),
        vocab_size=400,
        val_fraction=0.1,
        shard_tokens=4000,
        show=False,
    )
    return root, documents, manifest


def _all_ids(folder, manifest, split):
    tokens = load_token_shards(str(folder), context=8)
    mapped = tokens.train_tokens if split == "train" else tokens.val_tokens
    return mapped.windows([0], len(mapped))[0].numpy()


def test_shards_hold_each_documents_ids_with_end_of_text_between(written):
    root, documents, manifest = written
    tokenizer = tokenizers_file.load(root / "out" / "tokenizer.json")
    eot = manifest["tokenizer"]["end_of_text_id"]
    assert tokenizer.id_to_token(eot) == "<|endoftext|>" and manifest["tokenizer"]["vocab_size"] == 400
    expected = []
    for document in documents:  # each whole document encoded at once: the pieces' ids are the same
        expected += tokenizer.encode(document, add_special_tokens=False).ids + [eot]
    got = np.concatenate([_all_ids(root / "out", manifest, "train"), _all_ids(root / "out", manifest, "val")])
    assert got.tolist() == expected
    assert manifest["dtype"] == "uint16" and manifest["corpus"]["documents"] == 3
    # the validation split is the tail: about a tenth of the bytes (the .jsonl's last document)
    assert 0 < manifest["val"]["tokens"] < 0.2 * len(expected)
    assert len(manifest["train"]["shards"]) == -(-manifest["train"]["tokens"] // 4000) > 1
    for shard in manifest["train"]["shards"]:
        path = root / "out" / shard["file"]
        assert (
            path.stat().st_size == 2 * shard["tokens"]
            and tokenizers_file.file_sha256(path) == shard["sha256"]
        )


def test_cutting_a_document_changes_no_id_where_a_cut_at_any_line_break_would():
    """The cut rule is what makes the pieces' ids the whole text's: a cut at any line break would not be."""
    text = "alpha\n\n  beta gamma\n\n\ndelta\n"
    tokenizer = tokenizers_file.train_byte_bpe(iter([text * 2000]), vocab_size=300)

    def ids(parts):
        return sum((tokenizer.encode(part, add_special_tokens=False).ids for part in parts), [])

    whole = ids([text * 3000])
    assert ids(["alpha\n", "\n  beta gamma\n\n\ndelta\n"]) != ids([text])  # a cut between line breaks
    assert ids(["alpha\n\n", "  beta gamma\n\n\ndelta\n"]) != ids([text])  # a cut before a space
    pieces, rest = corpus._cut(text * 3000, final=True)
    assert len(pieces) > 1 and rest == "" and "".join(pieces) == text * 3000
    assert ids(pieces) == whole


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_windows_order_and_rank_slices_equal_the_in_memory_text(written, world_size):
    root, _, manifest = written
    shards = load_token_shards(str(root / "out"), context=16)
    ids = torch.from_numpy(_all_ids(root / "out", manifest, "train").astype(np.int64))
    val = torch.from_numpy(_all_ids(root / "out", manifest, "val").astype(np.int64))
    memory = TokenDataset("text", ids, val, ["x"] * 400, context=16)
    assert (shards.num_train, shards.num_val) == (memory.num_train, memory.num_val)
    for rank in range(world_size):
        for training, tokens, memory_tokens in (
            (True, shards.train_tokens, ids),
            (False, shards.val_tokens, val),
        ):
            common = dict(context=16, batch_size=6, device="cpu", rank=rank, world_size=world_size, seed=3)
            on_disk = TokenLoader(tokens, training=training, **common)
            in_memory = TokenLoader(memory_tokens, training=training, **common)
            for epoch in (0, 1):
                a = list(on_disk.train_batches(epoch, start_step=2) if training else on_disk.eval_batches())
                b = list(
                    in_memory.train_batches(epoch, start_step=2) if training else in_memory.eval_batches()
                )
                assert len(a) == len(b) > 0
                for x, y in zip(a, b):
                    assert (
                        torch.equal(x.x, y.x) and torch.equal(x.y, y.y) and x.global_count == y.global_count
                    )
                    assert x.x.is_contiguous() and x.y.is_contiguous()


def test_a_window_crosses_from_one_shard_into_the_next(tmp_path):
    for name, values in (("a", [0, 1, 2]), ("b", [3]), ("c", [4, 5, 6, 7])):
        np.asarray(values, dtype=np.uint16).tofile(tmp_path / name)
    mapped = MappedTokens([str(tmp_path / n) for n in "abc"], [3, 1, 4], "uint16")
    assert mapped.windows([1, 0, 2], 5).tolist() == [[1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [2, 3, 4, 5, 6]]
    assert len(mapped.head(5)) == 5
    with pytest.raises(IndexError):
        mapped.head(5).windows([1], 5)


def test_memory_stays_flat_as_the_corpus_grows_tenfold(written, tmp_path):
    """Peak RSS of a tokenize process for a corpus of 5 and of 25 copies of Shakespeare (5.6 and 28 MB, whose
    int64 ids alone would take 110 MB) with the same tokenizer."""
    root, _, _ = written
    text = SHAKESPEARE.read_text()
    peaks = {}
    for copies in (5, 25):
        (tmp_path / f"c{copies}.txt").write_text(text * copies)
        code = textwrap.dedent(f"""
            import resource
            from polytrain.data.corpus import tokenize_corpus
            tokenize_corpus([{str(tmp_path / f"c{copies}.txt")!r}], {str(tmp_path / f"o{copies}")!r},
                            tokenizer={str(root / "out")!r}, show=False)
            print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            """)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr
        peaks[copies] = int(done.stdout.split()[-1]) / 1024
        manifest = json.loads((tmp_path / f"o{copies}" / "manifest.json").read_text())
        assert manifest["train"]["tokens"] + manifest["val"]["tokens"] > copies * 100_000
    assert peaks[25] - peaks[5] < 48, (
        peaks
    )  # (measured 0-25 MiB apart: the allocator and the encoding threads)


def test_an_interrupted_run_leaves_nothing_a_reader_takes_and_the_next_run_clears_it(tmp_path, monkeypatch):
    (tmp_path / "c.txt").write_text(SHAKESPEARE.read_text()[:200_000])
    closed = []
    original = corpus.ShardWriter._close

    def close_then_fail(self):
        original(self)
        closed.append(1)
        if len(closed) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(corpus.ShardWriter, "_close", close_then_fail)
    with pytest.raises(KeyboardInterrupt):
        corpus.tokenize_corpus(
            [str(tmp_path / "c.txt")], str(tmp_path / "out"), vocab_size=300, shard_tokens=5000, show=False
        )
    assert (tmp_path / "out" / "train-00000.bin").exists() and not (
        tmp_path / "out" / "manifest.json"
    ).exists()
    with pytest.raises(DataError, match="holds no manifest.json of token shards"):
        load_token_shards(str(tmp_path / "out"), context=8)
    monkeypatch.setattr(corpus.ShardWriter, "_close", original)
    manifest = corpus.tokenize_corpus(
        [str(tmp_path / "c.txt")], str(tmp_path / "out"), vocab_size=300, shard_tokens=50_000, show=False
    )
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert names == {"tokenizer.json", "manifest.json"} | {
        s["file"] for s in manifest["train"]["shards"] + manifest["val"]["shards"]
    }
    with pytest.raises(UserError, match="already holds token shards"):
        corpus.tokenize_corpus([str(tmp_path / "c.txt")], str(tmp_path / "out"), vocab_size=300, show=False)


def _copy(written, tmp_path):
    import shutil

    root, _, manifest = written
    shutil.copytree(root / "out", tmp_path / "out")
    return tmp_path / "out", manifest


def test_a_damaged_or_missing_shard_is_one_line(written, tmp_path):
    folder, manifest = _copy(written, tmp_path)
    first = folder / manifest["train"]["shards"][0]["file"]
    data = bytearray(first.read_bytes())
    data[10] ^= 1
    first.write_bytes(bytes(data))
    with pytest.raises(DataError, match="does not match its checksum"):
        load_token_shards(str(folder), context=8)
    first.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="it is damaged"):
        load_token_shards(str(folder), context=8)
    first.unlink()
    with pytest.raises(DataError, match="is missing"):
        load_token_shards(str(folder), context=8)


def test_a_checked_shard_is_stamped_and_not_read_again(written, tmp_path, monkeypatch):
    folder, manifest = _copy(written, tmp_path)
    load_token_shards(str(folder), context=8)
    stamps = json.loads((folder / "verified.json").read_text())
    assert set(stamps) == {s["file"] for s in manifest["train"]["shards"] + manifest["val"]["shards"]}
    read = []
    monkeypatch.setattr("polytrain.data.token_shards.file_sha256", lambda path: read.append(path) or "x")
    with pytest.raises(DataError, match="is missing or is not the tokenizer"):
        load_token_shards(str(folder), context=8)  # the tokenizer is hashed every time...
    assert [p.name for p in read] == ["tokenizer.json"]  # ...the stamped shards are not


def test_bad_input_is_one_line(written, tmp_path):
    root, _, _ = written
    (tmp_path / "rows.jsonl").write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    with pytest.raises(DataError, match=r"has no text field 'text' \(it has: body, id\); name the field"):
        corpus.tokenize_corpus([str(tmp_path / "rows.jsonl")], str(tmp_path / "o1"), show=False)
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    with pytest.raises(UserError, match=r"holds no text files \(1 hidden or not UTF-8 text, skipped\); give"):
        corpus.tokenize_corpus([str(tmp_path / "pictures")], str(tmp_path / "o2"), show=False)
    with pytest.raises(UserError, match=r"holds no text files matching --glob '\*\*/\*.rs'; give another"):
        corpus.tokenize_corpus([str(SHAKESPEARE.parent)], str(tmp_path / "o2"), glob="**/*.rs", show=False)
    with pytest.raises(UserError, match="chooses files in a folder, and no folder was given"):
        corpus.tokenize_corpus([str(SHAKESPEARE)], str(tmp_path / "o2"), glob="*.txt", show=False)
    with pytest.raises(UserError, match="give a pattern inside the folder"):
        corpus.tokenize_corpus([str(tmp_path)], str(tmp_path / "o2"), glob="/etc/*.conf", show=False)
    with pytest.raises(UserError, match="--vocab-size trains a tokenizer and --tokenizer gives one"):
        corpus.tokenize_corpus(
            [str(SHAKESPEARE)], str(tmp_path / "o3"), tokenizer=str(root / "out"), vocab_size=9
        )
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="is not UTF-8 text"):
        corpus.tokenize_corpus(
            [str(tmp_path / "latin1.txt")], str(tmp_path / "o4"), vocab_size=300, show=False
        )
    with pytest.raises(DataError, match="polytrain tokenize FILES --out DIR"):
        load_token_shards(str(tmp_path), context=8)


def _code_folder(root):
    """A folder of Python source at two depths, with what a repository also holds: a .git folder, a hidden
    file, a picture, compiled bytecode and a README."""
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / ".git" / "objects").mkdir(parents=True)
    (root / "setup.py").write_text("from setuptools import setup\n\nsetup(name='pkg')\n")
    (root / "pkg" / "core.py").write_text("def twice(x):\n    return 2 * x  # é 中文\n" * 200)
    (root / "README.md").write_text("# pkg\n\nDoubles numbers.\n")
    (root / ".git" / "config").write_text("[core]\n\tbare = false\n")
    (root / ".git" / "objects" / "ab").write_bytes(b"x\x01\x9c\xcb\x00\xff")
    (root / ".env").write_text("TOKEN=1\n")
    (root / "pkg" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (root / "pkg" / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0c")
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))


def test_a_folder_gives_its_text_files_whatever_their_names_and_glob_chooses_among_them(tmp_path, capsys):
    """Every UTF-8 file of a folder by default (hidden files and folders, binary files and a Latin-1 one
    skipped and named in one line), those --glob matches with it, and a file named always, whatever its name."""
    code = tmp_path / "code"
    _code_folder(code)
    chosen = corpus.corpus_files([str(code)])
    assert chosen.files == [code / "README.md", code / "pkg" / "core.py", code / "setup.py"]
    assert chosen.hidden == [code / ".env", code / ".git"]
    assert chosen.not_text == [code / "latin1.txt", code / "pkg" / "__pycache__" / "core.cpython-311.pyc"] + [
        code / "pkg" / "logo.png"
    ]
    assert corpus.corpus_files([str(code)], "**/*.py").files == [code / "pkg" / "core.py", code / "setup.py"]
    assert corpus.corpus_files([str(code)], "*.py").files == [code / "setup.py"]  # the folder's top only
    assert corpus.corpus_files([str(code)], "**/*.py").skipped() is None  # nothing it matched was passed over
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    named = [str(tmp_path / "table.csv"), str(code / ".env"), str(code)]
    assert corpus.corpus_files(named, "**/*.py").files == [
        tmp_path / "table.csv",
        code / ".env",
        code / "pkg" / "core.py",
        code / "setup.py",
    ]
    manifest = corpus.tokenize_corpus([str(code)], str(tmp_path / "out"), vocab_size=300, glob="**/*.py")
    assert manifest["corpus"]["files"] == 2 and manifest["corpus"]["documents"] == 2
    corpus.tokenize_corpus([str(code)], str(tmp_path / "all"), vocab_size=300)
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")]
    assert skipped == [
        f"skipped 2 hidden ({code / '.env'}, {code / '.git'}); 3 not UTF-8 text ({code / 'latin1.txt'}, "
        f"{code / 'pkg' / '__pycache__' / 'core.cpython-311.pyc'}, {code / 'pkg' / 'logo.png'}); name a file on "
        f"the command line to read it anyway"
    ]


def test_the_validation_split_is_useful_on_a_small_corpus_and_a_small_share_of_a_large_one():
    MiB = 2**20
    # a 127k-token corpus, about 500 kB: a tenth of it (12.7k tokens, 99 windows of 128), not 0.005 (644 tokens)
    assert corpus.validation_bytes(500_000) == 50_000
    assert corpus.validation_bytes(9 * MiB) == int(0.9 * MiB)  # a tenth, below 10 MiB
    assert corpus.validation_bytes(50 * MiB) == MiB  # the floor, 2% of it
    assert corpus.validation_bytes(200 * MiB) == MiB
    assert corpus.validation_bytes(10 * 2**30) == int(0.005 * 10 * 2**30)  # 0.005 of a large corpus
    assert all(  # never more than a tenth, never less than 0.005
        0.005 * total - 1 <= corpus.validation_bytes(total) <= 0.1 * total
        for total in (1, 999, 10 * MiB - 1, 10 * MiB, 200 * MiB + 1, 10**12)
    )
    # a fraction given is taken as it is, 0 included
    assert corpus.validation_bytes(500_000, 0.005) == 2500 and corpus.validation_bytes(500_000, 0.0) == 0
    assert corpus.validation_bytes(10 * 2**30, 0.2) == int(0.2 * 10 * 2**30)


def test_shards_written_with_a_checkpoints_tokenizer_name_a_command_that_fine_tunes_it(
    written, tmp_path, capsys
):
    """`--tokenizer CHECKPOINT` (the folder, or its tokenizer.json): the closing line names `polytrain train
    --init-from CHECKPOINT`, and that command trains; a tokenizer trained here, or one on its own, names
    --model gpt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root, _, _ = written
    checkpoint = tmp_path / "my llama"  # a space, quoted in the command
    torch.manual_seed(0)
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = LlamaConfig(vocab_size=400, num_key_value_heads=1, max_position_embeddings=64, **sizes)
    LlamaForCausalLM(config).save_pretrained(checkpoint)
    (checkpoint / "tokenizer.json").write_bytes((root / "out" / "tokenizer.json").read_bytes())
    (tmp_path / "c.txt").write_text(SHAKESPEARE.read_text()[:20_000])
    for name, tokenizer in (("a", checkpoint), ("b", checkpoint / "tokenizer.json")):
        assert (
            main(
                [
                    "tokenize",
                    str(tmp_path / "c.txt"),
                    "--out",
                    str(tmp_path / name),
                    "--tokenizer",
                    str(tokenizer),
                ]
            )
            == 0
        )
        hint = capsys.readouterr().out.split("Train with: ")[1].strip()
        assert shlex.split(hint) == [
            "polytrain", "train", "--init-from", str(checkpoint), "--dataset", "tokens", "--data-dir",
            str(tmp_path / name),
        ]  # fmt: skip
    run = ["--max-steps", "1", "--context", "16", "--batch-size", "2", "--device", "cpu"]
    assert main([*shlex.split(hint)[1:], *run, "--out", str(tmp_path / "run")]) == 0
    assert corpus.next_command("tokens", str(root / "out")) == (
        "polytrain train --model gpt --dataset tokens --data-dir tokens"
    )  # the tokenizer of an earlier tokenize: no model beside it
    assert corpus.next_command("tokens") == "polytrain train --model gpt --dataset tokens --data-dir tokens"


def test_training_generating_and_resuming_on_shards(written, tmp_path, capsys):
    """One device: a run keeps the tokenizer, generate decodes with it, a resume of 3 + 3 steps ends where 6
    steps do, and a run or checkpoint with another tokenizer is refused in one line."""
    root, _, _ = written
    common = ["--model", "gpt", "--dataset", "tokens", "--data-dir", str(root / "out"), "--context", "16"]
    common += ["--layers", "1", "--width", "16", "--heads", "2", "--batch-size", "4", "--device", "cpu"]
    assert main(["train", *common, "--max-steps", "6", "--out", str(tmp_path / "whole")]) == 0
    assert main(["train", *common, "--max-steps", "3", "--out", str(tmp_path / "cut")]) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "--max-steps", "6"]) == 0
    whole, cut = (torch.load(tmp_path / run / "model.pt") for run in ("whole", "cut"))
    assert all(torch.equal(whole[name], cut[name]) for name in whole)
    settings = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert (tmp_path / "whole" / "tokenizer.json").read_bytes() == (
        root / "out" / "tokenizer.json"
    ).read_bytes()
    assert settings["kept_tokenizer"]["sha256"] == tokenizers_file.file_sha256(
        root / "out" / "tokenizer.json"
    )
    assert generate_text(tmp_path / "whole", prompt="ROMEO:", tokens=0) == "ROMEO:"
    sample = generate_text(tmp_path / "whole", prompt="ROMEO:", tokens=12)
    assert sample.startswith("ROMEO:") and len(sample) > len("ROMEO:")
    # another tokenizer in the run resumed, or in the folder of --init-from: refused before training
    other = tokenizers_file.train_byte_bpe(iter(["something else entirely"]), vocab_size=300)
    other.save(str(tmp_path / "cut" / "tokenizer.json"))
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "cut"), "--max-steps", "8"]) == 2
    assert "was tokenized by another tokenizer than the run" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_two_sharded_ranks_train_as_one_device_on_shards(written, capfd):
    root, _, _ = written
    done = polytrain_here(
        capfd,
        "verify", "--model", "llama", "--dataset", "tokens", "--data-dir", root / "out", "--context", "16",
        "--layers", "1", "--width", "32", "--heads", "4", "--kv-heads", "2", "--batch-size", "4",
        "--strategy", "sharded", "--devices", "2", "--steps", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 and all(float(row[3]) <= 1e-5 for row in rows)


def test_the_command_line_writes_and_names_the_next_command(tmp_path):
    (tmp_path / "c.txt").write_text(SHAKESPEARE.read_text()[:30_000])
    done = run_polytrain("tokenize", tmp_path / "c.txt", "--out", tmp_path / "out", "--vocab-size", "300")
    assert done.returncode == 0, done.stderr
    assert "polytrain train --model gpt --dataset tokens --data-dir" in done.stdout
    assert "encoding:" in done.stdout and "MiB/s" in done.stdout
    data = load_dataset("tokens", data_dir=str(tmp_path / "out"), context=8)
    assert data.num_classes == 300
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    held = manifest["val"]["tokens"] / (manifest["train"]["tokens"] + manifest["val"]["tokens"])
    assert manifest["corpus"]["val_fraction"] == 0.1 and 0.08 < held < 0.12  # a tenth of a small corpus
    again = run_polytrain("tokenize", tmp_path / "c.txt", "--out", tmp_path / "out")
    assert (
        again.returncode == 2
        and again.stderr.count("\n") == 1
        and "already holds token shards" in again.stderr
    )
