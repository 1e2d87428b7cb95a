"""
One attention layer, forward + backward: softmax (SDPA) vs linear attention (eq. 19, chunked)
across sequence lengths, and what RoPE costs over no position encoding.

    python bench/attention.py                      # N = 512 .. 8192, batch 1, 6 heads x 64
    python bench/attention.py --lengths 1024,4096 --reps 5

Time is the median of --reps runs after a warm-up. Peak memory is measured in a fresh
process per row (peak RSS minus the RSS after setup), so rows do not see each other's
allocations. The RoPE/none columns time the same layer with and without RoPE alternately in
one process, so load changes hit both alike. Ratios from one run are what to quote: the machine is shared and noisy.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import Attention, RoFormerConfig, rope_table  # noqa: E402


def run_one(attention, pos, N, n_embd, n_head, reps, chunk):
    """Time and peak memory of fwd+bwd of one layer; runs inside its own process. With
    pos="both", the same layer runs with RoPE and without, alternating rep by rep, so the
    ratio of the two is not at the mercy of load changes between processes."""
    torch.manual_seed(0)
    cfg = RoFormerConfig(vocab_size=8, block_size=N, n_layer=1, n_head=n_head, n_embd=n_embd,
                         attention=attention, pos_encoding="rope" if pos == "both" else pos,
                         linear_chunk=chunk)
    layer = Attention(cfg)
    x = torch.randn(1, N, n_embd, requires_grad=True)
    table = rope_table(torch.arange(N), n_embd // n_head)
    kinds = {"rope": table, "none": None} if pos == "both" else {pos: table if pos == "rope" else None}
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = {k: [] for k in kinds}
    for i in range(reps + 1):
        for k, rope in kinds.items():
            t0 = time.perf_counter()
            layer(x, rope).sum().backward()
            times[k].append(time.perf_counter() - t0)
            layer.zero_grad(set_to_none=True)
            x.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    med = {k: sorted(t[1:])[len(t[1:]) // 2] for k, t in times.items()}
    if pos == "both":
        return {"rope_over_none": med["rope"] / med["none"]}
    return {"ms": 1000 * med[pos], "peak_mib": peak / 1024}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192")
    ap.add_argument("--n_embd", type=int, default=384)
    ap.add_argument("--n_head", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: attention,pos,N
    a = ap.parse_args()
    if a.one:
        attention, pos, N = a.one.split(",")
        print(json.dumps(run_one(attention, pos, int(N), a.n_embd, a.n_head, a.reps, a.chunk)))
        return

    def measure(attention, pos, N):
        cmd = [sys.executable, __file__, "--one", f"{attention},{pos},{N}", "--n_embd",
               str(a.n_embd), "--n_head", str(a.n_head), "--reps", str(a.reps), "--chunk",
               str(a.chunk)]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    Ns = [int(n) for n in a.lengths.split(",")]
    print(f"# one attention layer, fwd+bwd, batch 1, {a.n_head} heads x {a.n_embd // a.n_head}, "
          f"linear chunk {a.chunk}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("|     N | softmax ms | linear ms | linear/softmax | softmax MiB | linear MiB "
          "| softmax RoPE/none | linear RoPE/none |")
    print("|------:|-----------:|----------:|---------------:|------------:|-----------:"
          "|------------------:|-----------------:|")
    rows = {}
    for N in Ns:
        r = {(k, p): measure(k, p, N) for k in ("softmax", "linear") for p in ("rope", "both")}
        rows[N] = r
        s, lin = r[("softmax", "rope")], r[("linear", "rope")]
        print(f"| {N:5d} | {s['ms']:10.1f} | {lin['ms']:9.1f} | {lin['ms'] / s['ms']:14.2f} "
              f"| {s['peak_mib']:11.1f} | {lin['peak_mib']:10.1f} "
              f"| {r[('softmax', 'both')]['rope_over_none']:17.3f} "
              f"| {r[('linear', 'both')]['rope_over_none']:16.3f} |", flush=True)
    if len(Ns) > 1:
        lo, hi = Ns[0], Ns[-1]
        for k in ("softmax", "linear"):
            ratio = rows[hi][(k, "rope")]["ms"] / rows[lo][(k, "rope")]["ms"]
            print(f"{k}: time x{ratio:.1f} from N={lo} to N={hi} "
                  f"(linear in N would be x{hi / lo:.0f}, quadratic x{(hi / lo) ** 2:.0f})")


if __name__ == "__main__":
    main()
