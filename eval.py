"""
Measure a trained run on text: loss in nats per token, perplexity, and bits per byte.

    python eval.py --out_dir=out-small --input=notes.txt
    python eval.py --out_dir=out-small --input=docs/,README.md --json
    python eval.py --out_dir=out-small --split=val
    python eval.py --out_dir=out-small --input=long.txt --rope_scaling=ntk --rope_factor=4

Nats per token depend on the tokenizer (a bigger vocab puts more text in each token), so runs
with different vocabularies, or other models, compare only in bits per byte: the total loss in
bits over the bytes of the text, total_nats / ln 2 / bytes.

The inputs become documents by the rule prepare applies to a corpus (data/documents.py, the
same code): a single text file is split into paragraphs at blank lines, several text files
are a document each, a .jsonl(.gz) record or parquet row is a document (--text_field). Each
document is read after the end-of-document token (the context every training document starts
from) and every one of its tokens is scored once.

Bytes are the UTF-8 bytes of the documents scored, exactly the text their tokens encode
(the carriage returns of CRLFs included): the blank runs between paragraphs, which the
end-of-document token stands for in training, and whitespace-only files, which are no
document, add no tokens and so no bytes. Counting them (the bytes on disk) let padding a text
with blank lines or a file of spaces lower bits per byte at will; scoring them as tokens would
charge the model for separators prepare never trains it on. So bits per byte is the loss per
byte of the text it is measured on.

Text longer than the window is scored with a sliding window: windows of
block_size tokens (original context * rope_factor when scaled) start every `stride` tokens;
the first scores all its tokens, each later one only the tokens past the previous window, so
each of those has at least window - stride tokens of context. --split=val scores the run's own
val.bin (its end-of-document tokens included: loss but no bytes).
"""
import json as jsonlib
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from data.dataset import load_meta, open_split
from data.documents import text_fields, whole_documents
from data.shared import tqdm
from data.sources import file_sources, find_files
from lib.common import UserError, cli, configure, pick_device
from sample import dataset_dir, describe, load_run

# -----------------------------------------------------------------------------------------
out_dir = "out"
input = ""              # text files or folders, comma-separated
split = ""              # "val" or "train": the run's own tokens instead of --input
text_field = "text"     # .jsonl / parquet inputs: the field holding a document (a,b: first present)
stride = 0              # 0: half the window
batch_size = 8          # windows per forward
device = "auto"         # auto: cuda if available, else cpu
dtype = "auto"          # auto: bfloat16 on a CUDA GPU that supports it (else float16), float32 on CPU
tokenizer = ""          # "" uses the path recorded in the checkpoint; either way its sha256 must match
rope_scaling = ""       # "" keeps the checkpoint's; none, linear, ntk or yarn, as sample.py
rope_factor = 0.0       # 0 keeps the checkpoint's; else the window is original context * factor
json = False            # print one JSON line instead of the table
# -----------------------------------------------------------------------------------------
CONFIG_KEYS = ("out_dir", "input", "split", "text_field", "stride", "batch_size", "device",
               "dtype", "tokenizer", "rope_scaling", "rope_factor", "json")


def windows(n, block, stride):
    """Windows over a sequence of n tokens, whose targets are tokens 1..n-1: a list of
    (start, end, first) where the input is tokens[start:end], the targets tokens[start+1:end+1],
    and targets from index `first` on are scored (those before were scored by an earlier
    window). Window k starts at k * stride."""
    out, done, start = [], 0, 0  # done: the last target index scored so far
    while done < n - 1:
        end = min(start + block, n - 1)
        out.append((start, end, done + 1))
        done, start = end, start + stride
    return out


@torch.no_grad()
def score(model, seqs, stride, batch_size):
    """Sum of -log p(token | its window) over every target token of every sequence, in float64,
    and the number of tokens scored. seqs: 1-d int64 arrays whose first token is context. The
    window is the model's context_window (original context * rope_factor, at least
    block_size): a full forward grows the rotation tables on demand."""
    window = model.config.context_window
    dev = next(model.parameters()).device
    jobs = [(s, w) for s in seqs for w in windows(len(s), window, stride)]
    nats, count = 0.0, 0
    bar = tqdm(total=len(jobs), desc="eval", unit="window")
    for i in range(0, len(jobs), batch_size):
        x = torch.zeros(len(jobs[i:i + batch_size]), window, dtype=torch.long)
        y = torch.full_like(x, -1)  # -1: padding and already-scored targets, ignored
        for row, (s, (start, end, first)) in enumerate(jobs[i:i + batch_size]):
            x[row, :end - start] = torch.from_numpy(s[start:end])
            y[row, first - start - 1:end - start] = torch.from_numpy(s[first:end + 1])
        logits = model(x.to(dev))[0].float()
        y = y.to(dev)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1,
                               reduction="sum")
        nats += loss.double().item()
        count += int((y >= 0).sum())
        bar.update(x.size(0))
    bar.close()
    return nats, count


