"""
export.py --gguf against independent references: gguf's own reader (every key and tensor as
written), sentencepiece's API for the vocabulary, formats/neox.py's float64 forward written from
llama.cpp's gptneox graph (how it splits attn_qkv, rotates, normalises) over the file's
tensors against our model's logits (and against transformers' model of the same weights),
and, where llama-cpp-python is installed, llama.cpp itself (its tokenizer, its logits, its
greedy decoding, its bits per byte against eval.py's).
"""
import errno
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf", reason="export.py --gguf writes with the gguf package")
import eval as evalpy  # noqa: E402
import export  # noqa: E402
import decode as decoding  # noqa: E402
from formats import gguf as gguf_export  # noqa: E402
from data.tokenizer import train_tokenizer  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402
from test_eval import BLOCK, corpus_docs, make_run, one_line_error, one_thread  # noqa: E402,F401
from test_export import refused_wrongly, save_run, tricky_texts  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = ("f32", "f16", "q8_0")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A briefly trained run, exported as f32, f16 and q8_0 GGUF files (without the llama.cpp
    check), with the model and tokenizer loaded independently."""
    root = tmp_path_factory.mktemp("gguf")
    out, data = make_run(str(root))
    files = {}
    for kind in TYPES:
        files[kind] = str(root / f"model-{kind}.gguf")
        export.main([f"--out_dir={out}", f"--gguf={files[kind]}", f"--gguf_type={kind}",
                     "--check=False"])
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    model = RoFormer(RoFormerConfig(**ckpt["model_args"])).eval()
    model.load_state_dict(ckpt["model"])
    sp = spm.SentencePieceProcessor(model_file=os.path.join(data, "tokenizer.model"))
    return {"root": root, "out": out, "data": data, "ckpt": ckpt, "model": model, "sp": sp,
            "files": files}


def err(*args):
    return one_line_error(export.main, list(args))


def fields(path):
    reader = gguf.GGUFReader(path)
    return reader, {name: f.contents() for name, f in reader.fields.items()
                    if not name.startswith("GGUF.")}


def tensor(reader, name):
    """A tensor of the file, dequantized, in torch's (out, in) order."""
    t = {t.name: t for t in reader.tensors}[name]
    values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)
    return values.reshape([int(n) for n in t.shape[::-1]])


def expected_names(n_layer):
    names = {"token_embd.weight", "output_norm.weight", "output_norm.bias", "output.weight"}
    for i in range(n_layer):
        for part in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"):
            names |= {f"blk.{i}.{part}.weight", f"blk.{i}.{part}.bias"}
    return names


# --- the file as gguf's reader sees it ------------------------------------------------------

