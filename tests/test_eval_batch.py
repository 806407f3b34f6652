"""Megatron-LM's --eval-global-batch-size and --eval-micro-batch-size: each evaluation batch's
samples and microbatch, by default the training ones. The validation loss is the mean
next-token loss over --eval-iters batches of that size (against the model's own loss on those
samples, one process); its microbatching, on one process, over pipeline stages (which then
send that shape) or data-parallel ranks, changes nothing; Megatron's validation and test
sample counts follow the evaluation batch; shapes that cannot run are refused by name."""

import pytest
import torch

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.models import GPT
from megart.training.data import builtin_corpus
from megart.training.megatron_blend import num_samples
from train_workers import SAME_RUN

# Two iterations of 8 samples, then the validation loss over 2 batches; no dropout, so that
# every layout evaluates the same weights alike.
BASE = dict(train_iters=2, eval_interval=2, eval_iters=2, global_batch_size=8,
            micro_batch_size=2, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip


def valid_loss(history: list[dict]) -> float:
    (loss,) = [h["valid_loss"] for h in history if "valid_loss" in h]
    return loss


def trained_and_direct(kw: dict) -> tuple[float, float]:
    """(megart train's validation loss, the one-process model's own mean loss on the same
    validation batches of --eval-global-batch-size samples)."""
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**BASE, **kw), tokens=builtin_corpus(1 << 16))
    reported = valid_loss(trainer.train(quiet=True))
    c = trainer.config
    model = GPT(trainer.model_config)
    model.chunk.load_state_dict(trainer.chunks[0].state_dict())
    size = c.eval_batch_sizes[0]
    with torch.no_grad():
        losses = [model(*trainer.valid.global_batch(c.seed, i, size)) for i in range(c.eval_iters)]
    return reported, sum(loss.item() for loss in losses) / len(losses)


def test_the_loss_is_the_models_own_on_batches_of_the_evaluation_size():
    reported, direct = launch(trained_and_direct, 1, dict(eval_global_batch_size=4), timeout=300)[0]
    assert reported == pytest.approx(direct, rel=1e-6)
    default, _ = launch(trained_and_direct, 1, {}, timeout=300)[0]
    assert default != pytest.approx(reported, rel=1e-4)  # other samples: the flag took effect


@pytest.mark.parametrize(
    "ranks,layout",
    [
        (1, dict(eval_micro_batch_size=1)),
        (1, dict(eval_micro_batch_size=4)),
        # The stages send the evaluation's microbatch shape, not the training one.
        (2, dict(pipeline_model_parallel_size=2, eval_micro_batch_size=1)),
        (2, dict(pipeline_model_parallel_size=2, eval_micro_batch_size=4)),
        (2, dict(eval_micro_batch_size=1)),  # data-parallel 2
    ],
)
def test_the_evaluation_microbatch_changes_only_the_microbatching(ranks, layout):
    want = valid_loss(launch(tw.train_kw, 1, dict(BASE), timeout=300)[0])
    histories = launch(tw.train_kw, ranks, dict(BASE, **layout), timeout=300)
    assert valid_loss(histories[-1]) == pytest.approx(want, **SAME_RUN)


def test_a_smaller_evaluation_batch_over_data_parallel_ranks():
    kw = dict(BASE, eval_global_batch_size=4, eval_micro_batch_size=1)
    want = valid_loss(launch(tw.train_kw, 1, kw, timeout=300)[0])
    for history in launch(tw.train_kw, 2, kw, timeout=300):
        assert valid_loss(history) == pytest.approx(want, **SAME_RUN)


def test_megatrons_validation_and_test_samples_count_the_evaluation_batch():
    c = tw.tiny(**dict(BASE, train_iters=10, eval_interval=4, eval_global_batch_size=12))
    # Megatron's get_train_valid_test_num_samples: 10 // 4 + 1 = 3 evaluations of 2 batches.
    assert num_samples(c) == (10 * 8, 3 * 2 * 12, 2 * 12)


@pytest.mark.parametrize(
    "kw,world,message",
    [
        (dict(eval_global_batch_size=6, eval_micro_batch_size=4), 1,
         "the evaluation batch is not divisible by its microbatch x data-parallel size 1 = 4"),
        (dict(eval_global_batch_size=6), 2, "microbatch x data-parallel size 2 = 4"),
        (dict(eval_micro_batch_size=0), 1, "must be at least 1"),
        (dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-v", num_layers=4,
              eval_global_batch_size=2, eval_micro_batch_size=1), 2,
         "make 2 microbatches per data-parallel rank; --pipeline-schedule zb-v runs "
         "evaluation's forwards on at least 2 x pipeline size = 4"),
        (dict(pipeline_model_parallel_size=2, num_layers=4,
              num_layers_per_virtual_pipeline_stage=1, eval_global_batch_size=3,
              eval_micro_batch_size=1), 2, "on a multiple of the pipeline size 2"),
    ],
)  # fmt: skip
def test_evaluation_batches_that_cannot_run_are_refused_by_name(kw, world, message):
    with pytest.raises(ConfigError, match=message):
        tw.tiny(**dict(BASE, **kw)).check(world)
