"""
A run as one GGUF file for llama.cpp, ollama and LM Studio (export.py --gguf imports it only
then): llama.cpp's `gptneox` block and the run's sentencepiece model as its `llama` (SPM)
tokenizer, written here because llama.cpp's converter would misread our tokenizer.json. This
module makes the metadata and tensors, writes and reads them back and runs llama.cpp against
our model; export.py decides what is exported and where. The file in detail: docs/EXPORT.md.
"""
import dataclasses
import sys

import numpy as np
import torch

import gguf

from formats import neox
from formats.hf import neox_state
from model import ntk_base

ARCH = "gptneox"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which model.py uses


# --- metadata ------------------------------------------------------------------------------

def rotary_dim(c):  # the channels of each head RoPE rotates (a config of old: all)
    return getattr(c, "rotary_dim", c.n_embd // c.n_head)


def rope_metadata(c):
    """(freq_base, llama.cpp's scaling type) for our RoPE: static NTK is plain RoPE with a larger
    base, and "none" is explicit (llama.cpp takes a missing type for "linear"); docs/EXPORT.md."""
    if c.rope_scaling == "ntk":  # over the rotated dims, as llama.cpp's and transformers'
        return ntk_base(c.rope_base, c.rope_factor, rotary_dim(c)), "none"
    return c.rope_base, c.rope_scaling if c.rope_factor != 1.0 else "none"


def vocabulary(proto, vocab_size):
    """(pieces, scores, token types) from the sentencepiece model, padded with unused entries up
    to the model's vocab_size (llama.cpp sizes the embedding from the token list)."""
    kinds = {getattr(proto.SentencePiece, k): getattr(gguf.TokenType, k)
             for k in ("NORMAL", "UNKNOWN", "CONTROL", "BYTE", "USER_DEFINED", "UNUSED")}
    pad = range(len(proto.pieces), vocab_size)  # rows the model has, the tokenizer never emits
    pieces = [p.piece for p in proto.pieces] + [f"[PAD{i}]" for i in pad]
    scores = [float(p.score) for p in proto.pieces] + [0.0] * len(pad)
    types = [int(kinds[p.type]) for p in proto.pieces] + [int(gguf.TokenType.UNUSED)] * len(pad)
    return pieces, scores, types


def gguf_metadata(c, sp, proto, gguf_type, name):
    """Every key the file gets: {key: (value, GGUFValueType, array item type or None)}."""
    T, K = gguf.GGUFValueType, gguf.Keys
    freq_base, scaling = rope_metadata(c)
    pieces, scores, types = vocabulary(proto, c.vocab_size)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    meta = {
        K.General.ARCHITECTURE: (ARCH, T.STRING, None),
        K.General.NAME: (name, T.STRING, None),
        K.General.FILE_TYPE: (int(file_type), T.UINT32, None),
        K.General.QUANTIZATION_VERSION: (gguf.GGML_QUANT_VERSION, T.UINT32, None),
        K.LLM.VOCAB_SIZE: (c.vocab_size, T.UINT32, None),
        K.LLM.CONTEXT_LENGTH: (c.context_window, T.UINT32, None),
        K.LLM.EMBEDDING_LENGTH: (c.n_embd, T.UINT32, None),
        K.LLM.FEED_FORWARD_LENGTH: (4 * c.n_embd, T.UINT32, None),
        K.LLM.BLOCK_COUNT: (c.n_layer, T.UINT32, None),
        K.LLM.USE_PARALLEL_RESIDUAL: (False, T.BOOL, None),  # x + attn(ln1(x)), then + mlp(ln2(.))
        K.Attention.HEAD_COUNT: (c.n_head, T.UINT32, None),
        K.Attention.LAYERNORM_EPS: (LAYER_NORM_EPS, T.FLOAT32, None),
        K.Rope.DIMENSION_COUNT: (rotary_dim(c), T.UINT32, None),  # the first r of each head
        K.Rope.FREQ_BASE: (float(freq_base), T.FLOAT32, None),
        K.Rope.SCALING_TYPE: (scaling, T.STRING, None),
        K.Tokenizer.MODEL: ("llama", T.STRING, None),  # llama.cpp's name for sentencepiece (SPM)
        K.Tokenizer.LIST: (pieces, T.ARRAY, T.STRING),
        K.Tokenizer.SCORES: (scores, T.ARRAY, T.FLOAT32),
        K.Tokenizer.TOKEN_TYPE: (types, T.ARRAY, T.INT32),
        K.Tokenizer.EOS_ID: (sp.eos_id(), T.UINT32, None),  # end of document
        K.Tokenizer.UNK_ID: (sp.unk_id(), T.UINT32, None),
        K.Tokenizer.PAD_ID: (sp.eos_id(), T.UINT32, None),  # as the HF export's pad_token
    }
    # documents start after EOS and no BOS is ever trained; our tokenizer adds no "▁" prefix
    for key in (K.Tokenizer.ADD_BOS, K.Tokenizer.ADD_EOS, K.Tokenizer.ADD_PREFIX,
                K.Tokenizer.REMOVE_EXTRA_WS):
        meta[key] = (False, T.BOOL, None)
    if sp.bos_id() >= 0:  # named, so that llama.cpp does not guess one; never added
        meta[K.Tokenizer.BOS_ID] = (sp.bos_id(), T.UINT32, None)
    if scaling != "none":  # the original context, or llama.cpp takes the window for it
        meta[K.Rope.SCALING_FACTOR] = (float(c.rope_factor), T.FLOAT32, None)
        meta[K.Rope.SCALING_ORIG_CTX_LEN] = (c.original_context, T.UINT32, None)
    if scaling == "yarn":  # llama.cpp's defaults, read by some architectures: ours, explicitly
        meta[K.Rope.SCALING_YARN_BETA_FAST] = (32.0, T.FLOAT32, None)
        meta[K.Rope.SCALING_YARN_BETA_SLOW] = (1.0, T.FLOAT32, None)
    return {key.format(arch=ARCH): value for key, value in meta.items()}


# --- tensors -------------------------------------------------------------------------------

def tensor_names(n_layer):
    """{our state-dict name without .weight/.bias: llama.cpp's name}; the head (lm_head, a tied
    one too) is output.weight."""
    names, M = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    out = {"wte": names[M.TOKEN_EMBD], "ln_f": names[M.OUTPUT_NORM]}
    for i in range(n_layer):
        for ours, theirs in (("ln_1", M.ATTN_NORM), ("attn.c_attn", M.ATTN_QKV),
                             ("attn.c_proj", M.ATTN_OUT), ("ln_2", M.FFN_NORM),
                             ("mlp.c_fc", M.FFN_UP), ("mlp.c_proj", M.FFN_DOWN)):
            out[f"blocks.{i}.{ours}"] = names[theirs].format(bid=i)
    out["lm_head"] = names[M.OUTPUT]  # last, where the files have always had it
    return out


def encode_tensor(weight, gguf_type):
    """float32 numpy array -> (array as stored, its GGML type). Norms and biases stay float32;
    q8_0 blocks run along rows of 32, so other row lengths fall back to f16."""
    Q = gguf.GGMLQuantizationType
    if weight.ndim == 1 or gguf_type == "f32":
        return weight.astype(np.float32), Q.F32
    if gguf_type == "q8_0" and weight.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        return gguf.quants.quantize(weight, Q.Q8_0), Q.Q8_0
    return weight.astype(np.float16), Q.F16


def gguf_tensors(model, gguf_type):
    """{gguf name: (stored array, GGML type, shape in our (out, in) order)}. c_attn is already
    llama.cpp's qkv layout (q and k in NeoX's pair order: neox_state); its loader requires every
    bias, so a bias-free model gets zeros."""
    c = model.config
    state = {k: v.numpy() for k, v in neox_state(model).items()}  # NeoX's pair order
    out = {}
    for ours, theirs in tensor_names(c.n_layer).items():
        weight = state[ours + ".weight"]
        out[theirs + ".weight"] = (*encode_tensor(weight, gguf_type), weight.shape)
        if ours not in ("wte", "lm_head"):  # neither has a bias in llama.cpp's gptneox
            bias = state.get(ours + ".bias", np.zeros(weight.shape[0], dtype=np.float32))
            out[theirs + ".bias"] = (*encode_tensor(bias, gguf_type), bias.shape)
    return out


# --- writing and reading back --------------------------------------------------------------

def write_gguf(path, metadata, tensors):
    """Write the file at `path` (export.py passes a temp name and renames it when checked)."""
    writer = gguf.GGUFWriter(path, ARCH)
    for key, (value, vtype, item_type) in metadata.items():
        if key != gguf.Keys.General.ARCHITECTURE:  # the writer adds it
            writer.add_key_value(key, value, vtype, sub_type=item_type)
    for name, (array, ggml_type, _) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=ggml_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def same_value(found, expected, vtype, item_type):
    T = gguf.GGUFValueType
    if T.FLOAT32 in (vtype, item_type):  # stored as float32: compare at that precision
        return np.array_equal(np.float32(found), np.float32(expected))
    return found == expected


def verify_gguf(path, metadata, tensors):
    """The file read back: every key's type and value, every tensor's name, shape, type and
    bytes, compared with what was written. Returns a list of problems (empty: all there)."""
    reader = gguf.GGUFReader(path)
    problems = []
    for key, (value, vtype, item_type) in metadata.items():
        field = reader.get_field(key)
        if field is None:
            problems.append(f"key {key} missing")
        elif field.types[0] != vtype or (item_type is not None and field.types[-1] != item_type):
            problems.append(f"key {key} has type {field.types}")
        elif not same_value(field.contents(), value, vtype, item_type):
            problems.append(f"key {key} holds another value")
    found = {t.name: t for t in reader.tensors}
    if set(found) != set(tensors):
        problems.append(f"tensors differ: {sorted(set(found) ^ set(tensors))[:4]}")
    for name, (array, ggml_type, shape) in tensors.items():
        t = found.get(name)
        if t is None:
            continue
        if t.tensor_type != ggml_type or tuple(int(n) for n in t.shape[::-1]) != tuple(shape):
            problems.append(f"tensor {name}: {t.tensor_type.name} {list(t.shape)}, expected "
                            f"{ggml_type.name} {list(shape)[::-1]}")
        elif not np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8),
                                array.reshape(-1).view(np.uint8)):
            problems.append(f"tensor {name}: stored bytes differ")
    return problems


