"""The pure batch helpers of core/step.py: batch size, shape keys, micro-batch slicing, loss extraction and the
merging of per-micro-batch outputs (the classes are covered by the multi-process tests)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from lightning_3d.core.step import batch_size_of, extract_loss, merge_outputs, shape_key, slice_batch

Pair = namedtuple("Pair", ["x", "y"])


# ------------------------------------------------------------------------------------ batch_size_of
def test_batch_size_of_a_tensor_and_of_containers() -> None:
    assert batch_size_of(torch.zeros(5, 3)) == 5
    assert batch_size_of((torch.zeros(4, 2), torch.zeros(4))) == 4
    assert batch_size_of({"ids": ["a", "b", "c"], "x": torch.zeros(3, 8)}) == 3
    assert batch_size_of(Pair(x=[torch.zeros(6)], y=None)) == 6


def test_batch_size_of_skips_scalars() -> None:
    assert batch_size_of({"temperature": torch.tensor(0.5), "x": torch.zeros(2, 4)}) == 2


def test_batch_size_of_without_a_batch_tensor() -> None:
    with pytest.raises(ValueError, match="could not find a tensor with a batch dimension"):
        batch_size_of({"text": ["a", "b"], "t": torch.tensor(1.0)})


# ------------------------------------------------------------------------------------ shape_key
def test_shape_key_lists_tensor_shapes_and_dtypes_in_order() -> None:
    batch = {"x": torch.zeros(4, 3), "names": ["a"] * 4, "y": torch.zeros(4, dtype=torch.long)}
    assert shape_key(batch) == (((4, 3), torch.float32), ((4,), torch.int64))


def test_shape_key_changes_with_shape_or_dtype_only() -> None:
    a = (torch.zeros(4, 3), torch.zeros(4))
    assert shape_key(a) == shape_key((torch.ones(4, 3), torch.ones(4)))
    assert shape_key(a) != shape_key((torch.zeros(2, 3), torch.zeros(2)))
    assert shape_key(a) != shape_key((torch.zeros(4, 3, dtype=torch.float64), torch.zeros(4)))


# ------------------------------------------------------------------------------------ slice_batch
def test_slice_batch_narrows_tensors_as_views() -> None:
    x = torch.arange(10).reshape(5, 2)
    part = slice_batch(x, 1, 2, 5)
    assert part.tolist() == [[2, 3], [4, 5]]
    assert part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view, no copy
    part[0, 0] = 100
    assert x[1, 0] == 100


def test_slice_batch_passes_non_batch_tensors_through() -> None:
    table = torch.arange(3)  # dim 0 is not the batch (total 5)
    scalar = torch.tensor(2.0)
    assert slice_batch(table, 0, 2, 5) is table
    assert slice_batch(scalar, 0, 2, 5) is scalar


def test_slice_batch_slices_lists_of_per_sample_items() -> None:
    assert slice_batch(["a", "b", "c", "d"], 1, 2, 4) == ["b", "c"]
    assert slice_batch([10, 11, 12, 13], 2, 2, 4) == [12, 13]
    assert slice_batch(("p", "q", "r", "s"), 0, 1, 4) == ("p",)
    assert slice_batch(["a", "b"], 0, 1, 4) == ["a", "b"]  # not per-sample: 2 items for 4 samples


def test_slice_batch_walks_dicts_and_keeps_their_type() -> None:
    batch = OrderedDict(x=torch.arange(8).reshape(4, 2), text=["w", "x", "y", "z"], lr=0.1)
    part = slice_batch(batch, 2, 2, 4)
    assert type(part) is OrderedDict and list(part) == ["x", "text", "lr"]
    assert part["x"].tolist() == [[4, 5], [6, 7]]
    assert part["text"] == ["y", "z"]
    assert part["lr"] == 0.1


def test_slice_batch_walks_namedtuples_and_tuples() -> None:
    batch = Pair(x=torch.arange(4), y=(torch.arange(4) * 10, "meta"))
    part = slice_batch(batch, 1, 3, 4)
    assert type(part) is Pair
    assert part.x.tolist() == [1, 2, 3]
    assert type(part.y) is tuple
    assert part.y[0].tolist() == [10, 20, 30] and part.y[1] == "meta"


def test_slice_batch_list_of_tensors_is_a_structure_not_samples() -> None:
    # a list of as many tensors as samples is a container (each tensor is sliced), not a list of samples
    batch = [torch.arange(3), torch.arange(3) + 10, torch.zeros(2)]
    part = slice_batch(batch, 1, 1, 3)
    assert [p.tolist() for p in part] == [[1], [11], [0.0, 0.0]]


def test_slices_of_all_micro_batches_rebuild_the_batch() -> None:
    batch = {"x": torch.randn(7, 3), "ids": [f"s{i}" for i in range(7)]}
    sizes, start, xs, ids = [3, 2, 2], 0, [], []
    for size in sizes:
        part = slice_batch(batch, start, size, 7)
        xs.append(part["x"])
        ids += part["ids"]
        start += size
    assert torch.equal(torch.cat(xs), batch["x"])
    assert ids == batch["ids"]


# ------------------------------------------------------------------------------------ extract_loss
def test_extract_loss() -> None:
    loss = torch.tensor(1.5)
    assert extract_loss(None, "training_step") is None
    assert extract_loss(loss, "training_step") is loss
    assert extract_loss({"loss": loss, "logits": torch.zeros(2)}, "training_step") is loss


@pytest.mark.parametrize(("output", "kind"), [({"logits": torch.zeros(1)}, "dict"), (1.5, "float"), ([1], "list")])
def test_extract_loss_refuses_other_outputs(output: object, kind: str) -> None:
    with pytest.raises(ValueError) as info:
        extract_loss(output, "validation_step")
    assert str(info.value) == (f"validation_step must return the loss tensor or a dict with a 'loss' key, got {kind}.")


# ------------------------------------------------------------------------------------ merge_outputs
def test_merge_outputs_empty_and_single() -> None:
    assert merge_outputs([]) is None
    only = {"a": torch.zeros(2)}
    assert merge_outputs([only]) is only


def test_merge_outputs_concatenates_tensors_on_dim0() -> None:
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 15.0).reshape(3, 3)
    assert torch.equal(merge_outputs([a, b]), torch.arange(15.0).reshape(5, 3))


def test_merge_outputs_lists_scalars() -> None:
    out = merge_outputs([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)])
    assert isinstance(out, list) and [float(v) for v in out] == [1.0, 2.0, 3.0]
    assert merge_outputs([0.5, 0.25]) == [0.5, 0.25]


def test_merge_outputs_walks_dicts() -> None:
    parts = [
        {"loss": torch.tensor(1.0), "pred": torch.tensor([1, 2])},
        {"loss": torch.tensor(2.0), "pred": torch.tensor([3])},
    ]
    out = merge_outputs(parts)
    assert list(out) == ["loss", "pred"]
    assert out["pred"].tolist() == [1, 2, 3]
    assert [float(v) for v in out["loss"]] == [1.0, 2.0]


def test_merge_outputs_walks_namedtuples_and_tuples() -> None:
    out = merge_outputs([Pair(torch.zeros(1, 2), (torch.ones(1),)), Pair(torch.ones(2, 2), (torch.zeros(2),))])
    assert type(out) is Pair
    assert out.x.tolist() == [[0, 0], [1, 1], [1, 1]]
    assert type(out.y) is tuple and out.y[0].tolist() == [1, 0, 0]


def test_merge_outputs_ragged_structures_become_a_list() -> None:
    parts = [(torch.zeros(1), torch.zeros(1)), (torch.zeros(1),)]
    assert merge_outputs(parts) == parts
    uneven = [["a", "b"], ["c"]]
    assert merge_outputs(uneven) == uneven


def test_merge_outputs_inverts_slicing() -> None:
    batch = {"x": torch.randn(6, 2), "y": (torch.arange(6), torch.randn(6, 1, 3))}
    parts = [slice_batch(batch, s, n, 6) for s, n in ((0, 2), (2, 3), (5, 1))]
    out = merge_outputs(parts)
    assert torch.equal(out["x"], batch["x"])
    assert torch.equal(out["y"][0], batch["y"][0]) and torch.equal(out["y"][1], batch["y"][1])


def test_merge_outputs_per_sample_strings_are_joined_like_the_whole_batch() -> None:
    """A step returning one string per sample (e.g. decoded predictions) merges to what the whole batch's step
    returns: the strings of every sample in order (recognised by the micro-batches' sample counts, the rule
    slice_batch uses), while a fixed-size structure such as [acc, f1] is still merged position by position."""
    parts = [{"text": ["a", "b"]}, {"text": ["c", "d"]}]
    assert merge_outputs(parts, [2, 2]) == {"text": ["a", "b", "c", "d"]}
    assert merge_outputs([["a"], ["b"], ["c"]], [1, 1, 1]) == ["a", "b", "c"]
    scores = [[torch.tensor([1.0, 2.0]), "x"], [torch.tensor([3.0, 4.0]), "y"]]  # (tensor, tag) per micro-batch
    merged = merge_outputs(scores, [2, 2])
    assert torch.equal(merged[0], torch.tensor([1.0, 2.0, 3.0, 4.0])) and merged[1] == ["x", "y"]


# ------------------------------------------------------------------ previous_grads_discarded
def _trainer(module, *, batch_idx=0, accumulate=1, callbacks=(), optimizer_cls=None, skip_backward=False):
    from types import SimpleNamespace

    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = (optimizer_cls or torch.optim.SGD)(params, lr=0.1)
    loop = SimpleNamespace(automatic_optimization=SimpleNamespace(_skip_backward=skip_backward), batch_idx=batch_idx)
    return SimpleNamespace(
        lightning_module=module,
        fit_loop=SimpleNamespace(epoch_loop=loop),
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
        optimizers=[optimizer],
    )


def test_previous_grads_are_discarded_only_where_lightning_zeroes_them_unobserved() -> None:
    """The previous step's gradients are dropped before the schedule only on the first batch of an accumulation
    window, and only when no hook or optimizer could read or keep them before Lightning's zero_grad."""
    import lightning as L

    from lightning_3d.core.step import previous_grads_discarded

    plain = L.LightningModule()
    assert previous_grads_discarded(_trainer(plain))
    assert previous_grads_discarded(_trainer(plain, batch_idx=4, accumulate=2))
    assert not previous_grads_discarded(_trainer(plain, batch_idx=3, accumulate=2))  # the window's so far
    assert not previous_grads_discarded(_trainer(plain, skip_backward=True))

    class Manual(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    class Watches(L.LightningModule):
        def on_before_zero_grad(self, optimizer) -> None:
            pass

    class KeepsGrads(L.LightningModule):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
            pass

    for module in (Manual(), Watches(), KeepsGrads()):
        assert not previous_grads_discarded(_trainer(module)), type(module).__name__

    class WatchingCallback(L.Callback):
        def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
            pass

    class OwnZeroGrad(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            pass

    assert previous_grads_discarded(_trainer(plain, callbacks=[L.Callback()]))
    assert not previous_grads_discarded(_trainer(plain, callbacks=[WatchingCallback()]))
    assert not previous_grads_discarded(_trainer(plain, optimizer_cls=OwnZeroGrad))


def test_zero_grad_hook_checks_remembered_per_objects(monkeypatch) -> None:
    """The strategy's memo answers as a fresh check does, re-checks when the module, a callback or an optimizer
    changes, and runs the override checks once for the same objects."""
    import lightning as L
    from lightning.pytorch.utilities import model_helpers

    from lightning_3d.core.step import ZeroGradHooks, previous_grads_discarded

    class WatchingCallback(L.Callback):
        def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
            pass

    calls = []
    real = model_helpers.is_overridden
    monkeypatch.setattr(model_helpers, "is_overridden", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    memo = ZeroGradHooks()
    plain = L.LightningModule()
    trainer = _trainer(plain)
    assert previous_grads_discarded(trainer, memo)
    checked = len(calls)
    assert checked > 0
    for _ in range(3):
        assert previous_grads_discarded(trainer, memo)
    assert len(calls) == checked  # the same objects: remembered
    watched = _trainer(plain, callbacks=[WatchingCallback()])
    assert not previous_grads_discarded(watched, memo)  # a new callback list: checked again
    assert previous_grads_discarded(trainer, memo)
    assert not previous_grads_discarded(_trainer(L.LightningModule(), batch_idx=1, accumulate=2), memo)


def test_grads_taken_put_back_and_dropped() -> None:
    """``take_grads`` leaves every ``.grad`` None and returns them, ``put_grads`` sets them back, ``drop_grads``
    frees them (the runner drops the previous step's gradients this way when Lightning would zero them)."""
    from lightning_3d.core.step import drop_grads, put_grads, take_grads

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    grads = [torch.ones(2), None, torch.full((2,), 3.0)]
    put_grads(params, grads)
    taken = take_grads(params)
    assert [g is t for g, t in zip(grads, taken, strict=True)] == [True, True, True]
    assert all(p.grad is None for p in params)
    put_grads(params, taken)
    assert params[0].grad is grads[0] and params[1].grad is None and params[2].grad is grads[2]
    drop_grads(params)
    assert all(p.grad is None for p in params)
