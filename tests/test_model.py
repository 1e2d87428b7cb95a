"""model.py against independent references: float64 formulas written out here, explicit
rotation matrices, the naive O(N^2) eq. 19, and uncached recomputation."""
import math
import os
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from optim import build_optimizer  # noqa: E402
from harness.mfu import flops_per_token  # noqa: E402
from model import RoFormer, RoFormerConfig, apply_rope, linear_attention, rope_table  # noqa
from decode import generate, sample_next  # noqa: E402

POS_ENCODINGS = ["rope", "learned", "sinusoidal", "none"]
# The note of the tests that pin today's architecture (the float64 reference model, the
# checkpoint key sets): they fail by design when an option changes the architecture, and a
# failure with no option changed is a bug the contract check may not see (a wrong constant
# attention scale keeps every contract property), so it never stands alone as the message.
PINNED = ("this test pins today's architecture: if a new model option changed it on purpose, "
          "the option is judged by python -m pytest -q tests/test_contract.py --model "
          "KEY=VALUE; with no option changed, model.py is wrong here, whatever the contract "
          "check says (it cannot see, e.g., a wrong constant attention scale)")


def mismatch(what, got, want, reference, atol, pinned=False, t_dim=1):
    """The message of a failed torch.allclose(got, want, atol=atol): the property, the largest
    difference, the first position (along t_dim) and batch row where it exceeds atol."""
    d = (got.double() - want.double()).abs()
    over = (d > atol + 1e-5 * want.double().abs()).movedim(t_dim, 0).flatten(1).any(1)
    first = over.nonzero().flatten()
    where = f", first at position {first[0].item()} of {len(over)}" if len(first) else ""
    return (f"{what}: differs from {reference} by {d.max().item():.2e} (max |diff|, atol "
            f"{atol:g}){where}" + (f". {PINNED}" if pinned else ""))
KINDS = [("softmax", "elu"), ("linear", "elu"), ("linear", "relu")]


def tiny(**kw):
    args = dict(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=16)
    args.update(kw)
    torch.manual_seed(0)
    return RoFormer(RoFormerConfig(**args)).eval()