def weights_from_gguf(path, model):
    """A copy of `model` with the file's weights (dequantized): what llama.cpp runs, our way (with
    half pairs, as the file is written)."""
    reader = gguf.GGUFReader(path)
    stored = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type),
                                                 dtype=np.float32)).reshape(
                  [int(n) for n in t.shape[::-1]]) for t in reader.tensors}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for ours, theirs in tensor_names(model.config.n_layer).items():
        for part in ("weight", "bias"):
            if f"{ours}.{part}" in state:
                state[f"{ours}.{part}"] = stored[f"{theirs}.{part}"]
    config = model.config  # the file pairs q and k channels (i, i + r/2): NeoX's order
    if getattr(config, "rope_pairs", "half") != "half":
        config = dataclasses.replace(config, rope_pairs="half")
    copy = type(model)(config).eval()
    copy.load_state_dict(state)
    return copy


def reference_logits(path, ids):
    """formats/neox.py's forward of the file as llama.cpp reads it: its metadata (a missing scaling
    type is llama.cpp's "linear") and its tensors, dequantized; q, k, v at offsets 0, n_embd,
    2 n_embd of attn_qkv's output."""
    reader = gguf.GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items() if name.startswith(ARCH)}
    key = lambda name, default=None: meta.get(f"{ARCH}.{name}", default)  # noqa: E731
    kind = key("rope.scaling.type", "linear")
    factor = key("rope.scaling.factor", 1.0) if kind != "none" else 1.0
    yarn = (key("rope.scaling.original_context_length", key("context_length")),
            key("rope.scaling.yarn_beta_fast", 32.0),
            key("rope.scaling.yarn_beta_slow", 1.0)) if kind == "yarn" else None
    tensors = {t.name: t for t in reader.tensors}
    names = {"ln1": "attn_norm", "qkv": "attn_qkv", "out": "attn_output", "ln2": "ffn_norm",
             "up": "ffn_up", "down": "ffn_down"}

    def W(name):
        if name in ("embed", "head"):
            t = tensors["token_embd.weight" if name == "embed" else "output.weight"]
        elif name.startswith("final_norm."):
            t = tensors["output_norm." + name.split(".")[1]]
        else:
            i, part, which = name.split(".")
            t = tensors[f"blk.{i}.{names[part]}.{which}"]
        values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)
        return torch.from_numpy(values.reshape([int(n) for n in t.shape[::-1]]))
    def rotate(x):
        return neox.rope(x, key("rope.freq_base"), 1 / factor, yarn, key("rope.dimension_count"))
    return neox.forward(W, ids, key("block_count"), key("attention.head_count"),
                        key("attention.layer_norm_epsilon"), rotate, heads_first=False,
                        parallel=key("use_parallel_residual", False))


