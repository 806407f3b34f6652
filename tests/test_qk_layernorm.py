"""--qk-layernorm: each query and key head normalised over its channels before rope, as
Megatron-Core's q_layernorm and k_layernorm. References: Megatron-Core's GPTModel (its local
layer spec with qk_layernorm) in float64, both ways, and megart's one-process training curve for
tensor, sequence and pipeline parallelism, whose ranks each normalise their own heads with
weights whose gradients must be summed over the tensor-parallel group."""

import pytest
import torch

import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig

BASE = dict(vocab_size=100, seq_length=16, hidden_size=64, num_layers=2, num_attention_heads=4,
            qk_layernorm=True)  # fmt: skip
MODELS = {
    "gpt2-style": {},
    "llama-style": dict(
        normalization="rmsnorm",
        position_embedding="rotary",
        bias=False,
        activation="swiglu",
        num_query_groups=2,
    ),  # fmt: skip
    "layernorm-1p": dict(apply_layernorm_1p=True, position_embedding="rotary"),
}


def _against_megatron_core(configs: list[dict]) -> list[float]:
    """In a launched process (Megatron-Core keeps its state in module globals): for each
    config, megart's GPT with drawn q/k norm weights (not the initial ones and zeros, which a
    norm applied after rope instead of before would match) against Megatron-Core's GPTModel
    holding the same weights; the largest logit difference, relative."""
    import megatron_core_workers as mcw
    from megart.models.megatron_names import to_megatron

    out = []
    for kw in configs:
        cfg = GPTConfig(**kw)
        ours = GPT(cfg).double()
        drawn = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in ours.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    p.copy_(1 + 0.5 * torch.randn(p.shape, generator=drawn, dtype=p.dtype))
        theirs = mcw.megatron_model(cfg)
        extra = {k: v for k, v in theirs.state_dict().items() if k.endswith("_extra_state")}
        theirs.load_state_dict({**to_megatron(ours.state_dict(), cfg), **extra}, strict=True)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=drawn)
        with torch.no_grad():
            want = ours(tokens)
        got = mcw.megatron_logits(theirs, tokens)[..., : want.shape[-1]]
        out.append(((got - want).abs().max() / want.abs().max()).item())
    return out


def test_megatron_core_computes_the_same_logits():
    pytest.importorskip("megatron.core")
    configs = [{**BASE, **kw} for kw in MODELS.values()]
    errors = launch(_against_megatron_core, 1, configs, timeout=300)[0]
    assert max(errors) < 1e-12, dict(zip(MODELS, errors, strict=True))


def test_the_norms_are_per_head_and_their_names_megatrons():
    cfg = GPTConfig(**BASE, **MODELS["llama-style"])
    names = {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items() if "layernorm" in k}
    assert names == {
        f"chunk.blocks.{i}.attn.{qk}_layernorm.weight": (16,) for i in (0, 1) for qk in "qk"
    }
    from megart.models.megatron_names import from_megatron, to_megatron

    state = GPT(cfg).state_dict()
    mapped = to_megatron(state, cfg)
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in mapped
    assert from_megatron(mapped, cfg).keys() == {k.removeprefix("chunk.") for k in state}


LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "tp2-distopt": dict(tensor_model_parallel_size=2, use_distributed_optimizer=True),
}
TRAIN = dict(qk_layernorm=True, train_iters=5, normalization="RMSNorm", swiglu=True,
             position_embedding_type="rope", disable_bias_linear=True)  # fmt: skip


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, TRAIN, timeout=300)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_follows_the_one_process_curve(one_process, layout):
    for rank in launch(tw.train_kw, 2, dict(TRAIN, **LAYOUTS[layout]), timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(
            [h["loss"] for h in one_process], rel=5e-6
        )


def _norm_grads(kw: dict) -> dict:
    grads = tw.gradients_after_one_step(**kw)
    return {k: v for k, v in grads.items() if "q_layernorm" in k or "k_layernorm" in k}


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_each_tensor_parallel_rank_holds_the_whole_gradient_of_the_norms(layout):
    """Each rank's heads give part of the gradient; summed over t, every rank holds the
    one-process gradient (the curves alone would hardly show a missing sum: Adam's first
    steps depend on little more than the gradient's sign)."""
    kw = {k: v for k, v in TRAIN.items() if k != "train_iters"}  # one, the helper's
    want = launch(_norm_grads, 1, kw, timeout=300)[0]
    assert len(want) == 2 * 4  # q and k in each of the tiny run's 4 layers
    for rank in launch(_norm_grads, 2, dict(kw, **LAYOUTS[layout]), timeout=300):
        for name, grad in rank.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("ckpt_format", ["megart", "torch", "torch_dist"])
def test_a_tp2_checkpoint_resumes_on_one_process_and_records_the_flag(
    tmp_path, one_process, ckpt_format
):
    kw = dict(TRAIN, save=str(tmp_path), exit_interval=2, ckpt_format=ckpt_format)
    launch(tw.train_kw, 2, dict(kw, tensor_model_parallel_size=2), timeout=300)
    resumed = launch(
        tw.train_kw, 1, dict(TRAIN, load=str(tmp_path), ckpt_format=ckpt_format), timeout=300
    )[0]
    assert [h["loss"] for h in resumed] == pytest.approx(
        [h["loss"] for h in one_process[2:]], rel=5e-6
    )
    with pytest.raises(Exception, match="qk-layernorm"):  # the weights mean another model
        launch(tw.train_kw, 1, dict(TRAIN, qk_layernorm=False, load=str(tmp_path)), timeout=300)


def test_hugging_face_formats_refuse_it_by_name():
    from megart.models import hf_gpt2, hf_llama

    for fmt, extra in ((hf_llama, MODELS["llama-style"]), (hf_gpt2, {})):
        with pytest.raises(ConfigError, match="--qk-layernorm"):
            fmt.check(GPTConfig(**BASE, **extra))
