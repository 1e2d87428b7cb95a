"""
Where a whole `python train.py config/speedrun_cpu.py` process spends its wall time: until its
first line (imports, checks, the model's build), the loop (to its last `iter N/N` line), the
final evaluation (to its `iter N: train .., val ..` line) and from there to the process's exit
(the checkpoint, Python's own exit); against the same command in another checkout (--baseline,
e.g. `git archive COMMIT | tar -x -C DIR`), the two alternated, OMP_NUM_THREADS=1, each line
timestamped as it arrives.

    python bench/speed/phases.py --data_dir=DATA --baseline=DIR --runs=3
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASES = ("start-up", "loop", "final evaluation", "to exit", "whole")


def phases(tree, data_dir, flags):
    """Seconds of each phase of one process of train.py in `tree`."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "train.py", "config/speedrun_cpu.py", f"--data_dir={data_dir}",
               f"--out_dir={out}", *flags]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        t0, stamps = time.perf_counter(), []
        p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            stamps.append((time.perf_counter() - t0, line))
        if p.wait():
            sys.exit("".join(line for _, line in stamps))
        end = time.perf_counter() - t0
    first = stamps[0][0]
    last_iter = [t for t, line in stamps if line.startswith("iter ") and "/" in line][-1]
    evaluated = [t for t, line in stamps if line.startswith("iter ") and "val" in line][-1]
    return dict(zip(PHASES, (first, last_iter - first, evaluated - last_iter, end - evaluated,
                             end)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data_dir", required=True, help="a prepared character text")
    ap.add_argument("--baseline", help="another checkout of this repo, timed alternately")
    ap.add_argument("--runs", type=int, default=3, help="processes per tree")
    ap.add_argument("--flags", default="", help="more train.py flags, e.g. --max_iters=1")
    args = ap.parse_args()
    trees = {"this tree": ROOT, **({args.baseline: args.baseline} if args.baseline else {})}
    times = {name: [] for name in trees}
    for i in range(args.runs):
        for name in list(trees)[i % len(trees):] + list(trees)[:i % len(trees)]:
            times[name].append(phases(trees[name], args.data_dir, args.flags.split()))
    print(f"train.py config/speedrun_cpu.py {args.flags}, OMP_NUM_THREADS=1, seconds, median "
          f"of {args.runs} (range)")
    print("| tree | " + " | ".join(PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for name, runs in times.items():
        cells = [f"{statistics.median(r[k] for r in runs):.2f} "
                 f"({min(r[k] for r in runs):.2f}-{max(r[k] for r in runs):.2f})"
                 for k in PHASES]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
