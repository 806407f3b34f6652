"""Multi-latent attention with YaRN (Megatron-LM's --rope-type yarn, its MLA's default): against
Megatron-Core 0.16.1's GPTModel with MLA and rope_type "yarn" (float64, weights drawn), a planted
mistake in either of YaRN's two scalings shows, tp2 with and without sequence parallelism
follows the one-process curve, and how the flags pick it (and what they refuse), by name."""

import dataclasses
import math

import pytest

import megatron_core_workers as mcw
import mla_workers as mw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT
from megart.models.yarn import yarn_mscale
from test_mla import BASE, MODELS, TRAIN, parse

# DeepSeek-V3's shape of YaRN (factor 40, mscale = mscale_all_dim) and one where the two differ,
# so that cos and sin carry a concentration factor besides the scores' scale. An original
# context of 4 and beta_fast 2 put the 16-token sequence's rope pairs inside the blend.
YARN = dict(rope_type="yarn", yarn_rotary_scaling_factor=40.0, yarn_mscale=1.0,
            yarn_mscale_all_dim=1.0)  # fmt: skip
MODELS_YARN = {
    "q-lora-norms-llama-dsv3": {**MODELS["q-lora-norms-llama"], **YARN},
    "q-proj-mscales-differ": dict(YARN, yarn_mscale=0.7, yarn_mscale_all_dim=0.3,
                                  yarn_original_max_position_embeddings=4,
                                  yarn_beta_fast=2.0, rotary_base=500.0),
    "factor-1": dict(rope_type="yarn", qk_layernorm=True),  # Megatron-LM's flags' default
}  # fmt: skip


@pytest.fixture(scope="module")
def against_megatron_core():
    return mcw.compare_named(BASE, MODELS_YARN)


@pytest.mark.parametrize("name", list(MODELS_YARN))
def test_megatron_cores_yarn_mla_computes_the_same_logits_both_ways(against_megatron_core, name):
    mcw.assert_same_both_ways(against_megatron_core[name])


@pytest.mark.parametrize(
    "name,mistake",
    [("q-lora-norms-llama-dsv3", "mscale-once"), ("q-proj-mscales-differ", "mscale-once"),
     ("q-proj-mscales-differ", "no-concentration")],
)  # fmt: skip
def test_the_comparison_catches_a_wrong_scaling(name, mistake):
    """The scores' scale times mscale(factor, mscale_all_dim) once instead of squared, or cos
    and sin without the concentration factor: Megatron-Core's logits leave megart's."""
    kw = {**BASE, **MODELS_YARN[name]}
    assert launch(mw.compare_with_mistake, 1, kw, mistake, timeout=300)[0] > 1e-3


def test_the_softmax_scale_is_mscale_squared_over_the_root_of_the_head():
    from megart.models import GPTConfig

    cfg = GPTConfig(**BASE, **MODELS_YARN["q-lora-norms-llama-dsv3"])
    attn = GPT(cfg).chunk.blocks[0].attn
    m = 0.1 * math.log(40) + 1
    assert yarn_mscale(40.0, 1.0) == pytest.approx(m)
    assert attn.softmax_scale == pytest.approx(m * m / math.sqrt(8 + 4), rel=1e-15)
    plain = GPT(GPTConfig(**BASE)).chunk.blocks[0].attn
    assert plain.softmax_scale is None  # torch's 1/sqrt(12)


