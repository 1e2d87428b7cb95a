"""
A decoder-only RoFormer: a GPT-style language model whose attention knows positions only
through Rotary Position Embedding (RoPE, Su et al. 2021). Read top to bottom:

  1. RoPE: the angle table and the rotation; the baselines it is compared with (absolute
     tables, and the relative biases Shaw, T5 and ALiBi).
  2. Linear attention (RoFormer eq. 19): chunked causal form, also used for decoding.
  3. Attention, MLP, Block, RoFormer (forward, generate, optimizer, FLOPs).

Everything a decoding step needs (the KV cache, the recurrent state) lives in this file.
Imports torch only.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


RELATIVE = ("shaw", "t5", "alibi")  # encodings that bias the attention scores by distance


@dataclass
class RoFormerConfig:
    vocab_size: int = 4096
    block_size: int = 256         # training context; also the attention window when decoding past it
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
# 1. RoPE
#
# Pairing convention: channel i of a head is paired with channel i + d/2 ("half split", as in
# GPT-NeoX), and pair i turns by angle m * theta_i at position m. The paper pairs adjacent
# channels (2i, 2i+1) instead; the two differ only by a fixed permutation of the q/k output
# channels, which the learned projection absorbs, so the maths is the same. Half split needs
# no interleaving, just two slices. Checkpoints are not interchangeable with the other layout.

def rope_table(pos, head_dim, base=10000.0, scaling="none", factor=1.0):
    """cos and sin of the angles m * theta_i for integer positions `pos`: two (len(pos),
    head_dim/2) float32 tables.

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
    ang = torch.outer(pos, inv_freq)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin):
    """Rotate x (..., T, D) by the (T, D/2) tables. Done in float32 (float64 stays float64)
    so a bf16 activation never meets a bf16-rounded angle; the result has x's dtype."""
    xf = x if x.dtype == torch.float64 else x.float()
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), written as x * [cos, cos] +
    # roll(x) * [-sin, sin]: rolling by D/2 swaps the halves in one op, which makes the whole
    # rotation 4 kernels instead of 7 (it is pure memory traffic, so kernel count is its cost).
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    out = xf * cos + xf.roll(x.size(-1) // 2, dims=-1) * sin
    return out.to(x.dtype)


SINUSOIDAL_SCALE = 0.02 * math.sqrt(2)


def sinusoidal_embedding(pos, dim):
    """The fixed absolute encoding of 'Attention Is All You Need', for the baseline. Scaled to
    an RMS of 0.02, the init scale of the token (and learned position) embeddings it is added
    to: unscaled sin/cos (RMS 0.71) would drown the tokens 35 to 1 at init, which handicaps
    the baseline rather than testing it. (The original scales tokens up by sqrt(d) instead.)"""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    ang = pos.cpu().double()[:, None] * inv_freq  # on the CPU: some devices lack float64
    table = torch.cat((ang.sin(), ang.cos()), dim=-1) * SINUSOIDAL_SCALE
    return table.float()


# Relative baselines. Each one turns the distances d = i - j (query position minus key
# position, an integer (Lq, Lk) matrix) into a float32 bias added to the attention scores.
# Only distances enter, never the positions themselves, so the same functions serve the
# training forward and the decoding cache (whose keys sit in slots at known positions), and
# all three are shift invariant. They are causal: only d >= 0 is ever visible.

def shaw_bias(q, table, d):
    """Shaw et al. 2018, keys side: q_i . a_clip(i-j) / sqrt(D), the part of the score
    q_i . (k_j + a_ij) that the keys do not give. table: (rel_clip + 1, D), one learned vector
    per clipped distance 0..rel_clip (causal: the paper's 2k+1 vectors minus the k for future
    keys), shared by the heads. q: (B, H, Lq, D) -> (B, H, Lq, Lk).
    Computed as the (Lq, rel_clip+1) products q . a, then gathered by distance: never the
    (Lq, Lk, D) tensor of the a_ij; the extra memory is that small product plus the
    (B, H, Lq, Lk) result, the size of the score matrix. The values-side term is left out."""
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
# 2. Linear attention, RoFormer eq. 19, causal:
#
#   o_m = sum_{n<=m} (R_m phi(q_m))^T (R_n phi(k_n)) v_n / (sum_{n<=m} phi(q_m)^T phi(k_n) + eps)
#
# The rotation sits in the numerator only, so the denominator stays a positive sum. A
# consequence of the formula (not a bug): the weights of the v_n can be negative and need not
# sum to one; on random inputs their sum is ~1 at the first position and shrinks to ~0.25
# after a thousand tokens, so the output scale drifts with position. `linear_norm` (an RMS norm
# per head) is the knob that removes that drift.
#
# Chunked form: inside a chunk of C tokens, a masked C x C product; across chunks, the
# running state S = sum R_n phi(k_n) v_n^T (d x d_v) and z = sum phi(k_n) (d). Only one d x d_v
# state per chunk is ever held (N/C of them), never the (N, d, d_v) prefix sums. Decoding is
# the same function with a one-token chunk and the state carried across calls.

def linear_attention(q, k, v, cos=None, sin=None, feature_map="elu", chunk=64, state=None,
                     eps=1e-6):
    """q, k: (B, H, N, D), v: (B, H, N, Dv); cos/sin: (N, D/2) or None for no rotation;
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
    C = min(chunk, N)
    nc = -(-N // C)
    pad = nc * C - N  # padded keys and values are zero, so they add nothing to any sum

    def chunks(t):
        return F.pad(t, (0, 0, 0, pad)).view(B, H, nc, C, t.size(-1))

    fq, fk, rq, rk, v = map(chunks, (fq, fk, rq, rk, v))
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # within each chunk
    num = (rq @ rk.transpose(-1, -2)).masked_fill(~causal, 0.0) @ v
    den = (fq @ fk.transpose(-1, -2)).masked_fill(~causal, 0.0).sum(-1)
    # across chunks: the state each chunk starts from (an exclusive prefix sum over chunks)
    kv = rk.transpose(-1, -2) @ v                # (B, H, nc, D, Dv)
    ks = fk.sum(-2)                              # (B, H, nc, D)
    S = torch.cat((torch.zeros_like(kv[:, :, :1]), kv.cumsum(2)[:, :, :-1]), dim=2)
    z = torch.cat((torch.zeros_like(ks[:, :, :1]), ks.cumsum(2)[:, :, :-1]), dim=2)
    if state is not None:
        S = S + state[0].to(dtype)[:, :, None]
        z = z + state[1].to(dtype)[:, :, None]
    num = num + rq @ S
    den = den + (fq @ z.unsqueeze(-1)).squeeze(-1)
    out = num / (den.unsqueeze(-1) + eps)
    out = out.view(B, H, nc * C, -1)[:, :, :N]
    return out, (S[:, :, -1] + kv[:, :, -1], z[:, :, -1] + ks[:, :, -1])


# ----------------------------------------------------------------------------------------
# 3. The transformer

class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        # shaw: this layer's key-side distance embeddings, shared across heads
        self.rel_k = (nn.Embedding(cfg.rel_clip + 1, self.head_dim)
                      if cfg.pos_encoding == "shaw" else None)
        # Decoding state, set only inside generate / a cached forward: rolling (k, v) buffers
        # for softmax, the recurrent (S, z) for linear attention.
        self.cache = None

    def forward(self, x, rope, step=None, rel=None):
        """rel (relative encodings only): (float mask, distances) from RoFormer.position_bias,
        the mask holding the bias and -inf where a key is not visible."""
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv
        cos, sin = rope if rope is not None else (None, None)
        if self.cfg.attention == "linear":
            # autocast off: the state and denominator must be summed in float32
            with torch.autocast(x.device.type, enabled=False):
                y, state = linear_attention(q, k, v, cos, sin, self.cfg.feature_map,
                                            self.cfg.linear_chunk, self.cache if step else None)
                if self.cfg.linear_norm:
                    y = F.rms_norm(y, (y.size(-1),))
            if step is not None and self.cache is None:
                self.cache = state
            elif step is not None:  # in place: a compiled (CUDA-graph) step needs fixed addresses
                for old, new in zip(self.cache, state):
                    old.copy_(new)
            y = y.to(v.dtype)
        else:
            if rope is not None:
                q, k = apply_rope(qkv[:2], cos, sin)  # q and k in one go; v is not rotated
            mask = None
            if rel is not None:  # the one place a position bias meets the scores
                mask = rel[0] if self.rel_k is None else rel[0] + shaw_bias(q, self.rel_k.weight,
                                                                            rel[1])
                # SDPA wants q's dtype; built in float32, the bias is rounded only here
                mask = mask.to(q.dtype)
            if step is None:  # with a float mask SDPA cannot use is_causal: -inf does it
                y = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None,
                    dropout_p=self.cfg.dropout if self.training else 0.0)
            else:
                y = self.cached_attention(q, k, v, step, mask)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.c_proj(y))

    def cached_attention(self, q, k, v, step, bias=None):
        """Attend from T new queries to the rolling cache plus the new keys, then store the new
        keys. Keys go in already rotated at their absolute position and are never touched
        again; only slots whose key has left the window get overwritten. bias, if given, is
        the float mask of a relative encoding over the same keys, used instead of step's."""
        buf, slots, mask, write_first = step[:4]
        if self.cache is None:  # preallocated once per generate call, then only written into
            shape = (q.size(0), self.n_head, buf, self.head_dim)
            self.cache = (k.new_zeros(shape), v.new_zeros(shape))
        ck, cv = self.cache
        if write_first:
            ck[:, :, slots], cv[:, :, slots] = k, v
            keys, vals = ck, cv
        else:
            # Writing first would evict keys that earlier queries of this chunk still see
            # (the classic chunked-prefill bug), so attend to old cache + new keys, then write.
            keys, vals = torch.cat((ck, k), dim=2), torch.cat((cv, v), dim=2)
            ck[:, :, slots], cv[:, :, slots] = k[:, :, -buf:], v[:, :, -buf:]
        return F.scaled_dot_product_attention(q, keys, vals,
                                              attn_mask=mask if bias is None else bias)


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

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, step=None, rel=None):
        x = x + self.attn(self.ln_1(x), rope, step, rel)
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
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        # The fixed position tables, RoPE's cos/sin or the sinusoidal baseline's embedding: not
        # persistent (never in a checkpoint, so rope_scaling can change at inference), kept
        # float32 when the model is cast (_apply), grown past block_size.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.register_buffer("sin_emb", torch.empty(0), persistent=False)
        if cfg.pos_encoding in ("rope", "sinusoidal"):
            # built now and moved with the model, so a training forward never builds, copies
            # or mutates them (a host-to-device copy per step would also break a compiled graph)
            self.pos_tables(cfg.block_size, "cpu")
        self.slot_pos = None  # decoding: absolute position held by each cache slot (-1: empty)
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
        """The fixed tables for positions 0..n-1 (at least), float32: (cos, sin) for RoPE, the
        (n, n_embd) embedding for the sinusoidal baseline. Built only when missing or too
        short (decoding past them), then grown geometrically."""
        c = self.config
        if c.pos_encoding not in ("rope", "sinusoidal"):
            return None  # the other encodings have no fixed table
        have = self.rope_cos if c.pos_encoding == "rope" else self.sin_emb
        if have.size(0) < n:
            # On the CPU explicitly (float64 exists there on every machine): a model built under
            # torch.device("meta") still gets real tables, which its materialisation carries over.
            pos = torch.arange(max(n, c.block_size, 2 * have.size(0)), device="cpu")
            if c.pos_encoding == "rope":
                cos, sin = rope_table(pos, c.n_embd // c.n_head, c.rope_base, c.rope_scaling,
                                      c.rope_factor)
                self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
            else:
                self.sin_emb = sinusoidal_embedding(pos, c.n_embd).to(device)
        return (self.rope_cos, self.rope_sin) if c.pos_encoding == "rope" else self.sin_emb

    def forward(self, idx, targets=None, start_pos=None):
        """idx (B, T) -> logits (B, T, V), and the mean cross-entropy if targets are given
        (-1 marks positions to ignore). With start_pos (inside generate), idx holds the tokens
        at absolute positions start_pos.. and attention runs against the decoding cache.
        start_pos is a Python int, or, for the static decode step that generate may compile, a
        (1,) long tensor on idx's device with T = 1: then the position is data, not a constant,
        so one graph serves every step, and nothing is read back to the host. The position
        tables must already cover it (generate grows them before the first step)."""
        c = self.config
        B, T = idx.shape
        if isinstance(start_pos, torch.Tensor):
            if T != 1:
                raise ValueError(f"a tensor start_pos decodes one token per sequence, got {T}")
            pos = rows = start_pos  # table rows by gather, not by a slice with a constant bound
        else:
            p0 = 0 if start_pos is None else start_pos
            pos, rows = torch.arange(p0, p0 + T, device=idx.device), slice(p0, p0 + T)
            if c.pos_encoding == "learned" and p0 + T > c.block_size:
                raise ValueError(f"learned positions end at block_size={c.block_size}; cannot "
                                 f"run position {p0 + T - 1} (use use_cache=False to crop)")
            self.pos_tables(p0 + T, idx.device)
        x = self.wte(idx)
        if c.pos_encoding == "learned":
            x = x + self.wpe(pos)
        elif c.pos_encoding == "sinusoidal":
            x = x + self.sin_emb[rows].to(x.dtype)
        x = self.drop(x)
        rope = None
        if c.pos_encoding == "rope":
            rope = (self.rope_cos[rows], self.rope_sin[rows])
        step = None if start_pos is None else self.cache_step(pos, start_pos)
        rel = None
        if c.pos_encoding in RELATIVE:  # distances: query x key, or query x cache slot
            d = pos[:, None] - pos[None, :] if step is None else step[4]
            rel = (self.position_bias(d, d >= 0 if step is None else step[2]), d)
        for block in self.blocks:
            x = block(x, rope, step, rel)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss

    def position_bias(self, d, visible):
        """The float32 attention mask of a relative encoding for distances d (Lq, Lk): the
        bias shared by all layers (t5, alibi; (H, Lq, Lk)) or zeros (shaw, whose term depends
        on each layer's queries; (1, Lq, Lk)), and -inf where `visible` is False, which is
        how causality (and the decoding window) enters once SDPA cannot take is_causal."""
        c = self.config
        if c.pos_encoding == "t5":
            bias = self.rel_bias(t5_bucket(d, c.t5_buckets, c.t5_max_distance))
            bias = bias.permute(2, 0, 1).float()
        elif c.pos_encoding == "alibi":
            slopes = torch.tensor(alibi_slopes(c.n_head), dtype=torch.float32, device=d.device)
            bias = -slopes[:, None, None] * d.float()
        else:
            bias = torch.zeros(1, *d.shape, device=d.device)
        return bias.masked_fill(~visible, float("-inf"))

    # --- incremental decoding -----------------------------------------------------------

    def reset_cache(self, total_len, device):
        """Empty every layer's decoding state. Softmax layers get a rolling buffer of
        min(total_len, block_size) slots, allocated on first use."""
        self.slot_pos = torch.full((min(total_len, self.config.block_size),), -1,
                                   dtype=torch.long, device=device)
        for block in self.blocks:
            block.attn.cache = None

    def cache_step(self, pos, start):
        """Bookkeeping shared by all layers for one cached forward over positions `pos`
        (starting at `start`: a Python int, or the (1,) tensor `pos` itself in the static
        decode step): which slots the new keys go to, and the mask (query position x slot).
        Nothing here reads a device value on the host: a per-token sync would stall a GPU.

        A query at position m sees the keys at positions m-block_size+1 .. m. Past block_size
        this is sliding-window attention: exact because RoPE scores depend on distance only,
        but not the same as cropping the text and recomputing (deeper layers' cached keys
        were computed from states that saw older tokens)."""
        if self.config.attention == "linear":
            return True  # the recurrent state needs no bookkeeping
        buf, T = self.slot_pos.numel(), pos.numel()
        # One token never evicts a key its query still needs, and neither does a chunk that
        # fits in the buffer's free slots; anything else must read the old keys first.
        write_first = T == 1 or start + T <= buf
        kept = pos[-buf:]
        slots = kept % buf
        kpos = self.slot_pos if write_first else torch.cat((self.slot_pos, pos))
        if write_first:
            self.slot_pos[slots] = kept
        else:
            self.slot_pos = self.slot_pos.index_put((slots,), kept)
        # The one place that sees query x key distances (cached and rolling paths alike): the
        # relative encodings turn d into their bias (position_bias), exact past block_size too.
        d = pos[:, None] - kpos[None, :]
        mask = (kpos[None, :] >= 0) & (d >= 0) & (d < self.config.block_size)
        return buf, slots, mask, write_first, d  # d: the distances, for relative encodings

    @torch.no_grad()
    def generate_stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                        use_cache=True, generator=None, compile=False):
        """Yield the next (B, 1) tokens one at a time.

        use_cache=True: prefill the prompt (in chunks of at most the cache size, so a long
        prompt costs memory linear in its length), then one token per step against the cache
        (rolling window for softmax, recurrent state for linear attention).
        use_cache=False: the reference loop; each step reruns the model on the last
        block_size tokens from scratch.
        compile=True (cached only): the one-token step runs through torch.compile, as one
        static graph (the position is a device tensor, the cache is preallocated; CUDA graphs
        on CUDA). Sampling stays outside it, so eager and compiled draw the same tokens
        whenever their logits agree."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        if top_k is not None and top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None: off), got {top_k}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 or None: off), got {top_p}")
        if idx.size(1) == 0:
            raise ValueError("generate needs at least one prompt token")
        if compile and not use_cache:
            raise ValueError("compile=True compiles the cached decode step; it needs use_cache=True")
        bs, T0 = self.config.block_size, idx.size(1)
        if use_cache and self.config.pos_encoding == "learned" and T0 + max_new_tokens > bs:
            raise ValueError(f"learned positions end at block_size={bs}; generating "
                             f"{T0 + max_new_tokens} tokens needs use_cache=False")
        seq = idx
        try:
            if use_cache:
                self.reset_cache(T0 + max_new_tokens, idx.device)
                n = self.slot_pos.numel()
                for p in range(0, T0, n):
                    logits = self(idx[:, p:p + n], start_pos=p)[0][:, -1]
                step = self.decode_step(compile, idx.device, T0 + max_new_tokens)
                pos = torch.full((1,), T0, dtype=torch.long, device=idx.device)
            for i in range(max_new_tokens):
                if not use_cache:
                    logits = self(seq[:, -bs:])[0][:, -1]
                nxt = sample_next(logits, temperature, top_k, top_p, generator)
                yield nxt
                if not use_cache:
                    seq = torch.cat((seq, nxt), dim=1)
                elif i + 1 < max_new_tokens:
                    logits = step(nxt, pos)
                    pos += 1  # on the device: the host never waits for a step to finish
        finally:  # a later call, or a normal forward, never sees this call's cache
            self.slot_pos = None
            for block in self.blocks:
                block.attn.cache = None

    def decode_step(self, compile, device, total_len):
        """The function generate calls per token: (B, 1) tokens, (1,) position tensor ->
        (B, V) logits, after the prefill has allocated every cache. Eager, it is the model's
        own forward; compiled, the same forward traced once into a static graph."""
        self.pos_tables(total_len, device)  # the step gathers table rows; they must exist now
        if not compile:
            return lambda tok, pos: self(tok, start_pos=pos)[0][:, -1]
        cuda = torch.device(device).type == "cuda"
        if cuda:  # CUDA graphs replay fixed addresses: the caches are written in place
            for t in [self.slot_pos] + [t for b in self.blocks for t in b.attn.cache]:
                torch._dynamo.mark_static_address(t)
        fn = torch.compile(self.forward, fullgraph=True, dynamic=False,
                           mode="reduce-overhead" if cuda else None)

        def step(tok, pos):
            if cuda:  # a new replay: the last step's logits (already sampled from) may go
                torch.compiler.cudagraph_mark_step_begin()
            return fn(tok, start_pos=pos)[0][:, -1]
        return step

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 use_cache=True, generator=None, compile=False):
        """Return idx followed by max_new_tokens sampled tokens, (B, T + new)."""
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p,
                                        use_cache, generator, compile))
        return torch.cat([idx] + new, dim=1)

    # --- training helpers ---------------------------------------------------------------

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
        else:  # causal chunk (C x C) three times over, plus state read and update
            C, d = min(c.linear_chunk, seq_len), c.n_embd // c.n_head
            attn = 2 * c.n_embd * (3 * C + 2 * d)
        return 6 * self.num_params() + 3 * c.n_layer * attn


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """(B, V) logits -> (B, 1) tokens. temperature 0 is greedy; top_k keeps the k likeliest
    tokens; top_p keeps the smallest set whose probability reaches p."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already >= p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
