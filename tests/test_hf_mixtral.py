"""Hugging Face Mixtral interop: a Mixtral is megart's Llama-style GPT with --num-experts in every
layer (--disable-bias-linear, a sliding window over every layer or none). Against transformers'
own MixtralForCausalLM: its routing is megart's default (checked on numbers), its logits from
megart's GPT, its files written back exactly, a megart model and a pp2 training checkpoint
written in its format, a wrong expert mapping caught by the logit bound, what either side
cannot represent refused by name, and an imported Mixtral fine-tuned under pipeline
parallelism with the flags import-hf prints (imported at tensor-parallel size 2 as well, the
experts split over the ranks)."""

import dataclasses
import json
import shlex

import pytest
import torch

import megatron_core_ckpt_workers as mckw
import train_workers as tw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.moe import route
from megart.training.config import TrainConfig
from megart.training.export_hf import export_checkpoint
from megart.training.import_hf import train_flags
from test_hf_llama import assert_fine_tunes, randomized, relative_error, saved_hf, train_config

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

# Two key/value heads, untied, four experts of which each token takes two.
HF_TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
               rope_theta=1e6, rms_norm_eps=1e-5)  # fmt: skip
VARIANTS = {
    "gqa-untied": {},
    # A window of 8 on 24 tokens, three of four experts, tied, heads 16 wide on h 32.
    "window-top3-tied-wide-heads": dict(sliding_window=8, num_experts_per_tok=3,
                                        tie_word_embeddings=True, head_dim=16,
                                        num_key_value_heads=4, rope_theta=10000.0),
}  # fmt: skip
MIXTRAL = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
               bias=False, num_experts=4)  # fmt: skip
# float32 on both sides; rope angles and the experts' sums in another order: measured 1.4e-7
# to 3.6e-7 relative; a wrong expert mapping is 3.4e-3 or more off.
BOUND = 1e-5


def saved_mixtral(root, **changes) -> object:
    """transformers' own Mixtral (saved_hf's: norm scales away from 1), saved in ``root``."""
    config = transformers.MixtralConfig(**{**HF_TINY, **changes})
    return saved_hf(root, transformers.MixtralForCausalLM, config)


def tokens(seed: int, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))


def moe(**kw) -> GPTConfig:
    base = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                num_attention_heads=4, ffn_hidden_size=48)  # fmt: skip
    return GPTConfig(**{**base, **MIXTRAL, **kw})


