"""megart train --save --ckpt-format torch_dist: the whole training state in Megatron-LM's
distributed format, each rank writing its own slices. --load resumes it under another layout
on the uninterrupted loss curve; Megatron-Core's own model and optimizer load it and hold
megart's weights and Adam moments exactly; a damaged or incomplete store is a ConfigError."""

import pickle
import re
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models.megatron_names import to_megatron
from megart.models.vocab import fit_vocab
from megart.training import dist_store
from megart.training.checkpoint import iteration_dir, latest_iteration, model_config
from megart.training.megatron_dist import is_dist_checkpoint, read_common, sharded_keys
from megart.training.megatron_layout import OUTPUT, WORD
from train_workers import SAME_RUN

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

# A layout change reorders floating-point sums (see test_checkpoint_reshard: 4e-8 observed;
# fresh moments move iteration 4 by 3e-5, a misplaced shard iteration 3 by 2e-4).
REL = 5e-6
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             disable_bias_linear=True, untie_embeddings_and_output_weights=True,
             group_query_attention=True, num_query_groups=2, ffn_hidden_size=48)  # fmt: skip
PP2_LLAMA = dict(pipeline_model_parallel_size=2, bf16=True, **LLAMA, **DROPOUT)
SCENARIOS = {  # name: (saving ranks, flags), (resuming ranks, flags), tolerance
    # Another layout: the random streams stay the run's own (dropout off, as resharding).
    "tp2-to-pp2": ((2, dict(tensor_model_parallel_size=2)),
                   (2, dict(pipeline_model_parallel_size=2)), dict(rel=REL, abs=0)),
    # The same layout with dropout: the random streams come back too; bf16 reads the fp32
    # main weights (optimizer.state.fp32_param), not the bf16 model tensors. SwiGLU (fc1's
    # two halves), grouped queries, an untied output layer on the last stage.
    "llama-pp2-bf16-dropout": ((2, PP2_LLAMA), (2, PP2_LLAMA), SAME_RUN),
    # Data-parallel rank 1 writes nothing; fp16's loss scaler (a low first scale, so that
    # both iterations step) goes through common.pt as Megatron's grad_scaler.
    "dp2-fp16-to-tp2": ((2, dict(fp16=True, initial_loss_scale=1024)),
                        (2, dict(tensor_model_parallel_size=2, fp16=True,
                                 initial_loss_scale=1024)), dict(rel=REL, abs=0)),
    # Two model chunks per rank, and zb-v's V (rank 0 holds layers 0 and 3): the store holds
    # whole tensors by layer, read back by any layout.
    "interleaved-to-tp2": ((2, dict(pipeline_model_parallel_size=2,
                                    num_layers_per_virtual_pipeline_stage=1)),
                           (2, dict(tensor_model_parallel_size=2)), dict(rel=REL, abs=0)),
    "zb-v-to-tp2": ((2, dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-v")),
                    (2, dict(tensor_model_parallel_size=2)), dict(rel=REL, abs=0)),
}  # fmt: skip
MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per scenario: the uninterrupted 4-iteration curve (saving layout), the store written
    after iteration 2 (--exit-interval 2 of the same 4-iteration run, as Megatron-LM stops a
    job) and what the saving ranks held then."""
    out = {}
    for name, ((n_save, save), _, _) in SCENARIOS.items():
        store = tmp_path_factory.mktemp(name) / "ckpt"
        straight = tw.holding(n_save, dict(save, train_iters=4))[0]["history"]
        saving = tw.holding(n_save, dict(save, train_iters=4, exit_interval=2, save=str(store),
                                   ckpt_format="torch_dist"))  # fmt: skip
        out[name] = straight, store, [r["trained"] for r in saving]
    return out


@pytest.fixture(scope="module")
def runs(saved):
    """Per scenario: what ``saved`` holds and the run resumed from its store."""
    out = {}
    for name, (_, (n_run, run), _) in SCENARIOS.items():
        straight, store, trained = saved[name]
        out[name] = (
            straight,
            store,
            trained,
            tw.holding(n_run, dict(run, train_iters=4, load=str(store))),
        )
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_continues_the_uninterrupted_curve(runs, name):
    straight, _, _, resumed = runs[name]
    tw.assert_resumed_on_curve(straight, resumed, **SCENARIOS[name][2])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_holds_exactly_what_was_saved(runs, name):
    """Weights (fp32: under bf16 the main weights), both moments and the step, whatever the
    layout; the random streams where the layout is the saved one."""
    _, _, trained, resumed = runs[name]
    loaded = tw.assert_holds(trained, resumed)
    assert all(rank["steps"] == {2.0} for rank in loaded)
    if SCENARIOS[name][0] == SCENARIOS[name][1]:
        for was, now in zip(trained, loaded, strict=True):
            assert torch.equal(was["rng"][0], now["rng"][0])
            assert was["rng"][1].keys() == now["rng"][1].keys()
            assert all(torch.equal(was["rng"][1][k][0], now["rng"][1][k][0]) for k in was["rng"][1])


def test_distributed_optimizer_resumes_a_store_too(saved):
    """--use-distributed-optimizer on data-parallel 2 loads the tp2 store (each rank keeping
    its slices of the moments) and continues the curve."""
    straight, store, trained = saved["tp2-to-pp2"]
    kw = dict(train_iters=4, load=str(store), use_distributed_optimizer=True)
    resumed = tw.holding(2, kw)
    tw.assert_resumed_on_curve(straight, resumed, rel=REL, abs=0)
    tw.assert_holds(trained, resumed, MOMENTS)


def test_store_is_megatrons_layout_one_file_per_writing_rank(saved):
    store = saved["llama-pp2-bf16-dropout"][1]
    assert latest_iteration(store) == 2
    root = iteration_dir(store, 2)
    assert is_dist_checkpoint(root)
    names = sorted(p.name for p in root.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
    common = read_common(root)
    assert common["iteration"] == 2 and common["checkpoint_version"] == 3.0
    assert common["args"].ckpt_format == "torch_dist" and common["args"].bf16
    assert common["args"].consumed_train_samples == 2 * common["args"].global_batch_size
    assert common["opt_param_scheduler"]["num_steps"] == common["args"].consumed_train_samples
    # Float16OptimizerWithFloat16Params' common part: torch's state dict without its params
    # (LocalNonpersistentObject), the shared step, Megatron-Core's group keys.
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0] and all("params" not in g for g in groups)
    assert float(common["optimizer"]["optimizer"]["state"]["common_step"]) == 2.0
    meta = pickle.loads((root / ".metadata").read_bytes()).state_dict_metadata
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    assert meta[qkv].properties.dtype == torch.bfloat16
    for prefix in ("optimizer.state.fp32_param.", "optimizer.state.exp_avg.",
                   "optimizer.state.exp_avg_sq."):  # fmt: skip
        assert meta[prefix + qkv].properties.dtype == torch.float32
        assert meta[prefix + qkv].size == meta[qkv].size
    # Each stage wrote its own layers, each rank its own random states.
    assert sorted(c.offsets[0] for c in meta[qkv].chunks) == [0, 1, 2, 3]
    assert {k for k in meta if k.startswith("rng_state/")} == {
        "rng_state/shard_0.0_2.1",
        "rng_state/shard_1.0_2.1",
    }
    # The untied output layer, written by the last stage alone (one chunk).
    assert len(meta["output_layer.weight"].chunks) == 1


def test_data_parallel_rank_1_writes_nothing_and_fp16_keeps_its_grad_scaler(saved):
    root = iteration_dir(saved["dp2-fp16-to-tp2"][1], 2)
    names = sorted(p.name for p in root.iterdir())
    assert names == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    scaler = read_common(root)["optimizer"]["grad_scaler"]  # Megatron's DynamicGradScaler's
    assert set(scaler) == {"scale", "growth_tracker", "hysteresis_tracker"}
    assert float(scaler["scale"]) == 1024.0 and scaler["growth_tracker"] == 2


def _megatron_wholes(saved, key, cfg, tp):
    """What the saving ranks held of ``key`` (weights or a moment), whole, under the store's
    keys: megart's names to Megatron-Core's (megart.models.megatron_names), the vocabulary
    padded for ``tp``, the layers stacked."""
    merged = {k.removeprefix("chunk."): v for k, v in tw.merged_by_place(saved, key).items()}
    model = to_megatron(merged, cfg)
    for name in (WORD, OUTPUT):
        if name in model:
            model[name] = fit_vocab(model[name], cfg.padded_vocab_size(tp))
    return sharded_keys(model, cfg)


@pytest.mark.parametrize("name, tp, pp", [("tp2-to-pp2", 2, 1), ("llama-pp2-bf16-dropout", 1, 2)])
def test_megatron_core_loads_the_store_and_holds_megarts_state(saved, name, tp, pp):
    """Megatron-Core's GPTModel and optimizer (FP32Optimizer; with --bf16
    Float16OptimizerWithFloat16Params) on the store's layout load model and optimizer with
    Megatron-LM's default strictness; each piece it holds, placed by its own sharded tensors,
    equals megart's: fp32 main weights and moments bitwise, the bf16 model tensors as megart's
    weights rounded; its step is megart's, and it reads megart's random states for its rank."""
    import megatron_dist_save_workers as w

    _, store, trained = saved[name]
    flags = SCENARIOS[name][0][1]
    root = iteration_dir(store, 2)
    cfg = model_config({"model_config": read_common(root)["megart"]["model_config"]})
    results = launch(w.megatron_loads, tp * pp, str(store), tp, pp, flags, timeout=300)
    half = torch.bfloat16 if flags.get("bf16") else torch.float32
    checks = [("model", "weights", half), ("main", "weights", torch.float32),
              *((m, m, torch.float32) for m in MOMENTS)]  # fmt: skip
    for what, key, dtype in checks:
        want = _megatron_wholes(trained, key, cfg, tp)
        seen = set()
        for rank in results:
            for name_, offset, axes, data in rank["held"][what]:
                index = tuple(offset[:axes]) + tuple(
                    slice(o, o + s) for o, s in zip(offset[axes:], data.shape, strict=True)
                )
                assert data.dtype == dtype, (what, name_)
                assert torch.equal(data, want[name_][index].to(dtype)), (what, name_, offset)
                seen.add(name_)
        assert seen == set(want), what
    for rank in results:
        assert rank["steps"] == {2.0}
        assert torch.equal(rank["rng_torch"], trained[rank["rank"]]["rng"][0])
        assert "rng_tracker_states" in rank["rng_keys"]


def _damage_data(root):
    (root / "__1_0.distcp").unlink()


def _damage_chunk(root):
    """Drops one rank's chunk of one moment from the metadata: the store is incomplete."""
    meta = pickle.loads((root / ".metadata").read_bytes())
    key = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
    meta.state_dict_metadata[key].chunks.pop()
    (root / ".metadata").write_bytes(pickle.dumps(meta))


