"""zb-v's checkpoints reshard like any other: each file records the layers its chunks hold, so
a store saved under zb-v's V resumes under another layout or schedule, and one saved under
1F1B, interleaved or another size resumes under zb-v, in megart's format, Megatron's
distributed one (torch_dist) and, loaded under zb-v, Megatron's legacy one, on the
uninterrupted run's loss curve (with Adam's moments: two iterations after the resume would
leave it if they were lost or misplaced). Megatron's legacy files are not written under zb-v
(megatron_flags refuses it: they cannot hold the V); megart convert-checkpoint writes a zb-v
checkpoint in Megatron's placement, which Megatron-Core's stages run to megart's logits."""

import pytest

import train_workers as tw
from megart.launcher import launch

BASE = dict(num_layers=8, micro_batch_size=1, global_batch_size=8, train_iters=4)
ZB_V2 = dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-v")
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             untie_embeddings_and_output_weights=True)  # fmt: skip

# (ranks and flags saving, ranks and flags resuming, format)
CASES = {
    "pp2-to-zb-v": ((2, dict(pipeline_model_parallel_size=2)), (2, ZB_V2), "megart"),
    "zb-v-dp2-distopt-to-tp2": (
        (4, dict(ZB_V2, use_distributed_optimizer=True)),
        (2, dict(tensor_model_parallel_size=2)),
        "megart",
    ),
    "tp2-to-zb-v-pp4": (
        (2, dict(tensor_model_parallel_size=2)),
        (4, dict(pipeline_model_parallel_size=4, pipeline_schedule="zb-v")),
        "torch",
    ),
    "zb-v-pp4-to-interleaved": (
        (4, dict(pipeline_model_parallel_size=4, pipeline_schedule="zb-v")),
        (2, dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2)),
        "torch_dist",
    ),
}


@pytest.fixture(scope="module")
def straight():
    return {
        name: launch(tw.train_kw, 1, dict(BASE, **model), timeout=300)[0]
        for name, model in (("gpt", {}), ("llama", LLAMA))
    }


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_store_resumes_across_zb_v_on_the_uninterrupted_curve(straight, tmp_path, case, model):
    (saving, before), (resuming, after), fmt = CASES[case]
    kw = dict(BASE, **(LLAMA if model == "llama" else {}), ckpt_format=fmt)
    save = dict(kw, **before, save=str(tmp_path), save_interval=2, exit_interval=2)
    launch(tw.train_kw, saving, save, timeout=300)
    histories = launch(tw.train_kw, resuming, dict(kw, **after, load=str(tmp_path)), timeout=300)
    want = [h["loss"] for h in straight[model][2:]]
    for history in histories:
        assert [h["iteration"] for h in history] == [3, 4]
        assert [h["loss"] for h in history] == pytest.approx(want, **tw.SAME_RUN)


def test_a_zb_v_checkpoint_converts_to_megatrons_placement(tmp_path):
    """Saved under zb-v (rank 0 holding layers 0-1 and 6-7 of 8), megart's checkpoint goes
    through convert-checkpoint --to megatron into Megatron's interleaved placement (rank 0:
    layers 0-1 and 4-5): Megatron-Core's GPTModel chunks built from those files' args, run stage
    by stage (sweep_mcore_pp), give megart's float64 logits of the saved weights."""
    pytest.importorskip("megatron.core")
    import torch

    import megatron_core_ckpt_workers as mckw
    import sweep_mcore_pp
    from megart.cli.main import main

    ckpt, out = tmp_path / "ckpt", tmp_path / "megatron"
    launch(tw.train_kw, 2, dict(BASE, **ZB_V2, train_iters=2, save=str(ckpt)), timeout=300)
    write = ["convert-checkpoint", "--from", "megart", "--to", "megatron", "--load", str(ckpt)]
    assert main([*write, "--save", str(out)]) == 0
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    want = launch(mckw.checkpoint_logits, 1, str(ckpt), tokens, timeout=300)[0]
    stages = launch(sweep_mcore_pp.stage_logits, 2, str(out), tokens, timeout=300)
    assert stages[0] is None  # the last stage is rank 1's second chunk
    got = stages[1][..., : want.shape[-1]]
    assert want.abs().max() > 0.1 and (got - want).abs().max() < 1e-10
