"""Megatron's --add-qkv-bias: the attention's fused q/k/v projection keeps a bias under
--disable-bias-linear (Megatron-Core's TransformerConfig.add_qkv_bias; Qwen2's attention).
Against Megatron-Core 0.16.1's own GPTModel (local spec, float64, weights drawn so that the
biases are not zero): the same logits both ways, and at tensor-parallel size 2 from a
converted legacy checkpoint; megart train at tp2 on CPU ranks: each rank's bias gradient is its
slice of the one-process gradient, the curve is the one-process curve, a checkpoint resumes on
one process and one without the flag is refused; the bias is zero-initialised and never
decayed (Megatron-Core's defaults); megart plan counts it."""

import dataclasses

import pytest
import torch

import megatron_core_workers as mcw
import train_workers as tw
from megart.cli.train import FlagParser, add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.plan.parameters import chunk_tensors
from megart.training.megatron_args import config_from_args as megatron_config
from megart.training.megatron_args import megatron_args
from megart.training.optimizer import param_groups
from test_megatron_ranks import _convert, megart_logits

BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4)
QWEN2 = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             ffn_hidden_size=64, bias=False, add_qkv_bias=True,
             untie_embeddings_and_output_weights=True, num_query_groups=2)  # fmt: skip
# The same model as megart train's (Megatron's) flags, TrainConfig's fields.
TRAIN = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             disable_bias_linear=True, add_qkv_bias=True, group_query_attention=True,
             num_query_groups=2, ffn_hidden_size=64)  # fmt: skip
MODELS = {
    "qwen2-style": QWEN2,
    # Learned positions, GeLU, multi-head.
    "gelu-learned-mha": dict(normalization="rmsnorm", bias=False, add_qkv_bias=True),
    # LayerNorm keeps its bias under --disable-bias-linear (Falcon's norms with Qwen2's q/k/v).
    "layernorm-gelu-learned-mha": dict(bias=False, add_qkv_bias=True),
}


def qkv_bias_names(cfg: GPTConfig) -> list[str]:
    return [f"chunk.blocks.{i}.attn.qkv.bias" for i in range(cfg.num_layers)]


def test_only_qkv_has_a_bias_starting_at_zero_as_megatron_cores():
    cfg = GPTConfig(**BASE, **QWEN2)
    model = GPT(cfg)
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert list(biases) == qkv_bias_names(cfg)
    rows = (4 + 2 * 2) * 8  # 4 query heads, 2 key and 2 value heads, of 8 channels
    assert all(p.shape == (rows,) and not p.any() for p in biases.values())
    # With every linear layer's bias on, the flag changes nothing: one model, one config.
    assert GPTConfig(**BASE, add_qkv_bias=True) == GPTConfig(**BASE)


def test_the_bias_is_not_decayed_as_megatron_cores_default():
    cfg = tw.tiny(**TRAIN, weight_decay=0.1)
    model = GPT(cfg.gpt_config())
    groups = param_groups(cfg, [model.chunk])
    decayed = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    params = dict(model.named_parameters())
    assert not any(id(params[n]) in decayed for n in qkv_bias_names(model.cfg))
    assert id(params["chunk.blocks.0.attn.qkv.weight"]) in decayed


def test_megatron_flags_and_args_carry_it():
    p = FlagParser(prog="megart train")
    add_arguments(p)
    assert "--add-qkv-bias" in p.format_help()
    config = config_from_args(p.parse_args(["--disable-bias-linear", "--add-qkv-bias"]))
    cfg = config.gpt_config()
    assert (cfg.bias, cfg.add_qkv_bias, cfg.qkv_bias) == (False, True, True)
    args = vars(megatron_args(cfg, 1, 1, 1))
    assert (args["add_bias_linear"], args["add_qkv_bias"]) == (False, True)
    assert megatron_config(args).add_qkv_bias
    # Megatron-LM's args of a model with every bias record add_qkv_bias True: the same model.
    plain = GPTConfig(**BASE)
    assert vars(megatron_args(plain, 1, 1, 1))["add_qkv_bias"] is True
    assert megatron_config(vars(megatron_args(plain, 1, 1, 1))).add_qkv_bias is False


@pytest.fixture(scope="module")
def against_megatron_core():
    return mcw.compare_named(BASE, MODELS)


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_computes_the_same_logits_both_ways(against_megatron_core, name):
    mcw.assert_same_both_ways(against_megatron_core[name])


def _local_grads(kw: dict) -> dict:
    """This rank's own (not gathered) gradient of each q/k/v bias after one iteration."""
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(train_iters=1, **kw), tokens=tw.builtin_corpus(1 << 16))
    trainer.train(quiet=True)
    return {n: p.grad.clone() for n, p in trainer.chunks[0].named_parameters() if "qkv.bias" in n}


