"""The relative position baselines (pos_encoding shaw, t5, alibi) against references written
out here: T5's bucket formula and ALiBi's slopes from the papers, Shaw's term with the
(L, L, D) embeddings materialised, a float64 model with the biases added score by score, and
uncached / banded / shifted recomputation of the same logits."""
import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import baselines  # noqa: E402
from baselines import alibi_slopes, shaw_bias, t5_bucket  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402
from test_model import cached_logits  # noqa: E402
from decode import generate  # noqa: E402

RELATIVE = ["shaw", "t5", "alibi"]


def tiny(pos_encoding, **kw):
    """3 heads (not a power of two, for ALiBi), small clip and buckets so that 24 tokens
    reach every regime; weights scaled up so that a wrong bias moves the logits."""
    args = dict(vocab_size=61, block_size=16, n_layer=2, n_head=3, n_embd=24,
                pos_encoding=pos_encoding, rel_clip=5, t5_buckets=8, t5_max_distance=12)
    args.update(kw)
    torch.manual_seed(0)
    m = RoFormer(RoFormerConfig(**args)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    return m


def paper_bucket(n, num_buckets, max_distance):
    """T5's causal bucket of a distance n = i - j >= 0, as the paper's code computes it."""
    exact = num_buckets // 2
    if n < exact:
        return n
    return min(num_buckets - 1,
               exact + int(math.log(n / exact) / math.log(max_distance / exact)
                           * (num_buckets - exact)))


def paper_slopes(n):
    """ALiBi slopes as the paper's code builds them (recursively for non powers of two)."""
    def pow2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** math.floor(math.log2(n))
    return pow2(closest) + paper_slopes(2 * closest)[0::2][:n - closest]


def naive_forward(model, idx, window=None):
    """The model in float64 with every score written as q_i.k_j/sqrt(D) + bias(i, j): Shaw's
    a_ij materialised as an (L, L, D) tensor, T5's bucket and ALiBi's slope from the
    functions above; causal, and banded to `window` positions if given."""
    c = model.config
    W = {k: v.double() for k, v in model.state_dict().items()}
    B, T = idx.shape
    H, D = c.n_head, c.n_embd // c.n_head
    ln = lambda x, p: torch.nn.functional.layer_norm(x, (c.n_embd,), W[p + ".weight"])  # noqa
    lin = lambda x, p: x @ W[p + ".weight"].T  # noqa
    dist = [[i - j for j in range(T)] for i in range(T)]
    allowed = torch.tensor([[0 <= n < (window or T + 1) for n in row] for row in dist])
    fixed = torch.zeros(H, T, T, dtype=torch.float64)  # t5 / alibi: the same in every layer
    for i in range(T):
        for j in range(i + 1):
            for h in range(H):
                if c.pos_encoding == "t5":
                    b = paper_bucket(i - j, c.t5_buckets, c.t5_max_distance)
                    fixed[h, i, j] = W["rel_bias.weight"][b, h]
                elif c.pos_encoding == "alibi":
                    fixed[h, i, j] = -paper_slopes(H)[h] * (i - j)
    x = W["wte.weight"][idx]
    for layer in range(c.n_layer):
        p = f"blocks.{layer}."
        q, k, v = lin(ln(x, p + "ln_1"), p + "attn.c_attn").view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        att = q @ k.transpose(-1, -2) / math.sqrt(D) + fixed
        if c.pos_encoding == "shaw":
            table = W[p + "attn.rel_k.weight"]
            a = torch.stack([torch.stack([table[min(max(n, 0), c.rel_clip)] for n in row])
                             for row in dist])  # (T, T, D)
            att = att + torch.einsum("bhid,ijd->bhij", q, a) / math.sqrt(D)
        y = att.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        x = x + lin(y.transpose(1, 2).reshape(B, T, c.n_embd), p + "attn.c_proj")
        h = lin(ln(x, p + "ln_2"), p + "mlp.c_fc")
        x = x + lin(0.5 * h * (1 + torch.erf(h / math.sqrt(2))), p + "mlp.c_proj")
    return ln(x, "ln_f") @ W["wte.weight"].T


# --- the bias functions --------------------------------------------------------------

def test_t5_buckets_match_the_papers_formula():
    d = torch.arange(0, 400)
    for nb, md in ((32, 128), (8, 12), (16, 40)):
        want = torch.tensor([paper_bucket(n, nb, md) for n in range(400)])
        assert torch.equal(t5_bucket(d, nb, md), want)
    # a few by hand, T5 defaults: exact below 16, log-spaced up to 128, then the last bucket
    got = t5_bucket(torch.tensor([0, 1, 15, 16, 20, 64, 127, 128, 5000]), 32, 128).tolist()
    assert got == [0, 1, 15, 16, 17, 26, 31, 31, 31]
    assert t5_bucket(torch.tensor([-3]), 32, 128).item() == 0  # future keys: masked anyway


def test_alibi_slopes_for_8_and_12_heads():
    assert alibi_slopes(8) == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    # 12 heads: the 8-head slopes, then every other slope of 16 heads from the first
    want12 = [2 ** -k for k in range(1, 9)] + [2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]
    assert alibi_slopes(12) == pytest.approx(want12, rel=1e-12)
    for n in (1, 2, 3, 5, 6, 7, 16, 24):
        assert alibi_slopes(n) == pytest.approx(paper_slopes(n), rel=1e-12)


def test_shaw_term_equals_materialised_embeddings():
    torch.manual_seed(1)
    q = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    table = torch.randn(4, 8, dtype=torch.float64)  # rel_clip 3
    qpos, kpos = torch.arange(40, 47), torch.tensor([-1, 30, 38, 41, 44, 45, 46, 40])
    d = qpos[:, None] - kpos[None, :]
    a = table[d.clamp(0, 3)]  # (7, 8, D): what the gather avoids
    want = torch.einsum("bhid,ijd->bhij", q, a) / math.sqrt(8)
    got = shaw_bias(q, table, d)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_bias_is_built_in_float32_for_a_bf16_model():
    m = tiny("alibi").to(torch.bfloat16)
    d = torch.tensor([[0, 1, 1000, 4097]])
    bias = baselines.position_bias(m, d, d >= 0)
    assert bias.dtype == torch.float32
    want = torch.tensor(paper_slopes(3))[:, None, None] * -d.double()
    assert torch.allclose(bias.double(), want, rtol=1e-7)  # bf16 would be off by ~4 at 4097


def test_linear_attention_with_a_relative_bias_is_a_config_error():
    for pe in RELATIVE:
        with pytest.raises(ValueError, match="score"):
            RoFormerConfig(attention="linear", pos_encoding=pe)
    with pytest.raises(ValueError, match="t5_max_distance"):
        RoFormerConfig(pos_encoding="t5", t5_buckets=32, t5_max_distance=16)
    with pytest.raises(ValueError, match="rel_clip"):
        RoFormerConfig(pos_encoding="shaw", rel_clip=0)


def test_t5_with_fewer_than_two_buckets_is_one_line_naming_the_value():
    """--pos_encoding=t5 --t5_buckets=1 left no exact bucket (t5_buckets // 2 = 0) and divided
    by it: a ZeroDivisionError traceback at the first forward. Two buckets (one exact, one
    log-spaced) is the least that builds and runs."""
    with pytest.raises(ValueError) as e:
        RoFormerConfig(pos_encoding="t5", t5_buckets=1)
    assert "t5_buckets=1" in str(e.value) and "t5_buckets >= 2" in str(e.value), str(e.value)
    m = RoFormer(RoFormerConfig(vocab_size=61, block_size=16, n_layer=1, n_head=2, n_embd=16,
                                pos_encoding="t5", t5_buckets=2, t5_max_distance=4))
    assert torch.isfinite(m(torch.randint(0, 61, (1, 16)))[0]).all()


# --- the model -----------------------------------------------------------------------

@pytest.mark.parametrize("pos_encoding", RELATIVE)
def test_forward_matches_naive_reference(pos_encoding):
    m = tiny(pos_encoding)
    idx = torch.randint(0, 61, (2, 16))
    assert torch.allclose(m(idx)[0].double(), naive_forward(m, idx), atol=1e-4)


@pytest.mark.parametrize("pos_encoding", RELATIVE)
def test_causality(pos_encoding):
    m = tiny(pos_encoding)
    idx = torch.randint(0, 61, (1, 16))
    other = idx.clone()
    other[0, 9] = (idx[0, 9] + 1) % 61
    a, b = m(idx)[0], m(other)[0]
    assert torch.allclose(a[:, :9], b[:, :9], atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:], atol=1e-3)


