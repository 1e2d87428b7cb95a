"""
What RoPE buys, measured on this repo: a position-encoding ablation, length extrapolation,
and generation past the training length. One command runs all three:

    python bench/studies/ablation.py                     # the defaults: a 2-core CPU, < 45 minutes
    python bench/studies/ablation.py --variants=rope,shaw,t5,alibi --seeds=1337   # relative baselines
    python bench/studies/ablation.py --device=cuda --max_iters=3000 --n_layer=6 --n_embd=384 \\
        --block_size=256 --batch_size=64 --out=bench/results/gpu

1. Training. The same small model is trained by the real train.py (one subprocess per run)
   with an equal budget (same steps, batch, tokens, learning-rate schedule, seed, hence the
   same batches) and only the position encoding / attention changed:
     rope, learned, sinusoidal, none          softmax attention
     linear_rope, linear_none                 linear attention (RoFormer eq. 19)
     shaw, t5, alibi                          relative biases on the scores (softmax only;
                                              not in the default set: --variants adds them)
   The headline pair (rope vs learned) runs once per seed in --seeds; the other variants run
   with the first seed only (--all_seeds for every seed). Output: the loss curves
   (curves.csv, loss_curves.png when matplotlib is installed) and a table of validation loss
   at fixed steps and the steps each variant needs to reach a target loss.
2. Extrapolation. Every trained checkpoint is evaluated on held-out val.bin windows of 1x,
   2x and 4x its block_size (the same tokens at every length). RoPE models also run with
   position interpolation (rope_scaling=linear), NTK-aware scaling (rope_scaling=ntk), both
   with rope_factor = the length multiple, and with a sliding window of block_size (the
   rolling KV cache). Learned positions end at block_size: n/a past it.
3. Generation past the training length. On long held-out sequences, the loss of every next
   token when each prediction recomputes the last block_size tokens from scratch
   (crop-and-recompute) vs the rolling cache (sliding-window attention), the rolling cache
   with the first few positions kept as attention sinks, and for linear attention the
   recurrent state, binned by position.

Extra `--key=value` arguments that this script does not know are passed to every train.py
run unchanged (e.g. --compile=True --dtype=bfloat16). Finished runs whose command is
unchanged are reused, so re-running after an interruption only trains what is missing
(--retrain to start over). Everything goes under --out (git-ignored by default):
runs/<variant>_s<seed>/ (train.py's out_dir), curves.csv, extrapolation.csv,
generation.csv, summary.md, loss_curves.png.
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench", "lab"))
sys.path.insert(0, os.path.join(ROOT, "bench", "studies"))
from extrapolation import (extrapolation, extrapolation_report, generation,  # noqa: E402
                           generation_report)
from lab_runs import pyplot, read_log, save_figure, stale, write_atomic, write_csv  # noqa: E402
from stats import spread  # noqa: E402

# variant name -> the train.py keys that define it; everything else is shared
VARIANTS = {
    "rope": {"attention": "softmax", "pos_encoding": "rope"},
    "learned": {"attention": "softmax", "pos_encoding": "learned"},
    "sinusoidal": {"attention": "softmax", "pos_encoding": "sinusoidal"},
    "none": {"attention": "softmax", "pos_encoding": "none"},
    "linear_rope": {"attention": "linear", "pos_encoding": "rope"},
    "linear_none": {"attention": "linear", "pos_encoding": "none"},
    "shaw": {"attention": "softmax", "pos_encoding": "shaw"},
    "t5": {"attention": "softmax", "pos_encoding": "t5"},
    "alibi": {"attention": "softmax", "pos_encoding": "alibi"},
}
# what the default run trains: ~20 minutes on a 2-core CPU (the relative three add ~7)
DEFAULT_VARIANTS = ("rope", "learned", "sinusoidal", "none", "linear_rope", "linear_none")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--stages", default="train,extrap,gen",
                    help="comma list out of train, extrap, gen (extrap and gen need the runs)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma list out of {', '.join(VARIANTS)}")
    ap.add_argument("--headline", default="rope,learned",
                    help="variants trained once per seed; the others use the first seed only")
    ap.add_argument("--seeds", default="1337,1338")
    ap.add_argument("--all_seeds", action="store_true", help="every variant with every seed")
    ap.add_argument("--retrain", action="store_true", help="ignore finished runs in --out")
    # the shared training budget and model (passed to train.py)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dataset", default="pystdlib")
    ap.add_argument("--data_dir", default="", help="default: data/<dataset>")
    ap.add_argument("--max_iters", type=int, default=600)
    ap.add_argument("--eval_interval", type=int, default=50)
    ap.add_argument("--eval_iters", type=int, default=10)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--block_size", type=int, default=128)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=128)
    ap.add_argument("--learning_rate", type=float, default=2e-3)
    ap.add_argument("--warmup_iters", type=int, default=None, help="default: max_iters // 12")
    # the summary
    ap.add_argument("--target_loss", type=float, default=None,
                    help="default: the mean final val loss of 'learned' (the baseline)")
    # evaluation
    ap.add_argument("--eval_windows", type=int, default=24,
                    help="extrapolation: held-out windows of 4x block_size")
    ap.add_argument("--eval_batch", type=int, default=16)
    ap.add_argument("--gen_seqs", type=int, default=4, help="generation: held-out sequences")
    ap.add_argument("--gen_mult", type=int, default=8, help="their length, x block_size")
    ap.add_argument("--gen_stride", type=int, default=4,
                    help="past block_size, score every this many positions (crop-and-recompute "
                         "costs a forward of block_size tokens per position scored)")
    ap.add_argument("--crop_batch", type=int, default=64, help="windows per forward when cropping")
    ap.add_argument("--sinks", type=int, default=4,
                    help="positions kept as attention sinks in the rolling cache (0: skip)")
    args, extra = ap.parse_known_args(argv)
    return check_args(args, extra)


def check_args(args, extra):
    """The parsed arguments made lists and checked, each mistake one `error:` line; extra:
    the arguments this script does not know, which go to every train.py run."""
    for a in extra:
        if not (a.startswith("--") and "=" in a):
            sys.exit(f"error: unexpected argument {a!r} (train.py options go as --key=value)")
    args.train_extra = extra
    args.variants = [v for v in args.variants.split(",") if v]
    args.headline = [v for v in args.headline.split(",") if v]
    args.stages = [s for s in args.stages.split(",") if s]
    for v in args.variants + args.headline:
        if v not in VARIANTS:
            sys.exit(f"error: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    for s in args.stages:
        if s not in ("train", "extrap", "gen"):
            sys.exit(f"error: unknown stage {s!r}; choose from train, extrap, gen")
    if extra and "train" not in args.stages:
        sys.exit(f"error: {extra[0]} is not an option of this script, and without the train "
                 f"stage there is no train.py run to pass it to")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        sys.exit(f"error: --seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seeds or not args.variants:
        sys.exit("error: need at least one variant and one seed")
    if args.max_iters < args.eval_interval or args.eval_interval < 1:
        sys.exit(f"error: need 1 <= eval_interval <= max_iters, got {args.eval_interval} "
                 f"and {args.max_iters}")
    if args.warmup_iters is None:
        args.warmup_iters = args.max_iters // 12
    if not 0 <= args.warmup_iters <= args.max_iters:
        sys.exit(f"error: need 0 <= warmup_iters <= max_iters, got {args.warmup_iters}")
    if args.gen_mult < 2 or min(args.eval_windows, args.eval_batch, args.gen_seqs,
                                args.gen_stride, args.crop_batch) < 1:
        sys.exit("error: need gen_mult >= 2 and eval_windows, eval_batch, gen_seqs, gen_stride, "
                 "crop_batch >= 1")
    if not 0 <= args.sinks < args.block_size:
        sys.exit(f"error: --sinks must be in [0, block_size), got {args.sinks}")
    args.out = os.path.abspath(args.out)
    args.data_path = os.path.abspath(args.data_dir or os.path.join(ROOT, "data", args.dataset))
    return args


# ----------------------------------------------------------------------------------------
# 1. training

def planned_runs(args):
    runs = []
    for v in args.variants:
        for seed in (args.seeds if args.all_seeds or v in args.headline else args.seeds[:1]):
            runs.append({"variant": v, "seed": seed,
                         "dir": os.path.join(args.out, "runs", f"{v}_s{seed}")})
    return runs


def train_command(args, run):
    keys = {"out_dir": run["dir"], "dataset": args.dataset, "seed": run["seed"],
            "device": args.device, "max_iters": args.max_iters,
            # the LR schedule ends with the run, so every variant sees the same schedule
            "lr_decay_iters": args.max_iters, "warmup_iters": args.warmup_iters,
            "learning_rate": args.learning_rate, "min_lr": args.learning_rate / 10,
            "eval_interval": args.eval_interval, "eval_iters": args.eval_iters,
            "batch_size": args.batch_size, "block_size": args.block_size,
            "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
            "dropout": 0.0, "compile": False, "wandb_log": False, **VARIANTS[run["variant"]]}
    if args.data_dir:
        keys["data_dir"] = args.data_path
    # extra arguments come last, so they override ours
    return ([sys.executable, os.path.join(ROOT, "train.py")]
            + [f"--{k}={v}" for k, v in keys.items()] + list(args.train_extra))


def train_all(args, runs):
    """Every run, in this terminal; a run is reused when it finished with the same command
    (its key, as bench/compare.py's runs are reused by theirs)."""
    for i, run in enumerate(runs):
        cmd = train_command(args, run)
        key = {"command": cmd[1:]}  # not the interpreter's path
        if not args.retrain and stale(run["dir"], key, args.max_iters) is None:
            print(f"[{i + 1}/{len(runs)}] {run['variant']} seed {run['seed']}: finished run "
                  f"in {run['dir']}, reused")
            continue
        print(f"[{i + 1}/{len(runs)}] training {run['variant']} seed {run['seed']}: "
              f"{' '.join(cmd[1:])}", flush=True)
        shutil.rmtree(run["dir"], ignore_errors=True)  # a stale or partial run of ours
        os.makedirs(run["dir"])
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc != 0:
            sys.exit(f"error: train.py failed for {run['variant']} seed {run['seed']} "
                     f"(exit {rc}); its output is above")
        write_atomic(os.path.join(run["dir"], "run_key.json"), json.dumps(key))


def load_logs(runs, max_iters):
    for run in runs:
        log = read_log(run["dir"])
        if not log or log[-1]["iter"] < max_iters:
            sys.exit(f"error: no finished run in {run['dir']} (run the train stage)")
        for rec in log:
            for k in ("iter", "train_loss", "val_loss", "tokens", "time_s"):
                if k not in rec:
                    sys.exit(f"error: {run['dir']}/log.jsonl: a record lacks '{k}'")
        run["log"] = log



def val_at(log, it):
    """Val loss at the last evaluation at or before step `it`."""
    recs = [r for r in log if r["iter"] <= it]
    return recs[-1]["val_loss"] if recs else None


def steps_to(log, target):
    hit = [r["iter"] for r in log if r["val_loss"] <= target]
    return hit[0] if hit else None


def training_report(args, runs):
    curve_rows = [{"variant": r["variant"], "seed": r["seed"], **{k: rec.get(k) for k in
                   ("iter", "tokens", "time_s", "train_loss", "val_loss", "lr")}}
                  for r in runs for rec in r["log"]]
    write_csv(os.path.join(args.out, "curves.csv"), curve_rows,
              ["variant", "seed", "iter", "tokens", "time_s", "train_loss", "val_loss", "lr"])
    by_variant = {}
    for r in runs:
        by_variant.setdefault(r["variant"], []).append(r)
    target = args.target_loss
    if target is None:
        base = by_variant.get("learned") or next(iter(by_variant.values()))
        target = sum(r["log"][-1]["val_loss"] for r in base) / len(base)
        target_src = f"the mean final val loss of '{base[0]['variant']}'"
    else:
        target_src = "--target_loss"
    # fixed steps: a quarter, half and all of the run, at the evaluations that exist
    steps = sorted({max([r["iter"] for r in runs[0]["log"] if r["iter"] <= f * args.max_iters]
                        or [0]) for f in (0.25, 0.5, 1.0)})
    lines = [f"Val loss at fixed steps (mean over seeds, (min–max) where there are several), "
             f"and the first evaluated step whose val loss is <= {target:.3f} "
             f"({target_src}).", "",
             "| variant | attention | positions | seeds | "
             + " | ".join(f"val @ {s}" for s in steps) + f" | steps to {target:.3f} | train s |",
             "|---|---|---|---|" + "---:|" * (len(steps) + 2)]
    for v, rs in by_variant.items():
        reached = [steps_to(r["log"], target) for r in rs]
        reach = ("not reached" if all(x is None for x in reached) else
                 spread([float(x) for x in reached if x is not None], "{:.0f}")
                 + (f" ({sum(x is None for x in reached)} seed(s) not)" if None in reached else ""))
        lines.append(f"| {v} | {VARIANTS[v]['attention']} | {VARIANTS[v]['pos_encoding']} | "
                     f"{len(rs)} | " + " | ".join(spread([val_at(r["log"], s) for r in rs])
                                                   for s in steps)
                     + f" | {reach} | {spread([r['log'][-1]['time_s'] for r in rs], '{:.0f}')} |")
    return "\n".join(lines + headline(args, by_variant)), by_variant


def headline(args, by_variant):
    """Lines: the headline pair's difference per seed next to the seed-to-seed spread of each
    of the two (none unless both ran)."""
    if len(args.headline) != 2 or not all(h in by_variant for h in args.headline):
        return []
    a, b = args.headline
    fa = {r["seed"]: r["log"][-1]["val_loss"] for r in by_variant[a]}
    fb = {r["seed"]: r["log"][-1]["val_loss"] for r in by_variant[b]}
    common = [s for s in fa if s in fb]
    diffs = [fa[s] - fb[s] for s in common]
    if not diffs:
        return []
    rng = max([max(f.values()) - min(f.values()) for f in (fa, fb)])
    lines = ["", f"Final val loss, {a} − {b}, per seed: "
             + ", ".join(f"{d:+.3f} (seed {s})" for d, s in zip(diffs, common))
             + f"; largest seed-to-seed range within one variant: {rng:.3f}."]
    if len(common) > 1:
        same_sign = all(d < 0 for d in diffs) or all(d > 0 for d in diffs)
        clear = same_sign and min(abs(d) for d in diffs) > rng
        lines.append(f"The difference is {'larger than' if clear else 'NOT clearly larger than'}"
                     f" the seed-to-seed spread.")
    return lines


def plot(args, by_variant):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for v, rs in by_variant.items():
        its = [rec["iter"] for rec in rs[0]["log"]]
        for ax, key in zip(axes, ("val_loss", "train_loss")):
            ys = np.array([[rec[key] for rec in r["log"]][:len(its)] for r in rs])
            line, = ax.plot(its, ys.mean(0), label=f"{v} ({len(rs)} seed{'s' * (len(rs) > 1)})",
                            ls="--" if v.startswith("linear") else "-")
            if len(rs) > 1:
                ax.fill_between(its, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.25)
    for ax, title in zip(axes, ("validation loss", "training loss (eval estimate)")):
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        lows = [min(r["log"][-1]["val_loss"] for r in rs) for rs in by_variant.values()]
        ax.set_ylim(min(lows) - 0.2, max(lows) + 1.5)  # the start of training is off-scale
    axes[0].legend()
    fig.suptitle(f"{args.n_layer} layers x {args.n_embd}, block {args.block_size}, "
                 f"batch {args.batch_size}, {args.max_iters} steps; band: min–max over seeds")
    return save_figure(plt, fig, os.path.join(args.out, "loss_curves.png"), dpi=110)


# ----------------------------------------------------------------------------------------

def main(argv):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs = planned_runs(args)
    t0 = time.time()
    timings = {}
    if "train" in args.stages:
        train_all(args, runs)
        timings["train"] = time.time() - t0
    load_logs(runs, args.max_iters)
    for run in runs:
        if not os.path.exists(os.path.join(run["dir"], "ckpt.pt")):
            sys.exit(f"error: {run['dir']}/ckpt.pt not found (run the train stage)")
    train_md, by_variant = training_report(args, runs)
    png = plot(args, by_variant)
    sections = [("Training: equal budget, position encodings compared", train_md)]
    if png:
        sections.append(("Loss curves", f"![loss curves]({os.path.basename(png)})"))
    if "extrap" in args.stages:
        t = time.time()
        rows = extrapolation(args, runs)
        sections.append(("Length extrapolation", extrapolation_report(args, rows, args.block_size)))
        timings["extrapolation"] = time.time() - t
    if "gen" in args.stages:
        t = time.time()
        rows = generation(args, runs)
        sections.append(("Generation past the training length",
                         generation_report(args, rows, args.block_size)))
        timings["generation"] = time.time() - t
    machine = (f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, "
               f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
               f"device {args.device}"
               + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    n_tok = runs[0]["log"][-1]["tokens"]
    head = ["# Position-encoding ablation", "",
            f"Command: `{' '.join(['python bench/studies/ablation.py'] + argv)}`",
            "", f"Model: {args.n_layer} layers, {args.n_head} heads, n_embd {args.n_embd}, "
            f"block_size {args.block_size}; {args.max_iters} steps of batch {args.batch_size}, "
            f"{n_tok / 1e6:.2f}M training tokens per run; "
            f"dataset {args.data_path}; seeds {','.join(map(str, args.seeds))}.",
            f"Machine: {machine}. Wall time of this invocation: "
            + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items())
            + f", total {(time.time() - t0) / 60:.1f} min."]
    md = "\n".join(head) + "\n\n" + "\n\n".join(f"## {t}\n\n{b}" for t, b in sections) + "\n"
    write_atomic(os.path.join(args.out, "summary.md"), md)
    print(md)
    print(f"wrote {args.out}/summary.md, curves.csv"
          + (", extrapolation.csv" if "extrap" in args.stages else "")
          + (", generation.csv" if "gen" in args.stages else "")
          + (", loss_curves.png" if png else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
