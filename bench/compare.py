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
patch): the user's checkout is only read. The tree's copy and every version's identity leave
out what no run reads (tests/, docs/, bench/, *.md) and --out's own files (--out may lie in
the tree, not ignored): a second invocation is the same code, and the folder does not grow.

Budget and data. Every run is train.py (a subprocess, in its arm's code) with the same
max_iters, batch and schedule (lr_decay_iters = max_iters), on DIR/data/<id>: the dataset's
train.bin and the first --eval_tokens tokens of its val.bin, and the config file as read at
the start (DIR/config/: an edit while compare runs changes no run). Seeds are 1337, 1338, ...: train.py
draws batches and the init from the seed, so equal seeds mean equal batches in every arm. Runs
are interleaved seed-major (seed 1 of every arm, then seed 2, ...) so that a change in machine
load falls on all arms alike.

Scoring. After training, eval.py --split=val (the arm's own eval.py, so a changed model loads)
scores the whole held-out slice in float32: the same tokens for every arm and seed, as nats
per token and bits per byte. (train.py's final val would be the same tokens only per seed, and
has no bytes.) train.py's periodic val on the same slice gives the curves and the wall time
each arm needs to reach the base's final loss. Only runs that reached the budget are scored: a
train.py stopped by a signal saves and exits 0 short of max_iters, and its arm is refused in
one line (the same command again trains it anew); an arm whose runs drew other tokens than
the base's is refused too.

Statistics. Per arm: mean and std over seeds; against the base, a paired t-test on the
per-seed differences: the seed fixes the init and every batch in both arms, so the pair shares
most of its noise and the difference of a pair is the measurement (an unpaired test would count
the seed-to-seed spread as noise). The t distribution is computed here (regularised incomplete
beta), no scipy. With n seeds it has n-1 degrees of freedom: 3 seeds give a wide interval
(t = 4.30); small effects need more seeds. The 'base' variant has other seeds, so it is not
paired with the base: its paired test only gives a noise floor.

Output, under --out: results.json (one record per arm), results.md (the table, tokens per run,
the timings marked "within noise" where their per-seed ratios' 95% interval covers 1x, and the
per-seed differences), compare.png (the differences from the base, same seed: along training
and of the held-out score), runs/<arm>-<hash>_sSEED
(named by what the arm is, not its place in the list). A finished run is reused while nothing
that decides it changed (its code file by file, the config file's contents, the data, the
flags); otherwise, or when interrupted, it is trained again and a line says why, naming a
changed code file (--retrain for all). Before the report every run's key and record are read
again: a folder another process retrained meanwhile is refused. So seeds
split over processes or machines (each its own --out, --first_seed and --seeds) report together:
copy their runs/ folders into one --out and run there with all the seeds. A variant
that fails (an unknown key, a patch that does not apply, a crash) is reported in one line and
the other arms finish. Extra --key=value arguments go to every train.py run; neither they nor a
variant may set what compare sets itself (OWN_KEYS), nor the config file init_from.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench", "lab"))
import lab_runs as bench_runs  # noqa: E402  (the run-folder helpers, shared with ablation.py)
from lab_runs import (code_identity, iteration_of, last_error, materialise,  # noqa: E402
                  patched_code, revision_code, run_logged, worktree_code)
from compare_report import report  # noqa: E402
import compare_args  # noqa: E402
from compare_args import parse_keys  # noqa: E402
from harness.common import UserError, cli  # noqa: E402

# The default model and budget when no config file is given: config/small.py's recipe, smaller
# (docs/COMPARE.md has its timing: 2 arms x 3 seeds within 10 minutes on 2 cores, either CPU kind).
DEFAULT_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "batch_size": 16,
                 "dropout": 0.0, "optimizer": "muon", "muon_lr": 0.04, "learning_rate": 2e-3,
                 "min_lr": 2e-4, "weight_decay": 0.1}
NOISE_SEED_OFFSET = 10000  # the 'base' variant's seeds: other batches and init than the base's


def parse_args(argv):
    return compare_args.parse_args(argv, __doc__)


# ----------------------------------------------------------------------------------------
# code versions and arms

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
    for arm in arms:  # what the arm is, whatever its place in the list: its runs' folders
        what = ("patch:" + os.path.abspath(arm["name"][6:]) if arm["name"].startswith("patch:")
                else " ".join(f"{k}={v}" for k, v in sorted(arm["keys"].items())) or arm["name"])
        label = ("patch-" + os.path.basename(what) if what.startswith("patch:")
                 else what.replace("=", "-"))
        arm["folder"] = bench_runs.folder_name(what, label)
        # what its runs read, taken now: part of every run's key (names a changed file)
        arm["identity"] = code_identity(arm["code"], skip=args.out) if not arm["broken"] else {}
    if len({a["folder"] for a in arms}) < len(arms):
        raise UserError("the same variant is given twice")
    return arms


def held_out_data(args):
    """DIR/data/<id>: the dataset's train.bin and tokenizer (linked), its meta.json, and the
    first eval_tokens tokens of its val.bin, so that every run and every score reads the same
    tokens. Named by a hash of the source folder, its meta.json, the slice's tokens and the
    train split's and tokenizer's files: other data is another folder, part of every run's key,
    so no finished run is reused with other data."""
    src = args.src_data
    if not os.path.exists(os.path.join(src, "val.bin")) and args.dataset == "pystdlib" \
            and not args.data_dir:  # what train.py would do on first use
        subprocess.run([sys.executable, os.path.join(ROOT, "data", "pystdlib", "prepare.py")],
                       check=True)
    from harness.dataset import load_meta, open_split
    meta = load_meta(src)
    val = np.asarray(open_split(src, "val", meta))[:args.eval_tokens]
    meta = dict(meta, val_tokens=len(val))
    h = hashlib.sha256(json.dumps([src, meta], sort_keys=True).encode() + val.tobytes())
    for name in ("train.bin", "tokenizer.model"):  # a rebuilt file has another size or mtime
        if os.path.exists(os.path.join(src, name)):
            st = os.stat(os.path.join(src, name))
            h.update(f"{name} {st.st_size} {st.st_mtime_ns}".encode())
    key = h.hexdigest()[:12]

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
        for arm in arms:
            seed = args.first_seed + i + arm["seed_offset"]
            runs.append({"arm": arm, "seed": seed, "pair": i,
                         "dir": os.path.join(args.out, "runs", f"{arm['folder']}_s{seed}")})
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
            + ([config_snapshot(args)] if args.config else [])
            + [f"--{k}={v}" for k, v in keys.items()]
            + list(args.train_extra) + [f"--{k}={v}" for k, v in arm["keys"].items()])


