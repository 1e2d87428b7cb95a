"""Shared logic of every data/<name>/prepare.py: text documents -> sentencepiece tokenizer ->
train.bin / val.bin / tokenizer.model / meta.json (the layout is in the README).

A corpus is a list of documents `(name, load)`, where `load()` returns the document's text.
`prepare()` makes four passes over it, each streaming one document at a time:
  1. scan: count bytes, hash the content (meta.json's source_sha256), refuse an empty corpus;
  2. draw the tokenizer's training sample, a seeded Bernoulli sample of lines, so the same
     corpus always gives the same vocabulary (sentencepiece's own sampling is not seeded);
  3. validation split: whole documents in a seeded random order, until the split holds both
     val_fraction of the bytes and at least min_val_tokens tokens (one training block);
  4. training split: every other document, in corpus order, encoded in batches.
Every document is followed by the end-of-document id. Outputs go to hidden temp names and
are renamed at the end, meta.json last: a folder with meta.json in it is complete.
"""
import hashlib
import io
import json
import os
import re
import sys
import time

import numpy as np

# A user mistake raises PrepareError; the prepare scripts turn it into `error: ...` + exit 1.
class PrepareError(Exception):
    pass


OUTPUTS = ("train.bin", "val.bin", "tokenizer.model", "tokenizer.vocab", "meta.json")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
ENCODE_BATCH_BYTES = 4 << 20  # documents handed to the encoder at once (bounds memory)


def tqdm(*args, **kwargs):
    # tqdm is a requirement, but a bar is only decoration: fall back to a plain iterator.
    try:
        from tqdm import tqdm as bar
    except ImportError:
        return args[0] if args else _NoBar()
    kwargs.setdefault("disable", None)  # no bar when stderr is not a terminal (CI logs)
    kwargs.setdefault("dynamic_ncols", True)
    return bar(*args, **kwargs)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def dtype_for_vocab(vocab_size):
    # ids run from 0 to vocab_size - 1; uint16 holds up to 65535.
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# ----------------------------------------------------------------------------- documents

