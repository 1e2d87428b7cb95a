"""The contract every correct causal decoder keeps, whatever its architecture: the one check
that judges a new model option (the float64 reference tests in test_model.py pin today's
architecture instead). Run it on any configuration:

    python -m pytest -q tests/test_contract.py --model mlp=swiglu --model qk_norm=True

Each property is a plain function check_<property>(cfg, model_factory) (check_options_act
also takes the --model overrides) that raises
AssertionError naming the property; model_factory(cfg) builds the model (RoFormer, or one of
the deliberately broken variants at the end, which prove each check can fail). The checks
use the public API only: RoFormer(cfg), forward(idx, targets) -> (logits, loss), and the
decoding primitives decode.py drives (new_cache, prefill, the one-token step)."""
import contextlib
import dataclasses
import io
import inspect
import json
import math
import os
import pickle
import shutil
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode as decoding  # noqa: E402
import model as model_module  # noqa: E402
from model import RoFormer  # noqa: E402

TOL = 1e-6  # on float64 logits of order 1: a real difference is orders of magnitude larger
# bf16 against float32, as a fraction of the float32 scale (max |logit|, the gradient's norm):
# bf16 keeps 8 significant bits (2^-9 relative per rounding), and a logit passes a few dozen
# roundings whose errors add like a random walk, a few per cent at most (docs/HACKING.md);
# a bug (an angle or a sum in bf16, a dtype branch) is off by order one
BF16_TOL = 0.1
# shifted positions read other rows of RoPE's float32 tables (model.py: cos and sin rounded to
# 2^-24): the logits move by float32 rounding carried through the layers, far below a bug's
SHIFT_TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # tiny models: a second thread only waits, more so on a shared CPU
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The two paths a forward takes. Checks run only under no_grad missed a kernel that leaked the
# future only while gradients were on (docs: PITFALLS, checks that look but do not see), and the
# training path is the one that learns: the forward properties run on both.
PATHS = {"inference": "on the inference path (eval mode, no_grad)",
         "training": "on the training path (train mode, gradients on)"}


def build_on(cfg, model_factory, path, **kw):
    """build() for one path; on the training path dropout is off (two forwards compared would
    draw different masks) and the model is in train mode. Run it under on_path(path)."""
    if path == "training":
        cfg = dataclasses.replace(cfg, dropout=0.0)
    return build(cfg, model_factory, **kw).train(path == "training")


def on_path(path):
    return torch.set_grad_enabled(path == "training")


def build(cfg, model_factory=RoFormer, seed=0, dtype=torch.float64, spread=0.2):
    """A model in eval mode whose every parameter is moved off its init by noise of std
    `spread`: at init (std 0.02, zero biases, unit norms) logits barely depend on the context,
    and a zero-initialised new parameter would switch its own path off."""
    torch.manual_seed(seed)
    model = model_factory(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * spread)
    return model.eval()


def tokens(cfg, B, T, seed=1):
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def windows(cfg):
    """How far the model sees, for messages: "window" alone is never the context window
    (block_size, or its RoPE extension), so that it can mean an attention window, named
    too where the configuration has one (a `window` field)."""
    attention = getattr(cfg, "window", 0)
    return f"context window {cfg.context_window}" + \
        (f", attention window {attention}" if attention else "")


def max_diff(a, b):
    return (a - b).abs().max().item()


@torch.no_grad()
def cached_logits(model, idx, split):
    """Logits at positions split-1 .. T-1 as decode.py computes them: the first split tokens
    prefilled (in chunks of the context window), then the rest fed one token per cached step."""
    total = idx.size(1)
    cache = model.new_cache(total, idx.device)
    out = [decoding.prefill(model, idx[:, :split], cache,
                            min(total, model.config.context_window))]
    model.hold_positions(0, total)
    step = decoding.one_token_step(model, cache, False, idx.device)
    pos = torch.full((1,), split, dtype=torch.long, device=idx.device)
    for t in range(split, total):
        out.append(step(idx[:, t:t + 1], pos))
        pos += 1
    return torch.stack(out, dim=1)


@contextlib.contextmanager
def wrapped_sdpa(wrap):
    """Every F.scaled_dot_product_attention call made inside goes through wrap(real)."""
    with mock.patch.object(F, "scaled_dot_product_attention",
                           wrap(F.scaled_dot_product_attention)):
        yield


def banded(window, calls):
    """The reference for the rolling cache: full-sequence attention (queries and keys at the
    same positions 0..T-1) whose causal mask is banded to the last `window` positions."""
    def wrap(real):
        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *a, **kw):
            i = torch.arange(q.size(-2), device=q.device)[:, None]
            j = torch.arange(k.size(-2), device=q.device)[None, :]
            band = (i >= j) & (i - j < window)
            if attn_mask is None:
                attn_mask = band
            elif attn_mask.dtype == torch.bool:
                attn_mask = attn_mask & band
            else:
                attn_mask = attn_mask.masked_fill(~band, float("-inf"))
            calls.append(q.size(-2))
            return real(q, k, v, attn_mask, dropout_p, False, *a, **kw)
        return sdpa
    return wrap


# --- the properties ----------------------------------------------------------------------

def observable(cfg, model_factory):
    """What a model option can change, on seed-0 weights: the parameters' names and shapes,
    eval logits past the context window (inside it where the model stops there) by a full
    forward and by the cached path, and a train-mode forward (dropout) under a fixed seed."""
    model = build(cfg, model_factory)
    seen = [sorted((n, tuple(p.shape)) for n, p in model.state_dict().items())]
    idx = tokens(cfg, 2, 2 * cfg.context_window + 7)
    with torch.no_grad():
        try:
            seen += [model(idx)[0], cached_logits(model, idx, 3)]
        except ValueError:  # a documented refusal past the context window (learned positions)
            idx = idx[:, :cfg.block_size]
            seen += [model(idx)[0], cached_logits(model, idx, 3)]
        torch.manual_seed(0)
        seen += list(model.train()(idx[:, :cfg.block_size], idx[:, :cfg.block_size]))
    return seen


def check_options_act(cfg, overrides, model_factory=RoFormer):
    """Each --model KEY=VALUE changes the model: its parameters, or one of the outputs
    `observable` compares bit for bit (an option that only reorders float sums acts)."""
    from conftest import CONTRACT_BASE
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    want = observable(cfg, model_factory)
    for key, value in overrides.items():
        without = CONTRACT_BASE.get(key, defaults[key])
        if value == without:
            continue  # the base's own value: nothing to act
        try:
            other = dataclasses.replace(cfg, **{key: without})
        except ValueError:  # the other options need it: it is not inert on its own
            continue
        got = observable(other, model_factory)
        same = got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))
        assert not same, (f"inert option: --model {key}={value!r} changes nothing at the "
                          f"check's size ({cfg.n_layer} layers, {windows(cfg)}): the same "
                          f"parameters and logits as {key}={without!r}, so the other checks "
                          f"never exercise it")


@torch.no_grad()
def check_eval_determinism(cfg, model_factory=RoFormer):
    """With dropout on (0.5 if the configuration has none), eval mode gives the same logits
    under any RNG state, full forward and cached path alike, and train mode does not. Checked
    first: dropout left on in eval otherwise shows up as a causality failure."""
    cfg = dataclasses.replace(cfg, dropout=cfg.dropout or 0.5)
    model = build(cfg, model_factory)
    idx = tokens(cfg, 2, min(cfg.block_size, 20))
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        runs.append((model.eval()(idx)[0], cached_logits(model, idx, 3), model.train()(idx)[0]))
    for i, path in enumerate(("full forward", "cached path")):
        d = max_diff(runs[0][i], runs[1][i])
        assert d == 0, (f"eval determinism: two eval-mode {path}s with dropout={cfg.dropout} "
                        f"differ (max |diff| {d:.2e}): dropout is active in eval mode")
    assert not torch.equal(runs[0][2], runs[1][2]), \
        f"eval determinism: train mode with dropout={cfg.dropout} is deterministic too (vacuous)"


