"""Shared logic of every data/<name>/prepare.py: a corpus -> sentencepiece tokenizer ->
train.bin / val.bin / tokenizer.model / meta.json (the layout is in the README).

A corpus is a list of sources read in order: text files (a file is a document; a corpus of a
single text file is split into paragraphs), .jsonl / .jsonl.gz (a record is a document),
.parquet (a row is a document), or documents held in memory. Everything streams: the main
process reads the sources in blocks and hands batches of at most TASK_CHARS characters to
`num_proc` worker processes, at most a few batches ahead, and takes their results back in
the order it sent them, so memory does not grow with the corpus and the output does not
depend on the number of workers. `prepare()` reads the corpus twice:
  1. scan: validate every record, hash the input files, count documents and bytes, and draw
     the tokenizer's training sample: the units (documents, or pieces of at most UNIT_CHARS
     of a long one) with the smallest seeded keys that fit in sample_bytes, which does not
     depend on the order the units arrive in or on how they were batched;
  2. encode every document into one token file, each followed by the end-of-document id.
Then the token file (not the corpus) is read once more to split it: validation takes an
exact budget of tokens, picked document by document along the corpus (see split_tokens).
Outputs go to hidden temp names and are renamed at the end, meta.json last: a folder with
meta.json in it is complete.
"""
import codecs
import collections
import hashlib
import heapq
import io
import itertools
import json
import multiprocessing
import os
import re
import sys
import time
import zlib

import numpy as np

# A user mistake raises PrepareError; the prepare scripts turn it into `error: ...` + exit 1.
class PrepareError(Exception):
    pass


OUTPUTS = ("train.bin", "val.bin", "tokenizer.model", "tokenizer.vocab", "meta.json")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
READ_BYTES = 1 << 20      # raw bytes read from a file at a time
TASK_CHARS = 1 << 20      # text handed to one worker at once
PIECE_CHARS = 1 << 20     # longer documents are encoded in pieces cut at line ends
UNIT_CHARS = 1 << 14      # the tokenizer sample is drawn in units of at most this size
SPLIT_CHUNK = 1 << 22     # tokens the split reads at a time
# sentencepiece's trainer records its thread count in the model and unigram's EM sums over
# one partition of the sentences per thread, so the count must not come from the machine.
TRAINER_THREADS = 16
PARAGRAPH_SEP = re.compile(r"(\n(?:[ \t\r\f\v]*\n)+)")


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


def cpu_seconds():
    """CPU time of this process and of its finished children (the workers), user + system."""
    try:
        import resource
    except ImportError:  # not on Windows
        return float("nan")
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def default_num_proc():
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:
        return os.cpu_count() or 1


