"""
A decoder-only RoFormer: a GPT-style language model whose attention knows positions only
through Rotary Position Embedding (RoPE, Su et al. 2021). Read top to bottom:

  1. the config and the one initialisation rule;
  2. RoPE: the angle tables and the rotation; the baselines it is compared with (absolute
     tables added to the embeddings; Shaw, T5 and ALiBi biases added to the scores);
  3. linear attention (RoFormer eq. 19), chunked and causal, also used for decoding;
  4. the decoding caches: a KV cache for softmax, the recurrent state of eq. 19;
  5. Attention, MLP, Block, RoFormer.

Decoding itself (prefill, the per-token step, compiling it, sampling) is in generate.py.
Imports torch only.
"""
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


RELATIVE = ("shaw", "t5", "alibi")  # encodings that bias the attention scores by distance


@dataclass
class RoFormerConfig:
    vocab_size: int = 4096
    block_size: int = 256         # training context
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False            # biases in Linear and LayerNorm
    rope_base: float = 10000.0
    attention: str = "softmax"    # "softmax" | "linear"
    feature_map: str = "elu"      # linear attention only: "elu" (elu+1) | "relu"
    pos_encoding: str = "rope"    # "rope" | baselines: "learned" | "sinusoidal" | "none" |
                                  # "shaw" | "t5" | "alibi" (relative biases, softmax only)
    linear_chunk: int = 64        # chunk length of the causal linear-attention kernel
    linear_norm: bool = False     # RMS-normalise each linear-attention head's output
    rope_scaling: str = "none"    # context extension at inference: "none" | "linear" | "ntk"
    rope_factor: float = 1.0      # how many times block_size the scaled RoPE should cover
    rel_clip: int = 16            # shaw: distances beyond this share one embedding
    t5_buckets: int = 32          # t5: number of distance buckets (half exact, half log-spaced)
    t5_max_distance: int = 128    # t5: distances from here on share the last bucket

    @property
    def context_window(self):
        """Tokens a query may attend to when decoding or scoring: block_size, times rope_factor
        when RoPE scaling extends the context at inference."""
        return int(self.block_size * self.rope_factor)

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "linear_chunk",
                     "rel_clip", "t5_buckets", "t5_max_distance"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        choices = {"attention": ("softmax", "linear"), "feature_map": ("elu", "relu"),
                   "pos_encoding": ("rope", "learned", "sinusoidal", "none") + RELATIVE,
                   "rope_scaling": ("none", "linear", "ntk")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.attention == "linear" and self.pos_encoding in RELATIVE:
            raise ValueError(f"pos_encoding={self.pos_encoding!r} adds a bias to every attention "
                             f"score, and linear attention never forms the score matrix: use "
                             f"attention='softmax' (or rope, which linear attention can use)")
        if self.t5_max_distance <= self.t5_buckets // 2:
            raise ValueError(f"t5_max_distance ({self.t5_max_distance}) must exceed the "
                             f"t5_buckets // 2 = {self.t5_buckets // 2} exact buckets")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.pos_encoding == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"RoPE rotates pairs of channels: head dim n_embd/n_head = "
                             f"{self.n_embd // self.n_head} must be even")
        if self.pos_encoding == "sinusoidal" and self.n_embd % 2:
            raise ValueError(f"sinusoidal positions need an even n_embd, got {self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.rope_base <= 1.0 or self.rope_factor < 1.0:
            raise ValueError(f"rope_base must be > 1 and rope_factor >= 1, got "
                             f"{self.rope_base} and {self.rope_factor}")
        if self.pos_encoding != "rope" and (self.rope_scaling != "none" or self.rope_factor != 1):
            raise ValueError(f"rope_scaling and rope_factor rescale RoPE's angles, and "
                             f"pos_encoding={self.pos_encoding!r} has none: leave them at "
                             f"'none' and 1 (got {self.rope_scaling!r}, {self.rope_factor})")
        if self.rope_scaling == "none" and self.rope_factor != 1:
            raise ValueError(f"rope_factor={self.rope_factor} needs rope_scaling='linear' or "
                             f"'ntk' (rope_scaling='none' means factor 1)")


@torch.no_grad()
def init_parameter(name, p, n_layer, generator=None):
    """The one initialisation rule, by parameter name (RoFormer's __init__ and the FSDP
    meta-device build in parallel.py both call it): matrices (linear and embedding weights)
    normal(0, 0.02), the residual projections c_proj scaled down by 1/sqrt(2 n_layer) so the
    residual stream's variance does not grow with depth; norm weights 1, biases 0."""
    if name.endswith("bias"):
        p.zero_()
    elif p.dim() == 1:
        p.fill_(1.0)
    else:
        std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
        p.normal_(0.0, std, generator=generator)


# ----------------------------------------------------------------------------------------
# 2. RoPE
#
# Pairing convention: channel i of a head is paired with channel i + d/2 ("half split", as in
# GPT-NeoX), and pair i turns by angle m * theta_i at position m. The paper pairs adjacent
# channels (2i, 2i+1) instead; the two differ only by a fixed permutation of the q/k output
# channels, which the learned projection absorbs, so the maths is the same. Half split needs
# no interleaving. Checkpoints are not interchangeable with the other layout.

def rope_table(pos, head_dim, base=10000.0, scaling="none", factor=1.0):
    """The rotation at integer positions `pos`, as two (len(pos), head_dim) float32 tables
    laid out for apply_rope: cos = [cos a, cos a] and sin = [-sin a, sin a], a = m * theta_i.

    Everything up to and including cos/sin runs in float64, and only the results are
    rounded: a float32 angle is already off by ~3e-2 rad at m = 1e6 (its spacing there is
    0.0625), and by whole radians past 1e7.
    Context extension (no retraining needed, both from the follow-up literature):
      linear: positions are divided by `factor` (position interpolation);
      ntk:    the base grows to base * factor^(d/(d-2)), stretching low frequencies most.
    """
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    # on the CPU, like pos below, also when the model is built under torch.device("meta")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
                        / head_dim)
    pos = pos.to(torch.float64).cpu()
    if scaling == "linear":
        pos = pos / factor
    angle = torch.outer(pos, inv_freq)
    cos, sin = angle.cos(), angle.sin()
    return torch.cat((cos, cos), -1).float(), torch.cat((-sin, sin), -1).float()


