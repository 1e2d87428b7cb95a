"""
export.py against independent references: transformers' own GPTNeoXForCausalLM loaded from
the exported folder (its logits, its greedy generate) against our model, the exported
tokenizer loaded by AutoTokenizer against sentencepiece, and eval.py's bits per byte against
one computed from the exported model's logits and tokenizer alone.
"""
import copy
import dataclasses
import errno
import io
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
spm = pytest.importorskip("sentencepiece")
pytest.importorskip("safetensors", reason="export.py writes model.safetensors with safetensors")
pytest.importorskip("tokenizers", reason="export.py builds tokenizer.json with tokenizers")
transformers = pytest.importorskip("transformers", reason="the exported folder is checked by "
                                   "loading it with transformers")
import eval as evalpy  # noqa: E402
import export  # noqa: E402
from formats import hf as hf_files  # noqa: E402
from data.tokenizer import train_tokenizer  # noqa: E402
import decode as decoding  # noqa: E402
from harness import load as loader  # noqa: E402
from model import RoFormer, RoFormerConfig  # noqa: E402
from test_eval import (BLOCK, corpus_docs, make_run, naive_nats, one_line_error,  # noqa: E402
                       one_thread)  # noqa: F401 (an autouse fixture)

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A briefly trained run, exported (without the built-in check) and loaded back."""
    root = tmp_path_factory.mktemp("export")
    out, data = make_run(str(root))
    export.main([f"--out_dir={out}", "--check=False"])
    hf_dir = os.path.join(out, "hf")
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    model = RoFormer(RoFormerConfig(**ckpt["model_args"])).eval()
    model.load_state_dict(ckpt["model"])
    return {"root": root, "out": out, "data": data, "hf_dir": hf_dir, "ckpt": ckpt,
            "model": model, "hf": load_hf(hf_dir),
            "sp": spm.SentencePieceProcessor(model_file=os.path.join(data, "tokenizer.model")),
            "tok": transformers.AutoTokenizer.from_pretrained(hf_dir)}


def load_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def err(*args):
    return one_line_error(export.main, list(args))


def save_run(folder, ckpt, model_args, state):
    """A checkpoint like train.py's (the run's tokenizer identity) with other weights."""
    os.makedirs(folder, exist_ok=True)
    ckpt = {k: v for k, v in ckpt.items() if k != "digest"}  # other weights: not train.py's
    torch.save(dict(ckpt, model_args=model_args, model=state), os.path.join(folder, "ckpt.pt"))
    return str(folder)


def max_logit_diff(model, hf, seed=0):
    """On random ids of the whole window (block_size, or the scaled original context), batch 2."""
    return logit_diffs(model, hf, seed).max().item()


def logit_diffs(model, hf, seed=0):
    """max_logit_diff's differences, per position: (T,)."""
    c = model.config
    idx = torch.randint(0, c.vocab_size, (2, c.context_window),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (hf(idx).logits - model(idx)[0]).abs().amax((0, 2))


def maps_exactly(model, hf, seed=0, tol=1e-4):
    """None, or what differs where: an assertion's message once said only `assert 0.3 < 1e-4`."""
    d = logit_diffs(model, hf, seed)
    if d.max() < tol:
        return None
    c = model.config
    return (f"export: transformers' {type(hf).__name__} of the folder differs from our model by "
            f"{d.max():.2e} (max |logit diff|, tolerance {tol:g}), first at position "
            f"{int((d >= tol).nonzero()[0])} of {len(d)}, for attention={c.attention!r} "
            f"rope_pairs={c.rope_pairs!r} rotary_fraction={c.rotary_fraction:g} rope_scaling="
            f"{c.rope_scaling!r} qk_norm={c.qk_norm}: formats/hf.py's mapping, or what "
            f"transformers reads from config.json")


# --- the model --------------------------------------------------------------------------------

def test_folder_config_and_tied_head(run):
    files = set(os.listdir(run["hf_dir"]))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    with open(os.path.join(run["hf_dir"], "config.json")) as f:
        conf = json.load(f)
    assert conf["architectures"] == ["GPTNeoXForCausalLM"] and conf["tie_word_embeddings"]
    hf = run["hf"]
    assert type(hf).__name__ == "GPTNeoXForCausalLM"
    assert hf.config.use_parallel_residual is False and hf.config.layer_norm_eps == 1e-5
    # the head is the embedding (not a random matrix the loader made up)
    assert torch.equal(hf.get_output_embeddings().weight, run["model"].wte.weight)
    assert hf.generation_config.eos_token_id == run["sp"].eos_id()


@pytest.mark.parametrize("scaling,factor,bias,original,tied", [
    ("none", 1.0, False, 0, True), ("linear", 2.0, False, 0, True), ("ntk", 4.0, False, 0, True),
    ("none", 1.0, True, 0, True), ("yarn", 2.0, False, 0, True), ("none", 1.0, True, 0, False),
    # fine-tune-like: RoPE trained at 16, the block (64) is the window, 4x the original
    ("yarn", 4.0, False, 16, True), ("linear", 4.0, False, 16, True),
    ("ntk", 4.0, False, 16, True)])
def test_random_model_logits_and_greedy_generation_match(run, tmp_path, scaling, factor, bias,
                                                         original, tied):
    """Fresh weights, made sharp (q/k x10) so positions steer the output, random biases and
    LayerNorm gains when bias=True: HF logits equal ours within 1e-4 over the whole window
    (past the original context), and greedy decoding gives the same 32 tokens. Untied: the
    folder's head is lm_head (embed_out, tie_word_embeddings false), its embedding wte."""
    args = dict(run["ckpt"]["model_args"], n_head=4, n_embd=64, bias=bias, rope_scaling=scaling,
                rope_factor=factor, rope_original=original, tie_embeddings=tied)
    torch.manual_seed(1)
    model = RoFormer(RoFormerConfig(**args)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_attn.weight"):
                p[:2 * args["n_embd"]] *= 10.0
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif bias and name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(torch.randn_like(p) * 0.1)
    out = save_run(tmp_path / "out", run["ckpt"], args, model.state_dict())
    export.main([f"--out_dir={out}", "--check=False"])
    hf = load_hf(os.path.join(out, "hf"))
    assert maps_exactly(model, hf) is None, maps_exactly(model, hf)
    assert hf.config.tie_word_embeddings == tied
    assert torch.equal(hf.get_output_embeddings().weight, model.lm_head.weight)
    assert torch.equal(hf.get_input_embeddings().weight, model.wte.weight)
    assert hf.config.max_position_embeddings == model.config.context_window
    if scaling == "yarn":  # truncate=False would be another model (tests/test_rope_scaling.py)
        rope = hf.config.rope_parameters
        assert (rope["truncate"], rope["original_max_position_embeddings"], rope["factor"]) == \
            (True, model.config.original_context, factor)
    if scaling != "none":  # the scaling matters on this model, so dropping it would show
        plain = RoFormer(RoFormerConfig(**dict(args, rope_scaling="none", rope_factor=1.0))).eval()
        plain.load_state_dict(model.state_dict())
        assert max_logit_diff(plain, hf) > 1e-2
    prompt = torch.randint(0, args["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    ours = decoding.generate(model, prompt, 32, temperature=0)
    theirs = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None,
                         pad_token_id=run["sp"].eos_id())
    assert torch.equal(ours, theirs)


def sharp_export(run, tmp_path, args):
    """A fresh model of `args` with q and k made sharp (x10, so positions steer the output),
    saved as a run and exported: (model, run folder, transformers' model of the folder)."""
    torch.manual_seed(1)
    model = RoFormer(RoFormerConfig(**args)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_attn.weight[:2 * args["n_embd"]] *= 10.0
    out = save_run(tmp_path / "out", run["ckpt"], args, model.state_dict())
    export.main([f"--out_dir={out}", "--check=False"])
    return model, out, load_hf(os.path.join(out, "hf"))


@pytest.mark.parametrize("scaling,factor,original", [
    ("none", 1.0, 0), ("ntk", 4.0, 0), ("yarn", 4.0, 16), ("linear", 2.0, 0)])
def test_partial_rotary_logits_match_and_full_rotation_would_not(run, tmp_path, scaling, factor,
                                                                 original):
    """rotary_fraction=0.5 (8 of 16 channels) is transformers' partial_rotary_factor (and
    rotary_pct), its scalings over the rotated dims: HF logits are ours over the window; the
    same weights rotating whole heads are another model."""
    args = dict(run["ckpt"]["model_args"], n_head=4, n_embd=64, rotary_fraction=0.5,
                rope_scaling=scaling, rope_factor=factor, rope_original=original)
    model, out, hf = sharp_export(run, tmp_path, args)
    assert maps_exactly(model, hf) is None, maps_exactly(model, hf)
    with open(os.path.join(out, "hf", "config.json")) as f:
        assert json.load(f)["rotary_pct"] == hf.config.rope_parameters["partial_rotary_factor"] \
            == 0.5
    whole = RoFormer(RoFormerConfig(**dict(args, rotary_fraction=1.0))).eval()
    whole.load_state_dict(model.state_dict())
    assert max_logit_diff(whole, hf) > 1e-2


@pytest.mark.parametrize("pairs,fraction", [("adjacent", 1.0), ("half", 1.0), ("adjacent", 0.5),
                                            ("half", 0.5)])
def test_both_pairings_export_and_the_other_pairing_would_not_match(run, tmp_path, pairs,
                                                                    fraction):
    """rope_pairs: adjacent (the default) and half (runs from before the key) both give
    transformers' logits, partial rotary too, so the folder's q and k rows are in GPT-NeoX's
    pair order for each; the same weights paired the other way are another model."""
    args = dict(run["ckpt"]["model_args"], n_head=4, n_embd=64, rope_pairs=pairs,
                rotary_fraction=fraction)
    model, _, hf = sharp_export(run, tmp_path, args)
    assert maps_exactly(model, hf) is None, maps_exactly(model, hf)
    other = dict(args, rope_pairs="half" if pairs == "adjacent" else "adjacent")
    other = RoFormer(RoFormerConfig(**other)).eval()
    other.load_state_dict(model.state_dict())
    assert max_logit_diff(other, hf) > 1e-2
    said = maps_exactly(other, hf)  # what a wrong mapping's failure says: what and where
    assert said.startswith("export: transformers' GPTNeoXForCausalLM of the folder differs from "
                           "our model by ") and "first at position 1 of" in said and \
        f"rope_pairs={other.config.rope_pairs!r}" in said, said


@pytest.mark.parametrize("extra", [
    {}, {"rotary_fraction": 0.5, "bias": True, "tie_embeddings": False},
    {"rope_pairs": "half", "rope_scaling": "yarn", "rope_factor": 4.0, "rope_original": 16}])
def test_qk_norm_exports_as_persimmon_and_without_its_norms_would_not_match(run, tmp_path, extra):
    """qk_norm=True (each head's q and k at mean 0, RMS 1 before the turn) is transformers'
    PersimmonForCausalLM with qk_layernorm: its logits are ours over the window and greedy
    decoding gives the same 32 tokens, with partial rotary, biases, an untied head and yarn too;
    the same weights without the norm are another model. formats/neox.py's reference computes
    the folder as transformers does (1e-6 in float64), and with qk_layernorm set to false (the
    norms left unread) it is another model there too."""
    args = dict(run["ckpt"]["model_args"], n_head=4, n_embd=64, qk_norm=True, **extra)
    model, out, hf = sharp_export(run, tmp_path, args)
    assert type(hf).__name__ == "PersimmonForCausalLM" and hf.config.qk_layernorm
    assert maps_exactly(model, hf) is None, maps_exactly(model, hf)
    plain = RoFormer(RoFormerConfig(**dict(args, qk_norm=False))).eval()
    plain.load_state_dict(model.state_dict())
    assert max_logit_diff(plain, hf) > 1e-2
    prompt = torch.randint(0, args["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(2))
    theirs = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None,
                         pad_token_id=run["sp"].eos_id())
    assert torch.equal(decoding.generate(model, prompt, 32, temperature=0), theirs)
    folder = os.path.join(out, "hf")
    assert export.reference_check(folder, hf_files.reference_logits, model, "the folder") is None
    ids = torch.randint(0, args["vocab_size"], (model.config.context_window,),
                        generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # the reference is Persimmon as transformers computes it, in float64
        hf64 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
        theirs = hf64.eval()(ids[None]).logits[0]
    assert (hf_files.reference_logits(folder, ids) - theirs).abs().max().item() < 1e-6
    with open(os.path.join(folder, "config.json")) as f:
        conf = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(conf, qk_layernorm=False), f)  # the norms in the file, not computed
    assert "is not this model" in export.reference_check(folder, hf_files.reference_logits,
                                                         model, "the folder")


def test_a_qk_norm_model_written_as_gpt_neox_is_refused_without_transformers(run, tmp_path,
                                                                             monkeypatch):
    """The Persimmon mapping left out (the folder written as GPT-NeoX, as before it), with
    nothing to load the folder: formats/neox.py's reference computes it without the q/k norms
    and disagrees; one line, nothing left."""
    monkeypatch.setattr(export, "hf_model", lambda model, eos, dtype: (
        hf_files.neox_config(model.config, eos, dtype),
        hf_files.neox_weights(model, getattr(torch, dtype))))
    for name in [n for n in sys.modules if n.split(".")[0] == "transformers"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    args = dict(run["ckpt"]["model_args"], qk_norm=True)
    torch.manual_seed(3)
    model = RoFormer(RoFormerConfig(**args))
    out = save_run(tmp_path / "out", run["ckpt"], args, model.state_dict())
    msg = err(f"--out_dir={out}", "--check=False")
    assert "formats/neox.py" in msg and "is not this model" in msg
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["ckpt.pt"]


def test_trained_run_logits_and_greedy_generation_match(run):
    model, hf = run["model"], run["hf"]
    assert maps_exactly(model, hf, seed=3) is None, maps_exactly(model, hf, seed=3)
    prompt = torch.tensor([run["sp"].encode("def value_1(x):\n    return")])
    ours = decoding.generate(model, prompt, 32, temperature=0)
    # min_new_tokens would ban EOS; eos_token_id=None lets both run 32 tokens unhindered
    theirs = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None,
                         pad_token_id=run["sp"].eos_id())
    assert theirs.shape == (1, prompt.size(1) + 32)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_builtin_check_reports_a_match(run, capsys, tmp_path, dtype):
    """export.py's own check (transformers vs our model with the same rounded weights)."""
    export.main([f"--out_dir={run['out']}", f"--hf_dir={tmp_path / 'hf'}", f"--dtype={dtype}"])
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == dtype
    line = [l for l in capsys.readouterr().err.splitlines() if l.startswith("check:")][0]
    diff = float(line.split("difference| ")[1].split()[0])
    n = line.split("sentencepiece on ")[1].split()[0]
    assert diff < 1e-4 and n.split("/")[0] == n.split("/")[1] and int(n.split("/")[1]) > 10


def test_the_check_keeps_transformers_quiet_and_its_settings_as_they_were(run, capfd,
                                                                           tmp_path):
    """Issue 45: transformers' `Loading weights` bar ran into export's output. With
    transformers set as it is by default (warnings on, bars on), the check's load prints none
    of it (nor its warning that the check's whole text is longer than the model's context), and
    the settings are the user's again afterwards. capfd: transformers' log handler holds the
    stderr it found at import, which capsys would not see."""
    log = transformers.utils.logging
    log.set_verbosity_warning()
    log.enable_progress_bar()
    try:
        capfd.readouterr()
        export.main([f"--out_dir={run['out']}", f"--hf_dir={tmp_path / 'hf'}"])
        errtext = capfd.readouterr().err
        assert "check: transformers loads it" in errtext and "Loading" not in errtext, errtext
        # a text longer than the model's context, as a run's validation text is: transformers
        # would warn about it through its logger (held here, whatever stream it writes to)
        heard = io.StringIO()
        handler = logging.StreamHandler(heard)
        logging.getLogger("transformers").addHandler(handler)
        try:
            export.check_export(run["hf_dir"], run["model"], run["sp"], "def f(x):\n" * 3000)
        finally:
            logging.getLogger("transformers").removeHandler(handler)
        assert heard.getvalue() == "", heard.getvalue()
        assert log.get_verbosity() == log.WARNING and log.is_progress_bar_enabled()
    finally:
        log.set_verbosity_error()


# --- the tokenizer ----------------------------------------------------------------------------

def tricky_texts(seed=0, n_random=1500):
    """Runs of 1-40 spaces, tabs and newlines, CJK, emoji, characters outside the vocabulary
    (byte pieces), digits, and text that looks like special pieces, alone and mixed."""
    texts = []
    for n in range(1, 41):
        texts += [" " * n, "x" + " " * n + "y", "\n" + " " * n + "return x", "\t" * n,
                  "\n" * n, " \t" * (n // 2 + 1), "a" * n, "9" * n, "def" + " " * n]
    texts += ["世界你好，中文字符。", "🙂", "a🙂b 🚀🚀", "ǅ", "\x00\x01", "\u2028", "𝔘𝔫𝔦", "café",
              "<s>", "</s>", "<unk>", "<0x41>", "x<s>y</s>", " <s> ", "12,345.678"]
    rng = random.Random(seed)
    alphabet = list("abcdefxyz_()[]{}:.,=+-*/#'\"0123456789") + [" "] * 12 + \
        ["\t", "\n", "\n", "世", "界", "🙂", "é", "λ", "ǅ", "\u2028", "<s>", "</s>", "<unk>"]
    for _ in range(n_random):
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 50))))
    for _, doc in corpus_docs(6, seed=2):
        texts += doc.split("\n") + [doc]
    return texts


def assert_same_as_sentencepiece(tok, sp, texts):
    bad = [t for t in texts if tok(t).input_ids != sp.encode(t)]  # default: special tokens on
    assert not bad, f"{len(bad)} of {len(texts)} differ, e.g. {bad[0]!r}: " \
                    f"{tok(bad[0]).input_ids} vs {sp.encode(bad[0])}"
    undecoded = [t for t in texts if tok.decode(tok(t).input_ids) != t]
    assert not undecoded, f"{undecoded[0]!r} decodes to {tok.decode(tok(undecoded[0]).input_ids)!r}"


def test_tokenizer_gives_sentencepiece_ids_and_decodes_back(run):
    tok, sp = run["tok"], run["sp"]
    assert type(tok).__name__ != "GPTNeoXTokenizerFast"
    assert tok.eos_token == "</s>" and tok.eos_token_id == sp.eos_id() and tok.bos_token is None
    texts = tricky_texts()
    assert any(sp.is_byte(i) for t in texts for i in sp.encode(t))  # byte fallback exercised
    assert len(sp.encode(" " * 40)) < 40  # space runs are merged pieces, so merges are tested
    assert_same_as_sentencepiece(tok, sp, texts)
    assert tok("x", add_special_tokens=True).input_ids == sp.encode("x")  # no BOS added
    assert sp.piece_to_id("<s>") not in tok("<s>").input_ids  # typed "<s>" stays text


def test_batched_generation_pads_with_end_of_document(run):
    """pad_token is the end-of-document piece (as GPT-NeoX models do), on the left: batched
    greedy generation through transformers' pipeline gives, for each prompt, the text our
    model's greedy decoding of that prompt alone gives."""
    tok, sp, model = run["tok"], run["sp"], run["model"]
    assert tok.pad_token == "</s>" and tok.pad_token_id == sp.eos_id()
    prompts = ["def value_1(x):\n    return", "the", "model: 世界 你好"]
    batch = tok(prompts, padding=True)
    lengths = [len(sp.encode(p)) for p in prompts]
    for ids, mask, n in zip(batch.input_ids, batch.attention_mask, lengths):
        assert ids[len(ids) - n:] == sp.encode(prompts[lengths.index(n)]) and sum(mask) == n
        assert ids[:len(ids) - n] == [sp.eos_id()] * (len(ids) - n)  # padded on the left
    pipe = transformers.pipeline("text-generation", model=run["hf"], tokenizer=tok, device="cpu")
    outs = pipe(prompts, batch_size=2, max_new_tokens=12, do_sample=False)
    for prompt, out in zip(prompts, outs):
        ids = sp.encode(prompt)
        new = decoding.generate(model, torch.tensor([ids]), 12, temperature=0)[0, len(ids):].tolist()
        new = new[:new.index(sp.eos_id())] if sp.eos_id() in new else new
        assert out[0]["generated_text"] == sp.decode(ids + new)


def test_char_tokenizer_and_unigram_refusal(run, tmp_path):
    """data/text/prepare.py also trains char tokenizers (shakespeare_char): same checks. A
    unigram one is refused with one line (its ids would differ on runs of spaces)."""
    lines = [l for _, d in corpus_docs() for l in d.split("\n") if l.strip()]
    sp = spm.SentencePieceProcessor(model_proto=train_tokenizer(lines, 0, "char")[0])
    path = tmp_path / "hf"
    path.mkdir()
    export.hf_tokenizer(sp).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(export.tokenizer_config(sp, BLOCK)))
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert_same_as_sentencepiece(tok, sp, tricky_texts(seed=1, n_random=500))
    uni = spm.SentencePieceProcessor(model_proto=train_tokenizer(lines, 330, "unigram")[0])
    assert "unigram" in one_line_error(export.hf_tokenizer, uni)


# --- eval.py and the exported model agree on bits per byte -----------------------------------

def test_eval_bpb_equals_bpb_from_exported_model(run, capsys, tmp_path):
    # one paragraph (no blank line): eval.py splits a single file at blank lines, as prepare does
    text = "\n".join(t for _, t in corpus_docs(6, seed=4))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    capsys.readouterr()
    evalpy.main([f"--out_dir={run['out']}", f"--input={tmp_path / 't.txt'}", "--json"])
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok, hf = run["tok"], run["hf"]
    ids = [tok.eos_token_id] + tok(text).input_ids
    assert len(ids) > 3 * BLOCK
    with torch.no_grad():
        nats = naive_nats(lambda ctx: hf(torch.tensor([ctx])).logits[0, -1], ids, BLOCK, BLOCK // 2)
    bpb = nats / math.log(2) / len(text.encode("utf-8"))
    assert ours["tokens"] == len(ids) - 1
    assert abs(ours["bits_per_byte"] - bpb) < 1e-4


# --- refusals and errors ----------------------------------------------------------------------

@pytest.mark.parametrize("change,reason", [({"attention": "linear"}, "linear attention"),
                                           ({"pos_encoding": "sinusoidal"}, "only through RoPE"),
                                           ({"pos_encoding": "none"}, "only through RoPE"),
                                           ({"pos_encoding": "learned"}, "GPT-2"),
                                           ({"nope_every": 2}, "nope_every=2"),
                                           ({"window": 4, "global_every": 2}, "window=4"),
                                           ({"length_temperature": 0.1},
                                            "length_temperature=0.1")])
def test_models_without_a_faithful_mapping_are_refused(run, tmp_path, change, reason):
    args = dict(run["ckpt"]["model_args"], **change)
    model = RoFormer(RoFormerConfig(**args))
    why = export.refusal(model, "hf")
    assert why and reason in why, refused_wrongly("hf", reason, why)
    out = save_run(tmp_path / "out", run["ckpt"], args, model.state_dict())
    msg = err(f"--out_dir={out}", "--check=False")
    assert reason in msg and "cannot export" in msg, refused_wrongly("hf", reason, msg)
    assert not os.path.exists(tmp_path / "out" / "hf")


@pytest.mark.parametrize("change", [{"pos_encoding": "none"}, {"attention": "linear"}])
def test_a_wrongly_allow_listed_change_is_refused_without_transformers(run, tmp_path, monkeypatch,
                                                                       change):
    """Issue 37: a configuration GPT-NeoX cannot express, let through by a wrong allow-list
    entry, with nothing to load the folder (--check=False, no transformers): formats/neox.py's
    reference computes the folder as written and disagrees; one line, nothing left."""
    monkeypatch.setattr(export, "config_refusal", lambda c, kind: None)  # the wrong entry
    for name in [n for n in sys.modules if n.split(".")[0] == "transformers"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    args = dict(run["ckpt"]["model_args"], **change)
    torch.manual_seed(3)
    model = RoFormer(RoFormerConfig(**args))
    with torch.no_grad():  # sharp attention, so that positions steer the logits
        for block in model.blocks:
            block.attn.c_attn.weight[:2 * args["n_embd"]] *= 10.0
    out = save_run(tmp_path / "out", run["ckpt"], args, model.state_dict())
    msg = err(f"--out_dir={out}", "--check=False")
    assert "formats/neox.py" in msg and "is not this model" in msg
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["ckpt.pt"]


def test_a_new_option_at_its_default_exports_and_at_another_value_is_refused():
    """Issue 47: a field model.py gains later (here `mlp`, made on the fly) needed a line in
    export.py even at its default, or both exports refused every model. At its default it is
    today's model and maps; at another value it is refused by name, saying the default maps."""
    New = dataclasses.make_dataclass("New", [("mlp", str, "gelu")], bases=(RoFormerConfig,))
    assert "mlp" not in export.MAPPED_FIELDS
    for kind in ("hf", "gguf"):
        assert export.config_refusal(New(**TINY), kind) is None
        assert export.config_refusal(RoFormerConfig(**TINY), kind) is None
        why = export.config_refusal(New(**TINY, mlp="swiglu"), kind)
        assert why and why.startswith("config field mlp='swiglu'") and "'gelu'" in why, why


def test_any_other_position_encoding_is_refused():
    """Checked by value: encodings model.py may gain later (alibi, t5, ...) are refused too."""
    model = RoFormer(RoFormerConfig(**TINY))
    for pos in ("alibi", "t5", "shaw", "something"):
        c = copy.copy(model.config)
        c.pos_encoding = pos  # past __post_init__: a value RoFormerConfig may accept one day
        for kind in ("hf", "gguf"):
            why = export.refusal(SimpleNamespace(config=c), kind)
            named = "only through RoPE"
            assert why and named in why, refused_wrongly(kind, named, why)
    for kind in ("hf", "gguf"):
        why = export.refusal(model, kind)
        assert why is None, mapped_refused(kind, why)


def refused_wrongly(kind, named, why):
    """The message of a refusal test that failed: what was expected, what came out, and what
    to do when the cause is a correct new mapping (these tests pin today's refusals)."""
    if why is None:
        return (f"expected the {kind} export to refuse this model in one line naming {named!r}; "
                f"export.refusal returned None, so the model would be exported. This test pins "
                f"today's refusals: if the {kind} export now maps this change exactly, move the "
                f"case from this test to the exports' exact-mapping tests and teach formats/neox.py "
                f"what it computes (docs/HACKING.md, 'A newly mapped option')")
    return f"expected the {kind} export's refusal to be one line naming {named!r}; got {why!r}"


def mapped_refused(kind, why):
    return f"the plain model, which the {kind} export maps, is refused: {why!r}"


TINY = dict(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=16)


def with_field(model, name, value, default):
    """The model with a config that has one field more, as a researcher's option would add
    (its default today's model), set to `value`."""
    Extended = dataclasses.make_dataclass("Extended", [(name, type(value), default)],
                                          bases=(RoFormerConfig,))
    # the value given, also where the field already exists (a researcher added it for real)
    model.config = Extended(**{**dataclasses.asdict(model.config), name: value})
    return model


def qk_norm(model):  # QK-norm: a new parameter per layer
    model.blocks[0].attn.q_norm = torch.nn.LayerNorm(8)
    return model


def swiglu(model):  # SwiGLU: a gate matrix beside c_fc
    model.blocks[1].mlp.c_gate = torch.nn.Linear(16, 64, bias=False)
    return model


def narrow_mlp(model):  # another MLP width: the shapes the exports write would be wrong
    model.blocks[0].mlp.c_fc = torch.nn.Linear(16, 32, bias=False)
    model.blocks[0].mlp.c_proj = torch.nn.Linear(32, 16, bias=False)
    return model


def untied(model):
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone() + 1)
    return model


@pytest.mark.parametrize("change", [{"nope_every": 2}, {"window": 4, "global_every": 2},
                                    {"length_temperature": 0.1}, {"value_residual": True}])
def test_a_value_refused_is_named_with_the_values_mapped_and_the_way_out(change):
    """Issue 45: "the hf export maps only (0,)" printed a raw tuple. The refusal names the
    value given, the value mapped as a setting (not a tuple) and what a user can do."""
    key, value = next(iter(change.items()))
    model = RoFormer(RoFormerConfig(**TINY, **change))
    for kind in ("hf", "gguf"):
        why = export.refusal(model, kind)
        mapped = export.MAPPED_FIELDS[key][0]
        assert f"{key}={value!r}" in why and f"{key}={mapped!r}" in why, why
        assert "(" not in why and "sample.py" in why and "trained with" in why, why


def activation(act):
    def change(model):  # same keys and shapes: only the module says what is computed
        model.blocks[1].mlp.gelu = act
        return model
    return change


def no_bias_field(model):  # a config that lost a field the exports read
    model.config = SimpleNamespace(**{k: v for k, v in vars(model.config).items() if k != "bias"})
    return model


@pytest.mark.parametrize("change,named", [
    (lambda m: with_field(m, "mlp", "swiglu", "gelu"), "mlp='swiglu'"),
    (lambda m: with_field(m, "value_residual", True, False), "value_residual=True"),
    (lambda m: with_field(m, "rotary_pct", 0.5, 1.0), "rotary_pct=0.5"),
    (qk_norm, "blocks.0.attn.q_norm.weight"),
    (swiglu, "blocks.1.mlp.c_gate.weight"),
    (narrow_mlp, "blocks.0.mlp.c_fc.weight has shape [32, 16]"),
    (untied, "lm_head.weight"),
    (activation(torch.nn.SiLU()), "SiLU"),
    (activation(torch.nn.GELU(approximate="tanh")), "tanh"),
    (no_bias_field, "no field bias"),
])
def test_refusal_maps_what_it_knows_and_names_the_first_thing_it_does_not(change, named):
    """Issue 28: a model.py change (a SwiGLU MLP, QK-norm, partial rotary) exported as if it
    were the plain model. Both exports allow-list the config fields, the state-dict keys and
    shapes and the modules they map, and name the first other one in one line. These cases pin
    today's refusals: a correct new mapping moves its case out (refused_wrongly says how)."""
    for kind in ("hf", "gguf"):
        for bias in (False, True):
            model = RoFormer(RoFormerConfig(**TINY, bias=bias))
            why = export.refusal(model, kind)
            assert why is None, mapped_refused(kind, why)
            why = export.refusal(change(model), kind)
            assert why and named in why and "\n" not in why, refused_wrongly(kind, named, why)


class QKNormRoFormer(RoFormer):
    """model.py as a researcher changed it: a q_norm per attention layer (the forward is left
    alone: what matters is that the weights are in the checkpoint and no export maps them)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        for block in self.blocks:
            block.attn.q_norm = torch.nn.LayerNorm(cfg.n_embd // cfg.n_head, bias=False)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_a_changed_model_is_refused_before_anything_is_written(run, tmp_path, monkeypatch, kind):
    if kind == "gguf":
        pytest.importorskip("gguf")
    monkeypatch.setattr(loader, "RoFormer", QKNormRoFormer)  # load_run builds this one
    args = run["ckpt"]["model_args"]
    state = QKNormRoFormer(RoFormerConfig(**args)).state_dict()
    out = save_run(tmp_path / "out", run["ckpt"], args, state)
    target = ["--gguf=" + str(tmp_path / "m.gguf")] if kind == "gguf" else []
    msg = err(f"--out_dir={out}", *target)
    assert "cannot export" in msg and "blocks.0.attn.q_norm.weight" in msg
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["ckpt.pt"]


def test_a_failed_check_leaves_nothing_behind(run, tmp_path, monkeypatch):
    """The folder is checked where it was written, beside its place: a failed check removes it
    and keeps the previous export (or none) exactly as it was."""
    target = tmp_path / "hf"
    monkeypatch.setattr(export, "check_export", lambda *a: (1.0, 0, 3))  # logits differ
    assert "does not match" in err(f"--out_dir={run['out']}", f"--hf_dir={target}")
    assert os.listdir(tmp_path) == []
    export.main([f"--out_dir={run['out']}", f"--hf_dir={target}", "--check=False"])
    before = hf_folder_state(target)
    assert "does not match" in err(f"--out_dir={run['out']}", f"--hf_dir={target}",
                                   "--dtype=float16")
    assert hf_folder_state(target) == before and os.listdir(tmp_path) == ["hf"]


def test_a_line_says_what_export_does_before_it_writes_and_checks(run, tmp_path, capsys,
                                                                  monkeypatch):
    """Issue 60 item 18: export was 10-11 s without a line (writing, the float64 reference,
    transformers loading the folder). A line naming the run and where it goes is out before
    the first byte is written, and is the only line before it."""
    seen, write = [], export.write_checked

    def spy(path, *args, **kwargs):
        seen.append(capsys.readouterr().err)  # what the user has read when the writing starts
        return write(path, *args, **kwargs)
    monkeypatch.setattr(export, "write_checked", spy)
    capsys.readouterr()
    export.main([f"--out_dir={run['out']}", f"--hf_dir={tmp_path / 'hf'}", "--check=False"])
    assert seen == [f"exporting {run['out']} to {tmp_path / 'hf'}: writing it, then checking it "
                    f"against this run\n"]
    assert capsys.readouterr().err.startswith(f"wrote {tmp_path / 'hf'}: GPTNeoXForCausalLM")


def test_missing_packages_and_bad_arguments(run, monkeypatch):
    o = f"--out_dir={run['out']}"
    assert "dtype" in err(o, "--dtype=int8")
    assert "unknown config key" in err(o, "--hf=x")
    for package in ("safetensors", "transformers", "tokenizers"):
        with monkeypatch.context() as m:
            for name in [n for n in sys.modules if n.split(".")[0] == package]:
                m.setitem(sys.modules, name, None)  # importing it now raises ImportError
            assert f"'{package}' package" in err(o)


def test_missing_protobuf_is_one_line_and_listed_for_tests(run, monkeypatch):
    """export reads the sentencepiece model's pieces through its protobuf schema (both formats
    need piece types and the trainer settings), so protobuf is a real dependency of export.py:
    missing, it is one line naming it; and requirements-test.txt installs it (and gguf)."""
    for name in [n for n in sys.modules if n.split(".")[0] == "google" or n.endswith("_pb2")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "google.protobuf", None)
    assert "'protobuf' package" in err(f"--out_dir={run['out']}")
    assert "'protobuf' package" in err(f"--out_dir={run['out']}", "--gguf=x.gguf")
    with open(os.path.join(ROOT, "requirements-test.txt")) as f:
        listed = {line.split("#")[0].strip().split(">")[0].split("=")[0].split("[")[0].lower()
                  for line in f}
    assert {"protobuf", "gguf", "transformers", "safetensors", "tokenizers"} <= listed


def test_truncated_val_bin_is_refused_in_one_line(run, tmp_path):
    """The validation text for the check is read through harness.dataset.open_split: a val.bin
    shorter than meta.json says is named in one line, and no export is left behind."""
    data = tmp_path / "data"
    shutil.copytree(run["data"], data)
    with open(data / "val.bin", "r+b") as f:
        f.truncate(os.path.getsize(data / "val.bin") // 2)
    info = dict(run["ckpt"]["tokenizer"], data_dir=str(data), path=str(data / "tokenizer.model"))
    config = dict(run["ckpt"]["config"], data_dir=str(data))  # the folder the run read
    out = save_run(tmp_path / "out", dict(run["ckpt"], tokenizer=info, config=config),
                   run["ckpt"]["model_args"], run["ckpt"]["model"])
    msg = err(f"--out_dir={out}")
    assert "val.bin" in msg and "meta.json" in msg
    assert os.listdir(out) == ["ckpt.pt"]


def hf_folder_state(path):
    return {name: (os.path.getmtime(os.path.join(path, name)),
                   open(os.path.join(path, name), "rb").read()) for name in os.listdir(path)}


def test_failed_write_keeps_the_previous_export_and_leaves_no_temp(run, tmp_path, monkeypatch):
    """The disk fills up (ENOSPC from fsync, as delayed allocation reports it) while the new
    folder is written: one error line, the previous export exactly as it was, nothing else."""
    target = tmp_path / "hf"
    export.main([f"--out_dir={run['out']}", f"--hf_dir={target}", "--check=False"])
    before = hf_folder_state(target)
    calls = []

    def full_disk(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full_disk)
        msg = err(f"--out_dir={run['out']}", f"--hf_dir={target}", "--check=False",
                  "--dtype=float16")
    assert "No space left" in msg and str(target) in msg
    assert hf_folder_state(target) == before
    assert os.listdir(tmp_path) == ["hf"]
    # and a folder that export did not write is never replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert "did not write" in err(f"--out_dir={run['out']}", f"--hf_dir={tmp_path / 'mine'}")
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def mount_tmpfs(path, size):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True)
    if r.returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    return path


def test_full_disk_on_a_real_filesystem(run, tmp_path):
    """A tmpfs with room for one export, not two: exporting again fails with one line while
    the first export stays whole and no temp folder remains."""
    disk = mount_tmpfs(tmp_path / "disk", "400k")
    try:
        target = disk / "hf"
        export.main([f"--out_dir={run['out']}", f"--hf_dir={target}", "--check=False"])
        before = hf_folder_state(target)
        assert sum(len(data) for _, data in before.values()) > 200_000  # two do not fit
        msg = err(f"--out_dir={run['out']}", f"--hf_dir={target}", "--check=False")
        assert "No space left" in msg
        assert hf_folder_state(target) == before and os.listdir(disk) == ["hf"]
        shutil.rmtree(target)  # room again: the export goes through, as a whole folder
        export.main([f"--out_dir={run['out']}", f"--hf_dir={target}", "--check=False"])
        assert set(os.listdir(target)) == set(export.HF_FILES)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
