"""--disable-bias-linear removes the linear layers' biases only, as Megatron-Core's
add_bias_linear=False: every LayerNorm (input, pre-MLP, final, --qk-layernorm's) keeps weight
and bias (Falcon's shape: LayerNorm with bias, linear layers without). Against Megatron-Core
0.16.1's GPTModel (local spec, float64, both sides' weights drawn so the biases are not zero):
the same logits both ways; a tp2 checkpoint converts to Megatron's legacy format (Megatron-Core
at tp2 loads it strictly, same logits) and back; at tp2 with --sequence-parallel each rank's
norm-bias gradient is the one-process gradient; the biases start at zero and are never decayed;
megart plan counts them; a checkpoint an older megart wrote without them loads with zero
biases and fresh Adam moments for them, everything else resumed."""

import dataclasses
import re

import pytest
import torch

import megatron_core_workers as mcw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig, hf
from megart.models.config import architecture_flags
from megart.models.megatron_names import from_megatron, to_megatron
from megart.plan.parameters import chunk_tensors
from megart.training.megatron_layout import tp_dim
from megart.training.megatron_optimizer import decayed
from megart.training.optimizer import param_groups
from test_megatron_ranks import _convert, megart_logits

BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4)
FALCON = dict(bias=False)  # LayerNorm, learned positions, GeLU, tied: only the biases differ
MODELS = {
    "falcon-style": FALCON,
    "rope-swiglu-gqa-qk-layernorm": dict(
        bias=False,
        position_embedding="rotary",
        activation="swiglu",
        ffn_hidden_size=64,
        untie_embeddings_and_output_weights=True,
        num_query_groups=2,
        qk_layernorm=True,
    ),  # fmt: skip
    # Its FusedLayerNorm with zero-centred gamma (apex's kernel replaced by torch's function).
    "layernorm-1p": dict(bias=False, apply_layernorm_1p=True),
}
# The same kind of model as megart train's (Megatron's) flags, TrainConfig's fields.
TRAIN = dict(disable_bias_linear=True, qk_layernorm=True)
NORM_BIAS = re.compile(r"(ln_1|ln_2|ln_f|q_layernorm|k_layernorm)\.bias$")


def norm_biases(named: dict) -> dict:
    return {n: v for n, v in named.items() if NORM_BIAS.search(n)}


def test_every_layernorm_keeps_a_zero_bias_and_no_linear_layer_has_one():
    cfg = GPTConfig(**BASE, bias=False, qk_layernorm=True)
    params = dict(GPT(cfg).named_parameters())
    biases = {n: p for n, p in params.items() if n.endswith(".bias")}
    per_layer = ("ln_1", "attn.q_layernorm", "attn.k_layernorm", "ln_2")
    want = [f"chunk.blocks.{i}.{m}.bias" for i in range(2) for m in per_layer]
    assert sorted(biases) == sorted([*want, "chunk.ln_f.bias"])
    assert all(not p.any() for p in biases.values())  # zero, as Megatron-Core initialises
    assert params["chunk.blocks.0.attn.q_layernorm.bias"].shape == (8,)  # one head wide
    # RMSNorm has no bias to keep.
    rms = GPT(dataclasses.replace(cfg, normalization="rmsnorm"))
    assert not [n for n, _ in rms.named_parameters() if n.endswith(".bias")]


def test_norm_biases_are_not_decayed_as_megatron_cores_default():
    cfg = tw.tiny(**TRAIN, weight_decay=0.1)
    model = GPT(cfg.gpt_config())
    groups = param_groups(cfg, [model.chunk])
    decayed_ids = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    params = dict(model.named_parameters())
    biases = norm_biases(params)
    assert len(biases) == 4 * cfg.num_layers + 1
    assert not any(id(p) in decayed_ids for p in biases.values())
    assert id(params["chunk.blocks.0.attn.qkv.weight"]) in decayed_ids
    mapped = to_megatron(model.state_dict(), model.cfg)
    assert not any(decayed(n, v) for n, v in mapped.items() if n.endswith("layernorm.bias"))


