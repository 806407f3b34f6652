"""GPT: equal across tensor-parallel layouts, equal to Hugging Face's GPT-2, options work."""

import pytest
import torch

import gpt_workers as gw
from megart import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig


def assert_same(result, reference, rtol=1e-5):
    loss, grads = result
    ref_loss, ref_grads = reference
    assert loss == pytest.approx(ref_loss, rel=rtol)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=rtol, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "tp, sp, options",
    [
        (2, False, {}),
        (2, True, {}),
        (
            4,
            True,
            {
                "normalization": "rmsnorm",
                "position_embedding": "rotary",
                "activation": "swiglu",
                "bias": False,
                # Zero-centred norm weights: the gamma sum under sequence parallelism.
                "apply_layernorm_1p": True,
            },
        ),
    ],
)
def test_forward_and_backward_equal_across_tensor_parallel_layouts(tp, sp, options):
    reference = gw.loss_and_grads(None, False, options)
    for result in launch(gw.tp_run, tp, sp, options, timeout=180):
        assert_same(result, reference)


def test_loss_is_the_mean_next_token_cross_entropy_of_the_logits():
    model = GPT(gw.small_config())
    x = gw.tokens()
    logits = model(x[:, :-1])
    assert logits.shape == (3, 16, 300)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), x[:, 1:].reshape(-1))
    assert model(x[:, :-1], x[:, 1:]).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(path)
    return str(path), hf


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_gpt2_logits_equal_transformers_at_tp1_and_tp2(gpt2_dir):
    path, hf = gpt2_dir
    x = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x).logits
        ours = GPT.from_hf_gpt2(path).eval()(x)
    assert relative_error(ours, expected) < 1e-4
    for logits in launch(gw.hf_logits, 2, path, x, timeout=180):
        assert relative_error(logits, expected) < 1e-4


def test_export_loads_back_unchanged(gpt2_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    path, hf = gpt2_dir
    launch(gw.hf_export, 2, path, str(tmp_path), timeout=180)  # gathered from two shards
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    original = hf.state_dict()
    for name, value in back.state_dict().items():
        assert torch.equal(value, original[name]), name


def test_layouts_the_model_cannot_take_are_refused():
    with pytest.raises(
        ConfigError,
        match=r"4 attention heads do not split over tensor-parallel "
        r"size 3 \(use tensor-parallel size 1, 2 or 4\)",
    ):
        GPTConfig(hidden_size=32, num_attention_heads=4).check_layout(tp=3)
    with pytest.raises(
        ConfigError,
        match=r"12 layers do not split into 5 pipeline stages \(use pipeline size 1, 2, 3, 4, "
        r"6 or 12, or uneven first/last stages\)",
    ):
        GPTConfig().check_layout(pp=5)
    # Each suggested size fits; interleaving (two chunks) suggests none under two stages.
    with pytest.raises(ConfigError, match=r"x 2 chunks \(use pipeline size 2, 3 or 6, or"):
        GPTConfig().check_layout(pp=4, chunks=2)
    for pp in (2, 3, 6):
        GPTConfig().check_layout(pp=pp, chunks=2)
    with pytest.raises(ConfigError, match="normalization='batchnorm'"):
        GPTConfig(normalization="batchnorm")


def test_attention_dropout_draws_from_the_tensor_parallel_stream():
    from megart.tensor_parallel import RNGStatesTracker, seed_tensor_parallel

    tracker = RNGStatesTracker()
    seed_tensor_parallel(tracker, seed=7, tp_rank=0)
    model = GPT(gw.small_config(attention_dropout=0.5), rng=tracker).train()
    x = gw.tokens()
    before = torch.get_rng_state()
    first, second = model(x[:, :-1], x[:, 1:]), model(x[:, :-1], x[:, 1:])
    assert first.item() != second.item()  # new masks each call
    assert torch.equal(torch.get_rng_state(), before)  # the default stream was not used
