"""
Measure a trained run on text: loss in nats per token, perplexity, and bits per byte.

    python eval.py --out_dir=out-small --input=notes.txt
    python eval.py --out_dir=out-small --input=docs/,README.md --json
    python eval.py --out_dir=out-small --split=val

Nats per token depend on the tokenizer (a bigger vocab puts more text in each token), so runs
with different vocabularies, or other models, compare only in bits per byte: the total loss in
bits over the UTF-8 bytes of the text, total_nats / ln 2 / bytes.

Each input file is one document: it is read after the end-of-document token (the context every
training document starts from) and every one of its tokens is scored once. Text longer than
block_size is scored with a sliding window: windows of block_size tokens start every `stride`
tokens; the first scores all its tokens, each later one only the tokens past the previous
window, so each of those has at least block_size - stride tokens of context. --split=val
scores the run's own val.bin (its end-of-document tokens included: loss but no bytes).
"""
import json as jsonlib
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from checkpoint import dataset_dir, describe, load_run, pick_device
from configurator import ConfigError, configure
from data.common import PrepareError, find_files, tqdm

# -----------------------------------------------------------------------------------------
out_dir = "out"
input = ""              # text files or folders, comma-separated
split = ""              # "val" or "train": the run's own tokens instead of --input
stride = 0              # 0: block_size // 2
batch_size = 8          # windows per forward
device = "auto"         # auto: cuda if available, else cpu
dtype = "auto"          # auto: bfloat16 on a CUDA GPU that supports it (else float16), float32 on CPU
tokenizer = ""          # "" uses the path recorded in the checkpoint; either way its sha256 must match
json = False            # print one JSON line instead of the table
# -----------------------------------------------------------------------------------------


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
    and the number of tokens scored. seqs: 1-d int64 arrays whose first token is context."""
    block = model.config.block_size
    dev = next(model.parameters()).device
    jobs = [(s, w) for s in seqs for w in windows(len(s), block, stride)]
    nats, count = 0.0, 0
    bar = tqdm(total=len(jobs), desc="eval", unit="window")
    for i in range(0, len(jobs), batch_size):
        x = torch.zeros(len(jobs[i:i + batch_size]), block, dtype=torch.long)
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


def main(argv):
    names = ("out_dir", "input", "split", "stride", "batch_size", "device", "dtype", "tokenizer",
             "json")
    try:
        cfg = configure({k: globals()[k] for k in names}, argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if bool(cfg["input"]) == bool(cfg["split"]):
        sys.exit("error: pass either --input=FILE[,FILE...] (text files or folders) or "
                 "--split=val")
    if cfg["split"] not in ("", "val", "train"):
        sys.exit(f"error: split must be val or train, got {cfg['split']!r}")
    if cfg["batch_size"] < 1 or cfg["stride"] < 0:
        sys.exit("error: batch_size must be >= 1 and stride >= 0 (0: block_size // 2)")
    dev, cfg["dtype"] = pick_device(cfg["device"], cfg["dtype"])
    texts = []
    if cfg["input"]:
        try:
            for name, path in find_files([p for p in cfg["input"].split(",") if p]):
                with open(path, encoding="utf-8") as f:
                    texts.append((name, f.read()))
        except PrepareError as e:
            sys.exit(f"error: {e}")
        except UnicodeDecodeError as e:
            sys.exit(f"error: {path} is not valid UTF-8 (byte {e.object[e.start]:#04x} at "
                     f"offset {e.start})")
        except OSError as e:
            sys.exit(f"error: cannot read {e.filename}: {e.strerror}")
        if not texts:
            sys.exit(f"error: no files found in {cfg['input']}")

    model, sp, ckpt = load_run(cfg["out_dir"], dev, cfg["dtype"], cfg["tokenizer"])
    block = model.config.block_size
    step = cfg["stride"] or max(1, block // 2)
    if step > block:
        sys.exit(f"error: stride {step} is larger than block_size {block}: tokens would be skipped")
    eos = sp.eos_id()
    if eos < 0:
        sys.exit("error: the tokenizer has no end-of-document piece (eos_id) to start a text from")
    if not cfg["json"]:
        print(describe(cfg["out_dir"], ckpt, model), file=sys.stderr)

    # every sequence starts with the end-of-document token: context only, never scored
    if cfg["split"]:
        ddir = dataset_dir(ckpt)
        if not ddir:
            sys.exit(f"error: the run's dataset (val.bin, meta.json) is not found; pass --input "
                     f"or prepare dataset '{(ckpt.get('tokenizer') or {}).get('dataset')}' again")
        with open(os.path.join(ddir, "meta.json")) as f:
            data_dtype = jsonlib.load(f)["dtype"]
        ids = np.fromfile(os.path.join(ddir, f"{cfg['split']}.bin"), dtype=data_dtype)
        seqs = [np.concatenate(([eos], ids)).astype(np.int64)]
        nbytes = len(sp.decode(ids.tolist()).encode("utf-8"))
        source = os.path.join(ddir, f"{cfg['split']}.bin")
    else:
        seqs = [np.array([eos] + sp.encode(t), dtype=np.int64) for _, t in texts]
        nbytes = sum(len(t.encode("utf-8")) for _, t in texts)
        source = ", ".join(n for n, _ in texts) if len(texts) <= 3 else f"{len(texts)} files"
    if sum(len(s) - 1 for s in seqs) == 0:
        sys.exit("error: the input is empty: no tokens to score")

    t0 = time.perf_counter()
    nats, count = score(model, seqs, step, cfg["batch_size"])
    secs = time.perf_counter() - t0
    result = {"out_dir": cfg["out_dir"], "input": source, "tokens": count, "bytes": nbytes,
              "nats_per_token": nats / count, "perplexity": math.exp(nats / count),
              "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan"),
              "block_size": block, "stride": step, "iter_num": ckpt.get("iter_num"),
              "dtype": cfg["dtype"]}
    if cfg["json"]:
        print(jsonlib.dumps(result))
        return result
    print(f"{source}: {count:,} tokens, {nbytes:,} bytes ({nbytes / count:.2f} bytes/token); "
          f"window {block}, stride {step}; {count / secs:,.0f} tok/s")
    print(f"loss {result['nats_per_token']:.4f} nats/token | perplexity "
          f"{result['perplexity']:.2f} | {result['bits_per_byte']:.4f} bits/byte")
    return result


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        sys.exit(130)
