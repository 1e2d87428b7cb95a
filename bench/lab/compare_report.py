"""bench/compare.py's report: per arm, the mean and std over seeds of the held-out loss and
bits per byte, the paired difference from the base (bench/lab/stats.py) and its per-seed values,
the training tokens per run (an arm trained on other tokens than the base is refused, not
compared), the tokens/s and memory ratios and the wall time to the base's final loss, each
timing with a 95% interval over seeds that says whether it is within the machine's noise
(results.json); the markdown tables (results.md) and the differences' curves (compare.png). It
reads the runs' logs and scores; it runs nothing."""
import json
import math
import os
import time

import numpy as np

import lab_runs as bench_runs  # the importer puts bench/lab/ on sys.path
from stats import mean_std, paired


def time_to(log, target):
    """Wall time of the first logged evaluation whose val loss is <= target (None: never)."""
    return next((r["time_s"] for r in log if r["val_loss"] <= target), None)


def refuse_unequal_budgets(arms, runs):
    """An arm whose runs trained on other tokens than the base's first run (a patch that changes
    the batch, a run cut short) is broken, with the two counts: arms compare at equal tokens."""
    scored = [r for r in runs if "result" in r]
    base = [r["result"]["tokens"] for r in scored if r["arm"] is arms[0]]
    for arm in arms:
        other = sorted({r["result"]["tokens"] for r in scored if r["arm"] is arm} - set(base[:1]))
        if base and other and not arm["broken"]:
            arm["broken"] = (f"trained on {other[0]:,} tokens per run, the base on {base[0]:,}: "
                             "not an equal budget, not compared (give every arm the same "
                             "batch_size, block_size and max_iters)")
            print(f"error: variant {arm['name']!r} is broken: {arm['broken']}")


def ratio_interval(ratios):
    """The per-seed ratios' (arm / base, same pair) 95% interval (a t interval of their logs)
    and whether it covers 1x: within the machine's noise (None: fewer than 2 ratios, or all
    equal, leave the noise unknown)."""
    d = paired([math.log(x) for x in ratios if x and x > 0])
    if d["ci95"] is None:
        return {"ratios": ratios, "ci95": None, "within_noise": None}
    lo, hi = math.exp(d["ci95"][0]), math.exp(d["ci95"][1])
    return {"ratios": ratios, "ci95": [lo, hi], "within_noise": lo <= 1.0 <= hi}


def timings(arm_runs, base, target, alike):
    """The tokens/s and time-to-the-base's-final-loss fields of an arm's record: means, and per
    pair ratios to the base's run of the same pair with their interval."""
    res = [r["result"] for r in arm_runs]
    reach = {r["pair"]: time_to(bench_runs.read_log(r["dir"]), target) for r in arm_runs}
    reached = [t for t in reach.values() if t is not None]
    tps = mean_std([x["tokens_per_s"] for x in res])[0]
    base_tps = mean_std([b["result"]["tokens_per_s"] for b in base.values()])[0]
    speed = [r["result"]["tokens_per_s"] / base[r["pair"]]["result"]["tokens_per_s"]
             for r in arm_runs if r["pair"] in base]
    # the base reaches its own mean final loss, on average, at its end: its wall time
    slow = [reach[p] / base[p]["result"]["train_s"] for p in reach
            if p in base and reach[p] is not None]
    return {"tokens_per_s": tps,
            "tokens_per_s_ratio": tps / base_tps if alike and base_tps else None,
            "tokens_per_s_noise": ratio_interval(speed) if alike else None,
            "base_final_val_loss": target,
            "time_to_base_loss_s": mean_std(reached)[0] if reached else None,
            "seeds_reaching_base_loss": len(reached),
            "time_to_base_loss_noise": ratio_interval(slow) if alike else None}


