"""
sample.py against independent references: the full-sequence decode of the tokens that
decode.generate returns with the same seed, the uncached loop, and sentencepiece's own decode
of random id sequences. The checkpoints are made here by training a few steps with the real
train.py on a tiny corpus and a tiny sentencepiece tokenizer built in the test.
"""
import hashlib
import importlib.util
import io
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
spm = pytest.importorskip("sentencepiece")
import sample  # noqa: E402
import decode as decoding  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402

BLOCK = 32
# Steps of a 32-wide model are far too small to split across threads; on a busy 2-core
# machine the extra thread only waits (measured: 10x slower). One thread for this module's
# tests and for the train.py subprocesses; restored afterwards for the other test files.
ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
# English, code and characters outside the vocabulary (they go through byte fallback)
LINES = [f"def f{i}(x):\n    return x * {i} + {i * i}  # café {i}" for i in range(60)] + \
        [f"The {w} jumped over the {v} near the river bank." for w in ("fox", "cat", "dog")
         for v in ("fence", "wall", "log")] + ["naïve façade — ünïcödé λ → ∑ 世界 🙂"] * 3


def train_tokenizer(path, byte_fallback):
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES), model_writer=buf, model_type="bpe",
        vocab_size=320 if byte_fallback else 120, byte_fallback=byte_fallback,
        character_coverage=0.995, unk_id=0, bos_id=-1, eos_id=1, pad_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return spm.SentencePieceProcessor(model_file=path)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny dataset in the data layout, and softmax and linear checkpoints trained on it."""
    root = tmp_path_factory.mktemp("sample")
    data = root / "data"
    data.mkdir()
    sp = train_tokenizer(str(data / "tokenizer.model"), byte_fallback=True)
    ids = []
    for i in range(40):
        ids += sp.encode("\n".join(LINES[i % len(LINES):][:10])) + [sp.eos_id()]
    arr = np.array(ids, dtype=np.uint16)
    n = int(0.9 * len(arr))
    arr[:n].tofile(data / "train.bin")
    arr[n:].tofile(data / "val.bin")
    meta = {"name": "tiny", "vocab_size": sp.get_piece_size(), "dtype": "uint16",
            "eos_id": sp.eos_id(), "bos_id": sp.bos_id(), "train_tokens": n,
            "val_tokens": len(arr) - n, "train_docs": 36, "val_docs": 4, "source": "test",
            "source_bytes": 0, "source_sha256": "",
            "tokenizer": {"model_type": "bpe", "vocab_size": sp.get_piece_size(),
                          "sha256": hashlib.sha256((data / "tokenizer.model").read_bytes()).hexdigest()}}
    (data / "meta.json").write_text(json.dumps(meta))
    outs = {}
    for attention in ("softmax", "linear"):
        out = root / f"out-{attention}"
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={data}",
               "--dataset=tiny", f"--out_dir={out}", "--device=cpu", "--dtype=float32",
               "--compile=False", "--n_layer=2", "--n_head=2", "--n_embd=32",
               f"--block_size={BLOCK}", "--batch_size=8", "--max_iters=20",
               "--lr_decay_iters=20", "--warmup_iters=2", "--eval_interval=20", "--eval_iters=2",
               "--learning_rate=1e-2", f"--attention={attention}", "--linear_chunk=8"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(root), timeout=300,
                           env=ENV)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[attention] = str(out)
    return {"root": root, "sp": sp, "data": data, **outs}


def run(capsys, *args):
    """sample.py in this process (no second torch import); returns (stdout, stderr)."""
    capsys.readouterr()
    sample.main(list(args))
    return capsys.readouterr()


def err(capsys, *args):
    """The one-line message of a sample.py error."""
    with pytest.raises(SystemExit) as e:
        sample.main(list(args))
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def reference(out_dir, prompt_ids, n, seed, num_samples=1, **kw):
    """Tokens from decode.generate (not the stream) with sample.py's seeding, each row cut at
    the first end-of-document token, decoded in one go."""
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=True)
    args = dict(ckpt["model_args"], **{k: kw.pop(k) for k in ("rope_scaling", "rope_factor",
                                                   "length_temperature") if k in kw})
    model = RoFormer(RoFormerConfig(**args)).eval()
    model.load_state_dict(ckpt["model"])
    x = torch.tensor(prompt_ids)[None].repeat(num_samples, 1)
    y = decoding.generate(model, x, n, generator=torch.Generator().manual_seed(seed), **kw)
    rows = []
    for row in y[:, len(prompt_ids):].tolist():
        rows.append(prompt_ids + (row[:row.index(1)] if 1 in row else row))  # eos_id is 1
    return rows


def sharpened(src, dst):
    """Checkpoint src with fresh random weights made sharp (q and k x30, attention output x30,
    final norm gain x5), saved in folder dst. A checkpoint from a few training steps has
    nearly uniform attention, a residual stream dominated by the token embedding and flat
    logits: an off-by-one cache position there changes no drawn token (measured), so a test
    on it could not fail. Sharp attention that matters, and sharp but varied logits, make
    positions show in the sampled text."""
    ckpt = torch.load(os.path.join(src, "ckpt.pt"), weights_only=True)
    torch.manual_seed(0)
    ckpt["model"] = RoFormer(RoFormerConfig(**ckpt["model_args"])).state_dict()
    for k, w in ckpt["model"].items():
        if k.endswith("attn.c_attn.weight"):
            w[: 2 * w.size(1)] *= 30.0
        if k.endswith("attn.c_proj.weight"):
            w *= 30.0
        if k == "ln_f.weight":
            w *= 5.0
    ckpt.pop("digest", None)  # other weights: not the ones train.py's digest is of
    torch.save(ckpt, os.path.join(dst, "ckpt.pt"))
    return f"--out_dir={dst}"


# --- the stream decoder -----------------------------------------------------------------

def test_text_stream_equals_full_decode_on_random_ids(ws):
    """Random ids, heavy on byte pieces (incomplete and invalid UTF-8) and word-initial
    pieces, pushed 1-3 at a time: what the stream prints, concatenated, is sp.decode."""
    sp = ws["sp"]
    V = sp.get_piece_size()
    bytes_ids = [i for i in range(V) if sp.is_byte(i)]
    words = [i for i in range(V) if sp.id_to_piece(i).startswith("\u2581")]
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.choice((bytes_ids, words, range(V))[rng.randrange(3)])
               for _ in range(rng.randint(1, 30))]
        s, printed, k = decoding.TextStream(sp), "", 0
        while k < len(ids):
            step = rng.randint(1, 3)
            printed += s.push(ids[k:k + step])
            k += step
        assert printed + s.flush() == sp.decode(ids)


def test_text_stream_holds_back_partial_characters(ws):
    sp = ws["sp"]
    ids = sp.encode("a 🙂 b")
    assert sum(sp.is_byte(i) for i in ids) == 4  # the emoji is four byte pieces
    s = decoding.TextStream(sp)
    pieces = [s.push([i]) for i in ids]
    assert "\ufffd" not in "".join(pieces) and "🙂" in pieces  # the emoji comes out whole
    assert "".join(pieces) + s.flush() == "a 🙂 b"


# --- sampling -------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_fixed_seed_repeats_and_seeds_differ(ws, capsys, attention):
    a = ("--out_dir=" + ws[attention], "--start=def f", "--max_new_tokens=40", "--temperature=1.5",
         "--top_k=0", "--stop_at_eos=False")
    one, two = run(capsys, *a, "--seed=7").out, run(capsys, *a, "--seed=7").out
    assert one == two
    assert run(capsys, *a, "--seed=8").out != one


@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_cached_equals_uncached_inside_block(ws, capsys, tmp_path, attention, temperature):
    """Greedy can hide a cache position bug; sampled text with the same seed shows it."""
    prompt_len = len(ws["sp"].encode("def f1(x):"))
    a = (sharpened(ws[attention], tmp_path), "--start=def f1(x):", f"--temperature={temperature}",
         "--top_k=0", f"--max_new_tokens={BLOCK - prompt_len}", "--stop_at_eos=False", "--seed=3")
    cached = run(capsys, *a)
    uncached = run(capsys, *a, "--use_cache=False")
    assert cached.out == uncached.out
    assert "cache on" in cached.err and "cache off" in uncached.err


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_stream_equals_decode_of_generated_tokens(ws, capsys, attention):
    """Unicode prompt, high temperature (byte pieces come out), three samples in one batch:
    each printed sample is the one-shot decode of the tokens decode.generate draws with the
    same seed, cut at the end-of-document token."""
    sp, prompt = ws["sp"], "naïve 世界 🙂 λ"
    out = run(capsys, "--out_dir=" + ws[attention], f"--start={prompt}", "--max_new_tokens=40",
              "--temperature=2.0", "--top_k=0", "--num_samples=3", "--seed=11").out
    ref = reference(ws[attention], sp.encode(prompt), 40, 11, num_samples=3, temperature=2.0)
    assert out == "\n---------------\n".join(sp.decode(r) for r in ref) + "\n"
    assert out.startswith(prompt)


def padded_vocab(src, dst, pad):
    """Checkpoint src with vocab_size padded by `pad` ids past the tokenizer's pieces (train.py
    allows a padded vocab_size) and weights that make those ids dominate every step: the final
    norm outputs the constant e_0 (gain 0, bias e_0), and the tied embedding's column 0 is 0
    for real ids and 50 for padded ones, so every real id's logit is 0 and every padded id's 50."""
    ckpt = torch.load(os.path.join(src, "ckpt.pt"), weights_only=True)
    pieces = ckpt["model_args"]["vocab_size"]
    ckpt["model_args"] = dict(ckpt["model_args"], vocab_size=pieces + pad, bias=True)
    torch.manual_seed(0)
    model = RoFormer(RoFormerConfig(**ckpt["model_args"]))
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.zero_()
        model.ln_f.bias[0] = 1.0
        model.wte.weight[:, 0] = 0.0
        model.wte.weight[pieces:, 0] = 50.0
    ckpt["model"] = model.state_dict()
    ckpt.pop("digest", None)  # other weights: not the ones train.py's digest is of
    torch.save(ckpt, os.path.join(dst, "ckpt.pt"))
    return model.eval(), pieces


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_padded_vocab_never_samples_ids_the_tokenizer_lacks(ws, capsys, tmp_path, temperature):
    """A model whose vocab_size exceeds the tokenizer's pieces, its padded ids far likelier
    than any real one: sample.py draws only ids the tokenizer decodes (uniformly among them
    here, all real logits being equal) and prints their decode."""
    model, pieces = padded_vocab(ws["softmax"], tmp_path, pad=64)
    sp, prompt = ws["sp"], ws["sp"].encode("def f")
    assert sp.get_piece_size() == pieces
    x = torch.tensor(prompt)[None]
    unlimited = decoding.generate(model, x, 20, temperature=float(temperature))[0, len(prompt):]
    assert (unlimited >= pieces).all()  # the setup works: unmasked, only padded ids come out
    out = run(capsys, f"--out_dir={tmp_path}", "--start=def f", "--max_new_tokens=40",
              f"--temperature={temperature}", "--top_k=0", "--stop_at_eos=False", "--seed=4").out
    (ref,) = reference(str(tmp_path), prompt, 40, 4, temperature=float(temperature),
                       vocab_limit=pieces)
    assert max(ref) < pieces
    assert out == sp.decode(ref) + "\n"
    if temperature == "1.0":  # sampled among the real ids, not collapsed onto one
        assert len(set(ref[len(prompt):])) > 10


def test_vanishing_temperature_is_greedy(ws, capsys):
    """Temperatures below generate.GREEDY_BELOW decode greedily (float32 logits divided by
    1e-45 overflow to inf and NaN probabilities); just above the floor it still samples:
    two logits 2**-17 (7.6e-6) apart at temperature 1e-5 are drawn about 32/68."""
    a = ("--out_dir=" + ws["softmax"], "--start=def f", "--max_new_tokens=30", "--top_k=0",
         "--stop_at_eos=False", "--seed=9")
    assert run(capsys, *a, "--temperature=1e-45").out == run(capsys, *a, "--temperature=0").out
    logits = torch.tensor([[1.0, 1.0 + 2 ** -17, -5.0]])
    assert decoding.sample_next(logits, temperature=1e-45).item() == 1
    g = torch.Generator().manual_seed(0)
    draws = [decoding.sample_next(logits, temperature=1e-5, generator=g).item()
             for _ in range(400)]
    p1 = 1 / (1 + torch.exp(torch.tensor(-(2 ** -17) / 1e-5, dtype=torch.float64)).item())
    assert abs(draws.count(1) / 400 - p1) < 0.08 and draws.count(2) == 0


@pytest.mark.slow
def test_compile_auto_switches_by_length_and_keeps_the_text(ws, capsys, monkeypatch):
    """--compile=auto stays eager for a short CPU run (compiling would cost more than it
    saves) and compiles once the requested length passes the measured break-even (lowered
    here so the test stays short); the compiled step prints the same sampled text as the
    eager one, past block_size (the rolling cache) and with a seed."""
    a = ("--out_dir=" + ws["softmax"], "--start=def f", f"--max_new_tokens={2 * BLOCK}",
         "--temperature=1.0", "--top_k=0", "--stop_at_eos=False", "--seed=5")
    eager = run(capsys, *a)
    assert "compile off" in eager.err
    monkeypatch.setitem(sample.COMPILE_PAYS_AFTER, "cpu", 2 * BLOCK)
    compiled = run(capsys, *a)
    assert "compile on" in compiled.err
    assert compiled.out == eager.out
    assert "compile off" in run(capsys, *a, "--compile=False").err


def test_prompt_from_file(ws, capsys, tmp_path):
    text = "def f3(x):\n    return x * 3  # café"
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    a = ("--out_dir=" + ws["softmax"], "--temperature=0", "--max_new_tokens=12")
    from_file = run(capsys, *a, f"--start=FILE:{tmp_path / 'prompt.txt'}").out
    assert from_file == run(capsys, *a, f"--start={text}").out
    assert from_file.startswith(text)


def test_prompt_file_is_read_byte_for_byte(ws, capsys, tmp_path):
    """CRLF line ends (and a lone CR) reach the model as they are in the file: training keeps
    "\r", so a prompt file must not be turned into other text by newline translation."""
    text = "def f3(x):\r\n    return x * 3\r\n# café\r"
    (tmp_path / "crlf.txt").write_bytes(text.encode("utf-8"))
    assert len(ws["sp"].encode(text)) != len(ws["sp"].encode(text.replace("\r", "")))
    a = ("--out_dir=" + ws["softmax"], "--temperature=0", "--max_new_tokens=8", "--stop_at_eos=False")
    from_file = run(capsys, *a, f"--start=FILE:{tmp_path / 'crlf.txt'}").out
    assert from_file.startswith(text)
    (ref,) = reference(ws["softmax"], ws["sp"].encode(text), 8, 1337, temperature=0)
    assert from_file == ws["sp"].decode(ref) + "\n"


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_generation_past_block_size(ws, capsys, attention):
    """3x past block_size: the rolling window (softmax) / recurrent state (linear) runs, and
    prints exactly the generated tokens; the uncached loop (crop and recompute) runs too."""
    sp, n = ws["sp"], 3 * BLOCK
    a = ("--out_dir=" + ws[attention], "--start=The fox", f"--max_new_tokens={n}",
         "--temperature=1.0", "--top_k=0", "--stop_at_eos=False", "--seed=5")
    out = run(capsys, *a)
    (ref,) = reference(ws[attention], sp.encode("The fox"), n, 5, temperature=1.0)
    assert len(ref) == len(sp.encode("The fox")) + n
    assert out.out == sp.decode(ref) + "\n"
    assert f"{n - 1} steps" in out.err
    assert run(capsys, *a, "--use_cache=False").out  # crop-and-recompute also goes past it


@pytest.mark.parametrize("scaling", ["ntk", "yarn"])
def test_rope_scaling_override_reaches_the_model(ws, capsys, tmp_path, scaling):
    """Sharpened attention (q/k weights x8) so positions visibly steer sampling; then the
    text under --rope_scaling=ntk (or yarn) is the reference model's with that config, not the
    plain one's."""
    sharpened(ws["softmax"], tmp_path)
    sp, n = ws["sp"], 2 * BLOCK
    a = (f"--out_dir={tmp_path}", "--start=def f", f"--max_new_tokens={n}",
         "--temperature=1.0", "--top_k=0", "--stop_at_eos=False", "--seed=2")
    r = run(capsys, *a, f"--rope_scaling={scaling}", "--rope_factor=4")
    assert f"rope_scaling {scaling} x4" in r.err
    (ref,) = reference(str(tmp_path), sp.encode("def f"), n, 2, temperature=1.0,
                       rope_scaling=scaling, rope_factor=4.0)
    assert r.out == sp.decode(ref) + "\n"
    assert r.out != run(capsys, *a).out  # the override changed what was sampled


