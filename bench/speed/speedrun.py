"""
The CPU speedrun: `python train.py config/speedrun_cpu.py` against nanoGPT's own CPU recipe,
each a whole process, alternated in pairs on one machine, on a character text.

    python bench/speed/speedrun.py --nanogpt=DIR --text=FILE_OR_FOLDER [--name=vim] [--seeds=5]
    python bench/speed/speedrun.py --nanogpt=DIR --text=T --nanogpt_runs=0 --flags="--max_iters=300"

DIR is a checkout of nanoGPT (github.com/karpathy/nanoGPT). The text (a file, or a folder's
files in name order, --ext to keep some) is cut to --chars characters and given to both sides'
own preparation: nanoGPT's data/shakespeare_char/prepare.py, copied next to the text as
DIR/data/speedrun_NAME/ (its first 90% trains, the last 10% is held out), and ours
(data/shakespeare/prepare.py --char --input). Then, for each seed, one pair of whole processes
in alternating order, each with OMP_NUM_THREADS=1 and this process's environment otherwise (so
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` holds both to AVX2): nanoGPT's README CPU
command at 2000 iterations (`python train.py config/train_shakespeare_char.py --device=cpu
--compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4
--n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`, plus its
--dataset and --out_dir), and ours (`python train.py config/speedrun_cpu.py --seed=S` plus
--data_dir, --out_dir and --flags). nanoGPT's train.py has no seed flag: its runs are one
seed, the same run each time (timed again in every pair).

Scored alike, after the clock: the two sides split the text differently (ours holds out whole
documents, nanoGPT the last 10%) and print losses over 20 random batches, so each side's own
figure is not the other's. Each final checkpoint is therefore scored on the same characters,
nanoGPT's held-out 10% in windows of 64 laid end to end (every character after the first
predicted once, float32), by its own code: nanoGPT's model.py for its checkpoint, model.py
(harness/load.py) for ours. The record's rule: ours' seeds' scored losses below nanoGPT's,
one-sided one-sample t, p < 0.01 (scipy); the time is the mean over the pairs of ours' wall
time / nanoGPT's. --nanogpt_runs=N times nanoGPT in the first N pairs only (0: reuse the
last results of this text in --work, for probes; the ratio is then not paired).
Results: --work/NAME/results.json (appended), and a table row for docs/RECORDS.md.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from harness.common import REPO, UserError, cli  # noqa: E402
from harness.files import atomic_write  # noqa: E402
from harness.flags import configure  # noqa: E402

NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
                "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                "--lr_decay_iters=2000", "--dropout=0.0"]
WINDOW = 64  # the recipe's block: both sides are scored in windows of the length they trained

# Runs in nanoGPT's folder (its model.py): a checkpoint's mean loss on its val.bin, windows of
# WINDOW laid end to end, float32. Prints one JSON line.
NANOGPT_SCORE = """
import json, sys, numpy as np, torch
from model import GPT, GPTConfig
ckpt = torch.load(sys.argv[1], map_location="cpu")
model = GPT(GPTConfig(**ckpt["model_args"]))
model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
model.eval()
ids = torch.from_numpy(np.fromfile(sys.argv[2], dtype=np.uint16).astype(np.int64))
n = (len(ids) - 1) // WINDOW_ * WINDOW_
x, y = ids[:n].view(-1, WINDOW_), ids[1:n + 1].view(-1, WINDOW_)
with torch.no_grad():
    losses = [model(x[i:i + 64], y[i:i + 64])[1].item() * len(x[i:i + 64])
              for i in range(0, len(x), 64)]
print(json.dumps({"loss": sum(losses) / len(x), "chars": n, "iter": ckpt["iter_num"]}))
""".replace("WINDOW_", str(WINDOW))


def read_text(path, chars, ext):
    """The file, or the folder's files (ending in ext) in name order, cut to `chars`."""
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                       if f.endswith(ext))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise UserError(f"--text={path} is not a file or a folder")
    parts, size = [], 0
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            parts.append(fh.read())
        size += len(parts[-1])
        if size >= chars:
            break
    if not size:
        raise UserError(f"--text={path} holds no text (files ending in {ext!r})")
    return "".join(parts)[:chars]