def _damage_common(root):
    (root / "common.pt").write_bytes(b"not a checkpoint")


DAMAGES = {
    "data-file-missing": (_damage_data, "cannot be read as a torch_dist checkpoint"),
    "chunk-missing": (_damage_chunk, "does not hold .* exactly once"),
    "common-unreadable": (_damage_common, "common.pt cannot be read"),
}


def _load_each(stores: list[str]) -> list[str | None]:
    """train_holding's load of each store in turn, in this one rank: what each raised, as a
    launch's traceback ends (``Type: message``), or None where it loaded."""
    out = []
    for store in stores:
        try:
            tw.train_holding(dict(train_iters=4, load=store))
        except Exception as e:  # the test reads which, and what it says
            out.append(f"{type(e).__name__}: {e}")
        else:
            out.append(None)
    return out


@pytest.fixture(scope="module")
def damaged(saved, tmp_path_factory):
    """Per damage: what loading the tp2 store so damaged raised. One launch loads the three
    copies (each damage was a launch of its own)."""
    stores = []
    for name, (damage, _) in DAMAGES.items():
        store = tmp_path_factory.mktemp(name) / "ckpt"
        shutil.copytree(saved["tp2-to-pp2"][1], store)
        damage(iteration_dir(store, 2))
        stores.append(str(store))
    (raised,) = launch(_load_each, 1, stores, timeout=300)
    return dict(zip(DAMAGES, raised, strict=True))


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_store_is_a_config_error(damaged, name):
    assert damaged[name] is not None, f"{name}: the damaged store loaded"
    assert re.search("ConfigError: .*" + DAMAGES[name][1], damaged[name]), damaged[name]


