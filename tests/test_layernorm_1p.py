"""--apply-layernorm-1p (Megatron's layernorm_zero_centered_gamma): every norm's weight is
stored zero-centred, starts at 0 and scales by 1 + weight. The norms against that formula in
float64 (LayerNorm and RMSNorm, megart's LayerNorm kernel path and torch's, values and
gradients); a 1p model against the ordinary model holding 1 + its norm weights; megart train
with the flag, its checkpoints' record of it and --load's refusal of the other setting."""

import argparse

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_workers as mw
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.norms import apply_norm, norm
from megart.training.checkpoint import FILE, iteration_dir
from megart.training.config import TrainConfig
from megart.training.export_hf import export_checkpoint
from megart.training.megatron_args import config_from_args, megatron_args
from megart.training.optimizer import param_groups

safetensors = pytest.importorskip("safetensors.torch")
NORM_WEIGHTS = ("ln_1.weight", "ln_2.weight", "ln_f.weight")


def formula(kind: str, x, w, b, eps: float):
    """The norm with scale 1 + w, written out (no torch norm op), in x's dtype."""
    if kind == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)
    return y if b is None else y + b


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(["layernorm", "rmsnorm"]),
    fused=st.booleans(),
    bias=st.booleans(),
    rows=st.integers(1, 6),
    h=st.integers(2, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_1p_norm_is_the_formula_with_one_plus_weight(kind, fused, bias, rows, h, seed):
    cfg = GPTConfig(
        hidden_size=h, num_attention_heads=1, normalization=kind, bias=bias, apply_layernorm_1p=True
    )
    module = norm(cfg, sequence_parallel=False)
    assert not module.weight.any()  # zero-centred: the initial scale is 1
    # In float64: what is checked is the formula, not fp32's rounding, which a LayerNorm over
    # h = 2 features amplifies (two nearly equal values: a tiny variance) past any fixed
    # tolerance, with or without the 1 + weight. (megart's RMSNorm normalises 16-bit inputs in
    # fp32, float64 ones in float64.)
    module.double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    x = torch.randn(rows, 3, h, generator=g, dtype=torch.float64).requires_grad_()
    upstream = torch.randn(rows, 3, h, generator=g, dtype=torch.float64)
    # fused: megart.kernels.layer_norm (its torch reference on a CPU) for LayerNorm.
    y = apply_norm(module, x, fused)
    (y * upstream).sum().backward()
    # A LayerNorm has its bias with or without --disable-bias-linear (Megatron-Core's).
    b = module.bias if kind == "layernorm" else None
    ref_inputs = [t.detach().clone().requires_grad_() for t in (x, module.weight)]
    ref_bias = None if b is None else b.detach().clone().requires_grad_()
    ref = formula(kind, *ref_inputs, ref_bias, cfg.layernorm_epsilon)
    (ref * upstream).sum().backward()
    close = dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(y, ref, **close)
    torch.testing.assert_close(x.grad, ref_inputs[0].grad, **close)
    torch.testing.assert_close(module.weight.grad, ref_inputs[1].grad, **close)
    if b is not None:
        torch.testing.assert_close(b.grad, ref_bias.grad, **close)


def _small(**kw) -> GPTConfig:
    base = dict(vocab_size=96, seq_length=8, hidden_size=32, num_layers=2, num_attention_heads=4)
    return GPTConfig(**{**base, **kw})


def _logits_and_grads(model: GPT, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    logits = model(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"fused_layer_norm": True},  # the kernel's path, the residual add in the second norm
        {"normalization": "rmsnorm", "position_embedding": "rotary", "bias": False},
    ],
    ids=["layernorm", "fused-layernorm", "rmsnorm"],
)
def test_a_1p_model_is_the_ordinary_model_with_one_plus_its_norm_weights(options):
    centred = GPT(_small(apply_layernorm_1p=True, **options))
    plain = GPT(_small(**options))
    # Both start as the same network: scale 1, stored as 0 and as 1.
    for name, p in centred.named_parameters():
        expected = plain.get_parameter(name) - int(name.endswith(NORM_WEIGHTS))
        assert torch.equal(p, expected), name
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in centred.named_parameters():
            if name.endswith(NORM_WEIGHTS):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    shifted = {k: v + int(k.endswith(NORM_WEIGHTS)) for k, v in centred.state_dict().items()}
    plain.load_state_dict(shifted)
    x = torch.randint(0, 96, (3, 9), generator=g)
    logits, grads = _logits_and_grads(centred, x)
    plain_logits, plain_grads = _logits_and_grads(plain, x)
    # 1 + w is the same float32 sum whether stored or computed in the forward: bitwise equal.
    assert torch.equal(logits, plain_logits)
    for name, grad in grads.items():  # d/dw of (1 + w) is 1: the same gradients
        assert torch.equal(grad, plain_grads[name]), name


