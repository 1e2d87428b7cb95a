"""The progress every wait shows (the data stages, eval.py's scoring, train.py's evaluations,
bench timings): a tqdm bar on a terminal; under a pipe or a file (CI, SLURM, `> log`) a plain
line now and then, since a bar's carriage-return redraws would pile up in a log and silence
leaves a user guessing for minutes. The training loop's own line is harness/progress_loop.py."""
import sys
import time

from tqdm import tqdm

QUIET_S = 5.0   # a wait shorter than this prints no line at all; a longer one, its first here
EVERY_S = 30.0  # then a line every this many seconds


def bar(iterable=None, total=None, desc="", unit="it", shown=True, out=None, **kwargs):
    """A tqdm bar on a terminal (kwargs go to it), else Lines; nothing where not `shown` (a
    rank other than 0). Plain lines go to `out`, stderr by default (stdout stays the data)."""
    if not shown or kwargs.get("disable") or sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, dynamic_ncols=True,
                    **{**kwargs, "disable": not shown or kwargs.get("disable", False)})
    return Lines(iterable, total, desc, unit, kwargs.get("unit_scale", False), out)


class Lines:
    """What a tqdm bar shows, as a plain line: the first once QUIET_S seconds have passed, then
    one every EVERY_S, each with the time left: the time per item since the first update x the
    items left (none before a second update). The first items carry the start-up (worker
    processes coming up, a first compile), which an estimate from them multiplies: from its
    first 5 kB of 31 MB the default corpus's prepare said "about 04:12 left" 10 s before it
    ended, and train.py's first evaluation "about 02:17 left" after compiling for 45 s."""

    def __init__(self, iterable=None, total=None, desc="", unit="it", unit_scale=False,
                 out=None):
        self.iterable, self.desc, self.unit, self.scale = iterable, desc, unit, unit_scale
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self.out, self.n, self.t0, self.said, self.first = out, 0, time.time(), None, None

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()

    def update(self, n=1):
        self.n += n
        now = time.time()
        self.first = self.first or (now, self.n)  # the rate is timed from here
        elapsed, (t1, n1) = now - self.t0, self.first
        left = ((now - t1) / (self.n - n1) * (self.total - self.n)
                if self.total and self.n > n1 else None)
        if self.said is None and elapsed < QUIET_S:
            return
        if self.said is not None and now - self.said < EVERY_S:
            return
        self.said = now
        size = tqdm.format_sizeof if self.scale else "{:,}".format
        done = f"{size(self.n)}/{size(self.total)}" if self.total else size(self.n)
        more = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        more += f", about {tqdm.format_interval(left)} left" if left is not None else ""
        print(f"{self.desc}: {done} {self.unit}{more}, {tqdm.format_interval(elapsed)} so far",
              file=self.out or sys.stderr, flush=True)

    def set_postfix(self, *args, **kwargs):
        pass

    def write(self, text):
        print(text, file=self.out or sys.stderr, flush=True)

    def close(self):
        pass
