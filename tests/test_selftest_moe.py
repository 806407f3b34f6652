"""megart selftest's mixture-of-experts check (megart.selftest.moe): the layer in fp32 and bf16
against its float64 self, output and gradients. On this machine's CPU every case passes (fp32
to some 1e-6); its prescribed logits keep every top-k choice 0.4 away from a tie; a device
whose router product is wrong fails by its routing, auxiliary losses wrong on the device fail
by the router's gradient, and an expert without tokens left without gradients fails by name.
On a GPU the same check runs on CUDA."""

import pytest
import torch

from megart.models import mlp, moe
from megart.selftest import moe as check
from megart.selftest.report import relative_error

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
CPU = torch.device("cpu")
NAMES = [f"moe {c.name} {dt}" for c in check.CASES for dt in ("float32", "bfloat16")]


def on_device_only(monkeypatch, owner, name, wrong):
    """Replaces ``owner.name`` by ``wrong(original, *args)`` where the layer runs in fp32 or
    bf16 (the device's runs), keeping the original for the float64 reference."""
    original = getattr(owner, name)

    def patched(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and tensors[0].dtype != torch.float64:
            return wrong(original, *args, **kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)


def test_every_case_passes_on_the_cpu_at_its_dtypes_tolerance():
    checks = check.check_moe(CPU)
    assert [c.name for c in checks] == NAMES
    for c in checks:
        assert c.status == "pass", c
        assert c.error < (2e-6 if "float32" in c.name else 2e-2), c
        assert ("(none to expert 3)" in c.detail) == ("without tokens" in c.name), c


def test_the_logits_are_prescribed_well_apart_and_one_expert_gets_no_token():
    for case in check.CASES:
        layer, x, dy = check.drawn(case)
        logits = layer.router(x.reshape(-1, x.shape[-1])).detach()
        ordered = logits.sort(dim=1).values
        assert (ordered[:, 1:] - ordered[:, :-1]).min() >= 0.4, case
        assert logits.abs().max() <= 1.1, case  # a sigmoid far from saturation
        loads = check.run(layer, x, dy, CPU, torch.float64).chosen.sum(dim=0)
        assert (loads[-1] == 0) == case.idle and (loads[:-1] > 0).all(), (case, loads)


def test_the_float64_run_is_the_layer_itself():
    layer, x, dy = check.drawn(check.CASES[3])  # swiglu: fc, gate, proj
    got = check.run(layer, x, dy, CPU, torch.float64)
    inp = x.clone().requires_grad_()
    out = layer.train()(inp)  # without the check's copy, buffers and fusion region
    out.backward(dy)
    assert torch.equal(got.out, out.detach())
    assert (got.grads["input"] - inp.grad).abs().max() < 1e-15
    for name, p in layer.named_parameters():
        assert (got.grads[name] - p.grad).abs().max() < 1e-15, name
    assert len(got.grads) == 1 + 1 + 4 * 3


def test_a_device_router_gone_wrong_fails_by_its_routing(monkeypatch):
    # The logits of the experts in reverse order: top-1 goes elsewhere for every token, top-2
    # where a token's two experts were not each other's mirror (0 and 3, 1 and 2).
    on_device_only(monkeypatch, moe.Router, "forward", lambda f, *a: f(*a).flip(-1))
    top2, top1 = (check.check_moe(CPU, (case,)) for case in check.CASES[:2])
    for c in top1:
        assert c.status == "fail" and c.detail.startswith("128 of 128 tokens routed unlike"), c
    for c in top2:
        n = int(c.detail.split(" of 128 tokens routed unlike float64")[0])
        assert c.status == "fail" and 64 < n < 128, c


@pytest.mark.parametrize("loss", ["load_balancing_loss", "z_loss"])
def test_an_auxiliary_loss_doubled_on_the_device_fails_its_router_gradient(monkeypatch, loss):
    on_device_only(monkeypatch, moe, loss, lambda f, *a: 2 * f(*a))
    checks = {c.name: c for c in check.check_moe(CPU)}
    assert all(checks[n].status == "fail" for n in NAMES if "float32" in n), checks
    # bf16's tolerance still sees the z-loss everywhere, the load-balancing loss where the
    # experts' loads are uneven (top-1, an idle expert): some 10% of the router's gradient.
    if loss == "z_loss":
        assert all(c.status == "fail" for c in checks.values()), checks
    for n in ("moe top-1 pre-softmax bfloat16", "moe top-2, an expert without tokens bfloat16"):
        assert checks[n].status == "fail", checks[n]


def test_an_expert_without_tokens_left_without_gradients_fails_by_name(monkeypatch):
    def skipped(f, self, x, *a, **kw):  # no token: zeros outside the graph, as a skip would
        if x.shape[0] == 0:
            return x.new_zeros(0, x.shape[-1])
        return f(self, x, *a, **kw)

    on_device_only(monkeypatch, mlp.MLP, "forward", lambda f, *a, **kw: skipped(f, *a, **kw))
    idle = check.CASES[-1]
    for c in check.check_moe(CPU, (idle,)):
        assert c.status == "fail", c
        assert c.detail.startswith("no gradient (None) for experts.3.fc.weight"), c
    # With megart train's gradient buffers the same skip leaves zeros where they were.
    layer, x, dy = check.drawn(idle)
    got = check.run(layer, x, dy, CPU, torch.float32, buffers=True)
    assert got.grads["experts.3.fc.weight"].count_nonzero() == 0


def test_the_compare_judges_output_and_every_gradient():
    layer, x, dy = check.drawn(check.CASES[0])
    want = check.run(layer, x, dy, CPU, torch.float64)
    got = check.run(layer, x, dy, CPU, torch.float32)
    err, wrong = check.compare(got, want)
    assert wrong == "" and 0 < err < 2e-6
    got.grads["experts.2.proj.weight"] = got.grads["experts.2.proj.weight"] * 1.01
    assert check.compare(got, want)[0] == pytest.approx(0.01, rel=1e-3)
    assert relative_error(got.out, want.out) < 2e-6
    # An expert without tokens: any nonzero gradient is off the reference's zeros.
    layer, x, dy = check.drawn(check.CASES[-1])
    want = check.run(layer, x, dy, CPU, torch.float64, buffers=False)
    got = check.run(layer, x, dy, CPU, torch.float32, buffers=False)
    assert want.grads["experts.3.proj.weight"].count_nonzero() == 0
    err, wrong = check.compare(got, want)
    assert wrong == "" and err < 2e-6
    got.grads["experts.3.proj.weight"][0, 0] = 1e-9
    assert check.compare(got, want)[0] > 1


@GPU
def test_the_check_passes_on_this_gpu():
    for c in check.check_moe(torch.device("cuda")):
        assert c.status == "pass", c
