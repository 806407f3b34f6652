"""Multi-latent attention (Megatron's --multi-latent-attention, megart.models.mla) with plain
rope: against Megatron-Core 0.16.1's own GPTModel with MLA (local spec, float64, weights drawn
so that norms and biases are not at their starting values), both ways and at tensor-parallel
size 2; a planted mistake shows; megart train's layouts (tp with and without sequence
parallelism, pp, dp, recomputation) follow the one-process curve; megart's checkpoints resume
and reshard; FLOPs; and what is refused, by name."""

import json

import pytest
import torch

import document_workers as dw
import megatron_core_workers as mcw
import mla_workers as mw
import train_workers as tw
from megart.cli.train import FlagParser, add_arguments, config_from_args
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.hf import read_format, writer
from megart.models.megatron_names import from_megatron, to_megatron
from megart.training.flops import iteration_flops, model_flops
from megart.training.megatron_args import config_from_args as megatron_config
from test_flops import torch_count

SIZES = dict(kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            position_embedding="rotary", multi_latent_attention=True, **SIZES)  # fmt: skip
MODELS = {
    "q-proj": {},
    "q-lora-norms-llama": dict(
        q_lora_rank=10,
        qk_layernorm=True,
        normalization="rmsnorm",
        bias=False,
        activation="swiglu",
        untie_embeddings_and_output_weights=True,
    ),  # fmt: skip
    "q-lora-layernorm-1p": dict(q_lora_rank=8, qk_layernorm=True, apply_layernorm_1p=True),
    "kv-norm-only": dict(qk_layernorm=True, rotary_base=500.0),
}
# megart train's flags (TrainConfig's fields) for a small MLA model.
TRAIN = dict(multi_latent_attention=True, rope_type="rope", position_embedding_type="rope",
             q_lora_rank=16, qk_layernorm=True, normalization="RMSNorm", swiglu=True,
             disable_bias_linear=True, **SIZES)  # fmt: skip


def parse(*argv: str):
    p = FlagParser(prog="megart train")
    add_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


MLA_FLAGS = ("--multi-latent-attention", "--rope-type", "rope", "--position-embedding-type",
             "rope", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim",
             "4", "--v-head-dim", "6")  # fmt: skip


@pytest.fixture(scope="module")
def against_megatron_core():
    return mcw.compare_named(BASE, MODELS)


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_computes_the_same_logits_both_ways(against_megatron_core, name):
    mcw.assert_same_both_ways(against_megatron_core[name])


def test_the_comparison_catches_rope_on_the_wrong_pairs():
    """The mutation the comparison exists for: rope turning the halves of the rope channels
    (megart's attention's default) instead of MLA's adjacent pairs."""
    kw = {**BASE, **MODELS["q-lora-norms-llama"]}
    assert launch(mw.compare_with_halves_rope, 1, kw, timeout=300)[0] > 1e-3


def test_megatron_cores_tp2_model_computes_megarts_logits_from_its_slices():
    """Megatron-Core's MLA at tensor-parallel size 2, each rank strictly loading its slice of
    megart's weights as megart's resharder cuts them (column-parallel projections by rows,
    the output projection by columns, norms whole): megart's one-process logits."""
    kw = {**BASE, **MODELS["q-lora-norms-llama"], "q_lora_rank": 8}
    cfg, state, tokens, want = mw.megart_model(kw)
    for got in launch(mw.tp_logits, 2, cfg, state, tokens, timeout=300):
        assert (got[..., : want.shape[-1]] - want).abs().max().item() < 1e-10


def test_the_parameters_have_megatron_cores_names_and_shapes():
    cfg = GPTConfig(**BASE, **MODELS["q-lora-norms-llama"])
    theirs = to_megatron(GPT(cfg).chunk.state_dict(), cfg)
    names = {k: v.shape for k, v in theirs.items()}
    attn = "decoder.layers.0.self_attention."
    assert names[attn + "linear_q_down_proj.weight"] == (10, 32)
    assert names[attn + "linear_q_up_proj.weight"] == (4 * 12, 10)  # heads x (8 + 4)
    assert names[attn + "linear_kv_down_proj.weight"] == (12 + 4, 32)
    assert names[attn + "linear_kv_up_proj.weight"] == (4 * (8 + 6), 12)
    assert names[attn + "linear_proj.weight"] == (32, 4 * 6)
    assert names[attn + "q_layernorm.weight"] == (10,)
    assert names[attn + "kv_layernorm.weight"] == (12,)
    # Transformer Engine's layer spec fuses the latents' norms into the up-projections.
    fused = {"q_layernorm.": "linear_q_up_proj.layer_norm_",
             "kv_layernorm.": "linear_kv_up_proj.layer_norm_"}  # fmt: skip
    te = dict(theirs)
    for name in list(te):
        for norm, up in fused.items():
            if norm in name:
                te[name.replace(norm, up)] = te.pop(name)
    assert attn + "linear_kv_up_proj.layer_norm_weight" in te
    assert set(from_megatron(te, cfg)) == set(GPT(cfg).chunk.state_dict())
    plain = GPTConfig(**BASE)  # no --q-lora-rank, no --qk-layernorm: no norms
    got = to_megatron(GPT(plain).chunk.state_dict(), plain)
    assert got[attn + "linear_q_proj.weight"].shape == (4 * 12, 32)
    assert not [n for n in got if "layernorm" in n and "self_attention" in n]


