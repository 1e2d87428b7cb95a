"""The study helpers bench/studies/context.py and bench/studies/designs.py share: running the repo's scripts
(train.py resumably, eval.py with its JSON cached), the record of the runs made, the held-out
long documents, the fine-tunes' long training documents and the passkey corpora. A failed
script stops the study in one line naming its log."""
import json
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from harness.common import UserError  # noqa: E402
from lab_runs import write_atomic  # noqa: E402  (the importers put bench/lab/ on sys.path)

GENERATED = re.compile(r"Codec|generated|DO NOT EDIT")  # the first 100 tokens of a document
COLLECT = False  # --collect: read what is finished, train and evaluate nothing
ECHO = print  # how a command is shown (bench/studies/designs.py: above its progress bar)


def sh(cmd, log):
    """Run one of the repo's scripts (a list of arguments) from the repo root, its output to
    `log` as it comes; returns stdout's lines. A failure stops the study naming the log."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    ECHO("$ " + " ".join(cmd))
    with open(log, "w") as f:
        r = subprocess.Popen([sys.executable] + cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=f,
                             text=True)
        lines = []
        for line in r.stdout:  # into the log as it comes: a long run's progress can be watched
            lines.append(line.rstrip("\n"))
            f.write(line)
            f.flush()
        r.wait()
    if r.returncode:  # the script's own `error: ...` line, where it printed one, says why
        with open(log) as f:
            said = [ln[len("error: "):] for ln in f.read().splitlines() if ln.startswith("error: ")]
        raise UserError(f"{cmd[0]} failed (exit {r.returncode}"
                        f"{': ' + said[-1] if said else ''}): see {log}")
    return lines


def run_minutes(run_dir):
    """(last iteration logged, wall minutes of training) from a run's log.jsonl, or None."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.exists(os.path.join(run_dir, "ckpt.pt")) or not os.path.exists(path):
        return None
    last = last_line(path)
    return last and (last["iter"], last["time_s"] / 60)


def last_line(path):
    """The last JSON line of a run's log.jsonl (None while it has none)."""
    with open(path) as f:
        lines = f.read().strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def runs_record(out):
    """{run: iterations, tokens, wall minutes, last val loss} of every run in out/runs with a
    log."""
    runs, folder = {}, os.path.join(out, "runs")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name, "log.jsonl")
        last = os.path.exists(path) and last_line(path)
        if last:
            runs[name] = dict(iterations=last["iter"], tokens=last["tokens"],
                              minutes=last["time_s"] / 60, val_loss=last.get("val_loss"))
    return runs


def train(out, name, args, max_iters):
    """train.py with `args` into out/runs/name, unless a run there already reached max_iters."""
    run_dir = os.path.join(out, "runs", name)
    done = run_minutes(run_dir)
    if done and done[0] >= max_iters:
        return run_dir
    if COLLECT:
        return None
    sh(["train.py"] + args + [f"--out_dir={run_dir}", f"--max_iters={max_iters}",
                              "--compile=False"], os.path.join(out, "logs", name + ".log"))
    return run_dir


def fine_tune(out, name, base, block, iters, batch, extra, rates):
    """The run `base` continued at 4 * block for `iters` iterations of `batch` sequences into
    out/runs/name, config/small.py with `extra` (data, shape, seed, ...) and then the learning
    `rates`, one evaluation at its end; the run's folder."""
    return train(out, name, ["config/small.py"] + extra + [
        f"--init_from={base}", f"--block_size={4 * block}", f"--batch_size={batch}",
        f"--lr_decay_iters={iters}", f"--eval_interval={iters}", "--eval_iters=5"] + rates,
        iters)


def evaluate(out, name, run_dir, args):
    """eval.py --json on run_dir with `args`; its JSON lines, cached in out/evals/name.json."""
    path = os.path.join(out, "evals", name + ".json")
    if COLLECT and not os.path.exists(path):
        return []
    if not os.path.exists(path):
        lines = sh(["eval.py", f"--out_dir={run_dir}", "--json"] + args,
                   os.path.join(out, "logs", "eval_" + name + ".log"))
        rows = [json.loads(line) for line in lines if line.startswith("{")]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, path)
    with open(path) as f:  # eval.py calls a text row's window `block_size`, a cell's `length`
        return [dict(r, length=r.get("length", r.get("block_size"))) for r in json.load(f)]


def lengths_of(block, multiples):
    return [int(round(block * m)) for m in multiples]