def arm_records(args, arms, runs):
    refuse_unequal_budgets(arms, runs)
    by_arm = {a["name"]: [r for r in runs if r["arm"] is a and "result" in r] for a in arms}
    base = {r["pair"]: r for r in by_arm[arms[0]["name"]]}
    base_logs = [bench_runs.read_log(r["dir"]) for r in base.values()]
    target = (sum(lg[-1]["val_loss"] for lg in base_logs) / len(base_logs)) if base_logs else None
    base_rss = mean_std([r["result"]["peak_rss_mib"] for r in base.values()])[0]
    records = []
    for arm in arms:
        mine = by_arm[arm["name"]]
        res = [r["result"] for r in mine]
        rec = {"arm": arm["name"], "code": os.path.relpath(arm["code"], args.out),
               "runs_dir": f"runs/{arm['folder']}_sSEED",
               "keys": arm["keys"], "broken": arm["broken"], "seeds": [r["seed"] for r in res],
               "runs": res}
        if res and not arm["broken"]:
            pairs = [(r["result"], base[r["pair"]]["result"]) for r in mine if r["pair"] in base]
            # runs timed at other thread counts (reused from another invocation): no ratio
            alike = {r.get("threads") for r in res} == \
                {b["result"].get("threads") for b in base.values()}
            rss = mean_std([r["peak_rss_mib"] for r in res])[0]
            for key in ("loss", "bpb"):
                rec[key + "_mean"], rec[key + "_std"] = mean_std([r[key] for r in res])
                rec[key + "_diff"] = paired([a[key] - b[key] for a, b in pairs])
            rec["per_seed_diffs"] = [{"seed": a["seed"], "base_seed": b["seed"],
                                      "loss": a["loss"] - b["loss"], "bpb": a["bpb"] - b["bpb"]}
                                     for a, b in pairs]
            rec.update(tokens=res[0]["tokens"], params=res[0]["params"],
                       peak_rss_mib=rss, memory_ratio=rss / base_rss if base_rss else None,
                       **timings(mine, base, target, alike))
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


def noise_note(noise, is_base):
    """' (within noise)' where the per-seed ratios' interval covers 1x, ' (noise unknown)'
    where there is none; nothing for the base (its own reference) or a real difference."""
    if is_base or noise is None:
        return ""
    if noise["within_noise"] is None:
        return " (noise unknown)"
    return " (within noise)" if noise["within_noise"] else ""