def read_utf8(path, undecodable):
    """The file's text, or None when it is not UTF-8 and undecodable == 'skip'."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if undecodable == "skip":
            return None
        raise PrepareError(f"{path} is not valid UTF-8 (byte {raw[e.start]:#04x} at offset "
                           f"{e.start}); pass --undecodable=skip to leave such files out")


def find_files(paths, extensions=None):
    """Expand files and folders (recursively; hidden entries and __pycache__ left out) into
    (name, path) pairs in a fixed order: the paths as given, each folder walked with sorted
    names. A name is the path relative to the folder given, with '/' separators, so the order
    and the names do not depend on the machine."""
    found = []
    for given in paths:
        if not os.path.exists(given):
            raise PrepareError(f"input path {given} does not exist")
        if os.path.isfile(given):
            found.append((os.path.basename(given), given))
            continue
        root_name = os.path.basename(os.path.normpath(given))
        for root, dirs, files in os.walk(given):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            for fn in sorted(files):
                if fn.startswith(".") or (extensions and not fn.endswith(tuple(extensions))):
                    continue
                path = os.path.join(root, fn)
                rel = os.path.relpath(path, given).replace(os.sep, "/")
                found.append((f"{root_name}/{rel}", path))
    return found


def split_paragraphs(text):
    """Paragraphs of a text: pieces separated by one or more blank (or whitespace-only) lines.
    The separators are dropped (the end-of-document id replaces them); each paragraph keeps
    its own leading indentation."""
    return [p for p in re.split(r"\n(?:[ \t\r\f\v]*\n)+", text) if p.strip()]


def file_documents(files, undecodable="fail"):
    """Documents for a list of (name, path): one per file; a corpus of exactly one file is
    split into paragraphs so it can still be divided into train and val by document.
    Returns (documents, skipped file names)."""
    skipped, docs = [], []
    if len(files) == 1:
        name, path = files[0]
        text = read_utf8(path, undecodable)
        if text is None:
            return [], [name]
        paragraphs = split_paragraphs(text)
        width = len(str(len(paragraphs)))
        for i, p in enumerate(paragraphs):
            docs.append((f"{name}#{i:0{width}d}", (lambda p=p: p)))
        return docs, skipped
    for name, path in files:
        # Decode once now to apply the undecodable policy; the text is read again on use so
        # the corpus is never held in memory.
        if read_utf8(path, undecodable) is None:
            skipped.append(name)
            continue
        docs.append((name, (lambda path=path: read_utf8(path, "fail"))))
    return docs, skipped


# ----------------------------------------------------------------------------- tokenizer

def sample_lines(docs, sample_bytes, total_bytes, seed):
    """A seeded Bernoulli sample of the corpus's non-blank lines, about sample_bytes in all.
    Sentencepiece learns from lines; newlines are a fixed piece of their own (see below)."""
    rate = min(1.0, sample_bytes / max(total_bytes, 1))
    rng = np.random.default_rng(seed)
    lines = []
    for _, load in docs:
        doc_lines = [l for l in load().split("\n") if l.strip()]
        keep = rng.random(len(doc_lines)) < rate
        lines.extend(l for l, k in zip(doc_lines, keep) if k)
    return lines


def train_tokenizer(lines, vocab_size, model_type, threads):
    """Train sentencepiece on the given lines; returns (model bytes, settings for meta.json)."""
    import sentencepiece as spm

    if not lines:
        raise PrepareError("the tokenizer sample is empty (the corpus has no non-blank line)")
    settings = dict(
        model_type=model_type,
        vocab_size=vocab_size,
        # Every input encodes: characters outside the vocabulary become their UTF-8 bytes.
        byte_fallback=True,
        # Code and whitespace pass through unchanged: no NFKC, no squeezing of spaces, no
        # space added in front of the text. Runs of spaces (indentation) may become pieces.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        # Numbers as digits: keeps the vocabulary for words, the usual choice for LMs.
        split_digits=True,
        # Lines are the training sentences, so "\n" never reaches the trainer; as a fixed
        # piece it still encodes as one token instead of a byte.
        user_defined_symbols=["\n"],
        character_coverage=1.0 if model_type == "char" else 0.9999,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
        input_sentence_size=0,  # use the whole sample: it is drawn (and bounded) by us
        max_sentence_length=1 << 16,
    )
    if model_type == "char" and not vocab_size:
        # Every character of the sample, the 256 byte pieces, unk/bos/eos and "\n".
        chars = set()
        for l in lines:
            chars.update(l)
        settings["vocab_size"] = len(chars) + 256 + 4
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                       num_threads=threads, minloglevel=2, **settings)
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        m = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
        if m:
            raise PrepareError(f"vocab_size {m.group(1)} is too small for this corpus: its "
                               f"characters and the special and byte pieces need {m.group(2)}; "
                               f"pass a larger --vocab_size")
        m = re.search(r"value <= (\d+)", msg)
        if "Vocabulary size" in msg:
            limit = f" (at most {m.group(1)} here)" if m else ""
            raise PrepareError(f"vocab_size {settings['vocab_size']} is too large for this "
                               f"corpus{limit}; pass a smaller --vocab_size")
        raise PrepareError(f"sentencepiece failed: {msg}")
    settings["user_defined_symbols"] = ["\\n"]  # readable in meta.json
    return model.getvalue(), settings


def load_tokenizer(model_bytes_or_path):
    import sentencepiece as spm

    if isinstance(model_bytes_or_path, (bytes, bytearray)):
        return spm.SentencePieceProcessor(model_proto=bytes(model_bytes_or_path))
    return spm.SentencePieceProcessor(model_file=model_bytes_or_path)


# ----------------------------------------------------------------------------- output

def make_out_dir(out_dir):
    """Create out_dir if needed and prove it is writable with a probe file.
    Returns True when this call created the folder (so a failure can remove it again)."""
    created = not os.path.isdir(out_dir) and not os.path.exists(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        # Temp files of an earlier run that was killed outright (SIGKILL) are of no use.
        for fn in os.listdir(out_dir):
            if any(fn.startswith(f".{out}.tmp.") for out in OUTPUTS):
                os.remove(os.path.join(out_dir, fn))
        probe = os.path.join(out_dir, f".write-probe.{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise PrepareError(f"cannot write to output folder {out_dir}: {e.strerror or e}")
    return created


def tmp_name(out_dir, fn):
    # Hidden and suffixed: nothing reading the folder mistakes it for a finished output.
    return os.path.join(out_dir, f".{fn}.tmp.{os.getpid()}")


# ----------------------------------------------------------------------------- prepare

def prepare(out_dir, name, docs, source, vocab_size=4096, model_type="bpe", val_fraction=0.05,
            min_val_tokens=1025, sample_bytes=4_000_000, seed=1337, threads=None,
            skipped=(), extra_meta=None, log=print):
    """Build data/<name>/ from documents [(name, load)]. Returns the meta dict written."""
    t_start = time.time()
    threads = threads or os.cpu_count() or 1
    if model_type not in ("bpe", "unigram", "char"):
        raise PrepareError(f"model_type must be bpe, unigram or char, not {model_type!r}")
    if not 0.0 < val_fraction < 1.0:
        raise PrepareError(f"val_fraction must be between 0 and 1 (exclusive), not {val_fraction}")
    if vocab_size and vocab_size < 261:
        raise PrepareError(f"vocab_size {vocab_size} is too small: byte fallback alone takes "
                           f"260 ids (256 bytes, unk, bos, eos, newline)")
    if min_val_tokens < 1:
        raise PrepareError(f"min_val_tokens must be at least 1, not {min_val_tokens}")

    # Pass 1: sizes and content hash, in corpus order. Empty documents are dropped here.
    h = hashlib.sha256()
    kept, sizes, with_marker = [], [], []
    bar = tqdm(docs, desc="reading", unit="doc")
    for doc_name, load in bar:
        text = load()
        if not text.strip():
            continue
        if "\u2581" in text:
            with_marker.append(doc_name)
        data = text.encode("utf-8")
        h.update(doc_name.encode("utf-8") + b"\0" + data + b"\0")
        kept.append((doc_name, load))
        sizes.append(len(data))
    total_bytes = sum(sizes)
    if not kept:
        raise PrepareError(f"empty corpus: no text found in {source}")
    if len(kept) < 2:
        raise PrepareError(f"the corpus has a single document ({kept[0][0]}); a train/val "
                           f"split needs at least two (separate paragraphs by a blank line, "
                           f"or add files)")
    if with_marker:
        # sentencepiece writes spaces as U+2581 internally, so the character itself decodes
        # back as a space: the only input that does not round-trip. Say so instead of hiding it.
        log(f"warning: {len(with_marker)} documents contain U+2581 (\u2581), which decodes as a "
            f"space, e.g. {with_marker[0]}")
    log(f"{name}: {len(kept)} documents, {total_bytes / 1e6:.1f} MB"
        + (f" ({len(skipped)} undecodable files skipped)" if skipped else ""))

    # Fail on an unwritable folder before any long work.
    created = make_out_dir(out_dir)
    tmps = {fn: tmp_name(out_dir, fn) for fn in OUTPUTS}
    try:
        # Pass 2: tokenizer.
        t0 = time.time()
        lines = sample_lines(kept, sample_bytes, total_bytes, seed)
        sample_size = sum(len(l.encode("utf-8")) for l in lines)
        log(f"training {model_type} tokenizer (vocab {vocab_size or 'auto'}) on a "
            f"{sample_size / 1e6:.1f} MB sample of {len(lines)} lines ...")
        model_bytes, tok_settings = train_tokenizer(lines, vocab_size, model_type, threads)
        del lines
        sp = load_tokenizer(model_bytes)
        vocab_size = sp.get_piece_size()
        dtype = np.dtype(dtype_for_vocab(vocab_size))
        log(f"tokenizer trained in {time.time() - t0:.1f}s, {vocab_size} pieces")

        # Passes 3 and 4: encode. Validation documents first, in a seeded random order.
        t0 = time.time()
        order = np.random.default_rng(seed).permutation(len(kept))
        bar = tqdm(total=total_bytes, desc="encoding", unit="B", unit_scale=True)
        is_val = np.zeros(len(kept), dtype=bool)
        val_docs, val_tokens, val_bytes = [], 0, 0
        with open(tmps["val.bin"], "wb") as f:
            for i in order:
                if val_bytes >= val_fraction * total_bytes and val_tokens >= min_val_tokens:
                    break
                if len(val_docs) == len(kept) - 1:
                    raise PrepareError(
                        f"corpus too small: the validation split needs val_fraction="
                        f"{val_fraction} of the bytes and min_val_tokens={min_val_tokens} "
                        f"tokens, but all documents but one give {val_tokens} tokens; add text "
                        f"or lower min_val_tokens")
                ids = sp.encode(kept[i][1]())
                ids.append(EOS_ID)
                np.asarray(ids, dtype=dtype).tofile(f)
                is_val[i] = True
                val_docs.append(kept[i][0])
                val_tokens += len(ids)
                val_bytes += sizes[i]
                bar.update(sizes[i])
        train_tokens, train_docs = 0, 0
        with open(tmps["train.bin"], "wb") as f:
            batch, batch_bytes = [], 0
            for i in range(len(kept) + 1):
                if i < len(kept) and not is_val[i]:
                    batch.append(kept[i][1]())
                    batch_bytes += sizes[i]
                if batch and (batch_bytes >= ENCODE_BATCH_BYTES or i == len(kept)):
                    # sentencepiece encodes a list on its own C++ threads (no GIL, no pickling).
                    for ids in sp.encode(batch, num_threads=threads):
                        ids.append(EOS_ID)
                        np.asarray(ids, dtype=dtype).tofile(f)
                        train_tokens += len(ids)
                    train_docs += len(batch)
                    bar.update(batch_bytes)
                    batch, batch_bytes = [], 0
        bar.close()
        t_encode = time.time() - t0
        if train_tokens < min_val_tokens:
            raise PrepareError(f"corpus too small: the training split has {train_tokens} tokens, "
                               f"fewer than min_val_tokens={min_val_tokens}; add text")

        with open(tmps["tokenizer.model"], "wb") as f:
            f.write(model_bytes)
        with open(tmps["tokenizer.vocab"], "w", encoding="utf-8") as f:
            for i in range(vocab_size):
                f.write(f"{sp.id_to_piece(i)!r}\t{sp.get_score(i)}\n")
        tok_settings.update(vocab_size=vocab_size, sha256=hashlib.sha256(model_bytes).hexdigest(),
                            sample_bytes=sample_size, sample_seed=seed)
        meta = {
            "name": name, "vocab_size": vocab_size, "dtype": dtype.name,
            "eos_id": EOS_ID, "bos_id": BOS_ID, "unk_id": UNK_ID,
            "train_tokens": train_tokens, "val_tokens": val_tokens,
            "train_docs": train_docs, "val_docs": len(val_docs),
            "source": source, "source_bytes": total_bytes, "source_sha256": h.hexdigest(),
            "source_hash_of": "sha256 over name + NUL + utf-8 text + NUL of each document in order",
            "val_fraction": val_fraction, "min_val_tokens": min_val_tokens, "split_seed": seed,
            "skipped_undecodable": list(skipped),
            "tokenizer": tok_settings,
            "val_documents": val_docs,  # in the order they appear in val.bin
        }
        meta.update(extra_meta or {})
        with open(tmps["meta.json"], "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, ensure_ascii=False)
            f.write("\n")

        # Commit: remove the old meta.json first, so that a crash between the renames never
        # leaves a meta.json beside files from another run; meta.json goes in last.
        final = {fn: os.path.join(out_dir, fn) for fn in OUTPUTS}
        if os.path.exists(final["meta.json"]):
            os.remove(final["meta.json"])
        for fn in OUTPUTS:
            os.replace(tmps[fn], final[fn])
    except BaseException:
        for path in tmps.values():
            if os.path.exists(path):
                os.remove(path)
        if created and not os.listdir(out_dir):
            os.rmdir(out_dir)
        raise
    total = time.time() - t_start
    log(f"wrote {out_dir}: train {train_tokens:,} tokens ({train_docs} docs), val {val_tokens:,} "
        f"tokens ({len(val_docs)} docs), {total_bytes / max(train_tokens + val_tokens, 1):.2f} "
        f"bytes/token; encoding {total_bytes / 1e6 / max(t_encode, 1e-9):.1f} MB/s; "
        f"{total:.1f}s in all")
    return meta


def run(main_fn, argv):
    """Call a prepare script's body and turn user mistakes into one line and exit code 1."""
    try:
        return main_fn(argv)
    except PrepareError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("error: interrupted; no output was written")
