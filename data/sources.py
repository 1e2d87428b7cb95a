"""Stage 1: reading sources. Files and folders -> sources (name, kind, path), and each kind
read as a stream: raw byte blocks (hashed as they pass), gzip members, lines of a .jsonl,
UTF-8 text, parquet column values. Nothing here decides what a document is (documents.py)."""
import codecs
import os
import zlib

from harness.common import UserError

READ_BYTES = 1 << 20      # raw bytes read from a file at a time
TEXT_KINDS = ("text", "paragraphs")  # read as UTF-8 text: a file is a document, or paragraphs


def find_files(paths, extensions=None):
    """Files and folders (walked in sorted order, hidden entries and __pycache__ left out) ->
    (name, path) pairs; a name is the path inside the folder given, '/'-separated, so the
    order and the names do not depend on the machine."""
    found = []
    for given in paths:
        if not os.path.exists(given):
            raise UserError(f"input path {given} does not exist")
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
                inside = os.path.relpath(path, given).replace(os.sep, "/")
                found.append((f"{root_name}/{inside}", path))
    return found


def file_kind(path):
    """jsonl (.jsonl, .jsonl.gz), parquet, or text, from the file name."""
    low = path.lower()
    if low.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    return "parquet" if low.endswith(".parquet") else "text"


def file_sources(files):
    """(name, path) pairs -> sources (name, kind, path); a corpus of exactly one text file is
    of kind "paragraphs", split at blank lines (documents.py)."""
    sources = [(name, file_kind(path), path) for name, path in files]
    if len(sources) == 1 and sources[0][1] == "text":
        sources = [(sources[0][0], "paragraphs", sources[0][2])]
    return sources


def raw_blocks(path, sha=None, bar=None):
    """The bytes of a file in blocks of READ_BYTES; `sha` and `bar`, if given, count each."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(READ_BYTES), b""):
            if sha is not None:
                sha.update(block)
            if bar is not None:
                bar.update(len(block))
            yield block


def gunzip(blocks, path):
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
        raise UserError(f"{path} is not a valid gzip file ({e})")
    if not d.eof:
        raise UserError(f"{path} is not a valid gzip file (it ends before its data does)")


def lines(blocks):
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


def decoded(blocks, path):
    """UTF-8 text of byte blocks, every byte kept (CRLF too); a bad byte: UnicodeError, offset."""
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


def parquet_texts(path, fields):
    """The values of the first column named in `fields` that the file has, row by row."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs the pyarrow package: pip install pyarrow")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for a file it cannot read
        raise UserError(f"{path} is not a readable parquet file ({e})")
    names = pf.schema_arrow.names
    field = next((f for f in fields if f in names), None)
    if field is None:
        wanted = " or ".join(repr(f) for f in fields)
        raise UserError(f"{path} has no column {wanted} (its columns: {', '.join(names)}); "
                        f"pass --text_field")
    ftype = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(ftype) or pa.types.is_large_string(ftype)):
        raise UserError(f"{path}: column {field!r} holds {ftype}, not strings")
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        yield from batch.column(0).to_pylist()
