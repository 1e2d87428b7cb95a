"""
Does a change help? Train the base and each variant with N seeds at equal tokens, score all of
them on the same held-out tokens, and report the difference with a 95% interval and a p-value.

    python bench/compare.py --variant='pos_encoding=learned' --seeds=3
    python bench/compare.py config/small.py --variant='optimizer=adamw' --max_iters=300
    python bench/compare.py --against=HEAD            # edit model.py, then: better than HEAD?
    python bench/compare.py --variant=patch:bench/patches/swiglu.patch
    python bench/compare.py --variant=base            # the noise floor: the base against itself

Arms. The base runs the working tree (uncommitted edits included), or the code at
--against=GIT_REV, in which case the working tree becomes a variant. Each --variant is one of
  'KEY=VALUE KEY=VALUE'   train.py options (model and training keys) on top of the base;
  patch:FILE              the base's code with the patch FILE applied (git apply);
  base                    the base again with other seeds (seed + 10000): its difference is
                          the noise floor, and its interval should cover 0.
Each code version is materialised once under DIR/code/ (git archive for a revision, a copy of
the tracked and untracked-but-not-ignored files for the working tree, plus git apply for a
patch): the user's checkout is only read.

Budget and data. Every run is train.py (a subprocess, in its arm's code) with the same
max_iters, batch and schedule (lr_decay_iters = max_iters), on DIR/data/<id>: the dataset's
train.bin and the first --eval_tokens tokens of its val.bin. Seeds are 1337, 1338, ...: train.py
draws batches and the init from the seed, so equal seeds mean equal batches in every arm. Runs
are interleaved seed-major (seed 1 of every arm, then seed 2, ...) so that a change in machine
load falls on all arms alike.

Scoring. After training, eval.py --split=val (the arm's own eval.py, so a changed model loads)
scores the whole held-out slice in float32: the same tokens for every arm and seed, as nats
per token and bits per byte. (train.py's final val would be the same tokens only per seed, and
has no bytes.) train.py's periodic val on the same slice gives the curves and the wall time
each arm needs to reach the base's final loss.

Statistics. Per arm: mean and std over seeds; against the base, a paired t-test on the
per-seed differences: the seed fixes the init and every batch in both arms, so the pair shares
most of its noise and the difference of a pair is the measurement (an unpaired test would count
the seed-to-seed spread as noise). The t distribution is computed here (regularised incomplete
beta), no scipy. With n seeds it has n-1 degrees of freedom: 3 seeds give a wide interval
(t = 4.30); small effects need more seeds. The 'base' variant has other seeds, so it is not
paired with the base: its paired test only gives a noise floor.

Output, under --out: results.json (one record per arm), results.md (the table), compare.png
(loss against tokens and against wall time: mean over seeds, min-max band). Finished runs whose
command is unchanged are reused (an interrupted one is trained again; --retrain for all). A
variant that fails (an unknown key, a patch that does not apply, a crash) is reported in one
line and the other arms finish. Extra --key=value arguments go to every train.py run.
"""
import argparse
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

import numpy as np
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import runs as bench_runs  # noqa: E402  (read_log, finished, write_atomic: shared with ablation.py)
from stats import t_cdf, t_quantile  # noqa: E402,F401  (tests/test_compare.py checks them here)
from lib.common import UserError, cli  # noqa: E402

# The default model and budget when no config file is given: config/small.py's recipe, smaller
# (docs/COMPARE.md has its timing: 2 arms x 3 seeds within 10 minutes on 2 cores, either CPU kind).
DEFAULT_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "batch_size": 16,
                 "dropout": 0.0, "optimizer": "muon", "muon_lr": 0.04, "learning_rate": 2e-3,
                 "min_lr": 2e-4, "weight_decay": 0.1}
