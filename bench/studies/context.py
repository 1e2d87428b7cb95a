"""The context-extension study, one command: a RoPE run trained at block B is read at
1x, 1.1x, 1.2x, 2x, 4x and 8x B by five methods -- none (plain RoPE past its length), linear
(position interpolation), ntk, yarn (each with rope_factor = L / B) and local (plain RoPE, each
token seeing only its last B tokens) -- first at inference only, then after a short fine-tune at
4B (`train.py --init_from`, factor 4; at 8x the scaled runs are also read with factor 8).
Two models: config/small.py's on the default corpus (bits per byte on long held-out
documents), and a small passkey model (greedy recall of a 5-digit key, lengths x depths).

    python bench/studies/context.py                           # everything: train, evaluate, report
    python bench/studies/context.py --stages=passkey,report   # a part; finished work is never redone
    python bench/studies/context.py --seeds=1337,1338         # more seeds of the text model

Resumable: a training run whose log reached its last iteration, and an evaluation whose JSON
exists, are skipped. Under --out (default bench/results/context, git-ignored): runs/ (the
checkpoints), logs/, evals/ (eval.py's JSON lines, one file per call), evalset/ (the held-out
documents scored), data/ (the passkey corpora), results.json (every row and each training's
wall minutes), tables.md and context.png (bits per byte against length; needs matplotlib).
Time, measured on a 2-core CPU shared with other jobs (docs/CONTEXT.md): about 80 minutes
for one text seed and one passkey seed run one after the other, of which the base run
(config/small.py's 300 iterations) took 10 to 32 minutes depending on the load, the passkey
model 18, each fine-tune 1-3, and the evaluations about 15.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lab"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import study as bench_study  # noqa: E402  (the run helpers: shared with designs.py)
from study import (ROOT, ensure_corpus, eval_set, evaluate, fine_tune,  # noqa: E402
                   lengths_of, passkey_corpus, runs_record, tag_rows, train)
from lab_runs import pyplot, save_figure  # noqa: E402
from stats import spread  # noqa: E402
from harness.common import cli  # noqa: E402

SCALED = ("linear", "ntk", "yarn")
COLORS = dict(none="C0", linear="C1", ntk="C2", yarn="C3", local="C4")  # the plot's


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "context"))
    p.add_argument("--stages", default="text,passkey,report", help="text, passkey, report")
    p.add_argument("--data_dir", default=os.path.join(ROOT, "data", "pystdlib"),
                   help="the default corpus (built by data/pystdlib/prepare.py if missing)")
    p.add_argument("--seeds", default="1337", help="seeds of the text model")
    p.add_argument("--multiples", default="1,1.1,1.2,2,4,8", help="lengths as multiples of B")
    p.add_argument("--eval_docs", type=int, default=6, help="held-out documents scored")
    p.add_argument("--eval_doc_tokens", type=int, default=4096, help="each cut to this many")
    p.add_argument("--ft_iters", type=int, default=50, help="text fine-tune at 4B: iterations")
    p.add_argument("--ft_batch", type=int, default=4, help="text fine-tune: sequences a step")
    p.add_argument("--pk_seeds", default="1337", help="seeds of the passkey model")
    p.add_argument("--pk_block", type=int, default=128, help="the passkey model's block B_p")
    p.add_argument("--pk_iters", type=int, default=1500)
    p.add_argument("--pk_ft_iters", type=int, default=150)
    p.add_argument("--pk_samples", type=int, default=20, help="passkey prompts per cell")
    p.add_argument("--pk_depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--collect", action="store_true",
                   help="train and evaluate nothing: the stages' rows from what is finished")
    args = p.parse_args(argv)
    args.stages = args.stages.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.pk_seeds = [int(s) for s in args.pk_seeds.split(",")]
    args.multiples = [float(m) for m in args.multiples.split(",")]
    return args


# ----------------------------------------------------------------------------------------
# one grid: a base run read by every method at every length, and its fine-tunes


def inference_rows(out, tag, run, block, lengths, eval_args):
    """Rows of the base run at every length: none and local (one call each, every length),
    linear/ntk/yarn with rope_factor = L / B (one call per length). At 1x a factor of 1 and a
    band of B are plain RoPE: those cells are plain RoPE's rows, marked same_as_none."""
    longer = [n for n in lengths if n > block]
    rows = tag_rows(evaluate(out, f"{tag}_none", run, eval_args + [
        f"--lengths={','.join(map(str, lengths))}"]), method="none", factor=1.0)
    rows += tag_rows(evaluate(out, f"{tag}_local", run, eval_args + [
        "--window_mode=local", f"--lengths={','.join(map(str, longer))}"]),
        method="local", factor=1.0)
    for method in SCALED:
        for n in longer:
            rows += tag_rows(evaluate(out, f"{tag}_{method}_{n}", run, eval_args + [
                f"--rope_scaling={method}", f"--rope_factor={n / block}", f"--lengths={n}"]),
                method=method, factor=n / block)
    at_1x = [r for r in rows if r["method"] == "none" and r["length"] == block]
    for method in SCALED + ("local",):
        rows += tag_rows(at_1x, method=method, same_as_none=True)
    return tag_rows(rows, stage="inference")


