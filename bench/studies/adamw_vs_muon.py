"""
adamw vs muon at equal steps and equal tokens (same batches, same iterations): learning rate
swept for both, three seeds at each one's best rate, on two corpora; val loss at the halfway
point and at the end; and the cost of a step.

    python data/text/prepare.py --input /usr/share/vim/vim90/doc --ext .txt --out_dir data/vimdoc
    python bench/studies/adamw_vs_muon.py                                   # the table in docs/OPTIM.md
    python bench/studies/adamw_vs_muon.py --datasets=pystdlib --iters=100   # quicker
    python bench/studies/adamw_vs_muon.py --step_cost=True --threads=2      # only the cost of a step

Every run is `python train.py config/small.py` with the overrides printed above the tables
(one training at a time, --threads torch threads each). A sweep per corpus: AdamW at each rate
of --adamw_lrs (first seed); if the best is at an end of the list, one more rate past it
(x2 or /2). Then Muon at each --muon_lrs, its AdamW part (embeddings, head, norms) at AdamW's
best rate, extended the same way. Then the other seeds at each optimizer's best rate. Runs
already in --results (one JSON line each) are not run again, so an interrupted sweep resumes.
"""
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, here)
from harness import progress_waits  # noqa: E402
from harness.common import UserError  # noqa: E402
from harness.flags import configure  # noqa: E402
from harness.device import cpu_has_bf16  # noqa: E402

defaults = {"datasets": "pystdlib,vimdoc", "iters": 200, "seeds": "1337,1338,1339",
            "adamw_lrs": "1e-3,2e-3,4e-3", "muon_lrs": "0.01,0.02,0.04", "threads": 1,
            "n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128, "batch_size": 8,
            "eval_iters": 10, "results": "bench/results/optim.jsonl", "time_steps": 8,
            "step_cost": False}
try:
    args = configure(defaults, sys.argv[1:], sources=(__file__,))
except UserError as e:
    sys.exit(f"error: {e}")