NOISE_SEED_OFFSET = 10000  # the 'base' variant's seeds: other batches and init than the base's
FIRST_SEED = 1337


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="", help="a train.py config file (optional)")
    ap.add_argument("--variant", action="append", default=[],
                    help="'KEY=VALUE ...', patch:FILE or base (repeat for several)")
    ap.add_argument("--against", default="", help="the base runs this git revision's code")
    ap.add_argument("--seeds", type=int, default=3, help="runs per arm (seeds 1337, 1338, ...)")
    ap.add_argument("--max_iters", type=int, default=300)
    ap.add_argument("--eval_interval", type=int, default=0, help="default: max_iters // 4")
    ap.add_argument("--eval_iters", type=int, default=4, help="train.py's periodic val batches")
    ap.add_argument("--eval_tokens", type=int, default=16384, help="held-out tokens scored")
    ap.add_argument("--dataset", default="pystdlib")
    ap.add_argument("--data_dir", default="", help="default: data/<dataset>")
    ap.add_argument("--device", default="auto", help="as train.py: cuda where there is one")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "compare"))
    ap.add_argument("--retrain", action="store_true", help="ignore finished runs in --out")
    args, extra = ap.parse_known_args(argv)
    for a in extra:
        if not (a.startswith("--") and "=" in a):
            raise UserError(f"unexpected argument {a!r} (train.py options go as --key=value)")
    args.train_extra = extra
    if args.seeds < 1 or args.max_iters < 1 or args.eval_tokens < 2:
        raise UserError("need --seeds >= 1, --max_iters >= 1 and --eval_tokens >= 2")
    args.eval_interval = args.eval_interval or max(1, args.max_iters // 4)
    if args.config and not os.path.isfile(args.config):
        raise UserError(f"config file not found: {args.config}")
    args.config = os.path.abspath(args.config) if args.config else ""
    args.out = os.path.abspath(args.out)
    args.src_data = os.path.abspath(args.data_dir or os.path.join(ROOT, "data", args.dataset))
    return args


# ----------------------------------------------------------------------------------------
# code versions and arms

def git(*cmd, **kw):
    return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, check=True, **kw).stdout


def materialise(dest, fill):
    """The folder dest, filled once by fill(folder) (into a temporary folder, then renamed)."""
    if not os.path.isdir(dest):
        tmp = dest + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        fill(tmp)
        os.replace(tmp, dest)
    return dest


def revision_code(out, rev):
    try:
        sha = git("rev-parse", "--verify", "--quiet", rev + "^{commit}", text=True).strip()
    except (subprocess.CalledProcessError, OSError):
        raise UserError(f"--against={rev}: not a git revision of {ROOT}") from None
    tar = git("archive", "--format=tar", sha)
    # the "data" filter where this Python has it (newer ones warn without a filter)
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    return materialise(os.path.join(out, "code", "rev-" + sha[:12]),
                       lambda d: tarfile.open(fileobj=io.BytesIO(tar)).extractall(d, **safe))


