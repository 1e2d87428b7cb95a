"""
What RoPE costs in the training step: aten ops per apply_rope call (torch.profiler), and the
forward+backward time of nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, batch
12, vocab 65, fp32, no dropout, one thread), this model.py against another one (--baseline, a
model.py file from another commit), alternated in one process so load changes hit both.

    git show 73f601f:model.py > /tmp/model_old.py
    python bench/rope.py --baseline /tmp/model_old.py
    python bench/rope.py --baseline /tmp/model_old.py --threads 2 --rounds 20 --iters 10
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import model as current  # noqa: E402

RECIPE = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
BATCH = 12


def load_module(path):
    spec = importlib.util.spec_from_file_location("baseline_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rope_ops(module):
    """(top-level ops, all aten ops) that one apply_rope call on a layer's q and k runs, as
    the model calls it (its own tables, sliced for the sequence), forward only."""
    torch.manual_seed(0)
    model = module.RoFormer(module.RoFormerConfig(**RECIPE))
    T, hd = RECIPE["block_size"], RECIPE["n_embd"] // RECIPE["n_head"]
    qk = torch.randn(2, BATCH, RECIPE["n_head"], T, hd)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    module.apply_rope(qk, cos, sin)  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        module.apply_rope(qk, cos, sin)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e.name for e in events if e.cpu_parent is None]
    return top, len(events)


def step_times(modules, threads, rounds, iters):
    """Median ms per forward+backward of the recipe for each module, same weights, same
    batches, the modules taking turns round by round."""
    torch.set_num_threads(threads)
    models = []
    for module in modules:
        torch.manual_seed(0)
        models.append(module.RoFormer(module.RoFormerConfig(**RECIPE)).train())
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(RECIPE["vocab_size"], (BATCH, RECIPE["block_size"] + 1), generator=gen)
    losses = [m(x[:, :-1], x[:, 1:])[1].item() for m in models]
    times = [[] for _ in models]
    for _ in range(rounds + 1):  # the first round warms up
        for m, out in zip(models, times):
            t0 = time.perf_counter()
            for _ in range(iters):
                m(x[:, :-1], x[:, 1:])[1].backward()
                m.zero_grad(set_to_none=True)
            out.append(1e3 * (time.perf_counter() - t0) / iters)
    return [statistics.median(t[1:]) for t in times], losses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", help="another model.py to compare with")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=10, help="fwd+bwd steps per timed round")
    a = ap.parse_args()
    modules = [("this model.py", current)]
    if a.baseline:
        modules.append((a.baseline, load_module(a.baseline)))
    print(f"# torch {torch.__version__}, {a.threads} thread(s); recipe {RECIPE}, batch {BATCH}")
    print("\n| model.py | top-level aten ops per apply_rope | all aten ops | which |")
    print("|---|--:|--:|---|")
    for name, module in modules:
        top, total = rope_ops(module)
        print(f"| {name} | {len(top)} | {total} | {', '.join(n[6:] for n in top)} |")
    ms, losses = step_times([m for _, m in modules], a.threads, a.rounds, a.iters)
    print(f"\n| model.py | fwd+bwd ms (median of {a.rounds} rounds x {a.iters}) | vs first | loss |")
    print("|---|--:|--:|--:|")
    for (name, _), t, loss in zip(modules, ms, losses):
        print(f"| {name} | {t:.2f} | {t / ms[0]:.3f} | {loss:.6f} |")


if __name__ == "__main__":
    main()
