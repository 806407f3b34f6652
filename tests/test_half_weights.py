"""--half-weights: 16-bit weights with fp32 main weights and gradients, as Megatron-LM trains
under --bf16/--fp16 (megart.training.main_weights).

The references are independent of megart's optimizer: the gradients against a float64 copy of
the same 16-bit model, a step against torch.optim.AdamW on fp32 copies of the weights, every
parallel layout against the one-process run, a resumed run against the uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.models import GPT
from megart.tensor_parallel import VocabParallelEmbedding, weight_grad
from megart.training import checkpoint
from megart.training.config import TrainConfig

HALF = dict(bf16=True, half_weights=True)


@pytest.fixture(autouse=True)
def _one_process_world():
    """The trainers built here in the test process make a one-process world: ended after
    each test, so that none is left to a later one."""
    yield
    import megart.distributed as dist

    dist.destroy()


def _trainer(**kw):
    from megart.training.trainer import Trainer

    return Trainer(tw.tiny(**kw), tokens=tw.builtin_corpus(1 << 16))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _backward(trainer) -> None:
    c = trainer.config
    trainer._forward_backward(0, c.global_batch_size, trainer.m, 1.0)


@pytest.mark.parametrize("fusion", [True, False])
def test_gradients_are_fp32_sums_of_the_16_bit_models_own(fusion, monkeypatch):
    """After a backward over 4 microbatches each weight is bf16 with no ``.grad`` left, and its
    fp32 ``main_grad`` is the gradient of the bf16-valued model: against float64 within bf16
    compute's error (a dropped or doubled microbatch would be 25% off). With gradient
    accumulation fusion every linear layer's product is added into ``main_grad`` itself."""
    trainer = _trainer(**HALF, gradient_accumulation_fusion=fusion)
    chunk = trainer.chunks[0]
    exact = GPT(trainer.model_config).chunk
    exact.load_state_dict(chunk.state_dict())
    exact.double()
    fused_into = set()
    add_product = weight_grad._add_product

    def spy(grad, dy2, x2):
        fused_into.add(grad.data_ptr())
        add_product(grad, dy2, x2)

    monkeypatch.setattr(weight_grad, "_add_product", spy)
    _backward(trainer)
    # Every matrix but the position embedding: a layer's four, and the tied output layer's.
    products = {
        p.main_grad.data_ptr()
        for n, p in chunk.named_parameters()
        if p.dim() == 2 and n != "wpe.weight"
    }
    assert len(products) == 4 * trainer.config.num_layers + 1
    assert fused_into == (products if fusion else set())
    inputs, targets, _ = trainer._microbatches(trainer.data, 0, trainer.config.global_batch_size)
    for x, y in zip(inputs, targets, strict=True):
        (exact.loss(exact(x), y) / len(inputs)).backward()
    for (name, p), e in zip(chunk.named_parameters(), exact.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and p.grad is None, name
        assert p.main_grad.dtype == torch.float32, name
        assert _relative_error(p.main_grad, e.grad) < 2e-2, name


def test_a_16_bit_embeddings_gradient_is_summed_in_fp32():
    """A token repeated 4096 times: its row's gradient is the fp32 sum rounded once to bf16 (as
    CUDA's embedding backward sums). CPU's own bf16 embedding backward stops at 256 here."""
    table = VocabParallelEmbedding(8, 4, dtype=torch.bfloat16)
    ids = torch.zeros(4096, dtype=torch.long)
    dy = torch.rand(4096, 4, generator=torch.Generator().manual_seed(0)).bfloat16()
    table(ids).backward(dy)
    assert torch.equal(table.weight.grad[0], dy.float().sum(0).bfloat16())
    assert not table.weight.grad[1:].any()


def test_a_step_is_adamw_on_fp32_main_weights_rounded_into_the_weights():
    """One step equals torch.optim.AdamW stepping fp32 copies of the bf16 weights with the fp32
    gradients (decay on matrices only, no clipping); the weights are then those copies rounded
    to bf16, and the main weights stay fp32 (the update is mostly below bf16's resolution)."""
    trainer = _trainer(**HALF, clip_grad=0.0, weight_decay=0.1, lr_warmup_iters=0)
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    mains = [p.detach().float() for p in params]
    _backward(trainer)
    for main, p in zip(mains, params, strict=True):
        main.grad = p.main_grad.clone()
    trainer._update_weights(0)
    lr = trainer.optimizer.param_groups[0]["lr"]
    assert lr == pytest.approx(1e-3)  # the peak: no warm-up
    c = trainer.config
    reference = torch.optim.AdamW(
        [
            {"params": [m for m in mains if m.dim() >= 2], "weight_decay": c.weight_decay},
            {"params": [m for m in mains if m.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(c.adam_beta1, c.adam_beta2),
        eps=c.adam_eps,
    )
    reference.step()
    opt = trainer.optimizer
    main_of = {id(p): m for p, m in zip(opt.params, opt.mains, strict=True)}
    stepped = [main_of[id(p)] for p in params]
    assert all(m.dtype == torch.float32 for m in stepped)
    for main, got, p in zip(mains, stepped, params, strict=True):
        torch.testing.assert_close(got, main, rtol=1e-6, atol=1e-7)
        assert torch.equal(p, main.to(torch.bfloat16))
    # The fp32 main weights carry what bf16 cannot: most of them differ from their rounding.
    assert sum(not torch.equal(m, m.bfloat16().float()) for m in stepped) > len(stepped) // 2


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_per_parameter_bytes_are_megatrons():
    """2 bytes of weight, 4 of gradient, 4 of main weight and 8 of moments per parameter; with
    the distributed optimizer over dp2 the main weights and moments are halved per rank."""
    trainer = _trainer(**HALF, train_iters=1)
    trainer.train(quiet=True)
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    n = sum(p.numel() for p in params)
    assert _bytes(params) == 2 * n
    assert _bytes(p.main_grad for p in params) == 4 * n
    assert all(p.grad is None for p in params)
    assert _bytes(trainer.optimizer.mains) == 4 * n
    state = trainer.optimizer.state
    assert _bytes(s[k] for s in state.values() for k in tw.MOMENTS) == 8 * n
    per_rank = launch(_sharded_bytes, 2, {}, timeout=300)
    for got in per_rank:
        assert got["weights"] == 2 * got["n"]
        padded = got["padded"]  # each bucket padded to split evenly over the two ranks
        assert got["main"] == 4 * padded // 2
        assert got["moments"] <= 8 * padded // 2
    assert sum(got["moments"] for got in per_rank) == 8 * per_rank[0]["n"]


def _sharded_bytes(_: object) -> dict:
    trainer = _trainer(**HALF, train_iters=1, use_distributed_optimizer=True)
    trainer.train(quiet=True)
    opt = trainer.optimizer
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    inner = opt.optimizer.state
    return {
        "n": sum(p.numel() for p in params),
        "weights": _bytes(params),
        "padded": sum(b.buffer.numel() for b in opt.buckets.buckets),
        "main": _bytes(m for m in opt.main_buffers),
        "moments": _bytes(inner[piece.data][k] for piece in opt.pieces for k in tw.MOMENTS),
    }


# bf16 rounding of a weight's gradient sum differs between layouts where autograd sums two
# uses in bf16 (the tied embedding in one process) and megart sums them in fp32 (across
# stages): losses stay within 1e-4, gradient norms within 5e-3 (measured: 2e-5 and 6e-4).
LAYOUT = dict(rel=1e-4)
NORM = dict(rel=5e-3)


FP16 = dict(fp16=True, half_weights=True, loss_scale=None, initial_loss_scale=2.0**20)


@pytest.mark.parametrize(
    "precision, layout",
    [
        (HALF, dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1")),
        (HALF, dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-v")),
        (HALF, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        (HALF, dict(use_distributed_optimizer=True, overlap_param_gather=True)),
        (HALF, dict()),
        (FP16, dict(pipeline_model_parallel_size=2)),
        (FP16, dict(tensor_model_parallel_size=2, use_distributed_optimizer=True)),
    ],
    ids=["pp2-zb-h1", "pp2-zb-v", "tp2-sp", "dp2-distopt", "dp2", "fp16-pp2", "fp16-tp2-distopt"],
)
def test_every_layout_follows_the_one_process_curve(precision, layout):
    """Each 2-rank layout against the one-process run of the same precision; under fp16 the
    loss scale starts high enough to overflow, and the same steps are skipped. (fp16 layouts
    keep the one-process microbatches: data parallelism divides each rank's loss by fewer of
    them, which scales its 16-bit gradients and so where they overflow, in Megatron-LM too.)"""
    kw = dict(precision, train_iters=5)
    one = launch(tw.train_kw, 1, kw, timeout=300)[0]
    for rank in launch(tw.train_kw, 2, dict(kw, **layout), timeout=300):
        assert [h["skipped"] for h in rank] == [h["skipped"] for h in one]
        for got, want in zip(rank, one, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], **LAYOUT)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], nan_ok=True, **NORM)
    if precision is FP16:
        assert one[0]["skipped"] and not one[-1]["skipped"]


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (1, dict(ckpt_format="megart")),
        (1, dict(ckpt_format="torch")),
        (2, dict(use_distributed_optimizer=True)),
        (2, dict(use_distributed_optimizer=True, ckpt_format="torch")),
        (2, dict(use_distributed_optimizer=True, ckpt_format="torch_dist")),
    ],
    ids=["megart", "megatron-torch", "dp2-distopt", "dp2-distopt-torch", "dp2-distopt-torch-dist"],
)
def test_a_resumed_run_continues_exactly(tmp_path, nproc, layout):
    """Checkpoints hold the fp32 main weights: a run resumed after iteration 2 repeats the
    uninterrupted run's iterations 3 and 4 exactly (rounded weights alone would not)."""
    kw = dict(HALF, train_iters=4, **layout)
    straight = launch(tw.train_kw, nproc, kw, timeout=300)
    launch(tw.train_kw, nproc, dict(kw, exit_interval=2, save=str(tmp_path)), timeout=300)
    resumed = launch(tw.train_kw, nproc, dict(kw, load=str(tmp_path)), timeout=300)
    for s, r in zip(straight, resumed, strict=True):
        assert [h["iteration"] for h in r] == [3, 4]
        for a, b in zip(s[2:], r, strict=True):
            assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"]


def test_the_checkpoint_holds_the_main_weights_in_fp32(tmp_path):
    """The saved weights are the optimizer's fp32 main weights (not their bf16 rounding), so a
    run with fp32 weights (no --half-weights) loads them as they are."""
    launch(tw.train_kw, 1, dict(HALF, train_iters=2, save=str(tmp_path)), timeout=300)
    state = torch.load(
        tmp_path / "iter_0000002" / "mp_rank_00" / checkpoint.FILE, weights_only=False
    )
    weights = state["model"][0]
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())
    loaded = launch(tw.loaded_and_first_step, 1, dict(bf16=True, load=str(tmp_path)), timeout=300)
    by_place = loaded[0][0]
    assert torch.equal(by_place["chunk.wte.weight"], weights["wte.weight"][:256])


def test_half_weights_need_a_16_bit_type():
    with pytest.raises(ConfigError, match="--half-weights .* --bf16 or --fp16"):
        TrainConfig(half_weights=True).check(1)


@pytest.mark.parametrize(
    "saved, resumed, nproc",
    [
        (dict(bf16=True), HALF, 1),
        (HALF, dict(HALF, tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4),
    ],
    ids=["fp32-weights-to-half", "one-process-to-tp2-pp2"],
)
def test_a_run_resumes_with_another_flag_or_layout(tmp_path, saved, resumed, nproc):
    """A checkpoint of fp32 weights resumes under --half-weights (its weights become the main
    weights), and a --half-weights checkpoint resumes resharded to tp2 x pp2: iterations 3
    and 4 on the uninterrupted run's curve, within what the weights' rounding and the layout
    change (measured: 1.6e-5 at most; a fresh optimizer state, --no-load-optim, is 9e-4 off
    at iteration 4)."""
    kw = dict(train_iters=4)
    one = {**resumed, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    straight = launch(tw.train_kw, 1, dict(kw, **one), timeout=300)[0]
    launch(tw.train_kw, 1, dict(kw, **saved, exit_interval=2, save=str(tmp_path)), timeout=300)
    for rank in launch(tw.train_kw, nproc, dict(kw, **resumed, load=str(tmp_path)), timeout=300):
        assert [h["iteration"] for h in rank] == [3, 4]
        for got, want in zip(rank, straight[2:], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
