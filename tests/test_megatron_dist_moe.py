"""Megatron-LM's distributed checkpoint (--ckpt-format torch_dist) of megart's mixture-of-experts
models, against Megatron-Core 0.16.1's own MoE GPTModel and dist_checkpointing: its sharded
keys (the experts numbered globally as one more sharded dimension; each layer its own key where
--moe-layer-freq mixes dense and MoE layers), a converted store loaded by Megatron-Core at pp1
and pp2 with megart's logits, Megatron-Core's own saves read by megart with its logits, and
megart train's stores (with and without --use-distributed-optimizer) resumed on the curve
holding exactly what was saved, and loaded by Megatron-Core's model and optimizer holding
megart's state. Bound 1e-6 on logits: Megatron-Core's softmax over experts rounds to fp32."""

import dataclasses
import re

import pytest
import torch

import train_workers as tw
from megart.cli.main import main
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import to_megatron
from megart.training.checkpoint import iteration_dir, model_config
from megart.training.megatron_checkpoint import read_megatron
from megart.training.megatron_dist import extra_states, layer_names, read_common, sharded_keys
from megart.training.megatron_dist_keys import layer_key, per_layer_keys
from test_megatron_dist_ckpt import _logits, _megart_checkpoint, _to_dist
from test_megatron_dist_save import MOMENTS, _megatron_wholes

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

BASE = dict(vocab_size=100, seq_length=8, hidden_size=16, num_layers=4, num_attention_heads=4,
            bias=False, num_experts=3, moe_ffn_hidden_size=24)  # fmt: skip
MODELS = {
    # Every layer MoE (--moe-layer-freq 1): one key per part, [layer, expert, ...]; SwiGLU's
    # fc1 each expert's [gate; up]; Llama-style around it.
    "swiglu-every-layer": dict(activation="swiglu", normalization="rmsnorm",
                               position_embedding="rotary", num_query_groups=2,
                               untie_embeddings_and_output_weights=True),
    # A 0/1 pattern: each layer its own key, dense MLPs between, sigmoid scores scaled.
    "gelu-pattern": dict(moe_layer_freq=(1, 0, 1, 1), moe_router_score_function="sigmoid",
                         moe_router_topk_scaling_factor=2.0, moe_router_dtype="fp32"),
    # Every second layer, top-1 pre-softmax, SwiGLU.
    "swiglu-freq2": dict(activation="swiglu", moe_layer_freq=2, moe_router_topk=1,
                         moe_router_pre_softmax=True),
}  # fmt: skip
LOGITS = 1e-6


def _cfg(name: str) -> GPTConfig:
    return GPTConfig(**BASE, **MODELS[name])


def _tokens(cfg: GPTConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                         generator=torch.Generator().manual_seed(5))  # fmt: skip


def megatron_core_keys(configs: list[GPTConfig]) -> list[dict]:
    """Per config, in one launched process: Megatron-Core's MoE GPTModel's sharded state dict
    as Megatron-LM asks for it (its metadata: singleton_local_shards False), its tensors'
    keys with global shape and each parameter's global offset, and its objects' unique keys."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    import megatron_dist_save_workers as w
    from megatron_core_workers import megatron_model

    out = []
    for cfg in configs:
        model = megatron_model(cfg)
        shapes, offsets, objects = {}, {}, set()
        metadata = {"singleton_local_shards": False}
        for name, sharded in model.sharded_state_dict(metadata=metadata).items():
            if isinstance(sharded, ShardedObject):
                objects.add(sharded.unique_key)
                continue
            for piece in w._pieces(sharded):
                shapes[piece.key] = tuple(piece.global_shape)
                offsets.setdefault(name, []).append(tuple(piece.global_offset))
        out.append(dict(shapes=shapes, offsets=offsets, objects=objects))
    return out


def test_megarts_keys_are_megatron_cores():
    """The store's keys megart writes for each model (sharded_keys of its whole state dict)
    are the keys, global shapes and per-parameter offsets Megatron-Core's MoE GPTModel asks
    for, its extra states' objects too; and layer_names inverts sharded_keys."""
    cfgs = [_cfg(name) for name in MODELS]
    theirs = launch(megatron_core_keys, 1, cfgs, timeout=300)[0]
    for name, cfg, their in zip(MODELS, cfgs, theirs, strict=True):
        assert_keys_are(their, cfg, name)
    assert not per_layer_keys(cfgs[0]) and per_layer_keys(cfgs[1]) and per_layer_keys(cfgs[2])
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in theirs[0]["shapes"]
    assert theirs[0]["shapes"]["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (
        4, 3, 48, 16)  # fmt: skip
    assert "decoder.layers.1.mlp.linear_fc2.weight" in theirs[1]["shapes"]  # a dense layer


