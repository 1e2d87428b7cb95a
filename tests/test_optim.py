"""optim.build_optimizer: which parameters Muon gets, one Muon step against the update written
from its documentation (momentum, Newton-Schulz orthogonalisation, shape-adjusted rate,
decoupled weight decay) in float64, the AdamW part against a plain torch AdamW, and an exact
resume through state_dict."""
import copy
import io
import os
import re
import subprocess
import sys

from unittest import mock

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import RoFormer, RoFormerConfig  # noqa: E402
import muon  # noqa: E402
from muon import Muon, gram_newton_schulz, orthogonalise, orthogonalise_batch  # noqa: E402
from optim import build_optimizer  # noqa: E402

HIDDEN = re.compile(r"blocks\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight")


def tiny(pos_encoding="rope", bias=True, seed=0, **kw):
    torch.manual_seed(seed)
    return RoFormer(RoFormerConfig(vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=32,
                                   bias=bias, pos_encoding=pos_encoding, **kw))


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 48, (3, 16), generator=g)
    return x, torch.randint(0, 48, (3, 16), generator=g)


def grads(model, seed):
    x, y = batch(seed)
    model(x, y)[1].backward()


def synthetic_grads(model, seed):
    """Gradients U diag(s) V^T with random orthonormal U, V and singular values s spread
    evenly from 1 to 0.1: a real one at init is nearly rank-deficient, and Newton-Schulz
    amplifies bfloat16 noise in its null directions (which an exact float64 reference leaves
    at zero), so the comparison would measure that noise."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() < 2:
            p.grad = torch.randn(p.shape, generator=g)
            continue
        k = min(p.shape)
        u = torch.linalg.qr(torch.randn(p.shape[0], k, generator=g))[0]
        v = torch.linalg.qr(torch.randn(p.shape[1], k, generator=g))[0]
        p.grad = u @ torch.diag(torch.linspace(1, 0.1, k)) @ v.T


@pytest.mark.parametrize("pos_encoding", ["rope", "learned", "shaw", "t5"])
def test_muon_gets_the_blocks_linear_weights_and_adamw_everything_else(pos_encoding):
    m = tiny(pos_encoding)
    opt = build_optimizer(m, 1e-3, 0.1, name="muon")
    in_muon = [id(p) for g in opt.muon.param_groups for p in g["params"]]
    in_adamw = [id(p) for g in opt.adamw.param_groups for p in g["params"]]
    every = [id(p) for p in m.parameters()]
    assert sorted(in_muon + in_adamw) == sorted(every) and len(set(every)) == len(every)
    names = {id(p): n for n, p in m.named_parameters()}
    assert sorted(names[i] for i in in_muon) == sorted(n for n in names.values()
                                                       if HIDDEN.fullmatch(n))
    assert len(in_muon) == 4 * 2
    # the tied head is wte itself: AdamW's, like the position tables (wpe, rel_k, rel_bias)
    assert id(m.lm_head.weight) == id(m.wte.weight) and id(m.wte.weight) in in_adamw
    decayed = {names[id(p)] for p in opt.adamw.param_groups[0]["params"]}
    assert all(p.dim() == 2 for n, p in m.named_parameters() if n in decayed)
    assert [g["base_lr"] for g in opt.param_groups] == [0.02, 1e-3, 1e-3]


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_an_untied_head_is_adamws_and_decayed_once(name):
    """tie_embeddings=False: lm_head, the classifier over the vocabulary, stays with AdamW under
    Muon too (as wte does: Muon is for the hidden layers' maps), in the weight-decayed group,
    and every parameter is in exactly one group."""
    m = tiny(tie_embeddings=False)
    opt = build_optimizer(m, 1e-3, 0.1, name=name)
    adamw = opt.adamw if name == "muon" else opt
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    every = sorted(i for g in groups for i in g)
    assert every == sorted(id(p) for p in m.parameters()) and len(set(every)) == len(every)
    decayed = [id(p) for p in adamw.param_groups[0]["params"]]
    assert adamw.param_groups[0]["weight_decay"] == 0.1
    assert id(m.lm_head.weight) in decayed and id(m.wte.weight) in decayed
    assert m.lm_head.weight is not m.wte.weight


def newton_schulz_reference(G, steps=5, a=3.4445, b=-4.7750, c=2.0315, dtype=torch.float64):
    """Muon's documented orthogonalisation in float64 (or `dtype`): scale to Frobenius norm 1,
    then X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation."""
    X = G.to(dtype)
    wide = X.shape[0] <= X.shape[1]
    X = X if wide else X.T
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X if wide else X.T


@pytest.mark.parametrize("shape", [(32, 64), (96, 32), (32, 128), (128, 32), (16, 80)])
@pytest.mark.parametrize("spectrum", ["gaussian", "decaying"])
def test_the_gram_form_is_the_documented_iteration(shape, spectrum):
    """A matrix at least twice as wide as tall is orthogonalised in float32 by the Gram form
    (iterating on x x^T). In float64 it is the documented iteration to 1e-12. In float32 its
    relative error is under 1e-3 and under 1/100 of the plain form's in bfloat16 (the precision
    torch.optim.Muon runs at); on a well-conditioned matrix it is within 4x of the plain form's
    in float32, and a momentum whose singular values fall from 1 to 1e-4 costs it ~100x that
    (squaring the spectrum rounds the small ones)."""
    gen = torch.Generator().manual_seed(sum(shape))
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    if spectrum == "decaying":
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        g = u @ torch.diag(torch.logspace(0, -4, min(shape), dtype=torch.float64)) @ vh
    want = newton_schulz_reference(g)
    t = (lambda x: x) if shape[0] <= shape[1] else (lambda x: x.T)  # to the wide orientation
    wide = t(g) / g.norm()
    assert (t(gram_newton_schulz(wide, *Muon.COEFFICIENTS, 5)) - want).abs().max() < 1e-12
    ours = orthogonalise(g.float(), Muon.COEFFICIENTS, 5, 1e-7, torch.float32)
    wide = t(g.float()) / g.float().norm()
    assert torch.equal(ours, t(gram_newton_schulz(wide, *Muon.COEFFICIENTS, 5)))  # its form
    plain = newton_schulz_reference(g.float(), dtype=torch.float32)
    bf16 = orthogonalise(g.float(), Muon.COEFFICIENTS, 5, 1e-7, torch.bfloat16)
    err, plain_err, bf16_err = ((x.double() - want).norm() / want.norm()
                                for x in (ours, plain, bf16))
    assert err < 1e-3 and err < bf16_err / 100, (err, bf16_err)
    assert spectrum == "decaying" or err < 4 * plain_err, (err, plain_err)


# tall, wide and square; one shape turned wide both ways (16 x 48 and 48 x 16), repeats, and a
# 3x-wide one that takes the Gram form in float64 and float32
MIXED = [(48, 16), (16, 48), (16, 16), (48, 16), (24, 40), (16, 16), (40, 24), (16, 48), (24, 40)]


def test_a_batched_muon_step_is_each_matrix_updated_alone_in_float64():
    """Muon orthogonalises the matrices of one shape as one batch (muon.orthogonalise_batch):
    two steps in float64 on matrices of mixed shapes give, for each matrix, the documented
    update computed for it alone (nesterov momentum, Newton-Schulz on it turned wide and scaled
    by its own norm, rate lr x sqrt(max(1, rows/cols)), decoupled decay), and the
    iteration runs once per shape, not once per matrix."""
    lr, wd, mom = 0.05, 0.1, 0.9
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
              for s in MIXED]
    want = [p.detach().clone() for p in params]
    buf = [torch.zeros_like(w) for w in want]
    opt = Muon(params, lr=lr, weight_decay=wd, momentum=mom, ns_dtype=torch.float64)
    for step in range(2):
        for p in params:  # singular values 1 to 0.1 (synthetic_grads' reason)
            u = torch.linalg.qr(torch.randn(p.shape[0], min(p.shape), generator=gen,
                                            dtype=torch.float64))[0]
            v = torch.linalg.qr(torch.randn(p.shape[1], min(p.shape), generator=gen,
                                            dtype=torch.float64))[0]
            p.grad = u @ torch.diag(torch.linspace(1, 0.1, min(p.shape), dtype=torch.float64)) @ v.T
        with mock.patch.object(muon, "newton_schulz", wraps=muon.newton_schulz) as iteration:
            opt.step()
        assert iteration.call_count == len(set(MIXED)), iteration.call_count
        for i, p in enumerate(params):
            buf[i] = mom * buf[i] + p.grad
            update = newton_schulz_reference(p.grad + mom * buf[i])
            rows, cols = p.shape
            want[i] = want[i] * (1 - lr * wd) - lr * max(1.0, rows / cols) ** 0.5 * update
            err = (p - want[i]).abs().max().item()
            assert err < 1e-12, (f"step {step + 1}: matrix {i} {tuple(p.shape)} is {err:.1e} "
                                 f"from its update computed alone (muon.py's batched step)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batching_changes_no_bit(dtype):
    """In the dtypes Muon runs in, each matrix of a batch comes out to the bit as when it is
    orthogonalised alone, and in bfloat16 as torch.optim.Muon's own function makes it (so a
    record's runs and the torch.optim.Muon equality are unchanged by batching)."""
    gen = torch.Generator().manual_seed(3)
    torchs = getattr(getattr(torch.optim, "_muon", None), "_zeropower_via_newtonschulz", None)
    for shape in set(MIXED):
        gs = torch.randn(3, *shape, generator=gen)
        together = orthogonalise_batch(gs, Muon.COEFFICIENTS, 5, 1e-7, dtype)
        assert together.shape == gs.shape and together.dtype == dtype
        for g, x in zip(gs, together):
            assert torch.equal(x, orthogonalise(g, Muon.COEFFICIENTS, 5, 1e-7, dtype)), shape
            if dtype == torch.bfloat16 and torchs is not None:
                assert torch.equal(x, torchs(g, Muon.COEFFICIENTS, 5, 1e-7)), shape


