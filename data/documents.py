"""Stage 2: documents, by one rule shared by prepare and eval.py: a text file is a document (a
corpus of a single text file: its paragraphs, split at blank lines); a .jsonl(.gz) line or a
parquet row is a record whose document is the first of the text fields it has; a document of
nothing but whitespace is none. A long document comes in pieces (text, first, last) cut at line
ends, and the pieces go to the workers in batches of about TASK_CHARS characters."""
import hashlib
import json
import os
import re

from data.shared import cut_point
from harness import progress_waits
from harness.common import UserError
from data.sources import TEXT_KINDS, decoded, gunzip, lines, parquet_texts, raw_blocks

TASK_CHARS = 1 << 20      # text handed to one worker at once
PIECE_CHARS = 1 << 20     # longer documents are encoded in pieces cut at line ends
PARAGRAPH_SEP = re.compile(r"(\n(?:[ \t\r\f\v]*\n)+)")
SKIP_HINT = "; pass --undecodable=skip to leave such {} out"
NO_FIELD = "has no field"  # how a record without any of the text fields is described
FIELD_HINT = ("pass --text_field=NAME with the field its records use (several names, the first "
              "present wins: --text_field=text,content)")


def text_fields(spec):
    """--text_field "text,content" -> ("text", "content"): the first one a record has wins."""
    fields = tuple(f.strip() for f in spec.split(",") if f.strip())
    if not fields:
        raise UserError(f"--text_field names no field: {spec!r}")
    return fields


def split_paragraphs(text):
    """Paragraphs of a text, separated by blank (or whitespace-only) lines, which are dropped:
    the reference for the streaming splitter `paragraphs`."""
    return [p for p in PARAGRAPH_SEP.split(text)[::2] if p.strip()]


def paragraphs(texts):
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


def in_pieces(texts):
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


def record_text(line, fields):
    """(text, None) from one .jsonl line, or (None, what is wrong with the record)."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        return None, "is not valid UTF-8"
    except ValueError as e:
        return None, f"is not valid JSON ({e.args[0].split(':')[0]})"
    if not isinstance(record, dict):
        return None, "is not a JSON object"
    field = next((f for f in fields if f in record), None)
    if field is None:
        names = " or ".join(repr(f) for f in fields)
        keys = ", ".join(list(record)[:8]) or "none"
        return None, f"{NO_FIELD} {names} (its fields: {keys})"
    if not isinstance(record[field], str):
        return None, f"field {field!r} is {type(record[field]).__name__}, not a string"
    return record[field], None


def documents(kind, name, items, fields, skip, stats, hint=True):
    """(location, text, first, last) of a batch's documents. A bad record is counted in
    stats["skipped"] (and "no_field") under skip, else stops the batch with stats["error"]."""
    for loc, payload, first, last in items:
        where = f"{name} line {loc}" if kind == "json" else f"{name} row index {loc}"
        problem = None
        if kind == "json":
            if not payload.strip():
                continue  # blank lines between records
            payload, problem = record_text(payload, fields)
        elif not isinstance(payload, str):  # a parquet value
            problem = f"text is {type(payload).__name__}, not a string"
        if problem:
            if not skip:  # one line; a missing field names --text_field first
                field_hint = "; " + FIELD_HINT if problem.startswith(NO_FIELD) else ""
                skip_hint = SKIP_HINT.format("records") if hint else ""
                stats["error"] = f"{where}: the record {problem}{field_hint}{skip_hint}"
                return
            stats["skipped"] += 1
            stats["no_field"] = stats.get("no_field", 0) + problem.startswith(NO_FIELD)
            continue
        if first and last and (not payload or payload.isspace()):
            continue  # an empty document
        yield loc, payload, first, last


def tasks(sources, fields, undecodable, skip_files=(), skipped=None, hashes=None, bar=None,
          hint=True):
    """Batches of work in corpus order: (kind, source index, name, items), items being
    (location, payload, first, last), payload a raw JSON line (kind 'json') or a text. Files
    not UTF-8 go to `skipped` (undecodable=skip); `hashes`, if given, gets each sha256."""
    bar = progress_waits.bar(disable=True) if bar is None else bar
    for si, (name, kind, where) in enumerate(sources):
        if si in skip_files:
            continue
        sha = hashlib.sha256() if hashes is not None else None
        try:
            yield from source_tasks(si, name, kind, where, fields, sha, bar)
        except UnicodeError as e:
            if undecodable != "skip":
                raise UserError(f"{e}" + (SKIP_HINT.format("files") if hint else ""))
            skipped.append(si)
            continue  # neither hashed nor counted
        if hashes is not None:
            hashes.append((name, sha.hexdigest()))


def source_tasks(si, name, kind, where, fields, sha, bar):
    """The batches of one source (see tasks); `sha` receives its content hash."""
    if kind in TEXT_KINDS + ("jsonl",):
        blocks = raw_blocks(where, sha, bar)
        if where.lower().endswith(".gz"):
            blocks = gunzip(blocks, where)
    if kind == "jsonl":
        items = ((i + 1, line, True, True) for i, line in enumerate(lines(blocks)))
        yield from batched(items, "json", si, where)
    elif kind in TEXT_KINDS:
        split = paragraphs if kind == "paragraphs" else in_pieces
        pieces = split(decoded(blocks, where))
        yield from batched(((i, *piece) for i, piece in enumerate(pieces)), "text", si, where)
    elif kind == "parquet":
        if sha is not None:
            for _ in raw_blocks(where, sha):  # the content hash needs one plain read
                pass
        items = ((i, t, True, True) for i, t in enumerate(parquet_texts(where, fields)))
        yield from batched(items, "text", si, where)
        bar.update(os.path.getsize(where))
    else:  # "docs": documents in memory, `where` returns an iterable of texts
        def texts():
            for t in where():
                if sha is not None:
                    sha.update(t.encode("utf-8") + b"\0")
                bar.update(len(t))
                yield t
        yield from batched(((i, t, True, True) for i, t in enumerate(texts())), "text", si, name)


def batched(items, kind, si, name):
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += len(item[1]) if item[1] is not None else 0
        if size >= TASK_CHARS:
            yield kind, si, name, batch
            batch, size = [], 0
    if batch:
        yield kind, si, name, batch


def whole_documents(sources, fields):
    """(source index, text) of every document, whole, by the code that feeds prepare's workers
    (for eval.py); any bad record or undecodable file is an error."""
    stats, pieces = {"skipped": 0, "error": None}, []
    for kind, si, name, items in tasks(sources, fields, "fail", hint=False):
        for _, text, first, last in documents(kind, name, items, fields, False, stats, False):
            pieces.append(text)
            if last:
                yield si, "".join(pieces)
                pieces = []
        if stats["error"]:
            raise UserError(stats["error"])
