"""
A run as a Hugging Face GPTNeoXForCausalLM folder's contents (export.py writes and checks them):
config.json (`neox_config`), the weights (`neox_weights`), the tokenizer (`hf_tokenizer`,
`tokenizer_config`), and the folder read back into formats/neox.py's float64 reference
(`reference_logits`). A model with qk_norm=True is written as PersimmonForCausalLM instead
(`persimmon`): GPT-NeoX's block with a LayerNorm on each head's query and key. The mapping in
detail: docs/EXPORT.md.
"""
import importlib
import importlib.util
import json
import os

import torch

from formats import neox
from harness.common import UserError
from model import ntk_base


def need(module, package=None, load=True):
    """Import an optional package's module, or stop with one line naming the package; with
    load=False only find it (export.py checks what it needs before a word, and importing
    transformers takes seconds)."""
    try:
        if not load and importlib.util.find_spec(module) is None:
            raise ImportError(module)
        return importlib.import_module(module) if load else None
    except ImportError:
        package = package or module.split(".")[0]
        raise UserError(f"export.py needs the '{package}' package: pip install {package}") from None


# --- the model ---------------------------------------------------------------------------

def neox_config(c, eos_id, torch_dtype):
    """config.json, with the RoPE keys both as transformers 5 reads them (rope_parameters) and
    the older way other GPT-NeoX readers use (rotary_pct, rotary_emb_base, rope_scaling)."""
    fraction = getattr(c, "rotary_fraction", 1.0)  # of each head: transformers' scalings
    theta, context, scaling = c.rope_base, c.context_window, None  # count the rotated dims
    if c.rope_scaling == "ntk":  # static NTK-aware scaling is plain RoPE with a larger base
        theta = ntk_base(c.rope_base, c.rope_factor, c.n_embd // c.n_head * fraction)
    elif c.rope_scaling == "linear" and c.rope_factor != 1.0:  # positions divided by factor
        scaling = {"rope_type": "linear", "type": "linear", "factor": c.rope_factor}
    elif c.rope_scaling == "yarn":  # model.py computes transformers' yarn with truncate=True;
        # betas written though they are its defaults, so a reader with other defaults agrees
        scaling = {"rope_type": "yarn", "type": "yarn", "factor": c.rope_factor, "truncate": True,
                   "original_max_position_embeddings": c.original_context,
                   "beta_fast": 32.0, "beta_slow": 1.0}
    rope = dict(scaling or {"rope_type": "default"}, rope_theta=theta,
                partial_rotary_factor=fraction)
    return {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
        "vocab_size": c.vocab_size, "hidden_size": c.n_embd, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "intermediate_size": 4 * c.n_embd,
        "hidden_act": "gelu",                # exact (erf) GELU, as F.gelu
        "layer_norm_eps": 1e-5,              # nn.LayerNorm's default
        "use_parallel_residual": False,      # x + attn(ln1(x)), then + mlp(ln2(.))
        "attention_bias": True,              # zeros when we train bias-free (see neox_weights)
        "tie_word_embeddings": c.tie_embeddings,
        "max_position_embeddings": context,  # RoPE runs past it; this is what was trained for
        "rotary_pct": fraction, "rotary_emb_base": theta, "rope_theta": theta,
        "rope_scaling": scaling, "rope_parameters": rope,
        "attention_dropout": c.dropout, "hidden_dropout": c.dropout,
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": None,                # documents start after EOS; BOS is never trained
        "eos_token_id": eos_id, "pad_token_id": None,
        "torch_dtype": torch_dtype, "dtype": torch_dtype,
    }


def neox_state(model):
    """The model's state dict in float32 on the CPU, with c_attn's q and k rows in GPT-NeoX's pair
    order: a model that pairs adjacent channels (rope_pairs="adjacent", pair i = 2i, 2i + 1) has
    each head's first r rows reordered to 0, 2, .., r - 2, 1, 3, .., r - 1 (pair i = i, i + r/2).
    The same permutation of q and k leaves every score q . k as it was: the maths is unchanged."""
    c = model.config
    state = {k: v.detach().to(dtype=torch.float32, device="cpu") for k, v in
             model.state_dict().items()}
    if getattr(c, "rope_pairs", "half") == "adjacent":
        H, D, r = c.n_head, c.n_embd // c.n_head, c.rotary_dim
        order = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, D)))
        for key in [k for k in state if k.endswith("attn.c_attn.weight") or
                    k.endswith("attn.c_attn.bias")]:
            t = state[key].view(3, H, D, -1)
            state[key] = torch.cat((t[:2, :, order], t[2:])).reshape(state[key].shape)
    return state