def test_two_muon_steps_match_the_documented_update_and_adamw_part_matches_plain_adamw():
    lr, wd, mom, muon_lr = 3e-3, 0.1, 0.9, 0.05
    m = tiny()
    ref = copy.deepcopy(m)
    opt = build_optimizer(m, lr, wd, (0.9, 0.95), name="muon", muon_lr=muon_lr, muon_momentum=mom)
    hidden = {n for n, _ in m.named_parameters() if HIDDEN.fullmatch(n)}
    rest = [p for n, p in ref.named_parameters() if n not in hidden]
    plain = torch.optim.AdamW([{"params": [p for p in rest if p.dim() == 2], "weight_decay": wd},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95))
    buf = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in ref.named_parameters()
           if n in hidden}
    for it in range(2):
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        synthetic_grads(m, it)
        synthetic_grads(ref, it)
        g = {n: p.grad.double() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        plain.step()
        plain.zero_grad()
        for n, p in m.named_parameters():
            if n not in hidden:  # the AdamW part: a plain (unfused) AdamW's step, to rounding
                want = dict(ref.named_parameters())[n]
                off, moved = (p - want).abs().max().item(), (p - before[n]).abs().max().item()
                assert off < 1e-7 < moved, (
                    f"AdamW part: {n} after step {it + 1} is {off:.2e} from plain AdamW's "
                    f"(tolerance 1e-7) and moved by {moved:.2e} (must be above 1e-7): the muon "
                    f"optimizer's AdamW group for it (optim.py, muon.py MuonAdamW) is not plain "
                    f"AdamW with lr={lr}, betas (0.9, 0.95), weight decay {wd} on matrices")
                continue
            buf[n] = mom * buf[n] + g[n]  # B_t = mu B_{t-1} + g_t; nesterov: g_t + mu B_t
            want = newton_schulz_reference(g[n] + mom * buf[n])
            rows, cols = p.shape
            rate = muon_lr * max(1.0, rows / cols) ** 0.5
            update = (before[n].double() * (1 - muon_lr * wd) - p.double()) / rate
            # Newton-Schulz in float32 (this CPU) or bfloat16 (native there): to rounding
            tol = 1e-4 if opt.muon.ns_dtype == torch.float32 else 0.03
            err = ((update - want).norm() / want.norm()).item()
            assert err < tol, (f"Muon update: {n} after step {it + 1} is {err:.2e} (relative) "
                               f"from the documented update (nesterov momentum {mom}, "
                               f"Newton-Schulz, rate {muon_lr} x sqrt(max(1, rows/cols)), "
                               f"decoupled decay {wd}), tolerance {tol} (muon.py)")
            # orthogonalised: the singular values bunched near one, not the momentum's 1 to 0.1
            s = torch.linalg.svdvals(update)
            assert s.min() > 0.5 and s.max() < 1.3, (
                f"Muon update: {n}'s update at step {it + 1} is not orthogonalised: singular "
                f"values {s.min():.3f} to {s.max():.3f}, not within (0.5, 1.3) (muon.py)")
        with torch.no_grad():  # keep the reference on the same weights for the next step
            for n, p in ref.named_parameters():
                p.copy_(dict(m.named_parameters())[n])


def run(model, opt, its):
    for it in its:
        for g in opt.param_groups:  # the training loop's schedule write (train.py)
            g["lr"] = (1 - it / 10) * g["base_lr"]
        grads(model, 100 + it)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_state_dict_round_trip_resumes_bit_exact():
    whole = tiny(seed=3)
    opt = build_optimizer(whole, 3e-3, 0.1, name="muon")
    run(whole, opt, range(4))

    first = tiny(seed=3)
    opt = build_optimizer(first, 3e-3, 0.1, name="muon")
    run(first, opt, range(2))
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = tiny(seed=99)
    resumed.load_state_dict(saved["model"])
    opt = build_optimizer(resumed, 1.0, 0.1, name="muon")
    opt.load_state_dict(saved["optimizer"])
    assert opt.muon.state and opt.adamw.state  # both optimizers' states came back
    run(resumed, opt, range(2, 4))
    for (n, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), (f"resume: {n} after 2 + 2 steps resumed from a saved "
                                   f"optimizer state differs from 4 uninterrupted steps by "
                                   f"{(a - b).abs().max():.2e} (must be bit-exact: muon.py's "
                                   f"state_dict / load_state_dict)")


def test_muon_refuses_an_adamw_state_and_unknown_names():
    m = tiny()
    with pytest.raises(ValueError, match="optimizer=adamw"):
        build_optimizer(m, 1e-3, name="muon").load_state_dict(
            build_optimizer(m, 1e-3).state_dict())
    with pytest.raises(ValueError, match="'adamw' or 'muon'"):
        build_optimizer(m, 1e-3, name="sgd")


def test_the_factory_owns_the_optimizers_rules():
    """optim.py alone decides: Muon refuses FSDP and an asked-for float16, and takes
    float32 where dtype=auto picked float16; AdamW keeps every dtype."""
    import optim
    with pytest.raises(ValueError, match="optimizer=muon does not work with fsdp=True"):
        optim.build_optimizer(tiny(), 1e-3, name="muon", fsdp=True)
    assert isinstance(optim.build_optimizer(tiny(), 1e-3, fsdp=True), torch.optim.AdamW)
    with pytest.raises(ValueError, match="dtype=float16"):
        optim.training_dtype("muon", "float16", "float16")
    assert optim.training_dtype("muon", "float16", "auto") == "float32"
    assert optim.training_dtype("adamw", "float16", "auto") == "float16"


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch < 2.9 has no torch.optim.Muon")
def test_muon_in_bfloat16_is_torch_optim_muon_to_the_bit_and_loads_its_state():
    """Our Muon in bfloat16 takes torch.optim.Muon's steps exactly (same update, same order of
    operations), and a torch.optim.Muon state_dict (checkpoints of earlier versions) resumes."""
    ours_model, torch_model = tiny(seed=5), tiny(seed=5)
    hidden = lambda m: [p for n, p in m.named_parameters() if HIDDEN.fullmatch(n)]
    ours = Muon(hidden(ours_model), lr=0.05, weight_decay=0.1, momentum=0.9,
                ns_dtype=torch.bfloat16)
    theirs = torch.optim.Muon(hidden(torch_model), lr=0.05, weight_decay=0.1, momentum=0.9)
    for it in range(3):
        if it == 2:  # resume ours from torch's state: the momentum buffers carry over
            ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # as from a file
        for m, opt in ((ours_model, ours), (torch_model, theirs)):
            grads(m, it)
            opt.step()
            opt.zero_grad()
        for a, b in zip(hidden(ours_model), hidden(torch_model)):
            assert torch.equal(a, b), (f"Muon against torch.optim.Muon: a hidden matrix "
                                       f"differs by {(a - b).abs().max():.2e} after step {it + 1}"
                                       f"{' (resumed from torch state)' if it == 2 else ''} "
                                       f"(must be bit-exact: muon.py)")


def test_muon_in_float32_where_bf16_is_emulated_and_closer_to_the_exact_update():
    """Where the device does not multiply bf16 natively (this CPU kind, most laptops) Muon
    orthogonalises in float32; in float32 it is ~100x closer to the float64 reference than in
    bfloat16, so nothing of the update is lost by leaving bf16."""
    assert build_optimizer(tiny(), 1e-3, name="muon", bf16=False).muon.ns_dtype == torch.float32
    assert build_optimizer(tiny(), 1e-3, name="muon", bf16=True).muon.ns_dtype == torch.bfloat16
    m = tiny()
    synthetic_grads(m, 0)
    g = m.blocks[0].mlp.c_fc.weight.grad
    want = newton_schulz_reference(g.double())
    err = {dt: (orthogonalise(g, Muon.COEFFICIENTS, 5, 1e-7, dt).double() - want).norm()
           / want.norm() for dt in (torch.float32, torch.bfloat16)}
    assert err[torch.float32] < 1e-5 and err[torch.bfloat16] > 1e-3, err


# ---------------------------------------------------------------------------------------
# end to end through train.py (optimizer=muon), against the same references as
# tests/test_train.py: an unbroken run for resume, one process for DDP
from test_train import TINY, load, log, make_data, max_diff, torchrun, train  # noqa: E402

MUON = [*TINY, "--dtype=float32", "--optimizer=muon"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("data")))


