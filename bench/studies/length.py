"""The length study, one command: the recall model (config/recall.py on data/recall/prepare.py's
documents) trained at its window B with each position design and N seeds, then asked for a
value at 1x, 4x and 16x B, at depths 0..1, the same prompts for every design. docs/CONTEXT.md
holds the table it writes and what it found.

    python bench/studies/length.py                                # everything (resumable)
    python bench/studies/length.py --seeds=1 --designs=rope,nope2  # a part; finished runs reused
    python bench/studies/length.py --collect                       # the table from what is done
    python bench/studies/length.py --collect --designs=yarn --digits=4  # each answer digit at 4x

A design trains (`train`: flags to train.py), or recalibrates another design's run (`recal`:
train.py --init_from for --recal of its iterations), or only reads another's run (`reads`);
`read` is what load_run changes at inference, "{f}" in it the length's multiple of B. A prompt
is scored by teacher forcing: correct when every answer digit is the argmax, which is what
greedy decoding returns. Under --out (default bench/results/length, git-ignored): runs/,
logs/, results.json (accuracy per design, seed, length and depth), tables.md, length.png.
"""
import argparse
import json
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor

from unittest.mock import patch

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lab"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import study  # noqa: E402  (resumable train.py runs; it puts the repo root on sys.path)
from study import ROOT  # noqa: E402
from lab_runs import write_atomic  # noqa: E402
from stats import interval  # noqa: E402  (the lab's 95% t interval)
from data.recall.prepare import prompt  # noqa: E402
from harness.common import UserError, cli  # noqa: E402
from harness.load import load_run  # noqa: E402

CONFIG = "config/recall.py"
DESIGNS = {
    "rope": dict(train=[]),
    "yarn": dict(reads="rope", read={"rope_scaling": "yarn", "rope_factor": "{f}"}),  # + its gain
    "logn": dict(reads="rope", read={"length_temperature": 0.5}),  # q x 1 + 0.5 ln(n / B)
    "yarn_logn": dict(reads="rope", read={"rope_scaling": "yarn", "rope_factor": "{f}",
                                          "length_temperature": 0.5}),
    "nope2": dict(train=["--nope_every=2"]),  # the second layer (of 2) rotates nothing
    "prope": dict(train=["--rotary_fraction=0.25", "--rope_base=10"]),  # the 4 fastest of 16 pairs
    "swa": dict(train=["--window=32", "--global_every=2"]),  # layer 0 sees 32 tokens, layer 1 all
    "rnope_swa": dict(train=["--window=32", "--global_every=2", "--nope_every=2"]),  # 1: NoPE too
    "drope": dict(recal="rope", train=["--nope_every=1"]),  # RoPE dropped, then recalibrated
    # combinations: a design's run read with YaRN or the log-length temperature, or both
    "nope2_yarn": dict(reads="nope2", read={"rope_scaling": "yarn", "rope_factor": "{f}"}),
    "nope2_logn": dict(reads="nope2", read={"length_temperature": 0.5}),
    "nope2_yarn_logn": dict(reads="nope2", read={"rope_scaling": "yarn", "rope_factor": "{f}",
                                                 "length_temperature": 0.5}),
    "rnope_swa_logn": dict(reads="rnope_swa", read={"length_temperature": 0.5}),
}
MULTIPLES = (1, 4, 16)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
EVAL_SEED = 4242  # the prompts: the same for every design, seed and run


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "length"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "recall"),
                   help="the recall dataset's folder (prepared there when missing)")
    p.add_argument("--docs", type=int, default=200000, help="documents, when it is prepared")
    p.add_argument("--designs", default=",".join(DESIGNS), help="names in DESIGNS, commas between")
    p.add_argument("--seeds", type=int, default=5, help="seeds a design (1337, 1338, ...)")
    p.add_argument("--iters", type=int, default=4000, help="training iterations a run")
    p.add_argument("--recal", type=float, default=0.02, help="a recalibration's share of --iters")
    p.add_argument("--samples", type=int, default=20, help="prompts per (length, depth)")
    p.add_argument("--needles", type=int, default=1, help="needles in a prompt (one asked)")
    p.add_argument("--jobs", type=int, default=2, help="training runs at once, 1 thread each")
    p.add_argument("--collect", action="store_true", help="train nothing: report what is done")
    p.add_argument("--digits", type=int, default=0, metavar="M",
                   help="only print each finished run's accuracy per answer digit at M x B")
    args = p.parse_args(argv)
    args.designs = args.designs.split(",")
    unknown = [d for d in args.designs if d not in DESIGNS]
    if unknown:
        raise UserError(f"unknown design {unknown[0]!r} (known: {', '.join(DESIGNS)})")
    if args.seeds < 1 or args.jobs < 1 or not 0 < args.recal < 1 or args.samples < 1:
        raise UserError("need --seeds >= 1, --jobs >= 1, --samples >= 1 and 0 < --recal < 1")
    return args


