"""
What RoPE buys, measured on this repo: a position-encoding ablation, length extrapolation,
and generation past the training length. One command runs all three:

    python bench/ablation.py                     # the defaults: a 2-core CPU, < 45 minutes
    python bench/ablation.py --variants=rope,shaw,t5,alibi --seeds=1337   # relative baselines
    python bench/ablation.py --device=cuda --max_iters=3000 --n_layer=6 --n_embd=384 \\
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
import csv
import io
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import RoFormer, RoFormerConfig  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "bench"))
from lab_runs import finished, pyplot, read_log, save_figure, write_atomic  # noqa: E402

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
MULTIPLES = (1, 2, 4)  # extrapolation lengths, in units of block_size


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


def write_csv(path, rows, fields):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    write_atomic(path, buf.getvalue())


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
    for i, run in enumerate(runs):
        cmd = train_command(args, run)
        if not args.retrain and finished(run, cmd, args.max_iters):
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
        write_atomic(os.path.join(run["dir"], "ablation_cmd.json"), json.dumps(cmd[1:]))


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


def spread(values, fmt="{:.3f}"):
    """'mean' for one value, 'mean (min-max)' for several: the seed-to-seed spread."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    m = fmt.format(sum(values) / len(values))
    if len(values) == 1:
        return m
    return f"{m} ({fmt.format(min(values))}–{fmt.format(max(values))})"


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
    # the headline: the difference per seed next to the seed-to-seed spread of each variant
    if len(args.headline) == 2 and all(h in by_variant for h in args.headline):
        a, b = args.headline
        fa = {r["seed"]: r["log"][-1]["val_loss"] for r in by_variant[a]}
        fb = {r["seed"]: r["log"][-1]["val_loss"] for r in by_variant[b]}
        common = [s for s in fa if s in fb]
        diffs = [fa[s] - fb[s] for s in common]
        if diffs:
            rng = max([max(f.values()) - min(f.values()) for f in (fa, fb)])
            lines += ["", f"Final val loss, {a} − {b}, per seed: "
                      + ", ".join(f"{d:+.3f} (seed {s})" for d, s in zip(diffs, common))
                      + f"; largest seed-to-seed range within one variant: {rng:.3f}."]
            if len(common) > 1:
                same_sign = all(d < 0 for d in diffs) or all(d > 0 for d in diffs)
                clear = same_sign and min(abs(d) for d in diffs) > rng
                lines.append(f"The difference is {'larger than' if clear else 'NOT clearly larger than'}"
                             f" the seed-to-seed spread.")
    return "\n".join(lines), by_variant


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
# evaluation helpers

def load_model(ckpt_path, device, **overrides):
    """The checkpoint's model in eval mode, optionally with rope_scaling/rope_factor changed
    (the cos/sin tables are not in the state dict, so any scaling loads the same weights)."""
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    model = RoFormer(RoFormerConfig(**{**ckpt["model_args"], **overrides}))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def load_val(data_path):
    meta_path = os.path.join(data_path, "meta.json")
    if not os.path.exists(meta_path):
        sys.exit(f"error: {meta_path} not found (train once, or prepare the dataset)")
    with open(meta_path) as f:
        meta = json.load(f)
    return np.memmap(os.path.join(data_path, "val.bin"), dtype=meta["dtype"], mode="r")


