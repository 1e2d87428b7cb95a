"""
Training throughput of config/small.py's model: tokens/s and MFU, eager vs torch.compile,
float32 vs bf16 autocast, RoPE vs learned absolute positions, all in one run so the ratios
are comparable (timings on a shared machine are noisy; read the ratios).

    python bench/speed/train_speed.py                    # CPU, config/small.py's shape
    python bench/speed/train_speed.py --steps=20 --compile=False
    python bench/speed/train_speed.py --overhead=True    # train.py's step vs a nanoGPT-equivalent one
    python bench/speed/train_speed.py --whole=True       # the whole 300-iteration command, both ways
    python bench/speed/train_speed.py --profile=True     # torch.profiler: what train.py adds per step
    python bench/speed/train_speed.py --adamw_step=True  # AdamW's step alone: for-loop, foreach, fused
    python bench/speed/train_speed.py --target=True --text=FILE_OR_FOLDER  # time to nanoGPT's final loss

MFU is model FLOPs (harness.mfu.flops_per_token) per second over a peak rate: on CPU a
1024^3 matmul in the same dtype, timed in this run; on CUDA the same measured rate (so
the numbers stay comparable with the CPU ones).

The last three run at nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, batch 12,
vocab 65, float32, eager, AdamW, clip 1.0) on random tokens, at each of --threads torch
threads. The reference, the nanoGPT-equivalent step (bench/speed/nanogpt_recipe.py), is our
RoFormer with learned positions (recipe_model("learned"): nanoGPT's architecture, learned
positions, pre-LayerNorm blocks without biases, causal SDPA, GELU MLP, tied head) under
torch's AdamW as nanoGPT builds it on CPU (weight decay on the matrices, plain_optimizer) in a
plain loop (plain_steps: lr write, a batch drawn from a fresh memmap, forward, backward, clip,
step, zero_grad, loss.item()).
--overhead=True: per-iteration time, one iteration being the time between two
optimizer.zero_grad calls, of (1) that nanoGPT-equivalent step, (2) the same plain loop on our
RoFormer with RoPE, (3) train.py itself (RoPE), run in this process, so everything it does per
step (batch, logging, checks) counts, and (4) train.py with --rope_pairs=half (the rotation's
roll form, the default before adjacent pairs). --rounds rounds, each runs all four (the order
rotates every round), --steps steps each with the first --warmup dropped; medians and per-round
ratios to (1) are reported. (2)/(1): RoPE, (3)/(2): train.py's loop. --cpu_clock=True times
with this process's CPU time instead of the wall clock: at 1 thread, time the machine gives to
other jobs then does not count. --train_dtype (default float32, as the plain loop runs)
is train.py's --dtype here and in --whole: auto times train.py as it runs by default (bf16
autocast on a CPU that multiplies bf16 natively) against the float32 plain loop.
--whole=True: wall and CPU time of `python train.py` for --iters iterations (evaluating at 0,
--eval_interval and the end, --eval_iters batches per split, checkpoints where it writes
them) against `python bench/speed/train_speed.py --plain_run=DIR`: the nanoGPT-equivalent plain loop with
the same evaluations and checkpoint writes; alternated over --rounds rounds.
--profile=True: torch.profiler over --steps iterations of train.py and of the plain loop on
our RoFormer (RoPE): per-iteration CPU time by op for each, and the ops where they differ.
--target=True: quality per unit of time, the time our RoFormer (Muon, AdamW) takes to
reach nanoGPT's final held-out loss on nanoGPT's shakespeare_char CPU recipe
(bench/speed/nanogpt_recipe.py says how).
"""
import contextlib
import json
import os
import resource
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from harness.common import UserError  # noqa: E402
from harness.flags import configure  # noqa: E402
from harness.mfu import flops_per_token  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402
from optim import build_optimizer  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt_recipe import (BETAS, LR, RECIPE, WEIGHT_DECAY, plain_model,  # noqa: E402
                            plain_optimizer, plain_run, plain_steps, target)

