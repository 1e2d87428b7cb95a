"""
Measure a trained run on text: loss in nats per token, perplexity, and bits per byte.

    python eval.py --out_dir=out-small --input=notes.txt             # or docs/,README.md --json
    python eval.py --out_dir=out-small --split=val
    python eval.py --out_dir=out-small --input=long.txt --lengths=256,1024,4096 --window_mode=local
    python eval.py --out_dir=out-small --passkey --lengths=256,1024 --depths=0,0.5,1 [--keys=4]

Nats per token depend on the tokenizer, so runs with different vocabularies, or other models,
compare only in bits per byte: total_nats / ln 2 / the UTF-8 bytes of the documents scored
(whitespace between them adds neither tokens nor bytes, so padding cannot move it; see
docs/RESULTS.md). The inputs become documents by prepare's rule (data/documents.py, the same
code), each read after the end-of-document token, every token scored once by windows every
`stride` tokens (each row of --lengths=L: windows of L, stride L/2). What each flag does:
README.md's "Evaluation in bits per byte".
"""
import json as jsonlib
import math
import os
import random
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from harness.dataset import load_meta, open_split
from data.documents import text_fields, whole_documents
from data.sources import file_sources, find_files
from harness import progress_waits
from harness.common import UserError, cli
from harness.device import device_memory, pick_device
from harness.flags import configure
from harness.load import dataset_dir, describe, load_run
from harness.run_tokenizer import folder_read
from model_checks import positions_error

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
length_temperature = -1.0  # -1 keeps the checkpoint's; t >= 0: queries past the context x 1 + t ln
json = False            # print one JSON line instead of the table
lengths = ""            # L1,L2,...: a row per window length ("": the model's window)
window_mode = "full"    # local: each token sees only its last context_window tokens (a band)
passkey = False         # passkey retrieval accuracy per length and depth instead of text
depths = "0,0.25,0.5,0.75,1"  # --passkey: where the key sits, as a fraction of the filler
samples = 10            # --passkey: prompts per (length, depth) cell
seed = 1337             # --passkey: draws the keys and where the filler starts
keys = 1                # --passkey: labelled keys in each prompt, the question names one
# -----------------------------------------------------------------------------------------
CONFIG_KEYS = ("out_dir", "input", "split", "text_field", "stride", "batch_size", "device",
               "dtype", "tokenizer", "rope_scaling", "rope_factor", "length_temperature",
               "json", "lengths", "window_mode", "passkey", "depths", "samples", "seed", "keys")
ANSWER = 7  # tokens --passkey decodes: " 12345" takes 6 at most, 1 more shows no digit follows


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
def score(model, seqs, stride, batch_size, window=None, band=None):
    """Sum of -log p(token | its window) over every target token of every sequence, in float64,
    and the number of tokens scored. seqs: 1-d int64 arrays whose first token is context. The
    window defaults to the model's context_window (original context * rope_factor, at least
    block_size): a full forward grows the rotation tables on demand. band: each token sees only
    its last `band` tokens (None: the whole window)."""
    window, c = window or model.config.context_window, model.config
    dev = next(model.parameters()).device
    jobs = [(s, w) for s in seqs for w in windows(len(s), window, stride)]
    nats, count = 0.0, 0
    bar = progress_waits.bar(total=len(jobs), desc="eval", unit="window")
    for i in range(0, len(jobs), batch_size):
        x = torch.zeros(len(jobs[i:i + batch_size]), window, dtype=torch.long)
        y = torch.full_like(x, -1)  # -1: padding and already-scored targets, ignored
        for row, (s, (start, end, first)) in enumerate(jobs[i:i + batch_size]):
            x[row, :end - start] = torch.from_numpy(s[start:end])
            y[row, first - start - 1:end - start] = torch.from_numpy(s[first:end + 1])
        # a cache as long as the window, filled by this one forward: only for its band mask
        cache = model.new_cache(window, dev, band) if band else None
        logits = model(x.to(dev), cache=cache)[0].float()
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
    """The run's own val.bin or train.bin, read through harness/dataset.py's checks."""
    try:
        ddir = dataset_dir(ckpt)
    except UserError as e:
        raise UserError(f"{e}; score text files with --input instead") from None
    if not ddir:  # an older run
        raise UserError(f"the run's dataset (val.bin, meta.json) is not found; pass --input or "
                        f"prepare the run's dataset {folder_read(ckpt.get('tokenizer') or {})} "
                        f"again")
    ids = np.asarray(open_split(ddir, split_name, load_meta(ddir)))
    return ids, os.path.join(ddir, f"{split_name}.bin")