def finetuned_rows(out, tag, ft_runs, block, lengths, eval_args):
    """Rows of the runs fine-tuned at 4B: each as trained (factor 4, or none) at every length;
    at 8x also linear/ntk/yarn with factor 8, and the none run banded to its 4B window."""
    rows, top = [], f"--lengths={max(lengths)}"
    for method, run in ft_runs.items():
        factor = 4.0 if method in SCALED else 1.0
        rows += tag_rows(evaluate(out, f"{tag}_ft_{method}", run, eval_args + [
            f"--lengths={','.join(map(str, lengths))}"]), method=method, factor=factor)
        if method in SCALED:
            rows += tag_rows(evaluate(out, f"{tag}_ft_{method}_f8", run, eval_args + [
                "--rope_factor=8", top]), method=f"{method}, factor 8", factor=8.0)
        else:
            rows += tag_rows(evaluate(out, f"{tag}_ft_local", run, eval_args + [
                "--window_mode=local", top]), method="local", factor=1.0)
    return tag_rows(rows, stage="finetuned")


# ----------------------------------------------------------------------------------------
# the two models

FT_LR = ["--learning_rate=6e-4", "--muon_lr=0.01", "--min_lr=6e-5", "--warmup_iters=5"]


def fine_tunes(out, prefix, base, block, extra, iters, batch, seed):
    """The base run continued at 4B for `iters` iterations (`extra`: its data and shape keys):
    none (plain RoPE at 4B) and linear/ntk/yarn with factor 4 (the original context stays B)."""
    runs = {}
    for method in ("none",) + SCALED:
        name = f"{prefix}_ft_{method}_s{seed}"
        runs[method] = fine_tune(out, name, base, block, iters, batch, extra + [
            f"--rope_scaling={method}", f"--rope_factor={4 if method in SCALED else 1}",
            f"--seed={seed}"], FT_LR)
    return runs


def text_study(args):
    """config/small.py on the default corpus (block 256), its fine-tunes, bits per byte."""
    ensure_corpus(args.data_dir)
    folder = eval_set(args.out, args.data_dir, args.eval_docs, args.eval_doc_tokens)
    block, data = 256, [f"--data_dir={args.data_dir}"]
    lengths, rows = lengths_of(block, args.multiples), []
    for seed in args.seeds:
        base = train(args.out, f"base_s{seed}", ["config/small.py"] + data + [
            f"--seed={seed}"], 300)
        tag, eval_args = f"text_s{seed}", [f"--input={folder}"]
        rows += tag_rows(inference_rows(args.out, tag, base, block, lengths, eval_args),
                         model="text", seed=seed)
        fts = fine_tunes(args.out, "text", base, block, data, args.ft_iters, args.ft_batch, seed)
        rows += tag_rows(finetuned_rows(args.out, tag, fts, block, lengths, eval_args),
                         model="text", seed=seed)
    return rows