@pytest.mark.parametrize("pos_encoding", RELATIVE)
def test_cached_logits_equal_uncached_inside_block(pos_encoding):
    m = tiny(pos_encoding)
    idx = torch.randint(0, 61, (2, 16))
    want = m(idx)[0]
    for split in (1, 5):
        assert (cached_logits(m, idx, split) - want).abs().max() < 1e-4


@pytest.mark.parametrize("pos_encoding", RELATIVE)
def test_rolling_cache_is_sliding_window_attention(pos_encoding):
    """3x past block_size, two layers: the cached logits equal a float64 forward over the
    whole sequence with a banded mask of width block_size, fed token by token or as one
    chunked prefill wider than the buffer."""
    m = tiny(pos_encoding, block_size=8)
    idx = torch.randint(0, 61, (1, 24))
    want = naive_forward(m, idx, window=8)
    assert torch.allclose(cached_logits(m, idx, split=3).double(), want, atol=1e-4)
    assert torch.allclose(m(idx, cache=m.new_cache(24, idx.device), start_pos=0)[0].double(),
                          want, atol=1e-4)


@pytest.mark.parametrize("pos_encoding", RELATIVE)
def test_one_layer_rolling_cache_equals_recomputing_the_window(pos_encoding):
    """With one layer the sliding window is exactly crop-and-recompute, because a relative
    bias sees distances only: the last block_size tokens rerun from position 0 give the
    same scores."""
    m = tiny(pos_encoding, block_size=8, n_layer=1)
    idx = torch.randint(0, 61, (1, 24))
    got = cached_logits(m, idx, split=3)
    want = torch.stack([m(idx[:, max(0, t - 7):t + 1])[0][:, -1] for t in range(24)], dim=1)
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("pos_encoding", RELATIVE + ["sinusoidal"])
def test_shift_invariance(pos_encoding):
    """Positions 100.. give the logits of positions 0.. (a cached forward starting at 100
    into an empty cache); an absolute encoding must fail the same check."""
    m = tiny(pos_encoding)
    idx = torch.randint(0, 61, (2, 16))
    shifted = m(idx, cache=m.new_cache(116, idx.device), start_pos=100)[0]
    same = torch.allclose(shifted, m(idx)[0], atol=1e-4)
    assert same == (pos_encoding != "sinusoidal")


