"""
Training throughput of config/small.py's model: tokens/s and MFU, eager vs torch.compile,
float32 vs bf16 autocast, RoPE vs learned absolute positions, all in one run so the ratios
are comparable (timings on a shared machine are noisy; read the ratios).

    python bench/train.py                    # CPU, config/small.py's shape
    python bench/train.py --steps=20 --compile=False

MFU is model FLOPs (model.flops_per_token) per second over a peak rate: on CPU a
1024^3 matmul in the same dtype, timed in this run; on CUDA the same measured rate (so
the numbers stay comparable with the CPU ones).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configurator import ConfigError, configure  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402

defaults = {"config": "config/small.py", "steps": 10, "warmup": 3, "compile": True,
            "device": "cpu", "batch_size": 0}
try:
    args = configure(defaults, sys.argv[1:])
except ConfigError as e:
    sys.exit(f"error: {e}")
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def run(pos, dtype, compiled):
    torch.manual_seed(0)
    cfg = RoFormerConfig(vocab_size=4096, pos_encoding=pos, **fields)
    raw = RoFormer(cfg).to(dev)
    model = torch.compile(raw) if compiled else raw
    opt = raw.configure_optimizers(0.1, 1e-3, device_type=dev.split(":")[0])
    x = torch.randint(0, 4096, (B, T), device=dev)
    y = torch.randint(0, 4096, (B, T), device=dev)
    ctx = torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=dtype == "bf16")
    times = []
    for i in range(args["warmup"] + args["steps"]):
        t0 = time.perf_counter()
        with ctx:
            loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = sorted(times[args["warmup"]:])[len(times[args["warmup"]:]) // 2]  # median step
    return B * T / dt, raw.flops_per_token(T) * B * T / dt


peaks = {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}
variants = [(p, d, c) for c in ((False, True) if args["compile"] else (False,))
            for d in ("fp32", "bf16") for p in ("rope", "learned")]
rows = []
from tqdm import tqdm  # noqa: E402

for pos, dtype, compiled in tqdm(variants, desc="variants"):
    tok_s, flops = run(pos, dtype, compiled)
    rows.append((pos, dtype, compiled, tok_s, flops))
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
