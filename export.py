"""
Export a trained run as a Hugging Face GPTNeoXForCausalLM folder (no custom code;
PersimmonForCausalLM for qk_norm=True) or, with --gguf, as one GGUF file for llama.cpp, ollama
and LM Studio (formats/gguf.py).

    python export.py --out_dir=out-small                  # -> out-small/hf
    python export.py --out_dir=out-small --hf_dir=my-model --dtype=bfloat16
    python export.py --out_dir=out-small --gguf --gguf_type=q8_0   # -> out-small/model-q8_0.gguf

Either export is written beside its place, read back into formats/neox.py's float64 GPT-NeoX and
compared with our model, loaded back by transformers / llama.cpp (--check=False skips this
loading), and only then renamed into place; what neither format maps is refused in one line
before anything is written (refusal). The mapping and the checks: docs/EXPORT.md.
"""
import contextlib
import dataclasses
import fnmatch
import json
import os
import sys

import torch
import torch.nn as nn

from harness.dataset import open_split
from formats import hf as hf_files, neox
from harness.common import UserError, cli
from harness.flags import configure
from harness.files import atomic_write
from formats.hf import (hf_model, hf_tokenizer, need, sentencepiece_proto,  # noqa: F401
                        tokenizer_config)  # (export.*)
from harness.load import dataset_dir, load_run

# -----------------------------------------------------------------------------------------
out_dir = "out"
hf_dir = ""             # "" is out_dir/hf
dtype = "float32"       # of the exported weights: float32 | bfloat16 | float16 (HF folder)
tokenizer = ""          # "": the path the checkpoint records; its sha256 must match either way
check = True            # load the export back (transformers / llama.cpp) and compare with our model
gguf = ""               # write one GGUF file instead of the HF folder: a path, a bare name
                        # (goes in out_dir) or --gguf alone (out_dir/model-<gguf_type>.gguf)
gguf_type = "f16"       # of the GGUF's 2-D weights: f32 | f16 | q8_0 (norms and biases stay f32)
# -----------------------------------------------------------------------------------------
HF_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
            "model.safetensors")


# The allow-list of both exports: every RoFormerConfig field with the values they map (ANY:
# every value; UNUSED: read only by models refused here; {kind: values} where the two differ).
# A field model.py gains later is not listed: at its default value it is today's model
# (model.py's rule for a new option), so it exports, and the float64 reference checks every
# file against the model all the same; at any other value the model is refused until the
# exports learn to map it.
ANY, UNUSED = "any", "unused"
MAPPED_FIELDS = {
    "vocab_size": ANY, "block_size": ANY, "n_layer": ANY, "n_head": ANY, "n_embd": ANY,
    "dropout": ANY, "bias": (False, True), "rope_base": ANY, "rope_factor": ANY,
    "rope_original": ANY, "rope_scaling": ("none", "linear", "ntk", "yarn"),
    "attention": ("softmax",), "pos_encoding": ("rope",),
    "feature_map": UNUSED, "linear_chunk": UNUSED, "linear_norm": UNUSED, "rel_clip": UNUSED,
    "t5_buckets": UNUSED, "t5_max_distance": UNUSED,
    # partial rotary: partial_rotary_factor / rope.dimension_count; GPT-NeoX has no per-layer
    # NoPE or window and no length temperature (global_every and local_rope_base need a window)
    "rotary_fraction": ANY, "nope_every": (0,), "window": (0,), "global_every": UNUSED,
    "local_rope_base": UNUSED, "length_temperature": (0.0,), "tie_embeddings": (True, False),
    "rope_pairs": ("adjacent", "half"),  # adjacent pairs: q and k rows reordered (formats/hf.py)
    "qk_norm": {"hf": (False, True), "gguf": (False,)},  # True: HF's Persimmon (formats/hf.py)
    "value_residual": (False,),
}
NOT_MAPPED = {  # why a value is refused, for the refusal
    "nope_every": "GPT-NeoX rotates positions in every layer",
    "window": "GPT-NeoX attends to the whole context in every layer",
    "length_temperature": "GPT-NeoX does not scale queries past the trained context",
    "qk_norm": "llama.cpp's gptneox block has no norm on queries and keys (and the gguf package "
               "no persimmon architecture; the HF export writes it as PersimmonForCausalLM)",
    "value_residual": "a GPT-NeoX layer sees only its own values, not layer 0's"}


