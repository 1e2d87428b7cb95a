"""
Newton-Schulz with coefficients of its own for each step: the coefficients, derived, of
bench/patches/ns_per_step4.patch and ns_per_step5.patch (docs/LOG.md, 2026-11-29: both lost to
torch's, so muon.py keeps torch's).

    python bench/studies/ns_coefficients.py                        # ns_per_step4.patch's: 4 steps
    python bench/studies/ns_coefficients.py --steps 5 --low 0.001  # ns_per_step5.patch's

Muon scales an update to Frobenius norm 1, so its singular values lie in (0, 1], and moves it
towards the nearest semi-orthogonal matrix with steps x <- a x + b (x x^T) x + c (x x^T)^2 x,
each of which maps every singular value s to p(s) = a s + b s^3 + c s^5 and keeps the singular
vectors. torch.optim.Muon repeats one (a, b, c) five times. Here each step gets its own: the odd
quintic nearest 1 in the worst case (minimax) over the interval the steps before it left,
starting from [--low, 1]. That polynomial maps [l, u] into [1 - E, 1 + E], the next step's
interval (the greedy construction of Amsel et al.'s Polar Express, 2025). Each minimax is a
linear program over a fine grid (scipy's linprog). Prints the coefficients, rounded to 4
decimals as the patches write them, and where each set leaves the singular values, beside
torch's.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from muon import Muon  # noqa: E402

TORCH = Muon.COEFFICIENTS  # torch.optim.Muon's (a, b, c), for each of its 5 steps


def minimax_quintic(low, high, points=4000):
    """The odd quintic (a, b, c) nearest 1 in the worst case over [low, high], and that error."""
    try:
        from scipy.optimize import linprog
    except ImportError:
        sys.exit("error: bench/studies/ns_coefficients.py needs scipy: pip install scipy")
    s = np.concatenate([np.geomspace(low, high, points), np.linspace(low, high, points)])
    powers = np.stack([s, s ** 3, s ** 5], axis=1)
    ones = np.ones((len(s), 1))
    # unknowns (a, b, c, E): minimise E with -E <= p(s) - 1 <= E at every grid point
    res = linprog([0, 0, 0, 1], A_ub=np.block([[powers, -ones], [-powers, -ones]]),
                  b_ub=np.concatenate([np.ones(len(s)), -np.ones(len(s))]),
                  bounds=[(None, None)] * 3 + [(0, None)], method="highs")
    if not res.success:
        sys.exit(f"error: the linear program for [{low:g}, {high:g}] failed: {res.message}")
    return tuple(res.x[:3]), res.x[3]


def derive(steps, low):
    """`steps` coefficient triples, each rounded to 4 decimals, greedy from [low, 1]."""
    coefficients, (lo, hi) = [], (low, 1.0)
    for _ in range(steps):
        abc, err = minimax_quintic(lo, hi)
        coefficients.append(tuple(round(float(v), 4) for v in abc))
        lo, hi = 1 - err, 1 + err
    return coefficients


def singular_range(coefficients, low, high=1.0):
    """Where the steps take the singular values of [low, high] (float64, a dense grid)."""
    s = np.geomspace(low, high, 20000)
    for a, b, c in coefficients:
        s = a * s + b * s ** 3 + c * s ** 5
    return s.min(), s.max()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--low", type=float, default=0.003)
    args = parser.parse_args()
    if args.steps < 1 or not 0 < args.low < 1:
        sys.exit("error: --steps must be at least 1 and --low inside (0, 1)")
    ours = derive(args.steps, args.low)
    print(f"per-step coefficients, {args.steps} steps from [{args.low:g}, 1]:")
    for abc in ours:
        print(f"    ({abc[0]}, {abc[1]}, {abc[2]}),")
    print("\n| coefficients | steps | singular values from [0.001, 1] | from [0.003, 1] "
          "| from [0.01, 1] |\n|---|--:|---|---|---|")
    rows = [("torch's, repeated", n, [TORCH] * n) for n in (3, 4, 5)]
    rows.append(("these", args.steps, ours))
    if args.steps > 1:
        rows.append(("these, the last step dropped", args.steps - 1, ours[:-1]))
    for name, n, coefficients in rows:
        cells = " | ".join("[%.3f, %.3f]" % singular_range(coefficients, low)
                           for low in (0.001, 0.003, 0.01))
        print(f"| {name} | {n} | {cells} |")


if __name__ == "__main__":
    main()