def neox_weights(model, dtype):
    """Our state dict -> GPT-NeoX tensor names, changing form, not content: c_attn's rows
    [q | k | v] regrouped per head, zero biases where bias=False, and the head (lm_head, tied or
    not) written as embed_out.weight, also for readers that do not tie (docs/EXPORT.md)."""
    c = model.config
    H, D, C = c.n_head, c.n_embd // c.n_head, c.n_embd  # heads, head size, width
    state = neox_state(model)

    def add(ours, theirs):  # a weight and its bias (zeros where we have none)
        w = out[theirs + ".weight"] = state[ours + ".weight"]
        out[theirs + ".bias"] = state.get(ours + ".bias", torch.zeros(w.shape[0]))

    out = {"gpt_neox.embed_in.weight": state["wte.weight"],
           "embed_out.weight": state["lm_head.weight"].clone()}
    add("ln_f", "gpt_neox.final_layer_norm")
    for i in range(c.n_layer):
        ours, theirs = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        for a, b in (("ln_1", "input_layernorm"), ("attn.c_attn", "attention.query_key_value"),
                     ("attn.c_proj", "attention.dense"), ("ln_2", "post_attention_layernorm"),
                     ("mlp.c_fc", "mlp.dense_h_to_4h"), ("mlp.c_proj", "mlp.dense_4h_to_h")):
            add(ours + a, theirs + b)
        qkv = theirs + "attention.query_key_value."
        out[qkv + "weight"] = out[qkv + "weight"].view(3, H, D, C).transpose(0, 1).reshape(3 * C, C)
        out[qkv + "bias"] = out[qkv + "bias"].view(3, H, D).transpose(0, 1).reshape(3 * C)
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


PERSIMMON = {"gpt_neox.embed_in": "model.embed_tokens", "embed_out": "lm_head",
             "gpt_neox.final_layer_norm": "model.final_layernorm",
             "gpt_neox.layers": "model.layers", "attention.dense": "self_attn.dense",
             "attention.query_key_value": "self_attn.query_key_value"}  # the rest: GPT-NeoX's


def persimmon(conf, weights):
    """GPT-NeoX's config.json and tensors -> transformers' Persimmon, for qk_norm=True: the same
    block (sequential residual, per-head [q k v] rows, a partial NeoX turn) with a LayerNorm on
    each head's query and key before the turn, written with gain 1 and bias 0 (model.py's norm
    has neither); partial_rotary_factor also at the top, where older readers default it to 0.5."""
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "hidden_act", "layer_norm_eps", "tie_word_embeddings",
            "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
            "attention_dropout", "hidden_dropout", "initializer_range", "use_cache",
            "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype")
    conf = dict({k: conf[k] for k in keep}, architectures=["PersimmonForCausalLM"],
                model_type="persimmon", qk_layernorm=True,
                partial_rotary_factor=conf["rope_parameters"]["partial_rotary_factor"])
    out = {}
    for key, tensor in weights.items():
        for a, b in PERSIMMON.items():
            key = key.replace(a, b)
        out[key] = tensor
        if key.endswith("self_attn.dense.weight"):  # once per layer
            D = conf["hidden_size"] // conf["num_attention_heads"]
            for norm in ("q_layernorm", "k_layernorm"):
                name = key.replace("dense.weight", norm)
                out[name + ".weight"] = torch.ones(D, dtype=tensor.dtype)
                out[name + ".bias"] = torch.zeros(D, dtype=tensor.dtype)
    return conf, out


def hf_model(model, eos_id, dtype):
    """(config.json, tensors) of the architecture that computes `model`, weights in `dtype` (a
    torch dtype's name): GPT-NeoX, or Persimmon when it norms queries and keys."""
    conf = neox_config(model.config, eos_id, dtype)
    weights = neox_weights(model, getattr(torch, dtype))
    return persimmon(conf, weights) if getattr(model.config, "qk_norm", False) else (conf, weights)


# --- the tokenizer -----------------------------------------------------------------------

def sentencepiece_proto(sp):
    """The tokenizer's ModelProto (needs protobuf), refused unless it is what data/tokenizer.py
    trains: a byte-fallback BPE (or char) whose only normalisation is " " -> "▁"."""
    pb = need("sentencepiece.sentencepiece_model_pb2", "protobuf")
    m = pb.ModelProto()
    m.ParseFromString(sp.serialized_model_proto())
    spec, norm = m.trainer_spec, m.normalizer_spec
    if spec.model_type not in (spec.BPE, spec.CHAR):
        # unigram: tried; `tokenizers` breaks ties between equal-score segmentations differently
        raise UserError("only bpe and char sentencepiece tokenizers are exported (the default "
                        "ones); a unigram tokenizer would give different ids on runs of spaces")
    if norm.name not in ("identity", "") or norm.add_dummy_prefix or \
            norm.remove_extra_whitespaces or spec.treat_whitespace_as_suffix:  # never trained here
        raise UserError(f"the tokenizer was trained with normalization {norm.name!r}, "
                        f"add_dummy_prefix={norm.add_dummy_prefix}, remove_extra_whitespaces="
                        f"{norm.remove_extra_whitespaces}; export handles identity/False/False "
                        f"only")
    if not spec.byte_fallback:
        raise UserError("the tokenizer has no byte fallback; export reproduces byte-fallback "
                        "tokenizers only (data/tokenizer.py always trains with it)")
    return m