def test_train_py_muon_learns_and_resumes_bit_exact(data, tmp_path):
    """8 iterations straight == 4, stop, resume, 4 more: the same weights and both optimizers'
    states to the bit (the checkpoint holds Muon's momentum and AdamW's moments)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = [f"--data_dir={data}", *MUON, "--dropout=0.1"]
    train(*common, f"--out_dir={a}", "--max_iters=8", "--eval_interval=4")
    train(*common, f"--out_dir={b}", "--max_iters=4", "--eval_interval=100")
    train(*common, f"--out_dir={b}", "--max_iters=8", "--eval_interval=100", "--init_from=resume")
    ka, kb = load(a), load(b)
    assert kb["iter_num"] == 8 and ka["config"]["optimizer"] == "muon"
    assert max_diff(ka["model"], kb["model"]) == 0
    for part in ("muon", "adamw"):
        sa, sb = ka["optimizer"][part]["state"], kb["optimizer"][part]["state"]
        assert sa.keys() == sb.keys() and len(sa) > 0
        assert all(max_diff(sa[i], sb[i]) == 0 for i in sa), part
    rows = log(a)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.3


@pytest.mark.slow
def test_train_py_muon_ddp_two_ranks_match_one_process(data, tmp_path):
    """torchrun, 2 gloo ranks, accumulation 2 == one process, accumulation 2, with Muon: every
    rank orthogonalises the same averaged gradient. Not bit-equal (the all-reduce sums in
    another order), and Newton-Schulz runs in bfloat16, which can round a last-bit difference
    in the gradient to one bf16 step of the update: hence a looser bound than AdamW's."""
    args = [f"--data_dir={data}", *MUON, "--gradient_accumulation_steps=2", "--max_iters=6",
            "--eval_interval=3"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    train(*args, f"--out_dir={one}")
    torchrun(2, *args, f"--out_dir={two}")
    for r, g in zip(log(one), log(two), strict=True):
        assert abs(r["val_loss"] - g["val_loss"]) < 1e-4
    assert max_diff(load(one)["model"], load(two)["model"]) < 1e-4


def test_train_py_refuses_muon_with_fsdp_in_one_line(data, tmp_path):
    """FSDP shards each matrix over the ranks, and Muon orthogonalises whole matrices."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = train(f"--data_dir={data}", f"--out_dir={tmp_path}", *MUON, "--fsdp=True", check=False,
              RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
              MASTER_PORT=str(port))
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and all(w in lines[0].lower() for w in ("muon", "fsdp"))
    assert not os.path.exists(os.path.join(tmp_path, "ckpt.pt"))


def test_a_cpu_that_emulates_bf16_trains_and_orthogonalises_in_float32():
    """oneDNN limited to AVX2 emulates bf16 as an AVX2-only CPU does (~100x slower than
    float32), although this CPU's flags may still list avx512_bf16: dtype=auto and Muon must
    both see that and keep to float32 (the flags alone said bf16 here)."""
    code = ("import torch; from harness.device import native_bf16, pick_device; from optim import "
            "build_optimizer; from model import RoFormer, RoFormerConfig; "
            "m = RoFormer(RoFormerConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, "
            "n_embd=8)); print(pick_device('cpu', 'auto', training=True)[1], build_optimizer("
            "m, 1e-3, name='muon', bf16=native_bf16('cpu')).muon.ns_dtype)")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["float32", "torch.float32"], out.stdout + out.stderr


def test_a_wrong_optimizer_step_says_which_part_and_parameter():
    """Issue 60: this file's checks failed as `AssertionError: blocks.0.ln_1.weight`. A planted
    bug in each part (AdamW's betas; Muon's Newton-Schulz coefficients) fails naming the part,
    the parameter, the step and the distance."""
    real = build_optimizer

    def wrong_betas(*args, **kw):
        opt = real(*args, **kw)
        for g in opt.adamw.param_groups:
            g["betas"] = (0.8, 0.95)
        return opt
    with mock.patch(f"{__name__}.build_optimizer", wrong_betas), \
            pytest.raises(AssertionError) as failure:
        test_two_muon_steps_match_the_documented_update_and_adamw_part_matches_plain_adamw()
    assert str(failure.value).startswith("AdamW part: ") and " after step 2 is " in \
        str(failure.value) and "from plain AdamW's" in str(failure.value), failure.value
    with mock.patch.object(Muon, "COEFFICIENTS", (2.0, -1.5, 0.5)), \
            pytest.raises(AssertionError) as failure:
        test_two_muon_steps_match_the_documented_update_and_adamw_part_matches_plain_adamw()
    assert str(failure.value).startswith("Muon update: blocks.") and "from the documented " \
        "update" in str(failure.value), failure.value