def apply_rope(x, cos, sin):
    """Rotate x (..., T, D) by the (T, D) tables of rope_table: pair (x1, x2) becomes
    (x1 cos - x2 sin, x2 cos + x1 sin). Rolling x by D/2 swaps the halves, so this is
    x * cos + roll(x) * sin: three kernels, and the tables are built once per table growth,
    not per call. The float32 tables promote a bf16 x, so the rotation runs in float32 and
    never meets a bf16-rounded angle; the result has x's dtype."""
    out = torch.addcmul(x * cos, x.roll(x.size(-1) // 2, dims=-1), sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)


SINUSOIDAL_SCALE = 0.02 * math.sqrt(2)


def sinusoidal_embedding(pos, dim):
    """The fixed absolute encoding of 'Attention Is All You Need', for the baseline. Scaled to
    an RMS of 0.02, the init scale of the token (and learned position) embeddings it is added
    to: unscaled sin/cos (RMS 0.71) would drown the tokens 35 to 1 at init, which handicaps
    the baseline rather than testing it. (The original scales tokens up by sqrt(d) instead.)"""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    angle = pos.cpu().double()[:, None] * inv_freq  # on the CPU: some devices lack float64
    return (torch.cat((angle.sin(), angle.cos()), dim=-1) * SINUSOIDAL_SCALE).float()


# Relative baselines. Each turns the distances d = i - j (query position minus key position,
# an integer (Lq, Lk) matrix) into a float32 bias added to the attention scores. Only
# distances enter, so the same functions serve training and the decoding cache (whose keys
# sit in slots at known positions), and all three are shift invariant. Causal: d >= 0.

def shaw_bias(q, table, d):
    """Shaw et al. 2018, keys side: q_i . a_clip(i-j) / sqrt(D), the part of the score
    q_i . (k_j + a_ij) that the keys do not give. table: (rel_clip + 1, D), one learned vector
    per clipped distance 0..rel_clip (causal: the paper's 2k+1 vectors minus the k for future
    keys), shared by the heads. q: (B, H, Lq, D) -> (B, H, Lq, Lk). Computed as the
    (Lq, rel_clip+1) products q . a gathered by distance: never the (Lq, Lk, D) tensor of the
    a_ij. The values-side term is left out."""
    qa = q.float() @ table.float().t()
    idx = d.clamp(0, table.size(0) - 1).expand(*qa.shape[:2], -1, -1)
    return qa.gather(-1, idx) / math.sqrt(q.size(-1))


def t5_bucket(d, num_buckets=32, max_distance=128):
    """T5's causal bucket of each distance d = i - j >= 0: d itself below num_buckets // 2,
    then log-spaced buckets up to max_distance, and the last bucket beyond."""
    d = d.clamp(min=0)
    exact = num_buckets // 2
    far = exact + (torch.log(d.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).long()
    return torch.where(d < exact, d, far.clamp(max=num_buckets - 1))


def alibi_slopes(n_head):
    """Press et al.'s head slopes: for n heads, n a power of two, the geometric sequence
    2^(-8/n), 2^(-16/n), .., 2^(-8). Otherwise the n' = largest power of two below n gives n'
    slopes, and the rest are the slopes of 2n' heads that fall between them (every other one,
    from the first), as in the paper's code."""
    p = 2 ** int(math.log2(n_head))
    slopes = [2 ** (-8 * (i + 1) / p) for i in range(p)]
    return slopes + [2 ** (-8 * (i + 1) / (2 * p)) for i in range(0, 2 * p, 2)][:n_head - p]


# ----------------------------------------------------------------------------------------
# 3. Linear attention, RoFormer eq. 19, causal:
#
#   o_m = sum_{n<=m} (R_m phi(q_m))^T (R_n phi(k_n)) v_n / (sum_{n<=m} phi(q_m)^T phi(k_n) + eps)
#
# The rotation sits in the numerator only, so the denominator stays a non-negative sum. A
# consequence of the formula (not a bug): the weights of the v_n can be negative and need not
# sum to one; on random inputs their sum starts at 1 and shrinks as the context grows, so the
# output scale drifts with position. `linear_norm` (an RMS norm per head) removes that drift.
#
# The denominator needs a guard. For one pair of channels (a1, a2) of phi(q) and (b1, b2) of
# phi(k), all >= 0, the numerator's term is (a1 b1 + a2 b2) cos + (a1 b2 - a2 b1) sin of the
# relative angle, while the denominator only has a1 b1 + a2 b2. With a1, b2 > 0 = a2 = b1 (a
# query on channel i, keys on channel i + d/2: relu does this) the denominator is 0 and the
# numerator is not. Both terms are bounded by (a1 + a2)(b1 + b2), so
#   bound_m = sum_n fold(phi(q_m)) . fold(phi(k_n)),   fold(x) = x[:d/2] + x[d/2:]
# bounds sum_n |weight_mn|, and dividing by max(denominator, GUARD * bound_m) keeps every output
# within max|v| / GUARD. bound >= denominator always; for features of similar size in both
# channels of a pair it is about twice the denominator, so GUARD = 1/4 sits well below the usual
# ratio and eq. 19 is unchanged unless its denominator is small for what the numerator can be.
#
# Chunked form: inside a chunk of L tokens, a masked L x L product; across chunks, the running
# state S = sum R_n phi(k_n) v_n^T (d x d_v) and z = sum phi(k_n) (d). Only one d x d_v state
# per chunk is held (N/L of them), never the (N, d, d_v) prefix sums. Decoding is the same
# function with a one-token chunk and the state carried across calls.

GUARD = 0.25


def linear_attention(q, k, v, cos=None, sin=None, feature_map="elu", chunk=64, state=None,
                     eps=1e-6):
    """q, k: (B, H, N, D), v: (B, H, N, Dv); cos/sin: (N, D) tables, or None for no rotation;
    state: (S, z) carried in from earlier tokens, or None. Returns (out, (S, z)).
    Computed in float32 (float64 stays float64): fp16 sums overflow within a few hundred
    tokens and a bf16 state drifts."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    phi = (lambda t: F.elu(t) + 1.0) if feature_map == "elu" else F.relu
    fqk = phi(torch.stack((q, k)).to(dtype))  # q and k side by side: one op each, not two
    fq, fk = fqk
    rq, rk = apply_rope(fqk, cos, sin) if cos is not None else fqk
    v = v.to(dtype)
    B, H, N, D = q.shape
    length = min(chunk, N)
    n_chunks = -(-N // length)
    pad = n_chunks * length - N  # padded keys and values are zero: they add nothing to any sum

    def chunks(t):
        return F.pad(t, (0, 0, 0, pad)).view(B, H, n_chunks, length, t.size(-1))

    fq, fk, rq, rk, v = map(chunks, (fq, fk, rq, rk, v))
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    num = (rq @ rk.transpose(-1, -2)).masked_fill(~causal, 0.0) @ v  # within each chunk
    # across chunks: the state each chunk starts from (an exclusive prefix sum over chunks)
    kv = rk.transpose(-1, -2) @ v                # (B, H, n_chunks, D, Dv)
    S = torch.cat((torch.zeros_like(kv[:, :, :1]), kv.cumsum(2)[:, :, :-1]), dim=2)
    k_total = fk.sum(-2)                         # (B, H, n_chunks, D)
    z = torch.cat((torch.zeros_like(k_total[:, :, :1]), k_total.cumsum(2)[:, :, :-1]), dim=2)
    if state is not None:
        S = S + state[0].to(dtype)[:, :, None]
        z = z + state[1].to(dtype)[:, :, None]
    num = num + rq @ S
    k_sum = z.unsqueeze(-2) + fk.cumsum(-2)      # sum of phi(k_n) over n <= m, at every m
    den = (fq * k_sum).sum(-1)
    if cos is not None:  # the guard above; without rotation the weights are den's own terms
        half = D // 2
        bound = ((fq[..., :half] + fq[..., half:]) * (k_sum[..., :half] + k_sum[..., half:]))
        den = torch.maximum(den, GUARD * bound.sum(-1))
    out = num / (den.unsqueeze(-1) + eps)
    out = out.view(B, H, n_chunks * length, -1)[:, :, :N]
    return out, (S[:, :, -1] + kv[:, :, -1], k_sum[:, :, -1, -1])


# ----------------------------------------------------------------------------------------
# 4. Decoding caches (generate.py makes them with RoFormer.new_cache and passes them in)

class KVCache:
    """Softmax decoding memory: per layer the keys and values of `size` positions, in
    preallocated slots used as a ring (position p lives in slot p % size), and, shared by the
    layers, the absolute position each slot holds (-1: empty). A query at position m sees the
    cached keys at m - window + 1 .. m. Past the window this is sliding-window attention:
    exact because RoPE scores depend on distance only, but not crop-and-recompute (a deeper
    layer's cached key was computed from a state that saw older tokens)."""

    def __init__(self, n_layer, size, window, device):
        self.keys, self.values = [None] * n_layer, [None] * n_layer  # (B, H, size, D) each
        self.slot_pos = torch.full((size,), -1, dtype=torch.long, device=device)
        self.window = window

    def place(self, pos, start):
        """Once per forward over positions `pos` (from `start`: an int, or the (1,) tensor pos
        itself in the static step): the slots the new keys go to, whether they may be written
        before attending, and (query x key) distances and visibility. Nothing is read back to
        the host: a per-token sync would stall a GPU."""
        size, new = self.slot_pos.numel(), pos.numel()
        # One token never evicts a key its query still needs, and neither does a chunk that
        # fits in the free slots; any other chunk must attend to the old keys before writing.
        write_first = new == 1 or start + new <= size
        kept = pos[-size:]
        slots = kept % size
        key_pos = self.slot_pos if write_first else torch.cat((self.slot_pos, pos))
        self.slot_pos[slots] = kept  # in place; key_pos aliases it only when writing first
        distance = pos[:, None] - key_pos[None, :]
        visible = (key_pos >= 0) & (distance >= 0) & (distance < self.window)
        return slots, write_first, distance, visible

    def update(self, layer, slots, write_first, k, v):
        """Store one layer's new (already rotated) keys and values, never touching the others;
        return the keys and values its queries attend to."""
        if self.keys[layer] is None:  # allocated by the first forward: its batch and dtype
            shape = (k.size(0), k.size(1), self.slot_pos.numel(), k.size(3))
            self.keys[layer], self.values[layer] = k.new_zeros(shape), v.new_zeros(shape)
        keys, values = self.keys[layer], self.values[layer]
        if write_first:
            keys[:, :, slots], values[:, :, slots] = k, v
            return keys, values
        attended = torch.cat((keys, k), dim=2), torch.cat((values, v), dim=2)
        keys[:, :, slots], values[:, :, slots] = k[:, :, -slots.numel():], v[:, :, -slots.numel():]
        return attended

    def tensors(self):
        return [self.slot_pos] + self.keys + self.values


class RecurrentState:
    """Linear attention's decoding memory: per layer eq. 19's running sums (S, z), float32,
    the same size at every position. It never forgets: past block_size it keeps all history."""

    def __init__(self, n_layer):
        self.S, self.z = [None] * n_layer, [None] * n_layer

    def get(self, layer):
        return None if self.S[layer] is None else (self.S[layer], self.z[layer])

    def update(self, layer, S, z):
        if self.S[layer] is None:
            self.S[layer], self.z[layer] = S, z
        else:  # in place: a compiled (CUDA-graph) step replays fixed addresses
            self.S[layer].copy_(S)
            self.z[layer].copy_(z)

    def tensors(self):
        return self.S + self.z


# ----------------------------------------------------------------------------------------
# 5. The transformer

class Positions(NamedTuple):
    """What every layer needs to know about the positions of one forward."""
    rope: Optional[tuple]          # (cos, sin) tables at the tokens' positions, RoPE only
    mask: Optional[torch.Tensor]   # None: causal; else bool, or float bias with -inf (q x key)
    distance: Optional[torch.Tensor] = None  # query x key distances (shaw adds its term)
    slots: Optional[torch.Tensor] = None     # KV cache: the slots the new keys go to
    write_first: bool = True                 # KV cache: see KVCache.place


class Attention(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.cfg, self.layer = cfg, layer  # layer: this layer's index in the caches
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        # shaw: this layer's key-side distance embeddings, shared across heads
        self.rel_k = (nn.Embedding(cfg.rel_clip + 1, self.head_dim)
                      if cfg.pos_encoding == "shaw" else None)

    def forward(self, x, where, cache=None):
        B, T, _ = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.cfg.attention == "linear":
            y = self.linear(qkv, where, cache)
        else:
            y = self.softmax(qkv, where, cache)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))

    def softmax(self, qkv, where, cache):
        q, k, v = qkv
        if where.rope is not None:
            q, k = apply_rope(qkv[:2], *where.rope)  # q and k in one go; v is not rotated
        mask = where.mask
        if self.rel_k is not None:  # shaw: the one score term that depends on the query
            mask = mask + shaw_bias(q, self.rel_k.weight, where.distance)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(q.dtype)  # SDPA wants q's dtype; the bias was built in float32
        if cache is not None:
            k, v = cache.update(self.layer, where.slots, where.write_first, k, v)
        return F.scaled_dot_product_attention(  # no mask and no cache: plain causal
            q, k, v, attn_mask=mask, is_causal=mask is None and cache is None,
            dropout_p=self.cfg.dropout if self.training else 0.0)

    def linear(self, qkv, where, cache):
        q, k, v = qkv
        cos, sin = where.rope if where.rope is not None else (None, None)
        # autocast off: the state and denominator must be summed in float32
        with torch.autocast(q.device.type, enabled=False):
            y, (S, z) = linear_attention(q, k, v, cos, sin, self.cfg.feature_map,
                                         self.cfg.linear_chunk,
                                         None if cache is None else cache.get(self.layer))
            if self.cfg.linear_norm:
                y = F.rms_norm(y, (y.size(-1),))
        if cache is not None:
            cache.update(self.layer, S, z)
        return y.to(v.dtype)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = Attention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, where, cache=None):
        x = x + self.attn(self.ln_1(x), where, cache)
        return x + self.mlp(self.ln_2(x))


class RoFormer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos_encoding == "learned" else None
        # t5: one scalar per (bucket, head), shared by all layers as in T5
        self.rel_bias = (nn.Embedding(cfg.t5_buckets, cfg.n_head)
                         if cfg.pos_encoding == "t5" else None)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        # The fixed position tables, RoPE's cos/sin or the sinusoidal baseline's embedding: not
        # persistent (never in a checkpoint, so rope_scaling can change at inference), kept
        # float32 when the model is cast (_apply), grown when a forward runs past them. Built
        # now and moved with the model, so a training forward never builds, copies or mutates
        # them (a host-to-device copy per step would also break a compiled graph).
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.register_buffer("sin_emb", torch.empty(0), persistent=False)
        self.pos_tables(cfg.context_window, "cpu")
        for name, p in self.named_parameters():  # the tied head is wte's weight: drawn once
            init_parameter(name, p, cfg.n_layer)

    def _apply(self, fn, *args, **kwargs):
        # model.to(torch.bfloat16) casts every float buffer, and a later .float() cannot undo
        # the rounding (cos/sin off by ~4e-3). The position tables are float32 by design: after
        # a conversion keep their float32 values, moved to wherever the model went.
        tables = {n: getattr(self, n) for n in ("rope_cos", "rope_sin", "sin_emb")}
        super()._apply(fn, *args, **kwargs)
        for name, before in tables.items():
            after = getattr(self, name)
            if after.dtype != before.dtype and not before.is_meta:
                setattr(self, name, before.to(after.device))
        return self

    def pos_tables(self, n, device):
        """Make the fixed tables cover positions 0..n-1 (float32, built on the CPU in float64,
        so also under torch.device("meta")); grown geometrically, only when too short."""
        c = self.config
        have = {"rope": self.rope_cos, "sinusoidal": self.sin_emb}.get(c.pos_encoding)
        if have is None or have.size(0) >= n:
            return  # the other encodings have no fixed table
        pos = torch.arange(max(n, c.block_size, 2 * have.size(0)), device="cpu")
        if c.pos_encoding == "rope":
            cos, sin = rope_table(pos, c.n_embd // c.n_head, c.rope_base, c.rope_scaling,
                                  c.rope_factor)
            self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        else:
            self.sin_emb = sinusoidal_embedding(pos, c.n_embd).to(device)

    def position_embedding(self, pos, index):
        """Hook 1 of 2 for position encodings: what is added to the token embeddings at
        positions `pos` (`index`: the same positions as a table index), or None."""
        if self.config.pos_encoding == "learned":
            return self.wpe(pos)
        if self.config.pos_encoding == "sinusoidal":
            return self.sin_emb[index].to(self.wte.weight.dtype)
        return None

    def position_bias(self, d, visible):
        """Hook 2 of 2: the float32 bias a relative encoding adds to the scores of distances
        d (Lq, Lk), shared by the layers ((H or 1, Lq, Lk); shaw adds its query term in each
        layer), with -inf where `visible` is False: that is how causality and the decoding
        window enter once SDPA cannot take is_causal. Without a bias: just `visible`."""
        c = self.config
        if c.pos_encoding == "t5":
            bias = self.rel_bias(t5_bucket(d, c.t5_buckets, c.t5_max_distance))
            bias = bias.permute(2, 0, 1).float()
        elif c.pos_encoding == "alibi":
            slopes = torch.tensor(alibi_slopes(c.n_head), dtype=torch.float32, device=d.device)
            bias = -slopes[:, None, None] * d.float()
        elif c.pos_encoding == "shaw":
            bias = torch.zeros(1, *d.shape, device=d.device)
        else:
            return visible
        return bias.masked_fill(~visible, float("-inf"))

    def new_cache(self, total_len, device):
        """An empty decoding cache for sequences of up to total_len tokens."""
        c = self.config
        if c.attention == "linear":
            return RecurrentState(c.n_layer)
        return KVCache(c.n_layer, min(total_len, c.context_window), c.context_window, device)

    def forward(self, idx, targets=None, cache=None, start_pos=0):
        """idx (B, T) -> logits (B, T, V), and the mean cross-entropy if targets are given
        (-1 marks positions to ignore). With a cache (new_cache), idx holds the tokens at
        absolute positions start_pos.., attention also sees the cached ones, and the cache is
        updated. start_pos is an int, or for generate.py's static one-token step a (1,) long
        tensor on idx's device: the position is then data, not a constant, so one graph
        serves every step and nothing is read back to the host (the tables must cover it)."""
        c = self.config
        T = idx.size(1)
        if isinstance(start_pos, torch.Tensor):
            if T != 1:
                raise ValueError(f"a tensor start_pos decodes one token per sequence, got {T}")
            pos = index = start_pos  # table entries by gather, not by a slice with a constant bound
        else:
            if c.pos_encoding == "learned" and start_pos + T > c.block_size:
                raise ValueError(f"learned positions end at block_size={c.block_size}; cannot "
                                 f"run position {start_pos + T - 1} (use use_cache=False to crop)")
            self.pos_tables(start_pos + T, idx.device)
            pos = torch.arange(start_pos, start_pos + T, device=idx.device)
            index = slice(start_pos, start_pos + T)
        x = self.wte(idx)
        added = self.position_embedding(pos, index)
        x = self.drop(x if added is None else x + added)
        rope = (self.rope_cos[index], self.rope_sin[index]) if c.pos_encoding == "rope" else None
        if isinstance(cache, KVCache):
            slots, write_first, distance, visible = cache.place(pos, start_pos)
            where = Positions(rope, self.position_bias(distance, visible), distance, slots,
                              write_first)
        elif c.pos_encoding in RELATIVE:
            distance = pos[:, None] - pos[None, :]
            where = Positions(rope, self.position_bias(distance, distance >= 0), distance)
        else:
            where = Positions(rope, None)
        for block in self.blocks:
            x = block(x, where, cache)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss

    def num_params(self, non_embedding=True):
        """Parameter count. non_embedding drops the position table (the token table stays: it
        is also the output head)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.wpe is not None:
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len):
        """Training FLOPs (forward + backward = 3x forward) per token at sequence length
        seq_len: 6 per parameter for the matmuls, plus attention itself."""
        c = self.config
        if c.attention == "softmax":  # q.k and att.v over seq_len keys, no causal discount
            attn = 2 * 2 * seq_len * c.n_embd
        else:  # two causal chunk (L x L) products, plus the state's read and update
            length, d = min(c.linear_chunk, seq_len), c.n_embd // c.n_head
            attn = 2 * c.n_embd * (2 * length + 2 * d)
        return 6 * self.num_params() + 3 * c.n_layer * attn
