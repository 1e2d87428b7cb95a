"""
eval.py against independent references: the sliding window's coverage checked target by
target, and the reported loss against a naive loop that runs the model once per scored token
on exactly the context the window rule gives it (a closed form, not eval.py's loop). Also the
shared loader's one-line errors (harness/load.py). The run here is trained for a few steps with
the real train.py on a corpus built with data/pipeline.py, so its tokenizer has the settings of
every real run (identity normalisation, no dummy prefix, byte fallback, "\\n" piece).
test_export.py reuses `make_run`.
"""
import json
import math
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
spm = pytest.importorskip("sentencepiece")
import eval as evalpy  # noqa: E402
from data import pipeline  # noqa: E402
from harness.common import UserError  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402

BLOCK = 64
from test_sample import ENV, one_thread  # noqa: E402,F401 (one thread for tiny models; autouse)


def corpus_docs(n_docs=24, seed=0):
    """Code and prose with runs of spaces and tabs, CJK, emoji and rare accented letters (which
    reach the model as byte pieces)."""
    rng = random.Random(seed)
    words = "the value return self data token model print class import list error".split()
    docs = []
    for d in range(n_docs):
        parts = []
        for _ in range(rng.randint(6, 12)):
            w = rng.choice(words)
            indent = " " * rng.choice((0, 4, 8, 12)) + "\t" * rng.randint(0, 1)
            parts.append(rng.choice((
                f"def {w}_{rng.randint(0, 99)}(x):\n{indent}return {w}(x)  # {rng.randint(0, 999)}",
                " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + ".",
                f"{w}: 世界 你好 {rng.choice('🙂😀🚀')}  café  ǅ{rng.randint(0, 9)}",
                f"{indent}{w} = [{', '.join(str(rng.randint(0, 99)) for _ in range(4))}]")))
        docs.append((f"doc{d:02d}", "\n".join(parts)))
    return docs


def make_run(root, iters=30, vocab_size=400, **train_args):
    """data/ (via data/pipeline.prepare) and out/ (train.py, a few steps) under root; returns
    (out_dir, data_dir)."""
    data, out = os.path.join(root, "data"), os.path.join(root, "out")
    texts = [t for _, t in corpus_docs()]
    pipeline.prepare(data, "tiny", [("docs", "docs", lambda: texts)], "test",
                   vocab_size=vocab_size, val_fraction=0.2, min_val_tokens=3 * BLOCK,
                   num_proc=1, log=lambda *a: None)
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, batch_size=8, max_iters=iters,
                lr_decay_iters=iters, warmup_iters=2, eval_interval=iters, eval_iters=2,
                learning_rate=1e-2, **train_args)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={data}", "--dataset=tiny",
           f"--out_dir={out}", "--device=cpu", "--dtype=float32", "--compile=False"]
    cmd += [f"--{k}={v}" for k, v in args.items()]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    return out, data


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    out, data = make_run(str(root))
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    model = RoFormer(RoFormerConfig(**ckpt["model_args"])).eval()
    model.load_state_dict(ckpt["model"])
    sp = spm.SentencePieceProcessor(model_file=os.path.join(data, "tokenizer.model"))
    # a text of ~5 blocks, and a short one (one window)
    text = "\n\n".join(t for _, t in corpus_docs(8, seed=1))
    (root / "long.txt").write_text(text, encoding="utf-8")
    (root / "short.txt").write_text("def f(x):\n    return  x  # 世界 🙂\n", encoding="utf-8")
    return {"root": root, "out": out, "data": data, "model": model, "sp": sp}


