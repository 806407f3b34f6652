"""Multi-latent attention with YaRN rope (Megatron-LM's --rope-type yarn, its MLA's default) in
Megatron-LM's checkpoints, against Megatron-Core 0.16.1: the args read as Megatron-LM builds its
MLATransformerConfig from them (its --yarn-* flags do not reach MLA), Megatron-Core's MLA
GPTModel with YaRN loading megart train's legacy files and torch_dist stores at tp1 and tp2 with
the logits of megart's model as trained, megart reading what Megatron-Core saves, megart train
resuming its own Megatron-format MLA+YaRN checkpoints on the one-process curve, and
convert-checkpoint both ways."""

import dataclasses

import pytest
import torch

import megatron_dist_workers as mdw
import megatron_mla_ckpt_workers as mmw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPTConfig
from megart.training.megatron_args import config_from_args, megatron_args
from megart.training.megatron_checkpoint import megart_to_megatron, read_megatron
from test_mla import TRAIN

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist writer needs it

# DeepSeek-V2-Lite's YaRN (factor 40, mscale = mscale_all_dim = 0.707), on weights drawn wide
# enough that the rope shows in the loss.
YARN = dict(TRAIN, rope_type="yarn", rotary_scaling_factor=40.0, mscale=0.707,
            mscale_all_dim=0.707, init_method_std=0.3)  # fmt: skip
# What MLASelfAttention builds its rope from (its config's fields, Megatron-Core 0.16.1).
ROPE_FIELDS = ("rope_type", "rotary_base", "rotary_scaling_factor",
               "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim")  # fmt: skip


def _megatron_lm_mla_rope(a: dict) -> dict:
    """MLA's rope fields of the MLATransformerConfig Megatron-LM's
    core_transformer_config_from_args builds from args ``a`` (fields taken by name where the
    args have them; rope_type None left to the config's default), and its rounding (which
    MLASelfAttention leaves to YarnRotaryEmbedding's default)."""
    import inspect

    from megatron.core.models.common.embeddings import YarnRotaryEmbedding
    from megatron.core.transformer import MLATransformerConfig

    kw = {n: a[n] for n in ROPE_FIELDS if n in a and not (n == "rope_type" and a[n] is None)}
    config = MLATransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                  apply_rope_fusion=False, **kw)  # fmt: skip
    rounding = inspect.signature(YarnRotaryEmbedding).parameters["correction_range_round_to_int"]
    return {n: getattr(config, n) for n in ROPE_FIELDS} | {"round": rounding.default}


def _megarts_rope(cfg: GPTConfig) -> dict:
    """_megatron_lm_mla_rope's fields, from megart's GPTConfig (its yarn_ names)."""
    names = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim")  # fmt: skip
    return (
        {"rope_type": cfg.rope_type, "rotary_base": cfg.rotary_base}
        | {n: getattr(cfg, f"yarn_{n}") for n in names}
        | {"round": cfg.yarn_correction_range_round_to_int}
    )


def _explicit(cfg: GPTConfig) -> GPTConfig:
    """``cfg`` as Megatron's args read back: the MLP's width given (its 4h written out)."""
    return dataclasses.replace(cfg, ffn_hidden_size=cfg.ffn_size)


def test_args_give_megart_the_yarn_megatron_lms_mla_builds():
    cfg = tw.tiny(**YARN).gpt_config()
    a = vars(megatron_args(cfg, 3))
    assert (a["rope_type"], a["position_embedding_type"]) == ("yarn", "rope")
    assert (a["rotary_scaling_factor"], a["mscale"], a["mscale_all_dim"]) == (40.0, 0.707, 0.707)
    assert config_from_args(a) == _explicit(cfg)
    theirs = _megatron_lm_mla_rope(a)
    assert _megarts_rope(cfg) == theirs
    # Megatron-LM's own args: no --rope-type (its MLA's YaRN), and --yarn-* flags that its MLA
    # does not read (its GPT model's YaRN does): megart builds what its MLA builds.
    given = {**a, "rope_type": None, "rotary_scaling_factor": 4.0, "mscale": 1.0,
             "yarn_original_max_position_embeddings": 8192, "yarn_beta_fast": 8.0,
             "yarn_correction_range_round_to_int": False}  # fmt: skip
    read = config_from_args(given)
    assert read.rope_type == "yarn" and read.yarn_rotary_scaling_factor == 4.0
    assert _megarts_rope(read) == _megatron_lm_mla_rope(given)
    # --rope-type rope: plain rope, its YaRN settings unread (but for the refused pair).
    plain = config_from_args({**a, "rope_type": "rope", "mscale_all_dim": 0.0})
    assert plain.rope_type == "rope" and plain.yarn_rotary_scaling_factor == 1.0
    assert _megatron_lm_mla_rope({**a, "rope_type": "rope"})["rope_type"] == "rope"
    with pytest.raises(ConfigError, match="--rope-type rope, --rotary-scaling-factor 40.0 and "
                       "--mscale-all-dim 0.707: its scores are scaled"):  # fmt: skip
        config_from_args({**a, "rope_type": "rope"})