@pytest.mark.parametrize("pos_encoding", RELATIVE)
def test_generate_past_block_size_follows_the_sliding_window(pos_encoding):
    m = tiny(pos_encoding, block_size=8)
    prompt = torch.randint(0, 61, (1, 3))
    out = generate(m, prompt, 21, temperature=0)
    assert out.shape == (1, 24) and torch.equal(out[:, :3], prompt)
    # every greedy token is the argmax of the banded float64 model on the tokens before it
    ref = naive_forward(m, out[:, :-1], window=8).argmax(-1)
    assert torch.equal(out[:, 3:], ref[:, 2:])


@pytest.mark.parametrize("pos_encoding", RELATIVE)
def test_compiled_training_step_matches_eager(pos_encoding):
    """torch.compile (inductor, whole graph: the training path builds its mask from an
    arange, with no graph break): eager's loss and gradients. One layer keeps it short."""
    m = tiny(pos_encoding, n_layer=1).train()
    idx = torch.randint(0, 61, (2, 16))
    loss = m(idx, idx)[1]
    loss.backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    torch._dynamo.reset()
    closs = torch.compile(m, fullgraph=True, dynamic=False)(idx, idx)[1]
    closs.backward()
    assert abs(closs.item() - loss.item()) < 1e-5
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, want[n], atol=1e-5), n


