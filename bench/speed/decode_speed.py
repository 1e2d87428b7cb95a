"""
Decoding speed against the hardware's limit (random weights: speed does not depend on what
was learned). Default shape: 6 layers, 6 heads, 384 wide, vocab 8192, block 256 (14M
parameters, 55 MB in float32); greedy, 16-token prompt, 256 new tokens.

    python bench/speed/decode_speed.py                              # all tables, ~5 min on 2 busy cores
    python bench/speed/decode_speed.py --no-compile --tables 1,3 --threads 1
    python bench/speed/decode_speed.py --n_layer 4 --n_head 4 --n_embd 256 --vocab_size 4096

Tables:
  1. The ceiling. A decode step must read every weight once, so it can go no faster than one
     matrix-vector product over a weight-sized matrix: torch.mv on a (params/n_embd, n_embd)
     matrix, timed right before and after each decode run in this process. Decode tok/s (batch
     1, eager and compiled, the 255 steps after the first token) as a fraction of it, float32
     and bfloat16 weights, 1 thread and all threads. Also the compile time, and the number
     of tokens after which compiling has paid for itself (compile s / time saved per token).
     Per token: the same ratios with one mv timed after each decode step (medians), so that
     both see the same load: the figure to quote on a shared machine.
  2. Batched sampling: total tokens/s at batch N = 1, 4, 16, 64 (--batches), eager and
     compiled (--threads, default all).
  3. transformers' RoFormerForCausalLM (same dims, its KV cache, greedy) when transformers is
     installed: its generate vs ours, whole calls, prefill included.
  4. Cached vs uncached loop, and one cached step's latency at positions 128 / 1024 / 4096
     with the bytes held by the cache (softmax rolling window, the same with local layers that
     keep only --window slots and every --global_every-th layer global, vs linear attention's
     recurrent state).
  5. Dynamo's guards: the compiled float32 step per token (as table 1's per-token column, 1
     thread) as decode.py runs it, every guard checked on the first call only, and with every
     guard checked on every call (decode.py's set_stance made a no-op), in turns, --reps
     rounds each.
Ratios from one run are what to quote: the machine may be shared and timings are noisy.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time
import unittest.mock
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from decode import generate, generate_stream  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402


def make(a, attention="softmax", dtype=torch.float32, **designs):
    torch.manual_seed(0)
    cfg = RoFormerConfig(vocab_size=a.vocab_size, block_size=a.block_size, n_layer=a.n_layer,
                         n_head=a.n_head, n_embd=a.n_embd, attention=attention, **designs)
    return RoFormer(cfg).eval().to(dtype)


def mv_time(W, v, reps=20):
    """Median seconds of one torch.mv(W, v): W a (params/width, width) matrix, one pass over
    as many weights as the model has."""
    torch.mv(W, v)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mv(W, v)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def interleaved(model, a, W, v, compile=False):
    """Batch-1 decode with one torch.mv(W, v) timed after each token: the median mv over the
    median step (the decode's fraction of the ceiling, both measured under the same moment's
    load, which on a shared machine moves each by +-20%)."""
    idx = torch.randint(model.config.vocab_size, (1, a.prompt))
    stream = generate_stream(model, idx, a.new_tokens, temperature=0, compile=compile)
    next(stream).tolist()
    steps, mvs = [], []
    for _ in range(a.new_tokens - 1):
        t0 = time.perf_counter()
        next(stream).tolist()
        t1 = time.perf_counter()
        torch.mv(W, v)
        steps.append(t1 - t0)
        mvs.append(time.perf_counter() - t1)
    return statistics.median(mvs) / statistics.median(steps)


def decode_rate(model, batch, a, compile=False, use_cache=True, new_tokens=None):
    """Tokens/s of the decode steps (all tokens after the first, which pays for the prefill),
    summed over the batch: greedy, as sample.py runs it (the stream is consumed on the host)."""
    new = new_tokens or a.new_tokens
    idx = torch.randint(model.config.vocab_size, (batch, a.prompt))
    stream = generate_stream(model, idx, new, temperature=0, use_cache=use_cache, compile=compile)
    next(stream).tolist()
    t0 = time.perf_counter()
    for tok in stream:
        tok.tolist()
    return batch * (new - 1) / (time.perf_counter() - t0)


def best_rate(model, batch, a, compile=False, use_cache=True, new_tokens=None):
    """Median of --reps runs; a compiled model's first (compiling) call is timed and returned."""
    t0 = time.perf_counter()
    if compile:  # same lengths as the timed runs, so the same graph
        decode_rate(model, batch, a, compile=True, new_tokens=new_tokens)
    compile_s = time.perf_counter() - t0
    rates = [decode_rate(model, batch, a, compile, use_cache, new_tokens) for _ in range(a.reps)]
    return statistics.median(rates), compile_s