@pytest.mark.parametrize("kind", TYPES)
def test_metadata_and_vocabulary_read_back(run, kind):
    c, sp = run["model"].config, run["sp"]
    _, meta = fields(run["files"][kind])
    head = c.n_embd // c.n_head
    assert meta["general.architecture"] == "gptneox"
    assert meta["general.file_type"] == {"f32": 0, "f16": 1, "q8_0": 7}[kind]
    want = {"context_length": c.block_size, "embedding_length": c.n_embd,
            "feed_forward_length": 4 * c.n_embd, "block_count": c.n_layer,
            "attention.head_count": c.n_head, "rope.dimension_count": head,
            "use_parallel_residual": False}
    for key, value in want.items():
        assert meta[f"gptneox.{key}"] == value, key
    assert meta["gptneox.rope.freq_base"] == pytest.approx(c.rope_base)
    assert meta["gptneox.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    # no scaling, said explicitly: llama.cpp takes a missing type for "linear"
    assert [key for key in meta if "rope.scaling" in key] == ["gptneox.rope.scaling.type"]
    assert meta["gptneox.rope.scaling.type"] == "none"
    # the tokenizer, against sentencepiece's own API
    n = sp.get_piece_size()
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.tokens"][:n] == [sp.id_to_piece(i) for i in range(n)]
    assert np.array_equal(np.float32(meta["tokenizer.ggml.scores"][:n]),
                          np.float32([sp.get_score(i) for i in range(n)]))
    types = meta["tokenizer.ggml.token_type"]
    for i in range(n):
        if sp.is_byte(i):
            assert types[i] == gguf.TokenType.BYTE
        elif sp.is_control(i):
            assert types[i] == gguf.TokenType.CONTROL
        elif sp.is_unknown(i):
            assert types[i] == gguf.TokenType.UNKNOWN
        elif sp.id_to_piece(i) == "\n":  # the fixed newline piece data/tokenizer.py adds
            assert types[i] == gguf.TokenType.USER_DEFINED
        else:
            assert types[i] == gguf.TokenType.NORMAL
    assert sum(t == gguf.TokenType.BYTE for t in types) == 256
    assert len(types) == len(meta["tokenizer.ggml.tokens"]) == c.vocab_size
    assert meta["tokenizer.ggml.eos_token_id"] == sp.eos_id()
    assert meta["tokenizer.ggml.unknown_token_id"] == sp.unk_id()
    for flag in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        assert meta[f"tokenizer.ggml.{flag}"] is False


@pytest.mark.parametrize("kind", TYPES)
def test_tensor_names_shapes_and_types(run, kind):
    c = run["model"].config
    reader, _ = fields(run["files"][kind])
    found = {t.name: t for t in reader.tensors}
    assert set(found) == expected_names(c.n_layer)
    arch_tensors = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GPTNEOX]}
    assert {n.rsplit(".", 1)[0].replace(n.split(".")[1], "{bid}") if n.startswith("blk.")
            else n.rsplit(".", 1)[0] for n in found} <= arch_tensors
    C, V = c.n_embd, c.vocab_size
    ne = {"token_embd": [C, V], "output": [C, V], "attn_qkv": [C, 3 * C], "attn_output": [C, C],
          "ffn_up": [C, 4 * C], "ffn_down": [4 * C, C]}  # ggml order: row length first
    for name, t in found.items():
        part = name.split(".")[-2]
        if name.endswith(".weight") and part in ne:
            assert list(t.shape) == ne[part], name
            assert t.tensor_type == {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0}[kind], name
        else:  # norms and biases stay float32
            assert len(t.shape) == 1 and t.tensor_type == Q.F32, name


def test_f32_values_tied_head_and_zero_biases(run):
    """The f32 file holds our weights exactly; the output head is the embedding; a bias-free
    model's biases (llama.cpp's gptneox requires them) are zeros."""
    reader, _ = fields(run["files"]["f32"])
    state = run["model"].state_dict()
    assert np.array_equal(tensor(reader, "token_embd.weight"), state["wte.weight"].double())
    assert np.array_equal(tensor(reader, "output.weight"), state["wte.weight"].double())
    assert np.array_equal(tensor(reader, "blk.1.ffn_down.weight"),
                          state["blocks.1.mlp.c_proj.weight"].double())
    assert np.array_equal(tensor(reader, "output_norm.weight"), state["ln_f.weight"].double())
    assert not run["model"].config.bias
    for t in reader.tensors:
        if t.name.endswith(".bias"):
            assert not np.any(np.asarray(t.data)), t.name


def test_sizes_half_and_about_a_quarter(run, tmp_path):
    """A wider random model (so the tokenizer's metadata is small beside the weights): f16 is
    about half of f32, q8_0 (34 bytes per 32 weights) about a quarter."""
    args = dict(run["ckpt"]["model_args"], n_embd=128, n_head=4, n_layer=3)
    state = RoFormer(RoFormerConfig(**args)).state_dict()
    out = save_run(tmp_path / "out", run["ckpt"], args, state)
    size = {}
    for kind in TYPES:
        export.main([f"--out_dir={out}", f"--gguf={tmp_path / kind}.gguf", f"--gguf_type={kind}",
                     "--check=False"])
        size[kind] = os.path.getsize(f"{tmp_path / kind}.gguf")
    assert 0.48 < size["f16"] / size["f32"] < 0.53
    assert 0.25 < size["q8_0"] / size["f32"] < 0.29


# --- the file computes our model -------------------------------------------------------------

