"""
Training throughput of config/small.py's model: tokens/s and MFU, eager vs torch.compile,
float32 vs bf16 autocast, RoPE vs learned absolute positions, all in one run so the ratios
are comparable (timings on a shared machine are noisy; read the ratios).

    python bench/train.py                    # CPU, config/small.py's shape
    python bench/train.py --steps=20 --compile=False
    python bench/train.py --overhead=True    # train.py's own step vs a bare step, see below

MFU is model FLOPs (model.flops_per_token) per second over a peak rate: on CPU a
1024^3 matmul in the same dtype, timed in this run; on CUDA the same measured rate (so
the numbers stay comparable with the CPU ones).

--overhead=True times train.py's own loop against a bare step on the same model, at
nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, batch 12, vocab 65, float32,
eager): train.py runs in this process on random tokens, and one iteration is the time
between two optimizer.zero_grad calls, so everything train.py does per step (drawing the
batch, logging, checks) is counted. The bare step is forward, backward, clip, AdamW,
zero_grad on a batch that stays put. Rounds alternate --rounds times between the two (each
round --steps steps, the first --warmup of each dropped); medians are reported.
"""
import contextlib
import json
import os
import runpy
import signal
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configurator import ConfigError, configure  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402
from optim import build_optimizer  # noqa: E402

defaults = {"config": "config/small.py", "steps": 10, "warmup": 3, "compile": True,
            "device": "cpu", "batch_size": 0, "overhead": False, "rounds": 5}
try:
    args = configure(defaults, sys.argv[1:])
except ConfigError as e:
    sys.exit(f"error: {e}")
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, vocab_size=65)


def zero_grad_clock():
    """Make every optimizer's zero_grad record the time it returns; the list of stamps."""
    stamps, real = [], torch.optim.Optimizer.zero_grad

    def stamped(self, *a, **kw):
        real(self, *a, **kw)
        stamps.append(time.perf_counter())
    torch.optim.Optimizer.zero_grad = stamped
    return stamps


def train_py_steps(stamps, n, data_dir, out_dir):
    """Per-iteration seconds of n iterations of train.py itself (this process, output to
    /dev/null), iterations after --warmup only."""
    argv = [f"--data_dir={data_dir}", "--dataset=random", f"--out_dir={out_dir}",
            "--device=cpu", "--dtype=float32", "--compile=False", f"--max_iters={n}",
            f"--eval_interval={10 * n}", "--eval_iters=1", "--dropout=0.0"]
    argv += [f"--{k}={v}" for k, v in RECIPE.items() if k != "vocab_size"]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    old_argv, first = sys.argv, len(stamps)
    sys.argv = [os.path.join(here, "train.py")] + argv
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), \
                contextlib.redirect_stderr(null):
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = old_argv
        for s, h in handlers.items():
            signal.signal(s, h)
    t = stamps[first:]
    return np.diff(t)[args["warmup"]:].tolist()