def config_refusal(c, kind):
    """The first config field (or value) the `kind` export does not map, as a reason."""
    if getattr(c, "attention", None) not in (None, "softmax"):
        return (f"attention={c.attention!r}: transformers has no architecture with RoFormer's "
                f"linear attention (eq. 19), so no loader would compute what this model computes")
    if getattr(c, "pos_encoding", None) not in (None, "rope"):
        return (f"pos_encoding={c.pos_encoding!r}: GPT-NeoX knows positions only through RoPE, "
                f"so only pos_encoding='rope' exports (learned positions are not exported as "
                f"GPT-2 either)")
    fields = dataclasses.fields(c) if dataclasses.is_dataclass(c) else []
    names = [f.name for f in fields] or list(vars(c))
    defaults = {f.name: f.default for f in fields}
    for name in names:
        value, allowed = getattr(c, name), MAPPED_FIELDS.get(name)
        allowed = allowed[kind] if isinstance(allowed, dict) else allowed
        if allowed is None and name in defaults and value == defaults[name]:
            continue  # a new option left at its default: today's model
        if allowed is None:
            return (f"config field {name}={value!r} is not one the {kind} export maps (at its "
                    f"default, {defaults[name]!r}, it would export)" if name in defaults else
                    f"config field {name}={value!r} is not one the {kind} export maps")
        if isinstance(allowed, tuple) and value not in allowed:
            words = " or ".join(f"{name}={v!r}" for v in allowed)
            return (f"{name}={value!r}: the {kind} export maps only {words}"
                    f"{f', since {NOT_MAPPED[name]}' if name in NOT_MAPPED else ''}; sample.py "
                    f"and eval.py run this model as it is, and a run trained with {words} "
                    f"exports")
    missing = [n for n, allowed in MAPPED_FIELDS.items() if allowed != UNUSED and n not in names]
    return f"the config has no field {missing[0]}, which the {kind} export reads" if missing else None


def expected_shapes(c):
    """{state-dict key: shape} of the model both exports map for config c (GPT-NeoX's block,
    biases only with bias=True, the output head as lm_head.weight, tied or not)."""
    C = c.n_embd
    shapes = {"wte.weight": (c.vocab_size, C), "lm_head.weight": (c.vocab_size, C),
              "ln_f.weight": (C,), **({"ln_f.bias": (C,)} if c.bias else {})}
    layer = {"ln_1": (C,), "attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "ln_2": (C,),
             "mlp.c_fc": (4 * C, C), "mlp.c_proj": (C, 4 * C)}
    for i in range(c.n_layer):
        for name, shape in layer.items():
            shapes[f"blocks.{i}.{name}.weight"] = shape
            if c.bias:
                shapes[f"blocks.{i}.{name}.bias"] = shape[:1]
    return shapes


def module_refusal(model):
    """The exports write exact GELU and LayerNorm eps 1e-5, which no parameter shows: a model
    built of any other leaf module (another activation) is refused."""
    for name, m in model.named_modules():
        if next(m.children(), None) is None and not (
                type(m) in (nn.Embedding, nn.Linear, nn.Dropout)
                or (type(m) is nn.GELU and m.approximate == "none")
                or (type(m) is nn.LayerNorm and m.eps == 1e-5)):
            return f"module {name} is {m!r}, which the exports do not map"
    return None


def refusal(model, kind):
    """Why `model` has no faithful form in the `kind` export ("hf", "gguf"), in a line; or None."""
    if why := config_refusal(model.config, kind):
        return why
    state, expected = model.state_dict(), expected_shapes(model.config)
    for key, tensor in state.items():
        if key not in expected:
            return f"state-dict key {key} is not one the {kind} export maps"
        if tuple(tensor.shape) != expected[key]:
            return (f"state-dict key {key} has shape {list(tensor.shape)}, the {kind} export "
                    f"maps {list(expected[key])}")
    if missing := [key for key in expected if key not in state]:
        return f"the model has no {missing[0]}, which the {kind} export writes"
    head, wte = state["lm_head.weight"], state["wte.weight"]
    tied = getattr(model.config, "tie_embeddings", True)  # the config the export writes says so
    if tied and head.data_ptr() != wte.data_ptr() and not torch.equal(head, wte):
        return f"lm_head.weight is not wte.weight: the {kind} export writes a tied output head"
    return module_refusal(model)