def assert_keys_are(their: dict, cfg: GPTConfig, name: str) -> None:
    """The store megart writes for ``cfg`` (sharded_keys of its whole state dict) has the keys,
    global shapes, per-parameter offsets and extra states' objects of Megatron-Core's model
    (``their``: megatron_core_keys'); layer_names inverts sharded_keys."""
    model = {k: torch.randn_like(v) for k, v in to_megatron(GPT(cfg).state_dict(), cfg).items()}
    model["embedding.word_embeddings.weight"] = torch.randn(128, 16)  # Megatron's padding
    if cfg.untie_embeddings_and_output_weights:
        model["output_layer.weight"] = torch.randn(128, 16)
    stored = sharded_keys(model, cfg)
    assert {k: tuple(v.shape) for k, v in stored.items()} == their["shapes"], name
    # Each layer's (and expert's) tensor at Megatron-Core's offsets in its key.
    for megatron, offsets in their["offsets"].items():
        match = re.match(r"decoder\.layers\.(\d+)\.(.+)$", megatron)
        if match:
            leading = layer_key(int(match.group(1)), match.group(2), cfg)[1]
            assert {o[: len(leading)] for o in offsets} == {tuple(i for i, _ in leading)}
    e2 = "decoder.layers.2.mlp.experts.local_experts.2.linear_fc2.weight"
    assert their["offsets"][e2] == [(2, 0, 0) if per_layer_keys(cfg) else (2, 2, 0, 0)]
    n, output = cfg.num_layers, cfg.untie_embeddings_and_output_weights
    # GPTModel drops its output layer's extra state from what it asks for (older stores
    # lack it); megart's dense stores have always carried it, unasked.
    objects = set(extra_states(range(n), cfg, output)) - {"output_layer._extra_state/shard_0_1"}
    assert objects == their["objects"], name
    back = layer_names(stored)
    fused = {k.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
              .replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"): v
             for k, v in model.items()}  # fmt: skip
    assert back.keys() == fused.keys()
    assert all(torch.equal(back[k], v) for k, v in fused.items())


@pytest.mark.parametrize("name,pp", [("swiglu-every-layer", 1), ("gelu-pattern", 2),
                                     ("swiglu-freq2", 1), ("swiglu-every-layer", 2)])  # fmt: skip
def test_megatron_core_loads_what_megart_writes(tmp_path, name, pp):
    """convert-checkpoint --to megatron --ckpt-format torch_dist of a megart MoE checkpoint:
    Megatron-Core's MoE GPTModel on pp ranks loads it through dist_checkpointing (every key it
    asks for there) strictly and computes megart's logits."""
    import megatron_dist_workers as mdw

    cfg = _cfg(name)
    weights = _megart_checkpoint(cfg, tmp_path / "megart")
    _to_dist(tmp_path / "megart", tmp_path / "dist")
    want = _logits(cfg, weights)
    results = launch(mdw.load_and_run, pp, str(tmp_path / "dist"), _tokens(cfg), 1, pp,
                     timeout=300)  # fmt: skip
    (got,) = [r for r in results if r is not None]
    assert want.abs().max().item() > 0.1
    assert (got[..., : cfg.vocab_size] - want).abs().max().item() < LOGITS


@pytest.mark.parametrize("name,pp", [("swiglu-every-layer", 2), ("gelu-pattern", 1),
                                     ("swiglu-freq2", 2)])  # fmt: skip