def eval_set(out, data_dir, n_docs, doc_tokens):
    """n_docs validation documents of the corpus with more than doc_tokens tokens, evenly
    spaced among those that are not generated tables (codecs' mapping tables, whose repeats
    reward long context more than code does), each cut to its first doc_tokens tokens (at
    the last newline before) and decoded into a file of its own in out/evalset/ (eval.py
    reads each file as one document)."""
    folder = os.path.join(out, "evalset")
    if os.path.exists(os.path.join(folder, "manifest.json")):
        return folder
    import sentencepiece as spm
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    ids = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=meta["dtype"])
    sp = spm.SentencePieceProcessor(model_file=os.path.join(data_dir, "tokenizer.model"))
    ends = np.flatnonzero(ids == meta["eos_id"])
    starts = np.concatenate(([0], ends[:-1] + 1))
    long_docs = [(s, e) for s, e in zip(starts, ends) if e - s > doc_tokens and not
                 GENERATED.search(sp.decode(ids[s:s + 100].tolist()))]
    if len(long_docs) < n_docs:
        sys.exit(f"only {len(long_docs)} validation documents exceed {doc_tokens} tokens")
    # spread over the split: n_docs evenly spaced picks from the eligible documents
    long_docs = [long_docs[i * len(long_docs) // n_docs] for i in range(n_docs)]
    os.makedirs(folder, exist_ok=True)
    manifest = []
    for i, (s, e) in enumerate(long_docs):
        doc = ids[s:s + doc_tokens]
        cut = np.flatnonzero(doc == meta["newline_id"])[-1] + 1  # keep whole lines
        text = sp.decode(doc[:cut].tolist())
        with open(os.path.join(folder, f"doc{i:02d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        manifest.append(dict(file=f"doc{i:02d}.txt", val_offset=int(s), tokens=int(cut),
                             doc_tokens=int(e - s), first_line=text.split("\n")[0][:80]))
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return folder


def ensure_corpus(data_dir):
    if not os.path.exists(os.path.join(data_dir, "meta.json")):
        sh(["data/pystdlib/prepare.py", "--out_dir", data_dir],
           os.path.join(os.path.dirname(data_dir), "prepare.log"))


def tag_rows(rows, **keys):
    return [dict(r, **keys) for r in rows]


def passkey_corpus(out, name, words, docs, tokenizer=None, extra=()):
    """data/passkey/prepare.py's corpus with 0..words filler words a document (`extra`: more
    of prepare.py's options, e.g. --keys)."""
    path = os.path.join(out, "data", name)
    if not COLLECT and not os.path.exists(os.path.join(path, "meta.json")):
        sh(["data/passkey/prepare.py", "--out_dir", path, "--docs", str(docs), "--min_len", "0",
            "--max_len", str(words)] + (["--tokenizer", tokenizer] if tokenizer else [])
           + list(extra),
           os.path.join(out, "logs", f"prepare_{name}.log"))
    return path


def long_corpus(out, data_dir, min_tokens):
    """out/data/long<min_tokens>: the corpus's training documents of at least min_tokens
    tokens (each with its end-of-document token), so that a fine-tune window of min_tokens is
    one document and needs its whole length; val.bin, the tokenizer and meta.json as the
    corpus's. Returns (folder, {documents, tokens, median and longest document})."""
    folder = os.path.join(out, "data", f"long{min_tokens}")
    info_path = os.path.join(folder, "long_docs.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            return folder, json.load(f)
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    ids = np.fromfile(os.path.join(data_dir, "train.bin"), dtype=meta["dtype"])
    ends = np.flatnonzero(ids == meta["eos_id"])
    starts = np.concatenate(([0], ends[:-1] + 1))
    keep = [(s, e + 1) for s, e in zip(starts, ends) if e - s >= min_tokens]
    if not keep:
        raise UserError(f"{data_dir}/train.bin has no document of {min_tokens} tokens or more "
                        f"for a fine-tune at that window")
    train_ids = np.concatenate([ids[s:e] for s, e in keep])
    os.makedirs(folder, exist_ok=True)
    train_ids.tofile(os.path.join(folder, "train.bin"))
    for name in ("val.bin", "tokenizer.model"):
        if not os.path.exists(os.path.join(folder, name)):
            os.symlink(os.path.abspath(os.path.join(data_dir, name)), os.path.join(folder, name))
    write_atomic(os.path.join(folder, "meta.json"),
                 json.dumps(dict(meta, train_tokens=int(len(train_ids)))))
    lengths = sorted(e - s - 1 for s, e in keep)
    info = dict(source=data_dir, min_tokens=min_tokens, documents=len(keep),
                tokens=int(len(train_ids)), median_tokens=int(lengths[len(lengths) // 2]),
                longest_tokens=int(lengths[-1]))
    write_atomic(info_path, json.dumps(info))
    return folder, info


def passkey_mix(out, name, words, docs, keys, vocab, tokenizer=None):
    """out/data/name: `docs` documents, half with one unlabelled key, half with 1..keys
    labelled ones (one tokenizer of `vocab` pieces, or `tokenizer`'s), so that both of
    bench/studies/designs.py's grids ask what training showed; with keys=1 both halves hold one
    unlabelled key (two seeds), and there is one grid."""
    folder = os.path.join(out, "data", name)
    if os.path.exists(os.path.join(folder, "meta.json")):
        return folder
    docs, vocab = docs // 2, ["--vocab_size", str(vocab)]
    multi = passkey_corpus(out, name + "_multi", words, docs, tokenizer,
                           extra=["--keys", str(keys)] + (vocab if not tokenizer else []))
    single = passkey_corpus(out, name + "_single", words, docs,
                            os.path.join(multi, "tokenizer.model"), extra=["--seed", "7"])
    with open(os.path.join(multi, "meta.json")) as f:
        meta = json.load(f)
    os.makedirs(folder, exist_ok=True)
    for split in ("train", "val"):
        ids = np.concatenate([np.fromfile(os.path.join(d, f"{split}.bin"), dtype=meta["dtype"])
                              for d in (multi, single)])
        ids.tofile(os.path.join(folder, f"{split}.bin"))
        meta[f"{split}_tokens"] = int(len(ids))
    if not os.path.exists(os.path.join(folder, "tokenizer.model")):  # an interrupted mix
        os.symlink(os.path.abspath(os.path.join(multi, "tokenizer.model")),
                   os.path.join(folder, "tokenizer.model"))
    write_atomic(os.path.join(folder, "meta.json"), json.dumps(meta))  # last: the folder is done
    return folder