def test_a_sample_of_documents_is_each_document_on_its_own():
    """Under --reset-position-ids and --reset-attention-mask (the documents' positions and
    mask, megart.models.documents) MLA's logits of a packed sample are each document's alone,
    in float64; without the mask they differ."""
    net = mcw.drawn(GPT(GPTConfig(**BASE, **MODELS["q-lora-norms-llama"])).double())
    dw.assert_each_document_on_its_own(net)


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, TRAIN, timeout=300)[0]


# name: (processes, flags)
# fmt: off
LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2-sp-core-attn": (
        2,
        dict(tensor_model_parallel_size=2, sequence_parallel=True, recompute_activations=True),
    ),  # fmt: skip
    "tp2-sp-layernorm-mlp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                     recompute_granularity="selective",
                                     recompute_modules=["core_attn", "layernorm", "mlp"])),
    "pp2-full-recompute": (2, dict(pipeline_model_parallel_size=2, recompute_granularity="full")),
    "dp2-distopt": (2, dict(use_distributed_optimizer=True)),
    "tp2-sp-pp2": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                           pipeline_model_parallel_size=2)),
}
# fmt: on


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_layouts_follow_the_one_process_curve(one_process, name):
    """Under tensor parallelism the heads split; the latents are gathered whole and the
    shared rope key part's gradient summed over the ranks' heads (left partial, the tp2
    curves leave this one: tried once)."""
    processes, kw = LAYOUTS[name]
    want = [h["loss"] for h in one_process]
    for rank in launch(tw.train_kw, processes, {**TRAIN, **kw}, timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(want, **tw.SAME_RUN)


@pytest.fixture(scope="module")
def one_process_gradients():
    return launch(mw.gradients, 1, TRAIN, timeout=300)[0]


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_gradients_are_the_one_process_gradients(one_process_gradients, sp):
    """Every weight's gradient, gathered over the ranks, is the one-process gradient: the
    down-projection's rope rows included, whose gradient is summed over the ranks' heads (left
    partial, only the rank's own heads' share, they differ: tried once; the loss curve alone
    did not show it)."""
    kw = dict(TRAIN, tensor_model_parallel_size=2, sequence_parallel=sp)
    got = launch(mw.gradients, 2, kw, timeout=300)[0]
    assert set(got) == set(one_process_gradients)
    assert any("kv_down_proj" in n for n in got)
    for name, want in one_process_gradients.items():
        scale = want.abs().max().item()  # float32's rounding, relative to the tensor's size
        assert scale > 0, name
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_the_latent_norms_and_q_lora_are_in_the_curve(one_process):
    kw = dict(TRAIN, qk_layernorm=False, q_lora_rank=None)
    other = launch(tw.train_kw, 1, kw, timeout=300)[0]
    assert [h["loss"] for h in other] != pytest.approx([h["loss"] for h in one_process], rel=1e-4)


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)])
def test_megart_checkpoints_resume_and_reshard_across_tp(tmp_path, one_process, saved, resumed):
    kw = dict(TRAIN, save=str(tmp_path), exit_interval=2, tensor_model_parallel_size=saved)
    launch(tw.train_kw, saved, kw, timeout=300)
    again = dict(TRAIN, load=str(tmp_path), tensor_model_parallel_size=resumed)
    for rank in launch(tw.train_kw, resumed, again, timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(
            [h["loss"] for h in one_process[2:]], **tw.SAME_RUN
        )


def test_a_checkpoint_of_another_attention_is_refused_by_name(tmp_path):
    launch(tw.train_kw, 1, dict(TRAIN, save=str(tmp_path), train_iters=1), timeout=300)
    with pytest.raises(Exception, match="multi-latent-attention"):
        launch(tw.train_kw, 1, dict(TRAIN, load=str(tmp_path), kv_lora_rank=8), timeout=300)


def test_the_flags_build_the_model():
    config = parse(*MLA_FLAGS, "--q-lora-rank", "16", "--qk-layernorm")
    cfg = config.gpt_config()
    assert (cfg.multi_latent_attention, cfg.q_lora_rank, cfg.kv_lora_rank) == (True, 16, 12)
    assert (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (8, 4, 6)
    assert cfg.rotary_dim == 4  # rope's tables for the rope channels alone
    assert type(GPT(cfg).chunk.blocks[0].attn).__name__ == "MLA"
    p = FlagParser(prog="megart train")
    add_arguments(p)
    assert "--kv-lora-rank" in p.format_help() and "--rope-type" in p.format_help()


@pytest.mark.parametrize(
    "argv,message",
    [
        # --rope-type picks MLA's rope in Megatron-LM (its YaRN: test_mla_yarn.py).
        ((*MLA_FLAGS[:4], "yarn", *MLA_FLAGS[5:]),
         "--multi-latent-attention with --position-embedding-type yarn: multi-latent "
         "attention turns its own rope"),
        (("--multi-latent-attention", "--rope-type", "rope"),
         "--multi-latent-attention needs --position-embedding-type rope"),
        (("--kv-lora-rank", "8"), "--kv-lora-rank 8: multi-latent attention's sizes; add "
         "--multi-latent-attention"),
        ((*MLA_FLAGS, "--group-query-attention", "--num-query-groups", "2"),
         "needs no --group-query-attention"),
        ((*MLA_FLAGS, "--rotary-interleaved"), "needs no --rotary-interleaved"),
        ((*MLA_FLAGS, "--use-rope-scaling"), "needs no --use-rope-scaling"),
        ((*MLA_FLAGS, "--window-size", "4,0"), "needs no --window-size"),
        ((*MLA_FLAGS, "--qk-pos-emb-head-dim", "3"), "--qk-pos-emb-head-dim 3: .* even"),
    ],
)  # fmt: skip
def test_what_megart_does_not_build_is_refused_by_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).gpt_config()


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (("--tensor-model-parallel-size", "3", "--num-attention-heads", "6", "--hidden-size",
          "36"), 3, r"down-projection's 16 rows \(--kv-lora-rank \+ --qk-pos-emb-head-dim\)"),
    ],
)  # fmt: skip
def test_layouts_and_formats_megart_does_not_take_are_refused_by_name(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse(*MLA_FLAGS, *argv).check(world)


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_context_parallelism_is_taken_with_every_exchange(comm):
    """Refused until MLA attended through the exchanges (its runs: tests/test_mtp_mla_cp.py)."""
    parse(*MLA_FLAGS, "--context-parallel-size", "2", "--cp-comm-type", comm).check(2)


@pytest.mark.parametrize("flag", ["--cache-mla-latents", "--mla-down-proj-fusion"])
def test_the_inference_flags_stay_refused_by_name(flag):
    with pytest.raises(ConfigError, match=f"^{flag}: megart's"):
        parse(*MLA_FLAGS, flag, "1")


@pytest.mark.parametrize("flag", ["--mscale", "--mscale-all-dim", "--rotary-scaling-factor",
                                  "--yarn-beta-fast"])  # fmt: skip
def test_yarns_settings_are_refused_beside_mla(flag):
    """YaRN's settings (Megatron-LM's MLA reads them under --rope-type yarn) beside
    --rope-type rope."""
    with pytest.raises(ConfigError, match=f"^{flag} 2.0 sets YaRN's rope scaling"):
        parse(*MLA_FLAGS, flag, "2").gpt_config()


def test_megatron_args_and_hugging_face_refuse_what_they_cannot_hold(tmp_path):
    cfg = GPTConfig(**BASE)
    # Hugging Face's MLA format is DeepSeek-V3's (test_hf_deepseek_v3.py), which this model's
    # LayerNorm, GeLU and missing latent norms do not fit.
    with pytest.raises(ConfigError, match="a DeepSeek-V3 checkpoint cannot represent .*LayerNorm"):
        writer(cfg)
    # Megatron-LM's MLA args read (test_megatron_mla_ckpt; YaRN too: test_megatron_mla_yarn),
    # but not beside its GPT model's own YaRN table.
    with pytest.raises(ConfigError, match="multi-latent attention and --position-embedding-type "
                       "yarn: .*--rope-type, on --position-embedding-type rope"):  # fmt: skip
        megatron_config(dict(multi_latent_attention=True, position_embedding_type="yarn"))
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="deepseek_v2")))
    with pytest.raises(ConfigError, match="holds a deepseek_v2.*DeepSeek-V2's .* is not"):
        read_format(tmp_path)
    # megart plan models MLA since the plan-ds merge: tests/test_plan_memory_mla.py.