def test_megart_reads_what_megatron_core_saves(tmp_path, name, pp):
    """Megatron-Core's MoE GPTModel on pp ranks saves its own weights (each rank its layers'
    experts and extra states); megart reads the store whole (convert-checkpoint's reader) and
    its GPT computes Megatron-Core's logits."""
    import megatron_dist_workers as mdw

    cfg = _cfg(name)
    kw = {**BASE, **MODELS[name]}
    results = launch(mdw.save_megatron, pp, kw, str(tmp_path / "dist"), 1, pp, _tokens(cfg),
                     timeout=300)  # fmt: skip
    theirs = next(r["logits"] for r in results if r["logits"] is not None)
    read_cfg, model, iteration = read_megatron(tmp_path / "dist")
    assert iteration == 3 and read_cfg.ffn_size == cfg.ffn_size  # Megatron's args name 4h
    assert dataclasses.replace(read_cfg, ffn_hidden_size=None) == cfg
    got = mdw.megart_logits(cfg, model, _tokens(cfg))
    assert got.abs().max().item() > 0.1
    assert (got - theirs[..., : cfg.vocab_size]).abs().max().item() < LOGITS


# megart train's MoE flags (TrainConfig's names) on its tiny GPT: the load-balancing and z
# losses on, so that the router's gradients depend on them.
EXPERTS = dict(num_experts=4, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.01,
               moe_z_loss_coeff=0.001, disable_bias_linear=True)  # fmt: skip