def test_megatron_names_carry_the_norm_biases_transformer_engines_included():
    cfg = GPTConfig(**BASE, bias=False, qk_layernorm=True)
    state = GPT(cfg).state_dict()
    mapped = to_megatron(state, cfg)
    for name in ("decoder.final_layernorm.bias", "decoder.layers.1.input_layernorm.bias",
                 "decoder.layers.1.pre_mlp_layernorm.bias",
                 "decoder.layers.1.self_attention.q_layernorm.bias",
                 "decoder.layers.1.self_attention.k_layernorm.bias"):  # fmt: skip
        assert name in mapped and tp_dim(name) is None  # replicated over tensor parallelism
    assert not any("linear" in n and n.endswith(".bias") for n in mapped)
    # Transformer Engine fuses the norms into the next linear layer: layer_norm_bias.
    te = {
        n.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_").replace(
            "pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"
        ): v
        for n, v in mapped.items()
    }
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias" in te
    assert tp_dim("decoder.layers.0.mlp.linear_fc1.layer_norm_bias") is None
    back = from_megatron(te, cfg)
    assert set(back) == {k.removeprefix("chunk.") for k in state}


@pytest.fixture(scope="module")
def against_megatron_core():
    return mcw.compare_named(BASE, MODELS)


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_computes_the_same_logits_both_ways(against_megatron_core, name):
    mcw.assert_same_both_ways(against_megatron_core[name])


def test_the_fused_layer_norm_path_takes_the_bias():
    """--fused-layer-norm (megart.kernels.layer_norm, its torch reference on a CPU, and the
    block's fused residual add) computes what the module does, bias and its gradient
    included."""
    cfg = GPTConfig(**BASE, bias=False)
    plain = mcw.drawn(GPT(cfg).double())
    fused = GPT(dataclasses.replace(cfg, fused_layer_norm=True)).double()
    fused.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    for model in (plain, fused):
        model(tokens, targets).backward()
    torch.testing.assert_close(fused(tokens), plain(tokens), rtol=1e-12, atol=1e-12)
    want = norm_biases({n: p.grad for n, p in plain.named_parameters()})
    got = norm_biases({n: p.grad for n, p in fused.named_parameters()})
    assert len(want) == 5 and all(g.abs().max() > 0 for g in want.values())
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-12, atol=1e-12)


def _norm_bias_grads(kw: dict) -> dict:
    return norm_biases(tw.gradients_after_one_step(**kw))


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_tp2_sequence_parallel_ranks_each_hold_the_one_process_norm_bias_gradient(fused):
    """Under --sequence-parallel each rank normalises its own part of the sequence: its bias
    gradients are partial sums, all-reduced over tensor parallelism (megart marks them as
    Megatron-Core marks sequence_parallel parameters)."""
    kw = dict(TRAIN, fused_layer_norm=fused)
    want = launch(_norm_bias_grads, 1, kw, timeout=300)[0]
    assert len(want) == 4 * tw.tiny().num_layers + 1 and all(
        g.abs().max() > 0 for g in want.values()
    )
    tp2 = dict(kw, tensor_model_parallel_size=2, sequence_parallel=True)
    ranks = launch(_norm_bias_grads, 2, tp2, timeout=300)
    for got in ranks:
        assert set(got) == set(want)
        for name, grad in got.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-8)
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in want)  # the same on both ranks


