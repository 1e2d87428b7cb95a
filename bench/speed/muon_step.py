"""
What one Muon step costs at the CPU speedrun's shape (config/speedrun_cpu.py: 4 layers, 128
wide, so 16 hidden matrices of 4 shapes), as train.py builds it (optim.build_optimizer, Newton-
Schulz in bf16 where the CPU multiplies it natively, else float32): muon.py's step, which
orthogonalises the matrices of one shape as one batch, against the same step with every matrix
orthogonalised alone, and optionally against muon.py from another commit (--baseline). The
arms take turns step by step in one process so that load changes hit all alike; each arm's
updates are checked equal to the first arm's, to the bit.

    git show 55b2e44:muon.py > /tmp/muon_old.py
    OMP_NUM_THREADS=1 python bench/speed/muon_step.py --baseline /tmp/muon_old.py
"""
import argparse
import contextlib
import copy
import importlib.util
import os
import statistics
import sys
import time
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import muon  # noqa: E402
from harness.device import native_bf16  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402
from optim import build_optimizer  # noqa: E402

SHAPE = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0,
             qk_norm=True, value_residual=True)


BATCHED = muon.orthogonalise_batch


def one_at_a_time(gs, *args):
    """The step's orthogonalisation with no batching: each matrix a batch of one."""
    return torch.stack([BATCHED(g[None], *args)[0] for g in gs])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a muon.py file from another commit, a third arm")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per arm")
    args = ap.parse_args()
    bf16 = native_bf16("cpu")
    torch.manual_seed(0)
    model = RoFormer(RoFormerConfig(**SHAPE))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = build_optimizer(model, 3e-3, 0.1, name="muon", muon_lr=0.03, bf16=bf16).muon
    alone = copy.deepcopy(opt)
    alone.ns_dtype = opt.ns_dtype  # (an optimizer's deepcopy keeps its groups and state only)
    arms = {"batched (muon.py)": (opt, None), "one matrix at a time": (alone, one_at_a_time)}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("muon_baseline", args.baseline)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        arms[f"{args.baseline}"] = (old.Muon(
            [torch.nn.Parameter(p.detach().clone()) for p in opt.param_groups[0]["params"]],
            lr=0.03, weight_decay=0.1, ns_dtype=opt.ns_dtype), None)
    for o, _ in arms.values():  # the same weights and gradients in every arm
        for p, q in zip(o.param_groups[0]["params"], opt.param_groups[0]["params"]):
            p.grad = q.grad
    times = {a: [] for a in arms}
    for i in range(args.steps + 2):
        for a in list(arms)[i % len(arms):] + list(arms)[:i % len(arms)]:
            o, patch = arms[a]
            with (mock.patch.object(muon, "orthogonalise_batch", patch) if patch
                  else contextlib.nullcontext()):
                t0 = time.perf_counter()
                o.step()
                t = time.perf_counter() - t0
            if i >= 2:  # the first steps allocate the momentum buffers
                times[a].append(t)
    weights = [[p for p in o.param_groups[0]["params"]] for o, _ in arms.values()]
    same = all(torch.equal(a, b) for w in weights[1:] for a, b in zip(weights[0], w))
    print(f"one Muon step (16 matrices of 4 shapes), Newton-Schulz in {opt.ns_dtype} "
          f"({'native' if bf16 else 'no native'} bf16), {torch.get_num_threads()} thread(s), "
          f"median of {args.steps} rotated steps; weights after every arm equal to the bit: "
          f"{same}")
    print("| arm | ms/step (median) | min |")
    print("|---|---:|---:|")
    for a, t in times.items():
        print(f"| {a} | {1e3 * statistics.median(t):.2f} | {1e3 * min(t):.2f} |")


if __name__ == "__main__":
    main()