SWIGLU = dict(EXPERTS, swiglu=True, normalization="RMSNorm", position_embedding_type="rope")
PATTERN = dict(EXPERTS, moe_layer_freq="[1,0,1,1]", moe_router_dtype="fp32")
REL = 5e-6  # a layout change reorders sums (test_megatron_dist_save's REL)
SAVE = dict(ckpt_format="torch_dist")
DISTOPT = dict(SAVE, use_distributed_optimizer=True)
SCENARIOS = {  # name: (saving ranks, flags), (resuming ranks, flags), tolerance
    # pp2 (each stage its layers' experts) to one rank; a dense layer between MoE layers.
    "pattern-pp2-to-pp1": ((2, dict(PATTERN, **SAVE, pipeline_model_parallel_size=2)),
                           (1, PATTERN), dict(rel=REL, abs=0)),
    # The same layout: the random streams come back too.
    "swiglu-pp2": ((2, dict(SWIGLU, **SAVE, pipeline_model_parallel_size=2)),
                   (2, dict(SWIGLU, pipeline_model_parallel_size=2)), tw.SAME_RUN),
    # The distributed optimizer's buckets (experts among the dense parameters at expert
    # parallelism 1), dp2 to dp1 with it, and pp2 to pp1 (megart's reshard index).
    "distopt-swiglu-dp2-to-dp1": ((2, dict(SWIGLU, **DISTOPT)),
                                  (1, dict(SWIGLU, use_distributed_optimizer=True)),
                                  dict(rel=REL, abs=0)),
    "distopt-pattern-pp2-to-pp1": ((2, dict(PATTERN, **DISTOPT, pipeline_model_parallel_size=2)),
                                   (1, PATTERN), dict(rel=REL, abs=0)),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return scenario_runs(SCENARIOS, tmp_path_factory)


def scenario_runs(scenarios: dict, tmp_path_factory) -> dict:
    """Per scenario (SCENARIOS' form): the uninterrupted 4 iterations, the store after 2, what
    the saving ranks held then, and the run resumed from the store."""
    out = {}
    for name, ((n_save, save), (n_run, run), _) in scenarios.items():
        store = tmp_path_factory.mktemp(name) / "ckpt"
        plain = {k: v for k, v in save.items() if k not in DISTOPT}
        straight = tw.holding(n_save, dict(plain, train_iters=4))[0]["history"]
        trained, resumed = tw.saved_and_resumed(n_save, save, n_run, run, store)
        out[name] = straight, store, trained, resumed
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_continues_the_curve_holding_exactly_what_was_saved(runs, name):
    straight, _, trained, resumed = runs[name]
    tw.assert_resumed_on_curve(straight, resumed, **SCENARIOS[name][2])
    loaded = tw.assert_holds(trained, resumed)
    assert all(rank["steps"] == {2.0} for rank in loaded)


def test_megatron_core_loads_megarts_train_store_and_holds_its_state(runs):
    """Megatron-Core's MoE GPTModel and FP32Optimizer on the saving layout (pp2) load megart
    train's store (Megatron-LM's default strictness): each piece it holds, placed by its own
    sharded tensors (the experts' by layer and expert), equals megart's weights and Adam
    moments bitwise; its step is megart's."""
    import megatron_dist_save_workers as w

    name = "pattern-pp2-to-pp1"
    _, store, trained, _ = runs[name]
    flags = SCENARIOS[name][0][1]
    cfg = model_config({"model_config": read_common(iteration_dir(store, 2))["megart"]
                        ["model_config"]})  # fmt: skip
    assert cfg.num_experts == 4
    results = launch(w.megatron_loads, 2, str(store), 1, 2, flags, timeout=300)
    seen = assert_megatron_core_holds(results, trained, cfg, 1)
    assert "decoder.layers.2.mlp.experts.experts.linear_fc1.weight" in seen


def assert_megatron_core_holds(results: list, trained: list, cfg: GPTConfig, tp: int) -> set:
    """Each piece Megatron-Core's ranks hold after loading a store (``results``: the ranks'
    megatron_loads), placed by its own sharded tensors, equals what megart's saving ranks held
    (``trained``), weights and Adam moments bitwise, and they hold every key; its step is 2.
    Returns the keys held."""
    for what, key in (("model", "weights"), ("main", "weights"), *((m, m) for m in MOMENTS)):
        want = _megatron_wholes(trained, key, cfg, tp)
        seen = set()
        for rank in results:
            for name_, offset, axes, data in rank["held"][what]:
                index = tuple(offset[:axes]) + tuple(
                    slice(o, o + s) for o, s in zip(offset[axes:], data.shape, strict=True)
                )
                assert torch.equal(data, want[name_][index]), (what, name_, offset)
                seen.add(name_)
        assert seen == set(want), what
    assert all(rank["steps"] == {2.0} for rank in results)
    return seen


def test_train_and_convert_take_experts_in_torch_dist(tmp_path):
    """megart train's command line (once refused by name with --num-experts) saves an MoE run
    in torch_dist and resumes it; convert-checkpoint writes its weights as a torch_dist store
    and reads them back exactly (a megart checkpoint again)."""
    import megatron_workers as mw
    from test_megatron_moe_ckpt import EXPERTS as MOE_FLAGS
    from test_megatron_moe_ckpt import FLAGS

    store = tmp_path / "dist"
    argv = [*FLAGS, *MOE_FLAGS, "--ckpt-format", "torch_dist", "--train-iters", "2"]
    status, out = launch(mw.run_cli, 1, [*argv, "--exit-interval", "1", "--save", str(store)],
                         timeout=300)[0]  # fmt: skip
    assert status == 0, out
    status, out = launch(mw.run_cli, 1, [*argv, "--load", str(store)], timeout=300)[0]
    assert status == 0 and "| loss " in out, out
    root = iteration_dir(store, 1)
    assert read_common(root)["args"].num_experts == 4
    cfg, weights, _ = read_megatron(store)
    assert cfg.num_experts == 4 and per_layer_keys(cfg)  # --moe-layer-freq 2
    back, again = tmp_path / "back", tmp_path / "again"
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load",
                 str(store), "--save", str(back)]) == 0  # fmt: skip
    _to_dist(back, again)
    _, twice, _ = read_megatron(again)
    assert twice.keys() == weights.keys()
    assert all(torch.equal(twice[k], v) for k, v in weights.items())
    assert any(".mlp.experts.local_experts.3.linear_fc1." in k for k in twice)


def test_a_store_of_singleton_local_shards_is_refused_by_name(tmp_path):
    cfg = _cfg("swiglu-every-layer")
    _megart_checkpoint(cfg, tmp_path / "megart")
    _to_dist(tmp_path / "megart", tmp_path / "dist")
    root = iteration_dir(tmp_path / "dist", 0)
    read_common(root)  # Megatron-LM's default keys: read
    common = torch.load(root / "common.pt", weights_only=False)
    common["content_metadata"] = {"singleton_local_shards": True}
    torch.save(common, root / "common.pt")
    with pytest.raises(ConfigError, match="singleton_local_shards.*megart reads Megatron-LM's"):
        read_megatron(tmp_path / "dist")