def gptneox_forward(path, ids):
    """The file's logits by formats/neox.py's float64 gptneox forward (checked against transformers
    in test_reference_of_the_file_is_transformers_model), as numpy."""
    return gguf_export.reference_logits(path, torch.as_tensor(ids)).numpy()


def sharp_run(run, folder, **changes):
    """Fresh weights with q and k x10, so that positions (and so the qkv split and the
    rotation) steer the logits; saved as a run in `folder`."""
    args = dict(run["ckpt"]["model_args"], **changes)
    torch.manual_seed(3)
    model = RoFormer(RoFormerConfig(**args)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_attn.weight"):
                p[:2 * args["n_embd"]] *= 10.0
    return model, save_run(folder, run["ckpt"], args, model.state_dict())


@pytest.mark.parametrize("scaling,factor,original,tied", [
    ("none", 1.0, 0, True), ("linear", 2.0, 0, True), ("ntk", 4.0, 0, True),
    ("yarn", 2.0, 0, True), ("none", 1.0, 0, False),
    ("yarn", 4.0, 16, True), ("linear", 4.0, 16, True)])  # fine-tune-like: RoPE trained at 16
def test_file_read_as_llama_cpp_reads_it_computes_our_logits(run, tmp_path, scaling, factor,
                                                             original, tied):
    """qkv layout, rotation and RoPE scaling: the float64 gptneox forward over the f32 file
    gives our model's logits (so q/k/v come back out of attn_qkv exactly as ours), and it
    would not if the heads were interleaved the HF way or the scaling dropped. Untied: the
    file's output.weight is lm_head and token_embd wte."""
    model, out = sharp_run(run, tmp_path / "out", rope_scaling=scaling, rope_factor=factor,
                           rope_original=original, tie_embeddings=tied)
    path = str(tmp_path / "m.gguf")
    export.main([f"--out_dir={out}", f"--gguf={path}", "--gguf_type=f32", "--check=False"])
    ids = torch.randint(0, model.config.vocab_size, (2 * BLOCK,),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids[None])[0][0].double().numpy()
    assert np.abs(gptneox_forward(path, ids.numpy()) - ours).max() < 1e-4
    reader, meta = fields(path)
    state = model.state_dict()
    assert np.array_equal(tensor(reader, "output.weight"), state["lm_head.weight"].double())
    assert np.array_equal(tensor(reader, "token_embd.weight"), state["wte.weight"].double())
    c, head = model.config, model.config.n_embd // model.config.n_head
    assert meta["gptneox.context_length"] == max(BLOCK, int((original or BLOCK) * factor))
    scaled = {k[len("gptneox.rope.scaling."):]: v for k, v in meta.items() if "rope.scaling" in k}
    if scaling in ("linear", "yarn"):  # llama.cpp's own keys; betas are its defaults, as ours
        assert scaled.pop("type") == scaling and scaled.pop("factor") == pytest.approx(factor)
        assert scaled.pop("original_context_length") == (original or BLOCK)
        assert scaled == ({"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0} if scaling == "yarn"
                          else {})
    else:  # NTK-aware scaling is RoPE with a larger base, and no scaling
        assert scaled == {"type": "none"}
        assert meta["gptneox.rope.freq_base"] == pytest.approx(
            c.rope_base * factor ** (head / (head - 2)) if scaling == "ntk" else c.rope_base)
    # the HF layout (per head [q, k, v]) would be another model; an adjacent-pairs model's q
    # rows are in NeoX's pair order, (0, 2, .., 1, 3, ..) of each head
    reader, _ = fields(path)
    qkv = tensor(reader, "blk.0.attn_qkv.weight")
    C, H = model.config.n_embd, model.config.n_head
    order = list(range(0, head, 2)) + list(range(1, head, 2)) \
        if model.config.rope_pairs == "adjacent" else list(range(head))
    q_ours = model.state_dict()["blocks.0.attn.c_attn.weight"][:C].view(H, head, C)[:, order]
    q_ours = q_ours.reshape(C, C).double().numpy()
    assert np.array_equal(qkv[:C], q_ours)
    assert not np.allclose(qkv.reshape(3, H, C // H, C).transpose(1, 0, 2, 3).reshape(3 * C, C)[:C],
                           q_ours)


@pytest.mark.parametrize("scaling,factor,original", [("none", 1.0, 0), ("ntk", 4.0, 0),
                                                     ("yarn", 4.0, 16)])
def test_partial_rotary_is_the_dimension_count(run, tmp_path, scaling, factor, original):
    """rotary_fraction=0.5: rope.dimension_count is the 8 rotated channels of 16 (NTK's base
    raised over them), and llama.cpp's graph of the f32 file gives our logits, which
    rotating the whole head would not."""
    model, out = sharp_run(run, tmp_path / "out", rotary_fraction=0.5, rope_scaling=scaling,
                           rope_factor=factor, rope_original=original)
    path = str(tmp_path / "m.gguf")
    export.main([f"--out_dir={out}", f"--gguf={path}", "--gguf_type=f32", "--check=False"])
    _, meta = fields(path)
    assert meta["gptneox.rope.dimension_count"] == 8
    if scaling == "ntk":
        assert meta["gptneox.rope.freq_base"] == pytest.approx(
            model.config.rope_base * factor ** (8 / 6))
    ids = torch.randint(0, model.config.vocab_size, (2 * BLOCK,),
                        generator=torch.Generator().manual_seed(0))
    whole = RoFormer(RoFormerConfig(**dict(vars(model.config), rotary_fraction=1.0))).eval()
    whole.load_state_dict(model.state_dict())
    with torch.no_grad():
        ours, other = (m(ids[None])[0][0].double().numpy() for m in (model, whole))
    theirs = gptneox_forward(path, ids.numpy())
    assert np.abs(theirs - ours).max() < 1e-4 and np.abs(theirs - other).max() > 1e-2


# --- refusals and failures -------------------------------------------------------------------

@pytest.mark.parametrize("change,reason", [({"attention": "linear"}, "linear attention"),
                                           ({"pos_encoding": "sinusoidal"}, "only through RoPE"),
                                           ({"pos_encoding": "learned"}, "only through RoPE"),
                                           ({"nope_every": 2}, "nope_every=2"),
                                           ({"window": 4, "local_rope_base": 100.0}, "window=4"),
                                           ({"length_temperature": 0.1},
                                            "length_temperature=0.1"),
                                           ({"qk_norm": True}, "no norm on queries and keys")])
def test_models_without_a_gptneox_form_are_refused(run, tmp_path, change, reason):
    args = dict(run["ckpt"]["model_args"], **change)
    model = RoFormer(RoFormerConfig(**args))
    why = export.refusal(model, "gguf")
    assert why and reason in why, refused_wrongly("gguf", reason, why)
    out = save_run(tmp_path / "out", run["ckpt"], args, model.state_dict())
    msg = err(f"--out_dir={out}", f"--gguf={tmp_path / 'm.gguf'}", "--check=False")
    assert reason in msg and "cannot export" in msg, refused_wrongly("gguf", reason, msg)
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("change", [{"pos_encoding": "none"}, {"attention": "linear"}])
def test_a_wrongly_allow_listed_change_is_refused_without_llama_cpp(run, tmp_path, monkeypatch,
                                                                    change):
    """Issue 37: a configuration the file cannot express, let through by a wrong allow-list
    entry, was written (rc 0) when llama.cpp was not there to run it. formats/neox.py's reference
    computes the file as written and disagrees: one line, no file, the previous one kept."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # importing it now raises ImportError
    monkeypatch.setattr(export, "config_refusal", lambda c, kind: None)  # the wrong entry
    _, out = sharp_run(run, tmp_path / "out", **change)
    path = tmp_path / "m.gguf"
    msg = err(f"--out_dir={out}", f"--gguf={path}")
    assert "formats/neox.py" in msg and "is not this model" in msg
    assert sorted(os.listdir(tmp_path)) == ["out"]
    export.main([f"--out_dir={run['out']}", f"--gguf={path}"])  # the plain model passes
    before = path.read_bytes()
    assert "is not this model" in err(f"--out_dir={out}", f"--gguf={path}", "--gguf_type=f32")
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["m.gguf", "out"]


@pytest.mark.parametrize("scaling,factor,original,fraction,tied", [
    ("none", 1.0, 0, 1.0, True), ("linear", 2.0, 0, 1.0, True), ("ntk", 4.0, 0, 1.0, True),
    ("yarn", 2.0, 0, 1.0, True), ("yarn", 4.0, 16, 1.0, True), ("none", 1.0, 0, 0.5, True),
    ("ntk", 4.0, 0, 0.5, True), ("yarn", 4.0, 16, 0.5, True), ("none", 1.0, 0, 1.0, False)])
def test_reference_of_the_file_is_transformers_model(run, tmp_path, scaling, factor, original,
                                                     fraction, tied):
    """formats/neox.py itself, read from either export, against transformers' GPTNeoXForCausalLM
    loaded from the folder of the same weights: the reference computes what the formats mean
    (partial rotary too: rope.dimension_count, partial_rotary_factor)."""
    transformers = pytest.importorskip("transformers", reason="the reference is checked "
                                       "against transformers' GPTNeoXForCausalLM")
    from formats import hf as hf_export
    model, out = sharp_run(run, tmp_path / "out", rope_scaling=scaling, rope_factor=factor,
                           rope_original=original, rotary_fraction=fraction,
                           tie_embeddings=tied)
    path = str(tmp_path / "m.gguf")
    export.main([f"--out_dir={out}", f"--gguf={path}", "--gguf_type=f32", "--check=False"])
    export.main([f"--out_dir={out}", "--check=False"])
    folder = os.path.join(out, "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    ids = torch.randint(0, model.config.vocab_size, (model.config.context_window,),
                        generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    for reference in (gguf_export.reference_logits(path, ids),
                      hf_export.reference_logits(folder, ids)):
        assert (reference - theirs).abs().max().item() < 1e-6


def test_unigram_tokenizer_and_bad_arguments_are_refused(run, tmp_path, monkeypatch):
    lines = [l for _, d in corpus_docs() for l in d.split("\n") if l.strip()]
    uni = spm.SentencePieceProcessor(model_proto=train_tokenizer(lines, 330, "unigram")[0])
    assert "unigram" in one_line_error(export.sentencepiece_proto, uni)
    o = f"--out_dir={run['out']}"
    assert "gguf_type" in err(o, f"--gguf={tmp_path / 'm.gguf'}", "--gguf_type=q4_0")
    assert "is a folder" in err(o, f"--gguf={tmp_path}")
    with monkeypatch.context() as m:
        for name in [n for n in sys.modules if n.split(".")[0] == "gguf"]:
            m.setitem(sys.modules, name, None)
        assert "'gguf' package" in err(o, f"--gguf={tmp_path / 'm.gguf'}")
    assert os.listdir(tmp_path) == []


def test_a_path_export_would_destroy_is_refused(run, tmp_path):
    """Issue 28: --gguf=out/ckpt.pt replaced the training state with a GGUF file. A path that is
    a file of a run (its checkpoint, log, DCP folder; there or not yet) or an existing file
    that is not GGUF is refused in one line, unchanged; an existing GGUF file is replaced."""
    folder = tmp_path / "run"
    out = save_run(folder, run["ckpt"], run["ckpt"]["model_args"], run["ckpt"]["model"])
    (folder / "log.jsonl").write_text('{"iter": 0}\n')
    (folder / "ckpt-5.0.dcp").mkdir()
    (folder / "ckpt-5.0.dcp" / "__0_0.distcp").write_bytes(b"shard")
    (tmp_path / "notes.txt").write_text("keep me")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for target in ("ckpt.pt", "log.jsonl", "ckpt-5.0.dcp/__0_0.distcp", "ckpt-5.0.dcp/new.gguf",
                   "ckpt.pt.tmp", "log.20250101-000000.jsonl", ".ckpt.pt.1234.tmp",
                   ".train.lock"):  # issue 35: the temp named by its pid, out_dir's lock
        msg = err(f"--out_dir={out}", f"--gguf={folder / target}", "--check=False")
        assert "file of the run" in msg and str(folder) in msg, msg
    msg = err(f"--out_dir={out}", f"--gguf={tmp_path / 'notes.txt'}", "--check=False")
    assert "not a GGUF file" in msg
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # beside the run's files, and over a GGUF file, export writes
    for _ in range(2):
        export.main([f"--out_dir={out}", f"--gguf={folder / 'model.gguf'}", "--check=False"])
    assert (folder / "model.gguf").read_bytes()[:4] == b"GGUF"
    assert sorted(os.listdir(folder)) == ["ckpt-5.0.dcp", "ckpt.pt", "log.jsonl", "model.gguf"]


def test_a_failed_llama_cpp_check_leaves_nothing_behind(run, tmp_path, monkeypatch):
    """The file is checked under its temp name: when llama.cpp disagrees with our model, no file
    goes into place and the previous one stays as it was."""
    path = tmp_path / "m.gguf"
    monkeypatch.setattr(gguf_export, "check_with_llama_cpp", lambda *a: False)
    assert "do not match" in err(f"--out_dir={run['out']}", f"--gguf={path}")
    assert os.listdir(tmp_path) == []
    export.main([f"--out_dir={run['out']}", f"--gguf={path}", "--check=False"])
    before = path.read_bytes()
    assert "do not match" in err(f"--out_dir={run['out']}", f"--gguf={path}", "--gguf_type=f32")
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["m.gguf"]


def test_failed_write_keeps_the_previous_file(run, tmp_path, monkeypatch):
    """ENOSPC when the new file is synced: one line, the previous file unchanged, no temp."""
    path = tmp_path / "m.gguf"
    export.main([f"--out_dir={run['out']}", f"--gguf={path}", "--check=False"])
    before = path.read_bytes()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full_disk)
        msg = err(f"--out_dir={run['out']}", f"--gguf={path}", "--gguf_type=f32", "--check=False")
    assert "No space left" in msg
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["m.gguf"]


def test_full_disk_on_a_real_filesystem(run, tmp_path):
    from test_export import mount_tmpfs
    disk = mount_tmpfs(tmp_path / "disk", "300k")
    try:
        path = disk / "m.gguf"
        export.main([f"--out_dir={run['out']}", f"--gguf={path}", "--gguf_type=f32",
                     "--check=False"])
        before = path.read_bytes()
        assert len(before) > 150_000  # two do not fit
        msg = err(f"--out_dir={run['out']}", f"--gguf={path}", "--gguf_type=f32", "--check=False")
        assert "No space left" in msg or "disk full" in msg  # numpy's short write has no errno
        assert path.read_bytes() == before and os.listdir(disk) == ["m.gguf"]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# --- llama.cpp runs it (llama-cpp-python: not installed by CI, it compiles for ~25 minutes) ----

def llama(path, n_ctx=BLOCK):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, logits_all=True, verbose=False)


def llama_bits_per_byte(llm, ids, nbytes, block, stride):
    """eval.py's rule, computed here from llama.cpp's logits: target t of ids (t >= 1) is scored
    with the context ids[k * stride : t], k = max(0, ceil((t - block) / stride)); total nats in
    bits over nbytes."""
    by_window = {}
    for t in range(1, len(ids)):
        by_window.setdefault(max(0, -(-(t - block) // stride)), []).append(t)
    nats = 0.0
    for k, targets in by_window.items():
        start = k * stride
        llm.reset()
        llm.eval(ids[start:max(targets)])
        logits = np.array(llm.scores[:max(targets) - start], dtype=np.float64)
        for t in targets:
            row = logits[t - 1 - start]
            top = row.max()
            nats += top + math.log(np.exp(row - top).sum()) - row[ids[t]]
    return nats / math.log(2) / nbytes


def test_llama_cpp_greedy_equals_ours(run):
    """Greedy decoding of 24 tokens from three prompts: llama.cpp running each file gives our
    model's tokens (our model holding the file's weights; for f32 those are ours exactly)."""
    sp = run["sp"]
    prompts = ["def value_1(x):\n    return", "the model print", "data: 世界 你好 🙂"]
    for kind, path in run["files"].items():
        llm = llama(path)
        reference = gguf_export.weights_from_gguf(path, run["model"])
        for prompt in prompts:
            ids = [sp.eos_id()] + sp.encode(prompt)
            ours = decoding.generate(reference, torch.tensor([ids]), 24, temperature=0)
            assert gguf_export.llama_cpp_greedy(llm, ids, 24) == ours[0, len(ids):].tolist(), \
                (kind, prompt)
    ours = decoding.generate(run["model"], torch.tensor([ids]), 24, temperature=0)
    assert gguf_export.llama_cpp_greedy(llama(run["files"]["f32"]), ids, 24) == \
        ours[0, len(ids):].tolist()


def test_llama_cpp_tokenizer_equals_sentencepiece(run):
    """A few hundred documents, plus runs of spaces, byte-fallback characters and text that
    looks like special pieces: llama.cpp's ids are sentencepiece's, and decode back."""
    sp, llm = run["sp"], llama(run["files"]["f16"])
    texts = [doc for _, doc in corpus_docs(300, seed=7)] + tricky_texts(seed=3, n_random=300)
    assert len(texts) > 600
    bad = [t for t in texts
           if llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) != sp.encode(t)]
    assert not bad, f"{len(bad)} of {len(texts)} differ, e.g. {bad[0]!r}"
    undecoded = [t for t in texts[:300] if llm.detokenize(sp.encode(t)).decode("utf-8") != t]
    assert not undecoded, undecoded[0]


def test_llama_cpp_bits_per_byte_q8_0_within_two_percent_of_f32(run, capsys):
    """On the run's val.bin, with eval.py's windows: q8_0 within 2% of f32, and llama.cpp's f32
    within 0.1% of eval.py's own number."""
    sp = run["sp"]
    meta = json.load(open(os.path.join(run["data"], "meta.json")))
    val = np.fromfile(os.path.join(run["data"], "val.bin"), dtype=meta["dtype"]).tolist()
    ids, nbytes = [sp.eos_id()] + val, len(sp.decode(val).encode("utf-8"))
    bpb = {kind: llama_bits_per_byte(llama(path), ids, nbytes, BLOCK, BLOCK // 2)
           for kind, path in run["files"].items()}
    capsys.readouterr()
    evalpy.main([f"--out_dir={run['out']}", "--split=val", "--json"])
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bits_per_byte"]
    with capsys.disabled():
        print(f"\nbits per byte on val.bin: eval.py {ours:.5f}; llama.cpp " +
              ", ".join(f"{k} {v:.5f}" for k, v in bpb.items()))
    assert abs(bpb["q8_0"] - bpb["f32"]) < 0.02 * bpb["f32"]
    assert abs(bpb["f32"] - ours) < 1e-3 * ours


def test_export_check_line_reports_a_match(run, capsys, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    export.main([f"--out_dir={run['out']}", f"--gguf={tmp_path / 'm.gguf'}", "--gguf_type=q8_0"])
    line = [l for l in capsys.readouterr().err.splitlines() if l.startswith("check:")][0]
    n = line.split("sentencepiece on ")[1].split()[0]
    assert n.split("/")[0] == n.split("/")[1] and int(n.split("/")[1]) > 10
    assert "greedy 24 tokens equal" in line


@pytest.mark.parametrize("scaling,factor,original", [
    ("none", 1.0, 0), ("linear", 2.0, 0), ("ntk", 4.0, 0), ("yarn", 2.0, 0),
    ("yarn", 4.0, 16)])  # fine-tune-like: RoPE trained at 16, block 64 = the window
def test_llama_cpp_logits_equal_ours_with_rope_scaling(run, tmp_path, scaling, factor, original):
    """Sharp attention (positions matter) over the whole window, past the original context:
    llama.cpp's logits for the f32 file are ours, with linear and YaRN scaling read from its
    keys (YaRN's ramp and attention factor computed by llama.cpp) and NTK as its larger base."""
    model, out = sharp_run(run, tmp_path / "out", rope_scaling=scaling, rope_factor=factor,
                           rope_original=original)
    path = str(tmp_path / "m.gguf")
    export.main([f"--out_dir={out}", f"--gguf={path}", "--gguf_type=f32", "--check=False"])
    ids = torch.randint(0, model.config.vocab_size, (model.config.context_window,),
                        generator=torch.Generator().manual_seed(1))
    llm = llama(path, n_ctx=len(ids))
    llm.eval(ids.tolist())
    theirs = np.array(llm.scores[:len(ids)])
    with torch.no_grad():
        ours = model(ids[None])[0][0].numpy()
    assert np.abs(theirs - ours).max() < 1e-2 * np.abs(ours).max()
    if scaling != "none":  # llama.cpp applied the scaling: without it the logits move 10x more
        args = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["model_args"]
        plain = RoFormer(RoFormerConfig(**dict(args, rope_scaling="none", rope_factor=1.0))).eval()
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            unscaled = plain(ids[None])[0][0].numpy()
        assert np.abs(theirs - ours).max() < 0.1 * np.abs(unscaled - ours).max()


def wait_until_serving(url, server, log_path, timeout=120):
    """Poll `url` until the server answers; fail with its log if it exits or never answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}): {open(log_path).read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:  # not listening yet (URLError is an OSError)
            time.sleep(0.5)
    pytest.fail(f"the server did not answer in {timeout} s: {open(log_path).read()[-2000:]}")


def test_llama_cpp_server_round_trip(run, tmp_path):
    """The README's serving block: llama-cpp-python's OpenAI-compatible server, listening on
    127.0.0.1 only, serves the f32 file, and a greedy completion through the openai client is
    our model's greedy continuation of the same prompt. The server is stopped in any case."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server extras are not "
                        "installed: pip install 'llama-cpp-python[server]'")
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    with socket.socket() as s:  # a free port on the loopback interface
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", run["files"]["f32"],
             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(BLOCK)],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        wait_until_serving(base + "/models", server, log_path)
        client = openai.OpenAI(base_url=base, api_key="unused")
        prompt = "def value_1(x):\n    return"
        # temperature 0 is greedy; the server's default repeat penalty (1.1) would move logits
        reply = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"repeat_penalty": 1.0})
        sp, ids = run["sp"], run["sp"].encode(prompt)
        new = decoding.generate(run["model"], torch.tensor([ids]), 16, temperature=0)[0, len(ids):]
        new = new.tolist()
        new = new[:new.index(sp.eos_id())] if sp.eos_id() in new else new  # it stops at EOS
        assert reply.choices[0].text == sp.decode(new)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_a_file_named_without_a_folder_goes_into_the_run_folder(run, tmp_path, monkeypatch):
    """Issue 45: `--gguf=model.gguf` wrote into the current folder (the repo root, where
    `git status` showed it). `--gguf` alone and a bare name write into out_dir; a path with a
    folder in it is written where it says; .gitignore ignores GGUF files."""
    import fnmatch
    out = tmp_path / "run"
    out.mkdir()
    for name in ("ckpt.pt", "tokenizer.model"):  # all a run folder needs to be exported
        shutil.copy(os.path.join(run["out"], name), out / name)
    monkeypatch.chdir(tmp_path)
    for flags, where in ((["--gguf"], out / "model-f16.gguf"),
                         (["--gguf", "--gguf_type=q8_0"], out / "model-q8_0.gguf"),
                         (["--gguf=mine.gguf"], out / "mine.gguf"),
                         ([f"--gguf={os.path.join('.', 'here.gguf')}"], tmp_path / "here.gguf")):
        export.main([f"--out_dir={out}", *flags, "--check=False"])
        assert gguf.GGUFReader(str(where)).fields, flags
    assert sorted(os.listdir(tmp_path)) == ["here.gguf", "run"]
    with open(os.path.join(ROOT, ".gitignore")) as f:
        ignored = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert any(fnmatch.fnmatch("model-f16.gguf", pattern) for pattern in ignored), ignored


def test_without_llama_cpp_the_check_is_a_note(run, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # importing it now raises ImportError
    export.main([f"--out_dir={run['out']}", f"--gguf={tmp_path / 'm.gguf'}"])
    assert "note: llama-cpp-python is not installed" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["m.gguf"]