def test_length_temperature_override_reaches_the_model(ws, capsys, tmp_path):
    """--length_temperature=t samples past the trained context as the reference model with t in
    its config does (sharpened attention, as above), not as the plain one; the summary says t."""
    sharpened(ws["softmax"], tmp_path)
    sp, n = ws["sp"], 2 * BLOCK
    a = (f"--out_dir={tmp_path}", "--start=def f", f"--max_new_tokens={n}",
         "--temperature=1.0", "--top_k=0", "--stop_at_eos=False", "--seed=2")
    # t = 8: the sharpened attention is near one-hot, and t = 2 (q at most 2.4x at twice the
    # context) changed no drawn token for some random weights, so the last assert could not fail
    r = run(capsys, *a, "--length_temperature=8")
    assert "length temperature 8" in r.err
    (ref,) = reference(str(tmp_path), sp.encode("def f"), n, 2, temperature=1.0,
                       length_temperature=8.0)
    assert r.out == sp.decode(ref) + "\n"
    assert r.out != run(capsys, *a).out  # the override changed what was sampled


def test_an_empty_out_dir_is_named_as_empty(capsys):
    """--out_dir= used to be "out_dir '' does not exist"; sample.py, eval.py and export.py
    share load_run, which says what is wrong with it."""
    assert "out_dir is empty" in err(capsys, "--out_dir=")


