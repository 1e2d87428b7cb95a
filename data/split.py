"""Stage 5: the split. Validation takes an exact budget of tokens from the token file, picked
document by document along the corpus; training is compacted in place in the same file, so
the split needs no second copy of the corpus (docs/DATA.md)."""
import os

import numpy as np

from data.shared import EOS_ID, mix64

SPLIT_CHUNK = 1 << 22     # tokens the split reads at a time
PICK_AHEAD = 4096         # documents tested at once for the next validation pick


class TokenSplit:
    """A split in progress: the token file `fd`, compacted in place into training, and val."""

    def __init__(self, fd, val_file, dtype, newline_id):
        self.fd, self.val_file, self.dtype, self.newline_id = fd, val_file, dtype, newline_id
        self.eos_bytes = np.array([EOS_ID], dtype=dtype).tobytes()
        self.train_end = 0   # tokens of the training split written (compacted) so far
        self.pending = None  # (start, end): a run of training tokens not moved yet
        self.val_tokens = self.train_docs = self.val_docs = self.cut = 0

    def read(self, start, end):
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self.fd, (end - start) * size, start * size),
                             dtype=self.dtype)

    def flush(self):
        """Move the pending run of training tokens down to the end of the training split."""
        if self.pending:
            start, end = self.pending
            if self.train_end != start:  # nothing to move until the first validation piece
                for s in range(start, end, SPLIT_CHUNK):
                    e = min(end, s + SPLIT_CHUNK)
                    os.pwrite(self.fd, self.read(s, e).tobytes(),
                              (self.train_end + s - start) * self.dtype.itemsize)
            self.train_end += end - start
            self.pending = None

    def to_train(self, start, end, docs=1):
        if self.pending and self.pending[1] == start:
            self.pending = (self.pending[0], end)
        else:
            self.flush()
            self.pending = (start, end)
        self.train_docs += docs

    def to_val(self, start, end, eos):
        self.flush()
        for s in range(start, end, SPLIT_CHUNK):
            self.val_file.write(self.read(s, min(end, s + SPLIT_CHUNK)).tobytes())
        if eos:
            self.val_file.write(self.eos_bytes)
        self.val_tokens += end - start + eos
        self.val_docs += 1

    def last_newline(self, start, lo, hi):
        """Largest L in [lo, hi] whose prefix start..start+L ends with a newline, or None."""
        while hi >= max(lo, 1):
            s = max(lo, 1, hi - SPLIT_CHUNK)
            hits = np.flatnonzero(self.read(start + s - 1, start + hi) == self.newline_id)
            if len(hits):
                return s + int(hits[-1])
            hi = s - 1
        return None

    def take(self, start, end, want, least):
        """`want` tokens of the document start..end to validation, at least `least`: all of
        it, or a prefix of L content tokens + its own EOS, preferably cut after a newline."""
        if want >= end - start:
            self.to_val(start, end, False)
            return
        cut = self.last_newline(start, max(least - 1, 0), want - 1) if want > 0 else None
        if cut is None and least > 0:
            cut = least - 1
        if cut is None:
            self.to_train(start, end)
        else:
            self.to_val(start, start + cut, True)
            self.to_train(start + cut, end)
            self.cut += 1


def pick_documents(split, starts, ends, uniforms, total, budget):
    """Send the documents starts[i]..ends[i] (in corpus order) to one split or the other.
    Validation, holding V, takes a document ending at e when what it owes, budget * e / total
    - V, is at least the seeded uniform u_i times its length; and always at least what the rest
    of the corpus could no longer supply, so the budget is met exactly."""
    rate = budget / total
    lengths = ends - starts
    i = 0
    while i < len(ends):
        # The next document that validation takes any of, found in bulk.
        j = min(len(ends), i + PICK_AHEAD)
        held = split.val_tokens
        owed = ends[i:j] * rate - held
        hit = (owed >= lengths[i:j] * uniforms[i:j]) | (budget - held > total - ends[i:j])
        k = i + int(np.argmax(hit)) if hit.any() else j
        if k > i:
            split.to_train(int(starts[i]), int(ends[k - 1]), docs=k - i)
        if k == j:
            i = j
            continue
        start, end, n = int(starts[k]), int(ends[k]), int(lengths[k])
        least = max(0, budget - held - (total - end))  # what only this document can give
        want = n if end * rate - held >= n * uniforms[k] else 0
        split.take(start, end, min(max(want, least), n, budget - held), least)
        i = k + 1


def split_tokens(path, val_path, dtype, total, budget, seed, newline_id, bar=None):
    """Move exactly `budget` tokens of the token file at `path` to val_path and compact the rest
    in place (pick_documents; a document too large for the budget left is cut after a newline:
    TokenSplit.take). Returns (train tokens, val tokens, train pieces, val pieces, cuts)."""
    dtype = np.dtype(dtype)
    fd = os.open(path, os.O_RDWR)
    try:
        with open(val_path, "wb") as val_file:
            split = TokenSplit(fd, val_file, dtype, newline_id)
            start, doc, done = 0, 0, 0  # start of the current document, its index, tokens read
            while done < total:
                chunk = split.read(done, min(total, done + SPLIT_CHUNK))
                if not len(chunk):
                    raise OSError(f"{path} ends after {done} of its {total} tokens")
                ends = done + np.flatnonzero(chunk == EOS_ID) + 1
                done += len(chunk)
                if bar is not None:
                    bar.update(len(chunk) * dtype.itemsize)
                starts = np.concatenate([[start], ends[:-1]]) if len(ends) else ends
                uniforms = mix64(mix64(seed, 0x5EED), doc + np.arange(len(ends), dtype=np.uint64))
                uniforms = (uniforms >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
                pick_documents(split, starts, ends, uniforms, total, budget)
                start = int(ends[-1]) if len(ends) else start
                doc += len(ends)
            split.flush()
            os.ftruncate(fd, split.train_end * dtype.itemsize)
    finally:
        os.close(fd)
    assert split.val_tokens == budget, (split.val_tokens, budget)
    return split.train_end, split.val_tokens, split.train_docs, split.val_docs, split.cut
