"""
Export a trained run as a Hugging Face model folder that transformers loads with no custom
code: GPTNeoXForCausalLM is exactly this model (pre-LayerNorm blocks, exact GELU MLP, RoPE in
the rotate-half layout on the whole head, sequential residual).

    python export.py --out_dir=out-small                  # -> out-small/hf
    python export.py --out_dir=out-small --hf_dir=my-model --dtype=bfloat16

The folder holds config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json. Afterwards it is loaded back with transformers and checked: the same
logits as ours on a random block, the same token ids as sentencepiece on the run's own
validation text (--check=False skips that; it is what needs transformers).
"""
import importlib
import json
import os
import sys

import torch

from checkpoint import dataset_dir, load_run
from configurator import ConfigError, configure

# -----------------------------------------------------------------------------------------
out_dir = "out"
hf_dir = ""             # "" is out_dir/hf
dtype = "float32"       # of the exported weights: float32 | bfloat16 | float16
tokenizer = ""          # "" uses the path recorded in the checkpoint; either way its sha256 must match
check = True            # load the export back with transformers and compare logits and token ids
# -----------------------------------------------------------------------------------------


def need(module):
    """Import an optional package's module, or stop with one line naming the package."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        sys.exit(f"error: export.py needs the '{package}' package: pip install {package}")


def refusal(c):
    """Why this model has no faithful GPT-NeoX form, or None when it has one."""
    if c.attention != "softmax":
        return (f"attention={c.attention!r}: transformers has no architecture with RoFormer's "
                f"linear attention (eq. 19), so no loader would compute what this model computes")
    if c.pos_encoding != "rope":
        return (f"pos_encoding={c.pos_encoding!r}: GPT-NeoX knows positions only through RoPE, "
                f"so only pos_encoding='rope' exports (learned positions are not exported as "
                f"GPT-2 either)")
    return None


# --- the model ---------------------------------------------------------------------------

def neox_config(c, eos_id, torch_dtype):
    """config.json. The RoPE keys are written both the way transformers 5 reads them
    (rope_parameters) and the older way (rotary_pct, rotary_emb_base, rope_scaling) that other
    GPT-NeoX readers use."""
    head_dim = c.n_embd // c.n_head
    theta, context, scaling = c.rope_base, c.block_size, None
    if c.rope_scaling == "ntk":  # static NTK-aware scaling is plain RoPE with a larger base
        theta = c.rope_base * c.rope_factor ** (head_dim / (head_dim - 2))
        context = int(c.block_size * c.rope_factor)
    elif c.rope_scaling == "linear" and c.rope_factor != 1.0:  # positions divided by factor
        scaling = {"rope_type": "linear", "type": "linear", "factor": c.rope_factor}
        context = int(c.block_size * c.rope_factor)
    rope = dict(scaling or {"rope_type": "default"}, rope_theta=theta, partial_rotary_factor=1.0)
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "intermediate_size": 4 * c.n_embd,
        "hidden_act": "gelu",                # exact (erf) GELU, as F.gelu
        "layer_norm_eps": 1e-5,              # nn.LayerNorm's default
        "use_parallel_residual": False,      # x + attn(ln1(x)), then + mlp(ln2(.))
        "attention_bias": True,              # zeros when we train bias-free (see neox_weights)
        "tie_word_embeddings": True,
        "max_position_embeddings": context,  # RoPE runs past it; this is what was trained for
        "rotary_pct": 1.0,
        "rotary_emb_base": theta,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "attention_dropout": c.dropout,
        "hidden_dropout": c.dropout,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,                # documents start after EOS; BOS is never trained
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }


def neox_weights(model, dtype):
    """Our state dict -> GPT-NeoX tensor names. Two changes of form, none of content:
    - c_attn's output rows are [q | k | v], each (n_head, head_dim); GPT-NeoX's are per head,
      (n_head, [q, k, v], head_dim), so the rows are regrouped;
    - GPT-NeoX always has biases on every linear and LayerNorm: ours are zero when bias=False.
    The output head is written as embed_out.weight, a copy of the tied embedding: the config
    says it is tied (transformers ties them), and readers with no tying get the same matrix."""
    c = model.config
    H, D, C = c.n_head, c.n_embd // c.n_head, c.n_embd
    sd = {k: v.detach().to(dtype=torch.float32, device="cpu") for k, v in model.state_dict().items()}

    def bias(name, n):
        return sd.get(name, torch.zeros(n))

    out = {"gpt_neox.embed_in.weight": sd["wte.weight"],
           "gpt_neox.final_layer_norm.weight": sd["ln_f.weight"],
           "gpt_neox.final_layer_norm.bias": bias("ln_f.bias", C),
           "embed_out.weight": sd["wte.weight"].clone()}
    for i in range(c.n_layer):
        p, q = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        qkv_w = sd[p + "attn.c_attn.weight"].view(3, H, D, C).transpose(0, 1).reshape(3 * C, C)
        qkv_b = bias(p + "attn.c_attn.bias", 3 * C).view(3, H, D).transpose(0, 1).reshape(3 * C)
        out.update({
            q + "input_layernorm.weight": sd[p + "ln_1.weight"],
            q + "input_layernorm.bias": bias(p + "ln_1.bias", C),
            q + "attention.query_key_value.weight": qkv_w,
            q + "attention.query_key_value.bias": qkv_b,
            q + "attention.dense.weight": sd[p + "attn.c_proj.weight"],
            q + "attention.dense.bias": bias(p + "attn.c_proj.bias", C),
            q + "post_attention_layernorm.weight": sd[p + "ln_2.weight"],
            q + "post_attention_layernorm.bias": bias(p + "ln_2.bias", C),
            q + "mlp.dense_h_to_4h.weight": sd[p + "mlp.c_fc.weight"],
            q + "mlp.dense_h_to_4h.bias": bias(p + "mlp.c_fc.bias", 4 * C),
            q + "mlp.dense_4h_to_h.weight": sd[p + "mlp.c_proj.weight"],
            q + "mlp.dense_4h_to_h.bias": bias(p + "mlp.c_proj.bias", C),
        })
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


# --- the tokenizer -----------------------------------------------------------------------

def hf_tokenizer(sp):
    """The run's sentencepiece model as a `tokenizers` Tokenizer giving the same ids.

    Our sentencepiece settings (data/common.py) make this a plain byte-fallback BPE: identity
    normalisation, no dummy prefix, so the only normalisation is " " -> "▁"; "\\n" is a fixed
    piece matched before the model runs (an added token here). The merges are rebuilt from the
    vocabulary: sentencepiece merges the adjacent pair whose joined piece scores highest, so
    every split of each normal piece into two pieces becomes a merge, ranked by the joined
    piece's score. Control pieces (<s>, </s>) and <unk> become special tokens that are never
    matched in text: a literal "<s>" in a document is text (split_special_tokens)."""
    need("tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:  # the proto reader needs protobuf, which wandb already requires
        sys.exit("error: reading the sentencepiece model needs the 'protobuf' package: "
                 "pip install protobuf")
    m = pb.ModelProto()
    m.ParseFromString(sp.serialized_model_proto())
    P, spec, norm = pb.ModelProto.SentencePiece, m.trainer_spec, m.normalizer_spec
    kind = {spec.BPE: "bpe", spec.CHAR: "char"}.get(spec.model_type)
    if kind is None:
        # unigram: tried, and `tokenizers`' Viterbi breaks ties between equal-score
        # segmentations (runs of spaces) differently from sentencepiece: other ids
        sys.exit("error: only bpe and char sentencepiece tokenizers are exported (the default "
                 "ones); a unigram tokenizer would give different ids on runs of spaces")
    custom = norm.name not in ("identity", "") or norm.add_dummy_prefix or \
        norm.remove_extra_whitespaces or spec.treat_whitespace_as_suffix
    if custom:  # data/common.py never trains these; other settings would need more than a Replace
        sys.exit(f"error: the tokenizer was trained with normalization {norm.name!r}, "
                 f"add_dummy_prefix={norm.add_dummy_prefix}, remove_extra_whitespaces="
                 f"{norm.remove_extra_whitespaces}; export handles identity/False/False only")
    if not spec.byte_fallback:
        sys.exit("error: the tokenizer has no byte fallback; export reproduces byte-fallback "
                 "tokenizers only (data/common.py always trains with it)")
    pieces = list(m.pieces)
    unk = pieces[spec.unk_id].piece
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    merges = []
    if kind == "bpe":  # a char model is the same BPE without merges
        normal = sorted((i for i, p in enumerate(pieces) if p.type == P.NORMAL),
                        key=lambda i: (-pieces[i].score, i))
        for i in normal:
            s = pieces[i].piece
            splits = [(s[:k], s[k:]) for k in range(1, len(s)) if s[:k] in vocab and s[k:] in vocab]
            merges += sorted(splits, key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True,
                       fuse_unk=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                            for p in pieces if p.type in (P.CONTROL, P.UNKNOWN)])
    tok.add_tokens([AddedToken(p.piece, special=False, normalized=False)
                    for p in pieces if p.type == P.USER_DEFINED])
    return tok


def tokenizer_config(sp, context):
    """tokenizer_config.json. tokenizer_class is what makes AutoTokenizer read tokenizer.json
    as it is (without it, transformers picks the GPT-NeoX tokenizer class: wrong ids).
    No BOS is added: the model never saw one (a document starts after EOS)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": sp.id_to_piece(sp.eos_id()),
            "unk_token": sp.id_to_piece(sp.unk_id()),
            "split_special_tokens": True,           # "<s>" typed in text stays text
            "clean_up_tokenization_spaces": False,  # decode gives back the exact text
            "add_bos_token": False, "add_eos_token": False,
            "model_max_length": context}