def pair_channels(d, pairs="half"):
    """The channels (a_j, b_j) of each pair j: (j, j + d/2), or (2j, 2j + 1) when adjacent."""
    return [(2 * j, 2 * j + 1) if pairs == "adjacent" else (j, j + d // 2) for j in range(d // 2)]


def rotation_matrix(m, d, base=10000.0, pairs="half"):
    """The (d, d) block rotation R_m in float64: pair j (pair_channels) turns by
    m * base^(-2j/d)."""
    R = torch.zeros(d, d, dtype=torch.float64)
    for j, (a, b) in enumerate(pair_channels(d, pairs)):
        angle = m * base ** (-2 * j / d)
        c, s = math.cos(angle), math.sin(angle)
        R[a, a], R[a, b] = c, -s
        R[b, a], R[b, b] = s, c
    return R


def reference_forward(model, idx, window=None):
    """The whole model written out naively in float64: explicit rotation matrices, explicit
    masks (causal, and banded to `window` positions if given), eq. 19 as a double sum."""
    c = model.config
    W = {k: v.double() for k, v in model.state_dict().items()}
    B, T = idx.shape
    H, D = c.n_head, c.n_embd // c.n_head
    ln = lambda x, p: F.layer_norm(x, (c.n_embd,), W[p + ".weight"], W.get(p + ".bias"))  # noqa
    lin = lambda x, p: x @ W[p + ".weight"].T + (W[p + ".bias"] if p + ".bias" in W else 0)  # noqa
    x = W["wte.weight"][idx]
    if c.pos_encoding == "learned":
        x = x + W["wpe.weight"][:T]
    if c.pos_encoding == "sinusoidal":
        half = c.n_embd // 2
        pe = torch.tensor([[math.sin(m * 10000 ** (-2 * i / c.n_embd)) for i in range(half)] +
                           [math.cos(m * 10000 ** (-2 * i / c.n_embd)) for i in range(half)]
                           for m in range(T)], dtype=torch.float64)
        x = x + 0.02 * math.sqrt(2) * pe  # scaled to the token embeddings' init RMS
    Rs = [rotation_matrix(m, D, c.rope_base, c.rope_pairs) for m in range(T)]
    rot = lambda t: torch.stack([t[:, :, m] @ Rs[m].T for m in range(T)], dim=2)  # noqa
    mpos = torch.arange(T)
    allowed = mpos[:, None] >= mpos[None, :]
    if window is not None:
        allowed &= mpos[:, None] - mpos[None, :] < window
    for i in range(c.n_layer):
        p = f"blocks.{i}."
        qkv = lin(ln(x, p + "ln_1"), p + "attn.c_attn").view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k, v = qkv
        if c.attention == "softmax":
            if getattr(c, "qk_norm", False):  # each head's query and key: float64 mean 0, RMS 1
                q, k = ((t - t.mean(-1, keepdim=True)) / t.var(-1, unbiased=False, keepdim=True)
                        .add(1e-5).sqrt() for t in (q, k))
            if c.pos_encoding == "rope":
                q, k = rot(q), rot(k)
            if getattr(c, "value_residual", False):  # layer 0's values v0, mixed in: gate / 2
                v0 = v if i == 0 else v0
                v = v if i == 0 else v + (v0 - v) * W[p + "attn.v_mix"] / 2
            att = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            y = att.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        else:
            y = naive_eq19(q, k, v, c.feature_map, c.pos_encoding == "rope", c.rope_base,
                           pairs=c.rope_pairs)
        x = x + lin(y.transpose(1, 2).reshape(B, T, c.n_embd), p + "attn.c_proj")
        h = lin(ln(x, p + "ln_2"), p + "mlp.c_fc")
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        x = x + lin(h, p + "mlp.c_proj")
    return ln(x, "ln_f") @ W["wte.weight" if getattr(c, "tie_embeddings", True) else
                             "lm_head.weight"].T


def naive_eq19(q, k, v, feature_map="elu", rope=True, base=10000.0, eps=1e-6, guard=0.25,
               pairs="half"):
    """RoFormer eq. 19, causal, one position at a time, float64, with the model's guard on the
    denominator (guard=0: eq. 19 as printed): max(den, guard * bound), where bound =
    sum_n sum_pairs (a_i + a_j)(b_i + b_j) >= |every numerator weight|, a = phi(q_m),
    b = phi(k_n), (i, j) the pairs the rotation turns. Without rotation there is no guard."""
    q, k, v = q.double(), k.double(), v.double()
    phi = (lambda t: F.elu(t) + 1) if feature_map == "elu" else F.relu
    fq, fk = phi(q), phi(k)
    T, D = q.size(2), q.size(3)
    first, second = map(list, zip(*pair_channels(D, pairs)))
    Rs = [rotation_matrix(m, D, base, pairs) if rope else torch.eye(D, dtype=torch.float64)
          for m in range(T)]
    rq = torch.stack([fq[:, :, m] @ Rs[m].T for m in range(T)], 2)
    rk = torch.stack([fk[:, :, m] @ Rs[m].T for m in range(T)], 2)
    out = torch.zeros(*q.shape[:3], v.size(-1), dtype=torch.float64)
    for m in range(T):
        w = (rq[:, :, m:m + 1] * rk[:, :, :m + 1]).sum(-1)          # (B, H, m+1)
        den = (fq[:, :, m:m + 1] * fk[:, :, :m + 1]).sum(-1).sum(-1)  # (B, H)
        a, b = fq[:, :, m:m + 1], fk[:, :, :m + 1]
        bound = ((a[..., first] + a[..., second]) * (b[..., first] + b[..., second])).sum(-1).sum(-1)
        if rope:
            den = torch.maximum(den, guard * bound)
        out[:, :, m] = (w[..., None] * v[:, :, :m + 1]).sum(2) / (den[..., None] + eps)
    return out


def eq19_denominator_ratio(q, k, feature_map):
    """Per position: eq. 19's denominator over the bound on its numerator (float64)."""
    phi = (lambda t: F.elu(t) + 1) if feature_map == "elu" else F.relu
    a, b = phi(q.double()), phi(k.double()).cumsum(2)  # sum over n <= m of phi(k_n)
    h = q.size(-1) // 2
    bound = ((a[..., :h] + a[..., h:]) * (b[..., :h] + b[..., h:])).sum(-1)
    return (a * b).sum(-1) / bound


def cached_logits(model, idx, split):
    """Prefill idx[:, :split], then feed the rest one token at a time; the logits of every
    position, as generate() sees them."""
    cache = model.new_cache(idx.size(1), idx.device)
    out = [model(idx[:, :split], cache=cache, start_pos=0)[0]]
    for t in range(split, idx.size(1)):
        out.append(model(idx[:, t:t + 1], cache=cache, start_pos=t)[0])
    return torch.cat(out, dim=1)


# --- RoPE ---------------------------------------------------------------------------------

def test_rope_table_matches_float64_at_large_positions():
    pos = torch.tensor([0, 1, 4095, 10 ** 5, 123457, 10 ** 6, 10 ** 7 + 3])
    d = 64
    cos, sin = rope_table(pos, d)  # full width, laid out for apply_rope: [c, c], [-s, s]
    assert cos.dtype == torch.float32 and cos.shape == sin.shape == (len(pos), d)
    for r, m in enumerate(pos.tolist()):
        for i in range(d // 2):
            a = m * 10000.0 ** (-2 * i / d)
            for j, sign in ((i, -1), (i + d // 2, 1)):
                assert abs(cos[r, j].item() - math.cos(a)) < 1e-6
                assert abs(sin[r, j].item() - sign * math.sin(a)) < 1e-6


def test_rope_preserves_norm_and_scores_depend_on_offset_only():
    torch.manual_seed(0)
    d = 64
    q, k = torch.randn(d), torch.randn(d)
    rot = lambda x, m: apply_rope(x[None], *rope_table(torch.tensor([m]), d))[0]  # noqa
    for m in [0, 7, 1000, 123456, 10 ** 6]:
        assert torch.allclose(rot(q, m).norm(), q.norm(), rtol=1e-5)
    # <R_m q, R_n k> = <R_(m-n) q, k> for m >= n, offsets up to 10^6
    for m, n in [(5, 2), (1000, 0), (10 ** 5 + 17, 10 ** 5), (10 ** 6, 10 ** 6 - 1234),
                 (10 ** 6, 3), (10 ** 6, 10 ** 6)]:
        lhs = rot(q, m) @ rot(k, n)
        rhs = rot(q, m - n) @ k
        assert abs(lhs - rhs) / rhs.abs().clamp_min(1e-3) < 1e-4, (m, n)


@pytest.mark.parametrize("pairs", ["half", "adjacent"])
def test_rope_matches_explicit_rotation_matrix(pairs):
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.float64)
    pos = torch.tensor([0, 3, 77, 5000, 65536])
    got = apply_rope(x, *rope_table(pos, 8), pairs)
    want = torch.stack([rotation_matrix(m, 8, pairs=pairs) @ x[i]
                        for i, m in enumerate(pos.tolist())])
    assert got.dtype == torch.float64 and torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_adjacent_pairs_compiled_form_is_the_complex_product(dtype):
    """Compiled, apply_rope writes adjacent pairs' turn out as sums (inductor has no complex
    kernels); eager, one complex product. Both must give the same numbers, in x's dtype, the
    angles never rounded to bf16, and the same gradient (q, k of every layer train through it)."""
    torch.manual_seed(0)
    cos, sin = rope_table(torch.arange(7) + 1000, 12)
    x = torch.randn(2, 3, 7, 16, dtype=dtype, requires_grad=True)  # 12 turn, 4 pass
    eager = apply_rope(x, cos, sin, "adjacent")
    (g_eager,) = torch.autograd.grad(eager.double().square().sum(), x)
    with mock.patch("torch.compiler.is_compiling", lambda: True):
        sums = apply_rope(x, cos, sin, "adjacent")
    (g_sums,) = torch.autograd.grad(sums.double().square().sum(), x)
    assert eager.dtype == sums.dtype == dtype
    assert torch.equal(eager[..., 12:], x[..., 12:])
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert (eager.double() - sums.double()).abs().max() <= tol
    assert (g_eager.double() - g_sums.double()).abs().max() <= 10 * tol
    want = torch.stack([torch.block_diag(rotation_matrix(m, 12, pairs="adjacent"),
                                         torch.eye(4, dtype=torch.float64)) @ x[..., i, :].double()
                        .unsqueeze(-1) for i, m in enumerate(range(1000, 1007))], -3).squeeze(-1)
    tables = 1e-6  # the float32 tables' own rounding, whatever x's dtype
    assert (eager.double() - want).abs().max() <= max(4 * tol, tables) * want.abs().max()


def neox_order(D, r):
    """Where each half-split channel comes from in the adjacent layout: pair j is (2j, 2j + 1)
    there and (j, j + r/2) here; channels past r pass."""
    return [2 * j if j < r // 2 else 2 * (j - r // 2) + 1 if j < r else j for j in range(D)]


@pytest.mark.parametrize("fields", [dict(), dict(rotary_fraction=0.5),
                                    dict(attention="linear"),
                                    dict(attention="linear", feature_map="relu",
                                         rotary_fraction=0.5)])
def test_adjacent_and_half_pairs_are_one_model_up_to_a_channel_permutation(fields):
    """The two conventions differ by a fixed permutation of each head's q and k channels: the
    same permutation of both leaves every score q . k as it was. An adjacent model's c_attn with
    its q and k rows reordered (here by hand; formats/hf.py's neox_state, which both exports
    write from) is a half model with the same logits, in float64, cached decoding too."""
    from formats.hf import neox_state
    adj = tiny(rope_pairs="adjacent", n_embd=32, **fields).double()
    half = tiny(rope_pairs="half", n_embd=32, **fields).double()
    H, D, C = 2, 16, 32
    state = {k: v.clone() for k, v in adj.state_dict().items()}
    for i in range(2):
        w = state[f"blocks.{i}.attn.c_attn.weight"].view(3, H, D, C)
        w[:2] = w[:2, :, neox_order(D, adj.config.rotary_dim)].clone()
    half.load_state_dict(state)
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    want = adj(idx, start_pos=5)[0]
    assert (half(idx, start_pos=5)[0] - want).abs().max() < 1e-12
    cached = cached_logits(half, idx, split=4) - cached_logits(adj, idx, split=4)
    assert cached.abs().max() < 1e-12
    half.load_state_dict({k: v.double() for k, v in neox_state(adj).items()})
    assert (half(idx, start_pos=5)[0] - want).abs().max() < 1e-5  # neox_state is float32


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_adjacent_pairs_train_as_half_pairs_do(optimizer):
    """The default moved to adjacent pairs for speed alone: from a half model's weights with each
    head's q and k reordered, an adjacent model takes the same steps to the same losses (AdamW
    is elementwise, Muon's orthogonalisation commutes with a permutation of rows, weight decay
    and clipping see the same norms), so neither layout trains better; their random inits, drawn
    alike and i.i.d., are equally likely."""
    half, adj = tiny(rope_pairs="half", n_embd=32), tiny(rope_pairs="adjacent", n_embd=32)
    state = {k: v.clone() for k, v in half.state_dict().items()}
    back = [neox_order(16, 16).index(j) for j in range(16)]  # half -> adjacent channels
    for i in range(2):
        w = state[f"blocks.{i}.attn.c_attn.weight"].view(3, 2, 16, 32)
        w[:2] = w[:2, :, back].clone()
    adj.load_state_dict(state)
    idx = torch.randint(0, 61, (4, 17), generator=torch.Generator().manual_seed(4))
    losses = []
    for m in (half.train(), adj.train()):
        opt, curve = build_optimizer(m, 3e-3, 0.1, name=optimizer), []
        for _ in range(6):
            loss = m(idx[:, :-1], idx[:, 1:])[1]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        losses.append(curve)
    assert losses[0][-1] < losses[0][0] - 0.05  # it trained
    assert max(abs(a - b) for a, b in zip(*losses)) < 1e-5, losses


def test_checkpoints_from_before_rope_pairs_load_as_half_pairs(tmp_path):
    """model_args written before the key existed pair (i, i + d/2): harness/load.py's read, every
    reader's, says so, and the weights give the logits they gave."""
    from harness.load import read
    old = tiny(rope_pairs="half")
    args = {k: v for k, v in vars(old.config).items() if k != "rope_pairs"}
    torch.save({"model_args": args, "model": old.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = read(str(tmp_path / "ckpt.pt"))
    assert ckpt["model_args"]["rope_pairs"] == "half"
    new = RoFormer(RoFormerConfig(**ckpt["model_args"])).eval()
    new.load_state_dict(ckpt["model"])
    idx = torch.randint(0, 61, (1, 10))
    assert torch.equal(new(idx)[0], old(idx)[0])
    assert RoFormerConfig(**args).rope_pairs == "adjacent"  # what a new run gets


def test_rope_tables_stay_float32_and_out_of_state_dict():
    m = tiny()
    assert "rope_cos" not in m.state_dict() and "rope_sin" not in m.state_dict()
    m = m.to(torch.bfloat16)  # casts every float buffer, but the tables stay float32
    idx = torch.randint(0, 61, (1, 16))
    m(idx)
    assert m.rope_cos.dtype == torch.float32
    cos, sin = rope_table(torch.arange(16), 8)
    assert torch.equal(m.rope_cos[:16], cos)
    # A round trip must not leave bf16-rounded tables behind in float32 clothing (they used
    # to come back ~4e-3 off, the right dtype, so nothing rebuilt them).
    m = tiny().to(torch.bfloat16).float()
    assert torch.equal(m.rope_cos[:16], cos) and torch.equal(m.rope_sin[:16], sin)
    s = tiny(pos_encoding="sinusoidal")
    table = s.sin_emb.clone()
    assert torch.equal(s.to(torch.bfloat16).double().float().sin_emb, table)


def test_rope_scaling_variants():
    d, f = 16, 4.0
    pos = torch.tensor([0, 10, 1000])
    lin_cos, _ = rope_table(pos, d, scaling="linear", factor=f)
    ref_cos, _ = rope_table(torch.tensor([0]), d)
    # position interpolation: position m under factor f is position m/f unscaled
    assert torch.allclose(lin_cos[1, :d // 2], torch.cos(torch.tensor(
        [10 / f * 10000.0 ** (-2 * i / d) for i in range(d // 2)])), atol=1e-6)
    ntk_cos, _ = rope_table(pos, d, scaling="ntk", factor=f)
    base = 10000.0 * f ** (d / (d - 2))
    assert abs(ntk_cos[2, -1].item() - math.cos(1000 * base ** (-(d - 2) / d))) < 1e-6
    assert abs(ntk_cos[2, 0].item() - math.cos(1000.0)) < 1e-6  # highest frequency unchanged
    assert torch.equal(ref_cos[0], lin_cos[0])


# --- the whole model against the naive float64 forward ----------------------------------

@pytest.mark.parametrize("attention,fmap", KINDS)
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_forward_matches_reference(attention, fmap, pos_encoding):
    m = tiny(attention=attention, feature_map=fmap, pos_encoding=pos_encoding, linear_chunk=5)
    idx = torch.randint(0, 61, (2, 16))
    got, want = m(idx)[0].double(), reference_forward(m, idx)
    assert torch.allclose(got, want, atol=1e-4), mismatch(
        f"forward ({attention}, {fmap}, {pos_encoding})", got, want,
        "the float64 reference forward", 1e-4, pinned=True)


@pytest.mark.parametrize("pos_encoding", ["rope", "learned", "none"])
def test_qk_norm_matches_reference_and_its_cache(pos_encoding):
    """qk_norm=True: every head's query and key at mean 0 and RMS 1 (LayerNorm without a gain, eps
    1e-5) before RoPE turns it, as the float64 reference does; it changes the model (at init q
    and k are far from RMS 1), and the cached step gives the uncached logits."""
    m = tiny(qk_norm=True, pos_encoding=pos_encoding)
    idx = torch.randint(0, 61, (2, 16))
    got, ref = m(idx)[0].double(), reference_forward(m, idx)
    assert torch.allclose(got, ref, atol=1e-4), mismatch(
        f"qk_norm forward ({pos_encoding})", got, ref, "the float64 reference forward", 1e-4)
    assert not torch.allclose(got, tiny(pos_encoding=pos_encoding)(idx)[0].double(), atol=1e-3)
    want = torch.stack([m(idx[:, :t + 1])[0][:, -1] for t in range(16)], dim=1)
    cached = cached_logits(m, idx, split=5)
    assert torch.allclose(cached, want, atol=1e-5), mismatch(
        f"qk_norm cached decoding ({pos_encoding})", cached, want, "the uncached forwards", 1e-5)
    with pytest.raises(ValueError, match="qk_norm=True normalises .* attention='linear'"):
        RoFormerConfig(qk_norm=True, attention="linear")


@pytest.mark.parametrize("pos_encoding", ["rope", "learned"])
def test_value_residual_matches_reference_and_its_cache(pos_encoding):
    """value_residual=True: each layer after the first attends with v + (v0 - v) g / 2, v0 the
    first layer's values of the same tokens and g the layer's gate, as the float64 reference
    does (gates drawn away from their init of 1, so each is read); gates at 0 give the plain
    model's logits exactly; the cached step gives the uncached logits."""
    m = tiny(value_residual=True, pos_encoding=pos_encoding, n_layer=3)
    assert [b.attn.v_mix is None for b in m.blocks] == [True, False, False]
    with torch.no_grad():
        for b in m.blocks[1:]:
            b.attn.v_mix.uniform_(-1.0, 3.0)
    idx = torch.randint(0, 61, (2, 16))
    got = m(idx)[0].double()
    assert torch.allclose(got, reference_forward(m, idx), atol=1e-4)
    plain = tiny(pos_encoding=pos_encoding, n_layer=3)  # same seed: the weights they share
    assert not torch.allclose(got, plain(idx)[0].double(), atol=1e-3)
    want = torch.stack([m(idx[:, :t + 1])[0][:, -1] for t in range(16)], dim=1)
    assert torch.allclose(cached_logits(m, idx, split=5), want, atol=1e-5)
    with torch.no_grad():
        for b in m.blocks[1:]:
            b.attn.v_mix.zero_()
    assert torch.equal(m(idx)[0], plain(idx)[0])
    with pytest.raises(ValueError, match="value_residual=True mixes .* attention='linear'"):
        RoFormerConfig(value_residual=True, attention="linear")


@pytest.mark.parametrize("attention,fmap", KINDS)
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_causality(attention, fmap, pos_encoding):
    m = tiny(attention=attention, feature_map=fmap, pos_encoding=pos_encoding, linear_chunk=4)
    idx = torch.randint(0, 61, (1, 16))
    base = m(idx)[0]
    for t in [0, 5, 11, 15]:
        changed = idx.clone()
        changed[0, t] = (changed[0, t] + 1) % 61
        out = m(changed)[0]
        assert torch.equal(out[:, :t], base[:, :t]), mismatch(
            f"causality ({attention}, {fmap}, {pos_encoding}): with token {t} changed, the "
            f"logits before it", out[:, :t], base[:, :t], "the unchanged forward's", 0)
        assert not torch.allclose(out[:, t], base[:, t]), \
            f"causality: changing token {t} left its own logit unchanged (vacuous check)"


# --- linear attention -----------------------------------------------------------------

@pytest.mark.parametrize("fmap", ["elu", "relu"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 16, 64])
def test_linear_chunked_equals_naive_eq19(fmap, chunk):
    torch.manual_seed(1)
    B, H, N, D = 2, 3, 37, 8
    q, k, v = torch.randn(B, H, N, D), torch.randn(B, H, N, D), torch.randn(B, H, N, 6)
    cos, sin = rope_table(torch.arange(N), D)
    got, _ = linear_attention(q, k, v, cos, sin, fmap, chunk)
    assert got.dtype == torch.float32
    want = naive_eq19(q, k, v, fmap)
    assert torch.allclose(got.double(), want, atol=1e-5), mismatch(
        f"eq. 19 (linear_attention, chunk {chunk}, {fmap})", got, want,
        "the naive float64 double sum", 1e-5, t_dim=2)


def test_linear_recurrent_decoding_equals_chunked():
    torch.manual_seed(2)
    B, H, N, D = 2, 2, 29, 8
    q, k, v = torch.randn(B, H, N, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    cos, sin = rope_table(torch.arange(N), D)
    full, (S, z) = linear_attention(q, k, v, cos, sin, chunk=8)
    state, outs = None, []
    # a 5-token prefill, then one token at a time
    for a, b in [(0, 5)] + [(t, t + 1) for t in range(5, N)]:
        o, state = linear_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], cos[a:b], sin[a:b],
                                    chunk=8, state=state)
        outs.append(o)
    got = torch.cat(outs, 2)
    assert torch.allclose(got, full, atol=1e-5), mismatch(
        "eq. 19 recurrent (a 5-token prefill, then one token per call)", got, full,
        "the chunked kernel over the whole sequence", 1e-5, t_dim=2)
    assert torch.allclose(state[0], S, atol=1e-4) and torch.allclose(state[1], z, atol=1e-4), \
        (f"eq. 19 recurrent state: S differs by {(state[0] - S).abs().max():.2e}, z by "
         f"{(state[1] - z).abs().max():.2e} from the chunked kernel's final state (atol 1e-4)")
    assert state[0].shape == (B, H, D, D)  # constant size, whatever N was


def test_linear_gradcheck():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 1, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cos, sin = rope_table(torch.arange(6), 4)
    fn = lambda q, k, v: linear_attention(q, k, v, cos.double(), sin.double(), chunk=4)[0]  # noqa
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_linear_state_stays_float32_under_bf16_autocast():
    m = tiny(attention="linear")
    idx = torch.randint(0, 61, (1, 8))
    cache = m.new_cache(8, idx.device)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(idx, cache=cache, start_pos=0)
    S, z = cache.state[0]
    assert S.dtype == torch.float32 and z.dtype == torch.float32


def test_eq19_weights_are_not_convex():
    """The documented property of eq. 19: rotation only above the line means the weights on
    the values do not sum to one; their sum shrinks with context length."""
    torch.manual_seed(0)
    N, D = 1024, 64
    q, k = torch.randn(1, 1, N, D), torch.randn(1, 1, N, D)
    v = torch.ones(1, 1, N, 1)  # output = sum of the weights
    out, _ = linear_attention(q, k, v, *rope_table(torch.arange(N), D))
    assert abs(out[0, 0, 0, 0] - 1.0) < 1e-4
    assert out[0, 0, -64:, 0].mean() < 0.45


def test_eq19_relu_zero_denominator_stays_bounded():
    """Issue 20 item 7: RoPE pairs channel i with i + d/2, so a relu query on channel 0 and
    keys on channel d/2 make eq. 19's denominator exactly 0 while the rotated numerator is
    not (the output was sin(1) / 1e-6 = 841470.9). The guard keeps every output within
    max|v| / GUARD, chunked and recurrent alike, and equals the float64 guarded formula."""
    import model as M
    D, N = 8, 12
    q = torch.full((1, 1, N, D), -1.0)
    k = torch.full((1, 1, N, D), -1.0)
    q[..., 0], k[..., D // 2] = 1.0, 1.0
    v = torch.randn(1, 1, N, 3)
    cos, sin = rope_table(torch.arange(N), D)
    chunked, _ = linear_attention(q, k, v, cos, sin, "relu", chunk=5)
    state, steps = None, []
    for t in range(N):
        o, state = linear_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                    cos[t:t + 1], sin[t:t + 1], "relu", state=state)
        steps.append(o)
    for out in (chunked, torch.cat(steps, 2)):
        assert out.isfinite().all()
        assert out.abs().max() <= v.abs().max() / M.GUARD + 1e-6
        assert out.abs().max() > 0  # the numerator really is there
        assert torch.allclose(out.double(), naive_eq19(q, k, v, "relu"), atol=1e-5)


@pytest.mark.parametrize("fmap", ["elu", "relu"])
def test_eq19_output_is_bounded_on_any_input(fmap):
    """The guard's promise on inputs scaled to put the features near 0 or far apart."""
    import model as M
    torch.manual_seed(4)
    for scale in (0.1, 3.0, 30.0):
        q, k = scale * torch.randn(2, 2, 40, 8), scale * torch.randn(2, 2, 40, 8)
        v = torch.randn(2, 2, 40, 4)
        out, _ = linear_attention(q, k, v, *rope_table(torch.arange(40), 8), fmap, chunk=7)
        assert out.isfinite().all() and out.abs().max() <= v.abs().max() / M.GUARD + 1e-5


@pytest.mark.parametrize("fmap", ["elu", "relu"])
def test_linear_is_eq19_as_printed_where_the_denominator_is_not_small(fmap):
    """Random inputs: wherever eq. 19's denominator is well above GUARD times the bound on its
    numerator (most positions), the output is exactly eq. 19 without any guard."""
    import model as M
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 3, 37, 8), torch.randn(2, 3, 37, 8), torch.randn(2, 3, 37, 6)
    got, _ = linear_attention(q, k, v, *rope_table(torch.arange(37), 8), fmap, chunk=8)
    away = eq19_denominator_ratio(q, k, fmap) > 1.2 * M.GUARD
    assert away.float().mean() > 0.9
    want = naive_eq19(q, k, v, fmap, guard=0.0)
    assert torch.allclose(got.double()[away], want[away], atol=1e-5)


# --- decoding -----------------------------------------------------------------------

@pytest.mark.parametrize("attention,fmap", KINDS)
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_cached_logits_equal_uncached_inside_block(attention, fmap, pos_encoding):
    m = tiny(attention=attention, feature_map=fmap, pos_encoding=pos_encoding, linear_chunk=4)
    idx = torch.randint(0, 61, (2, 16))
    got = cached_logits(m, idx, split=5)
    want = torch.stack([m(idx[:, :t + 1])[0][:, -1] for t in range(16)], dim=1)
    assert torch.allclose(got, want, atol=1e-5), mismatch(
        f"cached decoding ({attention}, {fmap}, {pos_encoding}; a 5-token prefill, then one "
        f"token per step)",
        got, want, "the uncached forwards", 1e-5)


@pytest.mark.parametrize("pos_encoding", ["rope", "sinusoidal", "none"])
def test_rolling_cache_is_sliding_window_attention(pos_encoding):
    """3x past block_size with 2 layers: the cached logits equal a full forward over the whole
    sequence with a banded causal mask of width block_size (and not crop-and-recompute)."""
    m = tiny(pos_encoding=pos_encoding, block_size=8)
    idx = torch.randint(0, 61, (1, 24))
    got = cached_logits(m, idx, split=3)
    want = reference_forward(m, idx, window=8)
    assert torch.allclose(got.double(), want, atol=1e-4), mismatch(
        f"rolling cache ({pos_encoding}; a 3-token prefill, then one token per step)", got, want,
        "the float64 reference with a causal mask banded to 8", 1e-4, pinned=True)
    # one chunked prefill of the whole sequence (wider than the buffer) is the same thing
    prefill = m(idx, cache=m.new_cache(24, idx.device), start_pos=0)[0].double()
    assert torch.allclose(prefill, want, atol=1e-4), mismatch(
        f"rolling cache, one 24-token prefill ({pos_encoding})", prefill, want,
        "the float64 reference with a causal mask banded to 8", 1e-4, pinned=True)
    # crop and recompute differs for n_layer > 1: at init by little, but far above float32's
    # rounding of these logits (~1e-7)
    crop = m(idx[:, -8:])[0][:, -1]
    assert (crop - got[:, -1]).abs().max() > 1e-5


def test_a_long_window_builds_no_table_until_a_position_needs_it():
    """A yarn factor of 1e4 made the model build cos/sin for its whole 160k-position window at
    construction (1e6: 100 GB); the tables now cover block_size and grow with the positions a
    forward runs, to the same values."""
    m = tiny(rope_scaling="yarn", rope_factor=1e4)
    assert m.rope_cos.size(0) == 16
    m(torch.randint(0, 61, (1, 40)))
    cos, sin = rope_table(torch.arange(40), 8, 10000.0, "yarn", 1e4, 16)
    assert torch.equal(m.rope_cos[:40], cos) and torch.equal(m.rope_sin[:40], sin)


def test_rope_forward_past_block_size_grows_table():
    m = tiny(block_size=8)
    idx = torch.randint(0, 61, (1, 20))
    got, want = m(idx)[0].double(), reference_forward(m, idx)
    assert torch.allclose(got, want, atol=1e-4), mismatch(
        "forward past block_size 8", got, want, "the float64 reference forward", 1e-4,
        pinned=True)
    assert m.rope_cos.size(0) >= 20


def test_cache_slots_are_never_rewritten():
    m = tiny(block_size=16)
    idx = torch.randint(0, 61, (1, 16))
    cache = m.new_cache(16, idx.device)
    m(idx[:, :4], cache=cache, start_pos=0)
    for t in range(4, 16):
        before = [(k.clone(), v.clone()) for k, v in zip(cache.keys, cache.values)]
        m(idx[:, t:t + 1], cache=cache, start_pos=t)
        for layer, (k0, v0) in enumerate(before):
            k1, v1 = cache.keys[layer], cache.values[layer]
            assert torch.equal(k1[:, :, :t], k0[:, :, :t]) and torch.equal(v1[:, :, :t], v0[:, :, :t])
            assert not torch.equal(k1[:, :, t], k0[:, :, t])  # the new key did land at slot t


def test_cache_update_is_one_call_per_layer_returning_what_it_attends_to():
    """Issue 36: KVCache.update(layer, k, v, pos) alone (no earlier call per forward) returns
    the keys and values each query sees, identified by the positions it returns: exactly the
    last `window` positions up to the query's own (naive reference), and each layer's slots
    are its own (layer 1 updated only every other chunk)."""
    from caches import KVCache
    size = window = 6
    cache, p, fed = KVCache(2, size, window, "cpu"), 0, []  # fed: the positions layer 1 got
    for i, n in enumerate([4, 1, 1, 5, 1, 9, 2]):
        pos = torch.arange(p, p + n)
        k = pos.double().view(1, 1, n, 1).expand(1, 1, n, 2)  # a key holds its own position
        for layer in ([0, 1] if i % 2 == 0 else [0]):
            keys, values, key_pos, visible = cache.update(layer, k, k + 0.5, pos)
            assert torch.equal(values[..., visible.any(0), :], keys[..., visible.any(0), :] + 0.5)
            for q in range(n):
                seen = sorted(keys[0, 0, visible[q], 0].long().tolist())
                want = [m for m in range(pos[q] + 1) if pos[q] - m < window]
                if layer == 1:  # only the chunks it was given
                    want = [m for m in want if m in fed + pos.tolist()]
                assert seen == want and torch.equal(key_pos[visible[q]].sort().values,
                                                    torch.tensor(seen))
        fed += pos.tolist() if i % 2 == 0 else []
        p += n


@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("chunks", [[3, 4, 1, 6], [5, 9, 10]])
def test_chunked_prefill_into_nonempty_cache_equals_token_by_token(attention, chunks):
    """[5, 9, 10] with block_size 8 forces chunks that wrap the rolling buffer."""
    m = tiny(attention=attention, block_size=8 if chunks[0] == 5 else 16, linear_chunk=4)
    T = sum(chunks)
    idx = torch.randint(0, 61, (2, T))
    one_by_one = cached_logits(m, idx, split=1)
    cache = m.new_cache(T, idx.device)
    out, p = [], 0
    for n in chunks:
        out.append(m(idx[:, p:p + n], cache=cache, start_pos=p)[0])
        p += n
    assert torch.allclose(torch.cat(out, 1), one_by_one, atol=1e-5)


def test_generate_cached_equals_uncached_and_fresh_calls_are_independent():
    m = tiny(block_size=32)
    prompt = torch.randint(0, 61, (2, 5))
    for kw in [dict(temperature=0), dict(temperature=1.0, top_k=10), dict(top_p=0.9)]:
        a = generate(m, prompt, 20, use_cache=True, generator=torch.Generator().manual_seed(1),
                     **kw)
        b = generate(m, prompt, 20, use_cache=False, generator=torch.Generator().manual_seed(1),
                     **kw)
        assert torch.equal(a, b), kw
    first = generate(m, prompt, 20, temperature=0)
    generate(m, torch.randint(0, 61, (3, 9)), 11, temperature=0)  # other shapes and content
    assert torch.equal(generate(m, prompt, 20, temperature=0), first)


def test_generate_past_block_size_any_length():
    for attention in ["softmax", "linear"]:
        m = tiny(attention=attention, block_size=8)
        out = generate(m, torch.randint(0, 61, (1, 3)), 40, temperature=0)
        assert out.shape == (1, 43)
    with pytest.raises(ValueError, match="learned"):
        generate(tiny(pos_encoding="learned", block_size=8), torch.zeros(1, 3, dtype=torch.long),
                 20)
    # the crop-and-recompute loop serves learned positions at any length
    assert generate(tiny(pos_encoding="learned", block_size=8),
                    torch.zeros(1, 3, dtype=torch.long), 20, use_cache=False).shape == (1, 23)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("scaling", ["linear", "ntk"])
def test_rope_scaling_extends_the_decoding_window(scaling, use_cache):
    """Issue 20 item 1: with rope_factor F the window is block_size * F everywhere. A 70-token
    prompt and 40 greedy tokens on a block-32 model with F=4 (window 128 > 110): cached and
    uncached decoding equal greedy decoding by plain full-sequence forwards (nothing cropped,
    nothing evicted). It used to crop and roll at 32."""
    m = tiny(block_size=32, rope_scaling=scaling, rope_factor=4.0)
    with torch.no_grad():  # weights large enough that every token of the context matters
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    prompt = torch.randint(0, 61, (2, 70))
    want = prompt
    with torch.no_grad():
        for _ in range(40):
            want = torch.cat((want, m(want)[0][:, -1:].argmax(-1)), dim=1)
    assert torch.equal(generate(m, prompt, 40, temperature=0, use_cache=use_cache), want)


def test_rope_scaling_window_rolls_past_the_extended_window():
    """Past block_size * F the cache is a sliding window of block_size * F positions: with one
    layer (and RoPE's distance-only scores) that is the full forward over the last 128
    tokens, for every position up to 150."""
    m = tiny(block_size=32, rope_scaling="ntk", rope_factor=4.0, n_layer=1)
    idx = torch.randint(0, 61, (1, 150))
    with torch.no_grad():
        got = cached_logits(m, idx, split=20)
        want = torch.stack([m(idx[:, max(0, t - 127):t + 1])[0][:, -1] for t in range(150)], 1)
    assert (got - want).abs().max() < 1e-4
    assert m.new_cache(1000, "cpu").slot_pos.size(-1) == 128


def test_learned_positions_decode_a_full_block_prompt_and_one_token():
    """Issue 20 item 8: the last sampled token is never fed back, so a block_size prompt and
    one new token (or block_size - 1 and two) need no position past the table."""
    m = tiny(pos_encoding="learned", block_size=8)
    prompt = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        first = m(prompt)[0][:, -1:].argmax(-1)
    assert torch.equal(generate(m, prompt, 1, temperature=0), torch.cat((prompt, first), 1))
    out = generate(m, prompt[:, :7], 2, temperature=0)
    assert torch.equal(out[:, -1:], m(out[:, :-1])[0][:, -1:].argmax(-1))
    with pytest.raises(ValueError, match="learned"):
        generate(m, prompt, 2, temperature=0)


def test_the_longest_input_is_one_rule_the_callers_share():
    """Issue 36: learned positions end at the rows of wpe (the reference); forward and
    decode.check_request accept exactly that many positions and refuse one more in one line
    naming block_size (model_checks.positions_error, the one rule); the encodings whose tables
    grow have no end (here, three times block_size)."""
    from decode import check_request
    for pe in POS_ENCODINGS + ["t5"]:
        m = tiny(pos_encoding=pe, block_size=8)
        limit = m.wpe.num_embeddings if pe == "learned" else None
        n = limit or 24
        with torch.no_grad():
            assert m(torch.zeros(1, n, dtype=torch.long))[0].isfinite().all()
        check_request(m, torch.zeros(1, n, dtype=torch.long), 1, True, False)
        if limit:
            for call in (lambda: m(torch.zeros(1, n + 1, dtype=torch.long)),
                         lambda: check_request(m, torch.zeros(1, n, dtype=torch.long), 2, True,
                                               False)):
                with pytest.raises(ValueError, match=r"^learned positions end at block_size=8"
                                                     r"[^\n]*$"):
                    call()


# --- sampling ---------------------------------------------------------------------------

def test_top_k_and_top_p_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 20)
    probs = logits.softmax(-1)[0]
    g = torch.Generator().manual_seed(0)
    draws = lambda **kw: {sample_next(logits, generator=g, **kw).item() for _ in range(3000)}  # noqa
    assert draws(top_k=5) == set(logits[0].topk(5).indices.tolist())
    # nucleus by hand: the smallest prefix of the sorted tokens whose mass reaches p
    order = probs.argsort(descending=True).tolist()
    nucleus, mass = set(), 0.0
    for t in order:
        nucleus.add(t)
        mass += probs[t].item()
        if mass >= 0.7:
            break
    assert draws(top_p=0.7) == nucleus
    assert draws(top_k=0, top_p=1.0) == set(range(20))
    assert sample_next(logits, temperature=0).item() == logits.argmax().item()


def test_sampling_argument_validation():
    m = tiny()
    idx = torch.zeros(1, 2, dtype=torch.long)
    for kw, word in [(dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top_k"),
                     (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")]:
        with pytest.raises(ValueError, match=word):
            generate(m, idx, 3, **kw)


@pytest.mark.parametrize("kw,word", [
    (dict(n_embd=30, n_head=4), "divisible"),
    (dict(n_embd=12, n_head=4), "even"),           # head dim 3
    (dict(attention="flash"), "attention"),
    (dict(feature_map="softplus"), "feature_map"),
    (dict(pos_encoding="xpos"), "pos_encoding"),
    (dict(rope_scaling="dynamic"), "rope_scaling"),
    (dict(block_size=0), "block_size"),
    (dict(dropout=1.0), "dropout"),
    # issue 20 item 9: a factor needs a scaling, and scaling needs RoPE
    (dict(rope_factor=2.0), "needs rope_scaling"),
    (dict(pos_encoding="learned", rope_scaling="ntk", rope_factor=2.0), "has none"),
    (dict(pos_encoding="alibi", rope_scaling="linear"), "has none"),
    (dict(pos_encoding="none", rope_factor=4.0), "has none"),
    # issue 28: ntk's base * factor^(d/(d-2)) divided by zero at head dim 2
    (dict(n_embd=4, n_head=2, rope_scaling="ntk", rope_factor=2.0), "above 2"),
    # issue 35 item 7: inf trained a degenerate rotation and exported "rope_theta": Infinity;
    # huge factors ended in OverflowError (NTK's raised base, the window's int)
    (dict(rope_base=float("inf")), "rope_base must be finite"),
    (dict(rope_base=float("nan")), "rope_base must be finite"),
    (dict(rope_scaling="linear", rope_factor=float("inf")), "rope_factor finite"),
    (dict(rope_scaling="ntk", rope_factor=1e300), "too large"),
    (dict(rope_scaling="yarn", rope_factor=1e300), "too large"),
])
def test_config_validation(kw, word):
    args = dict(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8)
    args.update(kw)
    with pytest.raises(ValueError, match=word):
        RoFormerConfig(**args)
    if kw == dict(n_embd=12, n_head=4):  # an odd head dim is fine without RoPE
        RoFormerConfig(**{**args, "pos_encoding": "learned"})
    if kw == dict(rope_factor=2.0):  # with a scaling the factor is what extends the window
        assert RoFormerConfig(**{**args, "rope_scaling": "ntk"}).context_window == 16


# The checkpoint format: every encoding's state_dict keys, as models written before the
# rebuild saved them (checked against the old model.py when this list was written).
COMMON_KEYS = {"wte.weight", "lm_head.weight", "ln_f.weight"} | {
    f"blocks.{i}.{name}.weight" for i in range(2)
    for name in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
EXTRA_KEYS = {"learned": {"wpe.weight"}, "t5": {"rel_bias.weight"},
              "shaw": {"blocks.0.attn.rel_k.weight", "blocks.1.attn.rel_k.weight"}}


@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS + ["shaw", "t5", "alibi"])
def test_state_dict_keys_are_the_checkpoint_format(pos_encoding):
    for attention in ["softmax", "linear"]:
        if attention == "linear" and pos_encoding in ("shaw", "t5", "alibi"):
            continue
        m = tiny(pos_encoding=pos_encoding, attention=attention)
        assert set(m.state_dict()) == COMMON_KEYS | EXTRA_KEYS.get(pos_encoding, set()), PINNED
        with_bias = tiny(pos_encoding=pos_encoding, attention=attention, bias=True)
        extra = set(with_bias.state_dict()) - set(m.state_dict())
        assert extra == {k[:-len("weight")] + "bias" for k in COMMON_KEYS
                         if k.startswith(("blocks", "ln_f"))}, PINNED


def test_untied_head_is_its_own_matrix_and_matches_the_float64_reference():
    """tie_embeddings=False: lm_head a parameter of its own, drawn by the one init rule
    (normal 0.02) from its own stream, so the rest of the model starts as the tied one does;
    logits are the naive forward with that head; num_params (non-embedding: what harness/mfu.py
    counts) drops the untied wte lookup and keeps the head."""
    tied, m = tiny(), tiny(tie_embeddings=False)
    assert m.lm_head.weight is not m.wte.weight and not torch.equal(m.lm_head.weight,
                                                                    m.wte.weight)
    head = m.lm_head.weight.detach()
    assert abs(head.std().item() - 0.02) < 0.003 and abs(head.mean().item()) < 0.003
    for (k, a), b in zip(tied.state_dict().items(), m.state_dict().values()):
        assert k == "lm_head.weight" or torch.equal(a, b), k
    assert list(m.state_dict()) == list(tied.state_dict())
    idx = torch.randint(0, 61, (2, 16))
    assert torch.allclose(m(idx)[0].double(), reference_forward(m, idx), atol=1e-4)
    with torch.no_grad():
        m.lm_head.weight.mul_(2)  # the head alone changes the logits; wte is untouched
    assert torch.equal(m.wte.weight, tied.wte.weight)
    assert torch.allclose(m(idx)[0].double(), reference_forward(m, idx), atol=1e-4)
    V, C = 61, 16
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in tied.parameters()) \
        + V * C
    assert m.num_params() == tied.num_params()
    assert m.num_params() == sum(p.numel() for n, p in m.named_parameters() if n != "wte.weight")
    # the same matmuls per token: the head's, once (a lookup in wte costs no FLOPs)
    assert flops_per_token(m.config, m.num_params(), 16) == flops_per_token(
        tied.config, tied.num_params(), 16)


INIT_ARGS = dict(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=True)


@pytest.mark.parametrize("other", [dict(pos_encoding="learned"), dict(tie_embeddings=False),
                                   dict(pos_encoding="shaw")])
def test_a_parameter_starts_from_the_seed_and_its_name_only(other):
    """Issue 45: seeds pair two arms only if every parameter they share starts equal. With one
    stream drawn parameter by parameter, an extra table (wpe, an untied head) moved most of the
    others. Reference: the two configurations' parameters, name by name; another seed moves
    every random one; by torch's global seed (RoFormer(cfg)) they pair as well; each follows
    the rule's spread (0.02, c_proj 0.02 / sqrt(2 n_layer))."""
    base, alt = RoFormerConfig(**INIT_ARGS), RoFormerConfig(**{**INIT_ARGS, **other})
    for seed in (0, 1337):
        a, b = (dict(RoFormer(c, seed=seed).named_parameters()) for c in (base, alt))
        torch.manual_seed(seed)
        g = dict(RoFormer(alt).named_parameters())
        torch.manual_seed(seed)
        h = dict(RoFormer(base).named_parameters())
        shared = a.keys() & b.keys()
        assert shared == a.keys() - {"lm_head.weight"} and len(b) > len(shared)
        for name in shared:
            assert torch.equal(a[name], b[name]), name
            assert torch.equal(g[name], h[name]), name
    other_seed = dict(RoFormer(base, seed=1).named_parameters())
    for name, p in RoFormer(base, seed=0).named_parameters():
        if p.dim() > 1:
            std = 0.02 / math.sqrt(2 * base.n_layer) if name.endswith("c_proj.weight") else 0.02
            assert abs(p.std().item() / std - 1) < 0.15, name
            assert not torch.equal(p, other_seed[name]), name


@pytest.mark.parametrize("other", [{}, dict(pos_encoding="learned"), dict(tie_embeddings=False)])
def test_the_meta_device_build_draws_the_eager_builds_weights(other):
    """harness/build.py (meta device, memory, then init_weights) against RoFormer(cfg, seed):
    every tensor equal, the tie as configured."""
    from harness.build import build_model
    cfg = RoFormerConfig(**{**INIT_ARGS, **other})
    eager = RoFormer(cfg, seed=1337)
    built = build_model(cfg, 1337, "cpu")[0]
    want, got = eager.state_dict(), built.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert (built.lm_head.weight is built.wte.weight) == cfg.tie_embeddings


def test_tied_and_untied_weights_load_only_where_they_fit():
    """A tied model given an untied model's weights would load lm_head over wte (the last key
    copied wins): an error naming tie_embeddings instead. An untied model needs lm_head.weight;
    a tied model's weights (both keys, equal) load into it and give the same logits."""
    tied, untied = tiny(), tiny(tie_embeddings=False)
    with pytest.raises(RuntimeError, match="tie_embeddings") as e:
        tiny().load_state_dict(untied.state_dict())
    assert len(str(e.value).splitlines()) == 2  # torch's header, our line (harness/load.misfit)
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        tiny(tie_embeddings=False).load_state_dict(
            {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"})
    copy = tiny(tie_embeddings=False)
    copy.load_state_dict(tied.state_dict())
    again = tiny()
    again.load_state_dict(tied.state_dict())  # a tied checkpoint into a tied model, unchanged
    idx = torch.randint(0, 61, (2, 16))
    assert torch.equal(copy(idx)[0], tied(idx)[0]) and torch.equal(again(idx)[0], tied(idx)[0])


# --- position designs (issue 38) ------------------------------------------------------

def designs_reference(model, idx):
    """The softmax RoPE model with issue 38's position fields written out naively in float64,
    layer by layer: a rotation matrix on each head's first r channels (none on NoPE layers;
    local layers at local_rope_base, unscaled; linear scaling divides the others' m), a banded
    mask on local layers, queries times 1 + t ln(max(1, (m + 1) / L))."""
    c = model.config
    W = {k: v.double() for k, v in model.state_dict().items()}
    (B, T), H, D = idx.shape, c.n_head, c.n_embd // c.n_head
    r, every = int(D * c.rotary_fraction), lambda k, i: k and (i + 1) % k == 0  # noqa: E731
    ln = lambda x, p: F.layer_norm(x, (c.n_embd,), W[p + ".weight"])  # noqa: E731
    lin = lambda x, p: x @ W[p + ".weight"].T  # noqa: E731
    m = torch.arange(T)
    dist = m[:, None] - m[None, :]
    temp = 1 + c.length_temperature * torch.log(((m + 1) / c.original_context).clamp(min=1))
    x = W["wte.weight"][idx]
    for i in range(c.n_layer):
        local = c.window and not every(c.global_every, i)
        base = (c.local_rope_base or c.rope_base) if local else c.rope_base
        scale = c.rope_factor if c.rope_scaling == "linear" and not local else 1.0
        R = [torch.block_diag(rotation_matrix(t / scale, r, base, c.rope_pairs), torch.eye(D - r,
             dtype=torch.float64)) if not every(c.nope_every, i) else
             torch.eye(D, dtype=torch.float64) for t in range(T)]
        p = f"blocks.{i}."
        q, k, v = lin(ln(x, p + "ln_1"), p + "attn.c_attn").view(B, T, 3, H, D).permute(
            2, 0, 3, 1, 4)
        q = torch.stack([q[:, :, t] @ R[t].T * temp[t] for t in range(T)], 2)
        k = torch.stack([k[:, :, t] @ R[t].T for t in range(T)], 2)
        allowed = (dist >= 0) & ((dist < c.window) if local else True)
        att = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, float("-inf"))
        x = x + lin((att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1), p + "attn.c_proj")
        h = lin(ln(x, p + "ln_2"), p + "mlp.c_fc")
        x = x + lin(0.5 * h * (1 + torch.erf(h / math.sqrt(2))), p + "mlp.c_proj")
    return ln(x, "ln_f") @ W["wte.weight"].T


@pytest.mark.parametrize("fields", [
    dict(rotary_fraction=0.5), dict(rotary_fraction=0.25, rope_base=100.0),
    dict(nope_every=2), dict(nope_every=1),
    dict(window=3), dict(window=3, global_every=2, local_rope_base=50.0),
    dict(window=4, global_every=3, rope_scaling="linear", rope_factor=2.0),
    dict(length_temperature=0.5),
    dict(rotary_fraction=0.5, nope_every=3, window=5, global_every=2, local_rope_base=30.0,
         length_temperature=0.3)])
def test_position_designs_match_a_naive_float64_reference(fields):
    """Past the original context (8) too: the length temperature acts only there."""
    m = tiny(n_layer=3, n_embd=32, block_size=32, rope_original=8, **fields).double()
    idx = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))
    want = designs_reference(m, idx)
    assert (m(idx)[0] - want).abs().max() < 1e-9
    assert (m(idx, cache=m.new_cache(20, "cpu"))[0] - want).abs().max() < 1e-9  # one chunk
    assert (cached_logits(m, idx, split=5) - want).abs().max() < 1e-9  # token by token


def test_partial_rotary_turns_the_first_r_channels_by_their_own_frequencies():
    """rotary_fraction: theta_i = base^(-2i/r) on channels i, i + r/2 < r; the rest pass."""
    x = torch.randn(5, 16, dtype=torch.float64)
    cos, sin = rope_table(torch.arange(5), 8, 500.0)
    got = apply_rope(x.float(), cos, sin).double()
    for t in range(5):
        R = torch.block_diag(rotation_matrix(t, 8, 500.0), torch.eye(8, dtype=torch.float64))
        assert (got[t] - R @ x[t]).abs().max() < 1e-5


def test_position_design_defaults_leave_todays_model_and_old_checkpoints_as_they_were():
    """model_args written before issue 38 (no such keys) build today's default model."""
    new = ("rotary_fraction", "nope_every", "window", "global_every", "local_rope_base",
           "length_temperature")
    args = dict(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=16)
    old = RoFormerConfig(**args)
    assert all(getattr(old, f) == RoFormerConfig.__dataclass_fields__[f].default for f in new)
    m, idx = tiny(), torch.randint(0, 61, (1, 16))
    assert m.config == old and all(b.attn.rotates and not b.attn.window for b in m.blocks)
    got, want = m(idx)[0].double(), reference_forward(m, idx)
    assert torch.allclose(got, want, atol=1e-5), mismatch(
        "forward at every new field's default", got, want, "the float64 reference forward",
        1e-5, pinned=True)


@pytest.mark.parametrize("kw,field", [
    (dict(rotary_fraction=0.3), "rotary_fraction"), (dict(rotary_fraction=0.0), "rotary_fraction"),
    (dict(rotary_fraction=0.125), "rotary_fraction"),  # 1 channel of 8: no pair
    (dict(rotary_fraction=0.5, pos_encoding="alibi"), "rotary_fraction"),
    (dict(nope_every=2, pos_encoding="none"), "nope_every"), (dict(nope_every=-1), "nope_every"),
    (dict(window=-2), "window"), (dict(global_every=2), "global_every"),
    (dict(local_rope_base=100.0), "local_rope_base"),
    (dict(window=4, local_rope_base=0.5), "local_rope_base"),
    (dict(window=4, attention="linear"), "window"),
    (dict(length_temperature=0.1, attention="linear"), "length_temperature"),
    (dict(length_temperature=-1.0), "length_temperature"),
    (dict(rope_scaling="ntk", rope_factor=2.0, rotary_fraction=0.25), "rotary dim"),
])
def test_position_design_mistakes_are_one_line_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field) as e:
        RoFormerConfig(**{**dict(vocab_size=10, block_size=8, n_layer=2, n_head=2, n_embd=16),
                          **kw})
    assert "\n" not in str(e.value)
    if kw.get("attention") == "linear":  # the one field set, not both
        assert ({"window", "length_temperature"} - {field}).pop() not in str(e.value)


@pytest.mark.parametrize("value,channels", [(-0.5, -4), (1.5, 12), (0.3, 2.4),
                                            (float("nan"), 0), (float("inf"), 0)])
def test_a_rotary_fraction_refusal_names_the_fraction_given(value, channels):
    """Issue 45: -0.5 was reported as "got -16", the channels it would rotate (the head dim
    here is 8, so those are 8 x the fraction); inf ended in an OverflowError."""
    with pytest.raises(ValueError) as e:
        RoFormerConfig(vocab_size=10, block_size=8, n_layer=2, n_head=2, n_embd=16,
                       rotary_fraction=value)
    msg = str(e.value)
    assert f"rotary_fraction={value:g}" in msg or f"got {value!r}" in msg, msg
    in_range = 0 < value <= 1  # then the channel count is the reason, and named as such
    assert (f"got {channels:g}" in msg) == in_range and "\n" not in msg, msg


@pytest.mark.parametrize("kw,said", [
    (dict(nope_every=5), "nope_every=5 changes nothing: a 2-layer model has no layer 5"),
    (dict(nope_every=3), "nope_every=3 changes nothing"),
    (dict(window=16), "window=16 changes nothing: every layer already sees the whole context "
     "window of 16"),
    (dict(window=1000), "window=1000 changes nothing"),
    (dict(window=40, rope_scaling="linear", rope_factor=2.0), "window=40 changes nothing"),
    (dict(window=4, global_every=1), "window=4 changes nothing with global_every=1")])
def test_a_design_that_changes_nothing_is_refused_in_one_line(kw, said):
    """Issue 45: these trained plain RoPE, which the exports then refused. One line naming the
    key, its value and why."""
    with pytest.raises(ValueError) as e:
        RoFormerConfig(**{**dict(vocab_size=10, block_size=16, n_layer=2, n_head=2, n_embd=16),
                          **kw})
    assert str(e.value).startswith(said) and "\n" not in str(e.value), e.value


@pytest.mark.parametrize("kw", [dict(nope_every=2), dict(window=15),
                                dict(window=20, rope_scaling="linear", rope_factor=2.0),
                                dict(window=4, global_every=2)])
def test_the_edges_of_those_refusals_build_and_act(kw):
    """Their neighbours still act inside the context window: the last layer rotating nothing,
    a window one short of the block, a window past the block but inside a scaled context
    window (32), every other layer global: the logits differ from plain RoPE's."""
    plain = {k: v for k, v in kw.items() if k.startswith("rope_")}
    a, b = tiny(**kw, bias=True), tiny(**plain, bias=True)
    idx = torch.randint(0, 61, (1, a.config.context_window),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in (*a.parameters(), *b.parameters()):  # off the init: logits that use context
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        assert (a(idx)[0] - b(idx)[0]).abs().max() > 1e-3


# --- training -------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_overfits_a_fixed_batch(attention):
    torch.manual_seed(0)
    m = RoFormer(RoFormerConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=32,
                                attention=attention))
    idx = torch.randint(0, 32, (4, 33))
    opt = build_optimizer(m, 3e-3, 0.0)
    first = None
    for _ in range(150):
        _, loss = m(idx[:, :-1], idx[:, 1:])
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.0 and loss.item() < 0.5 * first


def test_sinusoidal_table_has_the_embeddings_init_scale():
    """The baseline's fixed table must not drown the token embeddings (init std 0.02)."""
    m = tiny(pos_encoding="sinusoidal", n_embd=64, block_size=512)
    table = m(torch.zeros(1, 512, dtype=torch.long))[0]  # exercises the forward path too
    from baselines import sinusoidal_embedding
    rms = sinusoidal_embedding(torch.arange(512), 64).pow(2).mean().sqrt().item()
    tok = m.wte.weight.pow(2).mean().sqrt().item()
    assert table.isfinite().all() and 0.5 < rms / tok < 2.0


def test_sinusoidal_table_is_built_once_not_per_forward(monkeypatch):
    """Like RoPE's cos/sin, the baseline's table is a buffer built with the model and moved
    with it. Rebuilding it inside forward meant a float64 CPU computation and a host-to-device
    copy on every GPU step, and a break in the compiled graph. The cached table still equals
    the formula (reference_forward writes it out), also once decoding grows it."""
    import baselines as B
    m = tiny(pos_encoding="sinusoidal")
    built = []
    real = B.sinusoidal_embedding
    monkeypatch.setattr(B, "sinusoidal_embedding", lambda *a: built.append(a) or real(*a))
    idx = torch.randint(0, 61, (2, 16))
    logits = m(idx)[0]
    m(idx)
    assert built == []  # two forwards, no rebuild
    torch.testing.assert_close(logits.double(), reference_forward(m, idx), atol=1e-5, rtol=1e-4,
                               msg=lambda m: f"{m}\n{PINNED}")
    generate(m, idx[:1, :4], 40, temperature=0, use_cache=True)  # positions past block_size
    # issue 35: no longer grown to the whole generation; the step's rows slide in place (at
    # positions 16 and 32), slot p % 16 holding position p, up to 42, the last one fed
    assert len(built) == 2 and m.sin_emb.size(0) == 16
    naive = torch.tensor([math.sin(42 * 10000 ** (-2 * i / 16)) for i in range(8)])
    torch.testing.assert_close(m.sin_emb[42 % 16, :8], (0.02 * math.sqrt(2) * naive).float())


def test_params_and_flops():
    m = tiny(pos_encoding="learned")
    n = sum(p.numel() for p in m.parameters())
    assert n == sum(p.numel() for _, p in m.named_parameters(remove_duplicate=False)) - 61 * 16
    assert m.num_params() == n - 16 * 16  # less wpe; the tied head counted once, as the head
    assert flops_per_token(m.config, m.num_params(), 16) > 6 * m.num_params()


def test_a_wrong_model_fails_naming_the_property_and_the_position():
    """Issue 60: these tests failed as `AssertionError: 5` or `assert False`, and the float64
    reference's message pointed only at the contract check, as if only a new option could make
    it fail. Attention that doubles its values (the contract check does not see that either: it
    is a reparametrisation of c_attn), and a mask that sees the next token, each fail naming the
    property, the distance and the first position."""
    import model as M

    def functional(sdpa):  # model.py's F with another SDPA; the references keep torch's
        return mock.patch.object(M, "F", type("F", (), {
            "__getattr__": lambda self, name: getattr(F, name),
            "scaled_dot_product_attention": staticmethod(sdpa)})())
    real = F.scaled_dot_product_attention
    with functional(lambda q, k, v, *a, **kw: real(q, k, 2 * v, *a, **kw)), \
            pytest.raises(AssertionError) as failure:
        test_forward_matches_reference("softmax", "elu", "rope")
    said = str(failure.value)
    assert said.startswith("forward (softmax, elu, rope): differs from the float64 reference "
                           "forward by ") and ", first at position 0 of 16" in said, said
    assert "with no option changed, model.py is wrong here" in said, said

    def look_ahead(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(1)
        return real(q, k, v, mask if is_causal else attn_mask, dropout_p, **kw)
    with functional(look_ahead), pytest.raises(AssertionError) as failure:
        test_causality("softmax", "elu", "rope")
    assert str(failure.value).startswith("causality (softmax, elu, rope): with token 5 changed, "
                                         "the logits before it: differs from the unchanged "
                                         "forward's by "), failure.value
    # two layers, each seeing one token ahead: position 3 reads 4, which read token 5
    assert ", first at position 3 of 5" in str(failure.value), str(failure.value)[:300]
