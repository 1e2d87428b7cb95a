"""data/: tokenizers round-trip, the .bin files hold exactly the encoded documents (each whole
in one split, or cut once after a newline), the validation budget is met, runs are
reproducible for any number of worker processes, every input format reads the same records,
memory does not grow with the corpus, and every user mistake is one line + non-zero exit with
no output left behind. References are independent: each document encoded whole on its own
with a freshly loaded tokenizer, a naive paragraph splitter, records written here."""
import gzip
import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from data import common  # noqa: E402

OUTPUTS = ["train.bin", "val.bin", "tokenizer.model", "meta.json"]


def load_script(name):
    path = os.path.join(REPO, "data", name, "prepare.py")
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(name, *args):
    return subprocess.run([sys.executable, os.path.join(REPO, "data", name, "prepare.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


WORDS = ("the of and to in is that for it as with was on be by at this from or which an are "
         "value return function class import module object string number list error file "
         "data token model train test print self args none true false while else").split()


def make_corpus(folder, n_files=8, seed=0):
    """A small mixed corpus: prose, indented code with tabs and runs of spaces, blank lines,
    a little unicode. Returns {relative name: text}."""
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    texts = {}
    for i in range(n_files):
        parts = []
        for _ in range(rng.randint(15, 30)):
            kind = rng.random()
            if kind < 0.4:
                parts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) + ".")
            elif kind < 0.8:
                name = rng.choice(WORDS)
                parts.append(f"def {name}_{rng.randint(0, 99)}(x, y):\n"
                             f"    if x > {rng.randint(0, 9)}:\n"
                             f"        return {name}(x)  # {rng.choice(WORDS)}\n\treturn  y   \n")
            else:
                parts.append(f"café naïve — {rng.choice(WORDS)}   {rng.randint(0, 10**6)}\n\n")
        text = "\n".join(parts)
        fn = f"doc{i:02d}.txt"
        with open(os.path.join(folder, fn), "w", encoding="utf-8", newline="") as f:
            f.write(text)
        texts[fn] = text
    return texts


def prepare_folder(corpus, out_dir, *extra):
    args = ["--input", str(corpus), "--out_dir", str(out_dir), "--vocab_size", "400",
            "--min_val_tokens", "50", "--val_fraction", "0.2", *extra]
    load_script("text").main(args)
    with open(os.path.join(out_dir, "meta.json")) as f:
        return json.load(f)


def split_at_eos(ids, eos):
    """Token ids -> list of documents (each without its trailing eos)."""
    ends = np.flatnonzero(ids == eos)
    assert len(ends) and ends[-1] == len(ids) - 1, "every document ends with eos"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ids[s:e].tolist() for s, e in zip(starts, ends)]


def mem_sources(texts, name="mem"):
    """Documents held in memory, as common.prepare takes them."""
    texts = list(texts)
    return [(name, "docs", lambda: texts)]