def routed(router: torch.nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits [512, 8] of random tokens, transformers' ``router``'s routing weights for
    them, zero off each token's chosen experts) for a random router weight [8, 32]."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(512, 32, generator=g), torch.randn(8, 32, generator=g)
    with torch.no_grad():
        router.weight.copy_(weight)
        _, scores, chosen = router(hidden)
    return torch.nn.functional.linear(hidden, weight), torch.zeros(512, 8).scatter(
        1, chosen, scores
    )


@pytest.mark.parametrize("k", [2, 3])
def test_mixtrals_routing_is_megarts_default_top_k_softmax(k):
    """Softmax over all experts, top k, renormalised (transformers' MixtralTopKRouter) gives the
    weights megart's default routing gives (the softmax of the top k logits)."""
    cfg = moe(num_experts=8, moe_router_topk=k)
    router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(
        transformers.MixtralConfig(**{**HF_TINY, "num_local_experts": 8, "num_experts_per_tok": k})
    )
    logits, theirs = routed(router, seed=k)
    ours, _ = route(logits, cfg)
    assert (ours - theirs).abs().max() < 1e-6  # float32 softmaxes: measured 1.8e-7
    # The identity itself, in float64: exp(l_i) / sum_topk exp(l_j), whatever the denominator.
    wide = logits.double()
    top, which = torch.topk(torch.softmax(wide, dim=-1), k, dim=-1)
    renormalised = torch.zeros_like(wide).scatter(1, which, top / top.sum(-1, keepdim=True))
    assert (route(wide, cfg)[0] - renormalised).abs().max() < 1e-14  # measured 3.3e-16
    # What the bounds catch: the top-k probabilities kept without renormalising.
    kept, _ = route(logits, dataclasses.replace(cfg, moe_router_pre_softmax=True))
    assert (kept - theirs).abs().max() > 0.05


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_mixtral_loads_and_writes_back_exactly(tmp_path, variant):
    hf = saved_mixtral(tmp_path / "hf", **VARIANTS[variant])
    ours = GPT.from_hf(str(tmp_path / "hf")).eval()
    k = VARIANTS[variant].get("num_experts_per_tok", 2)
    assert (ours.cfg.num_experts, ours.cfg.moe_router_topk, ours.cfg.bias) == (4, k, False)
    if "sliding_window" in VARIANTS[variant]:
        assert ours.cfg.window_size == (7, 0)  # the token and 7 before it, in every layer
    x = tokens(1)
    with torch.no_grad():
        assert relative_error(ours(x), hf(x).logits) < BOUND
    ours.save_hf(str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["architectures"] == ["MixtralForCausalLM"]
    assert written["sliding_window"] == VARIANTS[variant].get("sliding_window")
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    original = hf.state_dict()
    assert back.keys() == original.keys()
    for name, value in back.items():
        assert torch.equal(value, original[name]), name


def rewritten(src, dst, change) -> str:
    """A copy of the Mixtral directory ``src`` whose tensors ``change`` edits in place."""
    dst.mkdir()
    tensors = safetensors.load_file(str(src / "model.safetensors"))
    change(tensors)
    safetensors.save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return str(dst)


def swap(tensors: dict, a: str, b: str) -> None:
    tensors[a], tensors[b] = tensors[b], tensors[a]


def swap_experts(tensors: dict, g: str, weights: tuple, router_too: bool) -> None:
    """Experts 0 and 1 of the MoE block ``g`` (its prefix) of four swapped, each of their
    ``weights``; with ``router_too`` their router rows as well."""
    for w in weights:
        swap(tensors, f"{g}experts.0.{w}.weight", f"{g}experts.1.{w}.weight")
    if router_too:  # the same network: router row e picks expert e
        tensors[g + "gate.weight"] = tensors[g + "gate.weight"][[1, 0, 2, 3]]


def _experts(tensors: dict, router_too: bool) -> None:
    swap_experts(tensors, "model.layers.0.block_sparse_moe.", ("w1", "w2", "w3"), router_too)


SABOTAGE = {
    "w1-w3-swapped": lambda t: swap(t, *(f"model.layers.1.block_sparse_moe.experts.2.{w}.weight"
                                          for w in ("w1", "w3"))),
    "experts-permuted": lambda t: _experts(t, router_too=False),
}  # fmt: skip


@pytest.mark.parametrize("sabotage", list(SABOTAGE))
def test_a_wrong_expert_mapping_fails_the_logit_bound(tmp_path, sabotage):
    """The files read as if megart mapped w1/w3 or the experts wrongly: the logits leave the
    bound the tests above hold; the experts permuted with their router rows stay within it."""
    hf = saved_mixtral(tmp_path / "hf")
    x = tokens(2)
    with torch.no_grad():
        expected = hf(x).logits
        wrong = GPT.from_hf(rewritten(tmp_path / "hf", tmp_path / "bad", SABOTAGE[sabotage]))
        assert relative_error(wrong.eval()(x), expected) > 100 * BOUND
        same = rewritten(tmp_path / "hf", tmp_path / "same", lambda t: _experts(t, True))
        assert relative_error(GPT.from_hf(same).eval()(x), expected) < BOUND


def test_a_megart_moe_model_is_written_as_a_mixtral(tmp_path):
    # Experts 40 wide where the (unused) dense width is 48; tied; a window in every layer.
    cfg = moe(moe_ffn_hidden_size=40, window_size=(5, 0), num_query_groups=2)
    model = randomized(GPT(cfg), seed=3)
    model.save_hf(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["model_type"], written["intermediate_size"]) == ("mixtral", 40)
    assert (written["num_local_experts"], written["sliding_window"]) == (4, 6)
    x = tokens(4, 16) % 100
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = model(x)
        assert relative_error(hf(x).logits, expected) < BOUND
    back = GPT.from_hf(str(tmp_path))
    assert back.cfg.moe_ffn_size == 40
    for name, p in back.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name


def test_a_pp2_moe_checkpoint_exports_as_the_mixtral_its_ranks_trained(tmp_path):
    flags = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 disable_bias_linear=True, num_experts=4, moe_ffn_hidden_size=24,
                 moe_aux_loss_coeff=0.01, untie_embeddings_and_output_weights=True)  # fmt: skip
    kw = dict(save=str(tmp_path / "ckpt"), train_iters=2, pipeline_model_parallel_size=2, **flags)
    weights = {}
    for rank in launch(tw.weights_after_training, 2, kw, timeout=300):
        weights.update(rank)
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    back = dict(GPT.from_hf(str(out)).named_parameters())
    assert back.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(back[name].detach()[: value.shape[0]], value), name
    x = tokens(5, 16)
    hf = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert relative_error(hf(x).logits, GPT.from_hf(str(out)).eval()(x)) < BOUND


def test_import_hf_prints_the_moe_flags_and_pp2_fine_tunes_from_them(tmp_path, capsys):
    hf = saved_mixtral(tmp_path / "hf", num_experts_per_tok=3)
    flags = imported_at_pp2(tmp_path / "hf", tmp_path / "ckpt", capsys)
    for flag in ("--num-experts", "--moe-router-topk", "--disable-bias-linear", "--swiglu"):
        assert flag in flags, flag
    # Measured: the first loss 6.5e-8 relative from transformers'.
    model = assert_fine_tunes_at_pp2(flags, tmp_path / "ckpt", tmp_path / "hf", hf)
    assert (model["num_experts"], model["moe_router_topk"]) == (4, 3)


def imported_at_pp2(hf_dir, ckpt, capsys) -> list[str]:
    """import-hf of the MoE model in ``hf_dir`` at tp2 (the experts split over tensor
    parallelism too; megart train then needs --sequence-parallel) and, into ``ckpt``, at pp2,
    the two the same whole weights: the model's flags it prints (a shell line, so split as the
    shell would)."""
    argv = ["import-hf", "--input", str(hf_dir), "--save", str(ckpt)]
    tp2 = ckpt.parent / f"{ckpt.name}-tp2"
    split_argv = ["import-hf", "--input", str(hf_dir), "--save", str(tp2)]
    assert megart_main([*split_argv, "--target-tensor-parallel-size", "2"]) == 0
    capsys.readouterr()
    assert megart_main([*argv, "--target-pipeline-parallel-size", "2"]) == 0
    split, staged = (mckw.checkpoint_gpt(str(d))[1] for d in (tp2, ckpt))
    assert split.keys() == staged.keys() and any(".mlp.experts." in n for n in split)
    assert all(torch.equal(split[n], staged[n]) for n in split)
    flags = shlex.split(capsys.readouterr().out.split(f"or with --load {ckpt} ")[1])
    # The aux loss is the run's choice (training.import_hf.moe_flags says why).
    assert "--moe-aux-loss-coeff" not in flags
    return flags


def assert_fine_tunes_at_pp2(flags: list[str], ckpt, hf_dir, hf: object) -> dict:
    """Two pp2 ranks train from ``ckpt`` with the printed ``flags``: assert_fine_tunes (the
    first loss transformers' on the same batch within 1e-5, the second lower); returns the
    model's TrainConfig fields the flags set."""
    model = {
        k: v
        for k, v in dataclasses.asdict(train_config(flags)).items()
        if v != getattr(TrainConfig(), k)
    }
    kw = dict(model, load=str(ckpt), train_iters=2, lr_warmup_iters=0, seq_length=16)
    kw.update(pipeline_model_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0)
    assert_fine_tunes(launch(tw.loaded_and_first_step, 2, kw, timeout=300), hf_dir, hf)
    return model


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(moe_ffn_hidden_size=24, moe_router_topk=3),
        dict(moe_layer_freq=2, moe_router_pre_softmax=True),
        dict(moe_layer_freq=(0, 1), moe_router_score_function="sigmoid", moe_router_topk=1),
        dict(moe_router_topk_scaling_factor=2.5),
    ],
)
def test_train_flags_build_the_moe_model_they_were_printed_for(changes):
    cfg = moe(**changes)
    built = train_config(train_flags(cfg)).gpt_config()
    fields = ["num_experts", "moe_ffn_size", "moe_layer_freq", "moe_router_topk",
              "moe_router_pre_softmax", "moe_router_score_function",
              "moe_router_topk_scaling_factor", "bias", "ffn_size"]  # fmt: skip
    assert [getattr(built, f) for f in fields] == [getattr(cfg, f) for f in fields]