def table(records):
    lines = ["| arm | seeds | tokens/run | held-out loss | bits/byte | Δ loss vs base [95% CI] p "
             "| Δ bits/byte vs base [95% CI] p | tokens/s × | memory × | params "
             "| s to base's final loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(records):
        if r["broken"] or "loss_mean" not in r:
            lines.append(f"| {r['arm']} | {len(r['seeds'])} | broken: {r['broken'] or 'no runs'}"
                         " ||||||||| ")
            continue
        reach = ("n/a (never)" if r["time_to_base_loss_s"] is None else
                 f"{r['time_to_base_loss_s']:.1f} ({r['seeds_reaching_base_loss']}/"
                 f"{len(r['seeds'])} seeds)" + noise_note(r["time_to_base_loss_noise"], i == 0))
        lines.append(f"| {r['arm']} | {len(r['seeds'])} | {r['tokens']:,} | {r['loss_mean']:.4f}"
                     f" ± {r['loss_std']:.4f} | {r['bpb_mean']:.4f} ± {r['bpb_std']:.4f} | "
                     f"{diff_cell(r['loss_diff'])} | {diff_cell(r['bpb_diff'])} | "
                     f"{fmt(r['tokens_per_s_ratio'], '.2f')}"
                     f"{noise_note(r['tokens_per_s_noise'], i == 0)} | "
                     f"{fmt(r['memory_ratio'], '.2f')} | {r['params']:,} | {reach} |")
    return "\n".join(lines)


def seed_table(records):
    """The per-seed differences the paired test is computed from, one column per base seed."""
    rows = [r for r in records[1:] if r.get("per_seed_diffs")]
    seeds = sorted({d["base_seed"] for r in rows for d in r["per_seed_diffs"]})
    lines = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|" + "---:|" * len(seeds)]
    for r in rows:
        by = {d["base_seed"]: d for d in r["per_seed_diffs"]}
        cells = [("" if s not in by else f"{by[s]['loss']:+.4f}" + (
            f" (its seed {by[s]['seed']})" if by[s]["seed"] != s else "")) for s in seeds]
        lines.append(f"| {r['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if rows else "(no variant was scored)"


def plot(args, arms, runs, records):
    """At the differences' scale (a 0.01-nat effect on a 4-8 nat curve is invisible): left,
    each arm's val loss minus its base pair's at every evaluation against tokens (mean over
    pairs, min-max band, the base at 0); right, the per-seed held-out differences with their
    mean and 95% interval."""
    plt = bench_runs.pyplot()
    if plt is None:
        return None
    fig, (curves, final) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = {r["pair"]: bench_runs.read_log(r["dir"]) for r in runs
            if r["arm"] is arms[0] and "result" in r}
    for ax in (curves, final):
        ax.axhline(0.0, color="k", lw=1, label=f"{arms[0]['name']} (0)")
    shown = [(arm, rec) for arm, rec in zip(arms[1:], records[1:])
             if not arm["broken"] and rec.get("per_seed_diffs")]
    for k, (arm, rec) in enumerate(shown):
        logs = [(bench_runs.read_log(r["dir"]), base[r["pair"]]) for r in runs
                if r["arm"] is arm and "result" in r and r["pair"] in base]
        n = min(min(len(a), len(b)) for a, b in logs)
        diffs = np.array([[a[i]["val_loss"] - b[i]["val_loss"] for i in range(n)]
                          for a, b in logs])
        xs = [rec_["tokens"] for rec_ in logs[0][1][:n]]
        line, = curves.plot(xs, diffs.mean(0), marker=".", label=f"{arm['name']} ({len(logs)} pairs)")
        curves.fill_between(xs, diffs.min(0), diffs.max(0), color=line.get_color(), alpha=0.25)
        per_seed = [d["loss"] for d in rec["per_seed_diffs"]]
        final.plot([k + 1] * len(per_seed), per_seed, "o", color=line.get_color(), alpha=0.6)
        ci = rec["loss_diff"]["ci95"] or [rec["loss_diff"]["mean"]] * 2
        final.errorbar([k + 1], [rec["loss_diff"]["mean"]], color=line.get_color(), capsize=6,
                       yerr=[[rec["loss_diff"]["mean"] - ci[0]], [ci[1] - rec["loss_diff"]["mean"]]],
                       fmt="s")
    curves.set_xlabel("training tokens")
    curves.set_ylabel("Δ val loss vs base, same seed (nats/token)")
    final.set_xticks(range(1, len(shown) + 1), [a["name"] for a, _ in shown], rotation=15)
    final.set_xlim(0.5, max(1, len(shown)) + 0.5)
    final.set_ylabel("Δ held-out loss vs base (nats/token)")
    for ax in (curves, final):
        ax.grid(alpha=0.3)
    curves.legend(fontsize=8)
    fig.suptitle(f"{args.max_iters} iterations per run; left: mean and min–max over seed pairs; "
                 "right: per seed (dots), mean and 95% interval")
    return bench_runs.save_figure(plt, fig, os.path.join(args.out, "compare.png"), dpi=100)


def report(args, argv, arms, runs, t0):
    """Write results.json, results.md and compare.png under args.out, print the tables;
    returns the records."""
    records = arm_records(args, arms, runs)
    md = "\n".join([
        f"# Compare: {len(arms)} arms x {args.seeds} seeds", "",
        f"Command: `python bench/compare.py {' '.join(argv)}`", "",
        f"{args.max_iters} iterations per run (training tokens per run: the table's column; an "
        f"arm trained on other tokens than the base is not compared); held-out: the first "
        f"{records[0]['runs'][0]['scored_tokens']:,} tokens of "
        f"{args.src_data}/val.bin scored by eval.py (float32). Δ: arm − base, paired by seed "
        f"(t-test over seeds). Ratios: arm / base. tokens/s and the time to the base's final "
        f"loss move with the machine's load (two identical runs have read 0.81x and 1.20x): "
        f"'within noise' where the 95% interval of their per-seed ratios covers 1x. "
        f"OMP_NUM_THREADS={args.threads}. Wall time of this invocation: "
        f"{(time.time() - t0) / 60:.1f} min.", "", table(records), "",
        "Per-seed differences of the held-out loss (arm − base, nats per token):", "",
        seed_table(records), ""])
    bench_runs.write_atomic(os.path.join(args.out, "results.json"), json.dumps(records, indent=1))
    bench_runs.write_atomic(os.path.join(args.out, "results.md"), md)
    png = plot(args, arms, runs, records)
    print(md)
    print(f"wrote {args.out}/results.json, results.md" + (", compare.png" if png else ""))
    return records
