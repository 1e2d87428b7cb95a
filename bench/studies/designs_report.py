"""bench/studies/designs.py's report: each design's targets (the fine-tuned gain at 4x, passkey at 4x,
1x within the noise of bench/compare.py's reference), the tables of every reading
(tables.md), results.json and the plot (designs.png). It reads rows the study stored; it runs
nothing."""
import json
import os

import numpy as np

from stats import interval  # the importer puts bench/lab/ and bench/studies/ on sys.path
from lab_runs import pyplot, save_figure, write_atomic
from study import runs_record


GAIN, PASSKEY = 0.02, 0.90  # the targets: bits per byte gained at 4x over 1x; passkey at 4x
SEEDS_TO_MEET = 2  # a target counts as met on this many seeds at least (one run is not a result)


def reading_stages(args):
    """The extra inference-only stages, one per --readings name."""
    return [f"inference+{r}" for r in args.readings]


def key_counts(args):
    """The passkey grids: one key, and --pk_keys where it is more."""
    return sorted({1, args.pk_keys})


def within_noise(out, specs):
    """{design: (Δ bits/byte against the reference, the noise floor, within)} from
    bench/compare.py's results.json in out/compare (specs: {design: its --variant}): within
    where the design is better, or worse by no more than the reference differs from itself at
    other seeds (the far end of its 95% interval)."""
    path = os.path.join(out, "compare", "results.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        arms = {r["arm"]: r for r in json.load(f)}
    noise = arms.get("base, other seeds", {}).get("bpb_diff")
    if not noise:
        return {}
    floor = max(abs(x) for x in noise["ci95"] or [noise["mean"]])
    out = {}
    for name, spec in specs.items():
        d = arms.get(spec, {}).get("bpb_diff")
        if d:
            out[name] = (d["mean"], floor, d["mean"] <= floor)
    return out



def seed_means(rows, key, **match):
    """{seed: mean of key} over the rows matching every key=value (passkey: over depths)."""
    acc = {}
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            acc.setdefault(r["seed"], []).append(r[key])
    return {s: sum(v) / len(v) for s, v in acc.items()}


def show(values, fmt="{:.4f}"):
    """Mean over seeds ± the half-width of its 95% t interval (none with one seed)."""
    if not values:
        return ""
    mean, half = interval(list(values))
    return fmt.format(mean) + ("" if half is None else " ± " + fmt.format(half))


def lengths_in(rows, **match):
    """The lengths read in the rows matching every key=value, in order."""
    return sorted({r["length"] for r in rows if all(r.get(k) == v for k, v in match.items())})


def grid(rows, designs, key, block, fmt, **match):
    """Markdown: a row per design, a column per length (a multiple of block)."""
    lengths = lengths_in(rows, **match)
    out = ["| design | " + " | ".join(f"{n / block:g}x ({n})" for n in lengths) + " |",
           "|---|" + "---:|" * len(lengths)]
    for d in designs:
        out.append(f"| {d} | " + " | ".join(show(seed_means(rows, key, design=d, length=n,
                                                             **match).values(), fmt)
                                            for n in lengths) + " |")
    return "\n".join(out)


def targets(args, rows, noise):
    """Per design: the gain of its fine-tuned 4x window over its own 1x window on text (per
    seed), its passkey accuracy at 4x after the fine-tune (one key and K), its 1x Δ against
    the reference (noise: within_noise's), and which targets it meets (by its mean over at
    least SEEDS_TO_MEET seeds)."""
    B, bp, out = args.block_size, args.pk_block, {}
    for d in args.designs:
        at1 = seed_means(rows, "bits_per_byte", model="text", stage="inference", design=d,
                         length=B)
        at4 = seed_means(rows, "bits_per_byte", model="text", stage="finetuned", design=d,
                         length=4 * B)
        gain = [at1[s] - at4[s] for s in at1 if s in at4]
        pk = {k: list(seed_means(rows, "accuracy", model="passkey", stage="finetuned", design=d,
                                 length=4 * bp, keys=k).values()) for k in (1, args.pk_keys)}
        cmp = noise.get(d) if d != next(iter(args.designs)) else (0.0, None, True)
        met = [len(gain) >= SEEDS_TO_MEET and interval(gain)[0] >= GAIN,
               len(pk[1]) >= SEEDS_TO_MEET and interval(pk[1])[0] >= PASSKEY, bool(cmp) and cmp[2]]
        out[d] = dict(gain=gain, passkey_4x=pk[1], multikey_4x=pk[args.pk_keys],
                      vs_reference_1x=cmp, met=met, inference_only=inference_only(args, rows, d))
    return out


def inference_only(args, rows, d):
    """The design's best reading without a fine-tune (plain, or one of --readings): its stage,
    the gain of its 4x window over the base's 1x on text (per seed) and its passkey at 4x."""
    B, best = args.block_size, None
    at1 = seed_means(rows, "bits_per_byte", model="text", stage="inference", design=d, length=B)
    for stage in ["inference"] + reading_stages(args):
        at4 = seed_means(rows, "bits_per_byte", model="text", stage=stage, design=d, length=4 * B)
        gain = [at1[s] - at4[s] for s in at1 if s in at4]
        pk = list(seed_means(rows, "accuracy", model="passkey", stage=stage, design=d,
                             length=4 * args.pk_block, keys=1).values())
        if gain and (best is None or np.mean(gain) > np.mean(best[1])):
            best = (stage, gain, pk)
    return best


def targets_table(args, tg):
    ok = {True: "yes", False: "no"}
    lines = [f"| design | 4x fine-tuned gain over 1x (target ≥ {GAIN}) | passkey 4x (target ≥ "
             f"{PASSKEY}) | {args.pk_keys}-key 4x | 1x Δ vs {next(iter(args.designs))} "
             f"(noise floor) | targets met | inference only: 4x gain, passkey 4x |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for d, t in tg.items():
        cmp = t["vs_reference_1x"]
        cmp_cell = ("reference" if cmp and cmp[1] is None else
                    f"{cmp[0]:+.4f} ({cmp[1]:.4f}): {'within' if cmp[2] else 'outside'}"
                    if cmp else "not run (stage compare)")
        lines.append(f"| {d} | {show(t['gain'])} | {show(t['passkey_4x'], '{:.2f}')} | "
                     f"{show(t['multikey_4x'], '{:.2f}')} | {cmp_cell} | "
                     f"{sum(t['met'])}/3 ({', '.join(ok[m] for m in t['met'])}) | "
                     f"{inference_cell(t['inference_only'])} |")
    if not any(t["gain"] for t in tg.values()):
        return "\n".join(lines + ["\nBest design: none yet (no fine-tuned text readings)."])
    best = max(tg, key=lambda d: (sum(tg[d]["met"]), interval(tg[d]["gain"])[0]
                                  if tg[d]["gain"] else -1e9))
    lines.append(f"\nBest design: **{best}**, {sum(tg[best]['met'])} of 3 targets met "
                 f"(gain, passkey, 1x within noise).")
    return "\n".join(lines)


def inference_cell(best):
    if not best:
        return ""
    stage, gain, pk = best
    return f"{show(gain)}, {show(pk, '{:.2f}') or 'not read'} ({stage})"


def plot(args, rows, path):
    """Panels against the window length (mean over seeds; dashed: inference only, solid:
    fine-tuned at 4x): bits per byte on long text, passkey accuracy with 1 key (and with K)."""
    plt = pyplot()
    if plt is None or not rows:
        return None
    panels = [("text", 0, "bits_per_byte", "long text: bits per byte"),
              ("passkey", 1, "accuracy", "passkey, 1 key: accuracy")]
    if args.pk_keys > 1:
        panels.append(("passkey", args.pk_keys, "accuracy", f"passkey, {args.pk_keys} keys: "
                                                            f"accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.8))
    panels = [(ax, *panel) for ax, panel in zip(axes, panels)]
    colors = dict(zip(args.designs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    for ax, model, keys, key, title in panels:
        block = args.block_size if model == "text" else args.pk_block
        for d in args.designs:
            for stage, ls in (("inference", "--"), ("finetuned", "-")):
                match = dict(model=model, design=d, stage=stage) | (
                    dict(keys=keys) if keys else {})
                pts = lengths_in(rows, **match)
                ys = [np.mean(list(seed_means(rows, key, length=n, **match).values()))
                      for n in pts]
                if pts:
                    ax.plot([n / block for n in pts], ys, ls=ls, marker="o", ms=3,
                            color=colors[d], label=d if stage == "finetuned" else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1x", "2x", "4x", "8x"])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("window, multiples of the trained block")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("bits per byte (lower is better)")
    axes[1].set_ylabel("mean accuracy over depths")
    for ax in axes[1:]:
        ax.set_ylim(-0.03, 1.03)
    fig.suptitle("dashed: inference only; solid: fine-tuned at 4x", fontsize=9)
    return save_figure(plt, fig, path, dpi=80)


def report(args, rows, shares, info, noise):
    runs, B, bp, names = runs_record(args.out), args.block_size, args.pk_block, list(args.designs)
    tg = targets(args, rows, noise)
    parts = ["# Position designs (bench/studies/designs.py)\n", f"## Targets ({args.seeds} seeds)\n",
             targets_table(args, tg),
             "\n## Training runs (wall minutes on the machine they ran on)\n",
             "| run | iterations | tokens | wall minutes |", "|---|---:|---:|---:|"]
    parts += [f"| {n} | {r['iterations']} | {r['tokens']:,} | {r['minutes']:.2f} |"
              for n, r in runs.items()]
    parts += ["\n## Fine-tune tokens as a share of pretraining\n",
              "\n".join(f"- {k}: {v}" for k, v in info.items()),
              "\n| run | fine-tune tokens | pretraining tokens | share |", "|---|---:|---:|---:|"]
    parts += [f"| {s['run']} | {s['ft_tokens']:,} | {s['base_tokens']:,} | {s['share']:.1%} |"
              for s in shares]
    for stage in ["inference", "finetuned"] + reading_stages(args):
        parts += [f"\n## Text, {stage}: bits per byte (mean ± 95% interval over seeds)\n",
                  grid(rows, names, "bits_per_byte", B, "{:.4f}", model="text", stage=stage)]
        for k in key_counts(args):
            parts += [f"\n## Passkey, {k} key(s), {stage}: mean accuracy over depths\n",
                      grid(rows, names, "accuracy", bp, "{:.2f}", model="passkey",
                           stage=stage, keys=k)]
    write_atomic(os.path.join(args.out, "tables.md"), "\n".join(parts) + "\n")
    write_atomic(os.path.join(args.out, "results.json"), json.dumps(
        dict(designs=args.designs, runs=runs, shares=shares, info=info, targets=tg, rows=rows),
        indent=1))
    if plot(args, rows, os.path.join(args.out, "designs.png")):
        print(f"wrote {args.out}/designs.png")
    print("\n".join(parts[1:4]))
    print(f"wrote {args.out}/tables.md and results.json")