def check_causality(cfg, model_factory=RoFormer, path="inference"):
    """Changing token t changes no logit before t (and does change the one at t). On the
    training path the backward too: the loss on the targets before t gives the token
    embeddings at t and after no gradient (a backward can see the future where the forward
    does not)."""
    model = build_on(cfg, model_factory, path)
    T = min(cfg.block_size, 24)
    idx = tokens(cfg, 2, T)
    with on_path(path):
        base = model(idx)[0]
        for t in sorted({0, 1, T // 3, T // 2, T - 2, T - 1}):
            changed = idx.clone()
            changed[:, t] = (changed[:, t] + 1 + torch.arange(2)) % cfg.vocab_size
            out = model(changed)[0]
            for s in range(t):
                d = max_diff(out[:, s], base[:, s])
                assert d <= TOL, (f"causality: logit at position {s} changed when token {t} "
                                  f"changed (max |diff| {d:.2e}) {PATHS[path]}")
            assert max_diff(out[:, t], base[:, t]) > TOL, (f"causality: changing token {t} left "
                                                           f"its own logit unchanged (vacuous "
                                                           f"check) {PATHS[path]}")
            if path == "training" and t > 0:
                gradient_causality(model, idx, t)


def gradient_causality(model, idx, t):
    """The training loss on the targets at positions < t: its gradient at each position's
    token embedding (wte's output, before anything else sees it) is zero from t on."""
    seen = []
    hook = model.wte.register_forward_hook(lambda mod, inp, out: seen.append(out), prepend=True)
    try:
        targets = idx.roll(-1, 1)
        targets[:, t:] = -1  # ignored: only positions before t make the loss
        _, loss = model(idx, targets)
    finally:
        hook.remove()
    grad = torch.autograd.grad(loss, seen[0])[0].norm(dim=(0, 2))  # (T,): per position
    past = grad[:t].max().item()
    assert past > 0, (f"causality: the loss on the targets before position {t} has no gradient "
                      f"at any embedding before it (vacuous check) {PATHS['training']}")
    leak = grad[t:].max().item()
    assert leak <= TOL * past, (
        f"causality: the loss on the targets before position {t} has a gradient at the "
        f"embedding of token {t + int(grad[t:].argmax())} (norm {leak:.2e}, {leak / past:.1e} of "
        f"the earlier ones') {PATHS['training']}: the backward sees the future")


def absolute_positions(cfg):
    """Why logits may depend on absolute positions, None if only on distances. A new option
    that makes them depend on absolute position by design adds itself here."""
    if cfg.pos_encoding in ("learned", "sinusoidal"):
        return f"pos_encoding={cfg.pos_encoding!r} encodes absolute positions"
    if getattr(cfg, "length_temperature", 0):
        return "length_temperature scales each query by its position past the trained context"
    return None


def check_shift_invariance(cfg, model_factory=RoFormer, path="inference"):
    """Relative encodings (RoPE, shaw, t5, alibi, none): the same tokens at positions shifted
    by a constant give the same logits (a value rotated by its position breaks this). A
    wrong constant attention scale keeps it, and every other property here: it is a
    reparametrisation of the query weights, caught only against a reference (test_model.py's
    float64 forward, the exports)."""
    if absolute_positions(cfg):
        pytest.skip(f"shift invariance: {absolute_positions(cfg)}")
    model = build_on(cfg, model_factory, path)
    idx = tokens(cfg, 2, min(cfg.block_size, 20))
    with on_path(path):
        base = model(idx)[0]
        for shift in (1, 1000):
            d = max_diff(model(idx, start_pos=shift)[0], base)
            assert d <= SHIFT_TOL, (f"shift invariance: the logits changed when every position "
                                    f"moved by {shift} (max |diff| {d:.2e}) {PATHS[path]}, "
                                    f"though a relative encoding sees only distances")


def rotated(x, pos, base, adjacent):
    """The paper's rotation in float64, pair by pair: pair i of each head (channels i, i + d/2;
    adjacent: 2i, 2i + 1) at position m turns by m theta_i, theta_i = base^(-2i/d)."""
    d = x.size(-1)
    pairs = [(2 * i, 2 * i + 1) if adjacent else (i, i + d // 2) for i in range(d // 2)]
    out = x.clone()
    for i, (a, b) in enumerate(pairs):
        angle = pos.double()[:, None] * base ** (-2 * i / d)  # (T, 1): one angle per position
        c, s = angle.cos(), angle.sin()
        out[..., a], out[..., b] = x[..., a] * c[:, 0] - x[..., b] * s[:, 0], \
            x[..., b] * c[:, 0] + x[..., a] * s[:, 0]
    return out


def check_rope_rotation(cfg, model_factory=RoFormer, path="inference"):
    """Plain RoPE (the default position design): the q and k every layer hands to
    F.scaled_dot_product_attention are c_attn's q and k (channels [q | k | v], heads of d in
    order; with qk_norm, each at mean 0 and RMS 1 first) rotated by the paper's angles m theta_i,
    theta_i = rope_base^(-2i/d), in every head, at positions from 0 and from 1000, against a
    float64 rotation written pair by pair (either pairing convention). A wrong angle in some heads
    keeps every other property here."""
    plain = dict(pos_encoding="rope", attention="softmax", rope_scaling="none",
                 rotary_fraction=1.0, nope_every=0, window=0, length_temperature=0.0)
    changed = [k for k, v in plain.items() if getattr(cfg, k, v) != v]
    if changed:
        pytest.skip(f"rope rotation: checked on plain RoPE only ({', '.join(changed)} differ)")
    model = build_on(cfg, model_factory, path)
    H, d = cfg.n_head, cfg.n_embd // cfg.n_head
    idx = tokens(cfg, 2, min(cfg.block_size, 20))
    inputs, seen = [], []
    hooks = [b.attn.c_attn.register_forward_hook(lambda mod, inp, out: inputs.append(out))
             for b in model.blocks]

    def record(real):
        def sdpa(q, k, v, *a, **kw):
            seen.append((q, k))
            return real(q, k, v, *a, **kw)
        return sdpa
    try:
        for start in (0, 1000):
            with wrapped_sdpa(record), on_path(path):
                model(idx, start_pos=start)
            if len(seen) != len(inputs):
                pytest.skip("rope rotation: the attention does not call "
                            "F.scaled_dot_product_attention once per layer")
            pos = torch.arange(idx.size(1)) + start
            for layer, (qkv, (q, k)) in enumerate(zip(inputs, seen)):
                B, T, _ = qkv.shape
                want = qkv.detach().double().view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)[:2]
                if getattr(cfg, "qk_norm", False):  # turned after the norm: LayerNorm, eps 1e-5
                    want = want - want.mean(-1, keepdim=True)
                    want = want / (want.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
                got = torch.stack((q, k)).detach().double()
                err = min(((got - rotated(want, pos, cfg.rope_base, adj)).abs().amax((0, 1, 3, 4))
                           for adj in (False, True)), key=lambda e: e.max()) / want.abs().max()
                head = int(err.argmax())
                assert err[head] <= 1e-5, (
                    f"rope rotation: layer {layer} head {head}'s q and k at positions from "
                    f"{start} are not c_attn's turned by m theta_i, theta_i = "
                    f"{cfg.rope_base:g}^(-2i/{d}) (max |diff| {err[head]:.2e} of max |q|, |k|) "
                    f"{PATHS[path]}")
            inputs.clear(), seen.clear()
    finally:
        for h in hooks:
            h.remove()


def check_prefix(cfg, model_factory=RoFormer, path="inference"):
    """A forward over the first t tokens gives the first t logits of the longer forward: no
    position's output depends on how many tokens follow (a scale or temperature taken from
    the forward's length breaks this)."""
    model = build_on(cfg, model_factory, path)
    T = min(cfg.block_size, 20)
    idx = tokens(cfg, 2, T)
    with on_path(path):
        base = model(idx)[0]
        for t in sorted({1, 2, T // 2, T - 1}):
            d = max_diff(model(idx[:, :t])[0], base[:, :t])
            assert d <= TOL, (f"prefix: the logits of the first {t} tokens alone differ from "
                              f"those in a {T}-token forward (max |diff| {d:.2e}) {PATHS[path]}")


@torch.no_grad()
def check_cached_decoding(cfg, model_factory=RoFormer):
    """Inside the context window: prefill + one-token cached steps give the full forward's
    logits."""
    model = build(cfg, model_factory)
    T = min(cfg.context_window, 20)
    idx = tokens(cfg, 2, T)
    want = model(idx)[0]
    got = {split: cached_logits(model, idx, split) for split in sorted({1, T // 3, T - 1})}
    bad = first_difference(got, want, "the full forward")
    assert bad is None, f"cached decoding: {bad}"


def first_difference(got, want, reference, where=""):
    """None, or where the cached logits {split: logits at positions split-1..} first differ
    from the reference's `want`: the earliest position over every prefill (a later one is
    often the same bug's echo, as when a cache wraps), and how many of that prefill's positions
    differ."""
    worst = None
    for split, logits in got.items():
        d = (logits - want[:, split - 1:split - 1 + logits.size(1)]).abs().amax((0, 2))
        off = (d > TOL).nonzero().flatten().tolist()
        if off and (worst is None or split - 1 + off[0] < worst[0]):
            worst = (split - 1 + off[0], split, len(off), len(d), d[off[0]].item())
    if worst is not None:
        p, split, n, of, d = worst
        return (f"logit at position {p}{where} differs from {reference} after a {split}-token "
                f"prefill (max |diff| {d:.2e}); {n} of the {of} positions from the prefill's "
                f"last on differ")


@torch.no_grad()
def check_rolling_cache(cfg, model_factory=RoFormer):
    """Past the context window: softmax attention's rolling cache is sliding-window attention, equal
    to a full forward with a causal mask banded to it; linear attention's recurrent
    state never forgets, so there the reference is the plain full forward."""
    model = build(cfg, model_factory)
    W = cfg.context_window
    idx = tokens(cfg, 2, 2 * W + 7)
    calls = []
    try:
        with wrapped_sdpa(banded(W, calls)) if cfg.attention != "linear" else \
                contextlib.nullcontext():
            want = model(idx)[0]
        got = {split: cached_logits(model, idx, split)  # a short prompt, and one longer than
               for split in (3, W + 5)}                  # the context window (a chunked prefill)
    except ValueError as e:  # a documented refusal, e.g. learned positions
        pytest.skip(f"rolling cache: this model does not run past its context window: {e}")
    if cfg.attention != "linear" and not calls:
        pytest.skip("rolling cache: the attention does not call F.scaled_dot_product_attention, "
                    "so no band-masked reference is built")
    bad = first_difference(got, want, f"the {'full' if calls == [] else 'band-masked'} forward",
                           f" ({windows(cfg)})")
    assert bad is None, f"rolling cache: {bad}"


def check_compiled_decoding(cfg, model_factory=RoFormer):
    """generate(compile=True) gives eager's greedy tokens, past the context window where it can."""
    compiler = os.environ.get("CXX") or "g++"
    if not any(shutil.which(c) for c in (compiler, "c++", "clang++")):
        pytest.skip(f"compiled decoding: no C++ compiler ({compiler}) for torch.compile")
    model = build(cfg, model_factory)
    prompt = tokens(cfg, 2, 5)
    new = cfg.context_window + 8
    try:
        want = decoding.generate(model, prompt, new, temperature=0)
    except ValueError:  # no decoding past the context window (learned positions): stay inside it
        new = cfg.block_size - prompt.size(1)
        want = decoding.generate(model, prompt, new, temperature=0)
    torch._dynamo.reset()
    got = decoding.generate(model, prompt, new, temperature=0, compile=True)
    differ = (got != want).any(0).nonzero()
    assert differ.numel() == 0, (f"compiled decoding: the compiled step's greedy token at "
                                 f"position {differ[0].item()} differs from eager's")


def float32_and_bf16(model, idx, start):
    """[(logits, loss, flat gradient)] of one forward and backward in float32, then under
    CPU bf16 autocast (train.py's dtype on a CPU with native bf16)."""
    out = []
    for bf16 in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits, loss = model(idx[:, :-1], idx[:, 1:], start_pos=start)
        loss.backward()
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        out.append((logits.float(), loss.float(), torch.cat(grads)))
    return out


def check_bf16_autocast(cfg, model_factory=RoFormer):
    """Under bf16 autocast a forward and backward stay finite and within BF16_TOL of float32,
    at positions from 0 and from 1000 (where bf16 cannot hold a position: 1001 rounds to
    1000) for a model that runs there."""
    model = build(dataclasses.replace(cfg, dropout=0.0), model_factory, dtype=torch.float32)
    idx = tokens(cfg, 2, cfg.block_size + 1)
    for start in (0, 1000):
        try:
            (logits, _, grad), (low, loss, low_grad) = float32_and_bf16(model, idx, start)
        except ValueError:  # a documented refusal past the context window (learned positions)
            continue
        for what, ref, got, scale in (("logits", logits, low, logits.abs().max()),
                                      ("gradient", grad, low_grad, grad.norm())):
            assert loss.isfinite() and got.isfinite().all(), \
                f"bf16 autocast: the {what} at positions from {start} are not finite"
            err = ((got - ref).abs().max() if what == "logits" else (got - ref).norm()) / scale
            assert err <= BF16_TOL, (f"bf16 autocast: the {what} at positions from {start} "
                                     f"differ from float32 by {err:.0%} of their scale, more "
                                     f"than the {BF16_TOL:.0%} bf16 rounding explains")


def loss_and_gradients(model, idx):
    model.zero_grad()
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return [loss] + [p.grad for p in model.parameters() if p.grad is not None]


def check_compiled_training_step(cfg, model_factory=RoFormer):
    """One torch.compile'd training step (train mode, no dropout: its RNG differs when
    compiled) gives eager's loss and gradients. Backend aot_eager: dynamo and AOTAutograd
    trace the forward and its backward (the joint graph, where compiled training differs
    from the compiled decoding step) and run them with eager's kernels, so float64 results
    match to TOL; inductor's code generation, many times slower to compile, is exercised by
    the compiled decoding check."""
    model = build(dataclasses.replace(cfg, dropout=0.0), model_factory).train()
    idx = tokens(cfg, 2, cfg.block_size + 1)
    want = loss_and_gradients(model, idx)
    torch._dynamo.reset()
    try:
        got = loss_and_gradients(torch.compile(model, backend="aot_eager"), idx)
    except Exception as e:  # dynamo's and AOTAutograd's errors have no common base
        raise AssertionError(f"compiled training step: torch.compile failed: "
                             f"{str(e).strip().splitlines()[0]}") from None
    names = ["the loss"] + [f"{n}'s gradient" for n, p in model.named_parameters()
                            if p.grad is not None]
    for name, a, b in zip(names, want, got):
        d = max_diff(a, b) / max(a.abs().max().item(), 1e-30)
        assert d <= TOL, (f"compiled training step: {name} differs from eager's by {d:.2e} "
                          f"of its scale")


def check_batch_independence(cfg, model_factory=RoFormer, path="inference"):
    """Row i of a batch gets the logits row i gets alone."""
    model = build_on(cfg, model_factory, path)
    idx = tokens(cfg, 3, min(cfg.block_size, 20))
    with on_path(path):
        batch = model(idx)[0]
        for i in range(idx.size(0)):
            d = max_diff(batch[i], model(idx[i:i + 1])[0][0])
            assert d <= TOL, (f"batch independence: row {i}'s logits in a batch of 3 differ from "
                              f"its batch-of-1 forward (max |diff| {d:.2e}) {PATHS[path]}")


def check_gradients(cfg, model_factory=RoFormer):
    """One loss.backward() gives every parameter a finite gradient that is not all zero."""
    model = build(cfg, model_factory).train()
    idx = tokens(cfg, 2, cfg.block_size + 1)
    _, loss = model(idx[:, :-1], idx[:, 1:])
    assert loss is not None and torch.isfinite(loss), f"gradients: the loss is {loss}"
    loss.backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert p.grad is not None, f"gradients: parameter {name} got no gradient (unused?)"
        assert p.grad.isfinite().all(), f"gradients: parameter {name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"gradients: parameter {name}'s gradient is all zero"


@torch.no_grad()
def check_round_trip(cfg, model_factory=RoFormer):
    """state_dict -> torch.save -> torch.load(weights_only=True) -> a fresh model: same logits."""
    model = build(cfg, model_factory)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = build(cfg, model_factory, seed=1)
    try:
        fresh.load_state_dict(torch.load(buf, weights_only=True))
    except (RuntimeError, pickle.UnpicklingError) as e:  # keys, shapes; weights_only refusing
        raise AssertionError(f"state-dict round trip: loading failed: {e}") from None
    idx = tokens(cfg, 2, min(cfg.block_size, 20))
    d = max_diff(fresh(idx)[0], model(idx)[0])
    assert d == 0, f"state-dict round trip: logits changed by {d:.2e} after save and load"


def check_overfit(cfg, model_factory=RoFormer, steps=40):
    """From its own init, the model memorises one tiny batch: AdamW halves the loss."""
    torch.manual_seed(0)
    model = model_factory(cfg).train()
    idx = tokens(cfg, 2, min(cfg.block_size, 16) + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        losses.append(loss.item())
        if losses[-1] < 0.5 * losses[0]:
            return
        opt.zero_grad()
        loss.backward()
        opt.step()
    raise AssertionError(f"overfit: the loss went from {losses[0]:.3f} to {min(losses):.3f} in "
                         f"{steps} AdamW steps on one batch, not below half")


def adversarial_qkv(shape, D, case, gen):
    """c_attn's output (B, T, 3 C) with q and k built to break eq. 19's denominator."""
    B, T, C3 = shape
    qk = torch.empty(B, T, 2, C3 // (3 * D), D)
    n = lambda: torch.randn(qk[:, :, 0].shape, generator=gen)  # noqa: E731
    if case == "large positive":
        qk[:, :, 0], qk[:, :, 1] = 30 * n().abs() + 5, 30 * n().abs() + 5
    elif case == "large negative":  # features ~0 (elu) or exactly 0 (relu)
        qk[:, :, 0], qk[:, :, 1] = -30 * n().abs() - 5, -30 * n().abs() - 5
    elif case == "large mixed":
        qk[:, :, 0], qk[:, :, 1] = 40 * n(), 40 * n()
    elif case == "disjoint supports":  # q's features where k has none, and the reverse
        on = torch.rand(qk[:, :, 0].shape, generator=gen) < 0.5
        qk[:, :, 0] = torch.where(on, n().abs() + 0.1, torch.full_like(n(), -30.0))
        qk[:, :, 1] = torch.where(~on, n().abs() + 0.1, torch.full_like(n(), -30.0))
    else:  # "one channel each": q on channel c, k on c + shift (the pairs a rotation mixes)
        shift = int(case.split()[-1])
        c = torch.randint(0, D, (B, T, 1, qk.size(3), 1), generator=gen)
        ch = torch.arange(D)
        qk[:, :, 0] = torch.where(ch == c[:, :, 0], 1.0, -30.0)
        qk[:, :, 1] = torch.where(ch == (c[:, :, 0] + shift) % D, 1.0, -30.0)
    v = torch.randn(B, T, C3 - qk[0, 0].numel(), generator=gen)
    v = v / v.abs().max()  # every call's max|v| is 1: the bound's max runs over the history
    return torch.cat((qk.reshape(B, T, -1), v), dim=-1)


def linear_attention_calls(model, idx, start, inject, path="inference"):
    """(max|out|, max|v|, finite) of the model.linear_attention calls while the model
    prefills idx at position `start` and takes 3 one-token steps (inference), or runs a
    training forward over idx (training: no cache), each layer's c_attn output replaced by
    inject(shape)."""
    seen, real = [], model_module.linear_attention

    def recorded(q, k, v, *args, **kw):
        out = real(q, k, v, *args, **kw)
        seen.append((out[0].abs().max().item(), v.abs().max().item(),
                     bool(out[0].isfinite().all())))  # .item(): no graph is kept
        return out
    hooks = [b.attn.c_attn.register_forward_hook(lambda mod, inp, out: inject(out.shape)
                                                 .to(out.dtype)) for b in model.blocks]
    try:
        with mock.patch.object(model_module, "linear_attention", recorded), on_path(path):
            if path == "training":
                model(idx, idx, start_pos=start)
                return seen
            T = idx.size(1)
            cache = model.new_cache(start + T + 3, idx.device)
            model(idx, cache=cache, start_pos=start)
            for t in range(3):  # the recurrent path
                model(idx[:, t:t + 1], cache=cache, start_pos=start + T + t)
    finally:
        for h in hooks:
            h.remove()
    return seen


def check_linear_bound(cfg, model_factory=RoFormer, path="inference"):
    """Linear attention's output stays within its stated bound, max|out| <= max|v| / GUARD
    (model.py, eq. 19's guard), on adversarial q and k fed through the model's own attention
    (its feature map, rotation, chunks and recurrent steps), from positions 0 and 1000."""
    if cfg.attention != "linear":
        pytest.skip(f"linear attention bound: attention={cfg.attention!r} is not linear")
    limit = 1.0 / model_module.GUARD
    model = build_on(cfg, model_factory, path, dtype=torch.float32)
    D, gen = cfg.n_embd // cfg.n_head, torch.Generator().manual_seed(0)
    cases = ["large positive", "large negative", "large mixed", "disjoint supports"] + \
        [f"one channel each, shift {s}" for s in sorted({D // 2, D // 4, 1} - {0})]
    idx = tokens(cfg, 2, 3 * cfg.linear_chunk + 1 if cfg.linear_chunk < 8 else 24)
    from model_checks import positions_error  # learned positions cannot start at 1000
    starts = [s for s in (0, 1000) if not positions_error(cfg, s + idx.size(1) + 3)]
    for case in cases:
        for start in starts:
            seen = linear_attention_calls(model, idx, start,
                                          lambda shape: adversarial_qkv(shape, D, case, gen), path)
            if not seen:
                pytest.skip("linear attention bound: the model never called "
                            "model.linear_attention")
            vmax = 0.0  # of the values seen so far: the recurrent state holds older ones
            for out, v, finite in seen:
                vmax = max(vmax, v)
                assert finite and out <= limit * vmax * (1 + 1e-4) + 1e-6, (
                    f"linear attention bound: max|out| = {out:.4g} = {out / max(vmax, 1e-30):.4g}"
                    f" max|v| > {limit:g} max|v| on '{case}' inputs from position {start} "
                    f"(feature_map={cfg.feature_map!r}) {PATHS[path]}")


def check_export(cfg, model_factory, kind, tmp_path):
    """export.refusal(model, kind) refuses in one line, or the export computes our logits."""
    import export
    if "kind" not in inspect.signature(export.refusal).parameters:
        pytest.skip("export.refusal(model, kind) not available")
    model = build(cfg, model_factory, dtype=torch.float32)
    reason = export.refusal(model, kind)
    if reason is not None:
        assert isinstance(reason, str) and reason.strip() and "\n" not in reason.strip(), \
            f"export: the {kind} refusal is not one line naming a reason: {reason!r}"
        return
    idx = tokens(cfg, 2, min(cfg.context_window, 64))
    with torch.no_grad():
        want = model(idx)[0]
        try:
            outputs = (export_hf if kind == "hf" else export_gguf)(model, model_factory,
                                                                   tmp_path, idx)
        except (RuntimeError, ValueError, KeyError) as e:  # shapes or names that do not map
            raise AssertionError(f"export: {kind} accepts this configuration, but the export "
                                 f"does not load back: {str(e).splitlines()[0]}") from None
    for what, got in outputs.items():
        diff = (got.double() - want.double()).abs().amax((0, 2))  # (T,): per position
        d = diff.max().item()
        assert d <= 1e-4, (f"export: {kind} accepts this configuration, but {what} differs from "
                           f"ours by {d:.2e} (max |logit diff|), first at position "
                           f"{int((diff > 1e-4).nonzero()[0])} of {len(diff)}: the export does "
                           f"not map this model (map it exactly or refuse it), or the model's "
                           f"maths have changed; {rope_verdict(cfg, model_factory)}")


def rope_verdict(cfg, model_factory):
    """What the rope rotation check says of this model, for an export's disagreement: the
    message once sent the reader to that check even where it had passed."""
    try:
        check_rope_rotation(cfg, model_factory)
    except AssertionError as e:
        return f"the rope rotation check fails too ({str(e).splitlines()[0]})"
    except pytest.skip.Exception as e:
        return (f"the rope rotation check does not apply ({e.msg}); test_model.py's float64 "
                f"reference pins today's maths")
    return ("the rope rotation check passes on this model (the rotation is the paper's): "
            "look past RoPE, test_model.py's float64 reference pins the rest of today's maths")


def export_hf(model, model_factory, folder, idx):
    """The logits transformers computes from the folder export.py's functions write."""
    import export
    st = pytest.importorskip("safetensors.torch", reason="the HF export writes safetensors")
    transformers = pytest.importorskip("transformers", reason="the HF export is checked by "
                                       "loading it with transformers")
    conf, weights = export.hf_model(model, 0, "float32")  # GPT-NeoX, or Persimmon (qk_norm)
    weights = st.save(weights, metadata={"format": "pt"})
    path = str(folder / "hf")
    export.write_folder(path, {"config.json": json.dumps(conf).encode(),
                               "model.safetensors": weights})
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return {"transformers' model of the folder": hf(idx).logits}


def export_gguf(model, model_factory, folder, idx):
    """The f32 file formats/gguf.py writes (its metadata with an empty tokenizer: the model's
    part is what counts here), computed two ways: by test_gguf.py's float64 forward written
    from llama.cpp's gptneox graph, and by our model with the file's weights read back into a
    fresh model of other weights (a parameter the file lacks keeps the fresh value, and shows)."""
    pytest.importorskip("gguf", reason="the GGUF export writes with the gguf package")
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2",
                             reason="GGUF metadata is written from a sentencepiece ModelProto")
    from formats import gguf as gguf_export
    from test_gguf import gptneox_forward  # skips this test where its packages are missing
    no_tokenizer = SimpleNamespace(eos_id=lambda: 0, unk_id=lambda: 0, bos_id=lambda: -1)
    meta = gguf_export.gguf_metadata(model.config, no_tokenizer, pb.ModelProto(), "f32",
                                     "contract")
    path = str(folder / "model.gguf")
    gguf_export.write_gguf(path, meta, gguf_export.gguf_tensors(model, "f32"))
    fresh = build(model.config, model_factory, seed=1, dtype=torch.float32)
    llama = torch.stack([torch.from_numpy(gptneox_forward(path, row.numpy())) for row in idx])
    return {"llama.cpp's gptneox graph on the file": llama,
            "our model with the file's weights": gguf_export.weights_from_gguf(path, fresh)(idx)[0]}


# --- the contract on the configuration under test (tests/conftest.py: --model) -------------

def test_every_model_option_changes_the_model(pytestconfig, contract_cfg):
    if not pytestconfig.contract_overrides:
        pytest.skip("inert option: no --model option given")
    check_options_act(contract_cfg, pytestconfig.contract_overrides)


def test_eval_mode_is_deterministic(contract_cfg):  # first: see its check
    check_eval_determinism(contract_cfg)


@pytest.mark.parametrize("path", PATHS)
def test_causality(contract_cfg, path):
    check_causality(contract_cfg, path=path)


@pytest.mark.parametrize("path", PATHS)
def test_rope_rotates_by_the_papers_angles(contract_cfg, path):
    check_rope_rotation(contract_cfg, path=path)


@pytest.mark.parametrize("path", PATHS)
def test_a_prefix_gives_the_same_logits(contract_cfg, path):
    check_prefix(contract_cfg, path=path)


@pytest.mark.parametrize("path", PATHS)
def test_shifting_every_position_changes_no_logit(contract_cfg, path):
    check_shift_invariance(contract_cfg, path=path)


def test_cached_decoding_equals_full_forward(contract_cfg):
    check_cached_decoding(contract_cfg)


def test_rolling_cache_equals_band_masked_forward(contract_cfg):
    check_rolling_cache(contract_cfg)


@pytest.mark.slow
def test_compiled_decoding_equals_eager(contract_cfg):
    check_compiled_decoding(contract_cfg)


@pytest.mark.parametrize("path", PATHS)
def test_batch_rows_are_independent(contract_cfg, path):
    check_batch_independence(contract_cfg, path=path)


def test_every_parameter_gets_a_finite_gradient(contract_cfg):
    check_gradients(contract_cfg)


def test_bf16_autocast_stays_close_to_float32(contract_cfg):
    check_bf16_autocast(contract_cfg)


@pytest.mark.slow
def test_compiled_training_step_equals_eager(contract_cfg):
    check_compiled_training_step(contract_cfg)


def test_state_dict_round_trip(contract_cfg):
    check_round_trip(contract_cfg)


def test_tiny_batch_overfits(contract_cfg):
    check_overfit(contract_cfg)


@pytest.mark.parametrize("path", PATHS)
def test_linear_attention_stays_within_its_bound(contract_cfg, path):
    check_linear_bound(contract_cfg, path=path)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_export_maps_exactly_or_refuses(contract_cfg, kind, tmp_path):
    check_export(contract_cfg, RoFormer, kind, tmp_path)


# --- deliberately broken decoders: each must fail the checks that guard against it ---------

def look_ahead(real):
    """A causal mask off by one: each query also sees the next token."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *a, **kw):
        if is_causal and attn_mask is None:
            attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool,
                                   device=q.device).tril(diagonal=1)
        return real(q, k, v, attn_mask, dropout_p, False, *a, **kw)
    return sdpa


class LookAheadMask(RoFormer):
    def forward(self, *args, **kw):
        with wrapped_sdpa(look_ahead):
            return super().forward(*args, **kw)


class DropoutInEval(RoFormer):
    """SDPA's dropout_p=cfg.dropout without `if self.training`: attention dropout in eval."""

    def forward(self, *args, **kw):
        p = self.config.dropout

        def always(real):  # dropout_p passed by keyword or as the fifth argument
            return lambda q, k, v, attn_mask=None, dropout_p=0.0, *a, **kw: real(
                q, k, v, attn_mask, p, *a, **kw)
        with wrapped_sdpa(always):
            return super().forward(*args, **kw)


class LowPrecisionAngles(RoFormer):
    """RoPE angles from positions held in the activations' dtype (docs: PITFALLS, low-precision
    angles): exact in float32 and float64, position 1001 becomes 1000 under bf16 autocast."""

    def forward(self, idx, targets=None, cache=None, start_pos=0):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else \
            self.wte.weight.dtype
        real = model_module.rope_table
        self.rope_cos, self.table_start = torch.empty(0), 0  # rebuilt in this forward's dtype
        with mock.patch.object(model_module, "rope_table", lambda pos, *a: real(
                pos.to(dtype).double(), *a)):
            return super().forward(idx, targets, cache, start_pos)


class CompiledPathDetaches(RoFormer):
    """A path taken only under torch.compile (a fused kernel, say) whose backward is lost:
    each attention output is detached, so the loss is right and its gradients are not."""

    def __init__(self, cfg):
        super().__init__(cfg)
        for block in self.blocks:
            block.attn.register_forward_hook(lambda mod, inp, out: out.detach() if
                                             torch.compiler.is_compiling() else out)


class RotatedValues(RoFormer):
    """RoPE applied to the values too (before the cache, so every path agrees): outputs then
    depend on absolute positions."""

    def __init__(self, cfg):
        super().__init__(cfg)
        for block in self.blocks:
            block.attn.softmax = (lambda attn: lambda qkv, positions, cache: type(attn).softmax(
                attn, torch.cat((qkv[:2], model_module.apply_rope(qkv[2:], *positions.rope[0])))
                if positions.rope[0] else qkv, positions, cache))(block.attn)


class ScaleFromLength(RoFormer):
    """A length temperature taken from the forward's number of keys instead of each query's
    position: the scale changes with how many tokens follow."""

    def forward(self, *args, **kw):
        def wrap(real):
            return lambda q, k, v, *a, **kw: real(q, k, v, *a, **{**kw, "scale": math.log(
                k.size(-2) + 1) / math.sqrt(q.size(-1))})
        with wrapped_sdpa(wrap):
            return super().forward(*args, **kw)


class CacheSkipsKeyRope(RoFormer):
    """Cached forwards rotate the queries but store (and attend to) unrotated keys."""

    def forward(self, idx, targets=None, cache=None, start_pos=0):
        if cache is None:
            return super().forward(idx, targets)
        real = model_module.apply_rope

        def queries_only(qk, *args, **kw):  # Attention.softmax rotates q and k stacked
            # the real call with the model's own arguments, then the keys put back unturned:
            # indexing qk[0], qk[1] for a separate call crashed (IndexError) on a model whose
            # call carried a single tensor, instead of planting the bug
            out = real(qk, *args, **kw)
            return torch.cat((out[:1], qk[1:].to(out.dtype)))
        with mock.patch.object(model_module, "apply_rope", queries_only):
            return super().forward(idx, targets, cache, start_pos)


class FutureBias(RoFormer):
    """Each position's input embedding gets half the next token's embedding added."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.wte.register_forward_hook(
            lambda mod, inp, out: out + 0.5 * F.pad(out[:, 1:], (0, 0, 0, 1)))


class PartialRotaryLinear(RoFormer):
    """Issue 29's hidden coupling: RoPE on half of each head's channels (pairs i, i + D/4)
    while eq. 19's guard still folds the model's own pairs (i, i + D/2, or 2i, 2i + 1), so the
    guard no longer bounds the numerator."""

    def forward(self, *args, **kw):
        real = model_module.apply_rope

        def half_rotary(x, cos, sin, *args, **kw):  # the first D/4 frequencies on :D/2
            h, q = x.size(-1) // 2, x.size(-1) // 4
            c, s = torch.cat((cos[..., :q], cos[..., :q]), -1), \
                torch.cat((sin[..., :q], sin[..., h:h + q]), -1)
            return torch.cat((real(x[..., :h], c, s, "half"), x[..., h:]), -1)  # pairs i, i + D/4
        with mock.patch.object(model_module, "apply_rope", half_rotary):
            return super().forward(*args, **kw)


class DoubleAngleInHalfTheHeads(RoFormer):
    """The second half of the heads turn by 2 m theta_i (cos 2a, sin 2a from the tables):
    still relative, causal and cache-consistent, so only the rotation check (and the exports)
    see it."""

    def forward(self, *args, **kw):
        real = model_module.apply_rope

        def doubled(x, cos, sin, *a, **k):  # x: (.., H, T, D); tables [cos a, cos a], [-sin, sin]
            h = x.size(-3) // 2  # the real call on the model's own x, twice: heads then chosen
            return torch.cat((real(x, cos, sin, *a, **k)[..., :h, :, :], real(
                x, 2 * cos * cos - 1, 2 * sin * cos, *a, **k)[..., h:, :, :]), -3)
        with mock.patch.object(model_module, "apply_rope", doubled):
            return super().forward(*args, **kw)


def leaks_next_token(real, cfg, when):
    """eq. 19's kernel with its chunk mask off by one (tril(1) for tril()): while when() holds,
    each position's output also takes the next token's value, where that token is in its
    chunk (the recurrent one-token steps have no next token, so decoding stays right)."""
    def kernel(q, k, v, *args, **kw):
        out, state = real(q, k, v, *args, **kw)
        if not when():
            return out, state
        N = v.size(-2)
        inside = (torch.arange(1, N) % min(cfg.linear_chunk, N) != 0).to(out.dtype)[:, None]
        return out + 0.5 * F.pad(v[..., 1:, :].to(out.dtype) * inside, (0, 0, 0, 1)), state
    return kernel


class ChunkSeesNextToken(RoFormer):
    """Issue 60: the chunk mask of eq. 19's kernel lets each position see one future token;
    the default check, run on softmax attention alone, passed it."""

    def forward(self, *args, **kw):
        leaky = leaks_next_token(model_module.linear_attention, self.config, lambda: True)
        with mock.patch.object(model_module, "linear_attention", leaky):
            return super().forward(*args, **kw)


class LeaksWhileLearning(RoFormer):
    """The same leak only while gradients are on: every no_grad check passed it, and it is the
    path that trains."""

    def forward(self, *args, **kw):
        leaky = leaks_next_token(model_module.linear_attention, self.config,
                                 torch.is_grad_enabled)
        with mock.patch.object(model_module, "linear_attention", leaky):
            return super().forward(*args, **kw)


class LooksAheadWhileLearning(RoFormer):
    """Softmax attention's look-ahead mask, only while gradients are on."""

    def forward(self, *args, **kw):
        with wrapped_sdpa(look_ahead) if torch.is_grad_enabled() else contextlib.nullcontext():
            return super().forward(*args, **kw)


class FutureGradient(torch.autograd.Function):
    """The identity forward; backward, each position also gets half the previous one's
    gradient, as if position p - 1's output had read position p."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + 0.5 * F.pad(grad[:, :-1], (0, 0, 1, 0))


class BackwardSeesTheFuture(RoFormer):
    """A wrong backward (a hand-written kernel's, say) after exactly causal forwards: only the
    gradient side of the causality check sees it."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.wte.register_forward_hook(lambda mod, inp, out: FutureGradient.apply(out))


@pytest.mark.parametrize("broken,check,prop,on", [
    (DoubleAngleInHalfTheHeads, check_rope_rotation, "rope rotation", []),
    (DropoutInEval, check_eval_determinism, "eval determinism", []),
    (LowPrecisionAngles, check_bf16_autocast, "bf16 autocast", []),
    (CompiledPathDetaches, check_compiled_training_step, "compiled training step", []),
    (RotatedValues, check_shift_invariance, "shift invariance", []),
    (ScaleFromLength, check_prefix, "prefix", []),
    (LookAheadMask, check_causality, "causality", []),
    (LookAheadMask, check_cached_decoding, "cached decoding", []),
    (CacheSkipsKeyRope, check_cached_decoding, "cached decoding", []),
    (CacheSkipsKeyRope, check_rolling_cache, "rolling cache", []),
    (FutureBias, check_causality, "causality", []),
    (FutureBias, check_cached_decoding, "cached decoding", []),
    (PartialRotaryLinear, check_linear_bound, "linear attention bound", ["attention=linear"]),
    (PartialRotaryLinear, check_linear_bound, "linear attention bound",
     ["attention=linear", "feature_map=relu"]),
    (ChunkSeesNextToken, check_causality, "causality", ["attention=linear"]),
    (ChunkSeesNextToken, check_prefix, "prefix", ["attention=linear"]),
    (ChunkSeesNextToken, check_cached_decoding, "cached decoding", ["attention=linear"]),
], ids=lambda x: "-".join(x) if isinstance(x, list) else None)
def test_a_broken_decoder_fails_the_check_that_names_its_bug(broken, check, prop, on):
    fails_where_the_base_passes(broken, check, prop, on)


@pytest.mark.parametrize("broken,check,prop,on", [
    (LeaksWhileLearning, check_causality, "causality", ["attention=linear"]),
    (LeaksWhileLearning, check_prefix, "prefix", ["attention=linear"]),
    (LooksAheadWhileLearning, check_causality, "causality", []),
    (BackwardSeesTheFuture, check_causality, "causality", []),
    (BackwardSeesTheFuture, check_causality, "causality", ["attention=linear"]),
], ids=lambda x: "-".join(x) if isinstance(x, list) else None)
def test_a_bug_of_the_training_path_fails_there_and_only_there(broken, check, prop, on):
    """Issue 60: bugs that only the grad-enabled path has pass every no_grad check (the
    self-test's first half shows it) and fail the same property on the training path."""
    from conftest import contract_overrides
    fails_where_the_base_passes(broken, check, prop, on, path="training")
    check(contract_overrides(on)[1], broken, path="inference")


def outcome(check, cfg, model_factory, **kw):
    """("passed" | "failed" | "crashed", the first line of what it said)."""
    try:
        check(cfg, model_factory, **kw)
    except AssertionError as e:
        return "failed", str(e).strip().split("\n")[0]
    except pytest.skip.Exception:
        raise
    except Exception as e:  # a stand-in or a model that no longer fits the call it makes
        return "crashed", f"{type(e).__name__}: {(str(e).strip() or '?').splitlines()[0]}"
    return "passed", ""


# the quick properties a base must keep before a stand-in built on it can show anything
QUICK = [(check_eval_determinism, {})] + [
    (c, {"path": p}) for c in (check_causality, check_prefix, check_shift_invariance,
                               check_batch_independence, check_rope_rotation, check_linear_bound)
    for p in PATHS] + [
    (check_cached_decoding, {}), (check_rolling_cache, {}), (check_round_trip, {}),
    (check_gradients, {})]
_base_verdicts = {}


def base_failure(base, cfg):
    """None, or (property, what it said) of the first quick property the base fails or
    crashes in on cfg; once per base and configuration."""
    key = (base, repr(cfg))
    if key not in _base_verdicts:
        _base_verdicts[key] = None
        for check, kw in QUICK:
            try:
                result, said = outcome(check, cfg, base, **kw)
            except pytest.skip.Exception:
                continue
            if result != "passed":
                _base_verdicts[key] = (check.__name__[len("check_"):].replace("_", " "),
                                       said if result == "failed" else f"crashed: {said}")
                break
    return _base_verdicts[key]


_reported = {}  # (base, configuration, property): the self-test that failed for it


def base_fails(base, cfg, on, prop, said):
    """The base is no ground for a stand-in: skip where this run's own contract tests check
    cfg (they report it, once), fail naming it where they do not (skipping there would hide
    it: the base's linear attention once failed its bound with only this skip to show), in the
    first self-test that finds it (the later ones skip, naming that one)."""
    import conftest
    runs = getattr(conftest, "CONTRACT_RUNS", None)  # None: not under pytest's configure
    runs = conftest.contract_runs([])[0] if runs is None else runs
    if repr(cfg) in (repr(c) for _, c in runs):
        pytest.skip(f"the base model itself fails {prop} (reported by its own test): {said}")
    key = (base, repr(cfg), prop)
    if key in _reported:
        pytest.skip(f"the base model itself fails {prop} with --model {' '.join(on) or '(none)'} "
                    f"(reported by {_reported[key]})")
    _reported[key] = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    raise AssertionError(f"{prop}: the base model ({base.__name__}) itself fails it with --model "
                         f"{' '.join(on) or '(none)'}, a configuration this run's contract tests "
                         f"do not check: {said}")


def as_in_the_default_run():
    """For the tests of the self-tests' own rules, whatever --model this run has: the
    configurations the default run checks."""
    import conftest
    return mock.patch.object(conftest, "CONTRACT_RUNS", conftest.contract_runs([])[0],
                             create=True)


def fails_where_the_base_passes(broken, check, prop, on, base=RoFormer, **kw):
    """On the tiny base (`on` overrides it), where these bugs live, the correct model passes
    `check` and the broken one fails it with the property's name first. A base that fails
    `check` itself, or one the broken model passes or crashes on while the base fails another
    quick property, is no ground for the stand-in (base_fails): a bug in today's model gives
    its own failures, not one per self-test."""
    from conftest import contract_overrides
    cfg = contract_overrides(on)[1]
    result, said = outcome(check, cfg, base, **kw)
    if result != "passed":
        base_fails(base, cfg, on, prop, said if result == "failed" else f"crashed: {said}")
    result, said = outcome(check, cfg, broken, **kw)
    if result == "failed":
        assert said.startswith(prop + ":"), (f"self-test: {broken.__name__} fails another "
                                             f"property than {prop}: {said}")
        return
    bad = base_failure(base, cfg)
    if bad:
        base_fails(base, cfg, on, *bad)
    where = PATHS[kw.get("path", "inference")]
    raise AssertionError(
        f"self-test: {broken.__name__} {'passed' if result == 'passed' else 'crashed in'} "
        f"{check.__name__} {where} ({said or 'no failure'}) on a base that passes the quick "
        f"properties: " + ("the check does not see its bug" if result == "passed" else
                          "the stand-in no longer fits the model's calls (its docstring says "
                          "what it plants)"))


def test_a_broken_base_skips_the_self_test_naming_the_property():
    with pytest.raises(pytest.skip.Exception) as skipped, as_in_the_default_run():
        # LookAheadMask as today's RoFormer
        fails_where_the_base_passes(FutureBias, check_causality, "causality", [],
                                    base=LookAheadMask)
    assert "base model itself fails causality" in str(skipped.value), skipped.value


def test_messages_say_context_window_and_name_an_attention_window():
    from conftest import contract_overrides
    cfg = contract_overrides([])[1]
    with pytest.raises(AssertionError, match=f"context window {cfg.context_window}\\)"):
        check_rolling_cache(cfg, CacheSkipsKeyRope)
    windowed = SimpleNamespace(context_window=32, window=8)  # issue 38's field, when it comes
    assert "context window 32" in windows(windowed) and "attention window 8" in \
        windows(windowed), windows(windowed)


@dataclasses.dataclass
class EveryConfig(model_module.RoFormerConfig):
    nope_every: int = 0  # test-only: the every-k-th-layer option issue 37's trial added


class NoPEEvery(RoFormer):
    """nope_every=k done right: layers k-1, 2k-1, .. attend without RoPE (a tiny model too
    shallow for k builds none)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        for i, block in enumerate(self.blocks):
            if cfg.nope_every and (i + 1) % cfg.nope_every == 0:
                block.attn.register_forward_pre_hook(
                    lambda mod, args: (args[0], args[1]._replace(rope=dict.fromkeys(
                        args[1].rope)), *args[2:]))  # every window's table: none


@pytest.mark.parametrize("every", [4, 6])
def test_an_every_k_th_layer_option_acts_and_an_inert_one_is_named(every):
    from conftest import contract_overrides
    with mock.patch.object(model_module, "RoFormerConfig", EveryConfig):
        overrides, cfg = contract_overrides([f"nope_every={every}"])
    check_options_act(cfg, overrides, NoPEEvery)  # the check's model is deep enough for it
    with pytest.raises(AssertionError) as failure:  # a model that ignores the field (as
        # RoFormer did before issue 38) builds no NoPE layer at any depth
        check_options_act(cfg, overrides,
                          lambda c: RoFormer(dataclasses.replace(c, nope_every=0)))
    assert str(failure.value).startswith(f"inert option: --model nope_every={every} "), \
        failure.value


class LateStep(RoFormer):
    """A one-token cached step placed one position later than its token: every step after
    a prefill is wrong."""

    def forward(self, idx, targets=None, cache=None, start_pos=0):
        late = cache is not None and idx.size(1) == 1
        return super().forward(idx, targets, cache, start_pos + 1 if late else start_pos)


@torch.no_grad()
def test_a_cached_decoding_failure_names_the_first_position_that_differs_and_how_many():
    """Reference: each prefill's cached logits against the full forward, compared here."""
    from conftest import contract_overrides
    cfg = contract_overrides([])[1]
    with pytest.raises(AssertionError) as failure:
        check_cached_decoding(cfg, LateStep)
    model, T = build(cfg, LateStep), min(cfg.context_window, 20)
    idx = tokens(cfg, 2, T)
    want, first = model(idx)[0], {}
    for split in sorted({1, T // 3, T - 1}):
        d = (cached_logits(model, idx, split) - want[:, split - 1:]).abs().amax((0, 2))
        off = (d > TOL).nonzero().flatten() + split - 1
        if len(off):
            first[split] = (off[0].item(), len(off), len(d))
    split = min(first, key=lambda s: first[s][0])
    p, n, of = first[split]
    assert str(failure.value).startswith(f"cached decoding: logit at position {p} differs from "
                                         f"the full forward after a {split}-token prefill")
    assert f"; {n} of the {of} positions" in str(failure.value), failure.value


GAIN = float(1)  # PassesMore's extra apply_rope argument, known by identity where it arrives


class PassesMore(RoFormer):
    """A correct model whose calls carry more arguments than today's: scale= (its default,
    1/sqrt(d), unless the model passes its own) and the mask positionally to SDPA, and a
    fourth argument (a gain of 1) to apply_rope, as a model change may. Where the gain does not
    reach a call (a model that unpacks its tables), that call goes through unchanged: a stand-in
    that cannot add its argument must not crash the self-tests built on it."""

    def forward(self, *args, **kw):
        real_rope, designs = model_module.apply_rope, self.designs

        class Functional:  # model.py's F, with SDPA called the other way
            def __getattr__(self, name):
                return getattr(F, name)

            def scaled_dot_product_attention(self, q, k, v, attn_mask=None, **kw):
                return F.scaled_dot_product_attention(q, k, v, attn_mask,
                                                      **{"scale": q.size(-1) ** -0.5, **kw})

        def with_gain(x, pos, cache):  # Attention.softmax calls apply_rope(qk, *rope)
            x, positions = designs(x, pos, cache)
            rope = {key: table + (GAIN,) if isinstance(table, tuple) else table
                    for key, table in positions.rope.items()}  # each window's table
            return x, positions._replace(rope=rope)

        def rope_with_gain(x, cos, sin, *a, **k):
            if a and a[0] is GAIN:
                return real_rope(x, cos, sin, *a[1:], **k) * a[0]
            return real_rope(x, cos, sin, *a, **k)
        with mock.patch.object(model_module, "F", Functional()), \
                mock.patch.object(model_module, "apply_rope", rope_with_gain), \
                mock.patch.object(self, "designs", with_gain):
            return super().forward(*args, **kw)


# the self-tests whose stand-ins wrap SDPA or apply_rope: run again on other correct models
SELF_TESTS = [(ScaleFromLength, check_prefix, "prefix"),
              (LookAheadMask, check_causality, "causality"),
              (DropoutInEval, check_eval_determinism, "eval determinism"),
              (CacheSkipsKeyRope, check_cached_decoding, "cached decoding"),
              (CacheSkipsKeyRope, check_rolling_cache, "rolling cache"),
              (DoubleAngleInHalfTheHeads, check_rope_rotation, "rope rotation")]


@pytest.mark.parametrize("broken,check,prop", SELF_TESTS, ids=lambda x: getattr(x, "__name__",
                                                                                 None))
def test_the_self_tests_hold_for_a_model_that_passes_more_arguments(broken, check, prop):
    """The planted bugs' stand-ins forward whatever they are given: on a correct model that
    calls SDPA with scale= and apply_rope with one more argument, the model passes and each
    bug still fails its check, never with a TypeError from a stand-in's signature."""
    fails_where_the_base_passes(type(broken.__name__, (PassesMore, broken), {}), check, prop,
                                [], base=PassesMore)


def test_an_export_that_disagrees_says_the_model_may_have_changed(tmp_path):
    """Issue 45: RoPE at twice the angle in half the heads was caught only by the exports,
    whose message then blamed the export alone."""
    from conftest import contract_overrides
    with pytest.raises(AssertionError) as failure:
        check_export(contract_overrides([])[1], DoubleAngleInHalfTheHeads, "hf", tmp_path)
    assert "map it exactly or refuse it" in str(failure.value) and \
        "the model's maths have changed" in str(failure.value), failure.value
    assert "the rope rotation check fails too (rope rotation: layer 0 head 1's" in \
        str(failure.value), failure.value


class FinalNormScaled(RoFormer):
    """The final norm's output times 1.5 outside any weight: the export maps the weights alone,
    and RoPE is untouched."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.ln_f.register_forward_hook(lambda mod, inp, out: 1.5 * out)


def test_an_export_that_disagrees_says_what_the_rope_check_found(tmp_path):
    """Issue 60: the disagreement pointed to the rope rotation check even where it passed. It
    now says what that check found, and the first position that differs."""
    from conftest import contract_overrides
    with pytest.raises(AssertionError) as failure:
        check_export(contract_overrides([])[1], FinalNormScaled, "hf", tmp_path)
    said = str(failure.value)
    assert said.startswith("export: hf accepts this configuration, but transformers' model of "
                           "the folder differs from ours by ") and "first at position 0 of" in \
        said, said
    assert "the rope rotation check passes on this model" in said, said


class ScaleGiven(RoFormer):
    """A correct model that passes SDPA its default scale=1/sqrt(d) by keyword (PassesMore
    then gets a scale= of the model's own)."""

    def forward(self, *args, **kw):
        functional = model_module.F

        class Functional:
            def __getattr__(self, name):
                return getattr(functional, name)

            def scaled_dot_product_attention(self, q, k, v, *a, **kw):
                return functional.scaled_dot_product_attention(q, k, v, *a, **kw,
                                                               scale=q.size(-1) ** -0.5)
        with mock.patch.object(model_module, "F", Functional()):
            return super().forward(*args, **kw)


class QueriesOnlyTurned(RoFormer):
    """A broken model (shift invariance, the rope rotation): Attention.softmax turns the
    queries alone, by apply_rope(qkv[:1], cos, sin, pairs), and leaves the keys unturned;
    cached decoding still equals the full forward."""

    def __init__(self, cfg):
        super().__init__(cfg)
        for block in self.blocks:
            block.attn.softmax = (lambda attn: lambda qkv, positions, cache: type(attn).softmax(
                attn, torch.cat((model_module.apply_rope(qkv[:1], *positions.rope[0],
                                                         cfg.rope_pairs), qkv[1:])),
                positions._replace(rope=dict.fromkeys(positions.rope)), cache))(block.attn)


@pytest.mark.parametrize("broken,check,prop", SELF_TESTS, ids=lambda x: getattr(x, "__name__",
                                                                                 None))
def test_the_self_tests_hold_for_a_model_that_passes_its_own_scale(broken, check, prop):
    """Issue 60: PassesMore added scale= beside the model's own, a TypeError ("got multiple
    values for keyword argument 'scale'") on a correct model."""
    base = type("ScaleGivenPassesMore", (PassesMore, ScaleGiven), {})
    fails_where_the_base_passes(type(broken.__name__, (base, broken), {}), check, prop, [],
                                base=base)


@pytest.mark.parametrize("passes_more", [False, True])
@pytest.mark.parametrize("broken,check,prop", SELF_TESTS, ids=lambda x: getattr(x, "__name__",
                                                                                 None))
def test_a_broken_model_skips_the_self_tests_it_cannot_ground(broken, check, prop, passes_more):
    """Issue 60: on a broken model the stand-ins crashed (IndexError in CacheSkipsKeyRope,
    TypeError in PassesMore), one noise failure per self-test beside the real one. Now each
    self-test either shows its bug failing its property, or skips naming what the base fails
    (its own contract test reports that): never a crash."""
    base = type("PassesMoreQueriesOnly", (PassesMore, QueriesOnlyTurned), {}) if passes_more \
        else QueriesOnlyTurned
    try:
        with as_in_the_default_run():
            fails_where_the_base_passes(type(broken.__name__, (base, broken), {}), check, prop,
                                        [], base=base)
    except pytest.skip.Exception as e:
        assert "the base model itself fails" in str(e) and "(reported by its own test)" in \
            str(e), e


def test_a_broken_base_fails_once_where_the_run_does_not_check_it():
    """A base that fails on a configuration the run's own tests do not check fails the first
    self-test that finds it, naming the property and the --model values; the others skip,
    naming that one (one failure per bug, not one per self-test)."""
    import conftest
    with mock.patch.object(conftest, "CONTRACT_RUNS", [], create=True), \
            mock.patch.dict(_reported, clear=True):
        with pytest.raises(AssertionError) as failure:
            fails_where_the_base_passes(FutureBias, check_causality, "causality", [],
                                        base=LookAheadMask)
        assert str(failure.value).startswith("causality: the base model (LookAheadMask) itself "
                                             "fails it with --model (none), a configuration this "
                                             "run's contract tests do not check: causality: "), \
            failure.value
        with pytest.raises(pytest.skip.Exception) as skipped:
            fails_where_the_base_passes(ScaleFromLength, check_causality, "causality", [],
                                        base=LookAheadMask)
        assert "(reported by tests/test_contract.py::test_a_broken_base_fails_once_where" in \
            str(skipped.value), skipped.value
