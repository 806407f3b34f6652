"""--moe-use-upcycling in launched processes for tests/test_moe_upcycling.py: megart's upcycling
of a dense GPT beside Megatron-Core's upcycling_utils on the same weights, and megart train runs
upcycled from a dense checkpoint (right, or with a deliberate mistake the tests must catch)."""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import torch

# The mistakes the tests must catch, by name (see mistaken).
MISTAKES = ("slices-blocked", "experts-of-layer-0")


@contextlib.contextmanager
def mistaken(mistake: str | None):
    """megart's upcycling wrong on purpose: "slices-blocked" (expert e takes slice
    e // (E/G) of the dense MLP, the G slices in blocks instead of Megatron's e mod G),
    "experts-of-layer-0" (every layer's experts made from the first layer's MLP)."""
    from megart.training import upcycling

    if mistake is None:
        yield
        return

    def blocked(dense, router, rule, real=upcycling.upcycled_layer):  # noqa: ANN001, ANN202
        ordered = real(dense, router, rule)  # expert e < G holds slice e
        out, per = dict(ordered), rule.num_experts // rule.granularity
        for e in range(rule.num_experts):
            for k in list(out):
                if k.startswith(f"experts.{e}."):
                    out[k] = ordered[k.replace(f"experts.{e}.", f"experts.{e // per}.", 1)]
        return out

    def first_layer(moe, dense, prefix, rule, group, real=upcycling._whole_layer):  # noqa: ANN001, ANN202
        whole = real(moe, dense, prefix.replace(prefix.split(".")[1], "0", 1), rule, group)
        whole["router.weight"] = real(moe, dense, prefix, rule, group)["router.weight"]
        return whole

    patch = {
        "slices-blocked": mock.patch.object(upcycling, "upcycled_layer", blocked),
        "experts-of-layer-0": mock.patch.object(upcycling, "_whole_layer", first_layer),
    }[mistake]
    with patch:
        yield


def configs(case: dict[str, Any]) -> tuple:
    """(the MoE GPTConfig, the dense one) of a case: GPTConfig's fields of the MoE model and
    ``granularity`` (the dense MLP that many times the experts' width, as Megatron builds it)."""
    from megart.models import GPTConfig

    kw = dict(case)
    g = kw.pop("granularity")
    moe_cfg = GPTConfig(**kw)
    dense_kw = {k: v for k, v in kw.items() if not k.startswith("moe_") and k != "num_experts"}
    return moe_cfg, GPTConfig(**dict(dense_kw, ffn_hidden_size=moe_cfg.moe_ffn_size * g))


def _named_gelu(x: torch.Tensor) -> torch.Tensor:
    """megart's (GPT-2's tanh) GeLU under the name Megatron-Core's upcycling_utils reads."""
    import megatron_core_workers as mw

    return mw.tanh_gelu(x)


_named_gelu.__name__ = "gelu"


def against_megatron(cases: dict[str, dict], mistake: str | None = None) -> dict[str, dict]:
    """For each case (GPTConfig fields of the MoE model, with ``granularity``): a dense
    megart GPT's weights (noise added, float64) upcycled by Megatron-Core's
    upcycle_state_dict in its own dense and MoE GPTModels (the MoE one holding megart's
    fresh routers) and by megart's upcycling.fill; the names that differ, the largest
    difference, and the names compared."""
    from megatron.core.transformer.moe import upcycling_utils

    import megatron_core_workers as mw
    from megart.models import GPT
    from megart.models.megatron_names import to_megatron
    from megart.training import upcycling

    out = {}
    for name, case in cases.items():
        moe_cfg, dense_cfg = configs(case)
        dense = mw.drawn(GPT(dense_cfg).double())
        moe = GPT(moe_cfg).double()
        theirs_dense, theirs_moe = mw.megatron_model(dense_cfg), mw.megatron_model(moe_cfg)
        extras = ("_extra_state", "router.expert_bias")
        for model, ours, cfg in ((theirs_dense, dense, dense_cfg), (theirs_moe, moe, moe_cfg)):
            own = {k: v for k, v in model.state_dict().items() if k.endswith(extras)}
            model.load_state_dict({**to_megatron(ours.state_dict(), cfg), **own}, strict=True)
        if moe_cfg.activation == "gelu":  # its rule knows GeLU by the function's name only
            theirs_moe.config.activation_func = _named_gelu
        theirs = upcycling_utils.upcycle_state_dict([theirs_moe], [theirs_dense])["model"]
        rule = upcycling.Rule.of(moe_cfg, dense_cfg.ffn_size)
        with torch.no_grad(), mistaken(mistake):
            upcycling.fill(moe.chunk, dense.chunk, rule, None)
        mine = to_megatron(moe.state_dict(), moe_cfg)
        theirs = {k: v for k, v in theirs.items() if not k.endswith(extras)}
        assert set(mine) == set(theirs), set(mine) ^ set(theirs)
        differ = sorted(k for k in mine if not torch.equal(mine[k], theirs[k].to(mine[k].dtype)))
        worst = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
        out[name] = dict(differ=differ, worst=worst, compared=sorted(mine))
    return out


def logits_upcycled(cases: dict[str, dict]) -> dict[str, tuple[float, float]]:
    """For each case (as against_megatron's): the largest difference between the dense GPT's
    logits (float64, weights drawn) and its upcycled MoE GPT's, and the logits' scale."""
    from megart.models import GPT
    from megart.training import upcycling

    out = {}
    for name, case in cases.items():
        moe_cfg, dense_cfg = configs(case)
        torch.manual_seed(5)
        dense, moe = GPT(dense_cfg).double(), GPT(moe_cfg).double()
        with torch.no_grad():
            for p in dense.parameters():  # biases and norms off their starting values
                p.add_(torch.randn_like(p) * 0.05)
            for p in moe.parameters():  # a router that prefers some experts
                p.add_(torch.randn_like(p) * 0.5)
            upcycling.fill(
                moe.chunk, dense.chunk, upcycling.Rule.of(moe_cfg, dense_cfg.ffn_size), None
            )
            tokens = torch.randint(0, moe_cfg.vocab_size, (2, moe_cfg.seq_length))
            want, got = dense(tokens), moe(tokens)
        out[name] = ((got - want).abs().max().item(), want.abs().max().item())
    return out


def upcycled_run(kw: dict[str, Any], mistake: str | None = None) -> list[dict]:
    """megart train's history with flags ``kw`` (on every launched rank), upcycling wrong
    where ``mistake`` says (see mistaken)."""
    import train_workers as tw

    with mistaken(mistake):
        return tw.train(**kw)
