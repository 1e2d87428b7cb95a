"""A decoder-only RoFormer: a GPT whose attention knows positions only through Rotary Position
Embedding (RoPE, Su et al. 2021). 1. config, init; 2. RoPE; 3. linear attention (eq. 19); 4. the
transformer. Beside it: baselines.py (other position encodings, behind two hooks), caches.py (the
decoding caches, driven by decode.py), model_checks.py (the config's rules)."""
import hashlib
import math
from collections import OrderedDict
from functools import partial
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model_checks import check_config, require_positions, tied_head_check  # config's rules


def baselines():  # baselines.py: loaded only by a model whose pos_encoding is not "rope"
    import baselines as module
    return module


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
    rope_pairs: str = "adjacent"  # RoPE pairs 2i, 2i + 1 (the paper's); "half": i, i + d/2
    attention: str = "softmax"    # "softmax" | "linear"
    feature_map: str = "elu"      # linear attention only: "elu" (elu+1) | "relu"
    pos_encoding: str = "rope"    # or a baseline: learned, sinusoidal, none, shaw, t5, alibi
    linear_chunk: int = 64        # chunk length of the causal linear-attention kernel
    linear_norm: bool = False     # RMS-normalise each linear-attention head's output
    rope_scaling: str = "none"    # context extension: "none" | "linear" | "ntk" | "yarn"
    rope_factor: float = 1.0      # the window is rope_original * rope_factor
    rope_original: int = 0        # the context RoPE was trained at (0: block_size)
    rel_clip: int = 16            # shaw: distances beyond this share one embedding
    t5_buckets: int = 32          # t5: number of distance buckets (half exact, half log-spaced)
    t5_max_distance: int = 128    # t5: distances from here on share the last bucket
    # position designs (docs/MODEL.md); a "k-th" layer: layers k-1, 2k-1, .. counting from 0
    rotary_fraction: float = 1.0  # RoPE on each head's first head_dim * this channels
    nope_every: int = 0           # k: every k-th layer rotates nothing (NoPE)
    window: int = 0               # > 0: local layers see themselves and window-1 keys before
    global_every: int = 0         # k (with window): every k-th layer sees the whole context
    local_rope_base: float = 0.0  # local layers' RoPE base, unscaled (0: rope_base)
    length_temperature: float = 0.0  # q x 1 + this ln(max(1, (pos+1) / original_context))
    tie_embeddings: bool = True   # the output head is wte's weight; False: a matrix of its own
    qk_norm: bool = False         # softmax: each head's q and k at mean 0, RMS 1 before the turn
    value_residual: bool = False  # softmax: later layers mix in layer 0's values, a gate each

    @property
    def original_context(self):  # a fine-tune at a longer block keeps it: no compounding
        return self.rope_original or self.block_size

    @property
    def context_window(self):  # what a query sees when decoding or scoring
        return max(self.block_size, int(self.original_context * self.rope_factor))

    @property
    def rotary_dim(self):  # the channels of each head that RoPE rotates (checked: even)
        return int(self.n_embd // self.n_head * self.rotary_fraction)

    def __post_init__(self):
        check_config(self)  # model_checks.py: every rule, one line per mistake


def init_generator(seed, name, device="cpu"):
    """Parameter `name`'s own stream, seeded by (seed, name) alone (sha256: Python salts hash()):
    two configurations drawn from one seed start every parameter they share equal."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def init_parameter(name, p, n_layer, seed):
    """The one init rule, by name (also for harness/build.py's meta-device build): matrices
    normal(0, 0.02), residual projections c_proj / sqrt(2 n_layer); norm weights 1, biases 0."""
    if p.dim() == 1:  # biases 0; norm weights and the value residual's gates 1
        p.fill_(0.0 if name.endswith("bias") else 1.0)
    else:
        std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
        p.normal_(0.0, std, generator=init_generator(seed, name, p.device))


# 2. RoPE: pair i of a head (channels 2i, 2i + 1, or i, i + d/2) turns by m theta_i (docs/MODEL.md)
def ntk_base(base, factor, head_dim):  # NTK-aware (also the exports'): the lowest pair s x slower
    return base * factor ** (head_dim / (head_dim - 2))


def rope_table(pos, head_dim, base=10000.0, scaling="none", factor=1.0, original=0):
    """float32 (len(pos), head_dim) cos = [cos a, cos a], sin = [-sin a, sin a], a = m theta_i,
    from float64 angles; `scaling` by `factor` from the `original` context: docs/MODEL.md."""
    if scaling == "ntk":
        base = ntk_base(base, factor, head_dim)
    i = torch.arange(head_dim // 2, device="cpu").double()  # cpu: also under device("meta")
    inv_freq, gain = base ** (-2 * i / head_dim), 1.0
    if scaling == "yarn":  # c(r): the pair that turns r times over `original` positions
        dim = lambda r: head_dim * math.log(original / (2 * math.pi * r)) / (2 * math.log(base))
        low, high = max(math.floor(dim(32)), 0), min(math.ceil(dim(1)), head_dim - 1)
        ramp = ((i - low) / ((high - low) or 1e-3)).clamp(0, 1)  # 0: theta_i, 1: theta_i / s
        inv_freq, gain = inv_freq * (1 - ramp + ramp / factor), 0.1 * math.log(factor) + 1.0
    pos = pos.to(torch.float64).cpu() / (factor if scaling == "linear" else 1.0)
    angle = torch.outer(pos, inv_freq)
    cos, sin = angle.cos() * gain, angle.sin() * gain
    return torch.cat((cos, cos), -1).float(), torch.cat((-sin, sin), -1).float()


def apply_rope(x, cos, sin, pairs="half"):
    """Pair i: (x1, x2) -> (x1 cos a - x2 sin a, x2 cos a + x1 sin a); "half" pairs (i, i + D/2)
    as x * cos + roll(x, D/2) * sin, "adjacent" (2i, 2i + 1) as a complex product (docs/MODEL.md).
    float32 tables promote a bf16 x. Narrower tables (rotary_fraction): r channels turn."""
    r = cos.size(-1)
    if r < x.size(-1):
        return torch.cat((apply_rope(x[..., :r], cos, sin, pairs), x[..., r:]), -1)
    if pairs == "half":
        return torch.addcmul(x * cos, x.roll(r // 2, dims=-1), sin).to(x.dtype)
    c, s = cos[..., :r // 2], sin[..., r // 2:]  # cos = [c, c], sin = [-s, s]
    xp = x.to(torch.promote_types(x.dtype, cos.dtype)).unflatten(-1, (-1, 2))  # (.., r/2, 2)
    if torch.compiler.is_compiling():  # inductor has no complex kernels, but fuses the sums
        x1, x2 = xp.unbind(-1)
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2).to(x.dtype)
    return torch.view_as_real(torch.view_as_complex(xp) * torch.complex(c, s)).flatten(-2).to(x.dtype)


# 3. Linear attention, RoFormer eq. 19 (docs/MODEL.md): causal, rotation in the numerator only, the
# denominator >= GUARD x its bound; chunked, S = sum R_n phi(k_n) v_n^T, z = sum phi(k_n) carried.
GUARD = 0.25
FEATURE_MAPS = {"elu": lambda t: F.elu(t) + 1.0, "relu": F.relu}  # phi: never negative


def linear_attention(q, k, v, cos=None, sin=None, feature_map="elu", chunk=64, state=None,
                     eps=1e-6, pairs="half"):
    """q, k: (B, H, N, D), v: (B, H, N, Dv); cos/sin or None; state: (S, z) or None -> (out,
    (S, z)). In float32: fp16 sums overflow within a few hundred tokens, a bf16 state drifts."""
    dtype = torch.promote_types(q.dtype, torch.float32)  # float64 (the references) stays
    fq, fk = fqk = FEATURE_MAPS[feature_map](torch.stack((q, k)).to(dtype))  # one op for both
    rq, rk = apply_rope(fqk, cos, sin, pairs) if cos is not None else fqk
    v = v.to(dtype)
    B, H, N, D = q.shape
    length = min(chunk, N)
    pad = -N % length  # zero keys and values: they add nothing to any sum
    fq, fk, rq, rk, v = (F.pad(t, (0, 0, 0, pad)).view(B, H, -1, length, t.size(-1))
                         for t in (fq, fk, rq, rk, v))
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    num = (rq @ rk.transpose(-1, -2)).masked_fill(~causal, 0.0) @ v  # within each chunk
    # across chunks: the state each chunk starts from (an exclusive prefix sum over chunks)
    kv = rk.transpose(-1, -2) @ v                # (B, H, n_chunks, D, Dv)
    S = torch.cat((torch.zeros_like(kv[:, :, :1]), kv.cumsum(2)[:, :, :-1]), dim=2)
    z = F.pad(fk.sum(-2).cumsum(2)[:, :, :-1], (0, 0, 1, 0))  # (B, H, n_chunks, D)
    if state is not None:
        S, z = S + state[0].to(dtype)[:, :, None], z + state[1].to(dtype)[:, :, None]
    num = num + rq @ S
    k_sum = z.unsqueeze(-2) + fk.cumsum(-2)      # sum of phi(k_n) over n <= m, at every m
    den = (fq * k_sum).sum(-1)
    if cos is not None:  # the guard; without rotation the weights are den's own terms
        r = cos.size(-1)  # apply_rope's pairs turn; channels past r (partial RoPE) do not
        fold = lambda t: torch.cat((t[..., :r // 2] + t[..., r // 2:r] if pairs == "half" else  # noqa
                                    t[..., :r].unflatten(-1, (-1, 2)).sum(-1), t[..., r:]), -1)
        den = torch.maximum(den, GUARD * (fold(fq) * fold(k_sum)).sum(-1))
    out = (num / (den.unsqueeze(-1) + eps)).flatten(2, 3)[:, :, :N]
    return out, (S[:, :, -1] + kv[:, :, -1], k_sum[:, :, -1, -1])


# 4. The transformer
def as_is(x, *_):  # where an option is off: its step leaves x (its first input) as it is
    return x


class Positions(NamedTuple):  # one forward's positions: each table its layers read, built once
    pos: torch.Tensor                  # the queries' absolute positions, (T,)
    rope: dict                         # a layer's window -> its (cos, sin) at pos; None: None
    bias: Callable = as_is             # (visible, distance) -> SDPA's mask: a baseline's bias
    scale_q: Callable = as_is          # the length temperature, where set
    own: Optional[dict] = None         # uncached: {window: (mask, distance)} of the chunk's keys
    first_v: Optional[list] = None     # value residual: [layer 0's values], once it ran

    def scores(self, key_pos, visible):  # -> SDPA's mask for keys at key_pos, the distances
        distance = self.pos[:, None] - key_pos[None, :]
        return self.bias(visible, distance), distance


class Attention(nn.Module):  # options decided once, here: a call reads as the paper's attention
    def __init__(self, cfg, layer=0):
        super().__init__()
        self.cfg, self.layer = cfg, layer  # layer: its index in the caches
        self.v_mix = nn.Parameter(torch.ones(1)) if cfg.value_residual and layer else None
        kth = lambda k: k > 0 and (layer + 1) % k == 0  # noqa: E731 (layers k-1, 2k-1, ..)
        self.rotates = cfg.pos_encoding == "rope" and not kth(cfg.nope_every)  # NoPE: no turn
        self.window = 0 if kth(cfg.global_every) else cfg.window  # 0: the whole context
        self.rope_key = self.window if self.rotates else None  # its table in Positions.rope
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        head = (self.head_dim,)  # Persimmon's QK-norm (no gain); eq. 19's per-head output norm
        self.qk_norm = partial(F.layer_norm, normalized_shape=head) if cfg.qk_norm else as_is
        self.out_norm = partial(F.rms_norm, normalized_shape=head) if cfg.linear_norm else as_is
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.rel_k = as_is  # shaw: this layer's table of query terms (baselines.add_tables)

    def forward(self, x, positions, cache=None):
        B, T, _ = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        y = getattr(self, self.cfg.attention)(qkv, positions, cache)  # softmax or linear, below
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))

    def softmax(self, qkv, positions, cache):
        qk, v = qkv.split((2, 1))  # not qkv[:2]: a split's backward is one concatenation
        qk, rope = self.qk_norm(qk), positions.rope[self.rope_key]
        q, k = apply_rope(qk, *rope, self.cfg.rope_pairs) if rope else qk  # v: not rotated
        q, v = positions.scale_q(q), v.squeeze(0)
        if self.cfg.value_residual:  # layer 0 lends its values, later layers mix them in
            v = self.mix_values(v, positions.first_v)
        if cache is None:  # the chunk's own keys: one mask per window, built once (designs)
            mask, distance = positions.own[self.window]
        else:
            k, v, key_pos, visible = cache.update(self.layer, k, v, positions.pos)
            mask, distance = positions.scores(key_pos, visible)
        mask = self.rel_k(mask, q, distance)  # shaw adds the one term that depends on q
        return F.scaled_dot_product_attention(  # no mask and no cache: plain causal
            q, k, v, attn_mask=mask, is_causal=mask is None and cache is None,
            dropout_p=self.cfg.dropout * self.training)  # a bool: dropout in training only

    def mix_values(self, v, first_v):  # value residual: v + (v_0 - v) g, g = v_mix / 2
        if self.v_mix is None:  # layer 0: the values the others mix in (0.5 at init)
            first_v.append(v)
            return v
        return torch.lerp(v, first_v[0], (0.5 * self.v_mix).to(v.dtype))

    def linear(self, qkv, positions, cache):
        q, k, v = qkv
        state = None if cache is None else cache.state[self.layer]
        with torch.autocast(q.device.type, enabled=False):  # the sums must be float32
            y, (S, z) = linear_attention(q, k, v, *(positions.rope[self.rope_key] or (None, None)),
                                         self.cfg.feature_map, self.cfg.linear_chunk, state,
                                         pairs=self.cfg.rope_pairs)
            y = self.out_norm(y)
        if cache is not None:
            cache.update(self.layer, S, z)
        return y.to(v.dtype)


class Block(nn.Module):  # pre-norm: x + attn(norm(x)), then x + mlp(norm(x))
    def __init__(self, cfg, layer):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = Attention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(OrderedDict(  # named as checkpoints name them
            c_fc=nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias), gelu=nn.GELU(),
            c_proj=nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
            drop=nn.Dropout(cfg.dropout)))

    def forward(self, x, positions, cache=None):
        x = x + self.attn(self.ln_1(x), positions, cache)
        return x + self.mlp(self.ln_2(x))


class RoFormer(nn.Module):
    def __init__(self, cfg, seed=None):
        super().__init__()  # seed None: drawn first, before the layers' own constructors draw
        seed = int(torch.randint(2 ** 62, (), device="cpu")) if seed is None else seed
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        for name in ("wpe", "rel_bias"):  # the learned and t5 tables' place in checkpoints
            self.register_module(name, None)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        if cfg.pos_encoding != "rope":  # a baseline's tables: here, and each layer's (shaw)
            baselines().add_tables(self, cfg)
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
            self._register_load_state_dict_pre_hook(tied_head_check)
        # Fixed float32 tables (RoPE, sinusoidal), grown on demand, not in checkpoints; on the
        # CPU even under device("meta") (harness/build.py keeps them); where a model has none,
        # one row of zero columns
        for name in ("rope_cos", "rope_sin", "sin_emb"):
            self.register_buffer(name, torch.empty(1, 0, device="cpu"), persistent=False)
        self.table_start = 0  # the tables hold positions table_start.. (hold_positions)
        self.hold_positions(0, cfg.block_size)  # not the window: a forward grows them
        if not self.wte.weight.is_meta:  # meta: harness/build.py draws once memory is given
            for name, p in self.named_parameters():  # a tied head is wte's weight: drawn once
                init_parameter(name, p, cfg.n_layer, seed)

    # Why a private hook: model.to(dtype) casts every floating buffer; plain attributes would not
    # follow .to(device), DDP or FSDP; a table cast to bf16 and back is float32, rounded, unseen.
    def _apply(self, fn, *args, **kwargs):  # so the float32 tables stay as rope_table built them
        tables = {n: getattr(self, n) for n in ("rope_cos", "rope_sin", "sin_emb")}
        super()._apply(fn, *args, **kwargs)
        for name, before in tables.items():  # as they were, on the device fn moved them to
            setattr(self, name, before.to(getattr(self, name).device))
        return self

    def hold_positions(self, start, n):
        """Make the fixed tables hold positions start..start+n-1, position p in row p % L of their
        L rows: written over in place up to L positions (docs/MODEL.md: why), resized past."""
        c = self.config  # `have`: the table whose length the others share, None if no table
        have = {"rope": self.rope_cos, "sinusoidal": self.sin_emb,
                "learned": getattr(self.wpe, "weight", None)}.get(c.pos_encoding)
        if have is None or self.table_start <= start and start + n <= self.table_start + len(have):
            return  # held already, or no table (the other encodings)
        require_positions(c, start + n)  # the one table that cannot grow, wpe: a line past it
        size = max(n, len(have))
        for name, rows in self.table_rows(torch.arange(start, start + size, device="cpu")).items():
            rows = rows.roll(start % size, 0)  # row i, position start + i, to row p % size
            getattr(self, name).resize_(rows.shape).copy_(rows)  # same shape: same memory
        self.table_start = start

    def table_rows(self, pos):  # the fixed tables' rows at positions pos (cpu: also under meta)
        c = self.config
        if c.pos_encoding == "sinusoidal":
            return {"sin_emb": baselines().sinusoidal_embedding(pos, c.n_embd)}
        tables = rope_table(pos, c.rotary_dim, c.rope_base, c.rope_scaling, c.rope_factor,
                            c.original_context)
        local = c.local_rope_base or c.rope_base  # unscaled (as Gemma 3's): they see no distance
        if c.window and (local != c.rope_base or c.rope_factor != 1):  # past the window
            tables = map(torch.cat, zip(tables, rope_table(pos, c.rotary_dim, local)), (-1, -1))
        return dict(zip(("rope_cos", "rope_sin"), tables))  # [rope | local layers'], if theirs

    def new_cache(self, total_len, device, window=None):  # for decode.py, which passes it
        """to forward; window: how far back a query sees (None: the context window)."""
        from caches import new_cache  # loaded only where a model decodes
        return new_cache(self, total_len, device, window)

    def forward(self, idx, targets=None, cache=None, start_pos=0):
        """idx (B, T) at positions start_pos.. -> logits (B, T, V), and the mean cross-entropy of
        targets (-1: ignore). start_pos: an int, or a (1,) tensor as in the static compiled step
        (one graph for every position), whose table rows must be held (hold_positions)."""
        if not isinstance(start_pos, torch.Tensor):  # known on the host: the tables hold it
            self.hold_positions(start_pos, idx.size(1))
        pos = torch.arange(idx.size(1), device=idx.device) + start_pos  # absolute positions
        x, positions = self.designs(self.wte(idx), pos, cache)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, positions, cache)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def designs(self, x, pos, cache):
        """The forward's Positions: every table its layers read, built once for all of them;
        and x, the token embeddings, with what an absolute baseline adds to them."""
        c, r = self.config, self.config.rotary_dim  # slot p % L holds position p
        cos, sin = (table[pos % table.size(0)] for table in (self.rope_cos, self.rope_sin))
        # by window: global layers' r columns, then local layers' last r (the same columns when
        # they have no base of their own or there is no window); NoPE layers, None
        rope = {0: (cos[..., :r], sin[..., :r]), c.window: (cos[..., -r:], sin[..., -r:])}
        positions = Positions(pos, {**rope, None: None}, first_v=[])
        if c.pos_encoding != "rope":  # the one hook into baselines.py: its vectors or its bias
            x, positions = baselines().positions(self, x, positions)
        if c.length_temperature:  # 1 inside the trained context: training at 1x is unchanged
            ratio = ((pos + 1) / c.original_context).clamp(min=1)  # float32 (pos < 2^24 exact)
            scale = 1 + c.length_temperature * ratio.log()[:, None]  # q's dtype after
            positions = positions._replace(scale_q=lambda q: (q * scale).to(q.dtype))
        if cache is None:  # every layer of a window attends to the same keys: one mask each
            own = {0: (None, None)} if positions.bias is as_is else {}  # SDPA's causal mask
            for w in {0, c.window} - own.keys():  # a window's, or a baseline's bias: built here
                d = pos[:, None] - pos[None, :]
                own[w] = positions.bias((d >= 0) & (d < (w or len(pos))), d), d
            positions = positions._replace(own=own)
        return x, positions

    def num_params(self):  # less the lookup tables: wpe, and wte unless tied (then the head)
        lookups = {self.wte.weight, getattr(self.wpe, "weight", None)} - {self.lm_head.weight}
        return sum(p.numel() for p in set(self.parameters()) - lookups)