def run_of(design):
    """The design whose runs `design` reads."""
    return DESIGNS[design].get("reads", design)


def train_one(args, design, seed):
    """train.py for one (design, seed) into out/runs (reused when finished); its folder."""
    d, common = DESIGNS[design], [CONFIG, f"--seed={seed}", f"--data_dir={args.data}"]
    if "recal" not in d:
        return study.train(args.out, f"{design}_s{seed}",
                           common + d["train"] + [f"--lr_decay_iters={args.iters}",
                                                  f"--warmup_iters={min(30, args.iters)}"],
                           args.iters)
    iters = max(1, round(args.recal * args.iters))  # at the parent's final rates, no warmup
    parent = os.path.join(args.out, "runs", f"{d['recal']}_s{seed}")
    return study.train(args.out, f"{design}_s{seed}", common + d["train"] + [
        f"--init_from={parent}", f"--lr_decay_iters={iters}", "--warmup_iters=0",
        "--learning_rate=3e-4", "--muon_lr=0.003", "--min_lr=3e-5"], iters)


def train_all(args, seeds):
    """Every run the designs read: the trained ones, then the recalibrations that start from
    them, `jobs` at a time. {design: {seed: run folder or None (not finished, --collect)}}."""
    study.COLLECT = args.collect
    if not args.collect and not os.path.exists(os.path.join(args.data, "meta.json")):
        study.sh(["data/recall/prepare.py", f"--out_dir={os.path.abspath(args.data)}",
                  f"--docs={args.docs}"], os.path.join(args.out, "logs", "prepare.log"))
    os.environ["OMP_NUM_THREADS"] = "1"  # one core a run: the runs side by side do not stall
    needed = {run_of(d) for d in args.designs} | {DESIGNS[d]["recal"] for d in args.designs
                                                  if "recal" in DESIGNS[d]}
    first = [d for d in DESIGNS if d in needed and "recal" not in DESIGNS[d]]
    then = [d for d in DESIGNS if d in needed and "recal" in DESIGNS[d]]
    runs = {}
    for stage in (first, then):
        jobs = [(d, s) for d in stage for s in seeds]
        with ThreadPoolExecutor(args.jobs) as pool:
            for (d, s), run in zip(jobs, pool.map(lambda j: train_one(args, *j), jobs)):
                runs.setdefault(d, {})[s] = run
    return {d: runs[run_of(d)] for d in args.designs}


def prompts(sp, multiple, block, samples, needles):
    """{depth: (ids [samples, L], answer positions, answer ids)} at L = multiple * block: the
    end-of-document token, then each prompt's characters (one token each, checked)."""
    length, grid = multiple * block, {}
    for depth in DEPTHS:
        rng, rows, answers = random.Random(f"{EVAL_SEED}-{length}-{depth}"), [], []
        for _ in range(samples):
            text, answer = prompt(rng, length, depth, needles)
            ids = [sp.eos_id()] + sp.encode(text + answer)
            if len(ids) != length:
                raise UserError(f"the run's tokenizer does not read a character as a token "
                                f"({len(ids)} tokens for {length} characters): not a recall run")
            rows.append(ids)
            answers.append(ids[-len(answer):])
        grid[depth] = (torch.tensor(rows), len(answer), torch.tensor(answers))
    return grid