def check_split(out, texts, meta, budget=None):
    """The two .bin files against each document encoded whole with a fresh tokenizer: in
    corpus order, every document is whole in val, whole in train, or a val prefix (+ its own
    eos) and the train rest; only the last cut may end inside a line (the exact budget).
    Returns the number of cut documents."""
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    dtype = np.dtype(meta["dtype"])
    val = split_at_eos(np.fromfile(out / "val.bin", dtype=dtype), meta["eos_id"])
    train = split_at_eos(np.fromfile(out / "train.bin", dtype=dtype), meta["eos_id"])
    nl = sp.piece_to_id("\n")
    vi = ti = cuts = mid_line = 0
    for text in texts:
        if not text.strip():
            continue
        ref = sp.encode(text)
        piece = val[vi] if vi < len(val) else None
        if (piece is not None and len(piece) < len(ref) and ref[:len(piece)] == piece
                and ti < len(train) and train[ti] == ref[len(piece):]):
            # A val prefix with its own eos (empty when one last token was owed), the rest
            # of the document in train.
            mid_line += not piece or piece[-1] != nl
            vi, ti, cuts = vi + 1, ti + 1, cuts + 1
        elif piece == ref:
            vi += 1
        else:
            assert ti < len(train) and train[ti] == ref
            ti += 1
    assert (vi, ti) == (len(val), len(train)), "nothing else in the files"
    assert mid_line <= 1
    total = sum(len(v) + 1 for v in val) + sum(len(t) + 1 for t in train) - cuts
    assert meta["split"]["tokens_before_split"] == total
    if budget is None:
        budget = max(round(meta["split"]["val_fraction"] * total), meta["split"]["min_val_tokens"])
    assert meta["val_tokens"] == budget == sum(len(v) + 1 for v in val)
    assert (meta["train_docs"], meta["val_docs"], meta["cut_documents"]) == (ti, vi, cuts)
    for split in ("train", "val"):
        assert os.path.getsize(out / f"{split}.bin") == meta[f"{split}_tokens"] * dtype.itemsize
    return cuts


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = make_corpus(root / "mycorpus")
    meta = prepare_folder(root / "mycorpus", root / "out")
    return root, texts, meta


# ----------------------------------------------------------------------------- round trip

ROUND_TRIP = [
    "Hello, world! It's 2024; x = 3.14159.",
    "日本語のテキスト 😀🚀 naïve café Ωμέγα",
    "def f(x):\n\tif x:\n\t\treturn  x   \n    y  =  1\n        \t mixed\n",
    "\n\n\nafter three empty lines\n\n\n\n",
    "   leading and trailing spaces   ",
    "windows\r\nline endings\r\n",
    "",
    " ",
    "\n",
]


@pytest.mark.parametrize("model_type", ["bpe", "unigram", "char"])
def test_round_trip_and_byte_fallback(tmp_path, model_type):
    texts = make_corpus(tmp_path / "c")
    vocab = {"char": 0, "bpe": 400, "unigram": 320}[model_type]  # 0: one piece per character
    common.prepare(str(tmp_path / "out"), "t", mem_sources(texts.values()), "test",
                   model_type=model_type,
                   vocab_size=vocab, min_val_tokens=50, val_fraction=0.2, log=lambda *a: None)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    for s in ROUND_TRIP:
        ids = sp.encode(s)
        assert sp.decode(ids) == s, (model_type, s)
        assert common.UNK_ID not in ids, "byte fallback: nothing maps to unknown"
    # Characters the training text never had come out as their UTF-8 bytes, one piece each.
    unseen = "漢字😀ß"
    ids = sp.encode(unseen)
    assert all(sp.is_byte(i) for i in ids)
    assert len(ids) == len(unseen.encode("utf-8"))
    assert sp.decode(ids) == unseen


def test_the_one_exception_u2581_decodes_as_space_and_is_reported(prepared, tmp_path):
    """sentencepiece stores spaces as U+2581, so that character comes back as a space: the
    prepare step must say so rather than change the text silently."""
    root, texts, _ = prepared
    sp = spm.SentencePieceProcessor(model_file=str(root / "out" / "tokenizer.model"))
    assert sp.decode(sp.encode("a\u2581b")) == "a b"
    logged = []
    sources = mem_sources(texts.values()) + mem_sources(["x\u2581y " * 50], "odd")
    common.prepare(str(tmp_path / "o"), "t", sources, "test", vocab_size=400, min_val_tokens=50,
                   val_fraction=0.2, log=logged.append)
    assert any("U+2581" in line and "odd" in line for line in logged)


def test_code_whitespace_is_not_normalised(prepared):
    root, texts, meta = prepared
    sp = spm.SentencePieceProcessor(model_file=str(root / "out" / "tokenizer.model"))
    for text in texts.values():
        assert sp.decode(sp.encode(text)) == text
    # Runs of spaces may be learned as single pieces (indentation is common in code).
    assert any(set(sp.id_to_piece(i)) == {"\u2581"} and len(sp.id_to_piece(i)) > 1
               for i in range(sp.get_piece_size()))
    assert sp.piece_to_id("\n") != common.UNK_ID