def _write_blocks(root, full, blocks):
    """Each block (rows, cols offsets and sizes) written by a rank of its own, then merged."""
    for rank, (r, c, h, w) in enumerate(blocks):
        slices = dist_store.Slices(full.shape)
        slices.add([r, c], full[r : r + h, c : c + w])
        dist_store.write_rank(root, rank, {"t": slices})
    return dist_store.merge(root, list(range(len(blocks))))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 3), cols=st.integers(1, 3), shift=st.booleans(), data=st.data())
def test_ranks_blocks_merge_into_one_store_and_a_misplaced_block_is_refused(
    tmp_path_factory, rows, cols, shift, data
):
    """A tensor cut in rows x cols blocks of drawn sizes, each written by its own rank, reads
    back whole through DCP; one block written one row off (a wrong offset) fails the merge."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("blocks")
    heights = data.draw(st.lists(st.integers(1, 3), min_size=rows, max_size=rows))
    widths = data.draw(st.lists(st.integers(1, 3), min_size=cols, max_size=cols))
    full = torch.randn(sum(heights), sum(widths))
    blocks = [(sum(heights[:i]), sum(widths[:j]), heights[i], widths[j])
              for i in range(rows) for j in range(cols)]  # fmt: skip
    if shift and len(blocks) > 1:
        r, c, h, w = blocks[-1]
        blocks[-1] = (r - 1, c, h, w) if r else (r + 1, c, h - 1 or 1, w)
        with pytest.raises(ConfigError, match="overlap|do not cover|outside"):
            _write_blocks(root, full, blocks)
        return
    _write_blocks(root, full, blocks)
    back = {"t": torch.zeros_like(full)}
    dcp.load(back, storage_reader=dcp.FileSystemReader(root), no_dist=True)
    assert torch.equal(back["t"], full)
    assert not list(root.glob("__*.metadata"))  # the parts are merged away
