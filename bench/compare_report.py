"""bench/compare.py's report: per arm, the mean and std over seeds of the held-out loss and
bits per byte, the paired difference from the base (bench/stats.py), the tokens/s and memory
ratios and the wall time to the base's final loss (results.json); the markdown table
(results.md) and the loss curves (compare.png). It reads the runs' logs and scores; it runs
nothing."""
import json
import os
import time

import numpy as np

import lab_runs as bench_runs  # the importer puts bench/ on sys.path
from stats import mean_std, paired


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
               "runs_dir": f"runs/{arm['folder']}_sSEED",
               "keys": arm["keys"], "broken": arm["broken"], "seeds": [r["seed"] for r in res],
               "runs": res}
        if res and not arm["broken"]:
            pairs = [(r["result"], base[r["pair"]]) for r in by_arm[arm["name"]]
                     if r["pair"] in base]
            reach = [time_to(bench_runs.read_log(r["dir"]), target) for r in by_arm[arm["name"]]]
            tps = mean_std([r["tokens_per_s"] for r in res])[0]
            # runs timed at other thread counts (reused from another invocation): no ratio
            alike = {r.get("threads") for r in res} == {r.get("threads") for r in base.values()}
            rss = mean_std([r["peak_rss_mib"] for r in res])[0]
            for key in ("loss", "bpb"):
                rec[key + "_mean"], rec[key + "_std"] = mean_std([r[key] for r in res])
                rec[key + "_diff"] = paired([a[key] - b[key] for a, b in pairs])
            reached = [t for t in reach if t is not None]
            rec.update(tokens=res[0]["tokens"], params=res[0]["params"], tokens_per_s=tps,
                       tokens_per_s_ratio=tps / base_tps if alike and base_tps else None,
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
        why = "1 pair" if d["pairs"] < 2 else "identical differences"
        return f"{d['mean']:+.4f} ({why}: no interval)"
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


def report(args, argv, arms, runs, t0):
    """Write results.json, results.md and compare.png under args.out, print the table;
    returns the records."""
    records = arm_records(args, arms, runs)
    md = "\n".join([
        f"# Compare: {len(arms)} arms x {args.seeds} seeds", "",
        f"Command: `python bench/compare.py {' '.join(argv)}`", "",
        f"{args.max_iters} iterations, {records[0]['tokens']:,} training tokens per run; held-out:"
        f" the first {records[0]['runs'][0]['scored_tokens']:,} tokens of "
        f"{args.src_data}/val.bin scored by eval.py (float32). Δ: arm − base, paired by seed "
        f"(t-test over seeds). Ratios: arm / base. OMP_NUM_THREADS={args.threads}. Wall time "
        f"of this invocation: "
        f"{(time.time() - t0) / 60:.1f} min.", "", table(records), ""])
    bench_runs.write_atomic(os.path.join(args.out, "results.json"), json.dumps(records, indent=1))
    bench_runs.write_atomic(os.path.join(args.out, "results.md"), md)
    png = plot(args, arms, runs)
    print(md)
    print(f"wrote {args.out}/results.json, results.md" + (", compare.png" if png else ""))
    return records