@pytest.mark.parametrize("kw", [{}, dict(q_lora_rank=10, qk_layernorm=True),
                                dict(recompute_granularity="selective")])  # fmt: skip
def test_flops_equal_torchs_flop_counter_on_the_model(kw):
    model = {k: v for k, v in BASE.items() if k not in ("vocab_size", "seq_length",
                                                         "hidden_size", "num_layers",
                                                         "num_attention_heads")}  # fmt: skip
    cfg, counted = torch_count(layers=2, **model, **kw)
    selective = cfg.recomputes("core_attn")
    assert model_flops(cfg, 3, causal=False, selective=selective) == counted


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_flops_are_megatrons_but_for_its_norm_terms(q_lora_rank):
    """Megatron-LM's num_floating_point_operations for MLA (facts from its training.py): per
    token and layer 3 passes x 2 FLOPs times the queries' h n (qk + pos) (or r_q (h + n (qk +
    pos) + 1)), r_kv (h + n (qk + v) + 1), h pos and n v h; per sequence and layer the same
    6 times s^2 (n (qk + pos) / 2 + n v / 2). Its "+ 1"s count the latents' norms, which
    megart, counting products, leaves out as it does every norm."""
    b, s, l, h, v, n, qk, pos, vd, rkv = 3, 64, 5, 96, 1000, 6, 16, 8, 12, 20
    cfg = GPTConfig(vocab_size=v, seq_length=s, hidden_size=h, num_layers=l,
                    num_attention_heads=n, position_embedding="rotary",
                    multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=rkv,
                    qk_head_dim=qk, qk_pos_emb_head_dim=pos, v_head_dim=vd,
                    make_vocab_size_divisible_by=8)  # fmt: skip
    rq = q_lora_rank
    q_term = h * n * (qk + pos) if rq is None else rq * (h + n * (qk + pos) + 1)
    norms = 0 if rq is None else rq  # the "+ 1" terms
    token = q_term + rkv * (h + n * (qk + vd) + 1) + h * pos + n * vd * h
    mlp = 2 * h * 4 * h
    megatron = 6 * b * s * l * (token + mlp) + 6 * b * s * h * 1000
    megatron += 6 * b * l * s * s * (n * (qk + pos) + n * vd) // 2
    assert model_flops(cfg, b) == megatron - 6 * b * s * l * (norms + rkv)
    assert iteration_flops(b, s, l, h, v) != model_flops(cfg, b)


