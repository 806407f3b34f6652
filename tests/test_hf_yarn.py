"""Hugging Face's rope type "yarn" (transformers' rope_parameters) as megart's
--position-embedding-type yarn, both ways: a transformers Llama or Qwen3 with YaRN loads into
megart with its logits (float64 on both sides, but transformers' RMSNorm and softmax compute in
float32: measured 1.2e-7 to 1.8e-7 relative, where plain rope's angles in YaRN's place move them
by 0.31 and YaRN without its concentration factor by 0.11) and writes back as yarn, which
transformers loads to the same logits (to the bit); transformers' attention_factor, its ratio
of mscales, its truncate and betas all carry, and megart's mscales that transformers would read
otherwise are written as attention_factor. import-hf's train command names the flags."""

import dataclasses
import json

import pytest
import torch

from megart.errors import ConfigError
from megart.models import GPT, GPTConfig, hf_nemotron
from megart.models.hf_yarn import yarn_from_hf
from megart.training.import_hf import train_flags

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SIZES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
# An original context of 16 extended 4 times to 64: over the 48 positions below, YaRN's
# frequencies and its concentration factor both move the logits.
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
            rope_theta=10000.0)  # fmt: skip
TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return getattr(out, "logits", out)


def hf_model(kind: str, rope: dict, path) -> torch.nn.Module:
    config = getattr(transformers, f"{kind}Config")(**SIZES, rope_parameters=rope)
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    with torch.no_grad():  # queries and keys of some size, so that the rope shows
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8)
    model.save_pretrained(path)
    return model.double()


@pytest.mark.parametrize(
    "kind, extra, mscales",
    [
        ("Llama", {}, (1.0, 0.0)),  # transformers' default factor, 0.1 ln 4 + 1
        ("Qwen3", {"beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}, (1.0, 0.0)),
        ("Llama", {"mscale": 1.6, "mscale_all_dim": 0.5}, (1.6, 0.5)),  # its ratio
        # One mscale alone: transformers ignores it (0.1 ln 4 + 1), and so does the import.
        ("Llama", {"mscale": 1.6}, (1.0, 0.0)),
    ],
)
def test_transformers_yarn_loads_with_its_logits_and_writes_back(tmp_path, kind, extra, mscales):
    rope = {**YARN, **extra}
    hf = hf_model(kind, rope, tmp_path / "hf")
    ours = GPT.from_hf(str(tmp_path / "hf")).eval()
    cfg = ours.cfg
    assert cfg.rope_type == "yarn" and cfg.yarn_rotary_scaling_factor == 4.0
    assert cfg.yarn_original_max_position_embeddings == 16
    assert (cfg.yarn_beta_fast, cfg.yarn_beta_slow) == (extra.get("beta_fast", 32.0),
                                                        extra.get("beta_slow", 1.0))  # fmt: skip
    assert cfg.yarn_correction_range_round_to_int == extra.get("truncate", True)
    assert (cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == mscales
    want = logits(hf)
    assert relative(logits(ours.double()), want) < 1e-6
    ours.save_hf(str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]
    assert {k: written[k] for k in rope if k in written} == {
        k: v for k, v in rope.items() if k != "mscale" or "mscale_all_dim" in rope
    }
    back = getattr(transformers, f"{kind}ForCausalLM").from_pretrained(tmp_path / "back")
    assert relative(logits(back.eval().double()), want) < 1e-6


def test_the_bound_catches_plain_rope_and_yarn_without_its_factor(tmp_path):
    """What the bound above tells apart (measured here): the same weights under plain rope,
    and under YaRN's frequencies with a concentration factor of 1."""
    hf = hf_model("Llama", YARN, tmp_path / "hf")
    ours = GPT.from_hf(str(tmp_path / "hf")).double().eval()
    want = logits(hf)
    for kw in (dict(rope_type="rope"), dict(yarn_mscale=0.0)):
        other = GPT(dataclasses.replace(ours.cfg, **kw)).double().eval()
        other.load_state_dict(ours.state_dict())
        assert relative(logits(other), want) > 1e-3


def test_attention_factor_is_read_as_mscale_and_megarts_mscales_written_as_it(tmp_path):
    """transformers' attention_factor A (at factor f > 1) is --mscale (A - 1) / (0.1 ln f)
    with --mscale-all-dim 0; megart's mscales that transformers would not read the same
    (one of them zero, yet not its default) are written as attention_factor."""
    rope = {**YARN, "attention_factor": 1.7}
    hf = hf_model("Llama", rope, tmp_path / "hf")
    ours = GPT.from_hf(str(tmp_path / "hf")).eval()
    assert ours.cfg.yarn_mscale_all_dim == 0.0
    assert ours.cfg.yarn_mscale == pytest.approx(0.7 / (0.1 * torch.log(torch.tensor(4.0)).item()))
    want = logits(hf)
    assert relative(logits(ours.double()), want) < 1e-6
    ours.save_hf(str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]
    assert written["attention_factor"] == pytest.approx(1.7, rel=1e-15)
    assert "mscale" not in written and "mscale_all_dim" not in written
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval().double()
    assert relative(logits(back), want) < 1e-6
    # At a factor of at most 1 Megatron-Core's YaRN multiplies by 1: another factor is refused.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"] = {**rope, "factor": 1.0}
    config.pop("rope_scaling", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="attention_factor 1.7 with factor 1"):
        GPT.from_hf(str(tmp_path / "hf"))


def test_import_hf_names_the_yarn_flags(tmp_path):
    hf_model("Qwen3", {**YARN, "beta_fast": 8.0, "truncate": False}, tmp_path / "hf")
    flags = " ".join(train_flags(GPT.from_hf(str(tmp_path / "hf")).cfg))
    assert (
        "--position-embedding-type yarn " in flags
        and "--rotary-scaling-factor 4 --yarn-original-max-position-embeddings 16 "
        "--yarn-beta-fast 8 --yarn-beta-slow 1 --mscale 1 --mscale-all-dim 0 "
        "--no-yarn-correction-range-round-to-int"
        in flags
    ), flags


def test_nemotron_refuses_yarn_naming_the_flags():
    """Nemotron's rope scales nothing (megart reads and writes it unscaled)."""
    cfg = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                    num_attention_heads=4, normalization="layernorm", apply_layernorm_1p=True,
                    position_embedding="rotary", activation="squared_relu", bias=False,
                    rope_type="yarn", yarn_rotary_scaling_factor=4.0)  # fmt: skip
    with pytest.raises(ConfigError, match="cannot represent --rotary-base 10000 .*--rotary-scal"):
        hf_nemotron.check(cfg)


def test_what_a_yarn_config_leaves_out_is_read_as_transformers_reads_it():
    """No factor: the two contexts' ratio; a top-level original context (Phi-3's) before the
    scaling's; beta 0 or none: 32 and 1; no truncate: rounded."""
    hf = {"max_position_embeddings": 128, "original_max_position_embeddings": 32}
    got, problem = yarn_from_hf({"rope_type": "yarn", "original_max_position_embeddings": 16,
                                 "beta_fast": 0}, hf)  # fmt: skip
    assert problem is None
    assert got["yarn_rotary_scaling_factor"] == 4.0
    assert got["yarn_original_max_position_embeddings"] == 32
    assert (got["yarn_beta_fast"], got["yarn_beta_slow"]) == (32.0, 1.0)
    assert got["yarn_correction_range_round_to_int"] is True