# --- the check ---------------------------------------------------------------------------

@contextlib.contextmanager
def quiet(transformers):
    """transformers' warnings and progress bars (its `Loading weights` bar) off while the check
    loads the folder, and as they were after it: our output is ours, the settings the user's."""
    log = transformers.utils.logging
    verbosity, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()
    log.disable_progress_bar()
    try:
        yield
    finally:
        log.set_verbosity(verbosity)
        if bars:
            log.enable_progress_bar()


@torch.no_grad()
def check_export(path, model, sp, text):
    """The folder in transformers against ours: (max |logit diff|, texts differing, texts)."""
    transformers = need("transformers")
    with quiet(transformers):  # also over the tokenizer's calls: the whole text is one of
        # them, longer than the model's context, which transformers would warn about
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(path)
        c = model.config
        gen = torch.Generator().manual_seed(0)
        idx = torch.randint(0, c.vocab_size, (2, c.block_size), generator=gen)
        diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
        texts = text.split("\n") + [text]
        bad = sum(tok(t).input_ids != sp.encode(t) for t in texts)  # (and no BOS is added)
    return diff, bad, len(texts)


@torch.no_grad()
def reference_check(path, reference_logits, model, what):
    """The written file computed by formats/neox.py (from what it holds alone) against `model`
    (ours with the file's weights), on formats/neox.py's probe: a reason they differ, or None."""
    ids = neox.probe(model.config.vocab_size, model.config.context_window)
    return neox.disagreement(reference_logits(path, ids), model(ids[None])[0][0], what)


def validation_text(ckpt, sp, max_tokens=20000):
    """The run's validation text for the tokenizer checks, or "" with a note when the run's
    dataset is gone: the run folder holds everything the export itself needs."""
    try:
        ddir = dataset_dir(ckpt, gone_ok=True)
    except UserError as e:  # checking the tokenizer on another corpus's ids would fail
        raise UserError(f"{e}; the export check tokenizes the run's validation text "
                        f"(--check=False exports without checking)") from None
    if not ddir:
        gone = (ckpt.get("config") or {}).get("data_dir") or "the run's dataset"
        print(f"note: {gone} is gone: the check compares the logits but tokenizes no validation "
              f"text", file=sys.stderr)
        return ""
    return sp.decode(open_split(ddir, "val")[:max_tokens].tolist())


# --- writing -----------------------------------------------------------------------------

