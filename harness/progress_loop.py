"""Rank 0's progress line in the training loop (tokens/s, MFU, eta). The progress of other
waits (evaluations, data stages) is harness/progress_waits.py."""
import contextlib
import sys
import time

from tqdm import tqdm


class Progress:
    """A tqdm bar on a terminal, else one plain line per log_interval (a bar's redraws would
    write megabytes into a log). Tokens/s: the tokens since the last line over the time since
    it, evaluations and saves left out (`paused`); none for a compiled run's first window (the
    compilation). MFU against a GPU's datasheet peak; above 100% the peak is wrong: n/a."""

    def __init__(self, start_iter, max_iters, start_tokens, flops_per_token, peak, world,
                 master, compiled=False):
        self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=max_iters, initial=start_iter, dynamic_ncols=True, unit="it",
                        disable=not master or not self.interactive)
        self.start_iter, self.max_iters, self.t_start = start_iter, max_iters, time.time()
        # the rate's window: its start (time, tokens seen), seconds paused in it, rate shown?
        self.mark, self.paused_s, self.show_rate = (self.t_start, start_tokens), 0.0, not compiled
        # per device: the FLOPs of one device's share of the tokens over its peak (none: a CPU)
        self.mfu_per_tok = flops_per_token / world / peak if peak else None
        self.has_peak = bool(peak)

    def log(self, iter_num, tokens, loss, grad_norm):
        now = time.time()
        t_mark, tokens_mark = self.mark
        seconds = now - t_mark - self.paused_s
        tok_s = (tokens - tokens_mark) / seconds if self.show_rate and seconds > 0 else None
        self.mark, self.paused_s, self.show_rate = (now, tokens), 0.0, True
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
        eta = (now - self.t_start) / (iter_num - self.start_iter) * (self.max_iters - iter_num)
        print(f"iter {iter_num}/{self.max_iters}: " + ", ".join(f"{k} {v}" for k, v in post.items())
              + f", eta {tqdm.format_interval(eta)}", flush=True)

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluating, saving) is not training: out of the tokens/s."""
        t0 = time.time()
        try:
            yield
        finally:
            self.paused_s += time.time() - t0

    def write(self, line):
        self.bar.write(line)

    def close(self, iter_num):
        self.bar.update(iter_num - self.bar.n)
        self.bar.close()