# --- llama.cpp against our model -----------------------------------------------------------

def llama_cpp_greedy(llm, prompt_ids, n_new):
    """n_new greedy tokens from llama.cpp's logits (argmax, no sampler in between)."""
    llm.reset()
    llm.eval(prompt_ids)
    out = []
    for _ in range(n_new):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return out


def check_with_llama_cpp(path, model, sp, text):
    """With llama-cpp-python: run the file, print one line comparing it with our model, return
    whether it matches (same ids; logits within 5% of their scale). Without: a note, True."""
    try:
        import llama_cpp
    except ImportError:
        print("note: llama-cpp-python is not installed, so llama.cpp did not run the file "
              "(pip install llama-cpp-python to check it here)", file=sys.stderr)
        return True
    result = compare_with_llama_cpp(path, model, sp, text)
    print(f"check: llama.cpp {llama_cpp.__version__} loads it; token ids equal to sentencepiece "
          f"on {result['texts'] - result['texts_differing']}/{result['texts']} texts; max |logit "
          f"difference| {result['max_logit_diff']:.2e} on {result['positions']} positions (against "
          f"our model with the file's weights); greedy {result['greedy_tokens']} tokens "
          f"{'equal' if result['greedy_equal'] else 'DIFFER'}", file=sys.stderr)
    return not result["texts_differing"] and \
        result["max_logit_diff"] <= 0.05 * result["logit_scale"]