def check_replaceable(path):
    """Refuse before writing anything when `path` holds something export would destroy."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{path} exists and is not a folder")
    other = sorted(set(os.listdir(path)) - set(HF_FILES) - {".model.safetensors.tmp"}) \
        if os.path.isdir(path) else []
    if other:
        raise UserError(f"{path} holds files an export did not write ({', '.join(other[:3])}); "
                        f"export replaces the whole folder, so pass an empty or new --hf_dir")


def write_checked(path, write, check=None):
    """write(tmp) beside `path`, check(tmp) -> a reason it is wrong or None, then the rename
    (harness/common.atomic_write): a failure anywhere leaves the previous export as it was."""
    try:
        problem = atomic_write(path, write, check)
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or (f"{e} (a short write: is the disk full?)"
                                                   if isinstance(e, OSError) else e)
        problem = f"cannot write {path}: {reason}"
    if problem:
        raise UserError(problem)


def write_folder(path, files, check=None):
    """files {name: bytes} -> the folder `path` (write_checked)."""
    def write(tmp):
        os.mkdir(tmp)
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
    write_checked(path, write, check)


def export_hf(cfg, model, sp, text):
    path = cfg["hf_dir"]  # parse_args': out_dir/hf by default
    check_replaceable(path)
    conf, weights = hf_model(model, sp.eos_id(), cfg["dtype"])
    gen = {"eos_token_id": sp.eos_id(), "pad_token_id": sp.eos_id(), "do_sample": True,
           "temperature": 0.8, "top_k": 200}  # sample.py's defaults
    docs = {"config.json": conf, "generation_config.json": gen,
            "tokenizer_config.json": tokenizer_config(sp, conf["max_position_embeddings"])}
    files = {name: (json.dumps(obj, indent=2) + "\n").encode() for name, obj in docs.items()}
    files["tokenizer.json"] = hf_tokenizer(sp).to_str().encode()
    files["model.safetensors"] = need("safetensors.torch").save(weights, metadata={"format": "pt"})

    def check(folder):
        with torch.no_grad():  # the weights the file holds (model.to would round RoPE too)
            for p in model.parameters():
                p.copy_(p.to(getattr(torch, cfg["dtype"])))
        why = reference_check(folder, hf_files.reference_logits, model, "the folder")
        if why or not cfg["check"]:
            return why
        diff, bad, n = check_export(folder, model, sp, text)
        print(f"check: transformers loads it; max |logit difference| {diff:.2e} on 2 random "
              f"blocks of {model.config.block_size}; token ids equal to sentencepiece on "
              f"{n - bad}/{n} texts", file=sys.stderr)
        if bad or diff > 1e-3:
            return ("the exported model or tokenizer does not match this run (see the check "
                    "line above); nothing was written")
        return None
    write_folder(path, files, check)
    print(f"wrote {path}: {conf['architectures'][0]}, {model.num_params() / 1e6:.2f}M params "
          f"({cfg['dtype']}, {len(files['model.safetensors']) / 1e6:.1f} MB), rope_theta "
          f"{conf['rope_theta']:g}, tokenizer {sp.get_piece_size()} pieces, eos "
          f"{sp.id_to_piece(sp.eos_id())!r}", file=sys.stderr)


def check_gguf_path(path):
    """Refuse a --gguf path whose replacement would destroy something: a folder, a file that is
    not GGUF (by its magic), or a file a training run owns (run_file), even one not there yet."""
    if os.path.isdir(path):
        raise UserError(f"--gguf={path} is a folder; give the file's path (e.g. {path}/model.gguf)")
    if owner := run_file(path):
        raise UserError(f"--gguf={path} is a file of the run in {owner} (its checkpoints, logs and "
                        f"their folders); write the GGUF file elsewhere, e.g. {owner}/model.gguf")
    if os.path.lexists(path):
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise UserError(f"--gguf={path}: cannot read it ({e.strerror or e})")
        if magic != b"GGUF":
            raise UserError(f"--gguf={path} exists and is not a GGUF file; export replaces only "
                            f"a GGUF file: remove it or give another path")


# What train.py writes in a run folder (one with ckpt.pt): checkpoints in every form, logs, wandb.
RUN_FILES = ("ckpt.pt", "ckpt.pt.tmp", ".ckpt.pt.*.tmp", "ckpt.*.pt", "ckpt-*.dcp", "ckpt-*.dcp.tmp",
             "log.jsonl", "log.*.jsonl", "wandb", ".train.lock")


def run_file(path):
    """The run folder whose own file (or a file inside whose own folder) `path` is, or None."""
    path = os.path.abspath(path)
    folder, first = os.path.dirname(path), os.path.basename(path)
    while True:
        if os.path.isfile(os.path.join(folder, "ckpt.pt")) and \
                any(fnmatch.fnmatchcase(first, pattern) for pattern in RUN_FILES):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder, first = parent, os.path.basename(folder)


def export_gguf(cfg, model, sp, proto, text):
    """--gguf: written beside its place, synced, read back and checked (module docstring)."""
    from formats import gguf  # only here: it imports the optional gguf package
    path, kind = cfg["gguf"], cfg["gguf_type"]
    name = os.path.basename(os.path.abspath(cfg["out_dir"]))
    metadata = gguf.gguf_metadata(model.config, sp, proto, kind, name)
    tensors = gguf.gguf_tensors(model, kind)

    def check(tmp):
        problems = gguf.verify_gguf(tmp, metadata, tensors)
        if problems:
            return f"cannot write {path}: the file read back differs from what was written: " \
                   f"{problems[0]}"
        why = reference_check(tmp, gguf.reference_logits, gguf.weights_from_gguf(tmp, model),
                              "the file")
        if why:
            return why
        if cfg["check"] and not gguf.check_with_llama_cpp(tmp, model, sp, text):
            return ("llama.cpp's tokenizer or logits do not match this run (see the check line "
                    "above); nothing was written")
        return None
    write_checked(path, lambda tmp: gguf.write_gguf(tmp, metadata, tensors), check)
    kept_f16 = sum(t[1].name == "F16" for t in tensors.values()) if kind == "q8_0" else 0
    print(f"wrote {path}: gguf {gguf.ARCH}, {model.num_params() / 1e6:.2f}M params ({kind}"
          f"{f', {kept_f16} tensors f16 (rows not a multiple of 32)' if kept_f16 else ''}, "
          f"{os.path.getsize(path) / 1e6:.1f} MB), rope freq_base "
          f"{metadata[f'{gguf.ARCH}.rope.freq_base'][0]:g}, tokenizer "
          f"{sp.get_piece_size()} pieces (llama.cpp SPM), eos {sp.id_to_piece(sp.eos_id())!r}; "
          f"read back: {len(metadata)} keys and {len(tensors)} tensors as written", file=sys.stderr)


def parse_args(argv):
    """The settings and the packages they need, checked before anything loads."""
    names = ("out_dir", "hf_dir", "dtype", "tokenizer", "check", "gguf", "gguf_type")
    cfg = configure({k: globals()[k] for k in names}, [a for a in argv if a != "--gguf"],
                    sources=(__file__,))
    if "--gguf" in argv and not cfg["gguf"]:
        cfg["gguf"] = f"model-{cfg['gguf_type']}.gguf"
    if cfg["gguf"] and not os.path.dirname(cfg["gguf"]):  # a bare name: the run's, not the cwd's
        cfg["gguf"] = os.path.join(cfg["out_dir"], cfg["gguf"])
    cfg["hf_dir"] = os.path.normpath(cfg["hf_dir"] or os.path.join(cfg["out_dir"], "hf"))
    if cfg["dtype"] not in ("float32", "bfloat16", "float16"):
        raise UserError(f"dtype must be float32, bfloat16 or float16, got {cfg['dtype']!r}")
    if cfg["gguf_type"] not in ("f32", "f16", "q8_0"):
        raise UserError(f"gguf_type must be f32, f16 or q8_0, got {cfg['gguf_type']!r}")
    need("sentencepiece.sentencepiece_model_pb2", "protobuf")  # both read the tokenizer's pieces
    hf = ["safetensors.torch", "tokenizers"] + ["transformers"] * cfg["check"]
    for module in ["gguf"] if cfg["gguf"] else hf:  # transformers: imported later (2 s)
        need(module, load=module != "transformers")
    if cfg["gguf"]:
        check_gguf_path(cfg["gguf"])
    return cfg


@cli
def main(argv):
    cfg = parse_args(argv)
    # float32 on the CPU: export copies the exact weights, it computes nothing
    model, sp, ckpt = load_run(cfg["out_dir"], torch.device("cpu"), "float32", cfg["tokenizer"])
    if why := refusal(model, "gguf" if cfg["gguf"] else "hf"):
        raise UserError(f"cannot export {cfg['out_dir']}: {why}")
    if sp.eos_id() < 0:
        raise UserError("the tokenizer has no end-of-document piece (eos_id); export needs one")
    proto = sentencepiece_proto(sp)  # before anything is written: it may refuse too
    text = validation_text(ckpt, sp) if cfg["check"] else ""
    loaded = f", loaded by {'llama.cpp' if cfg['gguf'] else 'transformers'}" * cfg["check"]
    print(f"exporting {cfg['out_dir']} to {cfg['gguf'] or cfg['hf_dir']}: writing it, then "
          f"checking it against this run{loaded}", file=sys.stderr)  # then seconds of silence
    if cfg["gguf"]:
        export_gguf(cfg, model, sp, proto, text)
    else:
        export_hf(cfg, model, sp, text)


if __name__ == "__main__":
    main(sys.argv[1:])