def mix64(a, b):
    """A 64-bit hash of two uint64 arrays (splitmix64 finalizer): seeded keys that are the
    same on every machine and for any batching, unlike a stream of random draws."""
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
        x = np.asarray(a, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x = x ^ np.asarray(b, dtype=np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


# ----------------------------------------------------------------------------- sources

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


def file_sources(files):
    """(name, path) pairs -> sources (name, kind, path), the kind from the file name: jsonl
    (.jsonl, .jsonl.gz), parquet, or text. A corpus of exactly one text file is split into
    paragraphs, so that it can still be divided into documents."""
    def kind(path):
        low = path.lower()
        if low.endswith((".jsonl", ".jsonl.gz")):
            return "jsonl"
        return "parquet" if low.endswith(".parquet") else "text"
    sources = [(name, kind(path), path) for name, path in files]
    if len(sources) == 1 and sources[0][1] == "text":
        sources = [(sources[0][0], "paragraphs", sources[0][2])]
    return sources


def split_paragraphs(text):
    """Paragraphs of a text: pieces separated by one or more blank (or whitespace-only) lines.
    The separators are dropped (the end-of-document id replaces them); each paragraph keeps
    its own leading indentation. The reference for the streaming splitter in _paragraphs."""
    return [p for p in PARAGRAPH_SEP.split(text)[::2] if p.strip()]


def cut_point(text, limit):
    """Where to cut text longer than limit: after the last newline before limit (a newline
    is a token of its own, so both sides encode exactly as the whole would), else before the
    last space, else at limit."""
    i = text.rfind("\n", 0, limit)
    if i >= 0:
        return i + 1
    i = text.rfind(" ", 1, limit)
    return i if i > 0 else limit


def _raw_blocks(path, h=None):
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            if not block:
                return
            if h is not None:
                h.update(block)
            yield block


def _gunzip(blocks, path):
    """Decompress a stream of gzip blocks (several members allowed) in bounded pieces."""
    d = zlib.decompressobj(31)
    try:
        for block in blocks:
            while block:
                if d.eof:
                    d = zlib.decompressobj(31)
                out = d.decompress(block, READ_BYTES)
                if out:
                    yield out
                block = d.unused_data if d.eof else d.unconsumed_tail
        out = d.flush()
        if out:
            yield out
    except zlib.error as e:
        raise PrepareError(f"{path} is not a valid gzip file ({e})")
    if not d.eof:
        raise PrepareError(f"{path} is not a valid gzip file (it ends before its data does)")


def _lines(blocks):
    """Split byte blocks into lines (without the newline); a long line is joined once."""
    pending = []
    for block in blocks:
        if b"\n" not in block:
            pending.append(block)
            continue
        parts = block.split(b"\n")
        if pending:
            parts[0] = b"".join(pending) + parts[0]
        pending = [parts.pop()]
        yield from parts
    tail = b"".join(pending)
    if tail:
        yield tail


def _decoded(blocks, path):
    """UTF-8 text of byte blocks; a bad byte raises UnicodeError with its offset in the file."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    for block in blocks:
        held = len(dec.getstate()[0])
        try:
            text = dec.decode(block)
        except UnicodeDecodeError as e:
            at = offset - held + e.start
            raise UnicodeError(f"{path} is not valid UTF-8 (byte {e.object[e.start]:#04x} at "
                               f"offset {at})")
        offset += len(block)
        if text:
            yield text
    try:
        dec.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UnicodeError(f"{path} is not valid UTF-8 (it ends inside a character)")


def _paragraphs(texts):
    """Stream of (text, first, last) pieces of paragraphs, the same paragraphs as
    split_paragraphs() on the whole text; a paragraph longer than PIECE_CHARS comes in pieces."""
    carry, first = "", True
    for text in texts:
        parts = PARAGRAPH_SEP.split(carry + text)
        # parts = [p0, sep0, p1, sep1, ..., pk]. A final separator followed by nothing but
        # whitespace may still grow with the next block: keep it for the next round.
        if len(parts) > 1 and (not parts[-1] or parts[-1].isspace()):
            carry = parts[-2] + parts[-1]
            done = parts[:-2:2]
        else:
            carry = parts[-1]
            done = parts[:-1:2]
        for p in done:
            if not first or (p and not p.isspace()):
                yield p, first, True  # (the last piece of a long one may be blank)
            first = True
        while len(carry) > PIECE_CHARS and not carry.isspace():
            # Not at the last newline: if only blanks follow it, it may start a separator.
            last_newline = carry.rfind("\n")
            i = cut_point(carry, min(PIECE_CHARS, last_newline) if last_newline > 0
                          else PIECE_CHARS)
            yield carry[:i], first, False
            carry, first = carry[i:], False
    if (carry and not carry.isspace()) or not first:
        yield carry, first, True


def _in_pieces(texts):
    """A whole stream as one document, in pieces of about PIECE_CHARS cut at line ends."""
    buf, size, first = [], 0, True
    for text in texts:
        buf.append(text)
        size += len(text)
        if size > PIECE_CHARS:
            carry = "".join(buf)
            while len(carry) > PIECE_CHARS:
                i = cut_point(carry, PIECE_CHARS)
                yield carry[:i], first, False
                carry, first = carry[i:], False
            buf, size = [carry], len(carry)
    yield "".join(buf), first, True


def _parquet_texts(path, field):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"reading {path} needs the pyarrow package: pip install pyarrow")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for a file it cannot read
        raise PrepareError(f"{path} is not a readable parquet file ({e})")
    names = pf.schema_arrow.names
    if field not in names:
        raise PrepareError(f"{path} has no column {field!r} (its columns: {', '.join(names)}); "
                           f"pass --text_field")
    ftype = pf.schema_arrow.field(field).type
    import pyarrow as pa
    if not (pa.types.is_string(ftype) or pa.types.is_large_string(ftype)):
        raise PrepareError(f"{path}: column {field!r} holds {ftype}, not strings")
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        yield from batch.column(0).to_pylist()


def _tasks(sources, text_field, undecodable, skip_files, skipped, hashes, bar):
    """Batches of work in corpus order: (kind, source index, name, items), items being
    (location, payload, first, last) with payload a raw JSON line (kind 'json') or a text or
    parquet value (kind 'text'). Text files that are not UTF-8 are added to `skipped` (under
    undecodable=skip); `hashes`, when given, receives each source's sha256."""
    for si, (name, kind, where) in enumerate(sources):
        if si in skip_files:
            continue
        h = hashlib.sha256() if hashes is not None else None
        if kind in ("text", "paragraphs", "jsonl"):
            blocks = _counted(_raw_blocks(where, h), bar)
            if where.lower().endswith(".gz"):
                blocks = _gunzip(blocks, where)
        if kind == "jsonl":
            items = ((i + 1, line, True, True) for i, line in enumerate(_lines(blocks)))
            yield from _batched(items, "json", si, where)
        elif kind in ("text", "paragraphs"):
            split = _paragraphs if kind == "paragraphs" else _in_pieces
            pieces = split(_decoded(blocks, where))
            items = ((i, *piece) for i, piece in enumerate(pieces))
            try:
                yield from _batched(items, "text", si, where)
            except UnicodeError as e:
                if undecodable != "skip":
                    raise PrepareError(f"{e}; pass --undecodable=skip to leave such files out")
                skipped.append(si)
                continue  # neither hashed nor counted
        elif kind == "parquet":
            if h is not None:
                for _ in _raw_blocks(where, h):  # the content hash needs one plain read
                    pass
            items = ((i, t, True, True) for i, t in enumerate(_parquet_texts(where, text_field)))
            yield from _batched(items, "text", si, where)
            bar.update(os.path.getsize(where))
        else:  # "docs": documents in memory, `where` returns an iterable of texts
            def texts():
                for t in where():
                    if h is not None:
                        h.update(t.encode("utf-8") + b"\0")
                    bar.update(len(t))
                    yield t
            items = ((i, t, True, True) for i, t in enumerate(texts()))
            yield from _batched(items, "text", si, name)
        if hashes is not None:
            hashes.append((name, h.hexdigest()))


def _counted(blocks, bar):
    for b in blocks:
        bar.update(len(b))
        yield b


def _batched(items, kind, si, name):
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += len(item[1]) if item[1] is not None else 0
        if size >= TASK_CHARS:
            yield kind, si, name, batch
            batch, size = [], 0
    if batch:
        yield kind, si, name, batch


def _ordered_map(fn, jobs, num_proc, initializer=None, initargs=()):
    """fn over jobs in num_proc worker processes, results in the order of the jobs. At most
    a few jobs are in flight, so a fast reader cannot queue up the whole corpus in memory."""
    if num_proc <= 1:
        if initializer:
            initializer(*initargs)
        for job in jobs:
            yield fn(job)
        return
    with multiprocessing.Pool(num_proc, initializer, initargs) as pool:
        window = collections.deque()
        for job in jobs:
            window.append(pool.apply_async(fn, (job,)))
            if len(window) >= 2 * num_proc + 2:
                yield window.popleft().get()
        while window:
            yield window.popleft().get()


# ----------------------------------------------------------------------------- workers

_worker = {}


def _init_worker(settings):
    _worker.clear()
    _worker.update(settings)
    if "model" in settings:
        _worker["sp"] = load_tokenizer(settings["model"])


def _documents(kind, name, items, stats):
    """(location, text, first, last) of the batch's documents; bad JSON records become an
    error in stats (the first one) or are counted as skipped."""
    field, skip = _worker["text_field"], _worker["undecodable"] == "skip"
    for loc, payload, first, last in items:
        where = f"{name} line {loc}" if kind == "json" else f"{name} row index {loc}"
        if kind == "json":
            if not payload.strip():
                continue  # blank lines between records
            try:
                record = json.loads(payload)
                problem = None
            except UnicodeDecodeError:
                problem = "is not valid UTF-8"
            except ValueError as e:
                problem = f"is not valid JSON ({e.args[0].split(':')[0]})"
            if problem is None:
                if not isinstance(record, dict):
                    problem = "is not a JSON object"
                elif field not in record:
                    problem = f"has no field {field!r}"
                else:
                    payload = record[field]
        else:
            problem = None
        if problem is None and not isinstance(payload, str):
            problem = f"field {field!r} is {type(payload).__name__}, not a string"
        if problem:
            if not skip:
                stats["error"] = stats.get("error") or (
                    f"{where}: the record {problem}; pass --undecodable=skip to leave such "
                    f"records out")
                return
            stats["skipped"] += 1
            continue
        if first and last and (not payload or payload.isspace()):
            continue  # an empty document
        yield loc, payload, first, last


def _scan(job):
    """Pass 1 on one batch: counts, U+2581 check, and sample candidates with keys < cutoff."""
    (kind, si, name, items), cutoff = job
    stats = {"docs": 0, "bytes": 0, "skipped": 0, "marker": None, "error": None, "source": si}
    units, locs = [], []
    for loc, text, first, last in _documents(kind, name, items, stats):
        stats["docs"] += last
        stats["bytes"] += len(text) if text.isascii() else len(text.encode("utf-8"))
        if stats["marker"] is None and "\u2581" in text:
            stats["marker"] = f"{name} at {loc}"
        sub = 0
        while text:
            i = cut_point(text, UNIT_CHARS) if len(text) > UNIT_CHARS else len(text)
            units.append(text[:i])
            locs.append((loc << 16) + sub)
            text, sub = text[i:], sub + 1
    keys = mix64(mix64(_worker["seed"], si), np.array(locs, dtype=np.uint64)) if units else []
    stats["sample"] = [(int(k), si, u) for k, u in zip(keys, units) if int(k) < cutoff]
    return stats


def _encode(job):
    """Pass 2 on one batch: the token ids of its documents, each finished by EOS."""
    kind, si, name, items = job
    sp, dtype = _worker["sp"], _worker["dtype"]
    stats = {"docs": 0, "bytes": 0, "skipped": 0, "error": None}
    texts, ends = [], []
    for loc, text, first, last in _documents(kind, name, items, stats):
        stats["docs"] += last
        stats["bytes"] += len(text) if text.isascii() else len(text.encode("utf-8"))
        while len(text) > PIECE_CHARS:  # a long JSON record or parquet value
            i = cut_point(text, PIECE_CHARS)
            texts.append(text[:i])
            ends.append(False)
            text = text[i:]
        texts.append(text)
        ends.append(last)
    ids = sp.encode(texts) if texts else []
    for piece, end in zip(ids, ends):
        if end:
            piece.append(EOS_ID)
    flat = itertools.chain.from_iterable(ids)  # iterated in C, not token by token in Python
    stats["tokens"] = np.fromiter(flat, dtype=dtype, count=sum(map(len, ids)))
    return stats


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(lines, vocab_size, model_type):
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
        # piece it still encodes as one token instead of a byte, and no piece spans it, so
        # text cut after a newline encodes exactly as the whole (pieces, the split).
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
                                       num_threads=TRAINER_THREADS, minloglevel=2, **settings)
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
    settings["trainer_threads"] = TRAINER_THREADS
    return model.getvalue(), settings


def load_tokenizer(model_bytes_or_path):
    import sentencepiece as spm

    if isinstance(model_bytes_or_path, (bytes, bytearray)):
        return spm.SentencePieceProcessor(model_proto=bytes(model_bytes_or_path))
    return spm.SentencePieceProcessor(model_file=model_bytes_or_path)


# ----------------------------------------------------------------------------- split

def split_tokens(path, val_path, dtype, total, budget, seed, newline_id, bar=None):
    """Move exactly `budget` tokens of the token file at `path` (every document ending in
    EOS) to val_path, and compact the rest in place into the training split.

    Documents are visited in corpus order. After document i (ending at token e) validation
    "owes" budget * e / total - V tokens, V being what it holds; it takes the document when
    the debt is at least u_i times the document's length, u_i being a seeded uniform number
    per document, so the picks are spread along the corpus and change with the seed. A
    document too large for the remaining budget is cut after the last newline that fits
    (its first part, with an EOS of its own, goes to validation, the rest stays in training).
    Whatever the debt, a document gives at least what the rest of the corpus could no longer
    supply, so the budget is met exactly however few and large the documents are; only such
    a forced piece may have to end inside a line (when the one token still owed is its EOS,
    it is an empty piece). Returns
    (train tokens, val tokens, train pieces, val pieces, documents cut)."""
    dtype = np.dtype(dtype)
    size = dtype.itemsize
    rate = budget / total
    eos_bytes = np.array([EOS_ID], dtype=dtype).tobytes()
    counts = {"val": 0, "train_docs": 0, "val_docs": 0, "cut": 0}
    fd = os.open(path, os.O_RDWR)
    try:
        with open(val_path, "wb") as fv:
            out = {"w": 0, "run": None}  # next write offset (tokens), pending train run

            def read(a, b):
                return np.frombuffer(os.pread(fd, (b - a) * size, a * size), dtype=dtype)

            def flush():
                if out["run"]:
                    a, b = out["run"]
                    if out["w"] != a:  # nothing to move until the first validation piece
                        for s in range(a, b, SPLIT_CHUNK):
                            e = min(b, s + SPLIT_CHUNK)
                            os.pwrite(fd, read(s, e).tobytes(), (out["w"] + s - a) * size)
                    out["w"] += b - a
                    out["run"] = None

            def to_train(a, b):
                run = out["run"]
                if run and run[1] == a:
                    out["run"] = (run[0], b)
                else:
                    flush()
                    out["run"] = (a, b)

            def to_val(a, b, eos):
                flush()
                for s in range(a, b, SPLIT_CHUNK):
                    fv.write(read(s, min(b, s + SPLIT_CHUNK)).tobytes())
                if eos:
                    fv.write(eos_bytes)
                counts["val"] += b - a + eos
                counts["val_docs"] += 1

            def last_newline(a, lo, hi):
                """Largest L in [lo, hi] whose prefix a..a+L ends with a newline, or None."""
                while hi >= max(lo, 1):
                    s = max(lo, 1, hi - SPLIT_CHUNK)
                    hits = np.flatnonzero(read(a + s - 1, a + hi) == newline_id)
                    if len(hits):
                        return s + int(hits[-1])
                    hi = s - 1
                return None

            start, doc, r = 0, 0, 0
            while r < total:
                chunk = read(r, min(total, r + SPLIT_CHUNK))
                ends = r + np.flatnonzero(chunk == EOS_ID) + 1
                r += len(chunk)
                if bar is not None:
                    bar.update(len(chunk) * size)
                starts = np.concatenate([[start], ends[:-1]]) if len(ends) else ends
                lengths = ends - starts
                u = mix64(mix64(seed, 0x5EED), doc + np.arange(len(ends), dtype=np.uint64))
                u = (u >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
                i = 0
                while i < len(ends):
                    # The next document that validation takes any of, found in bulk.
                    j = min(len(ends), i + 4096)
                    V = counts["val"]
                    owed = ends[i:j] * rate - V
                    hit = (owed >= lengths[i:j] * u[i:j]) | (budget - V > total - ends[i:j])
                    k = i + int(np.argmax(hit)) if hit.any() else j
                    if k > i:
                        to_train(int(starts[i]), int(ends[k - 1]))
                        counts["train_docs"] += k - i
                    if k == j:
                        i = j
                        continue
                    a, e, n = int(starts[k]), int(ends[k]), int(lengths[k])
                    owe = e * rate - V
                    lo = max(0, budget - V - (total - e))  # what only this document can give
                    want = n if owe >= n * u[k] else 0
                    want = min(max(want, lo), n, budget - V)
                    if want >= n:
                        to_val(a, e, False)
                    else:
                        # A prefix of L content tokens + its own EOS; prefer a line end.
                        L = last_newline(a, max(lo - 1, 0), want - 1) if want > 0 else None
                        if L is None and lo > 0:
                            L = lo - 1
                        if L is None:
                            to_train(a, e)
                            counts["train_docs"] += 1
                        else:
                            to_val(a, a + L, True)
                            to_train(a + L, e)
                            counts["train_docs"] += 1
                            counts["cut"] += 1
                    i = k + 1
                start = int(ends[-1]) if len(ends) else start
                doc += len(ends)
            flush()
            os.ftruncate(fd, out["w"] * size)
    finally:
        os.close(fd)
    assert counts["val"] == budget, (counts["val"], budget)
    return (out["w"], counts["val"], counts["train_docs"], counts["val_docs"], counts["cut"])


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

def prepare(out_dir, name, sources, source, vocab_size=4096, model_type="bpe",
            val_fraction=0.05, val_tokens=None, min_val_tokens=1025, sample_bytes=4_000_000,
            seed=1337, num_proc=None, text_field="text", undecodable="fail",
            extra_meta=None, log=print):
    """Build data/<name>/ from sources [(name, kind, path)] (see file_sources; kind "docs"
    takes a function returning an iterable of texts instead of a path). Returns the meta
    dict written."""
    t_start = time.time()
    num_proc = num_proc or default_num_proc()
    if model_type not in ("bpe", "unigram", "char"):
        raise PrepareError(f"model_type must be bpe, unigram or char, not {model_type!r}")
    if not 0.0 < val_fraction < 1.0:
        raise PrepareError(f"val_fraction must be between 0 and 1 (exclusive), not {val_fraction}")
    if val_tokens is not None and val_tokens < 1:
        raise PrepareError(f"val_tokens must be at least 1, not {val_tokens}")
    if vocab_size and vocab_size < 261:
        raise PrepareError(f"vocab_size {vocab_size} is too small: byte fallback alone takes "
                           f"260 ids (256 bytes, unk, bos, eos, newline)")
    if min_val_tokens < 1:
        raise PrepareError(f"min_val_tokens must be at least 1, not {min_val_tokens}")
    if num_proc < 1:
        raise PrepareError(f"num_proc must be at least 1, not {num_proc}")
    if sample_bytes < 1:
        raise PrepareError(f"sample_bytes must be at least 1, not {sample_bytes}")
    settings = {"text_field": text_field, "undecodable": undecodable, "seed": seed}
    raw_total = sum(os.path.getsize(w) for _, k, w in sources if k != "docs") or None

    # Pass 1: validate, count, hash, and draw the tokenizer sample.
    t0 = time.time()
    per_source = collections.defaultdict(lambda: np.zeros(3, dtype=np.int64))
    skipped, hashes, marker = [], [], None
    heap, heap_bytes = [], 0  # max-heap on key of the sample candidates: (-key, source, text)
    bar = tqdm(total=raw_total, desc="scanning", unit="B", unit_scale=True)

    def scan_jobs():
        for task in _tasks(sources, text_field, undecodable, (), skipped, hashes, bar):
            yield task, (-heap[0][0] if heap_bytes >= sample_bytes else 1 << 64)
    for r in _ordered_map(_scan, scan_jobs(), num_proc, _init_worker, (settings,)):
        if r["error"]:
            raise PrepareError(r["error"])
        per_source[r["source"]] += (r["docs"], r["bytes"], r["skipped"])
        marker = marker or r["marker"]
        for key, si, text in r["sample"]:
            if heap_bytes >= sample_bytes and key >= -heap[0][0]:
                continue
            heapq.heappush(heap, (-key, si, text))
            heap_bytes += len(text)
            # Drop the largest key while the others alone still fill the sample: it can no
            # longer be part of the sorted prefix that fits.
            while heap_bytes - len(heap[0][2]) >= sample_bytes:
                heap_bytes -= len(heapq.heappop(heap)[2])
    bar.close()
    kept = [si for si in per_source if si not in skipped]
    docs, total_bytes, skipped_records = (int(x) for x in sum((per_source[si] for si in kept),
                                                               np.zeros(3, dtype=np.int64)))
    skipped_names = [sources[si][0] for si in skipped]
    for n in skipped_names:
        log(f"warning: skipping {n}: not valid UTF-8")
    if skipped_records:
        log(f"warning: skipped {skipped_records} records without a string {text_field!r} "
            f"(not JSON, not an object, the field missing or not a string)")
    if not docs:
        raise PrepareError(f"empty corpus: no text found in {source}")
    if marker:
        # sentencepiece writes spaces as U+2581 internally, so the character itself decodes
        # back as a space: the only input that does not round-trip. Say so instead of hiding it.
        log(f"warning: some documents contain U+2581 (\u2581), which decodes as a space, e.g. "
            f"{marker}")
    h = hashlib.sha256()
    for n, digest in hashes:
        h.update(f"{n}\0{digest}\n".encode("utf-8"))
    log(f"{name}: {docs} documents, {total_bytes / 1e6:.1f} MB"
        + (f" ({len(skipped)} undecodable files skipped)" if skipped else "")
        + f"; scanned in {time.time() - t0:.1f}s")

    # Fail on an unwritable folder before any long work.
    created = make_out_dir(out_dir)
    tmps = {fn: tmp_name(out_dir, fn) for fn in OUTPUTS}
    try:
        # The tokenizer: the sample's units in key order, the prefix that fits sample_bytes.
        t0 = time.time()
        lines, size = [], 0
        for key, si, text in sorted((-k, si, t) for k, si, t in heap if si not in skipped):
            if size + len(text) > sample_bytes and lines:
                break
            size += len(text)
            lines.extend(l for l in text.split("\n") if l.strip())
        del heap
        sample_size = sum(len(l.encode("utf-8")) for l in lines)
        log(f"training {model_type} tokenizer (vocab {vocab_size or 'auto'}) on a "
            f"{sample_size / 1e6:.1f} MB sample of {len(lines)} lines ...")
        model_bytes, tok_settings = train_tokenizer(lines, vocab_size, model_type)
        del lines
        sp = load_tokenizer(model_bytes)
        vocab_size = sp.get_piece_size()
        dtype = np.dtype(dtype_for_vocab(vocab_size))
        newline_id = sp.piece_to_id("\n")
        log(f"tokenizer trained in {time.time() - t0:.1f}s, {vocab_size} pieces")

        # Pass 2: every document, in corpus order, into one token file.
        t0, cpu0 = time.time(), cpu_seconds()
        settings.update(model=model_bytes, dtype=dtype)
        total, enc_docs, enc_bytes = 0, 0, 0
        bar = tqdm(total=raw_total, desc="encoding", unit="B", unit_scale=True)
        jobs = _tasks(sources, text_field, undecodable, set(skipped), [], None, bar)
        with open(tmps["train.bin"], "wb") as f:
            for r in _ordered_map(_encode, jobs, num_proc, _init_worker, (settings,)):
                if r["error"]:
                    raise PrepareError(r["error"])
                r["tokens"].tofile(f)
                total += len(r["tokens"])
                enc_docs += r["docs"]
                enc_bytes += r["bytes"]
        bar.close()
        t_encode, cpu_encode = time.time() - t0, cpu_seconds() - cpu0
        if (enc_docs, enc_bytes) != (docs, total_bytes):
            raise PrepareError(f"the corpus changed while it was being prepared ({docs} "
                               f"documents, {total_bytes} bytes when scanned; {enc_docs}, "
                               f"{enc_bytes} when encoded)")

        # The split: an exact budget of tokens, taken from the token file.
        t0 = time.time()
        budget = val_tokens if val_tokens is not None else max(round(val_fraction * total),
                                                              min_val_tokens)
        if total - budget < min_val_tokens:
            raise PrepareError(
                f"corpus too small: {total} tokens in all, the validation split takes {budget} "
                f"({'val_tokens' if val_tokens is not None else f'val_fraction={val_fraction}, at least min_val_tokens={min_val_tokens}'}) "
                f"and training needs at least min_val_tokens={min_val_tokens}; add text or "
                f"lower min_val_tokens")
        bar = tqdm(total=total * dtype.itemsize, desc="splitting", unit="B", unit_scale=True)
        train_tokens, val_count, train_docs, val_docs, cut = split_tokens(
            tmps["train.bin"], tmps["val.bin"], dtype, total, budget, seed, newline_id, bar)
        bar.close()
        t_split = time.time() - t0

        with open(tmps["tokenizer.model"], "wb") as f:
            f.write(model_bytes)
        with open(tmps["tokenizer.vocab"], "w", encoding="utf-8") as f:
            for i in range(vocab_size):
                f.write(f"{sp.id_to_piece(i)!r}\t{sp.get_score(i)}\n")
        tok_settings.update(vocab_size=vocab_size, sha256=hashlib.sha256(model_bytes).hexdigest(),
                            sample_bytes=sample_size, sample_seed=seed)
        meta = {
            "name": name, "vocab_size": vocab_size, "dtype": dtype.name,
            "eos_id": EOS_ID, "bos_id": BOS_ID, "unk_id": UNK_ID, "newline_id": newline_id,
            "train_tokens": train_tokens, "val_tokens": val_count,
            "documents": docs, "train_docs": train_docs, "val_docs": val_docs,
            "cut_documents": cut,
            "source": source, "source_files": len(sources) - len(skipped),
            "source_bytes": total_bytes, "source_sha256": h.hexdigest(),
            "source_hash_of": "sha256 over 'name NUL sha256(file bytes) LF' of each input in "
                              "order (for documents held in memory: of each text + NUL)",
            "split": {
                "rule": "seeded document picks along the corpus with an exact token budget, "
                        "a document cut after a newline when large (data/common.py "
                        "split_tokens)",
                "seed": seed, "val_fraction": None if val_tokens is not None else val_fraction,
                "val_tokens": val_tokens, "min_val_tokens": min_val_tokens,
                "budget": budget, "tokens_before_split": total,
            },
            "text_field": text_field,
            "skipped_undecodable": skipped_names, "skipped_records": skipped_records,
            "tokenizer": tok_settings,
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
    log(f"wrote {out_dir}: train {train_tokens:,} tokens ({train_docs} pieces), val "
        f"{val_count:,} tokens ({val_docs} pieces, {cut} documents cut), "
        f"{total_bytes / max(total, 1):.2f} bytes/token; encoding {total_bytes / 1e6 / max(t_encode, 1e-9):.2f} "
        f"MB/s with {num_proc} processes ({cpu_encode:.1f} CPU s); split {t_split:.1f}s; {time.time() - t_start:.1f}s in all")
    return meta


def add_arguments(p, vocab_size=4096, val_fraction=0.05):
    """The options every prepare script shares; prepare_options(args) turns them into
    prepare()'s keyword arguments."""
    p.add_argument("--vocab_size", type=int, default=vocab_size,
                   help=f"default {vocab_size or 4096}; a char model without it takes every "
                        f"character of the sample + 256 bytes")
    p.add_argument("--val_fraction", type=float, default=val_fraction,
                   help="fraction of the tokens the validation split takes (exactly, rounded)")
    p.add_argument("--val_tokens", type=int, default=None, metavar="N",
                   help="exactly N validation tokens instead of a fraction (for huge corpora)")
    p.add_argument("--min_val_tokens", type=int, default=1025,
                   help="validation and training each hold at least this many tokens "
                        "(one block + 1)")
    p.add_argument("--sample_bytes", type=int, default=4_000_000,
                   help="size of the seeded sample the tokenizer is trained on")
    p.add_argument("--seed", type=int, default=1337, help="the tokenizer sample and the split")
    p.add_argument("--num_proc", type=int, default=None, metavar="N",
                   help="worker processes (default: every core); the output is the same for any N")


def prepare_options(args):
    return dict(vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                val_tokens=args.val_tokens, min_val_tokens=args.min_val_tokens,
                sample_bytes=args.sample_bytes, seed=args.seed, num_proc=args.num_proc)


def run(main_fn, argv):
    """Call a prepare script's body and turn user mistakes into one line and exit code 1."""
    try:
        return main_fn(argv)
    except PrepareError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("error: interrupted; no output was written")