def prepare(args, work):
    """Both sides' data from one text: returns (nanoGPT's dataset name, our data folder,
    nanoGPT's held-out characters)."""
    text = read_text(args["text"], args["chars"], args["ext"])
    name = f"speedrun_{args['name']}"
    ng_data = os.path.join(args["nanogpt"], "data", name)
    os.makedirs(ng_data, exist_ok=True)
    with open(os.path.join(ng_data, "input.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    shutil.copy(os.path.join(args["nanogpt"], "data", "shakespeare_char", "prepare.py"), ng_data)
    subprocess.run([sys.executable, "prepare.py"], cwd=ng_data, check=True,
                   stdout=subprocess.DEVNULL)
    ours = os.path.join(work, "data")
    subprocess.run([sys.executable, os.path.join(REPO, "data", "shakespeare", "prepare.py"),
                    "--char", "--input", os.path.join(ng_data, "input.txt"), "--out_dir", ours],
                   check=True, stdout=subprocess.DEVNULL)
    return name, ours, text[int(len(text) * 0.9):]  # nanoGPT's split, to the character


def timed(cmd, cwd, log):
    """Wall seconds of one whole process, its output to `log`; a failure stops the bench."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t = time.perf_counter()
    with open(log, "w") as out:
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t
    if r.returncode:
        raise UserError(f"{' '.join(cmd[:3])} ... exited {r.returncode}: see {log}")
    return seconds


def last_val(log_jsonl):
    with open(log_jsonl) as f:
        return [json.loads(line) for line in f][-1]["val_loss"]


def score_ours(out_dir, val_text):
    """Mean loss per character of our checkpoint on nanoGPT's held-out characters."""
    import torch
    from harness.load import load_run
    model, sp, _ = load_run(out_dir, "cpu", "float32")
    ids = sp.encode(val_text)
    if len(ids) != len(val_text):  # a character-level tokenizer: one piece per character
        raise UserError(f"our tokenizer gives {len(ids)} pieces for {len(val_text)} characters")
    ids = torch.tensor(ids)
    n = (len(ids) - 1) // WINDOW * WINDOW
    x, y = ids[:n].view(-1, WINDOW), ids[1:n + 1].view(-1, WINDOW)
    with torch.no_grad():
        total = sum(model(x[i:i + 64], y[i:i + 64])[1].item() * len(x[i:i + 64])
                    for i in range(0, len(x), 64))
    return total / len(x)


def one_sided_p(values, target):
    try:
        from scipy import stats
    except ImportError:
        raise UserError("bench/speed/speedrun.py needs scipy for its t-test: pip install scipy")
    if len(values) < 2:
        return float("nan")
    return float(stats.ttest_1samp(values, target, alternative="less").pvalue)


def main(argv):
    args = configure({"nanogpt": "", "text": "", "name": "", "ext": "", "chars": 1_115_394,
                      "seeds": 5, "first_seed": 1337, "nanogpt_runs": -1,
                      "config": "config/speedrun_cpu.py", "flags": "", "work": "speedrun"},
                     argv, sources=(__file__,))
    if not args["nanogpt"] or not os.path.isfile(os.path.join(args["nanogpt"], "train.py")):
        raise UserError("--nanogpt=DIR: a checkout of github.com/karpathy/nanoGPT "
                        "(its train.py and data/shakespeare_char/prepare.py)")
    if not args["text"]:
        raise UserError("--text=FILE_OR_FOLDER: the character text both sides train on")
    args["name"] = args["name"] or os.path.basename(os.path.normpath(args["text"])).split(".")[0]
    work = os.path.abspath(os.path.join(args["work"], args["name"]))
    os.makedirs(work, exist_ok=True)
    dataset, data_dir, val_text = prepare(args, work)
    results_path = os.path.join(work, "results.json")
    history = json.load(open(results_path)) if os.path.exists(results_path) else []
    ng_runs = args["seeds"] if args["nanogpt_runs"] < 0 else args["nanogpt_runs"]
    if ng_runs == 0 and not any(p.get("nanogpt_s") for h in history for p in h["pairs"]):
        raise UserError(f"--nanogpt_runs=0 needs an earlier run of this text in {work}")
    pairs = [one_pair(args, work, i, dataset, data_dir, val_text, timed_nanogpt=i < ng_runs)
             for i in range(args["seeds"])]
    summary = summarise(args, pairs, history, len(val_text))
    history.append(summary)
    atomic_write(results_path, lambda tmp: Path(tmp).write_text(json.dumps(history, indent=1)))


def one_pair(args, work, i, dataset, data_dir, val_text, timed_nanogpt):
    """Seed first_seed + i: ours and (if timed_nanogpt) nanoGPT, in an order that alternates
    with i, each timed whole, then both scored on nanoGPT's held-out characters."""
    seed = args["first_seed"] + i
    ours_out, ng_out = os.path.join(work, f"ours-{seed}"), os.path.join(work, "nanogpt")
    shutil.rmtree(ours_out, ignore_errors=True)
    ours_cmd = [sys.executable, "train.py", args["config"], f"--seed={seed}",
                f"--data_dir={data_dir}", f"--out_dir={ours_out}", *args["flags"].split()]
    ng_cmd = [sys.executable, "train.py", *NANOGPT_ARGS, f"--dataset={dataset}",
              f"--out_dir={ng_out}"]
    pair = {"seed": seed}
    jobs = [("ours", ours_cmd, REPO)] + ([("nanogpt", ng_cmd, args["nanogpt"])]
                                         if timed_nanogpt else [])
    for side, cmd, cwd in (jobs if i % 2 == 0 else jobs[::-1]):
        pair[f"{side}_s"] = timed(cmd, cwd, os.path.join(work, f"{side}-{seed}.log"))
        print(f"seed {seed}: {side} {pair[f'{side}_s']:.1f} s", flush=True)
    if timed_nanogpt:
        out = subprocess.run([sys.executable, "-c", NANOGPT_SCORE, os.path.join(ng_out, "ckpt.pt"),
                              os.path.join("data", dataset, "val.bin")],
                             cwd=args["nanogpt"], capture_output=True, text=True, check=True)
        scored = json.loads(out.stdout.strip().splitlines()[-1])
        pair.update(nanogpt_scored=scored["loss"], nanogpt_ckpt_iter=scored["iter"],
                    nanogpt_printed=last_nanogpt_val(os.path.join(work, f"nanogpt-{seed}.log")))
    pair.update(ours_scored=score_ours(ours_out, val_text),
                ours_printed=last_val(os.path.join(ours_out, "log.jsonl")))
    print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in pair.items()
                                     if isinstance(v, float)), flush=True)
    return pair