def test_zero_centred_weights_are_not_decayed():
    """As Megatron-Core's groups: 1-D parameters (norms, biases) get no weight decay, so the
    option does not change which group a norm's weight is in."""
    model = GPT(_small(apply_layernorm_1p=True))
    groups = param_groups(TrainConfig(weight_decay=0.1), [model.chunk])
    undecayed = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    norms = [p for n, p in model.named_parameters() if n.endswith(NORM_WEIGHTS)]
    assert len(norms) == 5 and all(id(p) in undecayed for p in norms)


def test_megatrons_args_record_and_give_the_option():
    cfg = _small(apply_layernorm_1p=True, ffn_hidden_size=128)  # as Megatron's args give it
    args = megatron_args(cfg, iteration=3)
    assert args.apply_layernorm_1p is True
    assert config_from_args(vars(args)) == cfg
    assert not config_from_args(vars(megatron_args(_small(), 3))).apply_layernorm_1p
    # Files from before the flag existed are ordinary models.
    del args.apply_layernorm_1p
    assert not config_from_args(vars(args)).apply_layernorm_1p


TRAIN = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 256 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0"
).split()


def _train(argv: list[str]) -> tuple[int, str]:
    return launch(mw.run_cli, 1, argv, timeout=120)[0]


def test_megart_train_with_the_flag_saves_zero_centred_weights_and_loads_only_with_it(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = [*TRAIN, "--apply-layernorm-1p", "--ckpt-format", "torch", "--save", ckpt]
    # Stopped after 2 of 3 iterations: the resumed run's --train-iters 3 is the saved schedule's.
    status, out = _train([*argv, "--train-iters", "3", "--exit-interval", "2"])
    assert status == 0 and "iteration     2/3" in out, out
    state = torch.load(iteration_dir(ckpt, 2) / "mp_rank_00" / FILE, weights_only=False)
    assert isinstance(state["args"], argparse.Namespace) and state["args"].apply_layernorm_1p
    assert state["megart"]["model_config"]["apply_layernorm_1p"]
    # Megatron's names, stored as trained: two Adam steps of 1e-3 move them from 0, not 1.
    norms = [v for k, v in state["model"].items() if k.endswith("layernorm.weight")]
    assert len(norms) == 5 and all(v.abs().max() < 0.01 for v in norms)
    # Hugging Face's GPT-2 holds the scale itself.
    hf = export_checkpoint(ckpt, tmp_path / "hf")
    final = safetensors.load_file(str(hf / "model.safetensors"))["transformer.ln_f.weight"]
    assert torch.equal(final, state["model"]["decoder.final_layernorm.weight"] + 1)
    status, out = _train([*TRAIN, "--load", ckpt, "--train-iters", "3"])
    assert status == 2, out
    assert "saved with --apply-layernorm-1p (now no --apply-layernorm-1p)" in out, out
    status, out = _train([*argv, "--load", ckpt, "--train-iters", "3"])
    assert status == 0 and "iteration     3/3" in out and "iteration     2/" not in out, out
