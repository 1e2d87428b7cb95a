"""Rank 0's progress line (tokens/s, MFU, eta), a countdown for evaluations, and the signals
that stop a run cleanly."""
import contextlib
import signal
import sys
import time

from tqdm import tqdm


def stop_on_signals():
    """SIGTERM/SIGINT: finish the step in flight, save, exit 0; a second Ctrl-C stops at once,
    a second SIGTERM does not (a launcher's death can deliver two, and the second would kill
    the save in flight). Returns a list that is non-empty once a signal came."""
    stop = []

    def on_signal(signum, frame):
        stop.append(signum)
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return stop


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal; under a pipe or a file (CI, SLURM, `> log`)
    one plain line per log_interval, since a bar's carriage-return updates would write
    megabytes there. Tokens/s is the tokens trained since the last line over the wall time
    since it, evaluations and saves left out (`paused`); with torch.compile the first window,
    which holds the compilation, shows none. MFU: against a GPU's datasheet peak; an MFU above
    100% cannot be right (the peak is wrong), so it is n/a from then on."""

    def __init__(self, start_iter, max_iters, tokens_per_iter, flops_per_token, peak, world,
                 master, compiled=False):
        self.interactive, self.master = sys.stderr.isatty(), master
        self.bar = tqdm(total=max_iters, initial=start_iter, dynamic_ncols=True, unit="it",
                        disable=not master or not self.interactive)
        self.start_iter, self.max_iters, self.t_start = start_iter, max_iters, time.time()
        self.tokens_per_iter = tokens_per_iter
        # the rate's window: its start (time, iteration), the seconds paused in it, whether
        # its rate is shown
        self.mark, self.paused_s, self.show_rate = (self.t_start, start_iter), 0.0, not compiled
        # MFU is per device: the FLOPs of one device's share of the tokens over its peak. With
        # no peak (a CPU) the first lines said why, and the progress line leaves it out.
        self.mfu_per_tok = flops_per_token / world / peak if peak else None
        self.has_peak = bool(peak)

    def log(self, iter_num, loss, grad_norm):
        now = time.time()
        t_mark, it_mark = self.mark
        seconds = now - t_mark - self.paused_s
        tok_s = (iter_num - it_mark) * self.tokens_per_iter / seconds \
            if self.show_rate and seconds > 0 else None
        self.mark, self.paused_s, self.show_rate = (now, iter_num), 0.0, True
        post = {"loss": f"{loss:.4f}", "gnorm": f"{grad_norm:.3f}"}
        if tok_s:
            mfu = self.mfu_per_tok and self.mfu_per_tok * tok_s
            if mfu and mfu > 1:
                self.mfu_per_tok = mfu = None
                self.write("note: MFU came out above 100%: the peak it is measured against is "
                           "too low for this device; MFU is n/a for this run")
            post["tok/s"] = f"{tok_s:,.0f}"  # all ranks together
            if self.has_peak:
                post["mfu"] = f"{100 * mfu:.1f}%" if mfu else "n/a"
        if self.interactive:
            self.bar.update(iter_num - self.bar.n)
            self.bar.set_postfix(post)
            return
        eta = int((now - self.t_start) / (iter_num - self.start_iter)
                  * (self.max_iters - iter_num))
        print(f"iter {iter_num}/{self.max_iters}: " + ", ".join(f"{k} {v}" for k, v in post.items())
              + f", eta {clock(eta)}", flush=True)

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluating, saving) is not training: out of the tokens/s."""
        t0 = time.time()
        try:
            yield
        finally:
            self.paused_s += time.time() - t0

    def batches(self, what, total):
        """A counter for `total` batches a user waits on (an evaluation): see Countdown."""
        return Countdown(what, total, self.interactive, self.master)

    def write(self, line):
        self.bar.write(line)

    def close(self, iter_num):
        self.bar.update(iter_num - self.bar.n)
        self.bar.close()


class Countdown:
    """Progress through `total` batches where a user would otherwise wait in silence (the
    evaluation before iteration 0 took minutes on a busy CPU): on a terminal a tqdm bar that
    appears after a second and is cleared when done; otherwise a plain line with the time
    left, once the first batches say it is more than QUIET_S seconds, and again every
    EVERY_S. Only rank 0 (`shown`) shows it."""
    QUIET_S, EVERY_S = 5.0, 30.0

    def __init__(self, what, total, interactive, shown):
        self.what, self.total, self.n, self.plain = what, total, 0, shown and not interactive
        self.bar = tqdm(total=total, desc=what, unit="batch", leave=False, delay=1.0,
                        dynamic_ncols=True, disable=not shown or not interactive)
        self.t0 = time.time()
        self.said = None  # when the last plain line went out

    def update(self):
        self.n += 1
        self.bar.update()
        if not self.plain or self.n >= self.total:
            return
        now = time.time()
        left = (now - self.t0) / self.n * (self.total - self.n)
        if (left > self.QUIET_S if self.said is None else now - self.said >= self.EVERY_S):
            print(f"{self.what}: {self.n}/{self.total} batches, about {clock(left)} left",
                  flush=True)
            self.said = now

    def close(self):
        self.bar.close()


def clock(seconds):
    """h:mm:ss"""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