# --- the check ---------------------------------------------------------------------------

def check_export(path, model, sp, text, dtype):
    """Load the folder with transformers and compare with our model (whose weights are rounded
    here to the exported dtype; both compute in float32) and tokenizer. Returns (max |logit difference|
    on two random blocks, texts tokenized differently, texts compared)."""
    transformers = need("transformers")
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    c = model.config
    with torch.no_grad():  # round the weights in place to what the file holds (not via
        for p in model.parameters():  # model.to(dtype): that would round the RoPE tables too)
            p.copy_(p.to(dtype))
    idx = torch.randint(0, c.vocab_size, (2, c.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
    texts = text.split("\n") + [text]
    bad = sum(tok(t).input_ids != sp.encode(t) for t in texts)  # (and no BOS is added)
    return diff, bad, len(texts)


def validation_text(ckpt, sp, max_tokens=20000):
    """Some of the run's own validation text for the tokenizer check ("" if not found)."""
    import numpy as np
    ddir = dataset_dir(ckpt)
    if not ddir:
        return ""
    with open(os.path.join(ddir, "meta.json")) as f:
        dt = json.load(f)["dtype"]
    return sp.decode(np.fromfile(os.path.join(ddir, "val.bin"), dtype=dt, count=max_tokens).tolist())


def main(argv):
    names = ("out_dir", "hf_dir", "dtype", "tokenizer", "check")
    try:
        cfg = configure({k: globals()[k] for k in names}, argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if cfg["dtype"] not in ("float32", "bfloat16", "float16"):
        sys.exit(f"error: dtype must be float32, bfloat16 or float16, got {cfg['dtype']!r}")
    st = need("safetensors.torch")
    need("tokenizers")
    if cfg["check"]:
        need("transformers")

    # float32 on the CPU: export copies the exact weights, it computes nothing
    model, sp, ckpt = load_run(cfg["out_dir"], torch.device("cpu"), "float32", cfg["tokenizer"])
    c = model.config
    why = refusal(c)
    if why:
        sys.exit(f"error: cannot export {cfg['out_dir']}: {why}")
    if sp.eos_id() < 0:
        sys.exit("error: the tokenizer has no end-of-document piece (eos_id); export needs one")
    tok = hf_tokenizer(sp)  # before anything is written: it may refuse too
    path = cfg["hf_dir"] or os.path.join(cfg["out_dir"], "hf")
    try:
        os.makedirs(path, exist_ok=True)
        if os.path.exists(os.path.join(path, "model.safetensors")):  # an earlier export:
            os.remove(os.path.join(path, "model.safetensors"))     # complete only when redone
    except OSError as e:
        sys.exit(f"error: cannot write to {path}: {e.strerror or e}")

    conf = neox_config(c, sp.eos_id(), cfg["dtype"])
    gen = {"eos_token_id": sp.eos_id(), "pad_token_id": sp.eos_id(), "do_sample": True,
           "temperature": 0.8, "top_k": 200}  # sample.py's defaults
    weights = neox_weights(model, getattr(torch, cfg["dtype"]))
    files = {"config.json": conf, "generation_config.json": gen,
             "tokenizer_config.json": tokenizer_config(sp, conf["max_position_embeddings"])}
    for name, obj in files.items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    tok.save(os.path.join(path, "tokenizer.json"))
    # written last, through a temp name: a folder with model.safetensors in it is complete
    tmp = os.path.join(path, ".model.safetensors.tmp")
    with open(tmp, "wb") as f:
        f.write(st.save(weights, metadata={"format": "pt"}))
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    size = os.path.getsize(os.path.join(path, "model.safetensors"))
    print(f"wrote {path}: GPTNeoXForCausalLM, {model.num_params() / 1e6:.2f}M params "
          f"({cfg['dtype']}, {size / 1e6:.1f} MB), rope_theta {conf['rope_theta']:g}, "
          f"tokenizer {sp.get_piece_size()} pieces, eos {sp.id_to_piece(sp.eos_id())!r}",
          file=sys.stderr)

    if cfg["check"]:
        text = validation_text(ckpt, sp)
        diff, bad, n = check_export(path, model, sp, text, getattr(torch, cfg["dtype"]))
        print(f"check: transformers loads it; max |logit difference| {diff:.2e} on 2 random "
              f"blocks of {c.block_size}; token ids equal to sentencepiece on {n - bad}/{n} texts",
              file=sys.stderr)
        if bad or diff > 1e-3:
            sys.exit("error: the exported model or tokenizer does not match this run (see the "
                     "check line above)")


if __name__ == "__main__":
    main(sys.argv[1:])
