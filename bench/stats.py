"""Student's t from the regularised incomplete beta function (no scipy): bench/compare.py's
paired test and bench/designs.py's intervals over seeds."""
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
