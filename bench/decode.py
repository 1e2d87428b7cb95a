"""
Decoding speed of the small config's model shape (random weights: speed does not depend on
what was learned).

    python bench/decode.py                          # shape from config/small.py, ~2-3 min on 2 cores
    python bench/decode.py --new_tokens 256 --positions 128,1024 --no-compile
    python bench/decode.py --n_layer 6 --n_head 6 --n_embd 384 --block_size 256

Tables:
  1. tokens/s, cached vs uncached, softmax vs linear attention, batch 1 and 8, generating
     --new_tokens after a 16-token prompt (sampling included, as sample.py runs it).
  2. per-token latency of one cached decode step at positions 128 / 1024 / 4096 (median of
     --steps steps after prefilling to that position), and the bytes of cache/state held.
  3. variants of the cached batch-1 step: float32 vs bfloat16 weights, 1 thread vs all,
     and torch.compile of the model (compile time reported separately).
Ratios from one run are what to quote: the machine is shared and timings are noisy.
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import RoFormer, RoFormerConfig  # noqa: E402


def small_shape():
    """The model keys of config/small.py (plain assignments), over RoFormerConfig's defaults."""
    shape = {"vocab_size": 4096, "block_size": 256, "n_layer": 6, "n_head": 6, "n_embd": 384}
    path = os.path.join(ROOT, "config", "small.py")
    if os.path.exists(path):
        scope = {}
        with open(path) as f:
            exec(f.read(), scope)
        shape.update({k: scope[k] for k in shape if isinstance(scope.get(k), int) and scope[k] > 0})
    return shape


def make(a, attention, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = RoFormerConfig(vocab_size=a.vocab_size, block_size=a.block_size, n_layer=a.n_layer,
                         n_head=a.n_head, n_embd=a.n_embd, attention=attention)
    return RoFormer(cfg).eval().to(dtype)


def throughput(model, batch, new_tokens, use_cache):
    """Generated tokens per second over a whole generate call (prefill included)."""
    idx = torch.randint(model.config.vocab_size, (batch, 16))
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    model.generate(idx, new_tokens, temperature=1.0, top_k=200, use_cache=use_cache, generator=g)
    return batch * new_tokens / (time.perf_counter() - t0)


@torch.no_grad()
def step_latency(model, pos, steps, batch=1, fn=None):
    """Median ms of one cached decode step at positions pos .. pos+steps-1, after prefilling
    pos tokens; also the bytes held by the caches at the end."""
    fn = model if fn is None else fn
    model.reset_cache(pos + steps, "cpu")
    idx = torch.randint(model.config.vocab_size, (batch, pos))
    logits = fn(idx, start_pos=0)[0]
    tok = logits[:, -1:].argmax(-1)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        logits = fn(tok, start_pos=pos + i)[0]
        tok = logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    held = sum(t.numel() * t.element_size() for b in model.blocks for t in b.attn.cache)
    model.reset_cache(1, "cpu")
    for b in model.blocks:
        b.attn.cache = None
    return 1e3 * statistics.median(times), held


def main():
    shape = small_shape()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for k, v in shape.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--new_tokens", type=int, default=1024)
    ap.add_argument("--uncached_tokens_b8", type=int, default=256,
                    help="new tokens for the slow uncached loop at batch 8 (0: --new_tokens);\n"
                         "fewer tokens favour the uncached loop (its window is not yet full)")
    ap.add_argument("--positions", default="128,1024,4096")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    nthreads = torch.get_num_threads()
    print(f"# decode bench: n_layer={a.n_layer} n_head={a.n_head} n_embd={a.n_embd} "
          f"block_size={a.block_size} vocab={a.vocab_size}; torch {torch.__version__}, "
          f"{nthreads} threads, float32 unless said")

    # 1. throughput
    print(f"\n## 1. tokens/s generating {a.new_tokens} new tokens (16-token prompt, top_k=200)")
    print("| attention | batch | cached tok/s | uncached tok/s | cached/uncached |")
    print("|---|---:|---:|---:|---:|")
    for attention in ("softmax", "linear"):
        model = make(a, attention)
        for batch in (1, 8):
            c = throughput(model, batch, a.new_tokens, True)
            n_unc = a.uncached_tokens_b8 if batch == 8 and a.uncached_tokens_b8 else a.new_tokens
            u = throughput(model, batch, n_unc, False)
            note = "" if n_unc == a.new_tokens else f" ({n_unc} tokens)"
            print(f"| {attention} | {batch} | {c:.1f} | {u:.1f}{note} | {c / u:.1f}x |", flush=True)

    # 2. latency vs position
    positions = [int(p) for p in a.positions.split(",")]
    print(f"\n## 2. one cached decode step at position p, batch 1 (median of {a.steps})")
    print("| attention | " + " | ".join(f"p={p} ms" for p in positions) + " | "
          + " | ".join(f"p={p} cache KiB" for p in positions) + " |")
    print("|---|" + "---:|" * (2 * len(positions)))
    for attention in ("softmax", "linear"):
        model = make(a, attention)
        r = [step_latency(model, p, a.steps) for p in positions]
        print(f"| {attention} | " + " | ".join(f"{ms:.2f}" for ms, _ in r) + " | "
              + " | ".join(f"{held / 1024:.0f}" for _, held in r) + " |", flush=True)

    # 3. variants of the batch-1 cached step
    pos = positions[0]
    print(f"\n## 3. cached softmax decode step at p={pos}, batch 1: variants")
    print("| variant | ms/token | vs float32 eager |")
    print("|---|---:|---:|")
    model = make(a, "softmax")
    base, _ = step_latency(model, pos, a.steps)
    print(f"| float32, {nthreads} threads | {base:.2f} | 1.00x |", flush=True)
    bf, _ = step_latency(make(a, "softmax", torch.bfloat16), pos, a.steps)
    print(f"| bfloat16 weights, {nthreads} threads | {bf:.2f} | {base / bf:.2f}x |", flush=True)
    other = 1 if nthreads > 1 else os.cpu_count()
    if other > 1 or nthreads > 1:
        torch.set_num_threads(other)
        one, _ = step_latency(model, pos, a.steps)
        torch.set_num_threads(nthreads)
        print(f"| float32, {other} thread(s) | {one:.2f} | {base / one:.2f}x |", flush=True)
    if a.compile:
        cm = torch.compile(model, dynamic=True)
        t0 = time.perf_counter()
        step_latency(model, pos, 4, fn=cm)  # compiles prefill and decode step
        compile_s = time.perf_counter() - t0
        cms, _ = step_latency(model, pos, a.steps, fn=cm)
        print(f"| float32, torch.compile (dynamic=True; compile {compile_s:.0f} s) "
              f"| {cms:.2f} | {base / cms:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