def hf_tokenizer(sp):
    """The run's sentencepiece model as a `tokenizers` Tokenizer giving the same ids. As
    sentencepiece merges the adjacent pair whose joined piece scores highest, every split of a
    normal piece in two is a merge ranked by its score; control pieces and <unk> are special
    tokens never matched in text ("\\n", a user-defined piece, is an added token)."""
    need("tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    m = sentencepiece_proto(sp)
    P, spec = m.SentencePiece, m.trainer_spec
    pieces = list(m.pieces)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    merges = []
    if spec.model_type == spec.BPE:  # a char model is the same BPE without merges
        normal = sorted((i for i, p in enumerate(pieces) if p.type == P.NORMAL),
                        key=lambda i: (-pieces[i].score, i))
        for i in normal:
            s = pieces[i].piece
            splits = [(s[:k], s[k:]) for k in range(1, len(s)) if s[:k] in vocab and s[k:] in vocab]
            merges += sorted(splits, key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
    model = models.BPE(vocab=vocab, merges=merges, unk_token=pieces[spec.unk_id].piece,
                       byte_fallback=True, fuse_unk=True)
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
    """tokenizer_config.json. tokenizer_class makes AutoTokenizer read tokenizer.json as it is
    (else the GPT-NeoX class: wrong ids); no BOS (never trained); padding with EOS on the left,
    so batched prompts all continue from their last token."""
    eos = sp.id_to_piece(sp.eos_id())
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
            "padding_side": "left", "unk_token": sp.id_to_piece(sp.unk_id()),
            "split_special_tokens": True,           # "<s>" typed in text stays text
            "clean_up_tokenization_spaces": False,  # decode gives back the exact text
            "add_bos_token": False, "add_eos_token": False,
            "model_max_length": context}


# --- the reference -----------------------------------------------------------------------

NAMES = {"ln1": "input_layernorm", "qkv": "attention.query_key_value", "out": "attention.dense",
         "ln2": "post_attention_layernorm", "up": "mlp.dense_h_to_4h", "down": "mlp.dense_4h_to_h"}
NEOX_NAMES = {"embed": "gpt_neox.embed_in", "head": "embed_out",
              "final_norm": "gpt_neox.final_layer_norm", "layer": "gpt_neox.layers", **NAMES}
PERSIMMON_NAMES = {"embed": "model.embed_tokens", "head": "lm_head", "layer": "model.layers",
                   "final_norm": "model.final_layernorm", **NAMES,
                   "qkv": "self_attn.query_key_value", "out": "self_attn.dense",
                   "qnorm": "self_attn.q_layernorm", "knorm": "self_attn.k_layernorm"}


def reference_logits(folder, ids):
    """formats/neox.py's forward of the folder as transformers reads it: config.json's fields
    (rope_parameters as transformers 5 reads them) and model.safetensors' tensors, by the names
    of its model_type (gpt_neox, or persimmon: q and k through their LayerNorms)."""
    with open(os.path.join(folder, "config.json")) as f:
        conf = json.load(f)
    state = need("safetensors.torch").load_file(os.path.join(folder, "model.safetensors"))
    if conf["hidden_act"] != "gelu":
        raise UserError(f"formats/neox.py computes exact GELU, not {conf['hidden_act']!r}")
    rope = conf["rope_parameters"]
    kind, factor = rope.get("rope_type", "default"), rope.get("factor", 1.0)
    if kind not in ("default", "linear", "yarn"):
        raise UserError(f"formats/neox.py does not compute rope_type {kind!r}")
    head = conf["hidden_size"] // conf["num_attention_heads"]
    yarn = (rope.get("original_max_position_embeddings") or conf["max_position_embeddings"],
            rope.get("beta_fast", 32.0), rope.get("beta_slow", 1.0)) if kind == "yarn" else None
    rot = int(head * rope.get("partial_rotary_factor", 1.0))

    qk_norm = conf["model_type"] == "persimmon" and conf["qk_layernorm"]
    names = PERSIMMON_NAMES if conf["model_type"] == "persimmon" else NEOX_NAMES

    def W(name):
        if name in ("embed", "head"):  # a reader that ties reads the embedding for the head
            name = "head" if name == "head" and not conf["tie_word_embeddings"] else "embed"
            return state[names[name] + ".weight"].double()
        if name.startswith("final_norm."):
            return state[names["final_norm"] + "." + name.split(".")[1]].double()
        i, part, which = name.split(".")
        return state[f"{names['layer']}.{i}.{names[part]}.{which}"].double()

    def rotate(x):
        return neox.rope(x, rope["rope_theta"], 1 / factor if kind != "default" else 1.0, yarn, rot)
    return neox.forward(W, ids, conf["num_hidden_layers"], conf["num_attention_heads"],
                        conf["layer_norm_eps"], rotate, heads_first=True,
                        parallel=conf.get("use_parallel_residual", False), qk_norm=qk_norm)