@torch.no_grad()
def step_latency(model, pos, steps):
    """Median ms of one cached decode step at positions pos .. pos+steps-1 (batch 1), after
    prefilling pos tokens; and the bytes the caches hold at the end."""
    cache = model.new_cache(pos + steps, "cpu")
    model.hold_positions(0, pos + steps)
    prompt = torch.randint(model.config.vocab_size, (1, pos))
    tok = model(prompt, cache=cache, start_pos=0)[0][:, -1:].argmax(-1)
    p = torch.tensor([pos])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = model(tok, cache=cache, start_pos=p)[0][:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
        p += 1
    held = cache.keys + cache.values if model.config.attention == "softmax" else \
        [t for state in cache.state for t in state]
    held = sum(t.numel() * t.element_size() for t in held)
    return 1e3 * statistics.median(times), held


def hf_model(a):
    """transformers' RoFormerForCausalLM with our dims (None if transformers is missing)."""
    try:
        from transformers import RoFormerConfig as HFConfig, RoFormerForCausalLM
    except ImportError:
        return None
    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=a.vocab_size, embedding_size=a.n_embd, hidden_size=a.n_embd,
                   num_hidden_layers=a.n_layer, num_attention_heads=a.n_head,
                   intermediate_size=4 * a.n_embd, is_decoder=True, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, pad_token_id=0,
                   max_position_embeddings=a.prompt + a.new_tokens)
    return RoFormerForCausalLM(cfg).eval()


def generate_rates(gens, a):
    """New tokens/s of whole greedy generate calls (prefill included) for each function in
    gens, median of --reps; the calls take turns so that load changes hit all alike."""
    rates = [[] for _ in gens]
    for r in range(a.reps + 1):  # the first round warms up (and compiles)
        idx = torch.randint(1, a.vocab_size, (1, a.prompt))
        for gen, out in zip(gens, rates):
            t0 = time.perf_counter()
            gen(idx)
            out.append(a.new_tokens / (time.perf_counter() - t0))
    return [statistics.median(out[1:]) for out in rates]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for k, v in dict(vocab_size=8192, block_size=256, n_layer=6, n_head=6, n_embd=384).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--window", type=int, default=64, help="table 4b: local layers' window")
    ap.add_argument("--global_every", type=int, default=6, help="table 4b: every k-th global")
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--threads", type=int, default=0, help="threads for tables 2-4 (0: torch's default)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tables", default="1,2,3,4,5", help="which tables to print")
    a = ap.parse_args()
    tables = {int(t) for t in a.tables.split(",")}
    warnings.filterwarnings("ignore")
    all_threads = a.threads or torch.get_num_threads()
    model = make(a)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"# decode bench: n_layer={a.n_layer} n_head={a.n_head} n_embd={a.n_embd} "
          f"block_size={a.block_size} vocab={a.vocab_size} ({n_params / 1e6:.1f}M params); "
          f"{a.prompt}-token prompt, {a.new_tokens} new tokens, greedy; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {all_threads} threads by default")

    if 1 in tables:
        ceiling_table(a, n_params, all_threads)
    # 2. batched sampling
    if 2 in tables:
        batched(model, a, all_threads)
    # 3. transformers
    hf = hf_model(a) if 3 in tables else None
    if hf is not None:
        versus_transformers(model, hf, a, all_threads)
    if 4 in tables:
        cached_vs_uncached(a, all_threads)
    if 5 in tables and a.compile:
        guards(a, n_params, all_threads)


