"""Multi-latent attention (megart.models.mla) in Megatron-LM's checkpoints, against
Megatron-Core 0.16.1's own MLA GPTModel (local spec, megatron_core_workers): its flags in the
args both ways (and --use-checkpoint-args), the legacy files' names, order and tensor-parallel
slices and torch_dist's keys and shard axes as Megatron-Core's model gives them, Megatron-Core
loading megart train's files and stores (megart's logits), megart reading what Megatron-Core
saves, and megart train resuming its own Megatron-format MLA checkpoints on the one-process
curve at tp1 and tp2, with either optimizer (Megatron-Core's distributed optimizer on them:
test_megatron_mla_distopt)."""

import dataclasses

import pytest
import torch

import megatron_core_workers as mcw
import megatron_dist_workers as mdw
import megatron_mla_ckpt_workers as mmw
import train_workers as tw
from megart.cli.main import main
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import megatron_layer_name, to_megatron
from megart.models.vocab import fit_vocab
from megart.training.megatron_args import config_from_args, megatron_args
from megart.training.megatron_checkpoint import read_megatron
from megart.training.megatron_dist_keys import sharded_keys
from megart.training.megatron_layout import split, tp_dim
from megart.training.megatron_optimizer import in_megatron_order
from megart.training.shards import partition_dims
from test_mla import BASE, MLA_FLAGS, SIZES, TRAIN, parse

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist writer needs it

# Queries through a latent with both latent norms, and queries projected directly.
LORA = dict(BASE, q_lora_rank=10, qk_layernorm=True, bias=False, activation="swiglu")
# A plain GPT's --qk-layernorm beside them: its norms keep their own sharded keys, the layer's
# norms take the fused names (the local spec's keys map, which MLA's spec lacks).
PLAIN = {k: v for k, v in BASE.items() if k not in SIZES and k != "multi_latent_attention"}
MODELS = {
    "q-lora-norms": LORA,
    "q-proj": dict(BASE),
    "plain-qk-norm": dict(PLAIN, qk_layernorm=True),
    # MLA with experts in one of two layers (each layer keyed apart in torch_dist).
    "moe": dict(
        LORA, num_experts=2, moe_router_topk=1, moe_router_pre_softmax=True, moe_layer_freq=(1, 0)
    ),  # fmt: skip
}


_tokens = mmw.tokens


def _explicit(cfg: GPTConfig) -> GPTConfig:
    """``cfg`` as Megatron's args read back: the MLP's width given (its 4h written out)."""
    return dataclasses.replace(cfg, ffn_hidden_size=cfg.ffn_size)