def parse_config(argv):
    cfg = configure({k: globals()[k] for k in CONFIG_KEYS}, argv, sources=(__file__,))
    if bool(cfg["input"]) + bool(cfg["split"]) + cfg["passkey"] != 1:
        raise UserError("pass either --input=FILE[,FILE...] (text files or folders), "
                        "--split=val or --passkey")
    if cfg["split"] not in ("", "val", "train"):
        raise UserError(f"split must be val or train, got {cfg['split']!r}")
    if cfg["batch_size"] < 1 or cfg["stride"] < 0 or cfg["samples"] < 1:
        raise UserError("batch_size, samples must be >= 1 and stride >= 0 (0: half the window)")
    if cfg["keys"] != 1 and not cfg["passkey"]:
        raise UserError("--keys sets the keys of a --passkey prompt; pass --passkey too")
    if cfg["passkey"]:
        from data.passkey.prepare import check_keys
        check_keys(cfg["keys"])
    if cfg["window_mode"] not in ("full", "local"):
        raise UserError(f"window_mode must be full or local, got {cfg['window_mode']!r}")
    try:
        cfg["lengths"] = [int(n) for n in cfg["lengths"].split(",")] if cfg["lengths"] else []
        cfg["depths"] = [float(d) for d in cfg["depths"].split(",")]
    except ValueError as e:
        raise UserError(f"lengths takes integers, depths numbers (comma-separated): {e}") from None
    if min(cfg["lengths"] or [2]) < 2 or not all(0 <= d <= 1 for d in cfg["depths"]):
        raise UserError(f"lengths must be >= 2 and depths between 0 and 1, got "
                        f"{cfg['lengths']} and {cfg['depths']}")
    return cfg


def check_lengths(model, cfg, lengths):
    """The band each token sees (None: full attention), once the lengths fit stride and model."""
    c = model.config
    if cfg["stride"] > min(lengths):
        raise UserError(f"stride {cfg['stride']} is larger than the window {min(lengths)}: "
                        f"tokens would be skipped")
    if why := positions_error(c, max(lengths) + cfg["passkey"] * ANSWER):
        raise UserError(f"{why}: no length past it")
    if cfg["window_mode"] == "local" and c.attention == "linear":
        raise UserError("window_mode=local bands softmax attention; linear attention keeps "
                        "its whole history in a recurrent state")
    return c.context_window if cfg["window_mode"] == "local" else None


@torch.no_grad()
def greedy(model, ids, band, vocab):
    """The ANSWER argmax tokens (ids < vocab) after the prompt ids, each seeing its last `band`
    tokens (the model's rolling cache) or, with band None, all of them (a cache that holds all)."""
    c, dev, total = model.config, next(model.parameters()).device, len(ids) + ANSWER
    full = c.attention == "softmax" and not band
    cache = model.new_cache(total, dev, total if full else None)
    x, pos, out = torch.tensor([ids], device=dev), 0, []
    for _ in range(ANSWER):
        logits = model(x, cache=cache, start_pos=pos)[0]
        pos, x = pos + x.size(1), logits[:, -1:, :vocab].argmax(-1)
        out.append(x.item())
    return out


def check_prompt_memory(model, lengths):
    """Refuse, before any prompt is built, a --passkey length whose prompt cannot be run here:
    one forward takes its logits (length x vocab) and, with softmax attention, a mask and
    scores over length x length (the cache's prefill; a band cuts what is seen, not that)."""
    c, memory = model.config, device_memory(next(model.parameters()).device)
    n = max(lengths) + ANSWER
    keys = n if c.attention == "softmax" else 0
    need = 4 * n * (c.vocab_size + 8 * c.n_embd) + n * keys * (9 + 4 * c.n_head)
    if memory is not None and need > memory:
        raise UserError(f"--passkey length {max(lengths)} needs about {need / 1e9:,.0f} GB for "
                        f"one prompt's forward (logits, and attention over every pair of its "
                        f"tokens), more than the {memory / 1e9:,.0f} GB here; pass shorter "
                        f"--lengths")


def check_passkey_tokenizer(sp, keys):
    """The question (and with keys > 1 every label's) must round-trip with no unknown piece."""
    from data.passkey.prepare import LABELLED_QUESTION, LABELS, QUESTION
    probes = [f"{QUESTION} 0123456789"]
    probes += [f"{LABELLED_QUESTION.format(label)} 0" for label in LABELS] if keys > 1 else []
    for probe in probes:
        if sp.unk_id() in sp.encode(probe) or sp.decode(sp.encode(probe)) != probe:
            raise UserError(f"--passkey{f' --keys={keys}' if keys > 1 else ''} needs a "
                            f"tokenizer that encodes {probe!r}; this one does not")


def passkey_draws(seed, samples, keys, n_words):
    """(key, filler start, asked label, other keys) per sample: one key draws as it always did,
    more draw their labels, keys and places after it."""
    from data.passkey.prepare import draw_labelled
    rng, draws = random.Random(seed), []
    for _ in range(samples):
        key, start = rng.randint(10000, 99999), rng.randrange(n_words)
        more = draw_labelled(rng, keys, key) if keys > 1 else (None, ())
        draws.append((key, start, *more))
    return draws