def passkey_study(args):
    """A 4-layer, 128-wide model trained at block B_p on documents that fit B_p whole (key
    and question in one window), its fine-tunes at 4 B_p, accuracy per length and depth."""
    bp, rows = args.pk_block, []
    # ~3 tokens a filler word with this 1,024-piece tokenizer, ~35 tokens of key and question
    short = passkey_corpus(args.out, f"passkey{bp}", (bp - 40) // 3, 60000)
    eval_args = ["--passkey", f"--depths={args.pk_depths}", f"--samples={args.pk_samples}",
                 "--seed=4242"]
    for seed in args.pk_seeds:
        base = train(args.out, f"pk_s{seed}", ["config/small.py", f"--data_dir={short}",
            f"--block_size={bp}", "--n_embd=128", "--batch_size=16", "--warmup_iters=50",
            f"--lr_decay_iters={args.pk_iters}", f"--eval_interval={args.pk_iters // 3}",
            f"--seed={seed}"], args.pk_iters)
        long = passkey_corpus(args.out, f"passkey{4 * bp}_s{seed}", (4 * bp - 40) // 3, 20000,
                              tokenizer=base)
        lengths, tag = lengths_of(bp, [1, 2, 4, 8]), f"pk_s{seed}"
        rows += tag_rows(inference_rows(args.out, tag, base, bp, lengths, eval_args),
                         model="passkey", seed=seed)
        fts = fine_tunes(args.out, "pk", base, bp, [f"--data_dir={long}", "--n_embd=128"],
                         args.pk_ft_iters, 4, seed)
        rows += tag_rows(finetuned_rows(args.out, tag, fts, bp, lengths, eval_args),
                         model="passkey", seed=seed)
    return rows


# ----------------------------------------------------------------------------------------
# the report: tables.md, results.json, context.png


def grid_table(rows, block, key, fmt):
    """Markdown: a row per method, a column per length (as a multiple of B); each cell the
    mean over seeds (and over depths for passkey cells) of `key`, with (min–max) when there
    are several seeds."""
    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out = ["| method | " + " | ".join(f"{n / block:.3g}x ({n})" for n in lengths) + " |",
           "|---|" + "---:|" * len(lengths)]
    for m in methods:
        cells = []
        for n in lengths:
            hits = [r for r in rows if r["method"] == m and r["length"] == n]
            per_seed = {}
            for r in hits:  # passkey: the mean over depths first, then over seeds
                per_seed.setdefault(r["seed"], []).append(r[key])
            cells.append(spread([sum(v) / len(v) for v in per_seed.values()], fmt)
                         if per_seed else "")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def depth_tables(rows, block):
    """Markdown: per method, accuracy by length (rows) and depth (columns), seeds pooled."""
    out, depths = [], sorted({r["depth"] for r in rows})
    for m in dict.fromkeys(r["method"] for r in rows):
        out += [f"\n{m}:\n", "| length | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
                "|---|" + "---:|" * len(depths)]
        for n in sorted({r["length"] for r in rows if r["method"] == m}):
            cells = [[r for r in rows if (r["method"], r["length"], r["depth"]) == (m, n, d)]
                     for d in depths]
            out.append(f"| {n / block:.3g}x ({n}) | " + " | ".join(
                f"{sum(r['correct'] for r in c)}/{sum(r['samples'] for r in c)}" if c else ""
                for c in cells) + " |")
    return "\n".join(out)


def runs_table(out):
    """Markdown: every training run, its iterations, tokens and wall minutes."""
    runs = runs_record(out)
    lines = ["| run | iterations | tokens | wall minutes |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {r['iterations']} | {r['tokens']:,} | {r['minutes']:.1f} |"
              for name, r in runs.items()]
    return "\n".join(lines), runs


def series(rows, key):
    """{(stage, method): [(length, mean over seeds and depths of key)]} for plotting."""
    acc = {}
    for r in rows:
        acc.setdefault((r["stage"], r["method"]), {}).setdefault(r["length"], []).append(r[key])
    return {k: sorted((n, sum(v) / len(v)) for n, v in d.items()) for k, d in acc.items()}


def plot(rows, path):
    """Bits per byte against length, inference-only and fine-tuned, and passkey accuracy."""
    plt = pyplot()
    if plt is None:
        return
    import matplotlib.ticker
    text = [r for r in rows if r["model"] == "text"]
    keys = [r for r in rows if r["model"] == "passkey"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [(axes[0], text, "inference", "bits_per_byte", "text model, inference only"),
              (axes[1], text, "finetuned", "bits_per_byte", "text model, fine-tuned at 4x"),
              (axes[2], keys, None, "accuracy", "passkey model (dashed: fine-tuned at 4x)")]
    for ax, sel, stage, key, title in panels:
        for (st, method), pts in series(sel, key).items():
            if stage in (None, st):  # a single point: a factor-8 or banded reading at 8x
                ax.plot(*zip(*pts), marker="o" if len(pts) > 1 else "x", ms=3 + 3 * (len(pts) < 2),
                        color=COLORS[method.split(",")[0]],
                        label=method if stage or st == "inference" else None,
                        ls="--" if stage is None and st == "finetuned" else "-")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("window length (tokens)")
        ax.set_ylabel("bits per byte" if key == "bits_per_byte" else "mean accuracy")
        ax.legend(fontsize=7)
    lim = [r["bits_per_byte"] for r in text if r["length"] <= 4 * 256]
    base = [r["bits_per_byte"] for r in text if r["stage"] == "inference" and
            r["method"] == "none" and r["length"] == 256]
    for ax in axes[:2]:
        if lim:  # plain RoPE at 8x would flatten the rest
            ax.set_ylim(min(lim) - 0.02, max(lim) + 0.15)
        if base:  # the reference every method is measured against: the base run at 1x
            ax.axhline(sum(base) / len(base), color="grey", ls=":", lw=1)
    print(f"wrote {save_figure(plt, fig, path, dpi=80)}")


def report(args, rows):
    runs_md, runs = runs_table(args.out)
    parts = ["# Context extension study (bench/studies/context.py)\n",
             "## Training runs (wall minutes on the machine they ran on)\n", runs_md]
    for model, key, fmt, block in [("text", "bits_per_byte", "{:.4f}", 256),
                                   ("passkey", "accuracy", "{:.2f}", args.pk_block)]:
        for stage in ("inference", "finetuned"):
            sel = [r for r in rows if r["model"] == model and r["stage"] == stage]
            if sel:
                what = "bits per byte" if model == "text" else "mean accuracy over depths"
                parts += [f"\n## {model} model, {stage}: {what}\n",
                          grid_table(sel, block, key, fmt)]
                if model == "passkey":
                    parts.append(depth_tables(sel, block))
    with open(os.path.join(args.out, "tables.md"), "w") as f:
        f.write("\n".join(parts) + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(runs=runs, rows=rows), f, indent=1)
    plot(rows, os.path.join(args.out, "context.png"))
    print(f"wrote {args.out}/tables.md and results.json")


@cli
def main(argv):
    """Each stage saves its rows (rows_text.json, rows_passkey.json); the report reads the
    rows of every stage run so far, so stages may run in separate invocations."""
    args = parse_args(argv)
    t0, bench_study.COLLECT = time.time(), args.collect
    for stage, study in (("text", text_study), ("passkey", passkey_study)):
        if stage in args.stages:
            rows = study(args)
            with open(os.path.join(args.out, f"rows_{stage}.json"), "w") as f:
                json.dump(rows, f)
    if "report" in args.stages:
        rows = []
        for stage in ("text", "passkey"):
            path = os.path.join(args.out, f"rows_{stage}.json")
            if os.path.exists(path):
                with open(path) as f:
                    rows += json.load(f)
        report(args, rows)
    print(f"done in {(time.time() - t0) / 60:.1f} minutes")

if __name__ == "__main__":
    main(sys.argv[1:])