def config_snapshot(args):
    """DIR/config/<hash>-<name>: the config file as compare read it at the start, which every
    run trains on (train.py reads the file it is given: an edit while compare runs would
    otherwise mix two configurations in one comparison)."""
    name = f"{args.config_sha[:12]}-{os.path.basename(args.config)}"
    path = os.path.join(args.out, "config", name)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(args.config_bytes)
        os.replace(path + ".tmp", path)
    return path


def run_key(args, run, cmd, data):
    """Everything that decides a run: its code (what its runs read, file by file), the config
    file's contents as read at the start (not its path), the data (the held-out folder's name
    is a hash of it) and every other flag."""
    paths = (f"--out_dir={run['dir']}", f"--data_dir={data}",
             config_snapshot(args) if args.config else None)
    return {"code": run["arm"]["identity"], "config file": args.config_sha,
            "data": os.path.basename(data), "flags": [a for a in cmd[2:] if a not in paths]}


def train_and_score(args, run, data, progress=None):
    """Train (unless finished with the same key) and score one run; its record in
    run['result'] and its key in run['key'], or a one-line reason in run['arm']['broken']."""
    arm, cmd = run["arm"], train_command(args, run, data)
    run["key"] = key = run_key(args, run, cmd, data)
    stats_path = os.path.join(run["dir"], "compare_run.json")
    why = "--retrain" if args.retrain else bench_runs.stale(run["dir"], key, args.max_iters)
    if why is None and os.path.exists(stats_path):
        with open(stats_path) as f:
            run["result"] = json.load(f)
        return "reused"
    say = progress.write if progress else print
    if why not in (None, "new", "--retrain"):  # the user asked for --retrain: no line a run
        say(f"{arm['name']} seed {run['seed']}: trained again ({why})")
    shutil.rmtree(run["dir"], ignore_errors=True)  # a stale or interrupted run of ours
    os.makedirs(run["dir"])

    def on_line(line):  # the bar moves while the run trains, not only when it ends
        it = iteration_of(line)
        if progress and it is not None:
            progress.at(it)
    if progress:  # train.py starts torch and builds the model before its first line
        progress.phase("starting train.py")
    env = dict(os.environ, OMP_NUM_THREADS=args.threads)
    rc, rss = run_logged(cmd, arm["code"], os.path.join(run["dir"], "train.out"), on_line, env)
    log = bench_runs.read_log(run["dir"])
    if rc:
        arm["broken"] = f"train.py failed (exit {rc}): {last_error(os.path.join(run['dir'], 'train.out'))}"
        return "failed"
    if not log or log[-1]["iter"] != args.max_iters:  # a signal: train.py saves and exits 0
        it, tokens = (log[-1]["iter"], log[-1]["tokens"]) if log else (0, 0)
        arm["broken"] = (f"train.py stopped at iteration {it} of {args.max_iters} ({tokens:,} "
                         "tokens) and exited 0 (a signal?): not scored; run the same command "
                         "again to train it anew")
        return "failed"
    if progress:
        progress.phase(f"scoring {args.eval_tokens:,} held-out tokens (eval.py)")
    score = score_run(args, run, env)
    if score is None:
        return "failed"
    run["result"] = {"seed": run["seed"], "loss": score["nats_per_token"],
                     "bpb": score["bits_per_byte"], "scored_tokens": score["tokens"],
                     "iters": log[-1]["iter"], "tokens": log[-1]["tokens"],
                     "train_s": log[-1]["time_s"],
                     "tokens_per_s": log[-1]["tokens"] / log[-1]["time_s"],
                     "peak_rss_mib": rss, "params": count_params(run["dir"]),
                     "threads": args.threads}
    bench_runs.write_atomic(stats_path, json.dumps(run["result"]))
    bench_runs.write_atomic(os.path.join(run["dir"], "run_key.json"), json.dumps(key))  # last
    return "trained"