def summarise(args, pairs, history, chars):
    """The run's record for results.json, printed: the time ratio (per pair, or against the
    earlier nanoGPT runs' mean time when this run timed none), the scored losses and p."""
    earlier = [p for h in history for p in h["pairs"] if "nanogpt_s" in p]
    timed_ng = [p for p in pairs if "nanogpt_s" in p] or earlier
    target = statistics.mean(p["nanogpt_scored"] for p in timed_ng)
    ng_s = statistics.mean(p["nanogpt_s"] for p in timed_ng)
    ratios = [p["ours_s"] / p.get("nanogpt_s", ng_s) for p in pairs]
    losses = [p["ours_scored"] for p in pairs]
    summary = {"when": time.strftime("%Y-%m-%d %H:%M"), "config": args["config"],
               "flags": args["flags"], "text": args["text"], "chars": chars,
               "env": {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                       if k in os.environ},
               "paired": all("nanogpt_s" in p for p in pairs), "pairs": pairs,
               "ratio": statistics.mean(ratios), "target": target,
               "ours_mean": statistics.mean(losses), "p": one_sided_p(losses, target)}
    print(f"\n{args['name']}: ours {summary['ratio']:.3f}x nanoGPT's time "
          f"({'paired' if summary['paired'] else 'NOT paired: nanoGPT timed earlier'}; "
          f"per pair {', '.join(f'{r:.3f}' for r in ratios)}); nanoGPT {ng_s:.1f} s")
    print(f"scored on nanoGPT's held-out {chars:,} characters: nanoGPT {target:.4f}, "
          f"ours {', '.join(f'{v:.4f}' for v in losses)} (mean {summary['ours_mean']:.4f}, "
          f"{summary['ours_mean'] - target:+.4f}); one-sided p = {summary['p']:.2g}")
    return summary


def last_nanogpt_val(log):
    """The val loss of nanoGPT's last `step N: train loss ..., val loss V` line."""
    with open(log) as f:
        lines = [line for line in f if line.startswith("step ") and "val loss" in line]
    return float(lines[-1].rsplit("val loss", 1)[1]) if lines else float("nan")


if __name__ == "__main__":
    cli(main)()