def test_train_flags_of_a_dense_model_name_no_experts():
    printed = train_flags(moe(num_experts=None))
    assert not [f for f in printed if f.startswith(("--num-experts", "--moe-"))]


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(moe_layer_freq=2), "--moe-layer-freq 2 (Mixtral has no dense MLP layers"),
        (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax (Mixtral divides"),
        (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
        (dict(moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling-factor 2.0"),
        (dict(window_size=(3, 0), window_attn_skip_freq=(1, 0)), "Mixtral's sliding window"),
    ],
)
def test_a_megart_model_mixtral_cannot_represent_is_refused_naming_the_flag(
    tmp_path, changes, named
):
    for expect in (None, "mixtral"):  # every format refuses it; Mixtral says why
        with pytest.raises(ConfigError) as e:
            GPT(moe(**changes)).save_hf(str(tmp_path), expect=expect)
        assert named in str(e.value)
    assert not (tmp_path / "config.json").exists()


def test_a_moe_model_with_query_key_norms_is_a_qwen3_moe_not_a_mixtral(tmp_path):
    with pytest.raises(ConfigError, match="Mixtral checkpoint cannot represent --qk-layernorm"):
        GPT(moe(qk_layernorm=True)).save_hf(str(tmp_path), expect="mixtral")
    GPT(moe(qk_layernorm=True)).save_hf(str(tmp_path))  # tests/test_hf_qwen3_moe.py checks it
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"


@pytest.mark.parametrize(
    "fmt, changes",
    [("llama", {}), ("mistral", dict(window_size=(3, 0))), ("qwen3", dict(qk_layernorm=True)),
     ("qwen2", dict(add_qkv_bias=True))],
)  # fmt: skip
def test_the_dense_formats_refuse_experts_by_name(tmp_path, fmt, changes):
    with pytest.raises(ConfigError, match="checkpoint cannot represent --num-experts 4"):
        GPT(moe(**changes)).save_hf(str(tmp_path), expect=fmt)


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(num_experts_per_tok=1), "num_experts_per_tok 1, which megart's GPT cannot"),
        (dict(hidden_act="gelu"), "this Mixtral has hidden_act 'gelu'"),
        (dict(sliding_window=0), "this Mixtral has sliding_window 0"),
    ],
)
def test_mixtrals_megart_cannot_represent_are_refused_naming_what(tmp_path, changes, named):
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**HF_TINY)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ConfigError, match=named):
        GPT.from_hf(str(tmp_path))