def test_megatron_cores_tp2_model_loads_the_converted_checkpoint_and_it_converts_back(tmp_path):
    """A tp2 run's checkpoint (LayerNorm, --disable-bias-linear, biases trained away from
    zero), converted to Megatron-LM's legacy checkpoint: Megatron-Core's GPTModel at tp2 loads
    each rank's file strictly and computes megart's logits; converted back to megart, the
    weights are the original ones."""
    ckpt, out, back = tmp_path / "megart", tmp_path / "megatron", tmp_path / "back"
    kw = dict(TRAIN, train_iters=2, save=str(ckpt), tensor_model_parallel_size=2)
    launch(tw.train_kw, 2, kw, timeout=300)
    _convert("--from", "megart", "--to", "megatron", "--load", str(ckpt), "--save", str(out),
             "--target-tensor-parallel-size", "2")  # fmt: skip
    ours, tokens, want = megart_logits(ckpt)
    biases = norm_biases(dict(ours.named_parameters()))
    assert len(biases) == 4 * ours.cfg.num_layers + 1 and all(
        p.abs().max() > 0 for p in biases.values()
    )
    with torch.no_grad():
        zeroed = GPT(ours.cfg).double()
        zeroed.load_state_dict(ours.state_dict())
        for p in norm_biases(dict(zeroed.named_parameters())).values():
            p.zero_()
        assert (zeroed(tokens) - want).abs().max() > 1e-6  # the biases count
    for got in launch(mcw.tp_rank_logits, 2, str(out), tokens, timeout=300):
        assert (got[..., : want.shape[-1]] - want).abs().max().item() < 1e-10
    _convert("--from", "megatron", "--to", "megart", "--load", str(out), "--save", str(back))
    again, _, logits = megart_logits(back)
    # The same architecture (Megatron's args spell out the default MLP size).
    assert architecture_flags(again.cfg) == architecture_flags(ours.cfg)
    assert torch.equal(logits, want)


def test_hugging_face_writers_refuse_it_by_name():
    """GPT-2 has every bias; Llama, Mistral, Qwen2 and Qwen3 use RMSNorm: none can hold
    LayerNorm with biases and linear layers without."""
    with pytest.raises(ConfigError) as e:
        hf.writer(GPTConfig(**BASE, bias=False))
    assert "--disable-bias-linear" in str(e.value) and "--normalization" in str(e.value)


def _rank_parameter_counts(cfg: GPTConfig) -> list[int]:
    import megart.distributed as dist

    dist.init(timeout=120)
    return [p.numel() for p in GPT(cfg, tp_group=dist.new_group()).chunk.parameters()]


@pytest.mark.parametrize("tp", [1, 2])
def test_plans_parameter_count_is_the_models(tp):
    cfg = GPTConfig(**BASE, bias=False, qk_layernorm=True)
    planned = chunk_tensors(cfg, tp, 1, 0, 1)[0].tensors
    for real in launch(_rank_parameter_counts, tp, cfg, timeout=180):
        assert planned == real


def _as_older_megart(kw: dict) -> dict:
    """tw.train_holding with the model an older megart built: its norm() gave LayerNorm no
    bias under --disable-bias-linear (nn.LayerNorm(bias=False) registers the bias as None,
    as setting it to None here does), so its checkpoints lack the norm biases and their
    optimizer state."""
    from unittest import mock

    from torch import nn

    from megart.models import attention, blocks, gpt, norms

    def old_norm(cfg: GPTConfig, sequence_parallel: bool, size: int | None = None) -> nn.Module:
        module = norms.norm(cfg, sequence_parallel, size)
        if isinstance(module, nn.LayerNorm) and not cfg.bias:
            module.bias = None
        return module

    with (
        mock.patch.object(gpt, "norm", old_norm),
        mock.patch.object(attention, "norm", old_norm),
        mock.patch.object(blocks, "norm", old_norm),
    ):
        return tw.train_holding(kw)


@pytest.fixture(scope="module")
def older_checkpoint(tmp_path_factory):
    """An older megart's run, 4 iterations straight, and one that saved after 2 (tp1)."""
    store = tmp_path_factory.mktemp("older") / "ckpt"
    kw = dict(TRAIN, train_iters=4)
    straight = launch(_as_older_megart, 1, kw, timeout=300)[0]
    saving = launch(_as_older_megart, 1, dict(kw, exit_interval=2, save=str(store)), timeout=300)
    return straight, saving[0]["trained"], store


