"""data/: tokenizers round-trip, the .bin files hold exactly the encoded documents (each whole
in one split, or cut once after a newline), the validation budget is met, runs are
reproducible for any number of worker processes, every input format reads the same records,
memory does not grow with the corpus, and every user mistake is one line + non-zero exit with
no output left behind. References are independent: each document encoded whole on its own
with a freshly loaded tokenizer, a naive paragraph splitter, records written here."""
import gzip
import hashlib
import importlib.util
import io
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
from data import documents, pipeline, shared, workers  # noqa: E402
from harness import progress_waits  # noqa: E402

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
    inputs = [str(c) for c in corpus] if isinstance(corpus, list) else [str(corpus)]
    args = ["--input", *inputs, "--out_dir", str(out_dir), "--vocab_size", "400",
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
    """Documents held in memory, as pipeline.prepare takes them."""
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
    pipeline.prepare(str(tmp_path / "out"), "t", mem_sources(texts.values()), "test",
                   model_type=model_type,
                   vocab_size=vocab, min_val_tokens=50, val_fraction=0.2, log=lambda *a: None)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    for s in ROUND_TRIP:
        ids = sp.encode(s)
        assert sp.decode(ids) == s, (model_type, s)
        assert shared.UNK_ID not in ids, "byte fallback: nothing maps to unknown"
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
    inputs = mem_sources(texts.values()) + mem_sources(["x\u2581y " * 50], "odd")
    pipeline.prepare(str(tmp_path / "o"), "t", inputs, "test", vocab_size=400, min_val_tokens=50,
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
    assert sp.piece_to_id("\n") != shared.UNK_ID


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
    assert shared.dtype_for_vocab(256) == "uint16"
    assert shared.dtype_for_vocab(65536) == "uint16"  # ids 0..65535 fit
    assert shared.dtype_for_vocab(65537) == "uint32"
    assert np.iinfo(shared.dtype_for_vocab(65536)).max == 65535


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
    assert documents.split_paragraphs(text) == ref == paras

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


@pytest.mark.parametrize("script, args, phrase", [
    ("passkey", ["--docs", "abc"], "argument --docs: invalid int value: 'abc'"),
    ("pystdlib", ["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    ("shakespeare", ["--nope"], "unrecognized arguments: --nope"),
    ("text", [], "the following arguments are required: --input"),
])
def test_error_bad_argument_is_one_line(capsys, script, args, phrase):
    """argparse's own mistakes, in every prepare script, end as the one line (and exit 1)
    that every other mistake does, without the usage block."""
    with pytest.raises(SystemExit) as e:
        load_script(script).main(args)
    assert str(e.value.code).startswith("error: ") and phrase in str(e.value.code)
    assert "\n" not in str(e.value.code) and capsys.readouterr().err == ""


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


def slow_job(job):
    """A job that marks its start, works 0.3 s, then marks its end (module level: the workers
    look it up by name)."""
    import time
    folder, i = job
    open(os.path.join(folder, f"{i}.start"), "w").close()
    time.sleep(0.3)
    open(os.path.join(folder, f"{i}.end"), "w").close()
    return i


def test_workers_stopped_early_finish_their_jobs_and_drop_the_rest(tmp_path):
    """A reader that stops at the first result (a batch with an error) used to terminate the
    pool, which killed workers mid-job and once hung prepare.py for good (a worker killed while
    holding the result pipe's lock). Now every job that started finishes, the rest never start,
    and the results come in the order of the jobs."""
    jobs = ((str(tmp_path), i) for i in range(40))
    results = workers.ordered_map(slow_job, jobs, 2, {})
    assert [next(results), next(results)] == [0, 1]
    results.close()
    started = {int(f.split(".")[0]) for f in os.listdir(tmp_path) if f.endswith(".start")}
    ended = {int(f.split(".")[0]) for f in os.listdir(tmp_path) if f.endswith(".end")}
    assert started == ended and {0, 1} <= started and len(started) < 12, (started, ended)


def ctrl_c_job(i):
    """A job that gets the Ctrl-C a terminal sends to the whole process group, then finishes."""
    import signal
    import time
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    return i


def test_workers_leave_ctrl_c_to_the_main_process():
    """Ctrl-C reaches every process of the group: a worker used to die of it with a traceback
    of its own printed beside prepare.py's one line (and the pool sometimes hung). Workers
    ignore it; the main process stops the pool."""
    try:
        results = list(workers.ordered_map(ctrl_c_job, range(6), 2, {}))
    except KeyboardInterrupt:  # a worker's, passed on as its job's result
        pytest.fail("a worker died of the Ctrl-C")
    assert results == list(range(6))


def test_error_vocab_too_large(tmp_path):
    make_corpus(tmp_path / "c", n_files=3)
    r = run_script("text", "--input", str(tmp_path / "c"), "--out_dir", str(tmp_path / "o"),
                   "--vocab_size", "20000", "--min_val_tokens", "20")
    assert_fails(r, "vocab_size 20000 is too large", "at most")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("option, value, phrase", [
    ("--seed", "-1", "seed must be from 0 to 2**64 - 1"),      # numpy: OverflowError
    ("--seed", str(1 << 64), "seed must be from 0 to 2**64 - 1"),
    ("--num_proc", "0", "num_proc must be at least 1"),             # silently meant every core
    ("--vocab_size", "0", "vocab_size must be at least 261"),       # sentencepiece INTERNAL
    ("--vocab_size", "-5", "at least 261"),
])
def test_error_option_out_of_range(tmp_path, option, value, phrase):
    """Values the stages cannot take are one line naming the valid range, before any output."""
    make_corpus(tmp_path / "c", n_files=3)
    r = run_script("text", "--input", str(tmp_path / "c"), "--out_dir", str(tmp_path / "o"),
                   "--vocab_size", "350", "--min_val_tokens", "20", option, value)
    assert_fails(r, phrase)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("meta", [
    json.dumps({"name": "tiny", "vocab_size": 64, "dtype": "uint16", "eos_id": 0}),  # hand-made
    "not json {",
    json.dumps(["a", "list"]),
])
def test_error_out_dir_holds_a_dataset_prepare_did_not_make(prepared, tmp_path, meta):
    """A folder whose meta.json another tool (or a person) wrote is refused and left exactly
    as it was; a folder prepare made is replaced (test_rerun_is_identical)."""
    root, _, _ = prepared
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "meta.json").write_text(meta)
    (out / "train.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    before = {fn: (out / fn).read_bytes() for fn in os.listdir(out)}
    r = run_script("text", "--input", str(root / "mycorpus"), "--out_dir", str(out),
                   "--vocab_size", "400", "--min_val_tokens", "50")
    assert_fails(r, str(out / "meta.json"), "not written by prepare", "--out_dir")
    assert {fn: (out / fn).read_bytes() for fn in os.listdir(out)} == before


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
            pipeline.prepare(str(target), "x", [("m", "docs", exploding)], "test", vocab_size=400,
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
    bench/speed/prepare_speed.py): code round-trips exactly through the .bin files."""
    mod = load_script("pystdlib")
    inputs, _ = mod.stdlib_sources()
    inputs = [s for s in inputs if s[0].startswith(("stdlib/json/", "stdlib/a"))]
    meta = pipeline.prepare(str(tmp_path / "o"), "pystdlib", inputs, "subset", vocab_size=1024,
                          min_val_tokens=500, undecodable="skip", log=lambda *a: None)
    texts = []
    for _, _, path in inputs:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    check_split(tmp_path / "o", texts, meta)


# ----------------------------------------------------------------------------- input formats

def write_records(folder, records, fmt, field="text"):
    """records -> folder/shard.<fmt>, written here with the standard library (and pyarrow)."""
    os.makedirs(folder, exist_ok=True)
    if fmt == "parquet":
        pa = pytest.importorskip("pyarrow", reason="parquet input needs pyarrow")
        import pyarrow.parquet as pq
        half = len(records) // 2  # two row groups
        table = pa.table({"id": list(range(len(records))), field: records})
        pq.write_table(table, folder / "shard.parquet", row_group_size=max(half, 1))
        return folder / "shard.parquet"
    lines = "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(records))
    if fmt == "jsonl.gz":
        with gzip.open(folder / "shard.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write(lines)
        return folder / "shard.jsonl.gz"
    (folder / "shard.jsonl").write_text(lines, encoding="utf-8")
    return folder / "shard.jsonl"


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet"])
def test_records_round_trip(tmp_path, fmt):
    """One record = one document: the .bin files hold each record's text encoded whole, the
    blank ones left out; a custom --text_field is read."""
    texts = list(make_corpus(tmp_path / "c", n_files=12, seed=3).values())
    texts.insert(3, "   \n")  # blank: no document
    path = write_records(tmp_path / "in", texts, fmt, field="body")
    out = tmp_path / "out"
    meta = prepare_folder(path, out, "--text_field", "body", "--num_proc", "2")
    assert meta["documents"] == len(texts) - 1 and meta["text_field"] == "body"
    check_split(out, texts, meta)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    for t in texts:
        assert sp.decode(sp.encode(t)) == t


def test_mixed_formats_and_long_documents_in_pieces(tmp_path, monkeypatch):
    """Text files, jsonl, gzip and parquet in one corpus, in the order given; tiny batch and
    piece sizes, so documents are encoded in many pieces cut at line ends (and one long
    line cut before a space) across many batches: still each document encoded whole."""
    monkeypatch.setattr(documents, "TASK_CHARS", 3000)
    monkeypatch.setattr(documents, "PIECE_CHARS", 700)
    monkeypatch.setattr(workers, "UNIT_CHARS", 500)
    texts = list(make_corpus(tmp_path / "txt", n_files=4, seed=5).values())
    long_line = " ".join(WORDS * 5)  # no newline at all, longer than a piece
    (tmp_path / "txt" / "doc99.txt").write_text(long_line, encoding="utf-8")
    recs = list(make_corpus(tmp_path / "r", n_files=6, seed=6).values())
    inputs = [tmp_path / "txt", write_records(tmp_path / "a", recs[:2], "jsonl"),
              write_records(tmp_path / "b", recs[2:4], "jsonl.gz")]
    expected = texts + [long_line] + recs[:4]
    if importlib.util.find_spec("pyarrow"):
        inputs.append(write_records(tmp_path / "p", recs[4:], "parquet"))
        expected += recs[4:]
    metas = []
    for n in (1, 2):
        out = tmp_path / str(n) / "out"
        metas.append(prepare_folder(inputs, out, "--num_proc", str(n)))
        check_split(out, expected, metas[-1])
    assert metas[0] == metas[1]
    for fn in OUTPUTS:
        assert (tmp_path / "1" / "out" / fn).read_bytes() == (tmp_path / "2" / "out" / fn).read_bytes()


def test_num_proc_1_and_2_give_the_same_bytes(tmp_path):
    """A corpus larger than several batches (so two workers really share it), in fresh
    processes: every output file is the same."""
    rng = random.Random(7)
    paras = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
             for _ in range(20000)]
    (tmp_path / "big.txt").write_text("\n\n".join(paras), encoding="utf-8")
    assert (tmp_path / "big.txt").stat().st_size > 2.5 * documents.TASK_CHARS
    for n in (1, 2):
        r = run_script("text", "--input", str(tmp_path / "big.txt"), "--out_dir",
                       str(tmp_path / str(n) / "o"), "--vocab_size", "400", "--num_proc", str(n),
                       "--sample_bytes", "300000")
        assert r.returncode == 0, r.stderr
    for fn in OUTPUTS + ["tokenizer.vocab"]:
        assert (tmp_path / "1" / "o" / fn).read_bytes() == (tmp_path / "2" / "o" / fn).read_bytes()


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_tokenizer_does_not_depend_on_the_machine(tmp_path, monkeypatch, model_type):
    """The same corpus gives the same tokenizer.model bytes whatever the core count or
    --num_proc (unigram's EM sums per trainer thread, so its vocabulary depended on them)."""
    texts = list(make_corpus(tmp_path / "c", n_files=10, seed=8).values())
    models = []
    for cores, n in ((1, None), (8, None), (3, 2)):
        monkeypatch.setattr(workers, "default_num_proc", lambda: cores)
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        out = tmp_path / f"o{cores}"
        pipeline.prepare(str(out), "t", mem_sources(texts), "test", model_type=model_type,
                       vocab_size=330, min_val_tokens=50, num_proc=n, log=lambda *a: None)
        models.append((out / "tokenizer.model").read_bytes())
    assert models[0] == models[1] == models[2]


# ----------------------------------------------------------------------------- the split

def test_skewed_corpus_gets_its_val_fraction(tmp_path):
    """Three files of 214, 3 and 3 KB: validation holds val_fraction of the tokens (exactly,
    rounded), cutting the big file after a newline, for any seed; --val_tokens N gives N."""
    rng = random.Random(9)

    def text(kb):
        lines, size = [], 0
        while size < kb * 1000:
            lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
            size += len(lines[-1]) + 1
        return "\n".join(lines) + "\n"
    texts = {"a.txt": text(214), "b.txt": text(3), "c.txt": text(3)}
    for fn, t in texts.items():
        (tmp_path / "c").mkdir(exist_ok=True)
        (tmp_path / "c" / fn).write_text(t, encoding="utf-8")
    for seed in (1, 2, 3):
        out = tmp_path / f"o{seed}"
        meta = prepare_folder(tmp_path / "c", out, "--val_fraction", "0.05", "--seed", str(seed),
                              "--min_val_tokens", "100")
        check_split(out, list(texts.values()), meta)
        total = meta["split"]["tokens_before_split"]
        assert abs(meta["val_tokens"] / total - 0.05) <= 0.1 * 0.05
    out = tmp_path / "exact"
    meta = prepare_folder(tmp_path / "c", out, "--val_tokens", "777", "--min_val_tokens", "100")
    check_split(out, list(texts.values()), meta, budget=777)
    assert meta["val_tokens"] == 777 and meta["split"]["val_fraction"] is None


def test_split_spreads_whole_documents_over_a_corpus_of_many(tmp_path):
    """With many small documents validation is whole documents (at most the last forced
    piece cut), picked from all along the corpus."""
    rng = random.Random(10)
    texts = [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(40)) for i in range(600)]
    out = tmp_path / "o"
    meta = pipeline.prepare(str(out), "t", mem_sources(texts), "test", vocab_size=400,
                          min_val_tokens=50, val_fraction=0.1, num_proc=1, log=lambda *a: None)
    assert check_split(out, texts, meta) <= 1
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    val = split_at_eos(np.fromfile(out / "val.bin", dtype=np.uint16), 2)
    where = [texts.index(sp.decode(v)) for v in val if sp.decode(v) in texts]
    assert len(where) >= 40
    assert min(where) < 100 and max(where) > 500  # not all from one end


# ----------------------------------------------------------------------------- bad records

@pytest.mark.parametrize("bad, problem", [
    ("{not json", "not valid JSON"),
    ('{"title": "no text here"}', "has no field 'text'"),
    ('{"text": 42}', "is int, not a string"),
    ('["text"]', "not a JSON object"),
])
def test_error_bad_jsonl_record(tmp_path, bad, problem):
    recs = list(make_corpus(tmp_path / "r", n_files=6).values())
    lines = [json.dumps({"text": t}) for t in recs]
    lines.insert(4, bad)
    with gzip.open(tmp_path / "in.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    args = ["--input", str(tmp_path / "in.jsonl.gz"), "--out_dir", str(tmp_path / "o"),
            "--vocab_size", "350", "--min_val_tokens", "20", "--num_proc", "2"]
    r = run_script("text", *args)
    assert_fails(r, f"{tmp_path / 'in.jsonl.gz'} line 5", problem, "--undecodable=skip")
    assert not (tmp_path / "o").exists()
    r = run_script("text", *args, "--undecodable", "skip")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["skipped_records"] == 1 and meta["documents"] == len(recs)


def test_error_parquet_problems(tmp_path):
    pytest.importorskip("pyarrow", reason="parquet input needs pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq
    recs = list(make_corpus(tmp_path / "r", n_files=4).values())
    pq.write_table(pa.table({"text": recs[:2] + [None] + recs[2:]}), tmp_path / "n.parquet")
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "i.parquet")
    base = ["--out_dir", str(tmp_path / "o"), "--vocab_size", "350", "--min_val_tokens", "20"]
    r = run_script("text", "--input", str(tmp_path / "n.parquet"), *base)
    assert_fails(r, str(tmp_path / "n.parquet"), "row index 2", "not a string")
    r = run_script("text", "--input", str(tmp_path / "i.parquet"), *base)
    assert_fails(r, str(tmp_path / "i.parquet"), "not strings")
    r = run_script("text", "--input", str(tmp_path / "n.parquet"), *base, "--text_field", "body")
    assert_fails(r, "no column 'body'", "--text_field")
    assert not (tmp_path / "o").exists()


def test_error_parquet_without_pyarrow(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    code = ("import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None; "
            f"sys.argv[0] = 'prepare.py'; sys.path.insert(0, {REPO!r}); "
            "import runpy; runpy.run_path('data/text/prepare.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, "--input", str(tmp_path / "x.parquet"),
                        "--out_dir", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert_fails(r, "needs the pyarrow package", "pip install pyarrow")
    assert not (tmp_path / "o").exists()


def test_error_bad_gzip(tmp_path):
    good = gzip.compress(b'{"text": "hello there"}\n' * 50)
    (tmp_path / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    r = run_script("text", "--input", str(tmp_path / "cut.jsonl.gz"), "--out_dir",
                   str(tmp_path / "o"))
    assert_fails(r, str(tmp_path / "cut.jsonl.gz"), "not a valid gzip file")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- streaming

def test_streaming_paragraphs_match_the_reference_splitter(monkeypatch):
    """The paragraph splitter that reads block by block (and cuts long paragraphs into
    pieces) gives exactly split_paragraphs() of the whole text, whatever the block size."""
    rng = random.Random(11)
    bits = ["word", "two words", "  indented", "\n", "\n\n", " \n", "\t\n", "\r\n", "x\n\n\n",
            " ", "   ", "y" * 40]
    for trial in range(400):
        text = "".join(rng.choice(bits) for _ in range(rng.randint(0, 40)))
        blocks, i = [], 0
        while i < len(text):
            k = rng.randint(1, 9)
            blocks.append(text[i:i + k])
            i += k
        monkeypatch.setattr(documents, "PIECE_CHARS", rng.choice([3, 12, 10_000]))
        got, cur = [], []
        for piece, first, last in documents.paragraphs(blocks):
            assert first == (not cur)
            cur.append(piece)
            if last:
                got.append("".join(cur))
                cur = []
        assert got == documents.split_paragraphs(text), repr(text)


PEAK_RSS_SCRIPT = r"""
import os, resource, sys, threading, time
sys.path.insert(0, sys.argv[1])
from data import pipeline, sources
peak = [0]
def watch():  # the whole process tree's resident memory, sampled
    while True:
        total = 0
        for pid in [os.getpid()] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if pid == os.getpid() or int(fields[1]) == os.getpid():
                    with open(f"/proc/{pid}/statm") as f:
                        total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError):
                pass
        peak[0] = max(peak[0], total)
        time.sleep(0.05)
threading.Thread(target=watch, daemon=True).start()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
pipeline.prepare(sys.argv[3], "big", sources.file_sources([("big.txt", sys.argv[2])]), "test",
               model_type="char", vocab_size=0, num_proc=int(sys.argv[4]),
               sample_bytes=500_000, log=lambda *a: None)
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak[0])
"""


@pytest.mark.slow
def test_peak_memory_of_a_200mb_single_file_is_bounded(tmp_path):
    """A 200 MB single text file prepared in a fresh process: the process's peak RSS stays
    within 150 MB of what it had before preparing (the old code held the file several
    times over, ~+600 MB), and the whole tree (two workers) within 400 MB.
    Slow: it really encodes 200 MB, with a character model, the fastest to encode (16 s of
    CPU, 40-70 s of wall time on two cores loaded by other jobs)."""
    rng = np.random.default_rng(12)
    words = np.array(WORDS)
    w = words[rng.integers(0, len(words), 400_000)]
    w[rng.random(len(w)) < 0.08] = "\n"  # lines, and blank lines between paragraphs
    chunk = " ".join(w) + "\n\n"  # 2 MB; repeated, the file has 100 times more paragraphs
    path = tmp_path / "big.txt"
    with open(path, "w", encoding="utf-8") as f:
        while f.tell() < 200_000_000:
            f.write(chunk)
    (tmp_path / "run.py").write_text(PEAK_RSS_SCRIPT)
    r = subprocess.run([sys.executable, str(tmp_path / "run.py"), REPO, str(path),
                        str(tmp_path / "o"), "2"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    base, peak_self, peak_tree = map(int, r.stdout.split())
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["source_bytes"] > 190_000_000
    assert peak_self - base < 150e6, (base, peak_self)
    assert peak_tree < 400e6, peak_tree


# ----------------------------------------------------------------------------- real corpora

def test_text_field_takes_several_names_first_present_wins(tmp_path):
    """Shards that disagree on the field (jsonl with `text`, jsonl.gz with `content`,
    parquet with `text`): --text_field=text,content reads every record; a record with both
    fields gives its `text`."""
    recs = list(make_corpus(tmp_path / "r", n_files=9, seed=13).values())
    a = write_records(tmp_path / "a", recs[:3], "jsonl", field="text")
    b = write_records(tmp_path / "b", recs[3:6], "jsonl.gz", field="content")
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"content": "not this one", "text": recs[6]}) + "\n",
                    encoding="utf-8")
    inputs, expected = [a, b, both], recs[:7]
    if importlib.util.find_spec("pyarrow"):
        inputs.append(write_records(tmp_path / "p", recs[7:], "parquet", field="text"))
        expected = recs
    out = tmp_path / "out"
    meta = prepare_folder(inputs, out, "--text_field", "text,content")
    assert meta["documents"] == len(expected) and meta["text_field"] == "text,content"
    check_split(out, expected, meta)


def test_error_record_without_the_field_names_text_field_first(tmp_path):
    recs = list(make_corpus(tmp_path / "r", n_files=4).values())
    lines = [json.dumps({"text": t}) for t in recs] + [json.dumps({"content": "x", "id": 7})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    r = run_script("text", "--input", str(tmp_path / "in.jsonl"), "--out_dir",
                   str(tmp_path / "o"), "--vocab_size", "350", "--min_val_tokens", "20")
    assert_fails(r, "line 5", "has no field 'text'", "content, id", "--text_field",
                 "--undecodable=skip")
    msg = r.stderr
    assert msg.index("--text_field") < msg.index("--undecodable=skip")
    assert not (tmp_path / "o").exists()


def test_error_a_file_without_the_field_even_under_skip(tmp_path):
    """--undecodable=skip leaves out a bad record, not a whole shard that names its field
    differently: that is a --text_field mistake, and silently dropping the shard is worse."""
    recs = list(make_corpus(tmp_path / "r", n_files=6).values())
    good = write_records(tmp_path / "a", recs[:3], "jsonl", field="text")
    other = write_records(tmp_path / "b", recs[3:], "jsonl.gz", field="content")
    base = ["--out_dir", str(tmp_path / "o"), "--vocab_size", "350", "--min_val_tokens", "20",
            "--undecodable", "skip"]
    r = run_script("text", "--input", str(good), str(other), *base)
    assert_fails(r, str(other), "none of its records", "'text'", "--text_field")
    assert not (tmp_path / "o").exists()
    r = run_script("text", "--input", str(good), str(other), *base, "--text_field", "text,content")
    assert r.returncode == 0, r.stderr


def test_an_empty_out_dir_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    """--out_dir '' resolved to data/ itself: a dataset written into the package, beside its
    code. It is refused in one line, before the corpus is read; nothing appears."""
    make_corpus(tmp_path / "c", n_files=4)
    monkeypatch.setattr(pipeline, "DATA_DIR", str(tmp_path / "repo_data"))
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SystemExit) as e:
        load_script("text").main(["--input", str(tmp_path / "c"), "--vocab_size", "350",
                                  "--min_val_tokens", "20", "--out_dir", ""])
    assert str(e.value.code) == "error: --out_dir is empty: pass a dataset name or a folder"
    assert sorted(os.listdir(tmp_path)) == before


def test_out_dir_name_is_where_train_py_looks(tmp_path, monkeypatch):
    """--out_dir NAME writes data/NAME next to train.py (where --dataset=NAME reads) from any
    current folder; a path with a slash or an absolute one is taken as given. (DATA_DIR is
    moved under tmp_path here so the test writes nothing into the repo.)"""
    assert pipeline.DATA_DIR == os.path.join(REPO, "data")
    assert os.path.isfile(os.path.join(os.path.dirname(pipeline.DATA_DIR), "train.py"))
    make_corpus(tmp_path / "c", n_files=4)
    monkeypatch.setattr(pipeline, "DATA_DIR", str(tmp_path / "repo_data"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    args = ["--input", str(tmp_path / "c"), "--vocab_size", "350", "--min_val_tokens", "20"]
    text_prepare = load_script("text")
    text_prepare.main(args + ["--out_dir", "mycorpus"])
    assert (tmp_path / "repo_data" / "mycorpus" / "meta.json").exists()
    assert not (elsewhere / "mycorpus").exists()
    text_prepare.main(args + ["--out_dir", "./here"])
    assert (elsewhere / "here" / "meta.json").exists()
    text_prepare.main(args + ["--out_dir", str(tmp_path / "abs")])
    assert (tmp_path / "abs" / "meta.json").exists()
    for name in ("text", "pystdlib", "shakespeare"):
        r = run_script(name, "--help")
        assert "--data_dir" in r.stdout and "data/NAME" in r.stdout, (name, r.stdout)


def test_log_says_how_many_workers_ran(tmp_path):
    """One batch of work with --num_proc 3: one worker encoded it, and the log says so."""
    texts = list(make_corpus(tmp_path / "c", n_files=4).values())
    for num_proc in (3, 1):
        logged = []
        pipeline.prepare(str(tmp_path / f"o{num_proc}"), "t", mem_sources(texts), "test",
                       vocab_size=350, min_val_tokens=20, num_proc=num_proc, log=logged.append)
        assert "with 1 worker process " in logged[-1], logged[-1]


def test_full_disk_during_prepare_leaves_nothing_partial(prepared, tmp_path):
    """A write that fails half way (the file size limit stands in for a full disk): one
    `error:` line, no temp file left, the dataset already in the folder unchanged, and no
    folder at all where there was none."""
    root, texts, _ = prepared
    out = tmp_path / "out"
    prepare_folder(root / "mycorpus", out)
    before = {fn: (out / fn).read_bytes() for fn in OUTPUTS}
    make_corpus(tmp_path / "other", n_files=8, seed=21)
    limit = 2000  # bytes: the encoding pass's token file passes it
    assert os.path.getsize(out / "train.bin") > 2 * limit

    resource = pytest.importorskip("resource")

    def limited():  # in the child: files may not grow past `limit` bytes
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    # SIGXFSZ ignored, so the write fails with EFBIG (as a full disk fails with ENOSPC)
    # instead of the signal killing the process.
    for target in (out, tmp_path / "fresh"):
        r = subprocess.run(
            [sys.executable, "-c", "import signal, runpy, sys; "
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')",
             os.path.join(REPO, "data", "text", "prepare.py"), "--input", str(tmp_path / "other"),
             "--out_dir", str(target), "--vocab_size", "400", "--min_val_tokens", "50",
             "--val_fraction", "0.2"],
            capture_output=True, text=True, cwd=REPO, timeout=120, preexec_fn=limited)
        assert_fails(r, "cannot write the dataset", str(target), "File too large")
    assert sorted(os.listdir(out)) == sorted(OUTPUTS + ["tokenizer.vocab"])
    assert {fn: (out / fn).read_bytes() for fn in OUTPUTS} == before
    assert not (tmp_path / "fresh").exists()


def test_outputs_are_fsynced_before_their_rename_and_the_folder_after(tmp_path, monkeypatch):
    """A rename is durable across a power loss only if the file's data reached the disk
    before it, and the rename itself only once the folder is synced."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name an fd")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.realpath(src)))
        return real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    texts = list(make_corpus(tmp_path / "c", n_files=4).values())
    out = tmp_path / "out"
    pipeline.prepare(str(out), "t", mem_sources(texts), "test", vocab_size=350,
                   min_val_tokens=20, num_proc=1, log=lambda *a: None)
    renames = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
    assert len(renames) == len(OUTPUTS) + 1  # each output (tokenizer.vocab included)
    for i in renames:
        tmp = events[i][1]
        assert ("fsync", tmp) in events[:i], f"{tmp} renamed before it was fsynced"
    assert ("fsync", os.path.realpath(out)) in events[renames[-1]:]


# ----------------------------------------------------------------------------- reading a split

def test_open_split_refuses_a_truncated_or_foreign_bin(prepared, tmp_path):
    """harness/dataset.py, the reader train/eval/export share: a .bin whose size disagrees with
    meta.json (truncated, empty, read with another dtype) and a meta.json that is not JSON
    are one line naming the file, never a silently shorter corpus."""
    import shutil
    from harness.dataset import load_meta, open_split
    from harness.common import UserError as DatasetError
    root, _, meta = prepared
    ddir = tmp_path / "d"
    shutil.copytree(root / "out", ddir)
    ok = open_split(str(ddir), "train")
    assert len(ok) == meta["train_tokens"] and ok.dtype == np.dtype(meta["dtype"])
    full = (ddir / "train.bin").read_bytes()

    (ddir / "train.bin").write_bytes(full[:len(full) // 2])
    with pytest.raises(DatasetError) as e:
        open_split(str(ddir), "train")
    msg = str(e.value)
    assert "\n" not in msg and str(ddir / "train.bin") in msg
    assert f"{len(full) // 2:,}" in msg and f"{len(full):,}" in msg  # both sizes

    (ddir / "train.bin").write_bytes(b"")
    meta_empty = dict(meta, train_tokens=0)
    with pytest.raises(DatasetError, match="is empty"):
        open_split(str(ddir), "train", meta_empty)

    (ddir / "train.bin").write_bytes(full)
    with pytest.raises(DatasetError, match="uint32") as e:
        open_split(str(ddir), "train", dict(meta, dtype="uint32"))  # 2-byte tokens read as 4
    assert f"{len(full):,}" in str(e.value) and f"{len(full) * 2:,}" in str(e.value)
    odd = dict(meta, dtype="uint32")
    del odd["train_tokens"]  # no count recorded: the size must still be whole tokens
    (ddir / "train.bin").write_bytes(full[:-2] if len(full) % 4 == 0 else full)
    with pytest.raises(DatasetError, match="whole number"):
        open_split(str(ddir), "train", odd)

    (ddir / "meta.json").write_text('{"vocab_size": 400, "dtype": ')
    with pytest.raises(DatasetError, match="not valid JSON") as e:
        load_meta(str(ddir))
    assert str(ddir / "meta.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("field, value", [
    ("vocab_size", "abc"), ("vocab_size", 0), ("vocab_size", True), ("train_tokens", None),
    ("train_tokens", "12"), ("val_tokens", 1.5), ("eos_id", "2"), ("dtype", None),
    ("dtype", "float32"),
])
def test_load_meta_refuses_a_field_of_the_wrong_type(prepared, tmp_path, field, value):
    """A meta.json field readers compute with, of the wrong type, is one line naming the file
    and the field, from load_meta (where train, eval, export read it), not an error raised
    while wording another error; the prepared meta.json itself loads."""
    from harness.dataset import load_meta, open_split
    from harness.common import UserError
    root, _, meta = prepared
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert load_meta(str(tmp_path)) == meta
    (tmp_path / "meta.json").write_text(json.dumps(dict(meta, **{field: value})))
    for read in (load_meta, lambda d: open_split(d, "train")):
        with pytest.raises(UserError) as e:
            read(str(tmp_path))
        msg = str(e.value)
        assert "\n" not in msg and str(tmp_path / "meta.json") in msg and repr(field) in msg


# ----------------------------------------------------------------------------- --tokenizer

def prepare_with(corpus, out_dir, tokenizer, *extra):
    """The text script with an existing tokenizer; the split options of prepare_folder."""
    load_script("text").main(["--input", str(corpus), "--out_dir", str(out_dir), "--tokenizer",
                              str(tokenizer), "--min_val_tokens", "50", "--val_fraction", "0.2",
                              *extra])
    return json.loads((out_dir / "meta.json").read_text())


def test_tokenizer_option_writes_the_bytes_a_normal_prepare_writes(prepared, tmp_path):
    """Corpus A prepared again with A's own tokenizer.model: the same encode and split, so the
    same files; meta.json differs only in the tokenizer, which names the copy's sha256."""
    root, _, meta = prepared
    given = root / "out" / "tokenizer.model"
    again = prepare_with(root / "mycorpus", tmp_path / "again", given)
    for fn in ("train.bin", "val.bin", "tokenizer.model"):
        assert (tmp_path / "again" / fn).read_bytes() == (root / "out" / fn).read_bytes(), fn
    copied = (tmp_path / "again" / "tokenizer.model").read_bytes()
    assert again["tokenizer"] == {"copied_from": str(given), "vocab_size": meta["vocab_size"],
                                  "sha256": hashlib.sha256(copied).hexdigest()}
    assert again == meta | {"tokenizer": again["tokenizer"], "name": "again"}


def test_tokenizer_option_takes_a_runs_and_the_run_resumes_on_the_new_corpus(prepared,
                                                                             tmp_path,
                                                                             monkeypatch):
    """A run trained on corpus A; corpus B prepared with --tokenizer=RUN (its out_dir, or its
    checkpoint file) gets A's tokenizer.model byte for byte (the copy the run folder keeps), the
    sha256 the run recorded, and train.py resumes the run on B (it refuses a dataset whose
    tokenizer's sha256 differs)."""
    import torch  # only here: the rest of data/ runs without it
    from test_train import TINY, load, train
    root, _, _ = prepared
    run = tmp_path / "run"
    train(f"--data_dir={root / 'out'}", f"--out_dir={run}", *TINY, "--max_iters=2")
    make_corpus(tmp_path / "b", seed=1)
    for i, given in enumerate((run, run / "ckpt.pt")):
        meta = prepare_with(tmp_path / "b", tmp_path / f"b{i}", given)
        copied = (tmp_path / f"b{i}" / "tokenizer.model").read_bytes()
        assert copied == (root / "out" / "tokenizer.model").read_bytes()
        assert meta["tokenizer"]["sha256"] == hashlib.sha256(copied).hexdigest()
        assert meta["tokenizer"]["copied_from"] == str(run / "tokenizer.model")
        assert meta["tokenizer"]["sha256"] == load(str(run))["tokenizer"]["sha256"]
    train(f"--data_dir={tmp_path / 'b0'}", f"--out_dir={run}", *TINY, "--max_iters=4",
          "--init_from=resume")
    assert load(str(run))["iter_num"] == 4
    # A run (from before run folders kept their tokenizer) whose tokenizer was moved away
    # since: said in one line, nothing written.
    ckpt = load(str(run))
    ckpt["tokenizer"] = dict(ckpt["tokenizer"], path=str(tmp_path / "gone.model"))
    (tmp_path / "moved").mkdir()
    torch.save(ckpt, tmp_path / "moved" / "ckpt.pt")
    from harness import run_tokenizer
    monkeypatch.setattr(run_tokenizer, "REPO", str(tmp_path))  # no data/<dataset> there
    with pytest.raises(SystemExit) as e:
        prepare_with(tmp_path / "b", tmp_path / "b2", tmp_path / "moved")
    msg = str(e.value.code)
    assert msg.startswith(f"error: --tokenizer {tmp_path / 'moved'}: ") and "\n" not in msg
    assert "gone.model" in msg and "not found" in msg
    assert not (tmp_path / "b2").exists()


def test_tokenizer_option_tells_another_tokenizer_from_one_retrained(prepared, tmp_path,
                                                                     monkeypatch):
    """Issue 45: --tokenizer=RUN whose folder holds another dataset's tokenizer was diagnosed
    "it was retrained since, so rebuild that dataset". Only the file in the folder the run
    read can have been prepared again since; any other file is another tokenizer. One line
    each, the way out named, nothing written."""
    import torch  # only here: the rest of data/ runs without it
    from harness import run_tokenizer
    monkeypatch.setattr(run_tokenizer, "REPO", str(tmp_path))  # no data/<dataset> there
    root, texts, _ = prepared
    ours = root / "out" / "tokenizer.model"
    lines = [line for t in make_corpus(tmp_path / "b", seed=1).values() for line in
             t.split("\n") if line.strip()]
    other = pipeline.train_tokenizer(lines, 400, "unigram")[0]

    def refusal(run, recorded):
        (tmp_path / run).mkdir(exist_ok=True)
        info = dict(sha256=run_tokenizer.file_sha256(ours), path=str(recorded), dataset="x")
        torch.save(dict(model_args={}, model={}, tokenizer=info), tmp_path / run / "ckpt.pt")
        with pytest.raises(SystemExit) as e:
            prepare_with(root / "mycorpus", tmp_path / f"{run}-out", tmp_path / run)
        assert not (tmp_path / f"{run}-out").exists()
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg and "--tokenizer=PATH" in msg
        return msg

    (tmp_path / "copy").mkdir()  # the run folder's copy is another dataset's tokenizer
    (tmp_path / "copy" / "tokenizer.model").write_bytes(other)
    msg = refusal("copy", "")
    assert "another tokenizer" in msg and "retrained" not in msg, msg
    (tmp_path / "a").mkdir()  # the dataset folder the run read, prepared again since
    (tmp_path / "a" / "tokenizer.model").write_bytes(other)
    msg = refusal("old", tmp_path / "a" / "tokenizer.model")
    assert f"{tmp_path / 'a'} was prepared again" in msg and "another tokenizer" not in msg, msg


def not_a_tokenizer(d, kind):
    """A --tokenizer value prepare cannot use, made in the folder d."""
    ids = {"no newline": {}, "other ids": dict(bos_id=-1, eos_id=1, user_defined_symbols="\n")}
    if kind in ids:  # sentencepiece models, but not as prepare makes them
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(WORDS * 3), model_writer=buf,
                                       vocab_size=60, minloglevel=2, **ids[kind])
        (d / f"{kind}.model").write_bytes(buf.getvalue())
    (d / "text.txt").write_text("not a model")
    (d / "empty.model").write_bytes(b"")
    return {"missing": d / "nope", "folder": d, "text": d / "text.txt",
            "empty": d / "empty.model"}.get(kind, d / f"{kind}.model")


@pytest.mark.parametrize("kind, extra, phrases", [
    ("missing", [], ["does not exist"]),
    ("folder", [], ["cannot load", "ckpt.pt"]),  # a folder without a checkpoint
    ("text", [], ["no tokenizer prepare can use"]),
    ("empty", [], ["no tokenizer prepare can use"]),
    ("no newline", [], ["no tokenizer prepare can use"]),
    ("other ids", [], ["no tokenizer prepare can use"]),
    ("missing", ["--vocab_size", "400"], ["--vocab_size would train one"]),
    ("missing", ["--model_type", "bpe"], ["--model_type would train one"]),  # even the default
])
def test_error_tokenizer_option(tmp_path, kind, extra, phrases):
    """One line each, before any work: nothing written."""
    make_corpus(tmp_path / "c", n_files=2)
    (tmp_path / "g").mkdir()
    r = run_script("text", "--input", str(tmp_path / "c"), "--out_dir", str(tmp_path / "o"),
                   "--tokenizer", str(not_a_tokenizer(tmp_path / "g", kind)), *extra)
    assert_fails(r, *phrases)
    assert not (tmp_path / "o").exists()


def test_error_tokenizer_option_with_char(prepared, tmp_path):
    root, texts, _ = prepared
    (tmp_path / "in.txt").write_text("\n\n".join(texts.values()))
    r = run_script("shakespeare", "--input", str(tmp_path / "in.txt"), "--char", "--out_dir",
                   str(tmp_path / "o"), "--tokenizer", str(root / "out" / "tokenizer.model"))
    assert_fails(r, "--char would train one")
    assert not (tmp_path / "o").exists()


def normalising_model(path, lines, **normaliser):
    """A sentencepiece model prepare's id check accepts (unk, bos, eos = 0, 1, 2, a newline
    piece, byte fallback) but trained with a normaliser: its decode is not its input."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf,
                                   vocab_size=330, byte_fallback=True, minloglevel=2,
                                   user_defined_symbols="\n", normalization_rule_name="nmt_nfkc",
                                   **normaliser)
    path.write_bytes(buf.getvalue())
    return path


def test_error_tokenizer_option_that_does_not_round_trip(tmp_path):
    """A normalising --tokenizer is refused in one line naming what it changes, before any
    output is written: squeezed spaces (caught on whitespace any corpus has), and NFKC alone
    (caught on the corpus's own text, here a ligature). The reference is the model's own
    decode(encode()) of that piece, computed here."""
    texts = make_corpus(tmp_path / "c", n_files=2)
    lines = [line for t in texts.values() for line in t.split("\n") if line.strip()]
    squeezing = normalising_model(tmp_path / "squeeze.model", lines,
                                  remove_extra_whitespaces=True)
    sp = spm.SentencePieceProcessor(model_file=str(squeezing))
    assert sp.decode(sp.encode("a  b")) == "a b"  # the model does normalise
    with pytest.raises(SystemExit) as e:
        prepare_with(tmp_path / "c", tmp_path / "o", squeezing)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg
    assert "does not round-trip" in msg and "changes '  ' to ' '" in msg and str(squeezing) in msg
    assert not (tmp_path / "o").exists()

    (tmp_path / "c" / "lig.txt").write_text("the \ufb01le is open\n", encoding="utf-8")
    nfkc = normalising_model(tmp_path / "nfkc.model", lines, remove_extra_whitespaces=False)
    sp = spm.SentencePieceProcessor(model_file=str(nfkc))
    assert sp.decode(sp.encode("\ufb01")) == "fi" and sp.decode(sp.encode("a  b\n")) == "a  b\n"
    with pytest.raises(SystemExit) as e:
        prepare_with(tmp_path / "c", tmp_path / "o", nfkc)
    assert "round-trip this corpus" in str(e.value.code)
    assert "changes '\ufb01' to 'fi'" in str(e.value.code)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- progress

def test_bench_optim_timing_shows_progress_in_a_log(monkeypatch, capsys):
    """Issue 45: bench/studies/adamw_vs_muon.py timed its steps for minutes in silence. harness/progress_waits.py's
    bar (eval.py's too) prints, under a pipe or a file, plain lines with the time left."""
    monkeypatch.setattr(progress_waits, "EVERY_S", 0.0)  # a line at every step
    monkeypatch.setattr(progress_waits, "QUIET_S", -1.0)
    monkeypatch.setattr(sys, "argv", ["optim.py", "--time_steps=1"])
    spec = importlib.util.spec_from_file_location("bench_optim",
                                                  os.path.join(REPO, "bench", "studies", "adamw_vs_muon.py"))
    optim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(optim)
    tiny = dict(n_layer=1, n_head=2, n_embd=32, block_size=8, batch_size=2)
    assert set(optim.step_cost(tiny)) == set(optim.ARMS)
    errtext = capsys.readouterr().err
    lines = [line for line in errtext.splitlines() if line.startswith("timing steps")]
    assert len(lines) == 12 and "\r" not in errtext, errtext  # (1 + 2 warm-up) x 4 arms
    assert "12/12 step (100%)" in lines[-1] and "left" in lines[1], lines  # after a 2nd step
    # the "no Gram form" arm times the same map as muon.gram_newton_schulz, done plainly
    import torch
    from muon import Muon, gram_newton_schulz
    x = torch.randn(16, 64, dtype=torch.float64)
    x /= x.norm()
    assert torch.allclose(optim.plain_newton_schulz(x, *Muon.COEFFICIENTS, 5),
                          gram_newton_schulz(x, *Muon.COEFFICIENTS, 5), atol=1e-12, rtol=0)