defaults = {"config": "config/small.py", "steps": 10, "warmup": 3, "compile": True,
            "device": "cpu", "batch_size": 0, "overhead": False, "rounds": 5, "whole": False,
            "profile": False, "threads": "1,2", "iters": 300, "eval_interval": 250,
            "eval_iters": 20, "plain_run": "", "adamw_step": False, "target": False,
            "text": "data/shakespeare/input.txt", "text_chars": 1_115_394, "target_iters": 2000,
            "target_eval": 25, "target_batches": 20, "muon_lr": 0.02, "seed": 1337,
            "ours_iters": 0, "ours_warmup": 100, "ours_cooldown": 0.0, "ours_lr": 0.0,
            "ours_qk_norm": False, "ours_dtype": "auto", "ours_short": 0, "ours_short_block": 32,
            "cpu_clock": False, "train_dtype": "float32"}
try:
    args = configure(defaults, sys.argv[1:], sources=(__file__,))
except UserError as e:
    sys.exit(f"error: {e}")
here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLOCK = time.process_time if args["cpu_clock"] else time.perf_counter  # --overhead's stamps


REAL_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def zero_grad_clock(on_stamp=None):
    """Make every optimizer's zero_grad record the time it returns (and call on_stamp);
    the list of stamps. Each call replaces the previous clock."""
    stamps, real = [], REAL_ZERO_GRAD

    def stamped(self, *a, **kw):
        real(self, *a, **kw)
        stamps.append(CLOCK())
        if on_stamp is not None:
            on_stamp()
    torch.optim.Optimizer.zero_grad = stamped
    return stamps


def train_py_argv(data_dir, out_dir, n, eval_interval, eval_iters):
    argv = [f"--data_dir={data_dir}", "--dataset=random", f"--out_dir={out_dir}",
            "--device=cpu", f"--dtype={args['train_dtype']}", "--compile=False",
            f"--max_iters={n}", f"--eval_interval={eval_interval}", f"--eval_iters={eval_iters}",
            "--dropout=0.0", f"--learning_rate={LR}", f"--weight_decay={WEIGHT_DECAY}",
            f"--beta1={BETAS[0]}", f"--beta2={BETAS[1]}"]
    return argv + [f"--{k}={v}" for k, v in RECIPE.items() if k != "vocab_size"]