def _held(trainer) -> dict:
    """Weights and Adam's moments by place (tw.by_place); NaN where a parameter has no
    optimizer state."""
    opt = trainer.optimizer
    params = [p for group in opt.param_groups for p in group["params"]]
    state = {id(params[i]): s for i, s in opt.state_dict()["state"].items()}
    out = {"weights": tw.by_place(trainer, lambda p: p)}

    def moment(p: torch.Tensor, key: str) -> torch.Tensor:
        return state[id(p)][key] if id(p) in state else torch.full_like(p, float("nan"))

    for key in tw.MOMENTS:
        out[key] = tw.by_place(trainer, lambda p, k=key: moment(p, k))
    return out


def _resumed(kw: dict) -> dict:
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=tw.builtin_corpus(1 << 16))
    loaded = _held(trainer)
    history = trainer.train(quiet=True)
    return {"loaded": loaded, "history": history, "trained": _held(trainer)}


@pytest.mark.parametrize("tp", [1, 2], ids=["same-layout", "resharded-tp2"])
def test_an_older_checkpoint_without_norm_biases_loads_them_as_zero(older_checkpoint, tp, capfd):
    straight, saved, store = older_checkpoint
    assert not norm_biases(saved["weights"])  # the older layout, as its files hold it
    capfd.readouterr()
    kw = dict(TRAIN, train_iters=4, load=str(store), tensor_model_parallel_size=tp)
    resumed = launch(_resumed, tp, kw, timeout=300)
    printed = capfd.readouterr().out
    assert printed.count("built LayerNorm without its bias") == 1  # once, from rank 0
    loaded = [r["loaded"] for r in resumed]
    weights = tw.merged_by_place(loaded, "weights")
    zeros = norm_biases(weights)
    assert len(zeros) == 4 * tw.tiny().num_layers + 1 and not any(b.any() for b in zeros.values())
    for key in ("weights", *tw.MOMENTS):  # everything else as saved
        got = tw.merged_by_place(loaded, key) if key == "weights" else loaded[0][key]
        assert all(torch.equal(got[n], v) for n, v in saved[key].items()), key
        if key != "weights":  # no moments for the biases: Adam starts them afresh
            assert all(m.isnan().all() for m in norm_biases(got).values())
    # A zero bias computes what no bias did: iteration 3 is the older run's iteration 3.
    history = resumed[0]["history"]
    assert [h["iteration"] for h in history] == [3, 4]
    assert history[0]["loss"] == pytest.approx(straight["history"][2]["loss"], **tw.SAME_RUN)
    # Then the biases train, from their own first Adam step.
    trained = norm_biases(resumed[0]["trained"]["exp_avg"])
    assert len(trained) == len(zeros) and all(m.abs().max() > 0 for m in trained.values())
    assert all(not m.isnan().any() for m in trained.values())


def test_an_older_torch_dist_store_is_refused_naming_the_conversion_that_completes_it(tmp_path):
    store, out = tmp_path / "dist", tmp_path / "converted"
    kw = dict(TRAIN, train_iters=2, ckpt_format="torch_dist")
    launch(_as_older_megart, 1, dict(kw, save=str(store)), timeout=300)
    with pytest.raises(Exception, match="(?s)older megart.*convert-checkpoint --from megatron"):
        launch(tw.train_kw, 1, dict(kw, load=str(store)), timeout=300)
    _convert("--from", "megatron", "--to", "megart", "--load", str(store), "--save", str(out))
    resumed = launch(_resumed, 1, dict(TRAIN, train_iters=1, load=str(out)), timeout=300)[0]
    zeros = norm_biases(resumed["loaded"]["weights"])
    assert len(zeros) == 4 * tw.tiny().num_layers + 1 and not any(b.any() for b in zeros.values())