SHAPE = {k: args[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size")}
results_path = os.path.join(here, args["results"])


def overrides(dataset, opt, lr, seed, adamw_lr):
    """train.py's command-line keys of one run (on top of config/small.py)."""
    n = args["iters"]
    base_lr = lr if opt == "adamw" else adamw_lr
    keys = dict(SHAPE, dataset=dataset, optimizer=opt, seed=seed, max_iters=n, lr_decay_iters=n,
                warmup_iters=n // 10, eval_interval=n // 2, eval_iters=args["eval_iters"],
                learning_rate=base_lr, min_lr=base_lr / 10, compile=False, log_interval=n)
    if opt == "muon":
        keys["muon_lr"] = lr
    return keys


def key_of(keys):
    return json.dumps(keys, sort_keys=True)


def load_results():
    done = {}
    if os.path.exists(results_path):
        with open(results_path) as f:
            for line in f:
                rec = json.loads(line)
                done[key_of(rec["keys"])] = rec
    return done


def train(keys, done):
    """One train.py run (or its stored result): val loss at the halfway point and the end."""
    k = key_of(keys)
    if k in done:
        return done[k]
    out = os.path.join(here, "bench", "results", "optim-run")
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: nothing of the last one moved aside
    cmd = [sys.executable, os.path.join(here, "train.py"), "config/small.py", f"--out_dir={out}"]
    cmd += [f"--{a}={b}" for a, b in keys.items()]
    env = dict(os.environ, OMP_NUM_THREADS=str(args["threads"]))
    t0 = time.time()
    r = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"error: a run failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    with open(os.path.join(out, "log.jsonl")) as f:
        rows = {row["iter"]: row for row in map(json.loads, f)}
    n = keys["max_iters"]
    rec = {"keys": keys, "half": rows[n // 2]["val_loss"], "final": rows[n]["val_loss"],
           "wall_s": round(time.time() - t0, 1)}
    with open(results_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    done[k] = rec
    print(f"{keys['dataset']} {keys['optimizer']} lr {keys.get('muon_lr', keys['learning_rate'])}"
          f" seed {keys['seed']}: half {rec['half']:.4f}, final {rec['final']:.4f}, "
          f"{rec['wall_s']} s", flush=True)
    return rec


def sweep(dataset, opt, lrs, seed, adamw_lr, done):
    """Final val loss per rate; one more rate past an end of the list if the best is there."""
    lrs = sorted(lrs)
    finals = {lr: train(overrides(dataset, opt, lr, seed, adamw_lr), done)["final"] for lr in lrs}
    best = min(finals, key=finals.get)
    if best in (lrs[0], lrs[-1]):
        extra = best * 2 if best == lrs[-1] else best / 2
        finals[extra] = train(overrides(dataset, opt, extra, seed, adamw_lr), done)["final"]
        best = min(finals, key=finals.get)
    return finals, best


ARMS = ("adamw", "muon", "muon, NS in bf16", "muon, no Gram form")


def plain_newton_schulz(x, a, b, c, steps):
    """muon.gram_newton_schulz's stand-in for the "no Gram form" arm: the plain iteration
    (muon.newton_schulz's other branch), to time the Gram form against it; on a batch of
    matrices (as muon.py gives it) or one."""
    import muon
    if x.dim() == 2:
        return plain_newton_schulz(x[None], a, b, c, steps)[0]
    return muon.newton_schulz(x, a, b, c, steps, gram_form=False)


def step_cost(shape):
    """ms per training step (forward, backward, optimizer) of adamw, muon as train.py builds it
    here (Newton-Schulz in bf16 where the CPU has it natively, else float32, wide matrices in
    the Gram form), muon forced to orthogonalise in bf16 (torch.optim.Muon's choice everywhere)
    and muon without the Gram form, on one model, rotated step by step so the shared machine's
    load hits all alike; bf16 autocast where the CPU has it natively, as train.py's auto dtype
    does."""
    import muon
    from unittest import mock
    from model import RoFormer, RoFormerConfig
    from optim import build_optimizer
    torch.set_num_threads(args["threads"])
    torch.manual_seed(0)
    T, B = shape["block_size"], shape["batch_size"]
    cfg = {k: v for k, v in shape.items() if k != "batch_size"}
    models = {o: RoFormer(RoFormerConfig(vocab_size=4096, **cfg)) for o in ARMS}
    bf16 = cpu_has_bf16()  # muon "as train.py builds it": bf16 only where native
    opts = {o: build_optimizer(m, 2e-3, 0.1, name=o.split(",")[0], bf16=bf16)
            for o, m in models.items()}
    opts["muon, NS in bf16"].muon.ns_dtype = torch.bfloat16
    x, y = torch.randint(0, 4096, (2, B, T))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_bf16())
    times = {o: [] for o in models}
    # minutes at config/small.py's shape, where bf16 is emulated: a bar, or a line in a log
    bar = progress_waits.bar(total=len(ARMS) * (args["time_steps"] + 2),
                   desc=f"timing steps (block {T}, batch {B})", unit="step")
    for i in range(args["time_steps"] + 2):
        for o in ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]:
            t0 = time.perf_counter()
            with ctx:
                loss = models[o](x, y)[1]
            loss.backward()
            with (mock.patch.object(muon, "gram_newton_schulz", plain_newton_schulz)
                  if o == "muon, no Gram form" else contextlib.nullcontext()):
                opts[o].step()
            opts[o].zero_grad(set_to_none=True)
            if i >= 2:  # the first two steps allocate optimizer state
                times[o].append(time.perf_counter() - t0)
            bar.update()
    bar.close()
    return {o: 1e3 * statistics.median(t) for o, t in times.items()}


def print_costs(costs):
    print(f"\ncost per step, {args['threads']} thread(s), median of {args['time_steps']} "
          f"rotated steps; muon's Newton-Schulz in "
          f"{'bf16' if cpu_has_bf16() else 'float32'} on this CPU "
          f"({'native' if cpu_has_bf16() else 'no native'} bf16)")
    print("| model | adamw ms/step | muon ms/step | muon, NS in bf16 | muon, no Gram form | "
          "muon / adamw | muon, NS in bf16 / adamw | muon, no Gram form / adamw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, c in costs.items():
        print(f"| {name} | {c['adamw']:.0f} | {c['muon']:.0f} | {c['muon, NS in bf16']:.0f} | "
              f"{c['muon, no Gram form']:.0f} | {c['muon'] / c['adamw']:.3f} | "
              f"{c['muon, NS in bf16'] / c['adamw']:.3f} | "
              f"{c['muon, no Gram form'] / c['adamw']:.3f} |")


SMALL = dict(n_layer=4, n_head=4, n_embd=256, block_size=256, batch_size=16)


def main():
    if args["step_cost"]:
        return print_costs({"config/small.py's model": step_cost(SMALL)})
    os.makedirs(os.path.dirname(results_path), exist_ok=True)
    done = load_results()
    seeds = [int(s) for s in args["seeds"].split(",")]
    datasets = args["datasets"].split(",")
    for d in datasets:
        if not os.path.exists(os.path.join(here, "data", d, "meta.json")):
            sys.exit(f"error: data/{d} not built (see this script's docstring)")
    print(f"train.py config/small.py with {SHAPE}, {args['iters']} iterations "
          f"({args['iters'] * SHAPE['batch_size'] * SHAPE['block_size']:,} tokens), "
          f"{args['threads']} thread(s)", flush=True)
    table, sweeps = [], []
    for d in datasets:
        a_finals, a_best = sweep(d, "adamw", map(float, args["adamw_lrs"].split(",")), seeds[0],
                                 None, done)
        m_finals, m_best = sweep(d, "muon", map(float, args["muon_lrs"].split(",")), seeds[0],
                                 a_best, done)
        sweeps += [(d, "adamw", a_finals, a_best), (d, "muon", m_finals, m_best)]
        for opt, lr in (("adamw", a_best), ("muon", m_best)):
            recs = [train(overrides(d, opt, lr, s, a_best), done) for s in seeds]
            table.append((d, opt, lr, [r["half"] for r in recs], [r["final"] for r in recs]))
    costs = {"this sweep's model": step_cost(SHAPE),
             "config/small.py's model": step_cost(SMALL)}

    print("\nlearning-rate sweep (first seed; final val loss per rate, best marked *)")
    print("| data | optimizer | rate: final val loss |")
    print("|---|---|---|")
    for d, opt, finals, best in sweeps:
        cells = ", ".join(f"{lr:g}{'*' if lr == best else ''}: {v:.4f}"
                          for lr, v in sorted(finals.items()))
        print(f"| {d} | {opt}{' (lr = muon_lr)' if opt == 'muon' else ''} | {cells} |")
    print(f"\nat each one's best rate, seeds {args['seeds']}: mean (min..max) val loss")
    print("| data | optimizer | rate | val loss at half | final val loss | final, per seed |")
    print("|---|---|---:|---:|---:|---|")
    for d, opt, lr, half, final in table:
        print(f"| {d} | {opt} | {lr:g} | {statistics.mean(half):.4f} "
              f"({min(half):.4f}..{max(half):.4f}) | {statistics.mean(final):.4f} "
              f"({min(final):.4f}..{max(final):.4f}) | {', '.join(f'{v:.4f}' for v in final)} |")
    print("\nmuon - adamw, same seed (same initial weights and batches), final val loss")
    print("| data | per seed | mean |")
    print("|---|---|---:|")
    for (d, _, _, _, a_final), (_, _, _, _, m_final) in zip(table[::2], table[1::2]):
        diffs = [m - a for a, m in zip(a_final, m_final)]
        print(f"| {d} | {', '.join(f'{x:+.4f}' for x in diffs)} | {statistics.mean(diffs):+.4f} |")
    print_costs(costs)


if __name__ == "__main__":
    main()
