"""The entry of every data/<name>/prepare.py: prepare() runs the stages on a corpus ->
train.bin / val.bin / tokenizer.model / meta.json, and the command-line options the scripts
share. The stages, one module each, import only downward (shared.py below them all):

    sources.py -> documents.py -> tokenizer.py -> workers.py -> split.py -> write.py

Everything streams. The corpus is read twice, a scan (validate, hash, count, draw the
tokenizer's sample) and the encoding into one token file, which the split then reads once
more; outputs are renamed into place at the end, meta.json last. Detail: docs/DATA.md.
"""
import collections
import hashlib
import os
import sys
import time
import zipfile

import numpy as np

from data import workers
from data.documents import FIELD_HINT, tasks, text_fields
from data.shared import BOS_ID, EOS_ID, UNK_ID, dtype_for_vocab
from data.split import split_tokens
from data.tokenizer import (ROUND_TRIP_PROBES, TokenizerSample, check_round_trip,
                            load_tokenizer, train_tokenizer)
from data.write import (check_own_folder, commit, make_out_dir, remove_partial, tmp_names,
                        write_meta, write_tokenizer)
from harness import progress_waits
from harness.common import REPO, UserError, cli, error_line
from harness.flags import check_seed

DATA_DIR = os.path.join(REPO, "data")  # train.py's --dataset=NAME reads data/NAME


def given_tokenizer(path):
    """--tokenizer=RUN_OR_MODEL, checked before any work: (model bytes, processor, meta.json's
    description) of a sentencepiece model, or of the one a run (out_dir or checkpoint) read."""
    if not os.path.exists(path):
        raise UserError(f"--tokenizer {path} does not exist")
    if os.path.isdir(path) or zipfile.is_zipfile(path):  # a run: ckpt.pt is a zip archive
        from harness.load import read  # torch and the model: only a run needs them
        from harness.load import find_tokenizer
        ckpt = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
        info = read(ckpt, mmap=True).get("tokenizer")  # one line if not a checkpoint
        try:  # the run folder's copy, else where an older run had it, by sha256
            path = find_tokenizer(os.path.dirname(ckpt), info)
        except UserError as e:  # moved, another tokenizer, or a dataset without one
            raise UserError(f"--tokenizer {path}: {e}") from None
    with open(path, "rb") as f:
        model_bytes = f.read()
    try:  # (empty bytes would load as an uninitialised model that logs errors on every call)
        sp = load_tokenizer(model_bytes) if model_bytes else None
    except RuntimeError:
        sp = None
    ids = (sp.unk_id(), sp.bos_id(), sp.eos_id()) if sp else None
    if ids != (UNK_ID, BOS_ID, EOS_ID) or sp.piece_to_id("\n") == UNK_ID:  # what prepare needs
        raise UserError(f"--tokenizer {path} gives no tokenizer prepare can use: a run, or a "
                        f"sentencepiece model with unk, bos, eos = 0, 1, 2 and a newline piece")
    # whitespace any corpus has, now, before the scan; the corpus's own text once it is read
    check_round_trip(sp, ROUND_TRIP_PROBES, path, "spaces and newlines")
    return model_bytes, sp, dict(copied_from=os.path.abspath(path), vocab_size=sp.get_piece_size(),
                                 sha256=hashlib.sha256(model_bytes).hexdigest())