# megart train's flags: YaRN as Megatron-LM's MLA takes it, on weights drawn wide enough that
# the scores' scale shows in the loss (at the default 0.02 YaRN moved it by 3e-7 relative,
# under the curves' tolerance).
TRAIN_YARN = dict(TRAIN, rope_type="yarn", rotary_scaling_factor=40.0, mscale=0.9,
                  mscale_all_dim=3.0, yarn_original_max_position_embeddings=4,
                  init_method_std=0.3)  # fmt: skip


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, TRAIN_YARN, timeout=300)[0]


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_follows_the_one_process_curve(one_process, sp):
    kw = dict(TRAIN_YARN, tensor_model_parallel_size=2, sequence_parallel=sp)
    want = [h["loss"] for h in one_process]
    for rank in launch(tw.train_kw, 2, kw, timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(want, **tw.SAME_RUN)


def test_yarn_is_in_the_curve(one_process):
    plain = launch(tw.train_kw, 1, dict(TRAIN, init_method_std=0.3), timeout=300)[0]
    assert [h["loss"] for h in plain] != pytest.approx([h["loss"] for h in one_process], rel=1e-4)


MLA = ("--multi-latent-attention", "--position-embedding-type", "rope", "--kv-lora-rank", "12",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6")  # fmt: skip


@pytest.mark.parametrize("rope", [(), ("--rope-type", "yarn")], ids=["no-rope-type", "yarn"])
def test_mla_takes_yarn_without_rope_type_as_megatron_lm_does(rope):
    cfg = parse(*MLA, *rope, "--rotary-scaling-factor", "40", "--mscale", "0.8",
                "--mscale-all-dim", "0.6").gpt_config()  # fmt: skip
    assert (cfg.rope_type, cfg.position_embedding) == ("yarn", "rotary")
    assert (cfg.yarn_rotary_scaling_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (
        40.0, 0.8, 0.6)  # fmt: skip
    # MLATransformerConfig's defaults, which no Megatron-LM flag reaches under MLA.
    assert (cfg.yarn_original_max_position_embeddings, cfg.yarn_beta_fast) == (4096, 32.0)
    assert (cfg.yarn_beta_slow, cfg.yarn_correction_range_round_to_int) == (1.0, True)
    # Without settings: factor 1, plain rope's angles and no mscale.
    bare = parse(*MLA, *rope).gpt_config()
    assert (bare.rope_type, bare.yarn_rotary_scaling_factor) == ("yarn", 1.0)
    assert parse(*MLA, "--rope-type", "rope").gpt_config().rope_type == "rope"


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--rope-type", "yarn"), "--rope-type yarn without --multi-latent-attention: "
         "--rope-type picks multi-latent attention's rope"),
        ((*MLA[:2], "yarn", *MLA[3:]), "--multi-latent-attention with "
         "--position-embedding-type yarn: .*Use --position-embedding-type rope"),
        ((*MLA, "--rope-type", "rope", "--mscale", "2"), "^--mscale 2.0 sets YaRN's rope "
         r"scaling: add --position-embedding-type yarn \(with --multi-latent-attention: "
         "--rope-type yarn\\)"),
        ((*MLA, "--rope-type", "yarn", "--rotary-scaling-factor", "0.5"),
         "--rotary-scaling-factor 0.5"),
    ],
)  # fmt: skip
def test_what_megatron_lm_refuses_is_refused_by_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).gpt_config()


def test_the_architecture_flags_name_mlas_rope_type():
    from megart.models.config_flags import architecture_flags

    flags = architecture_flags(parse(*MLA, "--rotary-scaling-factor", "4").gpt_config())
    assert flags["position_embedding"] == "--position-embedding-type rope"
    assert "--rope-type yarn" in flags["multi_latent_attention"]
    assert "--rotary-scaling-factor 4" in flags["rotary"]


def test_a_megart_checkpoint_gives_mla_and_its_yarn_to_use_checkpoint_args(tmp_path):
    """megart's own format holds MLA with YaRN; --use-checkpoint-args takes its rope type and
    settings (it describes the checkpoint with Megatron's args, where MLA's YaRN is --rope-type
    yarn on --position-embedding-type rope), and Megatron's formats hold it too (Megatron-Core
    against them: test_megatron_mla_yarn), its settings read back from their args alone."""
    from megart.training.megatron_checkpoint import megart_to_megatron
    from test_hf_llama import train_config

    yarn = dict(rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.7, mscale_all_dim=0.3)
    kw = dict(TRAIN, **yarn, train_iters=1, save=str(tmp_path / "ckpt"))
    launch(tw.train_kw, 1, kw, timeout=300)
    argv = ["--load", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--train-iters", "2"]
    cfg = train_config(argv).gpt_config()
    assert cfg.multi_latent_attention and cfg.rope_type == "yarn"
    assert (cfg.yarn_rotary_scaling_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (
        4.0, 0.7, 0.3)  # fmt: skip
    assert cfg.position_embedding == "rotary"
    megart_to_megatron(tmp_path / "ckpt", tmp_path / "out", ckpt_format="torch")
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_checkpoint import saved_args

    a = saved_args(tmp_path / "out")[0]
    assert (a["rope_type"], a["rotary_scaling_factor"], a["mscale"]) == ("yarn", 4.0, 0.7)
    assert config_from_args(a) == dataclasses.replace(cfg, ffn_hidden_size=cfg.ffn_size)
