"""Expert-parallel checkpoints as ordinary ones (training.expert_shards): a checkpoint saved under
--expert-model-parallel-size (every expert-parallel rank's file holding its experts) is merged
by the experts' global indices, so that megart train --load reshards it into another expert-
parallel size, pipeline or data-parallel layout (EP2 x dp2 and EP2 x pp2 into EP1, EP4 x dp4 and
interleaved EP2 x pp2; megart's and Megatron-LM's legacy checkpoints without expert parallelism
into EP2; with the distributed optimizer saving or resuming), holding right after load exactly
the weights and Adam moments the saving ranks held and going on on the one-process curve;
export-hf (Mixtral and Qwen3-MoE) and convert-checkpoint (Megatron-LM's legacy files, EP1)
write from it what they write from the same model's EP1 checkpoint, and the weights its ranks
trained. Experts merged at the wrong global index are caught; what cannot be merged is refused
by name (torch_dist stores at EP: tests/test_moe_ep_megatron_ckpt.py)."""

import json
import shutil

import pytest
import torch

import moe_ep_reshard_workers as rw
import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.training import expert_shards
from megart.training.shards import read_shards
from moe_ep_workers import MODEL
from train_workers import SAME_RUN

EP2 = dict(MODEL, expert_model_parallel_size=2)
EP4 = dict(MODEL, expert_model_parallel_size=4)
PP2 = dict(pipeline_model_parallel_size=2)
# name: (processes, flags) of the runs that save after iteration 2 of 4.
SAVED = {
    "ep2-dp2": (2, EP2),
    "ep2-pp2": (4, dict(EP2, **PP2)),
    "ep1": (1, MODEL),
    "ep1-megatron-legacy": (1, dict(MODEL, ckpt_format="torch")),
    "ep2-dp2-distopt": (2, dict(EP2, use_distributed_optimizer=True)),
}
# name: (the saved run, processes, flags) of the runs resumed from it.
RESUMED = {
    "ep2-dp2 into ep1": ("ep2-dp2", 1, MODEL),
    "ep2-dp2 into ep4-dp4": ("ep2-dp2", 4, EP4),
    "ep2-pp2 into ep1": ("ep2-pp2", 1, MODEL),
    "ep2-pp2 into ep4-dp4": ("ep2-pp2", 4, EP4),
    "ep2-pp2 into ep2-pp2-interleaved": (
        "ep2-pp2",
        4,
        dict(EP2, **PP2, num_layers_per_virtual_pipeline_stage=1),
    ),  # fmt: skip
    "ep1 into ep2-dp2": ("ep1", 2, EP2),
    "ep1-megatron-legacy into ep2-dp2": ("ep1-megatron-legacy", 2, EP2),
    # The distributed optimizer's files hold their experts' whole moments, as the others do.
    "ep2-dp2-distopt into ep1": ("ep2-dp2-distopt", 1, MODEL),
    "ep2-dp2-distopt into ep4-dp4-distopt": (
        "ep2-dp2-distopt",
        4,
        dict(EP4, use_distributed_optimizer=True),
    ),  # fmt: skip
    "ep2-dp2 into ep4-dp4-distopt": ("ep2-dp2", 4, dict(EP4, use_distributed_optimizer=True)),
}
LOGGED = ("loss", "grad_norm", "load_balancing_loss", "z_loss")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name: (what the saving ranks held at the save, the checkpoint directory)."""
    out = {}
    for name, (n, kw) in SAVED.items():
        store = tmp_path_factory.mktemp(name)
        saving = tw.holding(n, dict(kw, train_iters=4, exit_interval=2, save=str(store)))
        out[name] = ([r["trained"] for r in saving], store)
    return out


def _resumed(saved, name, worker=tw.train_holding):
    source, n, kw = RESUMED[name]
    trained, store = saved[source]
    return trained, launch(worker, n, dict(kw, train_iters=4, load=str(store)), timeout=300)


def _curve(history):
    return {key: [h[key] for h in history] for key in LOGGED}


def test_the_files_are_each_expert_parallel_ranks(saved):
    _, store = saved["ep2-pp2"]
    found = sorted(p.parent.name for p in (store / "iter_0000002").glob("*/*.pt"))
    assert found == ["mp_rank_00_000_000", "mp_rank_00_000_001",
                     "mp_rank_00_001_000", "mp_rank_00_001_001"]  # fmt: skip


@pytest.mark.parametrize("name", RESUMED)
def test_a_resharded_expert_parallel_checkpoint_resumes_on_the_curve(saved, moe_one_process, name):
    """Right after load, exactly the saving ranks' weights and Adam moments (each expert by
    its global index), whichever ranks hold them now; then iterations 3 and 4 of the
    one-process run: its loss, gradient norm (clipped at 1.0, below every iteration's) and
    auxiliary losses."""
    trained, resumed = _resumed(saved, name)
    tw.assert_holds(trained, resumed)
    history = resumed[-1]["history"]  # the last pipeline stage's: it has the loss
    assert [h["iteration"] for h in history] == [3, 4]
    want, got = _curve(moe_one_process[2:]), _curve(history)
    for key in LOGGED:
        assert got[key] == pytest.approx(want[key], **SAME_RUN), key


def test_experts_at_the_wrong_global_index_are_caught(saved, moe_one_process):
    """The merge with each expert-parallel rank's experts moved to the next rank's indices
    (their moments moved with them): the held experts differ from the saved ones, and the
    curve leaves the one-process one (measured: the loss 2.6e-3 and the gradient norm 1.8e-2
    off, of themselves, at iteration 3; the curve's tolerance is 1e-5)."""
    trained, resumed = _resumed(saved, "ep2-dp2 into ep1", rw.train_holding_misplaced)
    want = tw.merged_by_place(trained, "weights")
    got = tw.merged_by_place([r["loaded"] for r in resumed], "weights")
    wrong = sorted(n for n in want if not torch.equal(got[n], want[n]))
    assert wrong and all(".mlp.experts." in n for n in wrong)
    history = resumed[-1]["history"]
    for key in ("loss", "grad_norm"):
        assert [h[key] for h in history] != pytest.approx(
            [h[key] for h in moe_one_process[2:]], **SAME_RUN
        ), key


MIXTRAL = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
               disable_bias_linear=True, num_experts=4, moe_ffn_hidden_size=24,
               moe_aux_loss_coeff=0.01, untie_embeddings_and_output_weights=True)  # fmt: skip
# Layers 0 and 3 sparse: a dense layer between expert layers on either side.
QWEN3_MOE = dict(MIXTRAL, qk_layernorm=True, moe_layer_freq="[1,0,0,1]",
                 moe_router_pre_softmax=True)  # fmt: skip


def _hf_tensors(directory):
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _megatron_model(directory):
    """Every rank file's model state of a Megatron-LM legacy checkpoint, and its args."""
    out, args = {}, None
    for path in sorted(directory.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)
        args = state["args"]
        out.update({f"{path.parent.name}/{k}": v for k, v in state["model"].items()})
    return out, args


@pytest.mark.parametrize(
    "family,flags",
    [("mixtral", MIXTRAL), ("qwen3_moe", QWEN3_MOE)],
)
def test_an_expert_parallel_checkpoint_exports_and_converts_as_its_ep1_copy(
    tmp_path, family, flags
):
    """megart export-hf of an EP2 x dp2 checkpoint: the weights its ranks trained, bit for
    bit, and the very files (tensors and config.json) written from the same model saved at
    EP1 (loaded into one process and saved); megart convert-checkpoint to Megatron-LM's legacy
    files likewise, at expert-parallel size 1."""
    from megart.cli.main import main as megart_main
    from megart.models import GPT

    ep2, ep1 = tmp_path / "ep2", tmp_path / "ep1"
    kw = dict(flags, expert_model_parallel_size=2, train_iters=2, save=str(ep2))
    ranks = launch(tw.weights_after_training, 2, kw, timeout=300)
    weights = tw.merged_by_place([{"w": r} for r in ranks], "w")
    resave = dict(flags, train_iters=2, load=str(ep2), save=str(ep1))
    launch(rw.resharded_and_saved, 1, resave, timeout=300)
    out = {d.name: tmp_path / f"hf-{d.name}" for d in (ep2, ep1)}
    for d in (ep2, ep1):
        assert megart_main(["export-hf", "--load", str(d), "--output", str(out[d.name])]) == 0
    config = json.loads((out["ep2"] / "config.json").read_text())
    assert config["model_type"] == family
    assert config == json.loads((out["ep1"] / "config.json").read_text())
    a, b = _hf_tensors(out["ep2"]), _hf_tensors(out["ep1"])
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    back = GPT.from_hf(str(out["ep2"]))
    assert dict(back.named_parameters()).keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(back.get_parameter(name).detach()[: value.shape[0]], value), name
    for d in (ep2, ep1):
        to = [
            "--from",
            "megart",
            "--to",
            "megatron",
            "--save",
            str(tmp_path / f"megatron-{d.name}"),
        ]
        assert megart_main(["convert-checkpoint", *to, "--load", str(d)]) == 0
    (a, args), (b, _) = (_megatron_model(tmp_path / f"megatron-{d}") for d in ("ep2", "ep1"))
    assert args.expert_model_parallel_size == 1 and args.num_experts == 4
    assert a.keys() == b.keys() and all(_same(a[n], b[n]) for n in a)


def _same(a, b):
    """Two values of a state dict equal bit for bit (Megatron's files hold None extra states)."""
    return a is None and b is None or torch.equal(a, b)


def test_export_catches_experts_at_the_wrong_global_index(saved):
    """The same sabotage in the merge the exporters read through: its experts are not the
    ones the ranks trained."""
    from megart.training.checkpoint import model_config
    from megart.training.shards import whole_tensors

    trained, store = saved["ep2-dp2"]
    want = tw.merged_by_place(trained, "weights")
    with rw.experts_misplaced():
        shards = read_shards(store / "iter_0000002")
    whole = whole_tensors(shards, model_config(shards[0, 0]))
    wrong = sorted(n for n in want if not torch.equal(whole[n][: want[n].shape[0]], want[n]))
    assert wrong and all(".mlp.experts." in n for n in wrong)


def _copy(store, tmp_path):
    shutil.copytree(store, tmp_path / "copy")
    return tmp_path / "copy" / "iter_0000002"


def test_a_missing_expert_parallel_file_is_named(saved, tmp_path):
    root = _copy(saved["ep2-dp2"][1], tmp_path)
    shutil.rmtree(root / "mp_rank_00_001")
    with pytest.raises(
        ConfigError, match=r"x expert-parallel 2 ranks, but 1 of its 2 files .*mp_ra"
    ):
        read_shards(root)


def _file(experts, dense=True, with_optimizer=True):
    """A synthetic rank file: layer 0's dense weight (where ``dense``) and the experts given,
    each a 1-element tensor of its index; Adam states in two groups (matrices, then the rest)
    whose moments are the weights' values."""
    model = {"blocks.0.mlp.router.weight": torch.tensor([9.0])} if dense else {}
    model |= {f"blocks.0.mlp.experts.{e}.fc.weight": torch.tensor([float(e)]) for e in experts}
    model["blocks.0.ln.bias"] = torch.tensor([7.0])
    names = [k for k in model if not k.endswith("bias")] + ["blocks.0.ln.bias"]
    groups = [
        {"lr": 1.0, "params": list(range(len(names) - 1))},
        {"lr": 2.0, "params": [len(names) - 1]},
    ]
    optimizer = {
        "state": {i: {"exp_avg": model[k]} for i, k in enumerate(names)},
        "param_groups": groups,
    }
    return {
        "config": {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 1},
        "layer_ids": [[0]],
        "model": [model],
        "optimizer_params": [(0, k) for k in names] if with_optimizer else [],
        "optimizer": optimizer if with_optimizer else None,
    }


def test_the_merge_renumbers_the_optimizer_state_group_by_group():
    merged = expert_shards.merge_expert_files("ckpt", 0, [_file([0, 1]), _file([2, 3])])
    experts = [f"blocks.0.mlp.experts.{e}.fc.weight" for e in range(4)]
    names = ["blocks.0.mlp.router.weight", *experts, "blocks.0.ln.bias"]
    assert sorted(merged["model"][0]) == sorted(names)
    assert "expert_model_parallel_size" not in merged["config"]
    params = [k for _, k in merged["optimizer_params"]]
    assert params == ["blocks.0.mlp.router.weight", *experts, "blocks.0.ln.bias"]
    optim = merged["optimizer"]
    assert [g["params"] for g in optim["param_groups"]] == [[0, 1, 2, 3, 4], [5]]
    assert [g["lr"] for g in optim["param_groups"]] == [1.0, 2.0]
    for i, name in enumerate(params):
        assert torch.equal(optim["state"][i]["exp_avg"], merged["model"][0][name]), name
    no_optim = [_file([0, 1], with_optimizer=False), _file([2, 3], with_optimizer=False)]
    merged = expert_shards.merge_expert_files("ckpt", 0, no_optim)
    assert (merged["optimizer"], merged["optimizer_params"]) == (None, [])


def test_an_expert_in_two_files_is_refused():
    with pytest.raises(ConfigError, match=r"rank 1's file holds blocks.0.mlp.experts.1.fc.weight"):
        expert_shards.merge_expert_files("ckpt", 0, [_file([0, 1]), _file([1, 2])])


def test_shared_experts_are_dense_parameters():
    assert expert_shards.is_expert("blocks.3.mlp.experts.12.fc.weight")
    assert not expert_shards.is_expert("blocks.3.mlp.shared_experts.fc.weight")
    assert not expert_shards.is_expert("blocks.3.mlp.router.weight")
