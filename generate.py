"""
Decoding a RoFormer: prefill, the per-token step against the caches, rolling past the context
window, and sampling. sample.py, eval.py, bench/ and the tests call these functions.

    from generate import generate
    out = generate(model, idx, max_new_tokens=100, temperature=0.8, top_k=200)
"""
import torch

from model import sample_next  # noqa: F401  (decoding's sampling rule, re-exported here)


def check_sampling(temperature=1.0, top_k=None, top_p=None):
    """Raise ValueError (one line) for sampling settings that cannot work."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: off), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 or None: off), got {top_p}")


def generate_stream(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                    use_cache=True, generator=None, compile=False):
    """Yield the next (B, 1) tokens one at a time."""
    check_sampling(temperature, top_k, top_p)
    return model.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache,
                                 generator, compile)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
             use_cache=True, generator=None, compile=False):
    """Return idx followed by max_new_tokens sampled tokens, (B, T + new)."""
    new = list(generate_stream(model, idx, max_new_tokens, temperature, top_k, top_p,
                               use_cache, generator, compile))
    return torch.cat([idx] + new, dim=1)
