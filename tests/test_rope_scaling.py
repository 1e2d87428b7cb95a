"""Context extension (rope_scaling, rope_factor, rope_original) against independent references:
transformers' own ROPE_INIT_FUNCTIONS on a stub GPT-NeoX config for the frequencies and the
YaRN attention factor (truncate both ways: ours is truncate=True), the window rule, and an old
checkpoint without rope_original loading as before."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness.load import load_run  # noqa: E402
from model import RoFormer, RoFormerConfig, rope_table  # noqa: E402
from test_checkpoint import ARGS, logits, tokenizer, write_run  # noqa: E402,F401

POSITIONS = torch.tensor([1, 3, 100, 4097])
# (head dim, factor, original context, base): small and real-model sizes, bases of RoFormer
# and of long-context models, factors that are not powers of two
SETTINGS = [(d, f, L, b) for d in (8, 16, 64, 128) for f in (2.0, 4.0, 6.5, 32.0)
            for L, b in ((16, 10000.0), (256, 10000.0), (2048, 10000.0), (4096, 500000.0))]


def transformers_rope(kind, d, factor, original, base, truncate=True):
    """(inv_freq in float64, attention factor) from transformers' own RoPE init function."""
    transformers = pytest.importorskip("transformers", reason="the YaRN reference is "
                                       "transformers' ROPE_INIT_FUNCTIONS")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    transformers.logging.set_verbosity_error()
    params = {"rope_type": kind, "rope_theta": base, "factor": factor,
              "partial_rotary_factor": 1.0}
    if kind == "yarn":
        params.update(original_max_position_embeddings=original, truncate=truncate)
    config = transformers.GPTNeoXConfig(hidden_size=2 * d, num_attention_heads=2,
                                        max_position_embeddings=int(original * factor),
                                        rope_parameters=params)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.double(), attention_factor


def angle_error(kind, d, factor, original, base, inv_freq):
    """Largest |our angle - m * inv_freq| (mod 2 pi) over POSITIONS, in units of what float32
    allows: their inv_freq is float32 (a few ulps, so ~m * theta * 1e-6) and our table's cos
    and sin are float32 (~1e-6 rad). <= 1 means equal at float32 precision."""
    cos, sin = rope_table(POSITIONS, d, base, kind, factor, original)
    ours = torch.atan2(sin[:, d // 2:].double(), cos[:, d // 2:].double())  # gain > 0: no effect
    m = POSITIONS.double()[:, None]
    diff = torch.remainder(ours - m * inv_freq + math.pi, 2 * math.pi) - math.pi
    return (diff.abs() / (1e-6 + 1e-6 * m * inv_freq)).max().item()


def test_yarn_frequencies_and_attention_factor_are_transformers_truncate_true():
    """Every setting: our angles are transformers' (truncate=True) and cos = sin scale is its
    attention factor 0.1 ln s + 1. Where floor/ceil of the correction range moves a pair's ramp
    (most settings), truncate=False is another model, and ours is visibly not that one."""
    truncation_matters = 0
    for d, factor, original, base in SETTINGS:
        inv_freq, attention = transformers_rope("yarn", d, factor, original, base)
        assert angle_error("yarn", d, factor, original, base, inv_freq) <= 1, (d, factor, original)
        cos, _ = rope_table(torch.tensor([0]), d, base, "yarn", factor, original)
        assert torch.allclose(cos.double(), torch.full_like(cos.double(), attention), rtol=1e-6)
        untruncated, _ = transformers_rope("yarn", d, factor, original, base, truncate=False)
        if (untruncated - inv_freq).abs().max() > 1e-3 * inv_freq.min():
            truncation_matters += 1
            assert angle_error("yarn", d, factor, original, base, untruncated) > 100
    assert truncation_matters > len(SETTINGS) // 2


def test_linear_frequencies_are_transformers_linear():
    for d, factor, original, base in SETTINGS[::5]:
        inv_freq, attention = transformers_rope("linear", d, factor, original, base)
        assert attention == 1.0
        assert angle_error("linear", d, factor, original, base, inv_freq) <= 1


@pytest.mark.parametrize("block,original,factor,scaling", [
    (16, 0, 1.0, "none"), (16, 0, 4.0, "yarn"), (16, 0, 4.0, "linear"), (16, 0, 2.5, "ntk"),
    (64, 16, 4.0, "yarn"),   # a block-16 run fine-tuned at 64 with factor 4: still 64
    (64, 16, 2.0, "yarn"),   # the factor covers less than the block: the block
    (64, 16, 8.0, "linear")])
def test_window_is_original_context_times_factor(block, original, factor, scaling):
    """The window is the original context (rope_original, else block_size) times the factor,
    never below block_size; a fine-tune keeps the pretraining context (no compounding)."""
    c = RoFormerConfig(vocab_size=10, block_size=block, n_layer=1, n_head=2, n_embd=8,
                       rope_scaling=scaling, rope_factor=factor, rope_original=original)
    assert c.original_context == (original or block)
    assert c.context_window == max(block, int((original or block) * factor))


def test_a_run_without_rope_original_loads_as_before(tmp_path, tokenizer):  # noqa: F811
    """Checkpoints written before rope_original existed hold no such key: they load, their
    original context is block_size, and --rope_scaling=yarn at inference is the model built
    with rope_original=block_size directly."""
    out = str(tmp_path / "run")
    model = write_run(out, tokenizer)
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    del ckpt["model_args"]["rope_original"]
    torch.save(ckpt, os.path.join(out, "ckpt.pt"))
    cpu = torch.device("cpu")
    loaded, _, _ = load_run(out, cpu, "float32")
    assert loaded.config.original_context == ARGS["block_size"]
    assert torch.equal(logits(loaded), logits(model.eval()))
    scaled, _, _ = load_run(out, cpu, "float32", rope_scaling="yarn", rope_factor=4.0)
    assert scaled.config.context_window == 4 * ARGS["block_size"]
    direct = RoFormer(RoFormerConfig(**dict(ARGS, rope_scaling="yarn", rope_factor=4.0,
                                            rope_original=ARGS["block_size"]))).eval()
    direct.load_state_dict(model.state_dict())
    assert torch.equal(logits(scaled, T=64), logits(direct, T=64))


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_a_factor_too_large_is_one_line_naming_it_and_the_largest(tmp_path, scaling,
                                                                   tokenizer):  # noqa: F811
    """--rope_factor=1e308 made the window infinite, and context_window's int() raised
    OverflowError (a traceback) in train.py and eval.py before the window's own rule ran. It
    is one line naming the factor and a factor that works, from the config (train.py's check)
    and from a loaded run (eval.py's and sample.py's --rope_factor); the factor it names is
    accepted."""
    from harness.common import UserError
    with pytest.raises(ValueError) as e:
        RoFormerConfig(**dict(ARGS, rope_scaling=scaling, rope_factor=1e308))
    msg = str(e.value)
    assert "rope_factor=1e+308 is too large" in msg and "\n" not in msg, msg
    most = float(msg.rsplit("use a factor below ", 1)[1])
    assert RoFormerConfig(**dict(ARGS, rope_scaling=scaling, rope_factor=most / 2))
    out = str(tmp_path / "run")
    write_run(out, tokenizer)
    with pytest.raises(UserError, match=r"rope_factor=1e\+308 is too large.*use a factor below"):
        load_run(out, torch.device("cpu"), "float32", rope_scaling=scaling, rope_factor=1e308)