def bare_steps(stamps, n):
    """Per-step seconds of the bare step on the same model and optimizer settings."""
    torch.manual_seed(1337)
    cfg = {k: v for k, v in RECIPE.items() if k != "batch_size"}
    model = RoFormer(RoFormerConfig(**cfg))
    opt = build_optimizer(model, 6e-4, 0.1, (0.9, 0.95), "cpu")
    x = torch.randint(0, RECIPE["vocab_size"], (RECIPE["batch_size"], RECIPE["block_size"]))
    y = torch.randint(0, RECIPE["vocab_size"], x.shape)
    first = len(stamps)
    opt.zero_grad(set_to_none=True)
    for _ in range(n):
        loss = model(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return np.diff(stamps[first:])[args["warmup"]:].tolist()


def overhead():
    stamps = zero_grad_clock()
    n = args["steps"] + args["warmup"] + 1
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        for split, size in (("train", 200_000), ("val", 20_000)):
            rng.integers(0, RECIPE["vocab_size"], size).astype(np.uint16).tofile(
                os.path.join(tmp, f"{split}.bin"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"name": "random", "vocab_size": RECIPE["vocab_size"], "dtype": "uint16",
                       "eos_id": None, "bos_id": None}, f)
        ours, bare, ratios = [], [], []
        for r in range(args["rounds"]):  # alternate (and swap the order), so load changes hit both alike
            first_bare = r % 2 == 1
            b = bare_steps(stamps, n) if first_bare else None
            o = train_py_steps(stamps, n, tmp, os.path.join(tmp, f"out{r}"))
            b = b if first_bare else bare_steps(stamps, n)
            ours, bare = ours + o, bare + b
            ratios.append(statistics.median(o) / statistics.median(b))
    o, b = statistics.median(ours), statistics.median(bare)
    print(f"\nnanoGPT's CPU recipe {RECIPE}, float32, eager, {torch.get_num_threads()} threads; "
          f"median of {len(ours)} steps each, {args['rounds']} alternating rounds")
    print("| step | ms/step | tokens/s | vs bare |")
    print("|---|---:|---:|---:|")
    tokens = RECIPE["batch_size"] * RECIPE["block_size"]
    print(f"| bare (forward, backward, clip, AdamW, zero_grad) | {1e3 * b:.2f} | {tokens / b:,.0f} "
          f"| 1.000 |")
    print(f"| train.py (its whole iteration) | {1e3 * o:.2f} | {tokens / o:,.0f} | {o / b:.3f} |")
    print(f"train.py / bare per round: {', '.join(f'{r:.3f}' for r in ratios)}")


if args["overhead"]:
    overhead()
    sys.exit(0)
scope = {}
with open(os.path.join(here, args["config"])) as f:
    exec(f.read(), scope)
fields = {k: scope[k] for k in ("block_size", "n_layer", "n_head", "n_embd", "attention")
          if k in scope}
B = args["batch_size"] or scope.get("batch_size", 16)
T = fields.get("block_size", 256)
dev = args["device"]


def matmul_rate(dtype):
    a = torch.randn(1024, 1024, dtype=dtype, device=dev)
    a @ a
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        a @ a
        n += 1
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    return 2 * 1024 ** 3 * n / (time.perf_counter() - t0)


def setup(pos, dtype, compiled):
    torch.manual_seed(0)
    cfg = RoFormerConfig(vocab_size=4096, pos_encoding=pos, **fields)
    raw = RoFormer(cfg).to(dev)
    model = torch.compile(raw) if compiled else raw
    opt = build_optimizer(raw, 1e-3, 0.1, device_type=dev.split(":")[0])
    ctx = torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=dtype == "bf16")
    return raw, model, opt, ctx


def step(model, opt, ctx, x, y):
    t0 = time.perf_counter()
    with ctx:
        loss = model(x, y)[1]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


peaks = {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}
variants = [(p, d, c) for c in ((False, True) if args["compile"] else (False,))
            for d in ("fp32", "bf16") for p in ("rope", "learned")]
x = torch.randint(0, 4096, (B, T), device=dev)
y = torch.randint(0, 4096, (B, T), device=dev)
from tqdm import tqdm  # noqa: E402

built = []
for v in tqdm(variants, desc="build + warm up (compiles)"):
    raw, model, opt, ctx = setup(*v)
    for _ in range(args["warmup"]):
        step(model, opt, ctx, x, y)
    built.append((raw, model, opt, ctx))
# Round-robin: one step of every variant per round, so a change in the machine's load (it is
# shared) hits all variants alike; the median step per variant is kept.
times = [[] for _ in variants]
for _ in tqdm(range(args["steps"]), desc="timed rounds"):
    for i, (raw, model, opt, ctx) in enumerate(built):
        times[i].append(step(model, opt, ctx, x, y))
rows = []
for v, (raw, *_), ts in zip(variants, built, times):
    dt = sorted(ts)[len(ts) // 2]
    rows.append((*v, B * T / dt, raw.flops_per_token(T) * B * T / dt))
base = next(r[3] for r in rows if r[:3] == ("rope", "fp32", False))
print(f"\nmodel {fields}, batch {B}x{T}, {torch.get_num_threads()} threads, device {dev}")
print(f"matmul peak: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} "
      f"GFLOP/s (1024^3, measured now)")
print(f"| pos | dtype | compile | tokens/s | vs fp32 eager rope | MFU | RoPE cost vs learned |")
print("|---|---|---|---|---|---|---|")
for pos, dtype, compiled, tok_s, flops in rows:
    learned = next(r[3] for r in rows if r[:3] == ("learned", dtype, compiled))
    cost = f"{100 * (learned / tok_s - 1):+.1f}%" if pos == "rope" else ""
    print(f"| {pos} | {dtype} | {compiled} | {tok_s:,.0f} | {tok_s / base:.2f}x | "
          f"{100 * flops / peaks[dtype]:.1f}% | {cost} |")