def test_checkpoints_reload_in_sample_py(tmp_path, capsys):
    """train.py takes the new keys and writes a checkpoint; sample.py prints from it exactly
    the tokens generate() draws with the same seed, past block_size (rolling cache)."""
    test_sample = pytest.importorskip("test_sample")  # its tiny corpus and tokenizer builder
    import sample
    data = tmp_path / "data"
    data.mkdir()
    sp = test_sample.train_tokenizer(str(data / "tokenizer.model"), byte_fallback=True)
    arr = np.array(sp.encode("\n".join(test_sample.LINES * 3)), dtype=np.uint16)
    n = int(0.9 * len(arr))
    arr[:n].tofile(data / "train.bin")
    arr[n:].tofile(data / "val.bin")
    sha = hashlib.sha256((data / "tokenizer.model").read_bytes()).hexdigest()
    meta = {"name": "tiny", "vocab_size": sp.get_piece_size(), "dtype": "uint16",
            "eos_id": sp.eos_id(), "bos_id": sp.bos_id(), "train_tokens": n,
            "val_tokens": len(arr) - n, "train_docs": 1, "val_docs": 1, "source": "test",
            "source_bytes": 0, "source_sha256": "",
            "tokenizer": {"model_type": "bpe", "vocab_size": sp.get_piece_size(), "sha256": sha}}
    (data / "meta.json").write_text(json.dumps(meta))
    procs = {}
    for pe in RELATIVE:  # the three trainings side by side
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={data}",
               "--dataset=tiny", f"--out_dir={tmp_path / pe}", "--device=cpu",
               "--dtype=float32", "--compile=False", "--n_layer=2", "--n_head=3", "--n_embd=24",
               "--block_size=16", "--batch_size=4", "--max_iters=4", "--lr_decay_iters=4",
               "--warmup_iters=1", "--eval_interval=4", "--eval_iters=1",
               f"--pos_encoding={pe}", "--rel_clip=4", "--t5_buckets=8", "--t5_max_distance=12"]
        procs[pe] = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
    for pe, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    prompt = "The fox"
    for pe in RELATIVE:
        out_dir = str(tmp_path / pe)
        ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)
        assert ckpt["model_args"]["pos_encoding"] == pe and ckpt["model_args"]["rel_clip"] == 4
        (want,) = test_sample.reference(out_dir, sp.encode(prompt), 40, 5, temperature=1.0)
        capsys.readouterr()
        sample.main([f"--out_dir={out_dir}", f"--start={prompt}", "--max_new_tokens=40",
                     "--temperature=1.0", "--top_k=0", "--stop_at_eos=False", "--seed=5"])
        assert capsys.readouterr().out == sp.decode(want) + "\n"


def test_an_uncached_forward_builds_the_bias_once_for_all_layers(monkeypatch):
    """Every layer of an uncached forward attends to the same keys: the bias (t5's embedding
    lookup and its backward) is built once per forward, not once per layer, as a cached
    forward builds it per layer from the keys its cache returns."""
    m = tiny("t5")
    calls = []
    real = baselines.position_bias
    monkeypatch.setattr(baselines, "position_bias",
                        lambda m, d, v: calls.append(d.shape) or real(m, d, v))
    m(torch.randint(0, 61, (1, 8)))
    assert len(m.blocks) > 1 and calls == [(8, 8)]