def worktree_code(out):
    """A copy of the working tree as it is now (tracked and untracked files git does not
    ignore), named by a hash of the contents: an edit makes a new copy, and new runs."""
    try:
        files = sorted(f for f in git("ls-files", "-z", "-co", "--exclude-standard",
                                      text=True).split("\0")
                       if f and os.path.isfile(os.path.join(ROOT, f)))
    except (subprocess.CalledProcessError, OSError):
        return ROOT  # not a git checkout: the tree itself
    h = hashlib.sha256()
    for f in files:
        with open(os.path.join(ROOT, f), "rb") as fh:
            h.update(f.encode() + b"\0" + hashlib.sha256(fh.read()).digest())

    def copy(d):
        for f in files:
            os.makedirs(os.path.dirname(os.path.join(d, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(d, f))
    return materialise(os.path.join(out, "code", "tree-" + h.hexdigest()[:12]), copy)


def patched_code(out, base_code, patch):
    """base_code with `patch` applied; a patch that does not apply is a UserError (its arm
    only)."""
    path = os.path.abspath(patch)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"cannot read the patch {patch}: {e.strerror}") from None
    name = f"{os.path.basename(base_code)}+{hashlib.sha256(text).hexdigest()[:12]}"

    def fill(d):
        shutil.copytree(base_code, d, dirs_exist_ok=True)
        r = subprocess.run(["git", "apply", path], cwd=d, capture_output=True, text=True)
        if r.returncode:
            shutil.rmtree(d, ignore_errors=True)
            why = (r.stderr.strip().splitlines() or ["git apply failed"])[-1]
            raise UserError(f"the patch {patch} does not apply: {why}")
    return materialise(os.path.join(out, "code", name), fill)


def parse_keys(spec):
    keys = {}
    for item in spec.split():
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise UserError(f"--variant={spec!r}: expected KEY=VALUE items, got {item!r}")
        keys[k.removeprefix("--")] = v
    return keys


def plan_arms(args):
    """[{name, code, keys, seed_offset, broken}], the base first. A variant whose code cannot
    be made is kept, broken, so that it is reported with the others."""
    base_code = revision_code(args.out, args.against) if args.against else worktree_code(args.out)
    arms = [{"name": f"base ({args.against})" if args.against else "base", "code": base_code,
             "keys": {}, "seed_offset": 0, "broken": None}]
    specs = (["worktree"] if args.against else []) + args.variant
    for spec in specs:
        arm = {"name": spec, "code": base_code, "keys": {}, "seed_offset": 0, "broken": None}
        try:
            if spec == "worktree":
                arm["code"] = worktree_code(args.out)
            elif spec == "base":
                arm.update(name="base, other seeds", seed_offset=NOISE_SEED_OFFSET)
            elif spec.startswith("patch:"):
                arm["code"] = patched_code(args.out, base_code, spec[len("patch:"):])
            else:
                arm["keys"] = parse_keys(spec)
        except UserError as e:
            arm["broken"] = str(e)
        arms.append(arm)
    if len({a["name"] for a in arms}) < len(arms):
        raise UserError("the same variant is given twice")
    return arms


def held_out_data(args):
    """DIR/data/<id>: the dataset's train.bin and tokenizer (linked), its meta.json, and the
    first eval_tokens tokens of its val.bin, so that every run and every score reads the same
    tokens. Named by the source and the slice: another slice is another folder, hence another
    train.py command, so no finished run is reused with other held-out tokens."""
    src = args.src_data
    if not os.path.exists(os.path.join(src, "val.bin")) and args.dataset == "pystdlib" \
            and not args.data_dir:  # what train.py would do on first use
        subprocess.run([sys.executable, os.path.join(ROOT, "data", "pystdlib", "prepare.py")],
                       check=True)
    from data.dataset import load_meta, open_split
    meta = load_meta(src)
    val = np.asarray(open_split(src, "val", meta))[:args.eval_tokens]
    meta = dict(meta, val_tokens=len(val))
    key = hashlib.sha256(json.dumps([src, meta], sort_keys=True).encode()).hexdigest()[:12]

    def fill(d):
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump(meta, f)
        val.tofile(os.path.join(d, "val.bin"))
        for name in ("train.bin", "tokenizer.model"):
            if os.path.exists(os.path.join(src, name)):
                os.symlink(os.path.join(src, name), os.path.join(d, name))
    return materialise(os.path.join(args.out, "data", key), fill)


# ----------------------------------------------------------------------------------------
# runs: seed-major round robin over the arms, reused when finished with the same command

def plan_runs(args, arms):
    runs = []
    for i in range(args.seeds):
        for k, arm in enumerate(arms):
            seed = FIRST_SEED + i + arm["seed_offset"]
            runs.append({"arm": arm, "seed": seed, "pair": i,
                         "dir": os.path.join(args.out, "runs", f"arm{k}_s{seed}")})
    return runs


def train_command(args, run, data):
    arm = run["arm"]
    keys = {} if args.config else dict(DEFAULT_MODEL)
    keys.update({"out_dir": run["dir"], "dataset": args.dataset, "data_dir": data,
                 "seed": run["seed"], "device": args.device, "max_iters": args.max_iters,
                 # the schedule ends with the run: every arm sees the same schedule
                 "lr_decay_iters": args.max_iters, "warmup_iters": max(1, args.max_iters // 10),
                 "eval_interval": args.eval_interval, "eval_iters": args.eval_iters,
                 "compile": False, "wandb_log": False})
    # the config file first, then ours, the user's extra flags, and the variant's keys last
    return ([sys.executable, os.path.join(arm["code"], "train.py")]
            + ([args.config] if args.config else []) + [f"--{k}={v}" for k, v in keys.items()]
            + list(args.train_extra) + [f"--{k}={v}" for k, v in arm["keys"].items()])


def last_error(path):
    """The line a failed command ends with: its `error: ...` line, else its last line."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return "no output"
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["no output"])[-1].removeprefix("error: ")


def run_logged(cmd, cwd, out_path):
    """Run cmd with its output in out_path; returns (exit code, peak RSS in MiB)."""
    with open(out_path, "w") as f:
        p = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, usage.ru_maxrss / 1024  # Linux: KiB


def train_and_score(args, run, data):
    """Train (unless finished with this command) and score one run; its record in
    run['result'], or a one-line reason in run['arm']['broken']."""
    arm, cmd = run["arm"], train_command(args, run, data)
    stats_path = os.path.join(run["dir"], "compare_run.json")
    if not args.retrain and bench_runs.finished(run, cmd, args.max_iters) \
            and os.path.exists(stats_path):
        with open(stats_path) as f:
            run["result"] = json.load(f)
        return "reused"
    shutil.rmtree(run["dir"], ignore_errors=True)  # a stale or interrupted run of ours
    os.makedirs(run["dir"])
    rc, rss = run_logged(cmd, arm["code"], os.path.join(run["dir"], "train.out"))
    if rc:
        arm["broken"] = f"train.py failed (exit {rc}): {last_error(os.path.join(run['dir'], 'train.out'))}"
        return "failed"
    score_out = os.path.join(run["dir"], "eval.out")
    rc, _ = run_logged([sys.executable, os.path.join(arm["code"], "eval.py"),
                        f"--out_dir={run['dir']}", "--split=val", "--json=True",
                        f"--device={args.device}", "--dtype=float32"], arm["code"], score_out)
    if rc:
        arm["broken"] = f"eval.py failed (exit {rc}): {last_error(score_out)}"
        return "failed"
    with open(score_out) as f:
        score = json.loads([ln for ln in f if ln.startswith("{")][-1])
    log = bench_runs.read_log(run["dir"])
    run["result"] = {"seed": run["seed"], "loss": score["nats_per_token"],
                     "bpb": score["bits_per_byte"], "scored_tokens": score["tokens"],
                     "tokens": log[-1]["tokens"], "train_s": log[-1]["time_s"],
                     "tokens_per_s": log[-1]["tokens"] / log[-1]["time_s"],
                     "peak_rss_mib": rss, "params": count_params(run["dir"])}
    bench_runs.write_atomic(stats_path, json.dumps(run["result"]))
    bench_runs.write_atomic(os.path.join(run["dir"], "ablation_cmd.json"), json.dumps(cmd[1:]))
    return "trained"


def count_params(run_dir):
    """Parameters in the checkpoint's weights, a tied tensor counted once."""
    import torch
    sd = torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=True)["model"]
    seen = {t.untyped_storage().data_ptr(): t.numel() for t in sd.values()}
    return sum(seen.values())


def train_all(args, runs, data):
    bar = tqdm(runs, desc="runs", unit="run")
    for run in bar:
        arm = run["arm"]
        if arm["broken"]:
            continue
        bar.set_postfix_str(f"{arm['name']} seed {run['seed']}")
        what = train_and_score(args, run, data)
        if arm["broken"]:
            bar.write(f"error: variant {arm['name']!r} is broken: {arm['broken']} "
                      f"(see {run['dir']}); the other arms go on")
        elif what == "reused":
            bar.write(f"{arm['name']} seed {run['seed']}: finished run reused")
    bar.close()


# ----------------------------------------------------------------------------------------
# statistics: a paired t-test (Student's t: bench/stats.py)

def paired(diffs):
    """Mean of the per-seed differences, its 95% interval and the two-sided p-value of a paired
    t-test (None where fewer than 2 pairs)."""
    n = len(diffs)
    mean = sum(diffs) / n if n else float("nan")
    if n < 2:
        return {"mean": mean, "ci95": None, "p": None, "pairs": n}
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    if se == 0:  # identical differences: exact
        return {"mean": mean, "ci95": [mean, mean], "p": float(mean == 0), "pairs": n}
    q = t_quantile(0.975, n - 1)
    p = 2 * t_cdf(-abs(mean / se), n - 1)
    return {"mean": mean, "ci95": [mean - q * se, mean + q * se], "p": p, "pairs": n}


def mean_std(xs):
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


# ----------------------------------------------------------------------------------------
# the report

def time_to(log, target):
    """Wall time of the first logged evaluation whose val loss is <= target (None: never)."""
    return next((r["time_s"] for r in log if r["val_loss"] <= target), None)


def arm_records(args, arms, runs):
    by_arm = {a["name"]: [r for r in runs if r["arm"] is a and "result" in r] for a in arms}
    base = {r["pair"]: r["result"] for r in by_arm[arms[0]["name"]]}
    base_logs = [bench_runs.read_log(r["dir"]) for r in by_arm[arms[0]["name"]]]
    target = (sum(lg[-1]["val_loss"] for lg in base_logs) / len(base_logs)) if base_logs else None
    base_tps = mean_std([r["tokens_per_s"] for r in base.values()])[0]
    base_rss = mean_std([r["peak_rss_mib"] for r in base.values()])[0]
    records = []
    for arm in arms:
        res = [r["result"] for r in by_arm[arm["name"]]]
        rec = {"arm": arm["name"], "code": os.path.relpath(arm["code"], args.out),
               "keys": arm["keys"], "broken": arm["broken"], "seeds": [r["seed"] for r in res],
               "runs": res}
        if res and not arm["broken"]:
            pairs = [(r["result"], base[r["pair"]]) for r in by_arm[arm["name"]]
                     if r["pair"] in base]
            reach = [time_to(bench_runs.read_log(r["dir"]), target) for r in by_arm[arm["name"]]]
            tps = mean_std([r["tokens_per_s"] for r in res])[0]
            rss = mean_std([r["peak_rss_mib"] for r in res])[0]
            for key in ("loss", "bpb"):
                rec[key + "_mean"], rec[key + "_std"] = mean_std([r[key] for r in res])
                rec[key + "_diff"] = paired([a[key] - b[key] for a, b in pairs])
            reached = [t for t in reach if t is not None]
            rec.update(tokens=res[0]["tokens"], params=res[0]["params"], tokens_per_s=tps,
                       tokens_per_s_ratio=tps / base_tps if base_tps else None,
                       peak_rss_mib=rss, memory_ratio=rss / base_rss if base_rss else None,
                       base_final_val_loss=target,
                       time_to_base_loss_s=mean_std(reached)[0] if reached else None,
                       seeds_reaching_base_loss=len(reached))
        records.append(rec)
    return records


def fmt(x, spec=".4f"):
    return "n/a" if x is None else format(x, spec)


def diff_cell(d):
    if d is None:
        return "n/a"
    if d["ci95"] is None:
        return f"{d['mean']:+.4f} (1 pair: no interval)"
    return f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}] p={d['p']:.3g}"


