"""
The default run, as a user runs it: the wall time of the whole `python train.py config/small.py`
command and its training tokens/s, with each optimizer, on this CPU as it is and on this CPU
with bf16 emulated (oneDNN and ATen limited to AVX2, as on an AVX2-only CPU: a bf16 product then
costs ~100x a float32 one). Arms alternate round by round, so the machine's load falls on all.

    python bench/speed/default_run.py                              # 1 round, both optimizers, both kinds
    python bench/speed/default_run.py --rounds=2 --kinds=avx2 --optimizers=muon

The corpus is built before the first arm (its ~5 s is not in the times).
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, here)
from harness.common import UserError  # noqa: E402
from harness.flags import configure  # noqa: E402

defaults = {"rounds": 1, "optimizers": "adamw,muon", "kinds": "native,avx2", "extra": ""}
try:
    args = configure(defaults, sys.argv[1:], sources=(__file__,))
except UserError as e:
    sys.exit(f"error: {e}")
# what an AVX2-only CPU does: oneDNN's bf16 kernels need AVX512-BF16 or AMX
KINDS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def one_run(optimizer, kind, out_dir):
    """(seconds, last tokens/s printed, final val loss, dtype) of one whole command."""
    cmd = [sys.executable, "train.py", "config/small.py", f"--optimizer={optimizer}",
           f"--out_dir={out_dir}", *args["extra"].split()]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=here, env=dict(os.environ, **KINDS[kind]), text=True,
                         capture_output=True)
    seconds = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    tok_s = [float(v.replace(",", "")) for v in re.findall(r"tok/s ([\d,]+)", out.stdout)]
    dtype = re.search(r"parameters, \S+ (\w+),", out.stdout).group(1)
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        val = json.loads(f.readlines()[-1])["val_loss"]
    return seconds, tok_s[-1], val, dtype


def main():
    if not os.path.exists(os.path.join(here, "data", "pystdlib", "meta.json")):
        subprocess.run([sys.executable, "data/pystdlib/prepare.py"], cwd=here, check=True)
    arms = [(k, o) for k in args["kinds"].split(",") for o in args["optimizers"].split(",")]
    unknown = [k for k, _ in arms if k not in KINDS]
    if unknown:
        sys.exit(f"error: unknown kind {unknown[0]!r} (native, avx2)")
    results = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args["rounds"]):
            for i in range(len(arms)):
                kind, opt = arm = arms[(i + r) % len(arms)]  # the order rotates every round
                results[arm].append(one_run(opt, kind, os.path.join(tmp, f"{kind}-{opt}")))
                print(f"round {r + 1}: {kind} {opt}: {results[arm][-1]}", flush=True)
    print(f"\n`python train.py config/small.py`, {args['rounds']} round(s), median; load "
          f"average {os.getloadavg()[0]:.1f} at the end")
    print("| CPU | optimizer | dtype | tokens/s | whole command | final val loss |")
    print("|---|---|---|---:|---:|---:|")
    for (kind, opt), runs in results.items():
        s = statistics.median(r[0] for r in runs)
        cpu = "as it is" if kind == "native" else "bf16 emulated (AVX2)"
        print(f"| {cpu} | {opt} | {runs[0][3]} | {statistics.median(r[1] for r in runs):,.0f} | "
              f"{int(s // 60)} min {s % 60:.0f} s | {statistics.median(r[2] for r in runs):.4f} |")


if __name__ == "__main__":
    main()