def test_args_hold_megatron_lms_mla_flags_and_read_back():
    cfg = GPTConfig(**LORA)
    a = vars(megatron_args(cfg, 3))
    assert a["multi_latent_attention"] and a["rope_type"] == "rope"
    assert (a["q_lora_rank"], a["kv_lora_rank"], a["qk_head_dim"]) == (10, 12, 8)
    assert (a["qk_pos_emb_head_dim"], a["v_head_dim"]) == (4, 6)
    assert config_from_args(a) == _explicit(cfg)
    direct = GPTConfig(**BASE)
    assert config_from_args(vars(megatron_args(direct, 0))) == _explicit(direct)
    # Without MLA: Megatron-LM's defaults, and args from before it had the flags read as none.
    dense = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                      num_attention_heads=4)  # fmt: skip
    plain = vars(megatron_args(dense, 0))
    assert (plain["multi_latent_attention"], plain["rope_type"]) == (False, None)
    assert (plain["q_lora_rank"], plain["kv_lora_rank"], plain["v_head_dim"]) == (None, 32, 128)
    older = {k: v for k, v in plain.items() if k not in ("multi_latent_attention", "rope_type")}
    assert config_from_args(older) == config_from_args(plain) == _explicit(dense)
    # Megatron-LM's MLA turns YaRN unless --rope-type rope (test_megatron_mla_yarn), scales
    # its scores by YaRN's mscale with a scaling factor and --mscale-all-dim even under plain
    # rope, and may fuse its down-projections: refused by name.
    for rope in ("yarn", None):
        assert config_from_args({**a, "rope_type": rope}).rope_type == "yarn"
    yarn_scale = {**a, "rotary_scaling_factor": 40.0, "mscale_all_dim": 1.0}
    with pytest.raises(ConfigError, match="--rotary-scaling-factor 40.0 and --mscale-all-dim 1"):
        config_from_args(yarn_scale)
    assert config_from_args({**a, "rotary_scaling_factor": 40.0}) == _explicit(cfg)  # unused
    with pytest.raises(ConfigError, match="--mla-down-proj-fusion"):
        config_from_args({**a, "mla_down_proj_fusion": True})
    assert (a["rotary_scaling_factor"], a["mscale"], a["mscale_all_dim"]) == (1.0, 1.0, 0.0)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megart_train_takes_mla_with_megatrons_formats(fmt):
    """Once refused by name (test_mla's refusals): now checked and taken."""
    assert parse(*MLA_FLAGS, "--ckpt-format", fmt).check(1) == 1


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def layout(request):
    tp = request.param
    return tp, {name: launch(mmw.megatron_layout, tp, kw, timeout=300)
                for name, kw in MODELS.items()}  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_legacy_files_hold_megatron_cores_names_order_and_slices(layout, name):
    """Each tensor-parallel rank's legacy file holds the names, in order (its optimizer's
    parameter order), and the shapes of Megatron-Core's own model on that rank: the MLA
    projections (down-projections too) split on their rows, linear_proj on its columns."""
    tp, ranks = layout
    cfg = GPTConfig(**MODELS[name])
    whole = to_megatron(GPT(cfg).chunk.state_dict(), cfg)
    mcw.pad_vocab(whole, cfg, tp)
    files = split(whole, cfg, tp, 1)
    for t, theirs in enumerate(ranks[name]):
        ours = in_megatron_order(files[t, 0][0])
        assert list(ours) == list(theirs["state"])
        shapes = {k: None if v is None else tuple(v.shape) for k, v in ours.items()}
        assert shapes == theirs["state"]


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_dist_keys_and_shard_axes_are_megatron_cores(layout, name):
    """The store's keys and global shapes (megart.training.megatron_dist_keys) and each
    tensor's tensor-parallel axis (the legacy layout's and megart's own layers') are those of
    Megatron-Core's sharded_state_dict: its MLA norms under their own names (no fused names
    under MLA's local spec), every MLA projection split on its rows, an extra state each."""
    tp, ranks = layout
    cfg = GPTConfig(**MODELS[name])
    state = GPT(cfg).chunk.state_dict()
    whole = to_megatron(state, cfg)
    whole["embedding.word_embeddings.weight"] = fit_vocab(
        whole["embedding.word_embeddings.weight"], cfg.padded_vocab_size(tp)
    )
    stored = {k: tuple(v.shape) for k, v in sharded_keys(whole, cfg).items()}
    theirs = ranks[name][0]["sharded"]
    assert stored == {key: shape for key, shape, _, _ in theirs.values()}
    assert any(".q_layernorm." in k for k in stored) == (name != "q-proj")
    assert any("linear_qkv.layer_norm_" in k for k in stored) == (name == "plain-qk-norm")
    ours_dims = {}  # megart's own layers' split dimension, of the attention's parameters
    for n, d in partition_dims(cfg, tuple(range(cfg.num_layers)), True, True).items():
        _, layer, rest = n.split(".", 2) if n.startswith("blocks.") else ("", "", "")
        if rest.startswith("attn."):
            ours_dims[f"decoder.layers.{layer}.{megatron_layer_name(rest, cfg)[0]}"] = d
    for per_layer, (_, _, pieces, halves) in theirs.items():
        dim = tp_dim(per_layer)
        want = [tp if d == dim else 1 for d in range(len(pieces))]
        if halves:  # SwiGLU's gate and up pieces on the rows
            want[0] *= 2
        assert list(pieces) == want, per_layer
        if per_layer in ours_dims:
            assert ours_dims[per_layer] == dim, per_layer
    from megart.training.megatron_dist import extra_states

    objects = set(extra_states(range(cfg.num_layers), cfg, cfg.untie_embeddings_and_output_weights))
    assert objects == ranks[name][0]["objects"]


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, TRAIN, timeout=300)[0]


def _losses(history: list[dict]) -> list[float]:
    return [h["loss"] for h in history]