def run_train_py(n, data_dir, out_dir, extra=()):
    """n iterations of train.py itself in this process (output to /dev/null)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    old_argv = sys.argv
    sys.argv = [os.path.join(here, "train.py")] + train_py_argv(data_dir, out_dir, n, 10 * n,
                                                                1) + list(extra)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), \
                contextlib.redirect_stderr(null):
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = old_argv
        for s, h in handlers.items():
            signal.signal(s, h)


def make_random_data(d):
    rng = np.random.default_rng(0)
    for split, size in (("train", 200_000), ("val", 20_000)):
        rng.integers(0, RECIPE["vocab_size"], size).astype(np.uint16).tofile(
            os.path.join(d, f"{split}.bin"))
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"name": "random", "vocab_size": RECIPE["vocab_size"], "dtype": "uint16",
                   "eos_id": -1, "bos_id": -1, "train_tokens": 200_000,
                   "val_tokens": 20_000}, f)


STEP_KINDS = ["learned", "rope", "train.py", "train.py half"]
TRAIN_PY_FLAGS = {"train.py": [], "train.py half": ["--rope_pairs=half"]}  # kind: extra flags
STEP_NAMES = {"learned": "(1) nanoGPT-equivalent plain step (our RoFormer, learned positions)",
              "rope": "(2) plain loop, our RoFormer, RoPE",
              "train.py": "(3) train.py's whole iteration (RoPE)",
              "train.py half": "(4) the same, --rope_pairs=half (the roll form, before adjacent)"}


def overhead_round(kind, stamps, n, tmp, r):
    first = len(stamps)
    if kind in TRAIN_PY_FLAGS:
        run_train_py(n, tmp, os.path.join(tmp, f"out{STEP_KINDS.index(kind)}-{r}"),
                     TRAIN_PY_FLAGS[kind])
    else:
        model = plain_model(kind)
        opt = plain_optimizer(model)
        plain_steps(model, opt, tmp, n, np.random.default_rng(r))
    return np.diff(stamps[first:])[args["warmup"]:].tolist()


def overhead(threads):
    torch.set_num_threads(threads)
    stamps = zero_grad_clock()
    n = args["steps"] + args["warmup"] + 1
    times = {k: [] for k in STEP_KINDS}
    ratios = {k: [] for k in STEP_KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        make_random_data(tmp)
        for r in range(args["rounds"]):  # rotate the order, so load changes hit all alike
            order = STEP_KINDS[r % len(STEP_KINDS):] + STEP_KINDS[:r % len(STEP_KINDS)]
            got = {k: overhead_round(k, stamps, n, tmp, r) for k in order}
            for k in STEP_KINDS:
                times[k] += got[k]
                ratios[k].append(statistics.median(got[k]) / statistics.median(got["learned"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = RECIPE["batch_size"] * RECIPE["block_size"]
    print(f"\nnanoGPT's CPU recipe {RECIPE}, float32, eager, {threads} thread(s); median of "
          f"{len(times['learned'])} steps each, {args['rounds']} rotating rounds, "
          f"{'CPU time' if args['cpu_clock'] else 'wall clock'}")
    print("| step | ms/iter | tokens/s | vs (1) | vs (1) per round |")
    print("|---|---:|---:|---:|---|")
    for k in STEP_KINDS:
        print(f"| {STEP_NAMES[k]} | {1e3 * med[k]:.2f} | {tokens / med[k]:,.0f} | "
              f"{med[k] / med['learned']:.3f} | {', '.join(f'{x:.3f}' for x in ratios[k])} |")



def whole(threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    walls, cpus = {"train.py": [], "plain": []}, {"train.py": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        make_random_data(tmp)
        cmds = {"train.py": [sys.executable, os.path.join(here, "train.py")] + train_py_argv(
                    tmp, os.path.join(tmp, "out"), args["iters"], args["eval_interval"],
                    args["eval_iters"]),
                "plain": [sys.executable, os.path.abspath(__file__), f"--plain_run={tmp}",
                          f"--iters={args['iters']}", f"--eval_interval={args['eval_interval']}",
                          f"--eval_iters={args['eval_iters']}"]}
        for r in range(args["rounds"]):
            for k in (("train.py", "plain") if r % 2 else ("plain", "train.py")):
                t0, c0 = time.perf_counter(), children_cpu()
                res = subprocess.run(cmds[k], env=env, capture_output=True, text=True, cwd=here)
                if res.returncode:
                    sys.exit(f"error: {k} failed: {res.stderr[-2000:]}")
                walls[k].append(time.perf_counter() - t0)
                cpus[k].append(children_cpu() - c0)
    print(f"\nthe whole command, {args['iters']} iterations at nanoGPT's CPU recipe, evaluations "
          f"at 0, {args['eval_interval']} and {args['iters']} ({args['eval_iters']} batches per "
          f"split), {threads} thread(s), {args['rounds']} alternated rounds; CPU s: the "
          "process's user + system time, which at 1 thread other jobs on the machine move less")
    print("| command | wall s (median) | per round | vs plain | CPU s (median) | per round "
          "| vs plain |")
    print("|---|---:|---|---:|---:|---|---:|")
    for k in ("plain", "train.py"):
        row = f"| {k} |"
        for xs in (walls, cpus):
            med, base = statistics.median(xs[k]), statistics.median(xs["plain"])
            row += f" {med:.2f} | {', '.join(f'{x:.2f}' for x in xs[k])} | {med / base:.3f} |"
        print(row)
    for name, xs in (("wall", walls), ("CPU", cpus)):  # paired: a load that drifts between
        pairs = [t / p for t, p in zip(xs["train.py"], xs["plain"])]  # rounds hits both alike
        print(f"train.py / plain, {name} time, per round: {', '.join(f'{x:.3f}' for x in pairs)}"
              f" (median {statistics.median(pairs):.3f})")


def children_cpu():  # seconds of CPU (user + system) used by this process's finished children
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def profile(threads):
    """Per-iteration self CPU time by op of train.py and of the plain loop on our RoFormer."""
    from torch.profiler import ProfilerActivity, profile as torch_profile, schedule
    torch.set_num_threads(threads)
    n, tables = args["steps"], {}
    with tempfile.TemporaryDirectory() as tmp:
        make_random_data(tmp)
        for kind in ("rope", "train.py"):
            prof = torch_profile(activities=[ProfilerActivity.CPU],
                                 schedule=schedule(wait=args["warmup"], warmup=1, active=n,
                                                   repeat=1))
            stamps = zero_grad_clock(on_stamp=prof.step)
            with prof:
                if kind == "train.py":
                    run_train_py(n + args["warmup"] + 2, tmp, os.path.join(tmp, "out"))
                else:
                    model = plain_model("rope")
                    plain_steps(model, plain_optimizer(model), tmp, n + args["warmup"] + 2,
                                np.random.default_rng(0))
            wall = statistics.median(np.diff(stamps[args["warmup"] + 1:]))
            ops = {e.key: (e.self_cpu_time_total / n, e.count / n) for e in prof.key_averages()}
            tables[kind] = (wall * 1e6, ops)
    (w_plain, plain), (w_ours, ours) = tables["rope"], tables["train.py"]
    print(f"\ntorch.profiler, {threads} thread(s), {n} iterations, per iteration (us): wall "
          f"plain loop {w_plain:.0f}, train.py {w_ours:.0f}; in torch ops "
          f"{sum(v[0] for v in plain.values()):.0f} vs {sum(v[0] for v in ours.values()):.0f}")
    # first the ops train.py calls more often than the plain loop (its own work), then the
    # most expensive ops overall (the model's)
    extra = [k for k in ours if ours[k][1] > plain.get(k, (0, 0))[1] and k != "ProfilerStep*"]
    top = sorted(set(plain) | set(ours), key=lambda k: -max(ours.get(k, (0, 0))[0],
                                                           plain.get(k, (0, 0))[0]))[:12]
    print("| op | plain us/iter | train.py us/iter | calls/iter plain | calls/iter train.py |")
    print("|---|---:|---:|---:|---:|")
    for k in sorted(extra, key=lambda k: -ours[k][0]) + ["..."] + [k for k in top
                                                                  if k not in extra]:
        if k == "...":
            print("| (the most expensive ops) | | | | |")
            continue
        a, b = plain.get(k, (0.0, 0.0)), ours.get(k, (0.0, 0.0))
        print(f"| {k} | {a[0]:.0f} | {b[0]:.0f} | {a[1]:.1f} | {b[1]:.1f} |")


def adamw_step(threads):
    """ms per AdamW step on the recipe's RoFormer, torch's default (a Python loop over the
    parameters on CPU) vs foreach vs fused, alternated step by step."""
    torch.set_num_threads(threads)
    model = plain_model("rope")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    kinds = {"default (for-loop)": {}, "foreach=True": {"foreach": True},
             "fused=True": {"fused": True}}
    opts = {k: torch.optim.AdamW(model.parameters(), lr=1e-3, **kw) for k, kw in kinds.items()}
    times = {k: [] for k in opts}
    for i in range(20 + 20 * args["steps"]):
        for k, o in opts.items():
            t0 = time.perf_counter()
            o.step()
            if i >= 20:
                times[k].append(time.perf_counter() - t0)
    print(f"\nAdamW step alone, the recipe's RoFormer, {threads} thread(s), median of "
          f"{len(times[k])} alternated steps")
    print("| AdamW | ms/step |")
    print("|---|---:|")
    for k, t in times.items():
        print(f"| {k} | {1e3 * statistics.median(t):.2f} |")




if args["plain_run"]:
    plain_run(args["plain_run"], args)
    sys.exit(0)
if args["overhead"] or args["whole"] or args["profile"] or args["adamw_step"] or args["target"]:
    for threads in map(int, str(args["threads"]).split(",")):
        if args["overhead"]:
            overhead(threads)
        if args["whole"]:
            whole(threads)
        if args["profile"]:
            profile(threads)
        if args["adamw_step"]:
            adamw_step(threads)
        if args["target"]:
            target(threads, args)
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
    rows.append((*v, B * T / dt, flops_per_token(raw.config, raw.num_params(), T) * B * T / dt))
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
