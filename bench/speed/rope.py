"""
What RoPE costs in the training step: aten ops per apply_rope call (torch.profiler), and the
forward+backward time of nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, batch
12, vocab 65, fp32, no dropout, one thread), this model.py against another one (--baseline, a
model.py file from another commit), alternated in one process so load changes hit both.

    git show 73f601f:model.py > /tmp/model_old.py
    python bench/speed/rope.py --baseline /tmp/model_old.py
    python bench/speed/rope.py --baseline /tmp/model_old.py --threads 2 --rounds 20 --iters 10
    python bench/speed/rope.py --pairs --threads 1 --rounds 30     # the forms side by side (+ CUDA)

--pairs: which exact form of the rotation is cheapest. (a) Per attention layer, the recipe's
c_attn output -> rotation -> causal SDPA, forward + backward, against no rotation: half pairs
(mul, roll, addcmul), adjacent pairs as one complex product (eager), and adjacent pairs written
out as sums (what runs under torch.compile; timed here eager and, where a GPU is present,
compiled). (b) The recipe's whole forward + backward with rope_pairs half, adjacent, and
adjacent with qk_norm against learned positions (nanoGPT's), same weights, the configurations
taking turns. CPU time of this process (time.process_time) on CPU, so that time stolen by
other jobs is not counted; wall time with synchronisation on CUDA.
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def rotation_forms(device, rounds):
    """(a): {form: median us per layer, rotation + SDPA forward and backward}."""
    import torch.nn.functional as F
    from unittest import mock
    B, T, H, C = BATCH, RECIPE["block_size"], RECIPE["n_head"], RECIPE["n_embd"]
    cos, sin = (t.to(device) for t in current.rope_table(torch.arange(T), C // H))

    def layer(pairs, sums=False):
        def run(qkv):
            qk, v = qkv.view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4).split((2, 1))
            if pairs and sums:  # the form torch.compile runs, here eager
                with mock.patch("torch.compiler.is_compiling", lambda: True):
                    qk = current.apply_rope(qk, cos, sin, pairs)
            elif pairs:  # compiled (on CUDA below) it takes the sums by itself
                qk = current.apply_rope(qk, cos, sin, pairs)
            return F.scaled_dot_product_attention(*qk, v[0], is_causal=True)
        return run
    forms = {"no rotation": layer(None), "half: mul, roll, addcmul": layer("half"),
             "adjacent: complex product": layer("adjacent"),
             "adjacent: sums (compiled form)": layer("adjacent", True)}
    if device == "cuda":
        forms = {**forms, "half, compiled": torch.compile(layer("half")),
                 "adjacent, compiled": torch.compile(layer("adjacent"))}
    clock = time.process_time if device == "cpu" else time.perf_counter
    base = torch.randn(B, T, 3 * C, device=device)
    times = {name: [] for name in forms}
    for r in range(rounds + 1):
        for name, run in forms.items():
            x = base.clone().requires_grad_()
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            t0 = clock()
            for _ in range(10):
                run(x).sum().backward()
            sync()
            if r:  # round 0 warms up (and compiles)
                times[name].append(1e5 * (clock() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def pairs_tables(a):
    print(f"# torch {torch.__version__}, {a.threads} thread(s); recipe {RECIPE}, batch {BATCH}")
    torch.set_num_threads(a.threads)
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        us = rotation_forms(device, a.rounds)
        print(f"\n## (a) {device}: one attention layer, rotation + SDPA, forward + backward "
              f"(median of {a.rounds} rounds x 10)")
        print("| form | us | rotation's cost over none |\n|---|--:|--:|")
        for name, t in us.items():
            print(f"| {name} | {t:.0f} | {t - us['no rotation']:+.0f} us |")
    modules = {"learned positions": dict(pos_encoding="learned"),
               "rope_pairs=half": dict(rope_pairs="half"),
               "rope_pairs=adjacent": dict(rope_pairs="adjacent"),
               "adjacent, qk_norm=True": dict(rope_pairs="adjacent", qk_norm=True)}
    ms = config_step_times(modules, a.rounds, a.iters)
    print(f"\n## (b) cpu: the recipe's forward + backward, ms (median of {a.rounds} rounds x "
          f"{a.iters}, CPU time)\n| positions | ms | vs learned |\n|---|--:|--:|")
    for name, t in ms.items():
        print(f"| {name} | {t:.2f} | {t / ms['learned positions']:.3f} |")


def config_step_times(configs, rounds, iters):
    """(b): {name: median ms per forward + backward} of this model.py under each config."""
    models = {}
    for name, extra in configs.items():
        torch.manual_seed(0)
        models[name] = current.RoFormer(current.RoFormerConfig(**RECIPE, **extra)).train()
    x = torch.randint(RECIPE["vocab_size"], (BATCH, RECIPE["block_size"] + 1),
                      generator=torch.Generator().manual_seed(0))
    times = {name: [] for name in models}
    for r in range(rounds + 1):
        for name, m in models.items():
            t0 = time.process_time()
            for _ in range(iters):
                m(x[:, :-1], x[:, 1:])[1].backward()
                m.zero_grad(set_to_none=True)
            if r:
                times[name].append(1e3 * (time.process_time() - t0) / iters)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", help="another model.py to compare with")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=10, help="fwd+bwd steps per timed round")
    ap.add_argument("--pairs", action="store_true", help="the rotation's forms side by side")
    a = ap.parse_args()
    if a.pairs:
        return pairs_tables(a)
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