def test_empty_prompt_starts_a_document_with_a_note(ws, capsys):
    r = run(capsys, "--out_dir=" + ws["softmax"], "--start=", "--max_new_tokens=20",
            "--stop_at_eos=False", "--seed=1")
    assert "note: empty prompt" in r.err and r.out.strip()
    (ref,) = reference(ws["softmax"], [1], 20, 1, temperature=0.8, top_k=200)
    assert r.out == ws["sp"].decode(ref) + "\n"


def test_output_piped_into_head_closes_quietly(ws):
    cmd = (f"set -o pipefail; {sys.executable} {os.path.join(ROOT, 'sample.py')} "
           f"--out_dir={ws['softmax']} --max_new_tokens=3000 --stop_at_eos=False | head -c 20")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=120, env=ENV)
    stderr = r.stderr.decode()
    assert r.returncode == 0, stderr
    assert len(r.stdout) == 20  # bytes
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr
    assert "decode:" not in stderr  # it stopped instead of generating all 3000 tokens


# --- errors ---------------------------------------------------------------------------------

def test_argument_errors(ws, capsys, tmp_path):
    o = "--out_dir=" + ws["softmax"]
    assert "temperature" in err(capsys, o, "--temperature=-0.5")
    assert "top_k" in err(capsys, o, "--top_k=-1")
    assert "top_p" in err(capsys, o, "--top_p=0")
    assert "top_p" in err(capsys, o, "--top_p=1.5")
    assert "unknown config key 'temprature'" in err(capsys, o, "--temprature=1")
    assert "does not exist" in err(capsys, f"--out_dir={tmp_path / 'nope'}")
    assert "no checkpoint" in err(capsys, f"--out_dir={tmp_path}")
    assert "prompt file" in err(capsys, o, f"--start=FILE:{tmp_path / 'missing.txt'}")
    assert "rope_scaling" in err(capsys, o, "--rope_scaling=dynamic")
    assert "compile must be" in err(capsys, o, "--compile=yes")
    assert "cannot read '10**3' as an int" in err(capsys, o, "--num_samples=10**3")
    for seed in (-1, 2 ** 64):  # torch.Generator.manual_seed takes [0, 2**64 - 1]
        assert "seed must be from 0 to 2**64 - 1" in err(capsys, o, f"--seed={seed}")
    assert "use_cache" in err(capsys, o, "--compile=True", "--use_cache=False")