SAVES = {  # name: (processes, flags, format)
    "torch-tp2": (2, dict(tensor_model_parallel_size=2), "torch"),
    "torch-tp1": (1, {}, "torch"),
    "torch_dist-tp2": (2, dict(tensor_model_parallel_size=2), "torch_dist"),
    "torch_dist-tp1": (1, {}, "torch_dist"),
    "torch-dp2-distopt": (2, dict(use_distributed_optimizer=True), "torch"),
    "torch-pp2": (2, dict(pipeline_model_parallel_size=2), "torch"),
    "torch_dist-tp2-pp2": (
        4,
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        "torch_dist",
    ),  # fmt: skip
    "torch_dist-tp2-distopt": (
        4,
        dict(tensor_model_parallel_size=2, use_distributed_optimizer=True),
        "torch_dist",
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Per case: megart train's Megatron-format checkpoint after 2 of 3 iterations."""
    return mmw.saved_runs(tmp_path_factory, TRAIN, SAVES)


@pytest.mark.parametrize("name", list(SAVES))
def test_megart_resumes_its_megatron_format_mla_checkpoints_on_the_curve(saves, one_process, name):
    nproc, flags, _ = SAVES[name]
    again = dict(TRAIN, **flags, load=str(saves[name]))
    for rank in launch(tw.train_kw, nproc, again, timeout=300):
        assert _losses(rank) == pytest.approx(_losses(one_process[2:]), **tw.SAME_RUN)


@pytest.mark.parametrize("name", ["torch-tp2", "torch-tp1"])
def test_megatron_core_loads_megarts_legacy_files_with_its_logits(saves, name):
    """Each of Megatron-Core's tensor-parallel ranks strictly loads its own file."""
    ckpt, tp = saves[name], SAVES[name][0]
    cfg, model, _ = read_megatron(ckpt)
    want = mdw.megart_logits(cfg, model, _tokens(cfg))
    assert want.abs().max() > 0.1
    for got in mmw.megatron_core_logits(ckpt, "torch", tp, 1, _tokens(cfg)):
        assert (got[..., : cfg.vocab_size] - want).abs().max().item() < 1e-10


@pytest.mark.parametrize("name", ["torch_dist-tp2", "torch_dist-tp1", "torch_dist-tp2-pp2"])
def test_megatron_core_loads_megarts_torch_dist_store_with_its_logits(saves, name):
    """Megatron-Core's dist_checkpointing load as Megatron-LM's loader calls it (strict
    about missing keys), each rank its slices (its stage's layers), into its model
    (strictly)."""
    ckpt, flags = saves[name], SAVES[name][1]
    tp = flags.get("tensor_model_parallel_size", 1)
    pp = flags.get("pipeline_model_parallel_size", 1)
    cfg, model, _ = read_megatron(ckpt)
    want = mdw.megart_logits(cfg, model, _tokens(cfg))
    assert want.abs().max() > 0.1
    got = mmw.megatron_core_logits(ckpt, "torch_dist", tp, pp, _tokens(cfg))
    assert len(got) == tp
    for logits in got:
        assert (logits[..., : cfg.vocab_size] - want).abs().max().item() < 1e-10


@pytest.mark.parametrize("saved,run", [(1, 2), (2, 1)])
def test_megart_reads_megatron_cores_mla_store(tmp_path, saved, run):
    """Megatron-Core's MLA GPTModel saves its own weights on ``saved`` tensor-parallel ranks
    through dist_checkpointing; megart's reader (and convert-checkpoint to megart's format)
    gives a GPT computing Megatron-Core's logits, and megart train at tensor-parallel size
    ``run`` loads it holding exactly the store's tensors."""
    import megatron_core_ckpt_workers as mckw
    from megart.models.megatron_names import from_megatron

    cfg = tw.tiny(**TRAIN).gpt_config()
    store = tmp_path / "dist"
    results = launch(mdw.save_megatron, saved, dataclasses.asdict(cfg), str(store), saved, 1,
                     _tokens(cfg), timeout=300)  # fmt: skip
    theirs = next(r["logits"] for r in results if r["logits"] is not None)[..., : cfg.vocab_size]
    read_cfg, model, _ = read_megatron(store)
    assert read_cfg == _explicit(cfg)
    assert (mdw.megart_logits(cfg, model, _tokens(cfg)) - theirs).abs().max().item() < 1e-10
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load",
                 str(store), "--save", str(tmp_path / "back")]) == 0  # fmt: skip
    back = launch(mckw.checkpoint_logits, 1, str(tmp_path / "back"), _tokens(cfg), timeout=300)
    # checkpoint_gpt loads the file into a float32 GPT (Megatron-Core saved float64 weights).
    assert (back[0] - theirs).abs().max().item() < 1e-6
    want = {"chunk." + k: v for k, v in from_megatron(model, cfg).items()}
    want["chunk.wte.weight"] = want["chunk.wte.weight"][: cfg.vocab_size]
    kw = dict(TRAIN, load=str(store), train_iters=1, tensor_model_parallel_size=run)
    seen = set()
    for rank in launch(tw.train_holding, run, kw, timeout=300):
        for name, value in rank["loaded"]["weights"].items():
            assert torch.equal(value, want[name].to(value.dtype)), name
            seen.add(name)
    assert seen == set(want)