def score_run(args, run, env):
    """eval.py's JSON line for the finished run (the arm's own eval.py, float32, the whole
    held-out slice), or None with the reason in the arm's 'broken'."""
    arm, score_out = run["arm"], os.path.join(run["dir"], "eval.out")
    rc, _ = run_logged([sys.executable, os.path.join(arm["code"], "eval.py"),
                        f"--out_dir={run['dir']}", "--split=val", "--json=True",
                        f"--device={args.device}", "--dtype=float32"], arm["code"], score_out,
                       env=env)
    if rc:
        arm["broken"] = f"eval.py failed (exit {rc}): {last_error(score_out)}"
        return None
    with open(score_out) as f:
        return json.loads([ln for ln in f if ln.startswith("{")][-1])


def count_params(run_dir):
    """Parameters in the checkpoint's weights, a tied tensor counted once."""
    import torch
    sd = torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=True)["model"]
    seen = {t.untyped_storage().data_ptr(): t.numel() for t in sd.values()}
    return sum(seen.values())


def train_all(args, runs, data):
    """Every run, with progress by iterations as each trains (a bar on a terminal, a plain line
    with an estimate otherwise: a run takes minutes)."""
    bar = bench_runs.RunsProgress(len(runs), args.max_iters)
    for k, run in enumerate(runs):
        arm = run["arm"]
        bar.start(k, f"{arm['name']} seed {run['seed']}")
        what = "skipped" if arm["broken"] else train_and_score(args, run, data, bar)
        bar.end(trained=what in ("trained", "failed"))
        if arm["broken"] and what != "skipped":
            bar.write(f"error: variant {arm['name']!r} is broken: {arm['broken']} "
                      f"(see {run['dir']}); the other arms go on")
        elif what == "reused":
            bar.write(f"{arm['name']} seed {run['seed']}: finished run reused")
    bar.close()


def check_runs(args, runs):
    """Before reporting: every scored run's key and record, read again from its folder, are the
    ones this comparison made or reused (another compare writing to the same --out retrains a
    folder under another key), and a note when the config file changed meanwhile (the runs
    trained on the snapshot: the comparison holds, the file no longer says what it measured)."""
    for run in (r for r in runs if "result" in r):
        found = {}
        for name in ("run_key.json", "compare_run.json"):
            try:
                with open(os.path.join(run["dir"], name)) as f:
                    found[name] = json.load(f)
            except (OSError, ValueError):
                found[name] = None
        key = json.loads(json.dumps(run["key"]))  # as JSON reads it back (tuples as lists)
        old = found["run_key.json"] or {}
        parts = [p for p in key if old.get(p) != key[p]]
        if parts or found["compare_run.json"] != run["result"]:
            raise UserError(f"{run['dir']} changed while this compare ran (its "
                            f"{', '.join(parts) or 'result'} is not this comparison's): another "
                            "process wrote there; give each compare its own --out")
    if args.config and bench_runs.content("", args.config) != args.config_bytes:
        print(f"note: {args.config} changed while compare ran; every run trained on its "
              f"contents at the start ({config_snapshot(args)})")


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
    print(f"every run: OMP_NUM_THREADS={args.threads} (" + ("yours" if os.environ.get(
        "OMP_NUM_THREADS") else "the cores free at the start; set OMP_NUM_THREADS to choose")
        + ")")
    train_all(args, runs, data)
    check_runs(args, runs)
    if arms[0]["broken"]:
        raise UserError(f"the base is broken: {arms[0]['broken']}")
    return report(args, argv, arms, runs, t0)


if __name__ == "__main__":
    main(sys.argv[1:])