def ceiling_table(a, n_params, all_threads):
    """Table 1: batch-1 decode against one pass over the weights, the most a decode step
    could reach, in both dtypes and at 1 and all threads."""
    print(f"\n## 1. batch-1 decode vs the one-pass ceiling (torch.mv over "
          f"{n_params // a.n_embd} x {a.n_embd} weights)")
    print("| weights | threads | ceiling tok/s | eager tok/s | eager/ceiling | compiled tok/s "
          "| compiled/ceiling | compile s | compile pays after | per token: eager/ceiling "
          "| compiled/ceiling |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        m = make(a, dtype=dtype)
        W = torch.randn(n_params // a.n_embd, a.n_embd).to(dtype)  # the ceiling's weights
        v = torch.randn(a.n_embd).to(dtype)
        for threads in sorted({1, all_threads}):
            torch.set_num_threads(threads)
            before = mv_time(W, v)
            eager, _ = best_rate(m, 1, a)
            if a.compile:
                torch._dynamo.reset()  # compiled kernels are built for a thread count
                comp, compile_s = best_rate(m, 1, a, compile=True)
            ceiling = 2 / (before + mv_time(W, v))
            row = (f"| {str(dtype)[6:]} | {threads} | {ceiling:.0f} | {eager:.1f} | "
                   f"{eager / ceiling:.2f} |")
            if a.compile:
                saved = 1 / eager - 1 / comp
                pays = f"{compile_s / saved:,.0f} tokens" if saved > 0 else "never"
                row += f" {comp:.1f} | {comp / ceiling:.2f} | {compile_s:.0f} | {pays} |"
            else:
                row += " | | | |"
            row += f" {interleaved(m, a, W, v):.2f} |"
            row += f" {interleaved(m, a, W, v, True):.2f} |" if a.compile else " |"
            print(row, flush=True)
    torch.set_num_threads(all_threads)


def batched(model, a, all_threads):
    print(f"\n## 2. total tokens/s vs batch (float32, {all_threads} threads)")
    print("| batch | eager tok/s | compiled tok/s | compiled/eager |")
    print("|---:|---:|---:|---:|")
    for n in [int(b) for b in a.batches.split(",")]:
        eager, _ = best_rate(model, n, a)
        if a.compile:
            comp, compile_s = best_rate(model, n, a, compile=True)
            print(f"| {n} | {eager:.0f} | {comp:.0f} (compile {compile_s:.0f} s) | "
                  f"{comp / eager:.2f}x |", flush=True)
        else:
            print(f"| {n} | {eager:.0f} | | |", flush=True)


def versus_transformers(model, hf, a, all_threads):
    print(f"\n## 3. whole greedy generate calls, batch 1, float32: ours vs transformers' "
          f"RoFormerForCausalLM ({sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M "
          f"params, its KV cache)")
    print("| threads | transformers tok/s | ours eager tok/s | ours/transformers |"
          + (" ours compiled tok/s | ours/transformers |" if a.compile else ""))
    print("|---:|---:|---:|---:|" + ("---:|---:|" if a.compile else ""))
    for threads in sorted({1, all_threads}):
        torch.set_num_threads(threads)
        torch._dynamo.reset()
        gens = [lambda idx: hf.generate(idx, max_new_tokens=a.new_tokens,
                                        min_new_tokens=a.new_tokens, do_sample=False,
                                        use_cache=True, eos_token_id=None),
                lambda idx: generate(model, idx, a.new_tokens, temperature=0)]
        if a.compile:
            gens.append(lambda idx: generate(model, idx, a.new_tokens, temperature=0,
                                             compile=True))
        theirs, ours, *comp = generate_rates(gens, a)
        row = f"| {threads} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f}x |"
        if comp:
            row += f" {comp[0]:.1f} | {comp[0] / theirs:.2f}x |"
        print(row, flush=True)
    torch.set_num_threads(all_threads)


def cached_vs_uncached(a, all_threads):
    print(f"\n## 4a. batch-1 decode tok/s, cached vs the uncached loop (recompute the last "
          f"block_size tokens per step), {all_threads} threads")
    print("| attention | cached tok/s | uncached tok/s | cached/uncached |")
    print("|---|---:|---:|---:|")
    for attention in ("softmax", "linear"):
        m = make(a, attention)
        c, _ = best_rate(m, 1, a)
        u, _ = best_rate(m, 1, a, use_cache=False)
        print(f"| {attention} | {c:.1f} | {u:.1f} | {c / u:.1f}x |", flush=True)
    positions = (128, 1024, 4096)
    print("\n## 4b. one cached decode step at position p, batch 1 (median of 32 steps)")
    print("| attention | " + " | ".join(f"p={p} ms" for p in positions) + " | "
          + " | ".join(f"p={p} cache KiB" for p in positions) + " |")
    print("|---|" + "---:|" * (2 * len(positions)))
    local = dict(window=a.window, global_every=a.global_every)
    for label, attention, designs in [
            ("softmax", "softmax", {}), ("linear", "linear", {}),
            (f"softmax, window={a.window} global_every={a.global_every}", "softmax", local)]:
        m = make(a, attention, **designs)
        r = [step_latency(m, p, 32) for p in positions]
        print(f"| {label} | " + " | ".join(f"{ms:.2f}" for ms, _ in r) + " | "
              + " | ".join(f"{held / 1024:.0f}" for _, held in r) + " |", flush=True)


def guards(a, n_params, all_threads):
    print(f"\n## 5. the compiled float32 step per token vs the ceiling, 1 thread, {a.reps} rounds "
          "in turns: dynamo's guards checked on the first call only (decode.py) or on every call")
    print("| guards | per token: compiled/ceiling, each round | median |")
    print("|---|---|---:|")
    torch.set_num_threads(1)
    torch._dynamo.reset()  # compiled kernels are built for a thread count
    m = make(a)
    W, v = torch.randn(n_params // a.n_embd, a.n_embd), torch.randn(a.n_embd)
    every = unittest.mock.patch.object(torch.compiler, "set_stance",
                                       lambda *args, **kw: contextlib.nullcontext())
    got = {"first call only": [], "every call": []}
    interleaved(m, a, W, v, True)  # compiles
    for _ in range(a.reps):
        for name, patch in (("first call only", contextlib.nullcontext()), ("every call", every)):
            with patch:
                got[name].append(interleaved(m, a, W, v, True))
    for name, xs in got.items():
        print(f"| {name} | {', '.join(f'{x:.2f}' for x in xs)} | {statistics.median(xs):.2f} |")
    torch.set_num_threads(all_threads)


if __name__ == "__main__":
    main()
