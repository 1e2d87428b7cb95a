"""
Peak memory per rank and step time, DDP vs FSDP (fsdp=True), on N ranks of this machine
(gloo on CPU, nccl on GPUs). Each mode runs in its own torchrun with the model, wrapping and
optimizer of train.py (build.build_model, AdamW), on random tokens.

    python bench/speed/fsdp.py                                  # 2 CPU ranks, ~25M-parameter model
    python bench/speed/fsdp.py --nproc=2 --n_layer=4 --n_embd=256 --steps=3
    python bench/speed/fsdp.py --device=cuda --nproc=8 --n_layer=24 --n_embd=2048 --dtype=bfloat16

Memory on CPU is the process's peak resident set (VmHWM) minus its resident set before the
model was built, so the torch libraries do not count (glibc is told to unmap freed blocks at
once, see below); on CUDA, torch.cuda.max_memory_allocated.
It includes weights, gradients, AdamW moments and activations (batch_size x block_size tokens).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, HERE)
from harness.common import UserError  # noqa: E402
from harness.flags import configure  # noqa: E402

defaults = {"nproc": 2, "n_layer": 8, "n_embd": 512, "n_head": 8, "vocab_size": 8192,
            "block_size": 128, "batch_size": 2, "steps": 5, "device": "cpu", "dtype": "float32"}


def rss(field):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field))


def worker(args, mode, out):
    import torch.distributed as dist

    from harness import build, parallel
    from model import RoFormerConfig
    from optim import build_optimizer
    cuda = args["device"] == "cuda"
    rank = int(os.environ["RANK"])
    device = f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    bf16 = args["dtype"] == "bfloat16"
    cfg = RoFormerConfig(**{k: args[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size",
                                                 "block_size")})
    base = torch.cuda.memory_allocated() if cuda else rss("VmRSS")
    raw, model, _ = build.build_model(
        cfg, 1337, device, fsdp=mode == "fsdp", ddp=mode == "ddp",
        param_dtype=torch.bfloat16 if bf16 and mode == "fsdp" else None)
    opt = build_optimizer(raw, 1e-4, 0.1, device_type=device.split(":")[0])
    # autocast for DDP's bf16, the mixed-precision policy for FSDP's (as train.py does)
    ac = torch.autocast(device.split(":")[0], torch.bfloat16, enabled=bf16 and mode == "ddp")
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args["steps"]):
        x = torch.randint(0, cfg.vocab_size, (args["batch_size"], cfg.block_size), generator=g)
        x = x.to(device)
        t0 = time.perf_counter()
        with ac:
            loss = model(x, x)[1]
        loss.backward()
        parallel.clip_grad_norm(raw, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else rss("VmHWM")
    rec = {"rank": rank, "peak": peak - base, "step": sorted(times[1:])[len(times[1:]) // 2],
           "params": raw.num_params(non_embedding=False)}
    with open(os.path.join(out, f"{mode}{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


def main():
    try:
        args = configure(defaults, sys.argv[1:], sources=(__file__,))
    except UserError as e:
        sys.exit(f"error: {e}")
    out = tempfile.mkdtemp()
    rows = {}
    for mode in ("ddp", "fsdp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args['nproc']}", os.path.abspath(__file__), "--worker=" + mode,
               "--out=" + out, *sys.argv[1:]]
        # A fixed mmap threshold: glibc then returns every large freed block to the system at
        # once, so the resident set follows the live tensors (with its default, adaptive
        # threshold, freed blocks stay resident and the peak grows with fragmentation).
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   MALLOC_MMAP_THRESHOLD_="65536")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            sys.exit(f"error: the {mode} run failed:\n{r.stderr[-3000:]}")
        rows[mode] = [json.load(open(os.path.join(out, f"{mode}{i}.json")))
                      for i in range(args["nproc"])]
    n = rows["ddp"][0]["params"]
    print(f"{n / 1e6:.1f}M parameters, {args['nproc']} ranks on {args['device']}, "
          f"{args['dtype']}, batch {args['batch_size']} x {args['block_size']} per rank")
    print(f"{'mode':6} {'peak MiB/rank (max)':>20} {'bytes/param':>12} {'step s (median)':>16}")
    peak = {m: max(r["peak"] for r in rr) for m, rr in rows.items()}  # the worst rank
    step = {m: max(r["step"] for r in rr) for m, rr in rows.items()}
    for m in rows:
        print(f"{m:6} {peak[m] / 2**20:>20.0f} {peak[m] / n:>12.1f} {step[m]:>16.3f}")
    print(f"fsdp/ddp: memory {peak['fsdp'] / peak['ddp']:.2f}x, "
          f"step time {step['fsdp'] / step['ddp']:.2f}x")


if __name__ == "__main__":
    opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith(("--worker=", "--out=")))
    if "worker" in opts:
        rest = [a for a in sys.argv[1:] if not a.startswith(("--worker=", "--out="))]
        worker(configure(defaults, rest), opts["worker"], opts["out"])
    else:
        main()