def test_each_tp2_rank_holds_its_query_groups_slice_of_the_one_process_gradient():
    """Rank r's bias is rows [r, r+1) halves of the whole, the same query groups as its
    weight rows: its gradient is that slice of the one-process gradient."""
    want = launch(_local_grads, 1, TRAIN, timeout=300)[0]
    assert len(want) == 4 and all(g.abs().max() > 0 for g in want.values())
    ranks = launch(_local_grads, 2, dict(TRAIN, tensor_model_parallel_size=2), timeout=300)
    for r, got in enumerate(ranks):
        for name, grad in got.items():
            torch.testing.assert_close(grad, want[name].chunk(2)[r], rtol=1e-5, atol=1e-8)


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, dict(TRAIN, train_iters=4), timeout=300)[0]


def test_tp2_follows_the_one_process_curve(one_process):
    kw = dict(TRAIN, train_iters=4, tensor_model_parallel_size=2)
    for rank in launch(tw.train_kw, 2, kw, timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(
            [h["loss"] for h in one_process], rel=5e-6
        )


@pytest.mark.parametrize("ckpt_format", ["megart", "torch"])
def test_a_tp2_checkpoint_resumes_on_one_process_and_records_the_flag(
    tmp_path, one_process, ckpt_format
):
    kw = dict(TRAIN, train_iters=4, save=str(tmp_path), exit_interval=2, ckpt_format=ckpt_format)
    launch(tw.train_kw, 2, dict(kw, tensor_model_parallel_size=2), timeout=300)
    resume = dict(TRAIN, train_iters=4, load=str(tmp_path), ckpt_format=ckpt_format)
    resumed = launch(tw.train_kw, 1, resume, timeout=300)[0]
    assert [h["loss"] for h in resumed] == pytest.approx(
        [h["loss"] for h in one_process[2:]], rel=5e-6
    )
    with pytest.raises(Exception, match="add-qkv-bias"):  # another model's weights
        launch(tw.train_kw, 1, dict(resume, add_qkv_bias=False), timeout=300)


def test_megatron_cores_tp2_model_loads_the_converted_checkpoint(tmp_path):
    """Megatron-Core's GPTModel at tensor-parallel size 2 loads each rank's file of the
    converted legacy checkpoint strictly and computes megart's logits: each rank's bias is
    the slice of its own query groups."""
    ckpt, out = tmp_path / "megart", tmp_path / "megatron"
    kw = dict(TRAIN, train_iters=2, save=str(ckpt), tensor_model_parallel_size=2)
    launch(tw.train_kw, 2, kw, timeout=300)
    _convert("--from", "megart", "--to", "megatron", "--load", str(ckpt), "--save", str(out),
             "--target-tensor-parallel-size", "2")  # fmt: skip
    ours, tokens, want = megart_logits(ckpt)
    cfg = ours.cfg
    params = dict(ours.named_parameters())
    assert all(params[n].abs().max() > 0 for n in qkv_bias_names(cfg))  # trained away from 0
    with torch.no_grad():
        without = GPT(dataclasses.replace(cfg, add_qkv_bias=False)).double()
        state = {k: v for k, v in ours.state_dict().items() if not k.endswith("qkv.bias")}
        without.load_state_dict(state)
        assert (without(tokens) - want).abs().max() > 1e-6  # the biases count
    for got in launch(mcw.tp_rank_logits, 2, str(out), tokens, timeout=300):
        assert (got[..., : want.shape[-1]] - want).abs().max().item() < 1e-10


def _rank_parameter_counts(cfg: GPTConfig) -> list[int]:
    import megart.distributed as dist

    dist.init(timeout=120)
    return [p.numel() for p in GPT(cfg, tp_group=dist.new_group()).chunk.parameters()]


@pytest.mark.parametrize("tp", [1, 2])
def test_plans_parameter_count_is_the_models(tp):
    cfg = GPTConfig(**BASE, **QWEN2)
    planned = chunk_tensors(cfg, tp, 1, 0, 1)[0].tensors
    for real in launch(_rank_parameter_counts, tp, cfg, timeout=180):
        assert planned == real
    plain = dataclasses.replace(cfg, add_qkv_bias=False)
    extra = sum(planned) - sum(chunk_tensors(plain, tp, 1, 0, 1)[0].tensors)
    assert extra == 2 * (4 + 2 * 2) * 8 // tp  # each layer's q/k/v rows of this rank


def test_megart_plan_takes_the_flag(capsys):
    from plan_workers import plan_json

    base = ("--gpu h100-80gb --num-gpus 8 --num-layers 32 --hidden-size 4096 "
            "--num-attention-heads 32 --seq-length 4096 --vocab-size 32000 --global-batch-size 64 "
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --micro-batch-size 1 "
            "--position-embedding-type rope --normalization RMSNorm --swiglu "
            "--disable-bias-linear")  # fmt: skip
    without, with_bias = (plan_json(base + extra, capsys) for extra in ("", " --add-qkv-bias"))
    assert with_bias["memory_gib"]["parameters"] > without["memory_gib"]["parameters"]