def read_inputs(paths, field_spec):
    """The documents of the input files or folders, by prepare's own rule, and the bytes they
    are measured against: (texts, bytes, a short description of the input)."""
    sources = file_sources(find_files(paths))
    if not sources:
        raise UserError(f"no files found in {','.join(paths)}")
    texts = [text for _, text in whole_documents(sources, text_fields(field_spec))]
    # The bytes of the scored text only: not the separators, nor the JSON or parquet around
    # a record (see the docstring at the top).
    nbytes = sum(len(text.encode("utf-8")) for text in texts)
    names = [name for name, _, _ in sources]
    return texts, nbytes, ", ".join(names) if len(names) <= 3 else f"{len(names)} files"


def own_split(ckpt, split_name):
    """The run's own val.bin or train.bin, read through data/dataset.py's checks."""
    try:
        ddir = dataset_dir(ckpt)
    except UserError as e:
        raise UserError(f"{e}; score text files with --input instead") from None
    if not ddir:
        name = (ckpt.get("tokenizer") or {}).get("dataset")
        raise UserError(f"the run's dataset (val.bin, meta.json) is not found; pass --input "
                        f"or prepare dataset '{name}' again")
    ids = np.asarray(open_split(ddir, split_name, load_meta(ddir)))
    return ids, os.path.join(ddir, f"{split_name}.bin")


def parse_config(argv):
    cfg = configure({k: globals()[k] for k in CONFIG_KEYS}, argv)
    if bool(cfg["input"]) == bool(cfg["split"]):
        raise UserError("pass either --input=FILE[,FILE...] (text files or folders) or "
                        "--split=val")
    if cfg["split"] not in ("", "val", "train"):
        raise UserError(f"split must be val or train, got {cfg['split']!r}")
    if cfg["batch_size"] < 1 or cfg["stride"] < 0:
        raise UserError("batch_size must be >= 1 and stride >= 0 (0: half the window)")
    return cfg


def report(result, seconds):
    tokens, nbytes = result["tokens"], result["bytes"]
    print(f"{result['input']}: {tokens:,} tokens, {nbytes:,} bytes ({nbytes / tokens:.2f} "
          f"bytes/token); window {result['block_size']}, stride {result['stride']}; "
          f"{tokens / seconds:,.0f} tok/s")
    print(f"loss {result['nats_per_token']:.4f} nats/token | perplexity "
          f"{result['perplexity']:.2f} | {result['bits_per_byte']:.4f} bits/byte")


@cli
def main(argv):
    cfg = parse_config(argv)
    dev, cfg["dtype"] = pick_device(cfg["device"], cfg["dtype"])
    if cfg["input"]:
        try:
            texts, nbytes, source = read_inputs([p for p in cfg["input"].split(",") if p],
                                                cfg["text_field"])
        except OSError as e:
            raise UserError(f"cannot read {e.filename}: {e.strerror}") from None
    model, sp, ckpt = load_run(cfg["out_dir"], dev, cfg["dtype"], cfg["tokenizer"],
                               cfg["rope_scaling"], cfg["rope_factor"])
    window = model.config.context_window
    stride = cfg["stride"] or max(1, window // 2)
    if stride > window:
        raise UserError(f"stride {stride} is larger than the window {window}: tokens would be "
                        f"skipped")
    eos = sp.eos_id()
    if eos < 0:
        raise UserError("the tokenizer has no end-of-document piece (eos_id) to start a text from")
    if not cfg["json"]:
        print(describe(cfg["out_dir"], ckpt, model), file=sys.stderr)

    # every sequence starts with the end-of-document token: context only, never scored
    if cfg["split"]:
        ids, source = own_split(ckpt, cfg["split"])
        seqs = [np.concatenate(([eos], ids)).astype(np.int64)]
        nbytes = len(sp.decode(ids.tolist()).encode("utf-8"))
    else:
        seqs = [np.array([eos] + sp.encode(t), dtype=np.int64) for t in texts]
    if sum(len(s) - 1 for s in seqs) == 0:
        raise UserError("the input is empty: no tokens to score")

    t0 = time.perf_counter()
    nats, count = score(model, seqs, stride, cfg["batch_size"])
    result = {"out_dir": cfg["out_dir"], "input": source, "tokens": count, "bytes": nbytes,
              "nats_per_token": nats / count, "perplexity": math.exp(nats / count),
              "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan"),
              "block_size": window, "stride": stride, "iter_num": ckpt.get("iter_num"),
              "dtype": cfg["dtype"]}
    if cfg["json"]:
        print(jsonlib.dumps(result))
    else:
        report(result, time.perf_counter() - t0)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
