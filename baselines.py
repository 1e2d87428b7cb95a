"""The position-encoding baselines RoPE is measured against (pos_encoding "learned",
"sinusoidal", "none", and the relative biases "shaw", "t5", "alibi"), beside model.py at the
bottom of the layering: it imports nothing of the project. RoFormerConfig calls check when
pos_encoding is not "rope", and the model reaches it through two hooks: add_tables
(construction: the learned tables, registered where checkpoints have always had them) and
positions (each forward: the vectors added to the token embeddings, or the bias added to the
attention scores). Otherwise the model runs the same code path (its layers turn nothing), so
comparisons are fair."""
import math

import torch
import torch.nn as nn



def check(cfg):
    """RoFormerConfig's checks of the baselines' settings (called when pos_encoding != "rope")."""
    pe = cfg.pos_encoding
    for wrong, why in [
        (pe == "t5" and cfg.t5_buckets < 2, f"t5_buckets={cfg.t5_buckets}: T5 splits its "
         "buckets into exact distances and log-spaced ones, which needs t5_buckets >= 2"),
        (cfg.t5_max_distance <= cfg.t5_buckets // 2, "t5_max_distance must exceed the "
         f"t5_buckets // 2 = {cfg.t5_buckets // 2} exact buckets"),
        (pe == "sinusoidal" and cfg.n_embd % 2, "sinusoidal positions need an even n_embd"),
        (cfg.rope_scaling != "none" or cfg.rope_factor != 1, "rope_scaling and rope_factor "
         f"rescale RoPE's angles, and pos_encoding={pe!r} has none")]:
        if wrong:
            raise ValueError(why)


def add_tables(model, cfg):
    """Construction hook: a baseline's learned tables on the RoFormer `model`, in the places
    its constructor keeps for them (None where it has none): wpe, learned absolute positions;
    rel_bias, T5's one scalar per (bucket, head), shared by all layers as in T5; and each
    layer's rel_k, Shaw's key-side distance embeddings."""
    pe = cfg.pos_encoding
    model.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if pe == "learned" else None
    model.rel_bias = nn.Embedding(cfg.t5_buckets, cfg.n_head) if pe == "t5" else None
    if pe == "shaw":
        for block in model.blocks:
            block.attn.rel_k = ShawKeys(cfg.rel_clip + 1, cfg.n_embd // cfg.n_head)


def positions(model, x, where):
    """Forward hook (RoFormer.designs): the token embeddings x and the forward's Positions
    `where`, with what the baseline adds: its vectors to x (learned, sinusoidal), or its bias to
    the attention scores (shaw, t5, alibi: position_bias, built in float32 and handed to SDPA in
    the weights' dtype; under autocast SDPA casts its mask itself); "none" adds nothing."""
    pe, dtype = model.config.pos_encoding, model.wte.weight.dtype
    if pe in ("learned", "sinusoidal"):
        return position_embedding(model, x, where.pos), where
    if pe == "none":
        return x, where
    return x, where._replace(bias=lambda visible, d: position_bias(model, d, visible).to(dtype))


# Absolute baselines: a vector per position, added to the token embeddings.

def sinusoidal_embedding(pos, dim):
    """The fixed absolute encoding of 'Attention Is All You Need', scaled to an RMS of 0.02,
    the init scale of the token embeddings it is added to: unscaled (RMS 0.71) it would drown
    the tokens 35 to 1 at init, handicapping the baseline rather than testing it."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    angle = pos.cpu().double()[:, None] * inv_freq  # on the CPU: some devices lack float64
    return (torch.cat((angle.sin(), angle.cos()), dim=-1) * 0.02 * math.sqrt(2)).float()


def position_embedding(model, x, pos):
    """The absolute baselines: the token embeddings x plus learned rows of model.wpe, or plus
    the sinusoidal table (model.sin_emb, a float32 buffer that RoFormer.hold_positions builds
    with sinusoidal_embedding and grows, position p in row p % L), at positions pos. Learned
    positions past block_size are refused before any layer runs (RoFormer.hold_positions)."""
    if model.config.pos_encoding == "learned":
        return x + model.wpe(pos)
    return x + model.sin_emb[pos % model.sin_emb.size(0)].to(model.wte.weight.dtype)


# Relative baselines: distances d = i - j (query minus key position) -> a bias on the scores.

def shaw_bias(q, table, d):
    """Shaw et al. 2018, keys side: q_i . a_clip(i-j) / sqrt(D), one vector a per clipped
    distance (table (rel_clip + 1, D)): the (Lq, rel_clip+1) products q . a gathered by
    distance, never the (Lq, Lk, D) a_ij. The values-side term is left out."""
    qa = q.float() @ table.float().t()
    idx = d.clamp(0, table.size(0) - 1).expand(*qa.shape[:2], -1, -1)
    return qa.gather(-1, idx) / math.sqrt(q.size(-1))


class ShawKeys(nn.Embedding):
    """A layer's Shaw table (Attention.rel_k): called on the scores' mask, the queries and the
    distances, it adds the one score term that depends on the query, so it cannot be shared by
    the layers like the bias of position_bias (whose zeros it is added to), in q's dtype."""

    def forward(self, mask, q, d):
        return mask + shaw_bias(q, self.weight, d).to(q.dtype)  # shaw_bias: float32


def t5_bucket(d, num_buckets=32, max_distance=128):
    """T5's causal bucket of d >= 0: d below num_buckets // 2, then log-spaced to max_distance."""
    d = d.clamp(min=0)
    exact = num_buckets // 2
    far = exact + (torch.log(d.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).long()
    return torch.where(d < exact, d, far.clamp(max=num_buckets - 1))


def alibi_slopes(n_head):
    """Press et al.'s slopes 2^(-8/n) .. 2^(-8) for n a power of two; else those of the power
    of two below n, then every other one of twice as many heads, as in the paper's code."""
    p = 2 ** int(math.log2(n_head))
    slopes = [2 ** (-8 * (i + 1) / p) for i in range(p)]
    return slopes + [2 ** (-8 * (i + 1) / (2 * p)) for i in range(0, 2 * p, 2)][:n_head - p]


def position_bias(model, d, visible):
    """The relative baselines (shaw, t5, alibi; through positions): the float32 bias on the
    scores of distances d (Lq, Lk), (H or 1, Lq, Lk), -inf where not `visible`."""
    c = model.config
    if c.pos_encoding == "t5":  # (Lq, Lk, H) -> (H, Lq, Lk)
        bias = model.rel_bias(t5_bucket(d, c.t5_buckets, c.t5_max_distance)).permute(2, 0, 1)
    elif c.pos_encoding == "alibi":
        slopes = torch.tensor(alibi_slopes(c.n_head), dtype=torch.float32, device=d.device)
        bias = -slopes[:, None, None] * d.float()
    else:  # shaw: zeros, to which each layer adds its query term (ShawKeys)
        bias = torch.zeros(1, *d.shape, device=d.device)
    return bias.float().masked_fill(~visible, float("-inf"))