@pytest.mark.parametrize("name", ["torch-tp1", "torch_dist-tp1"])
def test_use_checkpoint_args_takes_the_mla_flags(saves, tmp_path, capsys, name):
    """From Megatron's args alone (megart's record stripped): MLA, its sizes and plain rope,
    forced over the command line's (megart's extra: Megatron-LM's loader takes none of them)."""
    import shutil

    from test_checkpoint_args import USE, flags_config, strip_megart_record

    copy = tmp_path / "stripped"
    shutil.copytree(saves[name], copy)
    strip_megart_record(copy)
    got = flags_config(["--load", str(copy), *USE, "--kv-lora-rank", "32"])
    assert "Setting kv_lora_rank to 12 from checkpoint (overriding the command line's " in (
        capsys.readouterr().out
    )
    want = tw.tiny(**TRAIN).gpt_config()
    assert got.gpt_config() == _explicit(want)
    assert (got.multi_latent_attention, got.rope_type, got.q_lora_rank) == (True, "rope", 16)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_convert_checkpoint_writes_megarts_mla_run_for_megatron_core(tmp_path, fmt):
    """convert-checkpoint of megart train's own MLA checkpoint to Megatron-LM's format at
    tensor-parallel size 2: Megatron-Core's two ranks load it and compute the checkpoint's
    logits; converted back, megart's weights are unchanged."""
    mmw.converted_both_ways(tmp_path, TRAIN, fmt)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mla_with_experts_resumes_from_megatrons_formats_on_its_curve(tmp_path, fmt):
    """MLA layers with experts in every other one (torch_dist keys each layer apart)."""
    kw = dict(TRAIN, num_experts=2, moe_layer_freq="2", moe_router_topk=1,
              moe_router_pre_softmax=True, tensor_model_parallel_size=2,
              sequence_parallel=True)  # fmt: skip
    straight = launch(tw.train_kw, 2, kw, timeout=300)[0]
    launch(tw.train_kw, 2, dict(kw, save=str(tmp_path), exit_interval=2, ckpt_format=fmt),
           timeout=300)  # fmt: skip
    for rank in launch(tw.train_kw, 2, dict(kw, load=str(tmp_path)), timeout=300):
        assert _losses(rank) == pytest.approx(_losses(straight[2:]), **tw.SAME_RUN)


def test_a_transformer_engine_mla_store_converts_and_train_names_its_spec(tmp_path):
    """A store keyed as Transformer Engine's MLA spec keys it (facts of its gpt_layer_specs:
    the latent norms fused into the up-projections, the pre-MLP norm into fc1, no keys map;
    untried against Transformer Engine itself): convert-checkpoint's whole read gives megart's
    weights; megart train's --load names the spec and the way through."""
    from megart.models.megatron_names import from_megatron
    from megart.training import megatron_dist
    from megart.training.megatron_mla import TE_MLA_NORMS

    cfg = tw.tiny(**TRAIN).gpt_config()
    weights = GPT(cfg).chunk.state_dict()
    te = {}
    for name, value in to_megatron(weights, cfg).items():
        for local, fused in TE_MLA_NORMS.items():
            name = name.replace(f".{local}", f".{fused}")
        te[name] = value
    assert any("linear_kv_up_proj.layer_norm_weight" in n for n in te)
    megatron_dist.write(tmp_path, 5, megatron_args(cfg, 5), te, cfg)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    _, model, _ = read_megatron(tmp_path)
    back = from_megatron(model, cfg)
    assert set(back) == set(weights) and all(torch.equal(back[k], weights[k]) for k in weights)
    with pytest.raises(Exception, match="Transformer Engine's layer spec .*convert-checkpoint"):
        launch(tw.train_kw, 1, dict(TRAIN, load=str(tmp_path), train_iters=6), timeout=300)