@torch.no_grad()
def compare_with_llama_cpp(path, model, sp, text, n_greedy=24):
    """The file in llama.cpp against our model with the file's weights: token ids (each line of
    `text` and all of it), the logits of one window of it, greedy decoding from its start."""
    import llama_cpp
    reference = weights_from_gguf(path, model)
    window = model.config.context_window
    llm = llama_cpp.Llama(model_path=path, n_ctx=window, logits_all=True, verbose=False)
    texts = text.split("\n") + [text]
    differing = sum(llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) != sp.encode(t)
                    for t in texts)
    ids = [sp.eos_id()] + sp.encode(text)[:window - 1]  # a document starts after EOS
    llm.reset()
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)], dtype=np.float64)
    ours = reference(torch.tensor([ids]))[0][0].double().numpy()
    prompt = ids[:max(1, min(8, len(ids)))]
    n_new = min(n_greedy, window - len(prompt))
    greedy_ours = torch.tensor([prompt])
    for _ in range(n_new):  # whole forwards inside the window: what the cached decoding gives
        next_id = reference(greedy_ours)[0][:, -1].argmax(-1, keepdim=True)
        greedy_ours = torch.cat((greedy_ours, next_id), dim=1)
    greedy_ours = greedy_ours[0, len(prompt):]
    return {"texts": len(texts), "texts_differing": differing, "positions": len(ids),
            "max_logit_diff": float(np.abs(theirs - ours).max()),
            "logit_scale": float(np.abs(ours).max()), "greedy_tokens": n_new,
            "greedy_equal": greedy_ours.tolist() == llama_cpp_greedy(llm, prompt, n_new)}
