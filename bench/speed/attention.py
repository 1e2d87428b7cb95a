"""
One attention layer, forward + backward: softmax (SDPA) vs linear attention (eq. 19, chunked)
across sequence lengths, and what RoPE costs over no position encoding.

    python bench/speed/attention.py                      # N = 512 .. 8192, batch 1, 6 heads x 64
    python bench/speed/attention.py --lengths 1024,4096 --reps 5
    python bench/speed/attention.py --positions          # RoPE vs the baselines, N = 512,2048,8192
    python bench/speed/attention.py --flex --lengths 1024,2048   # SDPA float mask vs flex_attention
    python bench/speed/attention.py --decode             # cached decoding per position encoding
    python bench/speed/attention.py --kernels --lengths 32,64,128,256 --n_embd 128 --n_head 4

--positions: one softmax layer, fwd+bwd, for rope, learned, shaw, t5, alibi: time, peak
memory and the ratio to rope. learned adds its table to the embeddings, so in one layer it
is attention without positions. The relative biases are built inside the timed step (t5 and
alibi build theirs once per model forward, so in a deep model that share is amortised).
--flex: forward only (flex_attention has no backward on CPU), the ALiBi and T5 biases as an
SDPA float mask vs a compiled flex_attention score_mod with a causal block mask.
--decode: the small config's model shape, random weights, tokens/s of generate(use_cache=True)
at batch 1 past block_size (rolling cache), and the cache bytes held per cached token.

--kernels: SDPA's CPU kernels, flash against math (the plain product), causal, forward +
backward at batch 12 (the speedrun's), in float32 and bf16, the two alternated in one process;
train.py turns flash off where math wins (harness/start.py).

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from decode import generate  # noqa: E402
from model import Attention, Positions, RoFormer, RoFormerConfig, rope_table  # noqa: E402

LENGTHS = "512,1024,2048,4096,8192"
POSITIONS = ("rope", "learned", "shaw", "t5", "alibi")


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
    kinds = {k: Positions(torch.arange(N), {0: rope}, own={0: (None, None)})  # plain causal
             for k, rope in kinds.items()}
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = {k: [] for k in kinds}
    for i in range(reps + 1):
        for k, where in kinds.items():
            t0 = time.perf_counter()
            layer(x, where).sum().backward()
            times[k].append(time.perf_counter() - t0)
            layer.zero_grad(set_to_none=True)
            x.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    med = {k: sorted(t[1:])[len(t[1:]) // 2] for k, t in times.items()}
    if pos == "both":
        return {"rope_over_none": med["rope"] / med["none"]}
    return {"ms": 1000 * med[pos], "peak_mib": peak / 1024}


def position_step(pos, N, n_embd, n_head):
    """One fwd+bwd of the softmax layer of a 1-layer model with positions `pos`, bias
    included (built as RoFormer.forward builds it), as a function to call."""
    torch.manual_seed(0)
    model = RoFormer(RoFormerConfig(vocab_size=8, block_size=N, n_layer=1, n_head=n_head,
                                    n_embd=n_embd, pos_encoding=pos))
    layer = model.blocks[0].attn  # the t5 table lives in the model, shaw's in the layer
    x = torch.randn(1, N, n_embd, requires_grad=True)
    p = torch.arange(N)

    def step():
        where = model.designs(x, p, None)[1]  # as RoFormer.forward builds them
        layer(x, where).sum().backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
    return step


def position_peak(pos, N, n_embd, n_head):
    """Peak RSS growth (MiB) of one fwd+bwd step; runs inside its own process."""
    step = position_step(pos, N, n_embd, n_head)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024


def flex_vs_sdpa(Ns, n_embd, n_head, reps):
    """Forward-only ms of the ALiBi / T5 bias as an SDPA float mask vs a flex_attention
    score_mod (compiled, causal block mask), next to plain causal SDPA."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from baselines import alibi_slopes, t5_bucket
    flex = torch.compile(flex_attention)
    H, D = n_head, n_embd // n_head
    slopes, table = torch.tensor(alibi_slopes(H)), torch.randn(32, H)

    def med(fn):
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return 1000 * sorted(ts[1:])[len(ts[1:]) // 2]

    print("| N | causal SDPA ms | alibi SDPA mask | alibi flex | t5 SDPA mask | t5 flex |")
    print("|--:|--:|--:|--:|--:|--:|")
    with torch.no_grad():
        for N in Ns:
            q, k, v = torch.randn(3, 1, H, N, D)
            d = torch.arange(N)[:, None] - torch.arange(N)[None, :]
            block = create_block_mask(lambda b, h, i, j: i >= j, None, None, N, N, device="cpu")
            alibi_mod = lambda s, b, h, i, j: s - slopes[h] * (i - j)  # noqa: E731
            t5_mod = lambda s, b, h, i, j: s + table[t5_bucket(i - j), h]  # noqa: E731
            r = {"causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 "alibi_sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=(
                     -slopes[:, None, None] * d).masked_fill(d < 0, float("-inf"))),
                 "alibi_flex": lambda: flex(q, k, v, score_mod=alibi_mod, block_mask=block),
                 "t5_sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=(
                     table[t5_bucket(d)].permute(2, 0, 1).masked_fill(d < 0, float("-inf")))),
                 "t5_flex": lambda: flex(q, k, v, score_mod=t5_mod, block_mask=block)}
            ms = {name: med(fn) for name, fn in r.items()}
            print(f"| {N} | {ms['causal']:.1f} | {ms['alibi_sdpa']:.1f} | {ms['alibi_flex']:.1f} "
                  f"| {ms['t5_sdpa']:.1f} | {ms['t5_flex']:.1f} |", flush=True)


