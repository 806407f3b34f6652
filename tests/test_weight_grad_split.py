"""The split linear backward of the zero-bubble schedules, in one process: I returns dX only
and keeps (X, dY); W's dW and db equal an ordinary backward's; each parameter's gradient is
accumulated (and its post-accumulate hook fires) exactly once per microbatch, in W; what I
kept is freed by W; outside the store, or with autocast, the layer is F.linear's equal."""

import pytest
import torch
import torch.nn.functional as F

from megart.tensor_parallel.weight_grad import WeightGradStore, deferring, linear


def _params(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5, generator=g, dtype=dtype))
    b = torch.nn.Parameter(torch.randn(6, generator=g, dtype=dtype))
    x = torch.randn(3, 4, 5, generator=g, dtype=dtype)
    return w, b, x


def test_input_grad_then_weight_grad_equals_one_backward_and_hooks_fire_once_in_w():
    w, b, x = _params()
    ref_x = x.clone().requires_grad_()
    F.linear(ref_x, w, b).tanh().sum().backward()
    ref = (ref_x.grad, w.grad.clone(), b.grad.clone())
    w.grad = b.grad = None

    fired = []
    for p in (w, b):
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    store = WeightGradStore()
    xi = x.clone().requires_grad_()
    with deferring(store):
        y = linear(xi, w, b).tanh().sum()
        with store.input_grad("mb0"):
            y.backward()
    # I: the input gradient only; no parameter touched, its hooks silent; one layer kept.
    torch.testing.assert_close(xi.grad, ref[0], rtol=0, atol=1e-14)
    assert w.grad is None and b.grad is None and fired == []
    assert store.pending("mb0") == 1 and store.deferred == 1
    store.weight_grad("mb0")
    torch.testing.assert_close(w.grad, ref[1], rtol=0, atol=1e-13)
    torch.testing.assert_close(b.grad, ref[2], rtol=0, atol=1e-13)
    assert len(fired) == 2 and len(store) == 0  # once each; nothing kept after W


def test_gradients_accumulate_over_microbatches_in_place():
    w, b, x = _params()
    w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    buffer = w.grad
    store = WeightGradStore()
    with deferring(store):
        for mb in range(2):
            with store.input_grad(mb):
                linear(x.clone().requires_grad_(), w, b).sum().backward()
        for mb in range(2):
            store.weight_grad(mb)
    dy = torch.ones(12, 6, dtype=torch.float64)
    torch.testing.assert_close(w.grad, 2 * dy.t() @ x.reshape(12, 5))
    assert w.grad.data_ptr() == buffer.data_ptr()  # the data-parallel bucket's view stays


def test_a_backward_outside_an_input_grad_accumulates_at_once():
    w, b, x = _params()
    store = WeightGradStore()
    with deferring(store):
        linear(x.clone().requires_grad_(), w, b).sum().backward()
    assert len(store) == 0 and w.grad is not None and b.grad is not None


def test_an_input_without_gradient_still_leaves_the_weights_to_w():
    w, b, x = _params()
    store = WeightGradStore()
    with deferring(store):
        y = linear(x, w, b)  # x needs no gradient: the model's first layer
        with store.input_grad(0):
            y.sum().backward()
    assert w.grad is None and store.pending(0) == 1
    store.weight_grad(0)
    torch.testing.assert_close(
        w.grad, torch.ones(12, 6, dtype=torch.float64).t() @ x.reshape(12, 5)
    )


def test_outside_the_store_it_is_f_linear():
    w, b, x = _params()
    y = linear(x, w, b)
    assert y.grad_fn.name() == F.linear(x, w, b).grad_fn.name()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_computes_in_its_dtype_and_grads_keep_the_parameters_dtype(dtype):
    w, b, x = _params(torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        ref = F.linear(x, w, b)
    store = WeightGradStore()
    xi = x.clone().requires_grad_()
    with deferring(store), torch.autocast("cpu", dtype=dtype):
        y = linear(xi, w, b)
        with store.input_grad(0):
            y.float().sum().backward()
    assert y.dtype == ref.dtype == dtype
    torch.testing.assert_close(y, ref)
    store.weight_grad(0)
    assert w.grad.dtype == torch.float32 and xi.grad.dtype == torch.float32