def passkey_grid(model, sp, cfg, lengths, band):
    """Accuracy per length (rows) and depth (columns), or a JSON line per cell."""
    from data.passkey.prepare import filler_words, prompt_ids
    check_prompt_memory(model, lengths)
    keys = cfg.get("keys", 1)
    check_passkey_tokenizer(sp, keys)
    words, cells, depths = filler_words(), [], cfg["depths"]
    # every cell asks the same keys with the same filler: only length and depth differ
    draws = passkey_draws(cfg["seed"], cfg["samples"], keys, len(words))
    for key, start, label, others in draws:  # too short: fail first
        prompt_ids(sp, words, start, min(lengths), 0, key, label, others)
    if not cfg["json"]:
        print(f"passkey accuracy, keys={keys}, {len(draws)} prompts a cell, window_mode "
              f"{cfg['window_mode']}\n{'length':>8}" + "".join(f"{d:>7g}" for d in depths))
    for length in lengths:
        for depth in depths:
            hits = 0
            for key, start, label, others in draws:
                ids = prompt_ids(sp, words, start, length, depth, key, label, others)
                answer = sp.decode(greedy(model, ids, band, sp.get_piece_size()))
                hits += re.match(r"\s*(\d*)", answer).group(1) == str(key)
            cells.append(dict(length=length, depth=depth, samples=len(draws), correct=hits,
                              accuracy=hits / len(draws), window_mode=cfg["window_mode"],
                              keys=keys))
            if cfg["json"]:
                print(jsonlib.dumps(cells[-1]))
        if not cfg["json"]:
            print(f"{length:>8}" + "".join(f"{c['accuracy']:>7.2f}" for c in cells[-len(depths):]))
    return cells


def report(r, seconds):  # a row per window length
    shorter = (f" (past every text: the longest is {r['window_used']} tokens, each scored once)"
               if r["window_used"] < r["block_size"] else "")
    print(f"window {r['block_size']}{shorter}, stride {r['stride']}: "
          f"loss {r['nats_per_token']:.4f} "
          f"nats/token | perplexity {r['perplexity']:.2f} | {r['bits_per_byte']:.4f} bits/byte"
          f" | {r['tokens'] / seconds:,.0f} tok/s")


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
    model, sp, ckpt = load_run(cfg["out_dir"], dev, cfg["dtype"], cfg["tokenizer"], *(
        cfg[k] for k in ("rope_scaling", "rope_factor", "length_temperature")))  # overrides
    lengths = cfg["lengths"] or [model.config.context_window]
    band = check_lengths(model, cfg, lengths)
    eos = sp.eos_id()
    if eos < 0:
        raise UserError("the tokenizer has no end-of-document piece (eos_id) to start a text from")
    if not cfg["json"]:
        print(describe(cfg["out_dir"], ckpt, model), file=sys.stderr)
    if cfg["passkey"]:
        return passkey_grid(model, sp, cfg, lengths, band)

    # every sequence starts with the end-of-document token: context only, never scored
    if cfg["split"]:
        ids, source = own_split(ckpt, cfg["split"])
        seqs = [np.concatenate(([eos], ids)).astype(np.int64)]
        nbytes = len(sp.decode(ids.tolist()).encode("utf-8"))
    else:
        seqs = [np.array([eos] + sp.encode(t), dtype=np.int64) for t in texts]
    tokens, results = sum(len(s) - 1 for s in seqs), []
    if tokens == 0:
        raise UserError("the input is empty: no tokens to score")
    if not cfg["json"]:
        print(f"{source}: {tokens:,} tokens, {nbytes:,} bytes ({nbytes / tokens:.2f} bytes/"
              f"token), window_mode {cfg['window_mode']}")
    longest = max(len(s) for s in seqs) - 1  # a window this long scores each text once
    for length in lengths:
        used = min(length, longest)  # longer costs the same: only padding would be added
        stride, t0 = cfg["stride"] or max(1, used // 2), time.perf_counter()
        nats, count = score(model, seqs, stride, cfg["batch_size"], used, band)
        results.append({
            "out_dir": cfg["out_dir"], "input": source, "tokens": count, "bytes": nbytes,
            "nats_per_token": nats / count, "perplexity": math.exp(nats / count),
            "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan"),
            "block_size": length, "window_used": used, "stride": stride, "dtype": cfg["dtype"],
            "window_mode": cfg["window_mode"], "iter_num": ckpt.get("iter_num")})
        if cfg["json"]:
            print(jsonlib.dumps(results[-1]))
        else:
            report(results[-1], time.perf_counter() - t0)
    return results if cfg["lengths"] else results[0]


if __name__ == "__main__":
    main(sys.argv[1:])