def sdpa_kernels(Ns, n_embd, n_head, reps):
    """Forward + backward ms of causal SDPA with the flash kernel and with math, batch 12."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    H, D = n_head, n_embd // n_head
    print("| dtype | N | flash ms | math ms | math / flash |")
    print("|---|--:|--:|--:|--:|")
    for dtype in (torch.float32, torch.bfloat16):
        for N in Ns:
            q, k, v = (torch.randn(12, H, N, D, dtype=dtype, requires_grad=True) for _ in range(3))
            times = {SDPBackend.FLASH_ATTENTION: [], SDPBackend.MATH: []}
            for _ in range(reps + 1):  # the first round warms up
                for kernel, ts in times.items():
                    t0 = time.perf_counter()
                    with sdpa_kernel(kernel):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                    ts.append(time.perf_counter() - t0)
            flash, math_ = (1000 * sorted(ts[1:])[len(ts[1:]) // 2] for ts in times.values())
            print(f"| {str(dtype)[6:]} | {N} | {flash:.2f} | {math_:.2f} | {math_ / flash:.2f} |",
                  flush=True)


@torch.no_grad()
def decode_speed(new_tokens, reps):
    """Tokens/s of cached generation per position encoding, batch 1, inside block_size and
    past it (the rolling cache), and the bytes the cache holds per cached token. Shape:
    config/small.py's defaults."""
    shape = dict(vocab_size=4096, block_size=256, n_layer=6, n_head=6, n_embd=384)
    inside = shape["block_size"] - 16
    print(f"# cached decode, batch 1, greedy, 16-token prompt + {inside} (inside block_size) "
          f"or {new_tokens} (past it) new tokens, best of {reps}; {shape}")
    print(f"| positions | tok/s, {inside} new | vs rope | tok/s, {new_tokens} new | vs rope "
          f"| cache bytes per token |")
    print("|---|--:|--:|--:|--:|--:|")
    models = {}
    for pos in POSITIONS:
        torch.manual_seed(0)
        models[pos] = RoFormer(RoFormerConfig(**shape, pos_encoding=pos)).eval()
        generate(models[pos], torch.zeros(1, 4, dtype=torch.long), 4)  # warm-up
    idx = torch.randint(shape["vocab_size"], (1, 16))
    secs = {(p, n): [] for p in POSITIONS for n in (inside, new_tokens)
            if not (p == "learned" and n > inside)}  # learned positions end at block_size
    for _ in range(reps):  # round-robin, so load changes hit every encoding alike
        for pos, n in secs:
            t0 = time.perf_counter()
            generate(models[pos], idx, n, temperature=0)
            secs[(pos, n)].append(time.perf_counter() - t0)
    rate = {k: k[1] / min(s) for k, s in secs.items()}
    for pos, m in models.items():
        cache = m.new_cache(shape["block_size"], "cpu")
        m(idx, cache=cache, start_pos=0)  # allocate the cache, then count what one slot holds
        per_token = sum(t.numel() * t.element_size() for t in cache.keys + cache.values
                        ) / cache.slot_pos.size(-1)
        cells = [f"{rate[(pos, n)]:.1f} | {rate[(pos, n)] / rate[('rope', n)]:.2f}"
                 if (pos, n) in rate else "n/a | n/a" for n in (inside, new_tokens)]
        print(f"| {pos} | {' | '.join(cells)} | {per_token:.0f} |", flush=True)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default=LENGTHS)
    ap.add_argument("--n_embd", type=int, default=384)
    ap.add_argument("--n_head", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--positions", action="store_true",
                    help="RoPE vs learned, shaw, t5, alibi (default lengths 512,2048,8192)")
    ap.add_argument("--flex", action="store_true", help="SDPA float mask vs flex_attention")
    ap.add_argument("--decode", action="store_true", help="cached decode per position encoding")
    ap.add_argument("--kernels", action="store_true", help="SDPA flash vs math, fwd+bwd")
    ap.add_argument("--new_tokens", type=int, default=512, help="--decode: tokens generated")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: attention,pos,N
    ap.add_argument("--one_pos", help=argparse.SUPPRESS)  # internal: pos,N
    return ap.parse_args()