def test_sampling_arguments_are_checked_by_generate_before_loading(ws, capsys, tmp_path,
                                                                    monkeypatch):
    """One rule for temperature/top_k/top_p (decode.check_sampling), applied before the
    checkpoint loads: its one-line message reaches the user even with no checkpoint at all."""
    missing = f"--out_dir={tmp_path / 'nope'}"
    assert "temperature" in err(capsys, missing, "--temperature=-1")
    seen = []

    def check(temperature, top_k, top_p):
        seen.append((temperature, top_k, top_p))
        raise ValueError("sampling rule says no")
    monkeypatch.setattr(decoding, "check_sampling", check)
    assert err(capsys, missing, "--temperature=0.5", "--top_k=0", "--top_p=0.9") == \
        "error: sampling rule says no"
    assert seen == [(0.5, None, 0.9)]  # top_k=0 (off) reaches it as None


def test_learned_positions_past_block_size_is_an_error_with_cache(ws, capsys, tmp_path):
    ckpt = torch.load(os.path.join(ws["softmax"], "ckpt.pt"), weights_only=True)
    ckpt["model_args"]["pos_encoding"] = "learned"
    cfg = RoFormerConfig(**ckpt["model_args"])
    ckpt["model"] = RoFormer(cfg).state_dict()
    ckpt.pop("digest", None)  # other weights: not the ones train.py's digest is of
    torch.save(ckpt, tmp_path / "ckpt.pt")
    o = f"--out_dir={tmp_path}"
    assert "learned positions" in err(capsys, o, f"--max_new_tokens={2 * BLOCK}")
    assert "rope_scaling applies to RoPE" in err(capsys, o, "--rope_scaling=ntk")
    assert run(capsys, o, f"--max_new_tokens={2 * BLOCK}", "--use_cache=False").out