def test_the_run_line_names_the_attention():
    from types import SimpleNamespace

    from megart.training.reporting import run_description

    fake = SimpleNamespace(config=tw.tiny(**TRAIN), chunks=[], peak=None, dp=1, m=1,
                           device_name="CPU")  # fmt: skip
    assert "4 heads of multi-latent attention (kv rank 12), seq 16" in run_description(fake)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("rope", [("--rope-type", "yarn"), ()])
def test_mla_yarn_megatron_lm_cannot_hold_is_refused_in_its_formats_before_training(fmt, rope):
    """Megatron's files hold MLA with YaRN (no --rope-type is YaRN under MLA, as in
    Megatron-LM), but not the settings its MLA keeps fixed (training/megatron_mla.py), which
    megart's own format holds."""
    flags = [f for f in MLA_FLAGS if f not in ("--rope-type",)]
    flags.remove("rope")  # --rope-type's value; --position-embedding-type keeps its own
    yarn = (*flags, *rope, "--rotary-scaling-factor", "40", "--mscale-all-dim", "1")
    assert parse(*yarn, "--ckpt-format", fmt).check(1) == 1
    assert parse(*yarn, "--yarn-beta-fast", "32", "--ckpt-format", fmt).check(1) == 1  # kept
    for extra, named in [(("--yarn-original-max-position-embeddings", "8192"),
                          "^--yarn-original-max-position-embeddings 8192 with"),
                         (("--yarn-beta-slow", "2", "--no-yarn-correction-range-round-to-int"),
                          "^--yarn-beta-slow 2.0 and --no-yarn-correction-range-round-to-int "
                          "with")]:  # fmt: skip
        with pytest.raises(ConfigError, match=named + " multi-latent attention's YaRN rope: "
                           r"Megatron-LM's checkpoints \(--ckpt-format .*keeps "):  # fmt: skip
            parse(*yarn, *extra, "--ckpt-format", fmt).check(1)
        assert parse(*yarn, *extra, "--ckpt-format", "megart").check(1) == 1
