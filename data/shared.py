"""What every stage of data/ shares, so that none imports another just for these and the
imports stay one-way: the special token ids, the names of the outputs, small helpers."""
import sys
import time

import numpy as np

OUTPUTS = ("train.bin", "val.bin", "tokenizer.model", "tokenizer.vocab", "meta.json")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


LINE_EVERY = 30.0  # seconds between two progress lines where stderr is not a terminal


def tqdm(*args, **kwargs):
    """Progress on stderr: a tqdm bar on a terminal; under a pipe or a file (CI, `> log`) a
    plain line every LINE_EVERY seconds with an estimate of the time left (Lines)."""
    from tqdm import tqdm as bar
    if kwargs.get("disable") or sys.stderr.isatty():
        return bar(*args, **{"dynamic_ncols": True, **kwargs})
    return Lines(*args, **kwargs)


class Lines:
    """What a tqdm bar shows, as a plain line now and then: a bar's carriage-return redraws
    would pile up in a log, and silence leaves a user guessing for minutes. The first line
    waits LINE_EVERY seconds too, so a short wait prints nothing."""

    def __init__(self, iterable=None, total=None, desc="", unit="it", unit_scale=False, **_):
        self.iterable, self.desc, self.unit, self.scale = iterable, desc, unit, unit_scale
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self.n, self.start = 0, time.monotonic()
        self.last = self.start

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()

    def update(self, n=1):
        self.n += n
        now = time.monotonic()
        if now - self.last >= LINE_EVERY:
            self.last = now
            print(self.line(now - self.start), file=sys.stderr, flush=True)

    def line(self, elapsed):
        from tqdm import tqdm as bar
        size = bar.format_sizeof if self.scale else "{:,}".format
        done = f"{size(self.n)}/{size(self.total)}" if self.total else size(self.n)
        left = ""
        if self.total and self.n:
            left = (f" ({100 * self.n / self.total:.0f}%), about "
                    f"{bar.format_interval(elapsed * (self.total - self.n) / self.n)} left")
        return f"{self.desc}: {done} {self.unit}{left}, {bar.format_interval(elapsed)} so far"

    def set_postfix(self, *args, **kwargs):
        pass

    def write(self, text):
        print(text, file=sys.stderr, flush=True)

    def close(self):
        pass


def dtype_for_vocab(vocab_size):
    # ids run from 0 to vocab_size - 1; uint16 holds up to 65535.
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def mix64(a, b):
    """A 64-bit hash of two uint64 arrays (splitmix64 finalizer): seeded keys that are the
    same on every machine and for any batching, unlike a stream of random draws."""
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
        x = np.asarray(a, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x = x ^ np.asarray(b, dtype=np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def cut_point(text, limit):
    """Where to cut text longer than limit: after the last newline before limit (a newline
    is a token of its own, so both sides encode exactly as the whole would), else before the
    last space, else at limit."""
    i = text.rfind("\n", 0, limit)
    if i >= 0:
        return i + 1
    i = text.rfind(" ", 1, limit)
    return i if i > 0 else limit
