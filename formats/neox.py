"""
GPT-NeoX computed in float64 from an export's own file: the exports' independent reference.
Written from the formats' definitions (transformers' GPTNeoX, llama.cpp's gptneox graph), it
shares nothing with model.py, so a model that an export maps wrongly (or that the allow-list
lets through unmapped) disagrees with it before the file goes into place, also where neither
transformers nor llama.cpp is installed. formats/hf.py and formats/gguf.py read their files into
`forward`'s arguments; export.py compares (`disagreement`).
"""
import math

import torch

POSITIONS = 256  # of the probe: the scalings change every frequency, so a short one shows them


def rope(x, base, freq_scale=1.0, yarn=None, rot=None):
    """The NEOX rotation (transformers' rotate_half, llama.cpp's rope type 2) of each head's
    first `rot` channels: channel i pairs with i + rot/2, angle position * freq_scale *
    base^(-2i/rot). With yarn = (original context, beta_fast, beta_slow): pair i mixes the
    interpolated and the original angle by 1 - clamp((i - lo) / max(hi - lo, 0.001)), lo/hi the
    floor/ceil of the correction dims rot ln(ctx / (2 pi beta)) / (2 ln base) clamped to
    [0, rot - 1], and cos and sin are scaled by 1 + 0.1 ln(1 / freq_scale). x: (T, H, D)."""
    T, _, D = x.shape
    rot = rot or D
    theta = base ** (-torch.arange(rot // 2, dtype=torch.float64) * 2 / rot)
    scaled, gain = freq_scale * theta, 1.0
    if yarn:
        ctx, beta_fast, beta_slow = yarn

        def dim(beta):  # the pair that turns `beta` times in the original context
            return rot * math.log(ctx / (2 * math.pi * beta)) / (2 * math.log(base))
        lo, hi = max(0, math.floor(dim(beta_fast))), min(rot - 1, math.ceil(dim(beta_slow)))
        mix = 1 - ((torch.arange(rot // 2) - lo) / max(hi - lo, 0.001)).clamp(0, 1)
        scaled, gain = scaled * (1 - mix) + theta * mix, 1 + 0.1 * math.log(1 / freq_scale)
    angle = (torch.arange(T, dtype=torch.float64)[:, None] * scaled)[:, None, :]
    cos, sin = gain * angle.cos(), gain * angle.sin()
    a, b = x[..., :rot // 2], x[..., rot // 2:rot]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, x[..., rot:]], -1)


def layer_norm(x, weight, bias, eps):
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def forward(W, ids, n_layer, n_head, eps, rotate, heads_first, parallel, qk_norm=False):
    """Logits (T, vocab) of ids (T,). W(name) is a float64 tensor in (out, in) order, named
    embed, head, final_norm.{weight,bias} and per layer i.{ln1,qkv,out,ln2,up,down}.{weight,bias};
    rotate(x) ropes q and k; heads_first: qkv's rows are per head [q k v] (transformers' layout)
    rather than [q | k | v] (llama.cpp's); parallel: x + attn(ln1 x) + mlp(ln2 x); qk_norm
    (Persimmon): each head's q and k through LayerNorms i.{qnorm,knorm} before the turn."""
    x = W("embed")[ids]
    T, C = x.shape
    D = C // n_head
    causal = torch.full((T, T), -math.inf, dtype=torch.float64).triu(1)
    for i in range(n_layer):
        def lin(h, name):
            return h @ W(f"{i}.{name}.weight").T + W(f"{i}.{name}.bias")

        def norm(h, name):
            return layer_norm(h, W(f"{i}.{name}.weight"), W(f"{i}.{name}.bias"), eps)
        qkv = lin(norm(x, "ln1"), "qkv")
        qkv = qkv.view(T, n_head, 3, D).transpose(1, 2) if heads_first else \
            qkv.view(T, 3, n_head, D)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        if qk_norm:  # over each head's channels, its own gain and bias
            q, k = norm(q, "qnorm"), norm(k, "knorm")
        q, k = rotate(q), rotate(k)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D) + causal
        attn = lin(torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, C), "out")
        h = lin(norm(x if parallel else x + attn, "ln2"), "up")
        x = x + attn + lin(0.5 * h * (1 + torch.erf(h / math.sqrt(2))), "down")
    return layer_norm(x, W("final_norm.weight"), W("final_norm.bias"), eps) @ W("head").T


def probe(vocab_size, window):
    """The ids both exports are checked on: random, seeded, min(window, POSITIONS) long."""
    n = min(window, POSITIONS)
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(0))


def disagreement(reference, ours, what):
    """Why `what`'s logits are not ours (beyond float32 rounding, 1e-3 of their scale), or None."""
    diff = (reference - ours.double()).abs().max().item()
    scale = max(1.0, ours.abs().max().item())
    if diff <= 1e-3 * scale:
        return None
    return (f"{what}, computed by formats/neox.py's float64 GPT-NeoX from the file as written, is "
            f"not this model: max |logit difference| {diff:.2e} (logits up to {scale:.2g}); "
            f"the export does not map this model, so nothing was written")