# ----------------------------------------------------------------------------- the .bin files

def test_bins_hold_exactly_the_encoded_documents(prepared):
    root, texts, meta = prepared
    out = root / "out"
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert meta["vocab_size"] == sp.get_piece_size()
    assert meta["dtype"] == "uint16" and meta["eos_id"] == sp.eos_id()
    assert meta["newline_id"] == sp.piece_to_id("\n")
    with open(out / "tokenizer.model", "rb") as f:
        assert meta["tokenizer"]["sha256"] == hashlib.sha256(f.read()).hexdigest()
    check_split(out, [texts[n] for n in sorted(texts)], meta)
    assert meta["documents"] == len(texts)
    assert meta["val_tokens"] >= meta["split"]["min_val_tokens"]
    assert meta["source_bytes"] == sum(len(t.encode("utf-8")) for t in texts.values())
    # meta.json stays small: counts and rules, no list of documents.
    assert os.path.getsize(out / "meta.json") < 4096


def test_dtype_follows_vocab_size():
    assert common.dtype_for_vocab(256) == "uint16"
    assert common.dtype_for_vocab(65536) == "uint16"  # ids 0..65535 fit
    assert common.dtype_for_vocab(65537) == "uint32"
    assert np.iinfo(common.dtype_for_vocab(65536)).max == 65535


def test_rerun_is_identical(prepared, tmp_path):
    root, texts, meta = prepared
    # In a separate process: sentencepiece seeds its own sampling per process.
    r = run_script("text", "--input", str(root / "mycorpus"), "--out_dir", str(tmp_path / "again"),
                   "--vocab_size", "400", "--min_val_tokens", "50", "--val_fraction", "0.2")
    assert r.returncode == 0, r.stderr
    meta2 = json.loads((tmp_path / "again" / "meta.json").read_text())
    for fn in ["train.bin", "val.bin", "tokenizer.model"]:
        with open(root / "out" / fn, "rb") as a, open(tmp_path / "again" / fn, "rb") as b:
            assert a.read() == b.read(), fn
    sp1 = spm.SentencePieceProcessor(model_file=str(root / "out" / "tokenizer.model"))
    sp2 = spm.SentencePieceProcessor(model_file=str(tmp_path / "again" / "tokenizer.model"))
    assert [sp1.id_to_piece(i) for i in range(sp1.get_piece_size())] == \
           [sp2.id_to_piece(i) for i in range(sp2.get_piece_size())]
    assert meta2 == meta | {"source": meta2["source"], "name": meta2["name"]}
    # Same folder again: overwritten in place, nothing left over, not even the temp file of
    # an earlier run that was killed outright.
    (tmp_path / "again" / ".train.bin.tmp.99999").write_bytes(b"partial")
    prepare_folder(root / "mycorpus", tmp_path / "again")
    assert sorted(os.listdir(tmp_path / "again")) == sorted(OUTPUTS + ["tokenizer.vocab"])


def test_seed_changes_the_split_but_not_the_content(prepared, tmp_path):
    root, texts, meta = prepared
    m2 = prepare_folder(root / "mycorpus", tmp_path / "s", "--seed", "7")
    assert (tmp_path / "s" / "val.bin").read_bytes() != (root / "out" / "val.bin").read_bytes()
    assert m2["source_sha256"] == meta["source_sha256"]
    assert m2["val_tokens"] == meta["val_tokens"]  # the same budget, other documents