def naive_nats(logits_fn, ids, block, stride):
    """Sum of -log p over targets 1..n-1, each computed alone: target t is scored by window
    k = max(0, ceil((t - block) / stride)), the first whose end reaches it, so its context is
    ids[k * stride : t]."""
    total = 0.0
    for t in range(1, len(ids)):
        k = max(0, -(-(t - block) // stride))
        logits = logits_fn(ids[k * stride:t])
        total -= torch.log_softmax(logits.double(), -1)[ids[t]].item()
    return total


def json_eval(capsys, *args):
    capsys.readouterr()
    evalpy.main([*args, "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def one_line_error(fn, *args):
    """The line fn(*args) must end in: one line, 'error: ...' (a script's main exits with it;
    a library function raises the UserError that harness/common.py turns into it)."""
    with pytest.raises((SystemExit, UserError)) as e:
        fn(*args)
    msg = str(e.value.code) if isinstance(e.value, SystemExit) else f"error: {e.value}"
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def err(*args):
    return one_line_error(evalpy.main, list(args))


# --- the window -------------------------------------------------------------------------------

def test_windows_score_every_target_once_with_enough_context():
    for n in [1, 2, 3, 10, 63, 64, 65, 66, 200, 1000]:
        for block, stride in [(64, 32), (64, 64), (64, 1), (64, 48), (8, 3), (1, 1)]:
            ws = evalpy.windows(n, block, stride)
            scored = []
            for i, (start, end, first) in enumerate(ws):
                assert end - start <= block and start == i * stride
                for t in range(first, end + 1):
                    scored.append(t)
                    if i > 0:  # past the first window: at least block - stride of context
                        assert t - start >= block - stride
            assert scored == list(range(1, n)), (n, block, stride)


# --- the numbers ------------------------------------------------------------------------------

@pytest.mark.parametrize("stride", [0, 17, BLOCK])
def test_loss_equals_naive_per_token_reference(run, capsys, stride):
    """Two files (one of ~5 blocks, one shorter than a window), batch 3 so batches mix files
    and padded last windows: nats/token, perplexity, bpb, token and byte counts."""
    files = [run["root"] / "long.txt", run["root"] / "short.txt"]
    r = json_eval(capsys, f"--out_dir={run['out']}", f"--input={files[0]},{files[1]}",
                  f"--stride={stride}", "--batch_size=3")
    sp, model, s = run["sp"], run["model"], stride or BLOCK // 2
    texts = [f.read_text(encoding="utf-8") for f in files]
    nats = 0.0
    with torch.no_grad():
        for t in texts:
            ids = [sp.eos_id()] + sp.encode(t)
            nats += naive_nats(lambda ctx: model(torch.tensor([ctx]))[0][0, -1], ids, BLOCK, s)
    tokens = sum(len(sp.encode(t)) for t in texts)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    assert tokens > 4 * BLOCK
    assert (r["tokens"], r["bytes"], r["stride"]) == (tokens, nbytes, s)
    assert r["nats_per_token"] == pytest.approx(nats / tokens, rel=1e-5)
    assert r["perplexity"] == pytest.approx(math.exp(nats / tokens), rel=1e-5)
    assert r["bits_per_byte"] == pytest.approx(nats / math.log(2) / nbytes, rel=1e-5)


def test_split_val_scores_the_whole_val_bin(run, capsys):
    """With stride = block_size the windows are disjoint blocks: the reference is the model's
    own loss on consecutive chunks of [eos] + val.bin."""
    r = json_eval(capsys, f"--out_dir={run['out']}", "--split=val", f"--stride={BLOCK}")
    val = np.fromfile(os.path.join(run["data"], "val.bin"), dtype=np.uint16).astype(np.int64)
    ids = torch.from_numpy(np.concatenate(([run["sp"].eos_id()], val)))
    nats = 0.0
    with torch.no_grad():
        for i in range(0, len(ids) - 1, BLOCK):
            x, y = ids[i:i + BLOCK], ids[i + 1:i + BLOCK + 1]
            nats += run["model"](x[None, :len(y)], y[None])[1].double().item() * len(y)
    assert r["tokens"] == len(val)
    assert r["bytes"] == len(run["sp"].decode(val.tolist()).encode("utf-8"))
    assert r["nats_per_token"] == pytest.approx(nats / len(val), rel=1e-5)


def test_scoring_shows_progress_in_a_log_and_json_stays_pure(run, capsys, monkeypatch):
    """Issue 45: --split scored a split in silence (about 54 minutes on a real one). Under a
    pipe or a file, plain lines on stderr with how far it is and the time left (no carriage
    returns); with --json, stdout holds only the JSON line."""
    from harness import progress_waits
    monkeypatch.setattr(progress_waits, "EVERY_S", 0.0)  # a line at every batch
    monkeypatch.setattr(progress_waits, "QUIET_S", -1.0)
    capsys.readouterr()
    evalpy.main([f"--out_dir={run['out']}", "--split=val", "--batch_size=1", "--json"])
    out, errtext = capsys.readouterr()
    assert [json.loads(line)["tokens"] > 0 for line in out.splitlines()] == [True]
    lines = [line for line in errtext.splitlines() if line.startswith("eval: ")]
    assert len(lines) >= 2 and "\r" not in errtext, errtext
    assert all(re.search(r"\d+/\d+ .*%\), about [\d:]+ left", line)  # from the second batch
               for line in lines[1:]), lines


def test_bfloat16_is_close_to_float32(run, capsys):
    a = (f"--out_dir={run['out']}", f"--input={run['root'] / 'long.txt'}")
    fp32 = json_eval(capsys, *a, "--dtype=float32")
    bf16 = json_eval(capsys, *a, "--dtype=bfloat16")
    assert bf16["dtype"] == "bfloat16" and bf16["tokens"] == fp32["tokens"]
    assert bf16["bits_per_byte"] == pytest.approx(fp32["bits_per_byte"], rel=2e-2)


def test_table_output(run, capsys):
    capsys.readouterr()
    evalpy.main([f"--out_dir={run['out']}", f"--input={run['root'] / 'short.txt'}"])
    out, errtext = capsys.readouterr()
    assert "bits/byte" in out and "nats/token" in out and "perplexity" in out
    assert "ckpt.pt: iter 30" in errtext


# --- errors -----------------------------------------------------------------------------------

def test_argument_and_input_errors(run, tmp_path):
    o = f"--out_dir={run['out']}"
    assert "either --input" in err(o)
    assert "either --input" in err(o, "--split=val", f"--input={run['root'] / 'short.txt'}")
    assert "split must be" in err(o, "--split=test")
    assert "does not exist" in err(o, f"--input={tmp_path / 'missing.txt'}")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert "not valid UTF-8" in err(o, f"--input={tmp_path / 'latin1.txt'}")
    (tmp_path / "empty.txt").write_text("")
    assert "empty" in err(o, f"--input={tmp_path / 'empty.txt'}")
    assert "stride" in err(o, "--split=val", f"--stride={BLOCK + 1}")
    assert "dtype" in err(o, "--split=val", "--dtype=int8")
    assert "unknown config key 'strde'" in err(o, "--strde=3")


def test_loader_errors(run, tmp_path):
    """harness/load.py's load_run, shared with sample.py and export.py: missing folder or file, a
    truncated file, weights that do not fit, a tokenizer retrained since."""
    a = ("--split=val",)
    assert "does not exist" in err(f"--out_dir={tmp_path / 'nope'}", *a)
    assert "no checkpoint" in err(f"--out_dir={tmp_path}", *a)
    raw = open(os.path.join(run["out"], "ckpt.pt"), "rb").read()
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "ckpt.pt").write_bytes(raw[:len(raw) // 2])
    assert "cannot load" in err(f"--out_dir={tmp_path / 'trunc'}", *a)
    ckpt = torch.load(os.path.join(run["out"], "ckpt.pt"), weights_only=True)
    (tmp_path / "shape").mkdir()
    torch.save(dict(ckpt, model_args=dict(ckpt["model_args"], n_embd=64)),
               tmp_path / "shape" / "ckpt.pt")
    assert "do not fit" in err(f"--out_dir={tmp_path / 'shape'}", *a)
    other = tmp_path / "other.model"
    lines = [t for _, t in corpus_docs(4, seed=3)]
    other.write_bytes(pipeline.train_tokenizer(lines, 350, "bpe")[0])
    assert "does not match" in err(f"--out_dir={run['out']}", *a, f"--tokenizer={other}")


# --- the window, the bytes and the documents (issue 20) --------------------------------------

def load_model(run, **overrides):
    ckpt = torch.load(os.path.join(run["out"], "ckpt.pt"), weights_only=True)
    model = RoFormer(RoFormerConfig(**dict(ckpt["model_args"], **overrides))).eval()
    model.load_state_dict(ckpt["model"])
    return model


def reference_nats(model, sp, docs, block, stride):
    """Each document after an end-of-document token, every target scored alone (naive_nats)."""
    with torch.no_grad():
        return sum(naive_nats(lambda ctx: model(torch.tensor([ctx]))[0][0, -1],
                              [sp.eos_id()] + sp.encode(d), block, stride) for d in docs)


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_rope_scaling_widens_the_scoring_window(run, capsys, scaling):
    """--rope_scaling/--rope_factor as in sample.py: windows of block_size * factor tokens on
    the scaled model, and --json reports that window as block_size."""
    files = [run["root"] / "long.txt", run["root"] / "short.txt"]
    r = json_eval(capsys, f"--out_dir={run['out']}", f"--input={files[0]},{files[1]}",
                  f"--rope_scaling={scaling}", "--rope_factor=2", "--batch_size=3")
    window = 2 * BLOCK
    assert (r["block_size"], r["stride"]) == (window, window // 2)
    model = load_model(run, rope_scaling=scaling, rope_factor=2.0)
    docs = [f.read_text(encoding="utf-8") for f in files]
    assert len(run["sp"].encode(docs[0])) > 2 * window  # several windows
    nats = reference_nats(model, run["sp"], docs, window, window // 2)
    assert r["nats_per_token"] == pytest.approx(nats / r["tokens"], rel=1e-5)


def test_length_temperature_at_inference_reaches_the_model(run, capsys):
    """--length_temperature=t scores with the checkpoint's weights in a model whose config has
    t (reference: that model built by hand, every target scored alone); past the trained
    context it changes the score (against the default, -1: the checkpoint's, here none); a
    negative t is one line."""
    files = [run["root"] / "long.txt", run["root"] / "short.txt"]
    docs = [f.read_text(encoding="utf-8") for f in files]
    window = 2 * BLOCK  # past the trained context: where the temperature acts
    args = (f"--out_dir={run['out']}", f"--input={files[0]},{files[1]}", f"--lengths={window}",
            "--batch_size=3")
    warm = json_eval(capsys, *args, "--length_temperature=2")
    plain = json_eval(capsys, *args)
    ref = reference_nats(load_model(run, length_temperature=2.0), run["sp"], docs, window,
                         window // 2)
    assert warm["nats_per_token"] == pytest.approx(ref / warm["tokens"], rel=1e-5)
    assert abs(warm["nats_per_token"] - plain["nats_per_token"]) > 1e-4
    msg = one_line_error(evalpy.main, [*args, "--length_temperature=-0.5"])
    assert msg.startswith("error: --length_temperature=-0.5 does not fit this model: "
                          "length_temperature must be finite and >= 0"), msg


def test_bytes_are_the_files_bytes_crlf_kept(run, capsys, tmp_path):
    """A CRLF file is scored as it is on disk: its \\r tokens scored, its bytes counted."""
    docs = [t.replace("\n", "\r\n") for _, t in corpus_docs(2, seed=6)]
    for i, d in enumerate(docs):
        (tmp_path / f"crlf{i}.txt").write_bytes(d.encode("utf-8"))
    r = json_eval(capsys, f"--out_dir={run['out']}", f"--input={tmp_path}")
    sp = run["sp"]
    assert r["bytes"] == sum(len(d.encode("utf-8")) for d in docs)
    assert r["tokens"] == sum(len(sp.encode(d)) for d in docs)
    nats = reference_nats(run["model"], sp, docs, BLOCK, BLOCK // 2)
    assert r["bits_per_byte"] == pytest.approx(nats / math.log(2) / r["bytes"], rel=1e-5)


def naive_paragraphs(text):
    """Blank (or whitespace-only) lines end a paragraph: a line walk, not data/'s regex."""
    paras, cur = [], []
    for line in text.split("\n"):
        if line.strip():
            cur.append(line)
        elif cur:
            paras.append("\n".join(cur))
            cur = []
    return paras + (["\n".join(cur)] if cur else [])


def test_a_file_scores_like_the_folder_of_its_paragraphs(run, capsys, tmp_path):
    """prepare splits a single text file into paragraphs, each trained after the
    end-of-document token; eval applies the same rule, so a held-out file and a folder of
    its paragraphs (one file each) score the same tokens with the same loss over the same
    bytes (the old rule scored the file as one document, charging the model for separators
    it never saw in training)."""
    paras = [t for _, t in corpus_docs(12, seed=7)]
    seps = ["\n\n", "\n\n\n", "\n  \n"]
    text = "".join(p + seps[i % 3] for i, p in enumerate(paras))
    (tmp_path / "held_out.txt").write_text(text, encoding="utf-8", newline="")
    (tmp_path / "paras").mkdir()
    for i, p in enumerate(paras):
        (tmp_path / "paras" / f"p{i:02d}.txt").write_text(p, encoding="utf-8", newline="")
    a = (f"--out_dir={run['out']}",)
    one_file = json_eval(capsys, *a, f"--input={tmp_path / 'held_out.txt'}")
    folder = json_eval(capsys, *a, f"--input={tmp_path / 'paras'}")
    assert naive_paragraphs(text) == paras
    nats = reference_nats(run["model"], run["sp"], paras, BLOCK, BLOCK // 2)
    assert one_file["tokens"] == folder["tokens"] == sum(len(run["sp"].encode(p)) for p in paras)
    assert one_file["nats_per_token"] * one_file["tokens"] == pytest.approx(nats, rel=1e-5)
    assert folder["nats_per_token"] == pytest.approx(one_file["nats_per_token"], rel=1e-6)
    assert one_file["bytes"] == folder["bytes"] == sum(len(p.encode("utf-8")) for p in paras)
    assert one_file["bits_per_byte"] == pytest.approx(folder["bits_per_byte"], rel=1e-6)
    # The old rule, the file as one document, scores the separators as tokens too.
    whole = reference_nats(run["model"], run["sp"], [text], BLOCK, BLOCK // 2)
    assert len(run["sp"].encode(text)) > one_file["tokens"] and whole > nats


def test_whitespace_padding_cannot_move_bits_per_byte(run, capsys, tmp_path):
    """Bytes are those of the documents scored. Blank runs between paragraphs and a file of
    spaces beside the text add no scored token, so they must add no byte either: they used to
    (6.04 bits/byte became 0.83 with blank runs, 0.0037 beside 20 kB of spaces). The bytes
    are checked against a count of the paragraphs found by a line walk (naive_paragraphs)."""
    paras = [t for _, t in corpus_docs(6, seed=9)]
    tight = "\n\n".join(paras)
    padded = "\n \n\n" + "\n\n\n\t\n  \n\n\n\n".join(paras) + "\n" * 400
    for name, text in (("tight.txt", tight), ("padded.txt", padded)):
        (tmp_path / name).write_text(text, encoding="utf-8", newline="")
    a = (f"--out_dir={run['out']}",)
    r_tight = json_eval(capsys, *a, f"--input={tmp_path / 'tight.txt'}")
    r_padded = json_eval(capsys, *a, f"--input={tmp_path / 'padded.txt'}")
    assert naive_paragraphs(padded) == paras
    assert r_padded["bytes"] == r_tight["bytes"] == sum(len(p.encode("utf-8")) for p in paras)
    assert r_padded["bits_per_byte"] == pytest.approx(r_tight["bits_per_byte"], rel=0.02)
    # A folder of texts (a document each) with a 20 kB file of spaces and blank lines beside.
    for folder, extra in (("plain", False), ("spaced", True)):
        (tmp_path / folder).mkdir()
        for i, p in enumerate(paras[:2]):
            (tmp_path / folder / f"t{i}.txt").write_text(p, encoding="utf-8", newline="")
        if extra:
            (tmp_path / folder / "blank.txt").write_text((" " * 99 + "\n") * 200)
    plain = json_eval(capsys, *a, f"--input={tmp_path / 'plain'}")
    spaced = json_eval(capsys, *a, f"--input={tmp_path / 'spaced'}")
    assert spaced["bytes"] == plain["bytes"] == sum(len(p.encode("utf-8")) for p in paras[:2])
    assert spaced["bits_per_byte"] == pytest.approx(plain["bits_per_byte"], rel=0.02)
    nats = reference_nats(run["model"], run["sp"], paras[:2], BLOCK, BLOCK // 2)
    assert spaced["bits_per_byte"] == pytest.approx(nats / math.log(2) / plain["bytes"], rel=1e-5)


def test_records_are_documents_as_in_prepare(run, capsys, tmp_path):
    """A .jsonl input: each record's --text_field (first present of several) is a document;
    the bytes are its text's, not the JSON's."""
    docs = [t for _, t in corpus_docs(3, seed=8)]
    lines = [json.dumps({"body": docs[0]}), json.dumps({"text": docs[1], "body": "not this"}),
             json.dumps({"text": docs[2]})]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    r = json_eval(capsys, f"--out_dir={run['out']}", f"--input={tmp_path / 'r.jsonl'}",
                  "--text_field=text,body")
    assert r["bytes"] == sum(len(d.encode("utf-8")) for d in docs)
    nats = reference_nats(run["model"], run["sp"], docs, BLOCK, BLOCK // 2)
    assert r["nats_per_token"] * r["tokens"] == pytest.approx(nats, rel=1e-5)
    assert "has no field 'title'" in err(f"--out_dir={run['out']}",
                                         f"--input={tmp_path / 'r.jsonl'}", "--text_field=title")


def test_split_is_read_through_the_dataset_checks(run, tmp_path):
    """--split=val reads val.bin through harness/dataset.py: a truncated one is one line naming
    the file and both sizes, not a silently shorter score."""
    import shutil
    data = tmp_path / "data"
    shutil.copytree(run["data"], data)
    full = (data / "val.bin").read_bytes()
    (data / "val.bin").write_bytes(full[:len(full) // 2])
    ckpt = torch.load(os.path.join(run["out"], "ckpt.pt"), weights_only=True)
    ckpt["config"] = dict(ckpt["config"], data_dir=str(data))
    (tmp_path / "out").mkdir()
    torch.save(ckpt, tmp_path / "out" / "ckpt.pt")
    msg = err(f"--out_dir={tmp_path / 'out'}", "--split=val")
    assert str(data / "val.bin") in msg
    assert f"{len(full) // 2:,}" in msg and f"{len(full):,}" in msg


# --- which corpus --split reads (issue 28) ----------------------------------------------------

def moved_run(run, tmp_path, ckpt_edit):
    """The fixture's run as if trained on a copy of its data at tmp_path/data (its checkpoint
    edited by ckpt_edit(ckpt, copy)); returns (out_dir, the copy)."""
    import shutil
    data = tmp_path / "data"
    shutil.copytree(run["data"], data)
    ckpt = torch.load(os.path.join(run["out"], "ckpt.pt"), weights_only=True)
    ckpt_edit(ckpt, str(data))
    (tmp_path / "out").mkdir()
    torch.save(ckpt, tmp_path / "out" / "ckpt.pt")
    return str(tmp_path / "out"), data


def as_trained_on(ckpt, data):
    ckpt["config"] = dict(ckpt["config"], data_dir=data)
    ckpt["tokenizer"] = dict(ckpt["tokenizer"], data_dir=data,
                             path=os.path.join(data, "tokenizer.model"))


def another_corpus_in_data_dataset(tmp_path, monkeypatch):
    """data/<dataset> next to the scripts (harness/run_tokenizer.py's REPO, moved to tmp_path/repo)
    holds another corpus with its own tokenizer: the folder the old search fell back to."""
    from harness import run_tokenizer
    repo = tmp_path / "repo"
    texts = [t for _, t in corpus_docs(12, seed=11)]
    pipeline.prepare(str(repo / "data" / "tiny"), "tiny", [("d", "docs", lambda: texts)], "test",
                   vocab_size=350, val_fraction=0.3, min_val_tokens=20, num_proc=1,
                   log=lambda *a: None)
    monkeypatch.setattr(run_tokenizer, "REPO", str(repo))
    return repo


def test_split_reads_the_folder_the_run_read_and_never_another(run, capsys, tmp_path, monkeypatch):
    """train.py records the folder it read (absolute). --split reads that folder; when it is
    gone, or holds another tokenizer's ids, one line says so. The old search fell back to
    data/<dataset> and scored another corpus (exit 0, or an IndexError half-way). export.py's
    check, which only tokenizes the validation text, goes without it when the folder is gone
    (with a note), but never reads another tokenizer's ids."""
    import shutil
    import export
    ckpt = torch.load(os.path.join(run["out"], "ckpt.pt"), weights_only=True)
    assert ckpt["config"]["data_dir"] == os.path.abspath(run["data"])
    repo = another_corpus_in_data_dataset(tmp_path, monkeypatch)
    out, data = moved_run(run, tmp_path / "moved", as_trained_on)
    r = json_eval(capsys, f"--out_dir={out}", "--split=val")  # read where it was trained
    val = np.fromfile(data / "val.bin", dtype=np.uint16)
    assert r["tokens"] == len(val) and r["input"] == str(data / "val.bin")
    original = tmp_path / "original.model"  # the run's tokenizer, kept by the user
    shutil.copy(data / "tokenizer.model", original)
    shutil.rmtree(data)
    msg = err(f"--out_dir={out}", "--split=val", f"--tokenizer={original}")
    assert str(data) in msg and "gone" in msg and "--input" in msg
    ck = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    capsys.readouterr()
    assert export.validation_text(ck, run["sp"]) == ""
    note = capsys.readouterr().err
    assert note.startswith("note: ") and str(data) in note and "gone" in note
    # the folder is there but was prepared again with another tokenizer: its ids are not the
    # run's, even when the run's own tokenizer is passed with --tokenizer
    out, data = moved_run(run, tmp_path / "again", as_trained_on)
    for fn in ("val.bin", "tokenizer.model"):
        shutil.copy(repo / "data" / "tiny" / fn, data / fn)
    msg = err(f"--out_dir={out}", "--split=val", f"--tokenizer={original}")
    assert str(data) in msg and "tokenizer.model is another" in msg
    ck = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    msg = one_line_error(export.validation_text, ck, run["sp"])
    assert str(data) in msg and "tokenizer.model is another" in msg and "--check=False" in msg


def test_split_of_an_older_checkpoint_keeps_its_search(run, capsys, tmp_path, monkeypatch):
    """A checkpoint from before the record (config data_dir as given, here "") still finds its
    dataset by the tokenizer's folder; when that is gone, data/<dataset> is taken only if its
    tokenizer is the run's."""
    import shutil

    def older(ckpt, data):
        as_trained_on(ckpt, data)
        ckpt["config"]["data_dir"] = ckpt["tokenizer"]["data_dir"] = ""
    out, data = moved_run(run, tmp_path, older)
    r = json_eval(capsys, f"--out_dir={out}", "--split=val")
    assert r["input"] == str(data / "val.bin")
    repo = another_corpus_in_data_dataset(tmp_path, monkeypatch)
    shutil.copy(data / "tokenizer.model", tmp_path / "original.model")
    shutil.rmtree(data)
    msg = err(f"--out_dir={out}", "--split=val", f"--tokenizer={tmp_path / 'original.model'}")
    assert str(repo / "data" / "tiny") in msg and "not the dataset this run read" in msg
    # with no data/<dataset> either, the hint names the folder the run read, not --dataset's
    shutil.rmtree(repo / "data" / "tiny")
    msg = err(f"--out_dir={out}", "--split=val", f"--tokenizer={tmp_path / 'original.model'}")
    assert "not found" in msg and f"prepare the run's dataset {data} again" in msg


# --- a run folder needs nothing outside it (issue 35) ------------------------------------------

def test_a_run_needs_nothing_outside_its_folder(run, capsys, tmp_path):
    """train.py keeps the dataset's tokenizer.model in out_dir. Once the run's dataset folder is
    prepared again from another corpus (another tokenizer), sample.py and eval.py on a text file
    give what they gave before; once it is deleted, export.py writes the same files, prepare
    --tokenizer=RUN encodes with the run's tokenizer and --init_from=RUN starts from its
    weights. All of these used to look for the tokenizer in the dataset folder only."""
    import shutil
    import export
    import sample
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    from pathlib import Path
    tok = Path(run["data"], "tokenizer.model").read_bytes()
    assert Path(run["out"], "tokenizer.model").read_bytes() == tok  # train.py's copy
    out, data = tmp_path / "out", tmp_path / "data"  # a copy of the run we may break
    shutil.copytree(run["out"], out)
    shutil.copytree(run["data"], data)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    as_trained_on(ckpt, str(data))
    torch.save(ckpt, out / "ckpt.pt")

    def results(hf_dir):
        capsys.readouterr()
        sample.main([f"--out_dir={out}", "--start=def ", "--temperature=0", "--max_new_tokens=12"])
        text = capsys.readouterr().out
        scores = json_eval(capsys, f"--out_dir={out}", f"--input={run['root'] / 'long.txt'}")
        export.main([f"--out_dir={out}", f"--hf_dir={hf_dir}", "--check=False"])
        files = {f: (hf_dir / f).read_bytes() for f in sorted(os.listdir(hf_dir))}
        return text, scores, files
    before = results(tmp_path / "hf0")
    texts = [t for _, t in corpus_docs(12, seed=11)]
    pipeline.prepare(str(data), "tiny", [("d", "docs", lambda: texts)], "test", vocab_size=350,
                   val_fraction=0.3, min_val_tokens=20, num_proc=1, log=lambda *a: None)
    assert (data / "tokenizer.model").read_bytes() != tok
    assert results(tmp_path / "hf1") == before
    shutil.rmtree(data)
    assert results(tmp_path / "hf2") == before
    # a new corpus for the run's tokenizer, and a run that starts from its weights
    texts = [t for _, t in corpus_docs(24, seed=12)]
    pipeline.prepare(str(tmp_path / "b"), "b", [("d", "docs", lambda: texts)], "test",
                   val_fraction=0.2, min_val_tokens=3 * BLOCK, num_proc=1, tokenizer=str(out),
                   log=lambda *a: None)
    assert (tmp_path / "b" / "tokenizer.model").read_bytes() == tok
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={tmp_path / 'b'}",
           f"--out_dir={tmp_path / 'new'}", f"--init_from={out}", "--device=cpu",
           "--dtype=float32", "--compile=False", "--n_layer=2", "--n_head=2", "--n_embd=32",
           f"--block_size={BLOCK}", "--batch_size=8", "--eval_iters=2", "--max_iters=0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    new = torch.load(tmp_path / "new" / "ckpt.pt", weights_only=True)["model"]
    assert new.keys() == ckpt["model"].keys()
    assert all(torch.equal(new[k], ckpt["model"][k]) for k in new)


# --- window lengths, local windows and passkey retrieval (issue 30) ---------------------------

def json_rows(capsys, *args):
    capsys.readouterr()
    evalpy.main([*args, "--json"])
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def banded_logits(model, window):
    """The last position's logits of a full forward whose causal mask is cut, by hand, to each
    query's last `window` positions (test_contract.banded: no KV cache involved)."""
    from test_contract import banded, wrapped_sdpa

    def logits(ctx):
        with wrapped_sdpa(banded(window, [])):
            return model(torch.tensor([ctx]))[0][0, -1]
    return logits


def test_lengths_rows_equal_naive_per_length(run, capsys):
    """--lengths: a row per L, each target scored on exactly the context of its window of L
    tokens (stride L/2), L past the trained window included; every row scores the same tokens
    over the same bytes."""
    files = [run["root"] / "long.txt", run["root"] / "short.txt"]
    lengths = [16, 40, BLOCK, 2 * BLOCK + 5]
    rows = json_rows(capsys, f"--out_dir={run['out']}", f"--input={files[0]},{files[1]}",
                     f"--lengths={','.join(map(str, lengths))}", "--batch_size=3")
    sp, docs = run["sp"], [f.read_text(encoding="utf-8") for f in files]
    tokens = sum(len(sp.encode(d)) for d in docs)
    assert tokens > 2 * (2 * BLOCK + 5)  # the longest window slides too
    assert [r["block_size"] for r in rows] == lengths
    assert [r["stride"] for r in rows] == [n // 2 for n in lengths]
    for r, n in zip(rows, lengths):
        assert (r["tokens"], r["bytes"]) == (tokens, sum(len(d.encode("utf-8")) for d in docs))
        nats = reference_nats(run["model"], sp, docs, n, n // 2)
        assert r["nats_per_token"] * r["tokens"] == pytest.approx(nats, rel=1e-5)
    capsys.readouterr()
    evalpy.main([f"--out_dir={run['out']}", f"--input={files[0]}", "--lengths=16,80"])
    out = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in out if line.startswith("window")] == \
        ["window 16", "window 80"]


def test_a_length_past_the_text_scores_it_once_at_the_cost_of_its_length(run, capsys,
                                                                           monkeypatch):
    """--lengths=10000000 on a short text: the row equals the naive reference with a window of
    exactly the text's token count, says which length was used, and no forward is ever
    wider than the text (before, it allocated windows of the requested length: minutes, GBs)."""
    text = (run["root"] / "short.txt").read_text(encoding="utf-8")
    tokens = len(run["sp"].encode(text))
    real, widths = evalpy.score, []

    def score(model, seqs, stride, batch_size, window=None, band=None):
        widths.append(window)
        assert window <= tokens, f"a {window}-token window for a {tokens}-token text"
        return real(model, seqs, stride, batch_size, window, band)
    monkeypatch.setattr(evalpy, "score", score)
    a = (f"--out_dir={run['out']}", f"--input={run['root'] / 'short.txt'}", "--lengths=10000000")
    r = json_rows(capsys, *a)[0]
    assert (r["block_size"], r["window_used"], r["tokens"]) == (10000000, tokens, tokens)
    nats = reference_nats(run["model"], run["sp"], [text], tokens, tokens // 2)
    assert r["nats_per_token"] * r["tokens"] == pytest.approx(nats, rel=1e-5)
    capsys.readouterr()
    evalpy.main(list(a))
    out = capsys.readouterr().out
    assert f"window 10000000 (past every text: the longest is {tokens} tokens" in out


def test_window_mode_local_equals_a_band_mask_built_by_hand(run, capsys):
    """--window_mode=local: each token sees its last block_size tokens inside windows of any
    length. The reference runs every target alone on its window's context, in a full forward
    whose causal mask is cut to the band by hand; past the band it differs from full."""
    files = [run["root"] / "long.txt", run["root"] / "short.txt"]  # two files: two documents
    a = (f"--out_dir={run['out']}", f"--input={files[0]},{files[1]}", "--lengths=40,150")
    local = json_rows(capsys, *a, "--window_mode=local", "--batch_size=3")
    full = json_rows(capsys, *a)
    band = banded_logits(run["model"], BLOCK)
    for r, n in zip(local, (40, 150)):
        with torch.no_grad():
            nats = sum(naive_nats(band, [run["sp"].eos_id()] + run["sp"].encode(
                f.read_text(encoding="utf-8")), n, n // 2) for f in files)
        assert r["window_mode"] == "local" and r["tokens"] == full[0]["tokens"]
        assert r["nats_per_token"] * r["tokens"] == pytest.approx(nats, rel=1e-5)
    assert local[0]["nats_per_token"] == pytest.approx(full[0]["nats_per_token"], rel=1e-6)
    assert abs(local[1]["nats_per_token"] - full[1]["nats_per_token"]) > 1e-4


def test_greedy_decoding_equals_a_loop_of_full_forwards():
    """eval's greedy decoder (one cache) against argmax over a full forward of the whole
    sequence per token: with all the context, and with the hand-built band. The model is
    test_contract's (float64, weights spread off init) so that the band changes the tokens."""
    from test_contract import build
    model = build(RoFormerConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 40, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    full = lambda ctx: model(torch.tensor([ctx]))[0][0, -1]  # noqa: E731
    got = {}
    for band, logits in ((None, full), (16, banded_logits(model, 16))):
        for prompt in (ids[:10], ids):
            seq = list(prompt)
            with torch.no_grad():
                for _ in range(evalpy.ANSWER):
                    seq.append(int(logits(seq)[:37].argmax()))
            got[band, len(prompt)] = evalpy.greedy(model, prompt, band, 37)
            assert got[band, len(prompt)] == seq[len(prompt):]
    assert got[None, 10] == got[16, 10] and got[None, 50] != got[16, 50]


def oracle(sp, seen):
    """A stand-in for greedy decoding that reads the key off the prompt: when fewer than half
    of the filler words come before the key sentence, it answers the key followed by "." for
    an even key and by another digit (no exact match) for an odd one; else a wrong key."""
    def decode(model, ids, band, vocab):
        text = sp.decode(ids)
        key = re.search(r"The pass key is (\d+)\. Remember it\.", text).group(1)
        before = len(text.split(f"The pass key is {key}.")[0].split())
        n = len(text.split()) - 7 - 9  # the key sentence's words and the question's
        seen.append(dict(tokens=len(ids), key=int(key), before=before, filler=n))
        early = before < n / 2
        return sp.encode(f" {key}{'.' if int(key) % 2 == 0 else '7'}" if early else " 12345")
    return decode


def test_passkey_grid_counts_exact_matches(run, capsys, monkeypatch):
    """--passkey: a cell per (length, depth), --samples prompts of at most L tokens each, the
    key after round(depth * words) filler words, the same keys in every cell; accuracy counted
    against what the oracle answered; the table has a row per length."""
    seen, sp = [], run["sp"]
    monkeypatch.setattr(evalpy, "greedy", oracle(sp, seen))
    a = (f"--out_dir={run['out']}", "--passkey", "--lengths=128,300", "--depths=0,0.2,0.8,1",
         "--samples=6", "--seed=5")
    cells = json_rows(capsys, *a)
    assert [(c["length"], c["depth"]) for c in cells] == \
        [(n, d) for n in (128, 300) for d in (0, 0.2, 0.8, 1)]
    for i, c in enumerate(cells):
        prompts = seen[6 * i:6 * (i + 1)]
        assert [p["key"] for p in prompts] == [p["key"] for p in seen[:6]]
        assert all(p["tokens"] <= c["length"] and p["filler"] > 8 for p in prompts)
        assert all(p["before"] == round(c["depth"] * p["filler"]) for p in prompts)
        want = sum(p["before"] < p["filler"] / 2 and p["key"] % 2 == 0 for p in prompts)
        assert (c["samples"], c["correct"], c["accuracy"]) == (6, want, want / 6)
    assert 0 < cells[0]["correct"] < 6 and cells[-1]["correct"] == 0  # every branch taken
    capsys.readouterr()
    evalpy.main(list(a))
    table = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert table[-3] == ["length", "0", "0.2", "0.8", "1"]
    assert [row[0] for row in table[-2:]] == ["128", "300"]
    assert [float(x) for x in table[-2][1:]] == [round(c["accuracy"], 2) for c in cells[:4]]


def test_passkey_on_the_trained_model(run, capsys):
    """The real path end to end (the tiny model knows no pass key): a full grid, local too,
    and with two labelled keys."""
    for mode in ("full", "local"):
        cells = json_rows(capsys, f"--out_dir={run['out']}", "--passkey", "--lengths=80,150",
                          "--depths=0,1", "--samples=2", f"--window_mode={mode}")
        assert len(cells) == 4 and all(0 <= c["accuracy"] <= 1 for c in cells)
    cells = json_rows(capsys, f"--out_dir={run['out']}", "--passkey", "--keys=2",
                      "--lengths=300", "--depths=0,1", "--samples=2")
    assert len(cells) == 2 and all(0 <= c["accuracy"] <= 1 and c["keys"] == 2 for c in cells)


def test_lengths_passkey_and_window_errors(run, tmp_path):
    o = f"--out_dir={run['out']}"
    t = f"--input={run['root'] / 'short.txt'}"
    for bad in ("32,abc", "1.5", ","):
        assert "lengths takes integers" in err(o, t, f"--lengths={bad}")
    assert "lengths must be >= 2" in err(o, t, "--lengths=32,1")
    assert "depths between 0 and 1" in err(o, "--passkey", "--depths=0,1.5")
    assert "depths numbers" in err(o, "--passkey", "--depths=half")
    assert "window_mode must be" in err(o, t, "--window_mode=sliding")
    assert "either --input" in err(o, t, "--passkey")
    assert "samples must be" in err(o, "--passkey", "--samples=0")
    assert "stride 20 is larger than the window 16" in err(o, t, "--lengths=64,16", "--stride=20")
    assert "too short for a passkey prompt" in err(o, "--passkey", "--lengths=8")
    # linear attention has no band to cut (the same weights load as either kind)
    ckpt = torch.load(os.path.join(run["out"], "ckpt.pt"), weights_only=True)
    ckpt["model_args"] = dict(ckpt["model_args"], attention="linear")
    (tmp_path / "linear").mkdir()
    torch.save(ckpt, tmp_path / "linear" / "ckpt.pt")
    assert "local bands softmax" in err(f"--out_dir={tmp_path / 'linear'}", t,
                                        "--window_mode=local")
    learned = RoFormer(RoFormerConfig(vocab_size=300, block_size=BLOCK, n_layer=1, n_head=2,
                                      n_embd=16, pos_encoding="learned"))
    cfg = {"stride": 0, "passkey": False, "window_mode": "full"}
    assert "learned positions end" in one_line_error(evalpy.check_lengths, learned, cfg,
                                                     [BLOCK, BLOCK + 1])
    evalpy.check_lengths(learned, cfg, [BLOCK])  # up to block_size is fine


def test_passkey_refuses_a_length_it_cannot_run_before_building_a_prompt(run, monkeypatch):
    """--passkey --lengths=10000000: a 10M-token prompt's attention alone is 1e14 pairs, more
    than any machine holds; one line, and not one prompt built (building them took minutes
    and GBs before the forward that could never run). Lengths that fit still run (the tests
    above)."""
    import data.passkey.prepare as passkey

    def prompt_ids(*args):
        raise AssertionError("a prompt was built for a length that cannot run")
    monkeypatch.setattr(passkey, "prompt_ids", prompt_ids)
    msg = err(f"--out_dir={run['out']}", "--passkey", "--lengths=64,10000000")
    assert "--passkey length 10000000 needs about" in msg and "GB" in msg


def test_passkey_needs_a_tokenizer_that_encodes_digits(run, tmp_path):
    """A tokenizer without byte fallback that never saw a digit turns the key into unknown
    pieces: a one-line error before any prompt is built."""
    import io
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["What is the pass key? The pass key is here."] * 20),
        model_writer=buf, model_type="char", vocab_size=30, byte_fallback=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    cfg = {"depths": [0.5], "samples": 1, "seed": 0, "json": True, "window_mode": "full"}
    msg = one_line_error(evalpy.passkey_grid, run["model"], sp, cfg, [BLOCK], None)
    assert "needs a tokenizer that encodes" in msg


# --- multi-key retrieval (issue 38) -----------------------------------------------------------

def multi_key_oracle(sp, seen, right):
    """A stand-in for greedy decoding that reads the labelled keys off the prompt and answers
    the key the question asks (right) or another label's key (not right)."""
    def decode(model, ids, band, vocab):
        text = sp.decode(ids)
        stated = dict(re.findall(r"The pass key for ([a-z]+) is (\d+)\. Remember it\.", text))
        asked = re.search(r"What is the pass key for ([a-z]+)\? The pass key for \1 is$", text)
        seen.append(dict(tokens=len(ids), text=text, stated=stated, asked=asked.group(1)))
        wrong = [k for label, k in stated.items() if label != asked.group(1)]
        return sp.encode(f" {stated[asked.group(1)] if right else wrong[0]}.")
    return decode


@pytest.mark.parametrize("right", [True, False])
def test_passkey_keys_grid_counts_the_asked_key(run, capsys, monkeypatch, right):
    """--passkey --keys=3: every prompt states three labelled keys and asks one, the asked key
    after round(depth * filler) words, the same keys and labels in every cell; an answer with
    the asked key counts (accuracy 1), another stated key does not (0); the report says keys=3."""
    from test_passkey import parse_labelled
    seen, sp = [], run["sp"]
    monkeypatch.setattr(evalpy, "greedy", multi_key_oracle(sp, seen, right))
    a = (f"--out_dir={run['out']}", "--passkey", "--keys=3", "--lengths=250,400",
         "--depths=0,0.5,1", "--samples=4", "--seed=9")
    cells = json_rows(capsys, *a)
    assert [(c["length"], c["depth"], c["keys"]) for c in cells] == \
        [(n, d, 3) for n in (250, 400) for d in (0, 0.5, 1)]
    for i, c in enumerate(cells):
        prompts = seen[4 * i:4 * (i + 1)]
        assert [(p["stated"], p["asked"]) for p in prompts] == \
            [(p["stated"], p["asked"]) for p in seen[:4]]
        for p in prompts:
            keys, n_stated, asked, before, filler, _ = parse_labelled(p["text"])
            assert n_stated == 3 and p["tokens"] <= c["length"] and filler > 8
            assert before == round(c["depth"] * filler)
        assert (c["samples"], c["correct"], c["accuracy"]) == (4, 4 * right, float(right))
    assert len({p["asked"] for p in seen[:4]}) > 1  # the labels are drawn
    capsys.readouterr()
    evalpy.main(list(a))
    assert "passkey accuracy, keys=3," in capsys.readouterr().out


def test_passkey_keys_1_asks_todays_prompts(run, capsys, monkeypatch):
    """--keys=1 (and no --keys) builds today's prompts: the keys and filler starts drawn from
    the seed as before, the unlabelled text rebuilt by hand."""
    from data.passkey.prepare import filler_words
    from test_passkey import todays_text
    seen = {}
    for flag in ([], ["--keys=1"]):
        got = seen[len(flag)] = []
        monkeypatch.setattr(evalpy, "greedy", lambda m, ids, b, v: got.append(ids) or [])
        rows = json_rows(capsys, f"--out_dir={run['out']}", "--passkey", "--lengths=100",
                         "--depths=0,0.6", "--samples=3", "--seed=21", *flag)
        assert [r["keys"] for r in rows] == [1, 1]
    assert seen[0] == seen[1]
    words, rng, sp = filler_words(), random.Random(21), run["sp"]
    draws = [(rng.randint(10000, 99999), rng.randrange(len(words))) for _ in range(3)]
    for ids, (depth, (key, start)) in zip(seen[0], [(d, k) for d in (0, 0.6) for k in draws]):
        filler = len(sp.decode(ids).split()) - 16
        assert ids == [sp.eos_id()] + sp.encode(todays_text(words, start, filler, depth, key))


def test_passkey_keys_errors(run, tmp_path):
    o, t = f"--out_dir={run['out']}", f"--input={run['root'] / 'short.txt'}"
    assert "--keys must be between 1 and 16" in err(o, "--passkey", "--keys=0")
    assert "--keys must be between 1 and 16" in err(o, "--passkey", "--keys=17")
    assert "pass --passkey too" in err(o, t, "--keys=2")
    assert "too short for a passkey prompt with 4 keys" in err(o, "--passkey", "--keys=4",
                                                               "--lengths=80")
    import io
    buf = io.BytesIO()  # a tokenizer that knows the single question's letters, not the labels'
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["What is the pass key? The pass key is 0123456789"] * 20),
        model_writer=buf, model_type="char", vocab_size=30, byte_fallback=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    cfg = {"depths": [0.5], "samples": 1, "seed": 0, "json": True, "window_mode": "full",
           "keys": 2}
    msg = one_line_error(evalpy.passkey_grid, run["model"], sp, cfg, [BLOCK], None)
    assert "--passkey --keys=2 needs a tokenizer that encodes 'What is the pass key for" in msg
    evalpy.check_passkey_tokenizer(sp, 1)  # the single key's question it does encode
