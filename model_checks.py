"""The rules a RoFormerConfig must keep, beside model.py so that its fields read first: each
mistake is one ValueError line naming the field (train.py, sample.py and eval.py turn it into
`error: ...`), and the check that weights loaded into a tied model fit its one matrix. A
baseline's own settings are checked in baselines.check."""
import math

import torch

RELATIVE = ("shaw", "t5", "alibi")  # the baselines that bias the attention scores by distance

CHOICES = {"attention": ("softmax", "linear"), "feature_map": ("elu", "relu"),
           "pos_encoding": ("rope", "learned", "sinusoidal", "none") + RELATIVE,
           "rope_scaling": ("none", "linear", "ntk", "yarn"), "rope_pairs": ("adjacent", "half")}


def check_config(cfg):
    """Raise ValueError (one line) for a RoFormerConfig that cannot build a working model; a
    baseline's own settings are checked in baselines.check."""
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "linear_chunk",
                 "rel_clip", "t5_buckets", "t5_max_distance", "rope_original"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < (name != "rope_original"):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    if not 0 < cfg.rotary_fraction <= 1:  # before any rule that reads rotary_dim (nan, inf)
        raise ValueError(f"rotary_fraction must be in (0, 1], got {cfg.rotary_fraction!r}")
    rope, hd = cfg.pos_encoding == "rope", cfg.n_embd // cfg.n_head
    if not rope:
        import baselines  # here: a RoPE model never loads the ablation baselines
        baselines.check(cfg)
    for wrong, why in [
        (cfg.n_embd % cfg.n_head, f"n_embd {cfg.n_embd} must be divisible by n_head"),
        (cfg.attention == "linear" and cfg.pos_encoding in RELATIVE, f"pos_encoding="
         f"{cfg.pos_encoding!r} biases the attention scores, which linear attention never "
         "forms: use attention='softmax'"),
        (rope and hd % 2, f"RoPE rotates channel pairs: head dim {hd} must be even"),
        (rope and cfg.rope_scaling == "ntk" and cfg.rotary_dim <= 2, "rope_scaling='ntk' raises"
         " the base to the power d/(d-2) of the factor: "
         f"{'head' if cfg.rotary_dim == hd else 'rotary'} dim {cfg.rotary_dim} must be above 2"),
        (not 0.0 <= cfg.dropout < 1.0, f"dropout must be in [0, 1), got {cfg.dropout}"),
        (cfg.qk_norm and cfg.attention == "linear", "qk_norm=True normalises the queries and "
         "keys of softmax attention: attention='linear' feeds them to its feature map unchanged"),
        (cfg.value_residual and cfg.attention == "linear", "value_residual=True mixes layer 0's "
         "values into softmax attention's: attention='linear' has no such gate"),
        (not (1.0 < cfg.rope_base < math.inf and 1.0 <= cfg.rope_factor < math.inf),
         f"rope_base must be finite and > 1 and rope_factor finite and >= 1, got "
         f"{cfg.rope_base} and {cfg.rope_factor}"),
        (cfg.rope_scaling == "none" and cfg.rope_factor != 1, f"rope_factor={cfg.rope_factor}"
         " needs rope_scaling='linear', 'ntk' or 'yarn' ('none' means factor 1)")]:
        if wrong:
            raise ValueError(why)
    # past 2**53 float64 positions (the angles' m) are no longer exact, and NTK's raised
    # base overflows a float (OverflowError) long before: both are factors no one means.
    # Before check_positions, which reads context_window (int() of an infinite window raises)
    window, most = cfg.original_context * cfg.rope_factor, 2 ** 53 / cfg.original_context
    if rope and cfg.rope_scaling == "ntk":  # base * factor^(d/(d-2)) within exp(700)
        most = min(most, math.exp((700 - math.log(cfg.rope_base)) * (hd - 2) / hd))
    if cfg.rope_factor >= most:
        raise ValueError(f"rope_factor={cfg.rope_factor:g} is too large: a window of "
                         f"{window:.3g} positions (rope_original x rope_factor) cannot be "
                         f"computed exactly; use a factor below {most:.3g}")
    check_positions(cfg)


def check_positions(cfg):
    """The position designs' fields (docs/MODEL.md), each refused in one line naming it."""
    hd, rope = cfg.n_embd // cfg.n_head, cfg.pos_encoding == "rope"
    r = hd * cfg.rotary_fraction
    for name, value in (("nope_every", cfg.nope_every), ("window", cfg.window),
                        ("global_every", cfg.global_every)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    for wrong, why in [
        (rope and (r != int(r) or r % 2), f"rotary_fraction={cfg.rotary_fraction:g} must rotate "
         f"an even number of each head's {hd} channels, got {r:g}"),
        (not rope and (cfg.rotary_fraction != 1 or cfg.nope_every or cfg.local_rope_base),
         f"rotary_fraction, nope_every and local_rope_base choose how RoPE rotates: "
         f"pos_encoding={cfg.pos_encoding!r} has no rotation"),
        (cfg.local_rope_base and not (rope and cfg.window and 1 < cfg.local_rope_base < math.inf),
         f"local_rope_base={cfg.local_rope_base:g} is the RoPE base of local layers: it needs "
         f"window > 0 and a finite base > 1"),
        (cfg.global_every and not cfg.window, f"global_every={cfg.global_every} picks the "
         f"layers that see the whole context among local ones: it needs window > 0"),
        (cfg.attention == "linear" and (cfg.window or cfg.length_temperature),
         f"{'window' if cfg.window else 'length_temperature'} acts on attention scores, which "
         "attention='linear' never forms"),
        (not 0 <= cfg.length_temperature < math.inf, f"length_temperature must be finite and "
         f">= 0, got {cfg.length_temperature}")]:
        if wrong:
            raise ValueError(why)
    # designs that change nothing: trained, they are the model without them under another name
    for wrong, why in [
        (cfg.nope_every > cfg.n_layer, f"nope_every={cfg.nope_every} changes nothing: a "
         f"{cfg.n_layer}-layer model has no layer {cfg.nope_every}, so every layer rotates "
         f"(use 1..{cfg.n_layer}, or 0)"),
        (cfg.window >= cfg.context_window, f"window={cfg.window} changes nothing: every layer "
         f"already sees the whole context window of {cfg.context_window} positions (use a "
         f"window below it, or 0)"),
        (cfg.window and cfg.global_every == 1, f"window={cfg.window} changes nothing with "
         f"global_every=1: every layer is global (use global_every=0 or >= 2)")]:
        if wrong:
            raise ValueError(why)


def tied_head_check(state, prefix, *args):
    """A tied model loads one matrix twice: an untied lm_head would silently overwrite wte."""
    wte, head = state.get(prefix + "wte.weight"), state.get(prefix + "lm_head.weight")
    plain = wte is not None and head is not None and not hasattr(head, "device_mesh")
    if plain and head.data_ptr() != wte.data_ptr() and not torch.equal(head, wte):
        args[-1].append("lm_head.weight is not wte.weight, but tie_embeddings=True: these weights "
                        "are an untied model's (tie_embeddings=False)")


def positions_error(cfg, n):
    """The one line saying why a model of `cfg` cannot run n positions, else None: learned
    positions end with wpe's rows; every other encoding runs to any length."""
    if cfg.pos_encoding == "learned" and n > cfg.block_size:
        return f"learned positions end at block_size={cfg.block_size}: position {n - 1} cannot run"


def require_positions(cfg, n):  # RoFormer.hold_positions: a forward refused before any layer
    if why := positions_error(cfg, n):
        raise ValueError(f"{why} (use_cache=False crops)")