@pytest.mark.parametrize(
    "field,value,named",
    [("yarn_original_max_position_embeddings", 8192, "--yarn-original-max-position-embeddings "
      "8192 with"), ("yarn_beta_fast", 8.0, "--yarn-beta-fast 8.0 with"),
     ("yarn_beta_slow", 2.0, "--yarn-beta-slow 2.0 with"),
     ("yarn_correction_range_round_to_int", False, "--no-yarn-correction-range-round-to-int with")],
)  # fmt: skip
def test_what_megatron_lms_mla_cannot_hold_is_refused_by_convert(tmp_path, field, value, named):
    """megart's own format holds MLA's YaRN with any original context, betas and rounding
    (megart applies its --yarn-* flags under MLA); Megatron-LM's MLA keeps
    MLATransformerConfig's: convert-checkpoint refuses to write them, by name."""
    from megart.models import GPT
    from megart.training.checkpoint_save import write_release

    cfg = dataclasses.replace(tw.tiny(**YARN).gpt_config(), **{field: value})
    write_release(tmp_path / "megart", cfg, GPT(cfg).chunk.state_dict(), [0, 1])
    with pytest.raises(
        ConfigError,
        match=f"^{named} multi-latent attention's YaRN rope: "
        r"Megatron-LM's checkpoints \(--ckpt-format torch\) cannot hold it",
    ):
        megart_to_megatron(tmp_path / "megart", tmp_path / "out", ckpt_format="torch")


_tokens = mmw.tokens


SAVES = {  # name: (processes, flags, format)
    "torch-tp1": (1, {}, "torch"),
    "torch-tp2": (2, dict(tensor_model_parallel_size=2), "torch"),
    "torch_dist-tp1": (1, {}, "torch_dist"),
    "torch_dist-tp2": (2, dict(tensor_model_parallel_size=2), "torch_dist"),
}


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, YARN, timeout=300)[0]


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Per case: megart train's MLA+YaRN Megatron-format checkpoint after 2 of 3 iterations."""
    return mmw.saved_runs(tmp_path_factory, YARN, SAVES)


@pytest.mark.parametrize("name", list(SAVES))
def test_megatron_core_loads_megarts_mla_yarn_files_with_its_logits(saves, name):
    """Megatron-Core's MLA GPTModel with YaRN (of the args) on each tensor-parallel rank loads
    its slices (legacy file or torch_dist store, strictly) and computes the logits of megart's
    model as trained (its flags, not the args read back) on the saved weights; plain rope's
    are far from them."""
    nproc, _, fmt = SAVES[name]
    trained = tw.tiny(**YARN).gpt_config()
    read_cfg, model, _ = read_megatron(saves[name])
    assert read_cfg == _explicit(trained)
    want = mdw.megart_logits(trained, model, _tokens(trained))
    plain = dataclasses.replace(trained, rope_type="rope", yarn_rotary_scaling_factor=1.0)
    assert (mdw.megart_logits(plain, model, _tokens(trained)) - want).abs().max() > 0.1
    got = mmw.megatron_core_logits(saves[name], fmt, nproc, 1, _tokens(trained))
    assert len(got) == nproc
    for logits in got:
        assert (logits[..., : trained.vocab_size] - want).abs().max().item() < 1e-10


@pytest.mark.parametrize("name", ["torch-tp2", "torch_dist-tp1"])
def test_megart_resumes_its_megatron_format_mla_yarn_checkpoints_on_the_curve(
    saves, one_process, name
):
    nproc, flags, _ = SAVES[name]
    again = dict(YARN, **flags, load=str(saves[name]))
    want = [h["loss"] for h in one_process[2:]]
    for rank in launch(tw.train_kw, nproc, again, timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(want, **tw.SAME_RUN)


def test_megart_reads_megatron_cores_mla_yarn_store(tmp_path):
    """Megatron-Core's MLA GPTModel with YaRN saves its weights on 2 tensor-parallel ranks;
    megart reads its YaRN and computes its logits, and megart train at tp1 loads exactly the
    store's tensors."""
    from megart.models.megatron_names import from_megatron

    cfg = tw.tiny(**YARN).gpt_config()
    store = tmp_path / "dist"
    results = launch(mdw.save_megatron, 2, dataclasses.asdict(cfg), str(store), 2, 1,
                     _tokens(cfg), timeout=300)  # fmt: skip
    theirs = next(r["logits"] for r in results if r["logits"] is not None)[..., : cfg.vocab_size]
    read_cfg, model, _ = read_megatron(store)
    assert read_cfg == _explicit(cfg)
    assert (mdw.megart_logits(read_cfg, model, _tokens(cfg)) - theirs).abs().max().item() < 1e-10
    want = {"chunk." + k: v for k, v in from_megatron(model, cfg).items()}
    want["chunk.wte.weight"] = want["chunk.wte.weight"][: cfg.vocab_size]
    kw = dict(YARN, load=str(store), train_iters=1)
    for rank in launch(tw.train_holding, 1, kw, timeout=300):
        loaded = rank["loaded"]["weights"]
        assert set(loaded) == set(want)
        assert all(torch.equal(v, want[n].to(v.dtype)) for n, v in loaded.items())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_convert_checkpoint_carries_mla_yarn_both_ways(tmp_path, fmt):
    """megart's own MLA+YaRN checkpoint converted to Megatron-LM's format at tp2: Megatron-Core
    computes its logits; converted back, its weights and model (YaRN's settings, the init
    std) are megart's."""
    from megart.training.checkpoint import iteration_dir, latest_iteration, model_config
    from megart.training.shards import read_shards

    back = mmw.converted_both_ways(tmp_path, YARN, fmt)
    root = iteration_dir(back, latest_iteration(back))
    assert model_config(read_shards(root)[0, 0]) == _explicit(tw.tiny(**YARN).gpt_config())