def explicit_attention(kept, query):
    """A stand-in for F.scaled_dot_product_attention that computes the weights itself (float32)
    and appends each call's weights from the query positions `query` (one per row) to `kept`."""
    def sdpa(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None):
        s = (q.float() @ k.float().transpose(-1, -2)) * (scale or q.size(-1) ** -0.5)
        if is_causal:
            attn_mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else s + attn_mask
        w = s.softmax(-1)
        kept.append(w[torch.arange(len(w)), :, query])  # (rows, heads, keys)
        return (w @ v.float()).to(v.dtype)
    return sdpa


@torch.no_grad()
def per_digit(model, grid, batch):
    """Each answer digit's share of argmax hits over every prompt of the grid: where a reading
    that finds the needle (its attention) still loses the answer."""
    hits = []
    for ids, n, answers in grid.values():
        for i in range(0, len(ids), batch):
            logits, _ = model(ids[i:i + batch, :-1])
            hits.append((logits[:, -n:].argmax(-1) == answers[i:i + batch]).float())
    return torch.cat(hits).mean(0).tolist()


def digits_table(args, runs, multiple):
    """The markdown table of per_digit at `multiple` x B, a row per design and seed."""
    lines = [f"| design | seed | digit 1 | 2 | 3 | 4 (at {multiple}x) |",
             "|---|---:|---:|---:|---:|---:|"]
    for design in args.designs:
        for seed, run_dir in sorted(runs[design].items()):
            if run_dir:
                model, sp, ckpt = read_run(run_dir, design, multiple)
                grid = prompts(sp, multiple, ckpt["model_args"]["block_size"], args.samples,
                               args.needles)
                hits = per_digit(model, grid, max(1, 64 // multiple))
                lines.append(f"| {design} | {seed} | " + " | ".join(f"{h:.2f}" for h in hits)
                             + " |")
    return "\n".join(lines)


@torch.no_grad()
def accuracy(model, grid, batch):
    """{depth: (share of prompts whose every answer token is the argmax after its prefix, the
    retrieval layer's attention on the needle)}. The second: the last layer's weight, in its
    head that gives the most, from the question's name (which predicts the first digit) to the
    needle's first digit (the token after the name's first place), mean over prompts."""
    out = {}
    for depth, (ids, n, answers) in grid.items():
        right, mass = [], []
        for i in range(0, len(ids), batch):
            rows, kept = ids[i:i + batch], []
            ask = rows.size(1) - n - 1  # the question's name: its logits predict the first digit
            with patch.object(F, "scaled_dot_product_attention", explicit_attention(kept, ask)):
                logits, _ = model(rows[:, :-1])
            guess = logits[:, -n:].argmax(-1)
            right.append((guess == answers[i:i + batch]).all(-1))
            first = (rows[:, :ask] == rows[:, ask:ask + 1]).float().argmax(-1) + 1
            mass.append(kept[-1][torch.arange(len(rows)), :, first].max(-1).values)
        out[depth] = (torch.cat(right).float().mean().item(), torch.cat(mass).mean().item())
    return out


def read_run(run_dir, design, multiple):
    """The run's model with the design's reading at `multiple` x B (float32, CPU)."""
    read = {k: (float(multiple) if v == "{f}" else v) for k, v in
            DESIGNS[design].get("read", {}).items()}
    if read.get("rope_factor") == 1.0:  # 1x: a factor of 1 is plain RoPE
        read = {}
    return load_run(run_dir, "cpu", "float32", **read)


def evaluate(args, runs):
    """[{design, seed, multiple, depth, accuracy}] of every finished run, cached per run and
    reading in out/evals."""
    rows, todo = [], [(d, s, r) for d in args.designs for s, r in runs[d].items() if r]
    grids = {}
    for design, seed, run_dir in tqdm(todo, desc="reading", unit="run", disable=not todo):
        path = os.path.join(args.out, "evals", f"{design}_s{seed}.json")
        if os.path.exists(path):
            with open(path) as f:
                rows += json.load(f)
            continue
        mine = []
        for m in MULTIPLES:
            model, sp, ckpt = read_run(run_dir, design, m)
            block = ckpt["model_args"]["block_size"]
            key = (m, block)
            if key not in grids:
                grids[key] = prompts(sp, m, block, args.samples, args.needles)
            acc = accuracy(model, grids[key], batch=max(1, 64 // m))
            mine += [dict(design=design, seed=seed, multiple=m, depth=d, accuracy=a,
                          needle_attention=w) for d, (a, w) in acc.items()]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, json.dumps(mine))
        rows += mine
    return rows


def table(rows, designs):
    """The markdown tables: mean accuracy over seeds per length (a seed's: its mean over
    depths) with its 95% interval and the worst depth at 1x (the task's bar: every depth >=
    0.95); then the retrieval layer's attention on the needle, mean over seeds and depths."""
    lines = ["| design | seeds | " + " | ".join(f"{m}x" for m in MULTIPLES) +
             " | worst depth at 1x |", "|---|---:|" + "---:|" * (len(MULTIPLES) + 1)]
    looks = ["| design | " + " | ".join(f"{m}x" for m in MULTIPLES) + " |",
             "|---|" + "---:|" * len(MULTIPLES)]
    summary = {}
    for d in designs:
        mine = [r for r in rows if r["design"] == d]
        seeds = sorted({r["seed"] for r in mine})
        if not seeds:
            continue
        cells, summary[d] = [], {}
        for m in MULTIPLES:
            per_seed = [np.mean([r["accuracy"] for r in mine if r["seed"] == s and
                                 r["multiple"] == m]) for s in seeds]
            mean, half = interval(per_seed)
            look = np.mean([r["needle_attention"] for r in mine if r["multiple"] == m])
            summary[d][m] = dict(mean=mean, half=half, seeds=per_seed, needle_attention=look)
            cells.append(f"{mean:.2f}" if half is None else f"{mean:.2f} ± {half:.2f}")
        worst = min(np.mean([r["accuracy"] for r in mine if r["multiple"] == 1 and
                             r["depth"] == dep]) for dep in DEPTHS)
        summary[d]["worst_depth_1x"] = worst
        lines.append(f"| {d} | {len(seeds)} | " + " | ".join(cells) + f" | {worst:.2f} |")
        looks.append(f"| {d} | " + " | ".join(f"{summary[d][m]['needle_attention']:.2f}"
                                              for m in MULTIPLES) + " |")
    return "\n".join(lines) + "\n\nAttention on the needle:\n\n" + "\n".join(looks), summary


def plot(summary, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for d, cells in summary.items():
        means = [cells[m]["mean"] for m in MULTIPLES]
        halves = [cells[m]["half"] or 0 for m in MULTIPLES]
        ax.errorbar(MULTIPLES, means, yerr=halves, marker="o", capsize=3, label=d)
    ax.set_xscale("log", base=2)
    ax.set_xticks(MULTIPLES, [f"{m}x" for m in MULTIPLES])
    ax.set_xlabel("prompt length, multiples of the training window B = 128")
    ax.set_ylabel("recall accuracy (mean of seeds, 95% interval)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    args = parse_args(argv)
    seeds = [1337 + i for i in range(args.seeds)]
    runs = train_all(args, seeds)
    if args.digits:
        return print(digits_table(args, runs, args.digits))
    rows = evaluate(args, runs)
    os.makedirs(args.out, exist_ok=True)
    text, summary = table(rows, args.designs)
    write_atomic(os.path.join(args.out, "results.json"),
                 json.dumps(dict(rows=rows, summary=summary), indent=1))
    write_atomic(os.path.join(args.out, "tables.md"), text + "\n")
    plot(summary, os.path.join(args.out, "length.png"))
    print(text)


if __name__ == "__main__":
    cli(main)(sys.argv[1:])
