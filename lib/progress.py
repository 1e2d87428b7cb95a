"""Rank 0's progress line (tokens/s, MFU, eta) and the signals that stop a run cleanly."""
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
    megabytes there. Tokens/s is smoothed over steps, the first (compilation) ones skipped.
    An MFU above 100% cannot be right: the peak is wrong (a CPU's, timed while the machine was
    busy), so it is n/a from then on."""

    def __init__(self, start_iter, max_iters, tokens_per_iter, flops_per_token, peak, world,
                 master):
        self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=max_iters, initial=start_iter, dynamic_ncols=True, unit="it",
                        disable=not master or not self.interactive)
        self.start_iter, self.max_iters, self.t_start = start_iter, max_iters, time.time()
        self.tokens_per_iter, self.tok_s = tokens_per_iter, None
        # MFU is per device: the FLOPs of one device's share of the tokens over its peak
        self.mfu_per_tok = flops_per_token / world / peak if peak else None

    def log(self, iter_num, loss, grad_norm, dt):
        rate = self.tokens_per_iter / dt
        if iter_num - self.start_iter > 2:
            self.tok_s = rate if self.tok_s is None else 0.9 * self.tok_s + 0.1 * rate
        post = {"loss": f"{loss:.4f}", "gnorm": f"{grad_norm:.3f}"}
        if self.tok_s:
            mfu = self.mfu_per_tok and self.mfu_per_tok * self.tok_s
            if mfu and mfu > 1:
                self.mfu_per_tok = mfu = None
                self.write("note: MFU came out above 100%: the peak it is measured against is "
                           "too low (timed while the machine was busy?); MFU is n/a for this "
                           "run")
            post["tok/s"] = f"{self.tok_s:,.0f}"  # all ranks together
            post["mfu"] = f"{100 * mfu:.1f}%" if mfu else "n/a"
        if self.interactive:
            self.bar.update(iter_num - self.bar.n)
            self.bar.set_postfix(post)
            return
        eta = int((time.time() - self.t_start) / (iter_num - self.start_iter)
                  * (self.max_iters - iter_num))
        print(f"iter {iter_num}/{self.max_iters}: " + ", ".join(f"{k} {v}" for k, v in post.items())
              + f", eta {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}", flush=True)

    def write(self, line):
        self.bar.write(line)

    def close(self, iter_num):
        self.bar.update(iter_num - self.bar.n)
        self.bar.close()
