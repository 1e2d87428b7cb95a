"""The decode loop's performance contracts, checked by what can be observed on a CPU: no
device value read back to the host per token, one static compiled graph whose tokens equal
the eager path's, and prompt-length-independent memory for the prefill."""
import ast
import importlib
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from decode import generate, generate_stream  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402


def tiny(**kw):
    args = dict(vocab_size=61, block_size=8, n_layer=2, n_head=2, n_embd=16)
    args.update(kw)
    torch.manual_seed(0)
    return RoFormer(RoFormerConfig(**args)).eval()


class AtenLog(TorchDispatchMode):
    """Every aten op that runs inside the `with` block, by name."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_generate_reads_nothing_back_to_the_host(attention):
    """On a GPU, reading a tensor's value on the host (`.item()`, `int(t)`, `.tolist()`) waits
    for every queued kernel, so one such read per token serialises the CPU and the GPU. All of
    them go through aten's _local_scalar_dense, which runs on the CPU too, so counting it there
    shows the GPU's syncs. The old cache_step read `int(pos[0])` once per forward (11 reads
    here); now the start position is a Python int in the prefill and a device tensor in the
    per-token step. 20 tokens at block_size 8 cover the rolling window, and sampling with
    top-k and top-p covers sample_next."""
    m = tiny(attention=attention)
    idx = torch.randint(0, 61, (2, 5))
    for kw in [dict(temperature=0), dict(temperature=0.9, top_k=5, top_p=0.8)]:
        with AtenLog() as log:
            out = generate(m, idx, 20, generator=torch.Generator().manual_seed(0), **kw)
        assert out.shape == (2, 25)
        assert "aten._local_scalar_dense" not in log.ops, kw


@pytest.mark.parametrize("pos_encoding", ["rope", "sinusoidal"])
def test_position_tables_do_not_grow_with_max_new_tokens(pos_encoding):
    """sample.py --max_new_tokens=1000000000 built cos/sin for every future position (8 GB)
    although the cache rolls. The tables now hold as many rows as before decoding, in the
    same buffers, whatever max_new_tokens says, and the tokens (greedy, 40 of them: the rows
    slide 5 times at block_size 8) equal those of a model whose tables already held every
    position as plain absolute rows (the reference: nothing slides there)."""
    import copy
    m = tiny(pos_encoding=pos_encoding)
    ref = copy.deepcopy(m)
    ref.hold_positions(0, 100)
    buffer = lambda: m.rope_cos if pos_encoding == "rope" else m.sin_emb  # noqa: E731
    rows, address = buffer().size(0), buffer().data_ptr()
    prompt = torch.randint(0, 61, (2, 3))
    stream = generate_stream(m, prompt, 10 ** 6, temperature=0)
    got = torch.cat([next(stream) for _ in range(40)], dim=1)
    assert buffer().size(0) == rows and buffer().data_ptr() == address
    assert getattr(m, "table_start", 0) > 0  # the rows did slide
    assert torch.equal(got, generate(ref, prompt, 40, temperature=0)[:, 3:])



@pytest.mark.parametrize("pos_encoding", ["rope", "sinusoidal"])
def test_a_deep_chunk_slides_the_tables_instead_of_growing_them(pos_encoding):
    """Issue 36: one rule holds the rows a forward needs. A chunk of at most L positions deep
    into the sequence (prefill, eval's cached windows) is written over the L rows in place, as
    the one-token step's are, not grown to every position before it; its logits equal those
    of a model whose tables hold every position as plain rows (the reference)."""
    import copy
    m = tiny(pos_encoding=pos_encoding)
    ref = copy.deepcopy(m)
    ref.hold_positions(0, 200)
    buffer = lambda: m.rope_cos if pos_encoding == "rope" else m.sin_emb  # noqa: E731
    rows, address = buffer().size(0), buffer().data_ptr()
    idx = torch.randint(0, 61, (2, rows))
    with torch.no_grad():
        got = m(idx, cache=m.new_cache(200, "cpu"), start_pos=150)[0]
        want = ref(idx, cache=ref.new_cache(200, "cpu"), start_pos=150)[0]
    assert buffer().size(0) == rows and buffer().data_ptr() == address
    assert ref.rope_cos.size(0) >= 200 if pos_encoding == "rope" else ref.sin_emb.size(0) >= 200
    torch.testing.assert_close(got, want)


PEAK_RSS = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from model import RoFormer, RoFormerConfig
from decode import generate
torch.set_num_threads(1)
torch.manual_seed(0)
m = RoFormer(RoFormerConfig(vocab_size=61, block_size=64, n_layer=2, n_head=2, n_embd=16)).eval()
generate(m, torch.randint(0, 61, (1, 8)), 2)  # allocator and lazy init warm
idx = torch.randint(0, 61, (1, {prompt}))
generate(m, idx, 4, temperature=0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_long_prompt_peak_memory_does_not_grow_with_its_length():
    """A prompt longer than the cache used to be prefilled as one chunk attending through a
    (T, slots + T) mask: at T = 8192 and block 64 that is 8192 x 8256 scores per head (about
    0.5 GiB here in float32 plus the mask), quadratic in T. Prefilled in chunks of at most the
    cache size, the peak stays that of a 64-token prompt. Measured as peak RSS of a fresh
    process (torch's allocations are invisible to tracemalloc); the old code's peak is
    hundreds of MiB higher, the allowed slack is 8 MiB."""
    peaks = {}
    for prompt in (64, 8192):
        r = subprocess.run([sys.executable, "-c", PEAK_RSS.format(root=ROOT, prompt=prompt)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        peaks[prompt] = int(r.stdout.split()[-1]) / 1024
    assert peaks[8192] - peaks[64] < 8, peaks


def test_long_prompt_chunked_prefill_equals_token_by_token():
    """The chunked prefill (chunks of the cache size, 3.5 of them here) gives the same first
    token and the same continuation as feeding the prompt one token at a time."""
    m = tiny()
    idx = torch.randint(0, 61, (2, 28))
    got = generate(m, idx, 6, temperature=0)
    cache = m.new_cache(34, idx.device)
    for t in range(28):
        logits = m(idx[:, t:t + 1], cache=cache, start_pos=t)[0][:, -1]
    seq = [logits.argmax(-1, keepdim=True)]
    for t in range(28, 33):
        seq.append(m(seq[-1], cache=cache, start_pos=t)[0][:, -1].argmax(-1, keepdim=True))
    assert torch.equal(got[:, 28:], torch.cat(seq, 1))


def test_tensor_position_step_equals_int_position_step():
    """The static step (position as a (1,) tensor, table rows gathered) computes the same
    logits as the int-position forward, inside and past block_size, for every position
    encoding that can decode there."""
    for pos_encoding in ["rope", "sinusoidal", "none", "learned"]:
        m = tiny(pos_encoding=pos_encoding, block_size=16 if pos_encoding == "learned" else 8)
        T = 16 if pos_encoding == "learned" else 20
        idx = torch.randint(0, 61, (2, T))
        outs = []
        for as_tensor in (False, True):
            cache = m.new_cache(T, idx.device)
            m.hold_positions(0, T)
            out = [m(idx[:, :3], cache=cache, start_pos=0)[0]]
            for t in range(3, T):
                p = torch.tensor([t]) if as_tensor else t
                out.append(m(idx[:, t:t + 1], cache=cache, start_pos=p)[0])
            outs.append(torch.cat(out, 1))
        assert torch.equal(outs[0], outs[1]), pos_encoding


def test_tensor_start_pos_takes_the_int_path_for_any_chunk():
    """Issue 36: one path for positions. A prefill chunk at a tensor start_pos (its rows held)
    gives the int start_pos's logits, for every encoding with a table or none."""
    for pos_encoding in ["rope", "sinusoidal", "none", "t5"]:
        m = tiny(pos_encoding=pos_encoding, block_size=8)
        idx = torch.randint(0, 61, (2, 12))
        m.hold_positions(0, 12)
        outs = []
        for start in (3, torch.tensor([3])):
            cache = m.new_cache(12, idx.device)
            m(idx[:, :3], cache=cache, start_pos=0)
            outs.append(m(idx[:, 3:9], cache=cache, start_pos=start)[0])
        assert torch.equal(outs[0], outs[1]), pos_encoding


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_compiled_decode_gives_the_eager_tokens_from_one_graph(attention):
    """compile=True: greedy and seeded sampling give exactly the eager tokens in float32
    (sampling runs outside the compiled graph, on logits that agree), past block_size too.
    After the first compile, a second call of the same shape runs with recompilation made an
    error: the step is static (same shapes at every position, the position a tensor)."""
    m = tiny(attention=attention)
    prompt = torch.randint(0, 61, (2, 5))
    torch._dynamo.reset()
    for kw in [dict(temperature=0), dict(temperature=1.0, top_k=10, top_p=0.9)]:
        want = generate(m, prompt, 20, generator=torch.Generator().manual_seed(1), **kw)
        got = generate(m, prompt, 20, generator=torch.Generator().manual_seed(1), compile=True,
                       **kw)
        assert torch.equal(got, want), kw
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = generate(m, prompt, 20, temperature=0, compile=True)
    assert torch.equal(again, generate(m, prompt, 20, temperature=0))
    with pytest.raises(ValueError, match="use_cache"):
        generate(m, prompt, 3, compile=True, use_cache=False)


@pytest.mark.slow
def test_compiled_streams_that_skip_guards_still_run_their_own_graphs():
    """After its first call a compiled step checks only the guards that tell graphs apart
    (decode.py). Models whose parameters have the same shapes but whose graphs differ (QK-norm,
    length temperature), a second batch size, and two streams consumed in turns each still give
    their own eager tokens, and a model changed between two generations (its weights moved to
    other tensors, an option switched on) is decoded as it now is."""
    torch._dynamo.reset()
    models = [tiny(), tiny(qk_norm=True), tiny(length_temperature=0.5, block_size=4)]
    prompt = torch.randint(0, 61, (2, 5))
    for m in models + models[:1]:
        want = generate(m, prompt, 12, temperature=0)
        assert torch.equal(generate(m, prompt, 12, temperature=0, compile=True), want)
    assert torch.equal(generate(models[0], prompt[:1], 12, temperature=0, compile=True),
                       generate(models[0], prompt[:1], 12, temperature=0))
    streams = [generate_stream(m, prompt, 12, temperature=0, compile=True) for m in models[:2]]
    got = [[prompt], [prompt]]
    for tokens in zip(*streams):  # one token from each in turn
        for out, token in zip(got, tokens):
            out.append(token)
    for m, out in zip(models, got):
        assert torch.equal(torch.cat(out, 1), generate(m, prompt, 12, temperature=0))
    m = models[0]
    m.load_state_dict({k: v * 1.5 for k, v in m.state_dict().items()}, assign=True)
    m.config.qk_norm = True  # the config the layers read
    assert torch.equal(generate(m, prompt, 12, temperature=0, compile=True),
                       generate(m, prompt, 12, temperature=0))

def test_compile_leaves_no_jit_deprecation_warnings():
    """torch.compile's first compile imports torch.utils.mkldnn, whose 14 uses of
    torch.jit.script_method each warn (DeprecationWarning, raised inside torch). Re-running
    that import under the filters pytest applies to this test (pytest.ini's): none gets
    through, and a warning of ours of the same category still does."""
    import torch.utils.mkldnn as mkldnn
    with warnings.catch_warnings(record=True) as seen:  # keeps the active filters
        importlib.reload(mkldnn)
        warnings.warn("still shown", DeprecationWarning)
    assert [str(w.message) for w in seen] == ["still shown"]


PACKAGES = ("harness", "formats")


def imported_modules(path):
    """The dotted names of every module the file at `path` imports, wherever it does
    (`from harness import x` counts as harness.x, and so for every package folder)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            names |= {f"{n.module}.{a.name}" for a in n.names} if n.module in PACKAGES else {n.module}
    return names


def test_sample_py_is_a_script_that_nothing_imports():
    """sample.py is the command line only: no project module (harness/, formats/, the scripts, bench/) imports
    it, since the decoding is decode.py and the run loader harness/load.py; and the decoding
    needs nothing of the project past the model's caches and rules (no loader, no tokenizer,
    no checkpoint)."""
    importers = []
    for folder, _, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        # not tests/, nor bench/results/: bench/compare.py keeps copies of the code it ran there
        if rel != "." and (rel.startswith(".") or rel.split(os.sep)[0] == "tests" or
                           rel.startswith(os.path.join("bench", "results"))):
            continue
        importers += [os.path.relpath(os.path.join(folder, name), ROOT) for name in files
                      if name.endswith(".py") and
                      "sample" in imported_modules(os.path.join(folder, name))]
    assert importers == [], f"these import sample.py, a script: {importers}"
    used = {m for m in imported_modules(os.path.join(ROOT, "decode.py"))  # the project's only
            if m.split(".")[0] not in sys.stdlib_module_names | {"torch"}}
    assert "caches" in used and used <= {"caches", "model", "model_checks", "harness.common"}, used


def test_learned_positions_past_block_size_are_refused_in_one_line():
    """The int path checks the positions against the one table that cannot grow (wpe) before
    any layer runs: uncached and cached, one ValueError naming the limit, not an IndexError."""
    m = tiny(pos_encoding="learned")
    for kw in [dict(), dict(cache=m.new_cache(20, "cpu"), start_pos=5)]:
        with pytest.raises(ValueError, match="learned positions end at block_size=8"):
            m(torch.zeros(1, 9 if not kw else 4, dtype=torch.long), **kw)



def stepped_logits(model, idx, split):  # a prefill, then one cached token at a time
    cache = model.new_cache(idx.size(1), "cpu")
    return torch.cat([model(idx[:, :split], cache=cache)[0]] + [model(
        idx[:, t:t + 1], cache=cache, start_pos=t)[0] for t in range(split, idx.size(1))], 1), cache


@pytest.mark.parametrize("global_every,total,slots", [(0, 24, [3, 3, 3]), (2, 8, [3, 8, 3])])
def test_local_layers_cache_only_their_window_and_decode_as_the_full_forward(global_every,
                                                                              total, slots):
    """window=3: a local layer keeps 3 slots, a global one (global_every=2: layer 1) the
    context window (8); the cached logits, past the local window (and, all local, 3x past the
    context window), are the uncached forward's, whose local layers mask their own band."""
    m = tiny(n_layer=3, window=3, global_every=global_every, local_rope_base=100.0)
    idx = torch.randint(0, 61, (2, total), generator=torch.Generator().manual_seed(0))
    for split in (1, 5):
        got, cache = stepped_logits(m, idx, split)
        assert [k.size(2) for k in cache.keys] == slots
        assert torch.allclose(got, m(idx)[0], atol=1e-5)
