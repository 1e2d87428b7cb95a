"""Student's t from the regularised incomplete beta function (no scipy): bench/compare.py's
paired test and bench/studies/designs.py's intervals over seeds; and the plain spread over seeds that
bench/studies/ablation.py's and bench/studies/context.py's tables give."""
import math


def incomplete_beta(a, b, x):
    """I_x(a, b) by its continued fraction (modified Lentz), on the side where it converges."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    if x > (a + 1) / (a + b + 2):
        return 1.0 - incomplete_beta(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p, df):
    """The t with t_cdf(t, df) = p, by bisection (t_cdf is increasing)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def interval(xs):
    """(mean, half-width of its 95% t interval) of a sample; half-width None with one value."""
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, t_quantile(0.975, n - 1) * sd / math.sqrt(n)


def paired(diffs):
    """Mean of the per-seed differences, its 95% interval and the two-sided p-value of a paired
    t-test (None where fewer than 2 pairs)."""
    n = len(diffs)
    mean = sum(diffs) / n if n else float("nan")
    if n < 2:
        return {"mean": mean, "ci95": None, "p": None, "pairs": n}
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    if se == 0:  # identical differences: exact when all 0 (the same computation), else no
        # interval: n equal numbers do not make a difference certain (p = 0 would say so)
        return {"mean": mean, "ci95": [0.0, 0.0] if mean == 0 else None,
                "p": 1.0 if mean == 0 else None, "pairs": n}
    q = t_quantile(0.975, n - 1)
    p = 2 * t_cdf(-abs(mean / se), n - 1)
    return {"mean": mean, "ci95": [mean - q * se, mean + q * se], "p": p, "pairs": n}


def mean_std(xs):
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def spread(values, fmt="{:.3f}"):
    """'mean' for one value, 'mean (min-max)' for several: the seed-to-seed spread."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    m = fmt.format(sum(values) / len(values))
    if len(values) == 1:
        return m
    return f"{m} ({fmt.format(min(values))}–{fmt.format(max(values))})"