def check_options(model_type, vocab_size, val_fraction, val_tokens, min_val_tokens, num_proc,
                  sample_bytes, seed):
    if model_type not in ("bpe", "unigram", "char"):
        raise UserError(f"model_type must be bpe, unigram or char, not {model_type!r}")
    check_seed(seed)
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), not {val_fraction}")
    if vocab_size == 0 and model_type != "char":  # sentencepiece's own error is INTERNAL
        raise UserError("vocab_size must be at least 261 (0, sized by the characters seen, "
                        "is for --model_type char only)")
    if vocab_size and vocab_size < 261:
        raise UserError(f"vocab_size {vocab_size} is too small: it must be at least 261, as "
                        f"byte fallback alone takes 260 ids (256 bytes, unk, bos, eos, newline)")
    for name, value in (("val_tokens", val_tokens), ("min_val_tokens", min_val_tokens),
                        ("num_proc", num_proc), ("sample_bytes", sample_bytes)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")


def scan_corpus(sources, settings, sample_bytes, num_proc, raw_total):
    """Pass 1: validate every record, count, hash the inputs, draw the tokenizer sample."""
    # per source: documents, bytes, skipped records, records without any of the text fields
    per_source = collections.defaultdict(lambda: np.zeros(4, dtype=np.int64))
    skipped, hashes, marker = [], [], None
    sample = TokenizerSample(sample_bytes)
    bar = progress_waits.bar(total=raw_total, desc="scanning", unit="B", unit_scale=True)
    found = tasks(sources, settings["text_fields"], settings["undecodable"], (), skipped,
                  hashes, bar)
    jobs = ((task, sample.cutoff()) for task in found)  # the cutoff when the job is sent
    for r in workers.ordered_map(workers.scan, jobs, num_proc, settings):
        if r["error"]:
            raise UserError(r["error"])
        per_source[r["source"]] += (r["docs"], r["bytes"], r["skipped"], r["no_field"])
        marker = marker or r["marker"]
        for key, si, text in r["sample"]:
            sample.offer(key, si, text)
    bar.close()
    for si, (docs, _, _, no_field) in per_source.items():
        if no_field and not docs and si not in skipped:  # --undecodable=skip cannot fix that
            raise UserError(f"{sources[si][2]}: none of its records has the field "
                            f"{' or '.join(map(repr, settings['text_fields']))}; {FIELD_HINT}")
    kept = [per_source[si] for si in per_source if si not in skipped]
    docs, total_bytes, skipped_records, _ = (int(x) for x in sum(kept, np.zeros(4, np.int64)))
    sha = hashlib.sha256("".join(f"{n}\0{digest}\n" for n, digest in hashes).encode("utf-8"))
    return dict(docs=docs, bytes=total_bytes, skipped_records=skipped_records, skipped=skipped,
                skipped_names=[sources[si][0] for si in skipped], marker=marker,
                sha256=sha.hexdigest(), sample=sample)


def report_scan(corpus, name, source, text_field, seconds, log):
    for n in corpus["skipped_names"]:
        log(f"warning: skipping {n}: not valid UTF-8")
    if corpus["skipped_records"]:
        log(f"warning: skipped {corpus['skipped_records']} records without a string "
            f"{text_field!r} (not JSON, not an object, the field missing or not a string)")
    if not corpus["docs"]:
        raise UserError(f"empty corpus: no text found in {source}")
    if corpus["marker"]:  # sentencepiece's own space: the one input that does not round-trip
        log(f"warning: some documents contain U+2581 (\u2581), which decodes as a space, e.g. "
            f"{corpus['marker']}")
    skipped = len(corpus["skipped"])
    log(f"{name}: {corpus['docs']} documents, {corpus['bytes'] / 1e6:.1f} MB"
        + (f" ({skipped} undecodable files skipped)" if skipped else "")
        + f"; scanned in {seconds:.1f}s")


def encode_corpus(path, sources, settings, skipped, num_proc, raw_total):
    """Pass 2: every document into the token file `path`: (tokens, docs, bytes, processes)."""
    total, docs, nbytes, pids = 0, 0, 0, set()
    bar = progress_waits.bar(total=raw_total, desc="encoding", unit="B", unit_scale=True)
    jobs = tasks(sources, settings["text_fields"], settings["undecodable"], set(skipped), [],
                 None, bar)
    with open(path, "wb") as f:
        for r in workers.ordered_map(workers.encode, jobs, num_proc, settings):
            if r["error"]:
                raise UserError(r["error"])
            f.write(r["tokens"].data)  # not ndarray.tofile: it ignores a failed write
            total += len(r["tokens"])
            docs += r["docs"]
            nbytes += r["bytes"]
            pids.add(r["pid"])
    bar.close()
    return total, docs, nbytes, len(pids)


def split_budget(total, val_fraction, val_tokens, min_val_tokens):
    """The exact number of validation tokens, checked to leave training its minimum."""
    budget = val_tokens if val_tokens is not None else max(round(val_fraction * total),
                                                          min_val_tokens)
    if total - budget < min_val_tokens:
        rule = ("val_tokens" if val_tokens is not None else
                f"val_fraction={val_fraction}, at least min_val_tokens={min_val_tokens}")
        raise UserError(
            f"corpus too small: {total} tokens in all, the validation split takes {budget} "
            f"({rule}) and training needs at least min_val_tokens={min_val_tokens}; add text "
            f"or lower min_val_tokens")
    return budget


def build_tokenizer(corpus, options, log):
    """The tokenizer trained on the sample, or --tokenizer's: (bytes, processor, its meta)."""
    if options["given"]:  # --tokenizer: that one, as it is, if it encodes this corpus exactly
        model_bytes, sp, settings = options["given"]
        check_round_trip(sp, corpus.pop("sample").texts(corpus["skipped"]),
                         settings["copied_from"])
        return options["given"]
    vocab_size, model_type = options["vocab_size"], options["model_type"]
    lines = corpus.pop("sample").lines(corpus["skipped"])
    sample_size = sum(len(line.encode("utf-8")) for line in lines)
    log(f"training {model_type} tokenizer (vocab {vocab_size or 'auto'}) on a "
        f"{sample_size / 1e6:.1f} MB sample of {len(lines)} lines ...")
    model_bytes, settings = train_tokenizer(lines, vocab_size, model_type)
    sp = load_tokenizer(model_bytes)
    settings.update(vocab_size=sp.get_piece_size(),
                    sha256=hashlib.sha256(model_bytes).hexdigest(), sample_bytes=sample_size,
                    sample_seed=options["seed"])
    return model_bytes, sp, settings


def dataset_meta(sources, corpus, sp, tok_settings, split, options):
    """meta.json: what train/eval/export read (vocab, dtype, ids, token counts) and how the
    dataset was made (source, hash, split rule, tokenizer settings)."""
    vocab_size = sp.get_piece_size()
    return {
        "name": options["name"], "vocab_size": vocab_size, "dtype": dtype_for_vocab(vocab_size),
        "eos_id": EOS_ID, "bos_id": BOS_ID, "unk_id": UNK_ID, "newline_id": sp.piece_to_id("\n"),
        "train_tokens": split["train_tokens"], "val_tokens": split["val_tokens"],
        "documents": corpus["docs"], "train_docs": split["train_docs"],
        "val_docs": split["val_docs"], "cut_documents": split["cut"],
        "source": options["source"], "source_files": len(sources) - len(corpus["skipped"]),
        "source_bytes": corpus["bytes"], "source_sha256": corpus["sha256"],
        "source_hash_of": "sha256 over 'name NUL sha256(file bytes) LF' of each input in "
                          "order (for documents held in memory: of each text + NUL)",
        "split": {
            "rule": "seeded document picks along the corpus with an exact token budget, "
                    "a document cut after a newline when large (data/split.py split_tokens)",
            "seed": options["seed"],
            "val_fraction": None if options["val_tokens"] is not None else options["val_fraction"],
            "val_tokens": options["val_tokens"], "min_val_tokens": options["min_val_tokens"],
            "budget": split["budget"], "tokens_before_split": split["total"],
        },
        "text_field": options["text_field"],
        "skipped_undecodable": corpus["skipped_names"],
        "skipped_records": corpus["skipped_records"],
        "tokenizer": tok_settings,
    }


def build_dataset(tmps, sources, corpus, settings, options, num_proc, raw_total, log):
    """Tokenizer, pass 2 and the split into the temp files: (meta.json's dict, log figures)."""
    t0 = time.time()
    model_bytes, sp, tok_settings = build_tokenizer(corpus, options, log)
    dtype = np.dtype(dtype_for_vocab(sp.get_piece_size()))
    log(f"tokenizer {'loaded' if options['given'] else 'trained'} in {time.time() - t0:.1f}s, "
        f"{sp.get_piece_size()} pieces")

    t0, cpu0 = time.time(), workers.cpu_seconds()
    settings = dict(settings, model=model_bytes, dtype=dtype)
    total, docs, nbytes, procs = encode_corpus(tmps["train.bin"], sources, settings,
                                               corpus["skipped"], num_proc, raw_total)
    figures = dict(encode_s=time.time() - t0, encode_cpu=workers.cpu_seconds() - cpu0,
                   procs=procs, tokens=total)
    if (docs, nbytes) != (corpus["docs"], corpus["bytes"]):
        raise UserError(f"the corpus changed while it was being prepared ({corpus['docs']} "
                        f"documents, {corpus['bytes']} bytes when scanned; {docs}, "
                        f"{nbytes} when encoded)")

    t0 = time.time()
    budget = split_budget(total, options["val_fraction"], options["val_tokens"],
                          options["min_val_tokens"])
    bar = progress_waits.bar(total=total * dtype.itemsize, desc="splitting", unit="B",
                   unit_scale=True)
    counts = split_tokens(tmps["train.bin"], tmps["val.bin"], dtype, total, budget,
                          options["seed"], sp.piece_to_id("\n"), bar)
    bar.close()
    split = dict(zip(("train_tokens", "val_tokens", "train_docs", "val_docs", "cut"), counts),
                 budget=budget, total=total)
    figures["split_s"] = time.time() - t0
    write_tokenizer(tmps, model_bytes, sp)
    return dataset_meta(sources, corpus, sp, tok_settings, split, options), figures


def os_error_message(e, out_dir):
    """One line for an OSError: a source unreadable, or an output unwritable (a full disk)."""
    if e.filename and not os.path.abspath(e.filename).startswith(os.path.abspath(out_dir)):
        return f"cannot read {e.filename}: {e.strerror or e}"
    return (f"cannot write the dataset to {out_dir}: {e.strerror or e}; nothing was written "
            f"(a dataset already there is unchanged)")


def prepare(out_dir, name, sources, source, vocab_size=4096, model_type="bpe",
            val_fraction=0.05, val_tokens=None, min_val_tokens=1025, sample_bytes=4_000_000,
            seed=1337, num_proc=None, text_field="text", undecodable="fail",
            tokenizer=None, extra_meta=None, log=print):
    """Build the dataset folder out_dir from sources [(name, kind, path)] (sources.file_sources;
    kind "docs": a function returning texts instead of a path); tokenizer: a run or a .model to
    encode with. Returns the meta written."""
    t_start = time.time()
    # None is every core; 0 is a mistake, not a second way to say that
    num_proc = workers.default_num_proc() if num_proc is None else num_proc
    check_options(model_type, vocab_size, val_fraction, val_tokens, min_val_tokens, num_proc,
                  sample_bytes, seed)
    check_own_folder(out_dir)
    options = dict(name=name, source=source, vocab_size=vocab_size, model_type=model_type,
                   val_fraction=val_fraction, val_tokens=val_tokens, seed=seed,
                   min_val_tokens=min_val_tokens, sample_bytes=sample_bytes,
                   text_field=text_field, given=tokenizer and given_tokenizer(tokenizer))
    settings = {"text_fields": text_fields(text_field), "undecodable": undecodable, "seed": seed}
    raw_total = sum(os.path.getsize(w) for _, k, w in sources if k != "docs") or None
    tmps, created = tmp_names(out_dir), False
    try:
        t0 = time.time()
        corpus = scan_corpus(sources, settings, sample_bytes, num_proc, raw_total)
        report_scan(corpus, name, source, text_field, time.time() - t0, log)
        created = make_out_dir(out_dir)  # fail on an unwritable folder before any long work
        meta, figures = build_dataset(tmps, sources, corpus, settings, options, num_proc,
                                      raw_total, log)
        meta.update(extra_meta or {})
        write_meta(tmps, meta)
        commit(tmps, out_dir)
    except BaseException as e:
        remove_partial(tmps, out_dir, created)
        if isinstance(e, OSError):
            raise UserError(os_error_message(e, out_dir)) from None
        raise
    total = max(figures["tokens"], 1)
    log(f"wrote {out_dir}: train {meta['train_tokens']:,} tokens ({meta['train_docs']} pieces), "
        f"val {meta['val_tokens']:,} tokens ({meta['val_docs']} pieces, "
        f"{meta['cut_documents']} documents cut), {meta['source_bytes'] / total:.2f} "
        f"bytes/token; encoding {meta['source_bytes'] / 1e6 / max(figures['encode_s'], 1e-9):.2f} "
        f"MB/s with {figures['procs']} worker process{'es' if figures['procs'] != 1 else ''} "
        f"({figures['encode_cpu']:.1f} CPU s); split {figures['split_s']:.1f}s; "
        f"{time.time() - t_start:.1f}s in all")
    return meta


# ----------------------------------------------------------------------------- command line

def resolve_out_dir(out_dir):
    """--out_dir NAME (no slash) is data/NAME, wherever prepare runs from; a path is as given."""
    if not out_dir:  # '' would be data/ itself: the package's code beside the dataset
        raise UserError("--out_dir is empty: pass a dataset name or a folder")
    if os.path.isabs(out_dir) or "/" in out_dir or os.sep in out_dir or out_dir in (".", ".."):
        return os.path.abspath(out_dir)
    return os.path.join(DATA_DIR, out_dir)


OUT_DIR_HELP = ("a NAME (no slash) writes data/NAME next to train.py, which train.py "
                "--dataset=NAME reads, wherever this runs from; a path (absolute, or with a "
                "slash, e.g. ./corpus or /big/disk/corpus) is taken as given: train on it "
                "with train.py --data_dir=PATH")


def add_arguments(p, vocab_size=4096, val_fraction=0.05):
    """The options every prepare script shares (prepare_options makes prepare's keywords), and
    a bad argument as the one line every other mistake is, not argparse's usage block."""
    p.error = lambda message: sys.exit(error_line(f"{message} (--help lists the options)"))
    p.add_argument("--vocab_size", type=int, default=None,
                   help=f"default {vocab_size or 4096}; a char model without it takes every "
                        f"character of the sample + 256 bytes")
    p.set_defaults(default_vocab_size=vocab_size)  # None above: given, or not (--tokenizer)
    p.add_argument("--val_fraction", type=float, default=val_fraction,
                   help="fraction of the tokens the validation split takes (exactly, rounded)")
    p.add_argument("--val_tokens", type=int, default=None, metavar="N",
                   help="exactly N validation tokens instead of a fraction (for huge corpora)")
    p.add_argument("--min_val_tokens", type=int, default=1025,
                   help="validation and training each hold at least this many tokens "
                        "(one block + 1)")
    p.add_argument("--sample_bytes", type=int, default=4_000_000,
                   help="size of the seeded sample the tokenizer is trained on")
    p.add_argument("--seed", type=int, default=1337,
                   help="the tokenizer sample and the split (0 to 2**64 - 1)")
    p.add_argument("--num_proc", type=int, default=None, metavar="N",
                   help="worker processes (default: every core); the output is the same for any N")
    p.add_argument("--tokenizer", default=None, metavar="RUN_OR_MODEL",
                   help="encode with this tokenizer.model, or a run's (out_dir or checkpoint), "
                        "instead of training one: the dataset fits that run")


def prepare_options(args):
    trains = [f"--{k}" for k in ("vocab_size", "model_type", "char")
              if getattr(args, k, None) not in (None, False)]
    if args.tokenizer and trains:
        raise UserError(f"--tokenizer takes a tokenizer that exists; {' and '.join(trains)} "
                        f"would train one: pass one or the other")
    shared = ("val_fraction", "val_tokens", "min_val_tokens", "sample_bytes", "seed", "num_proc")
    return dict({k: getattr(args, k) for k in shared}, tokenizer=args.tokenizer,
                vocab_size=args.default_vocab_size if args.vocab_size is None else args.vocab_size,
                model_type=getattr(args, "model_type", None) or "bpe")


def run(main_fn, argv):
    """Call a prepare script's body: a user mistake is one line and exit code 1."""
    return cli(main_fn, interrupted="error: interrupted; no output was written")(argv)