def table(records):
    lines = ["| arm | seeds | held-out loss | bits/byte | Δ loss vs base [95% CI] p | Δ bits/byte "
             "vs base [95% CI] p | tokens/s × | memory × | params | s to base's final loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        if r["broken"] or "loss_mean" not in r:
            lines.append(f"| {r['arm']} | {len(r['seeds'])} | broken: {r['broken'] or 'no runs'}"
                         " |||||||| ")
            continue
        reach = ("n/a (never)" if r["time_to_base_loss_s"] is None else
                 f"{r['time_to_base_loss_s']:.1f} ({r['seeds_reaching_base_loss']}/"
                 f"{len(r['seeds'])} seeds)")
        lines.append(f"| {r['arm']} | {len(r['seeds'])} | {r['loss_mean']:.4f} ± "
                     f"{r['loss_std']:.4f} | {r['bpb_mean']:.4f} ± {r['bpb_std']:.4f} | "
                     f"{diff_cell(r['loss_diff'])} | {diff_cell(r['bpb_diff'])} | "
                     f"{fmt(r['tokens_per_s_ratio'], '.2f')} | {fmt(r['memory_ratio'], '.2f')} | "
                     f"{r['params']:,} | {reach} |")
    return "\n".join(lines)


def plot(args, arms, runs):
    plt = bench_runs.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm in arms:
        logs = [bench_runs.read_log(r["dir"]) for r in runs if r["arm"] is arm and "result" in r]
        if arm["broken"] or not logs:
            continue
        n = min(len(lg) for lg in logs)
        ys = np.array([[rec["val_loss"] for rec in lg[:n]] for lg in logs])
        for ax, key in zip(axes, ("tokens", "time_s")):
            xs = np.array([[rec[key] for rec in lg[:n]] for lg in logs]).mean(0)
            line, = ax.plot(xs, ys.mean(0), label=f"{arm['name']} ({len(logs)} seeds)")
            ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.25)
    for ax, xlabel in zip(axes, ("training tokens", "wall time (s, mean over seeds)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss (held-out slice)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{args.max_iters} iterations per run; line: mean, band: min–max over seeds")
    return bench_runs.save_figure(plt, fig, os.path.join(args.out, "compare.png"), dpi=100)


@cli
def main(argv):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    arms = plan_arms(args)
    for arm in arms:
        if arm["broken"]:
            print(f"error: variant {arm['name']!r} is broken: {arm['broken']}; the other arms go on")
    data = held_out_data(args)
    runs = plan_runs(args, arms)
    train_all(args, runs, data)
    if arms[0]["broken"]:
        raise UserError(f"the base is broken: {arms[0]['broken']}")
    records = arm_records(args, arms, runs)
    md = "\n".join([
        f"# Compare: {len(arms)} arms x {args.seeds} seeds", "",
        f"Command: `python bench/compare.py {' '.join(argv)}`", "",
        f"{args.max_iters} iterations, {records[0]['tokens']:,} training tokens per run; held-out:"
        f" the first {records[0]['runs'][0]['scored_tokens']:,} tokens of "
        f"{args.src_data}/val.bin scored by eval.py (float32). Δ: arm − base, paired by seed "
        f"(t-test over seeds). Ratios: arm / base. Wall time of this invocation: "
        f"{(time.time() - t0) / 60:.1f} min.", "", table(records), ""])
    bench_runs.write_atomic(os.path.join(args.out, "results.json"), json.dumps(records, indent=1))
    bench_runs.write_atomic(os.path.join(args.out, "results.md"), md)
    png = plot(args, arms, runs)
    print(md)
    print(f"wrote {args.out}/results.json, results.md" + (", compare.png" if png else ""))
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