def main():
    a = parse_args()
    if a.one_pos:
        pos, N = a.one_pos.split(",")
        print(position_peak(pos, int(N), a.n_embd, a.n_head))
        return
    if a.flex:
        flex_vs_sdpa([int(n) for n in a.lengths.split(",")], a.n_embd, a.n_head, a.reps)
        return
    if a.decode:
        decode_speed(a.new_tokens, a.reps)
        return
    if a.kernels:
        sdpa_kernels([int(n) for n in a.lengths.split(",")], a.n_embd, a.n_head, a.reps)
        return
    if a.positions:
        positions_table(a)
        return
    if a.one:
        attention, pos, N = a.one.split(",")
        print(json.dumps(run_one(attention, pos, int(N), a.n_embd, a.n_head, a.reps, a.chunk)))
        return
    lengths_table(a)


def lengths_table(a):
    """The default table: softmax against linear attention at each length, each cell measured
    in a fresh process (its peak memory is its own)."""

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


def positions_table(a):
    """Time: the five encodings round-robin in this process, rep by rep, so load changes hit
    them alike; memory: a fresh process per cell."""
    Ns = [int(n) for n in (a.lengths if a.lengths != LENGTHS else "512,2048,8192").split(",")]
    print(f"# one softmax layer, fwd+bwd, batch 1, {a.n_head} heads x {a.n_embd // a.n_head}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {a.reps} "
          f"round-robin reps; ratios to rope")
    print("| N | positions | ms | vs rope | peak MiB | vs rope |")
    print("|--:|---|--:|--:|--:|--:|")
    for N in Ns:
        peak = {}
        for pos in POSITIONS:
            cmd = [sys.executable, __file__, "--one_pos", f"{pos},{N}", "--n_embd", str(a.n_embd),
                   "--n_head", str(a.n_head)]
            # a process now and then reports no growth on a loaded machine (its setup's
            # high-water mark already covered the step): then one more try
            for _ in range(2):
                peak[pos] = float(subprocess.run(cmd, check=True, capture_output=True,
                                                 text=True).stdout)
                if peak[pos] > 0:
                    break
        steps = {pos: position_step(pos, N, a.n_embd, a.n_head) for pos in POSITIONS}
        times = {pos: [] for pos in POSITIONS}
        for i in range(a.reps + 1):  # the first round is a warm-up
            for pos, step in steps.items():
                t0 = time.perf_counter()
                step()
                if i:
                    times[pos].append(1000 * (time.perf_counter() - t0))
        ms = {pos: sorted(t)[len(t) // 2] for pos, t in times.items()}
        for pos in POSITIONS:
            print(f"| {N} | {pos} | {ms[pos]:.1f} | {ms[pos] / ms['rope']:.2f} "
                  f"| {peak[pos]:.0f} | {peak[pos] / peak['rope']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
