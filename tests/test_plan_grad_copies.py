"""The gradient copies SC21's Megatron-LM held (plan.runtime_options.gradient_copy_bytes): fp16
gradients, the optimizer's fp32 copies of them kept from one step to the next, and torch DDP's
buckets on its p = 1 runs; and what counting them does to Table 1's recommendations."""

from __future__ import annotations

import pytest

from megart.errors import ConfigError
from megart.plan import Layout, estimate, load_profile
from megart.plan.published import TABLES, config, model_options

SC21, MCORE = TABLES
GPU = load_profile(SC21.gpu)
ROW_3_6B = SC21.rows[1]


def _sc21(layout: Layout, copies: bool = True, **options):
    kwargs = dict(model_options(SC21), fp32_grad_copies=copies, **options)
    return estimate(config(SC21, ROW_3_6B), layout, GPU, simulate=False, **kwargs)


@pytest.mark.parametrize(
    "layout,ddp,per_parameter",
    [
        # p = 1: torch DDP: fp16 gradient + its bucket copy + the fp32 copy.
        (Layout(2, 1, 32, 1, 4, False, "full", False), "single-stage", 2 + 2 + 4),
        # p > 1: local DDP: fp16 gradient + the fp32 copy.
        (Layout(2, 2, 16, 1, 4, False, "full", False), "single-stage", 2 + 4),
        # --local-ddp's sensitivity check: local DDP at p = 1 too.
        (Layout(2, 1, 32, 1, 4, False, "full", False), False, 2 + 4),
    ],
    ids=["p1-torch-ddp", "p2-local-ddp", "p1-local-ddp"],
)
def test_gradients_are_counted_per_parameter_as_megatron_lm_of_2021_held_them(
    layout, ddp, per_parameter
):
    with_copies = _sc21(layout, dp_overlap=ddp).memory
    without = _sc21(layout, copies=False, dp_overlap=ddp).memory
    # Megatron's runtime counts 2 bytes of (fp16) parameters per element: the gradients are
    # per_parameter / 2 times that with the copies, and one fp32 gradient (2x) without.
    assert with_copies["gradients"] == pytest.approx(with_copies["parameters"] * per_parameter / 2)
    assert without["gradients"] == pytest.approx(without["parameters"] * 4 / 2)
    for part in ("parameters", "optimizer", "activations"):
        assert with_copies[part] == without[part]


def test_the_copies_are_what_keep_the_36b_model_off_one_gpu_per_replica():
    # 3.6B at t = 1 (micro batch 1) holds 3.6e9 parameters a GPU: 61.3 GiB in all at 18 bytes
    # each fits an A100 80 GB's usable 71.4 GiB; 74.6 GiB at 22 (with torch DDP's buckets and the
    # fp32 copies) does not.
    t1 = Layout(1, 1, 64, 1, 1, False, "full", False)
    assert _sc21(t1, copies=False).fits
    fat = _sc21(t1)
    assert not fat.fits and fat.missing_bytes > 0


def test_only_sc21s_table_counts_them():
    assert model_options(SC21)["fp32_grad_copies"] is True
    assert model_options(MCORE)["fp32_grad_copies"] is False


@pytest.mark.parametrize(
    "options",
    [dict(runtime="megart"), dict(runtime="megatron", grad_reduce_bytes=4)],
    ids=["megart-runtime", "fp32-reduction"],
)
def test_the_copies_are_refused_where_they_describe_nothing(options):
    layout = Layout(2, 1, 32, 1, 4, False, "full", False)
    base = config(SC21, ROW_3_6B)
    with pytest.raises(ConfigError, match="fp32_grad_copies"):
        estimate(base, layout, GPU, simulate=False, fp32_grad_copies=True, **options)
