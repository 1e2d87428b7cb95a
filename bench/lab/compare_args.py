"""bench/compare.py's arguments: parsed, checked and refused in one line before anything is
built; the config file read once (its bytes are the snapshot every run trains on and is keyed
by: an edit while compare runs changes nothing it measures); and the thread count every run
gets."""
import argparse
import hashlib
import os

from harness.common import UserError  # the importer puts the repo root on sys.path
from harness.flags import run_config_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIRST_SEED = 1337
# train.py keys compare sets on every run (train_command), and init_from (another start is
# another measurement): a flag or variant that changed them would make the report lie (a
# --seed=5 after ours made every "seed" one run)
OWN_KEYS = {"out_dir", "dataset", "data_dir", "seed", "device", "max_iters", "lr_decay_iters",
            "warmup_iters", "eval_interval", "eval_iters", "compile", "wandb_log", "init_from"}
# own keys compare does not put on a run's command line, with the value every run has: a config
# file can set only these behind compare's back (the others its flags override, as
# config/small.py's max_iters)
NOT_ON_THE_COMMAND = {"init_from": "scratch"}
# the tokens a run trains on: one arm changing them is not compared at an equal budget
BUDGET_KEYS = {"batch_size", "block_size", "gradient_accumulation_steps", "short_iters"}
MAX_RUNS = 1000  # each run is a whole train.py run: more is days of work, surely a typo


def parse_args(argv, doc):
    ap = argparse.ArgumentParser(description=doc, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="", help="a train.py config file (optional)")
    ap.add_argument("--variant", action="append", default=[],
                    help="'KEY=VALUE ...', patch:FILE or base (repeat for several)")
    ap.add_argument("--against", default="", help="the base runs this git revision's code")
    ap.add_argument("--seeds", type=int, default=3, help="runs per arm: --first_seed, +1, ...")
    ap.add_argument("--first_seed", type=int, default=FIRST_SEED,
                    help="the first seed, 1337 (to split seeds over processes: see above)")
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
    if args.seeds < 1 or args.first_seed < 0 or args.max_iters < 1 or args.eval_tokens < 2:
        raise UserError("need --seeds >= 1, --first_seed >= 0, --max_iters >= 1 and "
                        "--eval_tokens >= 2")
    n_arms = 1 + bool(args.against) + len(args.variant)
    if args.seeds * n_arms > MAX_RUNS:
        raise UserError(f"--seeds={args.seeds} x {n_arms} arm{'s' * (n_arms > 1)} is "
                        f"{args.seeds * n_arms:,} train.py runs (at most {MAX_RUNS}): give "
                        "fewer seeds")
    check_keys(args)
    args.eval_interval = args.eval_interval or max(1, args.max_iters // 4)
    read_config(args)
    args.out = os.path.abspath(args.out)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out={args.out} is a file, not a folder")
    args.src_data = os.path.abspath(args.data_dir or os.path.join(ROOT, "data", args.dataset))
    args.threads = run_threads()
    return args


def read_config(args):
    """The config file's bytes, read once (args.config_bytes, args.config_sha: the snapshot),
    and refused when it sets an own key that compare does not override on the command line."""
    args.config_bytes, args.config_sha = b"", ""
    if not args.config:
        return
    if not os.path.isfile(args.config):
        raise UserError(f"config file not found: {args.config}")
    args.config = os.path.abspath(args.config)
    with open(args.config, "rb") as f:
        args.config_bytes = f.read()
    args.config_sha = hashlib.sha256(args.config_bytes).hexdigest()
    scope = run_config_file(args.config)
    for key, every_run in NOT_ON_THE_COMMAND.items():
        if key in scope and scope[key] != every_run:
            raise UserError(f"{args.config} sets {key} = {scope[key]!r}: compare sets {key} "
                            f"itself ({every_run!r} for every run; another start is another "
                            "measurement): remove that line, or give compare a copy of the "
                            "file without it")


def run_threads():
    """OMP_NUM_THREADS for every run, chosen once: the user's, else train.py's rule (the cores
    other processes keep busy now are left to them, since a torch thread waiting for a core
    stalls every step: docs/COMPARE.md) applied here at the start. One count for all runs, so
    that arms run alike: train.py choosing per run, by the load at each start, would make the
    tokens/s ratios compare thread counts."""
    if os.environ.get("OMP_NUM_THREADS"):
        return os.environ["OMP_NUM_THREADS"]
    from harness.device import busy_cores, fewer_threads, usable_cores
    cores, busy = usable_cores(), busy_cores()
    return str(fewer_threads(cores, cores, busy or 0) if cores else 1)


def check_keys(args):
    """Refuse, in one line, extra flags and variant keys that would override compare's own
    settings, empty variants, and a key given twice in one variant."""
    for a in args.train_extra:
        key = a[2:].partition("=")[0]
        if key in OWN_KEYS:
            raise UserError(f"{a}: compare sets {key} itself for every run (the pairing and the "
                            "budget depend on it); see --help")
    for spec in args.variant:
        if not spec.strip():
            raise UserError("--variant='': an empty variant (give KEY=VALUE ..., patch:FILE "
                            "or base)")
        if spec in ("base", "worktree") or spec.startswith("patch:"):
            continue
        for key in parse_keys(spec):
            if key in OWN_KEYS | BUDGET_KEYS:
                why = ("compare sets it itself for every run" if key in OWN_KEYS else
                       "it changes the tokens a run trains on: arms are compared at equal "
                       f"tokens (give --{key}=... to every arm)")
                raise UserError(f"--variant={spec!r}: {key}: {why}")


def parse_keys(spec):
    keys = {}
    for item in spec.split():
        k, eq, v = item.partition("=")
        k = k.removeprefix("--")
        if not eq or not k:
            raise UserError(f"--variant={spec!r}: expected KEY=VALUE items, got {item!r}")
        if k in keys:
            raise UserError(f"--variant={spec!r}: {k} is given twice")
        keys[k] = v
    return keys