def test_single_file_is_split_into_paragraphs(tmp_path):
    rng = random.Random(1)
    paras = []
    for i in range(60):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
                 for _ in range(rng.randint(1, 4))]
        if i % 5 == 0:
            lines.insert(0, "    indented first line")
        paras.append("\n".join(lines))
    # Separators: one blank line, several, and a whitespace-only one.
    seps = ["\n\n", "\n\n\n", "\n  \t\n"]
    text = "".join(p + seps[i % 3] for i, p in enumerate(paras))
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")

    # Naive reference: walk the lines, a blank line ends a paragraph.
    ref, cur = [], []
    for line in text.split("\n"):
        if line.strip():
            cur.append(line)
        elif cur:
            ref.append("\n".join(cur))
            cur = []
    if cur:
        ref.append("\n".join(cur))
    assert common.split_paragraphs(text) == ref == paras

    out = tmp_path / "out"
    load_script("text").main(["--input", str(tmp_path / "one.txt"), "--out_dir", str(out),
                              "--vocab_size", "300", "--min_val_tokens", "200"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == len(paras)
    assert meta["val_tokens"] >= 200  # the val split holds at least one block
    check_split(out, paras, meta)


def test_char_model_is_one_token_per_character(tmp_path):
    rng = random.Random(2)
    speeches = []
    for _ in range(200):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        speeches.append(f"{rng.choice(['ROMEO', 'JULIET'])}:\n{line.capitalize()},")
    (tmp_path / "input.txt").write_text("\n\n".join(speeches), encoding="utf-8")
    out = tmp_path / "sc"
    load_script("shakespeare").main(["--input", str(tmp_path / "input.txt"), "--char",
                                     "--out_dir", str(out), "--min_val_tokens", "100"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["model_type"] == "char"
    # Each speech is its characters, then eos: tokens = characters + documents.
    chars = sum(len(s) for s in speeches)
    assert meta["train_tokens"] + meta["val_tokens"] == chars + len(speeches) + meta["cut_documents"]
    n_chars = len(set("".join(speeches)) - {"\n"})
    assert meta["vocab_size"] == n_chars + 256 + 4  # chars, bytes, unk/bos/eos, "\n"


# ----------------------------------------------------------------------------- errors

def assert_fails(result, *phrases):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for p in phrases:
        assert p in lines[0], (p, lines[0])
    assert "Traceback" not in result.stderr


def test_error_missing_input(tmp_path):
    r = run_script("text", "--input", str(tmp_path / "nope"), "--out_dir", str(tmp_path / "o"))
    assert_fails(r, "does not exist", str(tmp_path / "nope"))
    assert not (tmp_path / "o").exists()


def test_error_empty_corpus(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("")
    (tmp_path / "c" / "b.txt").write_text("  \n\n\t\n")
    r = run_script("text", "--input", str(tmp_path / "c"), "--out_dir", str(tmp_path / "o"))
    assert_fails(r, "empty corpus")
    assert not (tmp_path / "o").exists()


def test_error_undecodable_fail_and_skip(tmp_path):
    make_corpus(tmp_path / "c", n_files=4)
    bad = tmp_path / "c" / "latin1.txt"
    bad.write_bytes("caf\u00e9 ol\u00e9\n".encode("latin-1"))
    r = run_script("text", "--input", str(tmp_path / "c"), "--out_dir", str(tmp_path / "o"),
                   "--vocab_size", "350", "--min_val_tokens", "20")
    assert_fails(r, str(bad), "UTF-8", "--undecodable=skip")
    assert not (tmp_path / "o").exists()
    r = run_script("text", "--input", str(tmp_path / "c"), "--out_dir", str(tmp_path / "o"),
                   "--vocab_size", "350", "--min_val_tokens", "20", "--undecodable", "skip")
    assert r.returncode == 0, r.stderr
    assert "latin1.txt" in r.stdout
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["skipped_undecodable"] == ["c/latin1.txt"]
    assert meta["documents"] == 4


def test_error_vocab_too_large(tmp_path):
    make_corpus(tmp_path / "c", n_files=3)
    r = run_script("text", "--input", str(tmp_path / "c"), "--out_dir", str(tmp_path / "o"),
                   "--vocab_size", "20000", "--min_val_tokens", "20")
    assert_fails(r, "vocab_size 20000 is too large", "at most")
    assert not (tmp_path / "o").exists()


def test_error_unwritable_output(tmp_path):
    make_corpus(tmp_path / "c", n_files=3)
    (tmp_path / "afile").write_text("x")
    # A folder below a regular file cannot be created, whoever runs the test (even root).
    r = run_script("text", "--input", str(tmp_path / "c"),
                   "--out_dir", str(tmp_path / "afile" / "o"),
                   "--vocab_size", "350", "--min_val_tokens", "20")
    assert_fails(r, "cannot write to output folder")
    assert (tmp_path / "afile").read_text() == "x"


def test_error_corpus_too_small_for_a_block(tmp_path):
    make_corpus(tmp_path / "c", n_files=2)
    r = run_script("text", "--input", str(tmp_path / "c"), "--out_dir", str(tmp_path / "o"),
                   "--vocab_size", "350", "--min_val_tokens", "100000")
    assert_fails(r, "corpus too small", "min_val_tokens")
    assert not (tmp_path / "o").exists()


def test_interrupted_run_keeps_the_previous_outputs(prepared, tmp_path):
    """A run killed during encoding leaves no temp files and does not touch a finished
    folder; a failure in a fresh folder leaves no folder at all."""
    root, texts, _ = prepared
    out = tmp_path / "out"
    prepare_folder(root / "mycorpus", out)
    before = {fn: (out / fn).read_bytes() for fn in OUTPUTS}
    reads = {"n": 0}

    def exploding():
        # The first read (the scan) is whole; the second (encoding) stops half way.
        reads["n"] += 1
        for i, name in enumerate(sorted(texts)):
            if reads["n"] > 1 and i == len(texts) // 2:
                raise KeyboardInterrupt
            yield texts[name]
    for target in (out, tmp_path / "fresh"):
        reads["n"] = 0
        with pytest.raises(KeyboardInterrupt):
            common.prepare(str(target), "x", [("m", "docs", exploding)], "test", vocab_size=400,
                           min_val_tokens=50, val_fraction=0.2, num_proc=2, log=lambda *a: None)
        assert reads["n"] == 2
    assert sorted(os.listdir(out)) == sorted(OUTPUTS + ["tokenizer.vocab"])
    assert {fn: (out / fn).read_bytes() for fn in OUTPUTS} == before
    assert not (tmp_path / "fresh").exists()


# ----------------------------------------------------------------------------- default corpus

def test_stdlib_collector_is_deterministic_and_finds_text():
    mod = load_script("pystdlib")
    sources1, source1 = mod.stdlib_sources()
    sources2, source2 = mod.stdlib_sources()
    names = [n for n, _, _ in sources1]
    assert names == [n for n, _, _ in sources2] and source1 == source2
    assert len(names) == len(set(names))
    assert "stdlib/os.py" in names and "stdlib/json/__init__.py" in names
    assert names[-1] == "pydoc_data.topics" and sources1[-1][1] == "docs"
    assert sources1[-1][2]() == sources2[-1][2]() and len(sources1[-1][2]()) > 10
    # The text is this Python's own source.
    import os as os_module
    assert dict((n, p) for n, _, p in sources1)["stdlib/os.py"] == os_module.__file__
    assert all(k == "text" for _, k, _ in sources1[:-1])
    assert len(names) > 300
    assert not any("site-packages" in n or "__pycache__" in n for n in names)


@pytest.mark.slow
def test_stdlib_subset_prepares(tmp_path):
    """The default pipeline end to end on a slice of the stdlib (the full corpus is for
    bench/prepare.py): code round-trips exactly through the .bin files."""
    mod = load_script("pystdlib")
    sources, _ = mod.stdlib_sources()
    sources = [s for s in sources if s[0].startswith(("stdlib/json/", "stdlib/a"))]
    meta = common.prepare(str(tmp_path / "o"), "pystdlib", sources, "subset", vocab_size=1024,
                          min_val_tokens=500, undecodable="skip", log=lambda *a: None)
    texts = []
    for _, _, path in sources:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    check_split(tmp_path / "o", texts, meta)