def spaced_windows(val, n, length):
    """n windows of `length` tokens spread evenly over val.bin (int64 tensor (n, length))."""
    if len(val) < length:
        sys.exit(f"error: val.bin has {len(val)} tokens, fewer than the {length} needed")
    n = min(n, len(val) // length)
    starts = np.linspace(0, len(val) - length, n).astype(np.int64)
    return torch.from_numpy(np.stack([val[s:s + length].astype(np.int64) for s in starts]))


def token_losses(model, x, cached=False):
    """Per-token next-token loss of x (B, T+1): (B, T). cached=True runs the same tokens as
    one chunked prefill against a decoding cache: for softmax attention past block_size
    this is sliding-window attention (see caches.KVCache), for linear attention the
    recurrent state."""
    inp, tgt = x[:, :-1], x[:, 1:]
    if cached:
        logits = model(inp, cache=model.new_cache(inp.size(1), inp.device), start_pos=0)[0]
    else:
        logits = model(inp)[0]
    return F.cross_entropy(logits.float().transpose(1, 2), tgt, reduction="none")


def keep_sinks(model, n_sink):
    """Make the rolling cache keep the first n_sink positions (attention sinks) plus the
    last block_size - n_sink: each layer's query m sees keys 0..n_sink-1 and
    m-(block_size-n_sink)+1..m, at their absolute positions, so the cache size and the cost
    per token stay those of the plain rolling cache. Only the attention mask changes, and
    only for one prefill of a whole sequence from an empty cache (where model.py keeps every
    key of the chunk in view and the mask alone decides), which is how token_losses calls it."""
    bs = model.config.block_size
    new_cache = model.new_cache

    def sink_cache(total_len, device):
        cache = new_cache(total_len, device)

        def update(layer, k, v, pos):  # KVCache.update, with the sinks' visibility
            if int(cache.slot_pos[layer].max()) >= 0 or pos.numel() <= cache.slot_pos.size(1):
                raise RuntimeError("keep_sinks supports one prefill longer than block_size only")
            keys, values, key_pos, _ = plain_update(layer, k, v, pos)  # the whole chunk in view
            d = pos[:, None] - key_pos[None, :]  # true distances, also for a relative bias
            recent = (d >= 0) & (d < bs - n_sink)
            sink = (d >= 0) & (key_pos[None, :] >= 0) & (key_pos[None, :] < n_sink)
            return keys, values, key_pos, (recent | sink) & (key_pos[None, :] >= 0)

        plain_update, cache.update = cache.update, update  # instance attributes: this cache only
        return cache

    model.new_cache = sink_cache  # an instance attribute: this model object only
    return model


def scored_positions(T, bs, stride):
    """Context ends t (predicting token t+1) that generation scores: every t inside the first
    block, then every stride-th one."""
    return torch.cat((torch.arange(min(bs, T)), torch.arange(bs, T, stride)))


@torch.no_grad()
def crop_losses(model, x, batch, stride=1):
    """Crop-and-recompute: token t+1 of x (T+1,) predicted from x[max(0, t-bs+1) : t+1]
    run from scratch at positions 0.. (what generate(use_cache=False) does), for the t in
    scored_positions. The first block_size predictions come from one forward; each later one
    from its own window, `batch` windows per forward. Returns (len(scored_positions),)."""
    bs = model.config.block_size
    first = token_losses(model, x[None, :bs + 1])[0]
    # windows starting at 1 .. T-bs: context ends bs .. T-1, every stride-th of them
    wins = x[:-1].unfold(0, bs, 1)[1::stride]
    tgts = x[bs + 1::stride]
    rest = []
    for i in range(0, wins.size(0), batch):
        logits = model(wins[i:i + batch])[0][:, -1]
        rest.append(F.cross_entropy(logits.float(), tgts[i:i + batch], reduction="none"))
    return torch.cat([first] + rest)


# ----------------------------------------------------------------------------------------
# 2. extrapolation

@torch.no_grad()
def extrapolation(args, runs):
    """Rows: run x method; columns: mean next-token loss on windows of 1x, 2x, 4x block_size.
    Every length covers the same tokens (each 4x window split into shorter ones)."""
    val = load_val(args.data_path)
    rows = []
    for run in tqdm(runs, desc="extrapolation", unit="model"):
        ckpt = os.path.join(run["dir"], "ckpt.pt")
        base = load_model(ckpt, args.device)
        bs, c = base.config.block_size, base.config
        big = spaced_windows(val, args.eval_windows, max(MULTIPLES) * bs + 1).to(args.device)
        methods = ["full"]
        if c.attention == "softmax" and c.pos_encoding == "rope":
            methods += ["pi", "ntk"]
        if c.attention == "softmax" and c.pos_encoding != "learned":
            methods.append("window")
        for method in methods:
            row = {"variant": run["variant"], "seed": run["seed"], "method": method}
            for mult in MULTIPLES:
                L = mult * bs
                if method == "full" and c.pos_encoding == "learned" and L > bs:
                    row[f"{mult}x"] = None  # learned positions end at block_size
                    continue
                model = base
                if method in ("pi", "ntk"):
                    model = load_model(ckpt, args.device, rope_scaling=
                                       {"pi": "linear", "ntk": "ntk"}[method], rope_factor=float(mult))
                # (n, 4bs+1) -> (n*4/mult, L+1): consecutive windows share one boundary token
                inp = big[:, :-1].reshape(-1, L)
                tgt = big[:, 1:].reshape(-1, L)
                x = torch.cat((inp, tgt[:, -1:]), dim=1)
                total = 0.0
                for i in range(0, x.size(0), args.eval_batch):
                    total += token_losses(model, x[i:i + args.eval_batch],
                                          cached=method == "window").sum().item()
                row[f"{mult}x"] = total / x[:, 1:].numel()
            rows.append(row)
    return rows


METHOD_NAMES = {"full": "full context", "pi": "position interpolation (rope_scaling=linear)",
                "ntk": "NTK-aware (rope_scaling=ntk)", "window": "sliding window of block_size"}


def extrapolation_report(args, rows, bs):
    write_csv(os.path.join(args.out, "extrapolation.csv"), rows,
              ["variant", "seed", "method"] + [f"{m}x" for m in MULTIPLES])
    groups = {}
    for r in rows:
        groups.setdefault((r["variant"], r["method"]), []).append(r)
    lines = [f"Mean next-token val loss on held-out windows of 1x, 2x, 4x the training length "
             f"({', '.join(str(m * bs) for m in MULTIPLES)} tokens; the same tokens at every "
             f"length); rope_factor = the length multiple; mean over seeds, (min–max) where "
             f"there are several.", "",
             "| variant | method | seeds | " + " | ".join(f"{m}x ({m * bs})" for m in MULTIPLES)
             + " |", "|---|---|---|" + "---:|" * len(MULTIPLES)]
    for (v, method), rs in groups.items():
        lines.append(f"| {v} | {METHOD_NAMES[method]} | {len(rs)} | "
                     + " | ".join(spread([r[f"{m}x"] for r in rs]) for m in MULTIPLES) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# 3. generation past the training length

@torch.no_grad()
def generation(args, runs):
    """Per-token losses on gen_seqs held-out sequences of gen_mult x block_size, for the
    first seed of each variant; returns rows (variant, method, one value per position bin)
    and the bin edges."""
    val = load_val(args.data_path)
    seen, rows = set(), []
    todo = [r for r in runs if not (r["variant"] in seen or seen.add(r["variant"]))]
    for run in tqdm(todo, desc="generation", unit="model"):
        ckpt = os.path.join(run["dir"], "ckpt.pt")
        model = load_model(ckpt, args.device)
        c = model.config
        bs = c.block_size
        N = args.gen_mult * bs
        seqs = spaced_windows(val, args.gen_seqs, N + 1).to(args.device)
        pos = scored_positions(N, bs, args.gen_stride)
        losses = {"crop": torch.stack([crop_losses(model, s, args.crop_batch, args.gen_stride)
                                       for s in seqs])}
        if c.attention == "linear":
            losses["recurrent"] = token_losses(model, seqs, cached=True)
        elif c.pos_encoding != "learned":
            losses["full"] = token_losses(model, seqs)
            losses["rolling"] = token_losses(model, seqs, cached=True)
            if args.sinks:
                losses["sinks"] = token_losses(keep_sinks(load_model(ckpt, args.device),
                                                          args.sinks), seqs, cached=True)
        losses = {k: v if k == "crop" else v[:, pos.to(v.device)] for k, v in losses.items()}
        # inside the first block every method computes the same thing: a check, not a result
        for name, lo in losses.items():
            gap = (lo[:, :bs] - losses["crop"][:, :bs]).abs().max().item()
            if gap > 1e-3:
                raise RuntimeError(f"{run['variant']} {name}: differs from crop-and-recompute "
                                   f"by {gap:.2e} inside the first block (a bug)")
        edges = [0, bs] + [m * bs for m in (2, 4, 8, 16, 32, 64) if m < args.gen_mult] + [N]
        for name, lo in losses.items():
            row = {"variant": run["variant"], "seed": run["seed"], "method": name}
            for a, b in zip(edges[:-1], edges[1:]):
                row[f"{a}-{b - 1}"] = lo[:, (pos >= a) & (pos < b)].mean().item()
            row[f"{bs}-{N - 1}"] = lo[:, pos >= bs].mean().item()
            rows.append(row)
    return rows


GEN_NAMES = {"crop": "crop-and-recompute (last block_size tokens, from scratch)",
             "full": "full context (no window)",
             "rolling": "rolling cache (sliding window)",
             "sinks": "rolling cache + first {k} positions kept (sinks)",
             "recurrent": "recurrent state (all history)"}


def generation_report(args, rows, bs):
    cols = [k for k in rows[0] if k not in ("variant", "seed", "method")]
    write_csv(os.path.join(args.out, "generation.csv"), rows, ["variant", "seed", "method"] + cols)
    N = args.gen_mult * bs
    lines = [f"Mean loss of each next token on {args.gen_seqs} held-out sequences of {N} tokens "
             f"({args.gen_mult}x block_size), by the position of the predicted token's context "
             f"end, every position inside the first block, then every {args.gen_stride}th "
             f"(the first column is inside the training length, where all methods compute the "
             f"same thing: checked); first seed of each variant. The last column is everything "
             f"past block_size. Compare methods within a column: the columns hold different "
             f"text.", "",
             "| variant | method | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['variant']} | {GEN_NAMES[r['method']].format(k=args.sinks)} | "
                     + " | ".join(f"{r[k]:.3f}" for k in cols) + " |")
    return "\n".join(lines)


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
            f"Command: `{' '.join(['python bench/ablation.py'] + argv)}`",
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