def test_a_batch_that_cannot_fit_is_refused_before_it_is_built(ws, capsys, monkeypatch):
    """--num_samples is one batch: one whose cache alone (float32 keys and values of every
    layer at every position it decodes, counted here from the checkpoint's shape) is past the
    device's memory is one line naming the flag, before a tensor of its size exists (a batch of
    10^12 prompts would itself need terabytes); the same batch runs where memory allows it."""
    args = torch.load(os.path.join(ws["softmax"], "ckpt.pt"), weights_only=True)["model_args"]
    samples, new = 4, 8
    positions = 1 + new  # the prompt "\n" is one token
    cache = 2 * args["n_layer"] * samples * positions * args["n_embd"] * 4
    flags = ["--out_dir=" + ws["softmax"], "--start=\n", f"--max_new_tokens={new}"]
    monkeypatch.setattr(sample, "device_memory", lambda dev: cache // 2)
    assert "--num_samples=4 needs about" in err(capsys, *flags, f"--num_samples={samples}")
    monkeypatch.setattr(sample, "device_memory", lambda dev: 100 * cache)
    assert run(capsys, *flags, f"--num_samples={samples}").out.count("---------------") == 3
    monkeypatch.undo()
    assert "--num_samples=1000000000000 needs" in err(capsys, *flags, "--num_samples=1000000000000")


def test_tokenizer_missing_or_mismatched(ws, capsys, tmp_path):
    ckpt = torch.load(os.path.join(ws["softmax"], "ckpt.pt"), weights_only=True)
    moved = dict(ckpt, tokenizer=dict(ckpt["tokenizer"], path=str(tmp_path / "gone.model"),
                                      dataset="no_such_dataset"))
    (tmp_path / "a").mkdir()
    torch.save(moved, tmp_path / "a" / "ckpt.pt")
    msg = err(capsys, f"--out_dir={tmp_path / 'a'}")
    # the hint names the folder the run read, not --dataset's data/<name>
    assert "tokenizer not found" in msg and f"prepare the run's dataset {tmp_path} again" in msg
    # the same bytes elsewhere are accepted via --tokenizer
    shutil.copy(ws["data"] / "tokenizer.model", tmp_path / "copy.model")
    assert run(capsys, f"--out_dir={tmp_path / 'a'}", f"--tokenizer={tmp_path / 'copy.model'}",
               "--max_new_tokens=3").out
    # a retrained tokenizer at the recorded path is refused
    train_tokenizer(str(tmp_path / "gone.model"), byte_fallback=False)
    assert "does not match" in err(capsys, f"--out_dir={tmp_path / 'a'}")


def test_moved_tokenizer_is_reported_as_missing_not_retrained(ws, capsys, tmp_path,
                                                              monkeypatch):
    """The recorded tokenizer is gone and data/<dataset>/tokenizer.model holds another one:
    the message says the run's file is missing and how to point to it, not "retrained"; the
    file at the new place is then accepted."""
    from harness import run_tokenizer
    monkeypatch.setattr(run_tokenizer, "REPO", str(tmp_path))  # where data/<dataset> is
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    train_tokenizer(str(tmp_path / "data" / "tiny" / "tokenizer.model"), byte_fallback=False)
    ckpt = torch.load(os.path.join(ws["softmax"], "ckpt.pt"), weights_only=True)
    gone = tmp_path / "old" / "tokenizer.model"
    ckpt["tokenizer"] = dict(ckpt["tokenizer"], path=str(gone), dataset="tiny")
    (tmp_path / "run").mkdir()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    msg = err(capsys, f"--out_dir={tmp_path / 'run'}")
    assert f"{gone} is missing" in msg and "--tokenizer=PATH" in msg and "retrained" not in msg
    shutil.copy(ws["data"] / "tokenizer.model", tmp_path / "moved.model")
    assert run(capsys, f"--out_dir={tmp_path / 'run'}", f"--tokenizer={tmp_path / 'moved.model'}",
               "--max_new_tokens=3").out


def test_a_truncated_tokenizer_is_one_line(ws, capsys, tmp_path):
    """A run that recorded a truncated tokenizer.model (train.py used to accept one): one line
    naming the file, not sentencepiece's `RuntimeError: INTERNAL: could not parse ModelProto`."""
    path = tmp_path / "tokenizer.model"
    blob = (ws["data"] / "tokenizer.model").read_bytes()
    path.write_bytes(blob[:len(blob) // 2])
    ckpt = torch.load(os.path.join(ws["softmax"], "ckpt.pt"), weights_only=True)
    ckpt["tokenizer"] = dict(ckpt["tokenizer"], path=str(path),
                             sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    torch.save(ckpt, tmp_path / "ckpt.pt")
    msg = err(capsys, f"--out_dir={tmp_path}")
    assert "cannot load the tokenizer" in msg and str(path) in msg


def test_prompt_the_tokenizer_cannot_encode(ws, capsys, tmp_path):
    """Without byte fallback an unseen character becomes <unk>: refuse, never guess."""
    path = tmp_path / "nobytes.model"
    sp = train_tokenizer(str(path), byte_fallback=False)
    assert sp.unk_id() in sp.encode("☃")
    ckpt = torch.load(os.path.join(ws["softmax"], "ckpt.pt"), weights_only=True)
    ckpt["tokenizer"] = dict(ckpt["tokenizer"], path=str(path),
                             sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    torch.save(ckpt, tmp_path / "ckpt.pt")
    msg = err(capsys, f"--out_dir={tmp_path}", "--start=def ☃(x):")
    assert "cannot encode" in msg and "☃" in msg


def test_sampling_imports_no_training_code():
    """sample.py reads a run; what writes checkpoints or trains is not imported with it (issue
    36: the lines of project code a sampled token imports). Reference: the modules a fresh
    interpreter holds after `import sample`, against the modules train.py imports instead."""
    code = "import sys, sample; print(' '.join(sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    imported = set(r.stdout.split())
    assert "harness.load" in imported
    for training_only in ("harness.checkpoint", "optim", "harness.out_dir", "harness.memory",
                          "harness.run_log", "harness.stops", "harness.progress_loop"):
        assert importlib.util.find_spec(training_only) and training_only not in imported
