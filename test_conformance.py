"""Conformance: varbatch's own tests of the promises the ecosystem's suites make for the classes it stands in for.

Each section names the upstream suite whose promises it checks, and says in one line why a promise of theirs
does not apply where one does not. The tests are written for varbatch; no upstream code is copied.

- HF transformers' ``DataCollatorWithFlattening`` (tests/trainer/test_data_collator.py): `FlatCollate`.
- torch's scheduler protocol (test/optim/test_lrscheduler.py): `VariableBatchSizeLR` over torch's schedulers.
- torchdata's StatefulDataLoader (test/stateful_dataloader/test_state_dict.py): a dataset that has its own state,
  and the resume cases (0, 3 and spawned workers, persistent workers, snapshots, the end of an epoch, a state saved
  before the first iter()), over `make_dataloader(..., dataloader_class=StatefulDataLoader)`, the sampler passed as
  ``batch_sampler`` and the sampler's own ``state_dict``.

Run: ``python -m pytest -q test_conformance.py`` (the workers' runs are marked ``slow``).
"""

import copy
import gc
import io
import json
import warnings
import weakref
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.optim.lr_scheduler import (
    ChainedScheduler,
    ConstantLR,
    CosineAnnealingLR,
    CosineAnnealingWarmRestarts,
    CyclicLR,
    ExponentialLR,
    LambdaLR,
    LinearLR,
    MultiplicativeLR,
    MultiStepLR,
    OneCycleLR,
    PolynomialLR,
    SequentialLR,
    StepLR,
)
from torch.optim.swa_utils import SWALR

import varbatch
from varbatch import FlatCollate, VariableBatchSampler, VariableBatchSizeLR, make_dataloader

_PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# =============================================================================
# HF transformers' DataCollatorWithFlattening -> FlatCollate
# =============================================================================
# Not applicable, one line each:
# - return_tensors other than "pt" ("np", TensorFlow's "tf"): FlatCollate returns torch tensors for torch loaders.
# - return_tensors as the first positional argument (HF's dataclass field): keyword-only here, since FlatCollate's
#   first parameter was return_position_ids before it took return_tensors.
# - an empty sample (HF drops it) and labels in some samples only (HF reads them where the first sample has them).
# varbatch refuses each by name (test_flat_collate_refuses_by_name): nothing is silently lost or mislabelled.


def _hf_collator(**options):
    transformers = pytest.importorskip("transformers")
    return transformers.DataCollatorWithFlattening(**options)


@st.composite
def _hf_samples(draw):
    """HF-style samples, every one with labels or none, some with a mask, each field a list, a tensor or an array."""
    count = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 12), min_size=count, max_size=count))
    labelled = draw(st.booleans())
    samples = []
    for length in lengths:
        ids = draw(st.lists(st.integers(0, 50_000), min_size=length, max_size=length))
        sample = {"input_ids": ids}
        if labelled:
            sample["labels"] = draw(st.lists(st.sampled_from([-100, 0, 7, 31_999]), min_size=length, max_size=length))
        if draw(st.booleans()):  # an attention_mask of ones, which the row leaves out
            sample["attention_mask"] = [1] * length
        form = draw(st.sampled_from(["list", "tensor", "array"]))
        for key in sample:
            if form == "tensor":
                sample[key] = torch.tensor(sample[key])
            elif form == "array":
                sample[key] = np.array(sample[key])
        samples.append(sample)
    return samples


# DataCollatorWithFlattening's options at construction, and its keywords at call.
_HF_OPTIONS = st.fixed_dictionaries(
    {
        "return_position_ids": st.booleans(),
        "separator_id": st.sampled_from([-100, -1, 0, 5]),
        "return_flash_attn_kwargs": st.booleans(),
        "return_seq_idx": st.booleans(),
        "position_ids_start": st.integers(0, 3),
    },
    optional={"return_tensors": st.just("pt")},
)
_HF_CALL_KEYWORDS = st.fixed_dictionaries(
    {"return_tensors": st.sampled_from([None, "pt"]), "separator_id": st.sampled_from([None, -100, -7, 3])}
)


def _assert_same_batch(ours, theirs):
    """The same keys in the same order, each of the same type, dtype, shape and values."""
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        mine = ours[key]
        assert type(mine) is type(value), f"{key}: {type(mine).__name__} for HF's {type(value).__name__}"
        if isinstance(value, torch.Tensor):
            assert (mine.dtype, mine.shape) == (value.dtype, value.shape), key
            assert torch.equal(mine, value), f"{key}: {mine.tolist()} for HF's {value.tolist()}"
        else:
            assert mine == value, key


@_PROPERTY
@given(samples=_hf_samples(), options=_HF_OPTIONS, keywords=_HF_CALL_KEYWORDS)
# every sample one token: every position a start, every label a separator
@example(
    samples=[{"input_ids": [7], "labels": [3]}, {"input_ids": [8], "labels": [4]}],
    options={"return_seq_idx": True},
    keywords={},
)
def test_flat_collate_equals_hf_flattening(samples, options, keywords):
    """FlatCollate gives DataCollatorWithFlattening's keys, order, types, dtypes and values, under its options and
    its keywords at construction and at call (a call's keywords for that call only), for samples with and without
    labels, as lists, tensors or arrays; and keeps HF's immutability promise: collating changes no sample (the
    separator replaces a first label in the row only)."""
    before = copy.deepcopy(samples)
    theirs = _hf_collator(**options)(copy.deepcopy(samples), **keywords)
    collate = FlatCollate(**options)
    _assert_same_batch(collate(samples, **keywords), theirs)
    _assert_same_batch(collate(samples), _hf_collator(**options)(copy.deepcopy(samples)))
    for sample, original in zip(samples, before):
        assert list(sample) == list(original)
        for key, value in original.items():
            assert type(sample[key]) is type(value)
            assert np.array_equal(np.asarray(sample[key]), np.asarray(value)), key


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: FlatCollate(return_tensors="np"), ValueError, "return_tensors='np'; pass return_tensors='pt'"),
        (lambda: FlatCollate(return_tensors=None), ValueError, "return_tensors=None; pass return_tensors='pt'"),
        (lambda: FlatCollate()([{"input_ids": [1]}], return_tensors="np"), ValueError, "pass return_tensors='pt'"),
        (lambda: FlatCollate("pt"), TypeError, "return_position_ids='pt'; pass return_tensors by keyword"),
        (lambda: FlatCollate()([{"input_ids": [1]}], "pt"), TypeError, "seqlens='pt'; pass return_tensors by keyword"),
        (lambda: FlatCollate()([{"input_ids": [1]}, {"input_ids": []}]), ValueError, "sample 1 of .* is empty"),
        (
            lambda: FlatCollate()([{"input_ids": [1]}, {"input_ids": [3], "labels": [3]}]),
            ValueError,
            r"samples \[1\] of 2",
        ),
        (lambda: FlatCollate()([{"input_ids": [1, 2], "labels": [1]}]), ValueError, "has 1 labels for 2 input_ids"),
    ],
    ids=[
        "other tensors",
        "no tensors",
        "other tensors at call",
        "positional",
        "positional at call",
        "an empty sample",
        "labels in some",
        "labels too few",
    ],
)
def test_flat_collate_refuses_by_name(call, error, message):
    """What HF's collator takes differently, or goes on with, dropping or misaligning tokens silently, is refused by
    name: another return_tensors, HF's positional forms, an empty sample, labels in some samples, too few labels."""
    with pytest.raises(error, match=message):
        call()


# =============================================================================
# torch's scheduler protocol -> VariableBatchSizeLR
# =============================================================================
# Not applicable, one line each:
# - ReduceLROnPlateau: it steps on a validation metric, not once per batch; wrapping it is refused (as is wrapping
#   a VariableBatchSizeLR, which would scale the LR twice): test_varbatch.py's test_bad_input_VariableBatchSizeLR.
# - step(epoch) (deprecated in torch; "LR is constant for a constant epoch", the closed forms): the position is told
#   by a Batch record, step(batch), or counted, one step() per update; step(0) is DeepSpeed's mark of a cut epoch and
#   any other argument is refused (DESIGN.md, item 5).
# - the "old pattern" warning (scheduler.step() before optimizer.step()): varbatch silences torch's step-order check;
#   its order is torch's documented one, and nothing is inferred from the data the loop was given (DESIGN.md, item 5).
# - resuming by constructing with last_epoch=N (test_lr_scheduler_checkpoint, test_cos_anneal_lr_continue): the
#   batches trained, b, cannot be told from torch's last_epoch once updates are skipped; a run resumes with
#   load_state_dict.
# - compound schedulers (test_compound_*: several schedulers stepping one optimizer): one VariableBatchSizeLR per
#   optimizer, wrapping ChainedScheduler([...]) where schedules stack; a second one detaches the first
#   (test_varbatch.py's test_a_second_wrapper_on_an_optimizer_detaches_the_first).
# - a subclass whose get_lr takes an epoch (test_error_when_getlr_has_epoch): about torch's base class, not a wrapper.

_BASE_LR = 0.05
_SECOND_LR = 0.5  # the second param group's (a tensor in torch's suite: here in the tensor-LR cases only)
_SIZES = [2, 4, 8, 3]  # the batch sizes a wrapper reads, cycled
_REFERENCE = 4  # B_ref: the linear rule scales batch b's LR by _SIZES[b % 4] / 4

# torch's schedulers as its state_dict test lists them (ReduceLROnPlateau left out: see above), and a bare optimizer
# (a constant LR).
_SCHEDULERS = {
    "LambdaLR": partial(LambdaLR, lr_lambda=lambda step: 1 + step // 3),
    "MultiplicativeLR": partial(MultiplicativeLR, lr_lambda=lambda step: 0.95),
    "StepLR": partial(StepLR, step_size=3, gamma=0.1),
    "MultiStepLR": partial(MultiStepLR, milestones=[2, 5, 9], gamma=0.1),
    "ConstantLR": partial(ConstantLR, factor=0.5, total_iters=4),
    "LinearLR": partial(LinearLR, start_factor=0.25, total_iters=5),
    "ExponentialLR": partial(ExponentialLR, gamma=0.9),
    "PolynomialLR": partial(PolynomialLR, total_iters=6, power=2.0),
    "CosineAnnealingLR": partial(CosineAnnealingLR, T_max=10),
    "ChainedScheduler": lambda optimizer: ChainedScheduler(
        [LinearLR(optimizer, start_factor=0.4, total_iters=3), MultiStepLR(optimizer, milestones=[4, 8], gamma=0.1)]
    ),
    "SequentialLR": lambda optimizer: SequentialLR(
        optimizer, [ConstantLR(optimizer, factor=0.1, total_iters=3), ExponentialLR(optimizer, gamma=0.8)], [3]
    ),
    "CyclicLR": partial(CyclicLR, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "OneCycleLR": partial(OneCycleLR, max_lr=0.1, total_steps=12, anneal_strategy="linear"),
    "CosineAnnealingWarmRestarts": partial(CosineAnnealingWarmRestarts, T_0=4, T_mult=2),
    "SWALR": partial(SWALR, swa_lr=0.01, anneal_epochs=3),
    "optimizer (constant)": lambda optimizer: optimizer,
}
_STEPS = 11  # OneCycleLR's total_steps is 12


def _two_groups(tensor_lr=False):
    """torch's suite's optimizer: two param groups, the second's LR a tensor where ``tensor_lr``."""
    net = torch.nn.Linear(2, 2)
    second = torch.tensor(_SECOND_LR) if tensor_lr else _SECOND_LR
    return torch.optim.SGD([{"params": [net.weight]}, {"params": [net.bias], "lr": second}], lr=_BASE_LR)


# torch's per-scheduler state_dict tests load a state into the scheduler made with other hyperparameters (but
# SWALR's: its swa_lr lives in the optimizer's param groups, which the optimizer's own state restores).
_OTHERWISE = {
    "StepLR": partial(StepLR, step_size=1, gamma=0.005),
    "MultiStepLR": partial(MultiStepLR, milestones=[1, 4, 6], gamma=0.01),
    "ExponentialLR": partial(ExponentialLR, gamma=0.01),
    "CosineAnnealingLR": partial(CosineAnnealingLR, T_max=5, eta_min=0.001),
    "CosineAnnealingWarmRestarts": partial(CosineAnnealingWarmRestarts, T_0=100),
}


def _wrapped(name, tensor_lr=False, schedulers=_SCHEDULERS):
    optimizer = _two_groups(tensor_lr)
    return optimizer, VariableBatchSizeLR(schedulers[name](optimizer), _REFERENCE, _SIZES)


def _step(scheduler, t, told):
    """After update t: told by batch t's record (its last step input; an epoch is one cycle of _SIZES), or counted."""
    if told:
        epoch, place = divmod(t, len(_SIZES))
        scheduler.step(varbatch.Batch(index=t, epoch=epoch, count=_SIZES[place], last=True, step_input=place))
    else:
        scheduler.step()


def _schedule(name, steps):
    """The LRs of each param group of torch's scheduler alone, unwrapped, at steps 0 .. steps - 1 (the oracle)."""
    optimizer = _two_groups(tensor_lr=True)
    scheduler = _SCHEDULERS[name](optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append([float(group["lr"]) for group in optimizer.param_groups])
        optimizer.step()
        if scheduler is not optimizer:
            scheduler.step()
    return lrs


def _expected(name, steps):
    """schedule(t) x B_b / B_ref, with b = t (no update skipped)."""
    return [[lr * _SIZES[t % len(_SIZES)] / _REFERENCE for lr in lrs] for t, lrs in enumerate(_schedule(name, steps))]


def _check_lrs(t, expected, got):
    assert np.allclose([float(x) for x in got], expected, rtol=1e-5, atol=1e-8), (
        f"LR is wrong at step {t}: expected {expected}, got {[float(x) for x in got]}"
    )


# A tensor LR (torch's suite's second param group) is the optimizer's own, written in place by the schedulers.
@pytest.mark.parametrize(
    "name, tensor_lr",
    [
        *((name, False) for name in _SCHEDULERS),
        *((name, True) for name in ("StepLR", "ExponentialLR", "optimizer (constant)")),
    ],
)
@pytest.mark.parametrize("told", [False, True], ids=["counted", "told"])
def test_wrapped_scheduler_lrs_follow_the_schedule_times_the_batch_factor(name, tensor_lr, told):
    """torch's `_test`: before each update the optimizer holds the wrapped schedule's LR at that step times the batch's
    factor, in every param group (a tensor LR as a float's), the position counted or told; `_test_get_last_lr`:
    get_last_lr() before each step is that LR; the new-pattern and SequentialLR no-warning tests: construction, then
    optimizer.step() and scheduler.step() after each update, warn nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer, scheduler = _wrapped(name, tensor_lr)
        for t, expected in enumerate(_expected(name, _STEPS)):
            _check_lrs(t, expected, [group["lr"] for group in optimizer.param_groups])
            _check_lrs(t, expected, scheduler.get_last_lr())
            optimizer.step()
            _step(scheduler, t, told)
    assert [str(warning.message) for warning in caught] == []


def _same(first, second):
    """Equal plain data, tensors compared by value (torch's assertEqual, as far as states go)."""
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return torch.equal(torch.as_tensor(first), torch.as_tensor(second))
    if isinstance(first, dict):
        return (
            isinstance(second, dict)
            and first.keys() == second.keys()
            and all(_same(first[k], second[k]) for k in first)
        )
    if isinstance(first, (list, tuple)):
        return type(first) is type(second) and len(first) == len(second) and all(map(_same, first, second))
    return type(first) is type(second) and first == second


def _reloaded(scheduler, other, weights_only):
    """``scheduler``'s state through torch.save and torch.load is unchanged, and ``other`` loads it as it is."""
    state, buffer = scheduler.state_dict(), io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=weights_only)
    assert _same(loaded, state)
    other.load_state_dict(loaded)
    assert _same(other.state_dict(), state)


@pytest.mark.parametrize("told", [False, True], ids=["counted", "told"])
@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float LRs", "a tensor LR"])
@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("name", list(_SCHEDULERS))
def test_state_dict_round_trips_through_torch_save_and_load(name, weights_only, tensor_lr, told):
    """torch's state_dict tests: a state saved mid-run loads through torch.save/torch.load (weights_only True and
    False) unchanged; a new wrapper (around the scheduler made with other hyperparameters where torch's suite does
    so) that loads it has the same state and LRs, and steps on as the first, counted or told."""
    optimizer, scheduler = _wrapped(name, tensor_lr)
    for t in range(5):
        optimizer.step()
        _step(scheduler, t, told)
    other_optimizer, other = _wrapped(name, tensor_lr, {**_SCHEDULERS, **_OTHERWISE})
    _reloaded(scheduler, other, weights_only)
    for t in range(5, _STEPS):
        _check_lrs(t, [float(lr) for lr in scheduler.get_last_lr()], other.get_last_lr())
        _check_lrs(t, [float(lr) for lr in scheduler.get_last_lr()], [g["lr"] for g in other_optimizer.param_groups])
        for opt, sched in ((optimizer, scheduler), (other_optimizer, other)):
            opt.step()
            _step(sched, t, told)


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("base_batch_size", [4, "mean", None])
def test_state_dict_of_a_sampler_driven_wrapper_loads_with_weights_only(base_batch_size, weights_only):
    """A wrapper that reads its batch sizes from a sampler saves the sampler's settings too: plain data that
    torch.load(weights_only=True) accepts, loaded into a new wrapper unchanged."""

    def build():
        sampler = VariableBatchSampler([3, 5, 2, 7, 4, 6, 1, 8] * 4, 12, order="bucket", seed=3)
        optimizer = _two_groups()
        return VariableBatchSizeLR(LinearLR(optimizer, start_factor=0.5), base_batch_size, sampler)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default reference's unit-trap warning, not what is tested here
        scheduler, other = build(), build()
    _reloaded(scheduler, other, weights_only)


def test_a_stepped_wrapper_is_freed_with_no_garbage_collector_and_leaves_no_reference_to_its_optimizer():
    """torch's no-cycle-in-step and no-cyclic-references tests: with the garbage collector off, a stepped scheduler is
    freed when it goes out of reach (its optimizer hooks hold it weakly), and then nothing refers to its optimizer."""

    def run():
        parameter = torch.empty(10, requires_grad=True)
        optimizer = torch.optim.SGD([parameter], lr=0.5)
        scheduler = VariableBatchSizeLR(LambdaLR(optimizer, lambda step: 1.0), _REFERENCE, _SIZES)
        parameter.sum().backward()
        optimizer.step()
        scheduler.step()
        return weakref.ref(scheduler), optimizer

    gc.collect()
    gc.disable()
    try:
        reference, optimizer = run()
        assert reference() is None
        assert gc.get_referrers(optimizer) == []
    finally:
        gc.enable()


@pytest.mark.parametrize("name", ["LambdaLR", "StepLR", "ConstantLR", "LinearLR", "CosineAnnealingWarmRestarts"])
def test_a_tensor_lr_is_not_aliased(name):
    """torch's constant-initial-LR test: a tensor LR changed in place after construction changes neither initial_lr
    nor base_lrs (the wrapped scheduler's and the wrapper's)."""
    lr = torch.as_tensor(0.1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.randn(1))], lr=lr)
    wrapped = _SCHEDULERS[name](optimizer)
    scheduler = VariableBatchSizeLR(wrapped, _REFERENCE, _SIZES)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
        lr.multiply_(0.1)
        for owner in (wrapped, scheduler):
            assert [float(x) for x in owner.base_lrs] == [float(torch.tensor(0.1))], type(owner).__name__
        assert float(optimizer.param_groups[0]["initial_lr"]) == float(torch.tensor(0.1))


# =============================================================================
# torchdata's StatefulDataLoader (test/stateful_dataloader/test_state_dict.py)
# =============================================================================
# Two loaders over varbatch's sampler: make_dataloader(..., dataloader_class=StatefulDataLoader) ("make") and
# StatefulDataLoader(dataset, batch_sampler=sampler) ("direct"); each pass is an iterator whose state torchdata saves
# with the loader's. The loop is torchdata's tests' own: it counts its epochs (calling sampler.set_epoch(epoch), or
# not) and keeps its count beside the loader's state. The dataset draws from its own generator, which torchdata saves
# with the loader: a resumed run must read the samples and the draws of the uninterrupted one. States go through JSON.
# Not applicable, one line each:
# - iterable-style datasets (the Iterable, Generator, dynamic-state and iter()-count tests): varbatch plans the ids
#   of a map-style dataset; an iterable one has no ids to plan.
# - in_order=False (the out-of-order tests): make_dataloader refuses it, the plan's order is the order trained.
# - a sampler that is not stateful, fast-forwarded (TestNotStatefulSamplerSDL): varbatch's passes are stateful.
# - num_workers changed between save and load (TestNumWorkersMismatch): torchdata's assertion on its own format.
# - worker init and iteration errors: torch's error propagation, which varbatch's loader does not touch.
# - torch's global RNG as a dataset's state (DummyMapDataset): a dataset's own generator stands for it.
# - set_epoch(e + 1) right after load_state_dict, as if the saved epoch were done: the loader's next pass continues
#   the saved one (its epoch and place) whatever set_epoch said, as torchdata restores a sampler's iterator; the
#   sampler's epoch is left as the loop set it (test_the_next_pass_continues_the_loaded_one_whatever_set_epoch_said).

_TD_EPOCHS = 3
_SEQLENS = [int(n) for n in np.random.default_rng(0).integers(1, 30, 120)]


class _AugmentedDataset(torch.utils.data.Dataset):
    """Sample i is ``_SEQLENS[i]`` copies of ``1000 i + noise``, the noise drawn from the dataset's own generator at
    each read (an augmentation): its state is what torchdata saves for it."""

    def __init__(self):
        self.rng = np.random.default_rng(7)

    def __len__(self):
        return len(_SEQLENS)

    def __getitem__(self, index):
        return torch.full((_SEQLENS[index],), 1000 * index + int(self.rng.integers(1000)))

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state_dict):
        self.rng.bit_generator.state = state_dict["rng"]


class _StateDictOnly(list):
    """A dataset with state_dict but no load_state_dict: not Stateful to torchdata."""

    def state_dict(self):
        return {}


def _td_sampler():
    return VariableBatchSampler(_SEQLENS, 64, order="random", num_replicas=1, rank=0)


def _td_build(arm, workers=0, dataset=None, **options):
    """A fresh dataset (by default an `_AugmentedDataset`), sampler and stateful loader: varbatch's sampler through
    make_dataloader ("make") or passed as batch_sampler ("direct"); or make_dataloader's torch loader ("torch")."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    dataset = _AugmentedDataset() if dataset is None else dataset
    sampler = _td_sampler()
    options = dict(collate_fn=varbatch.PaddedCollate(), num_workers=workers, **options)
    if arm == "make":
        return sampler, make_dataloader(dataset, sampler, dataloader_class=stateful.StatefulDataLoader, **options)
    if arm == "torch":
        return sampler, make_dataloader(dataset, sampler, **options)
    return sampler, stateful.StatefulDataLoader(dataset, batch_sampler=sampler, **options)


def _rows(batch):
    """A batch's first column: ``1000 i + draw`` per sample, as read."""
    x, _ = batch
    return tuple(x[:, 0].tolist())


def _ids(batches):
    return [[row // 1000 for row in rows] for _, rows in batches]


def _td_run(build, set_epoch=True, state=None, start=0, stop=None):
    """torchdata's tests' loop from epoch ``start`` over a new dataset, sampler and loader (restored from ``state``
    if given), counting its epochs: its batches as ``(epoch, rows)``, and the loader's state through JSON where it
    stops, at ``stop = (epoch, at)``: after the ``at``-th batch of that epoch it read ("last": the epoch's last,
    inside its loop), or once the epoch's loop ended (``at="end"``)."""
    sampler, loader = build()
    if state is not None:
        loader.load_state_dict(state)
    if stop is not None and stop[1] == "last":
        stop = (stop[0], len(loader))
    batches = []
    for epoch in range(start, _TD_EPOCHS):
        if set_epoch:
            sampler.set_epoch(epoch)
        for batch in loader:
            batches.append((epoch, _rows(batch)))
            if stop == (epoch, sum(e == epoch for e, _ in batches)):
                return batches, json.loads(json.dumps(loader.state_dict()))
        if stop == (epoch, "end"):
            return batches, json.loads(json.dumps(loader.state_dict()))
    return batches, None


def _td_resumes_exactly(build, *stops, set_epoch=True):
    """Stopped at each of ``stops`` in turn, each run resumed from the state the one before saved, the runs read the
    samples and the dataset's draws of the uninterrupted run, none twice."""
    full, _ = _td_run(build, set_epoch)
    trained = []
    state = None
    start = 0
    for stop in stops:
        batches, state = _td_run(build, set_epoch, state, start, stop)
        trained += batches
        start = stop[0] + 1 if stop[1] == "end" else stop[0]
    trained += _td_run(build, set_epoch, state, start)[0]
    where = f"stopped at {stops}"
    assert _ids(trained) == _ids(full), f"{where}: the resumed runs read other samples than the uninterrupted one"
    assert trained == full, f"{where}: the same samples, but the dataset's own draws differ"


@pytest.mark.parametrize("set_epoch", [True, False], ids=["set_epoch", "no set_epoch"])
@pytest.mark.parametrize(
    "stop",
    [(0, 1), (0, 10), (1, 7), (0, "last"), (1, "last"), (0, "end"), (1, "end")],
    ids=["first batch", "batch 10", "epoch 1", "end, in the loop", "end of 1, in", "end, loop ended", "end of 1"],
)
@pytest.mark.parametrize("arm", ["make", "direct"])
def test_a_loop_counting_its_epochs_resumes_exactly(arm, stop, set_epoch):
    """torchdata's interrupted-run, multi-epoch, end-of-epoch and JSON resumes, 0 workers: saved after any batch,
    after an epoch's last batch inside its loop (resumed as the epoch's empty rest) or after its loop ended (as a
    fresh pass), through JSON, and resumed by a loop that counts its epochs, the run reads the samples and the
    dataset's draws of the uninterrupted run, none twice."""
    _td_resumes_exactly(partial(_td_build, arm), stop, set_epoch=set_epoch)


@pytest.mark.parametrize("arm", ["make", "direct"])
def test_the_next_pass_continues_the_loaded_one_whatever_set_epoch_said(arm):
    """Loaded from a state saved inside epoch 1, then set_epoch(2): the loader's next pass is the rest of epoch 1,
    its draws too, and the sampler stays at epoch 2, whose pass follows in full."""
    full, _ = _td_run(partial(_td_build, arm))
    _, state = _td_run(partial(_td_build, arm), stop=(1, 5))
    sampler, loader = _td_build(arm)
    loader.load_state_dict(state)
    sampler.set_epoch(2)
    rest = [_rows(batch) for batch in loader]
    assert sampler.epoch == 2
    assert rest == [rows for e, rows in full if e == 1][5:]
    assert [_rows(batch) for batch in loader] == [rows for e, rows in full if e == 2]


def _check_states_anywhere(build):
    """TestInitialState, TestSnapshotZero and the load-then-state test, a loop that calls no set_epoch: a state saved
    before the first iter() restores the passes that followed it, also into a loader in the middle of a pass, and is
    the loader's state right after the load; a state saved mid-pass resumes its rest, loaded into the loader that
    saved it after it moved on, and into a new loader with its state asked before or after the load."""
    _, loader = build()
    initial = loader.state_dict()
    passes = [[_rows(batch) for batch in loader] for _ in range(2)]
    moved = iter(loader)
    next(moved)
    next(moved)
    loader.load_state_dict(initial)
    assert loader.state_dict() == initial
    assert [[_rows(batch) for batch in loader] for _ in range(2)] == passes, "from a state before the first iter()"
    _, loader = build()
    batches = iter(loader)
    for _ in range(4):
        next(batches)
    middle = json.loads(json.dumps(loader.state_dict()))
    tail = [_rows(batch) for batch in batches]
    loader.load_state_dict(middle)
    assert [_rows(batch) for batch in loader] == tail, "loaded into the loader that saved it"
    for asked_first in (True, False):
        _, fresh = build()
        if asked_first:
            fresh.state_dict()
        fresh.load_state_dict(middle)
        if not asked_first:
            assert fresh.state_dict() == middle
        assert [_rows(batch) for batch in fresh] == tail, f"loaded into a new loader, state asked first: {asked_first}"


@pytest.mark.parametrize("arm", ["make", "direct"])
def test_states_saved_before_the_first_iter_or_mid_pass_resume_anywhere(arm):
    """`_check_states_anywhere`, 0 workers."""
    _check_states_anywhere(partial(_td_build, arm))


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent workers"])
@pytest.mark.parametrize("arm", ["make", "direct"])
def test_workers_resume_exactly(arm, persistent):
    """torchdata's worker resumes, 3 workers and snapshots every 3 steps: saved at a batch that is no multiple of
    either, after an epoch's last batch inside its loop, after its loop ended, and 2 batches after a restore
    (TestFastStateDictRequest), the runs read the samples and every worker's draws of the uninterrupted one; and
    `_check_states_anywhere` (TestInitialState with persistent workers)."""
    build = partial(_td_build, arm, 3, persistent_workers=persistent, snapshot_every_n_steps=3)
    for stop in [(0, 10), (0, "last"), (1, "end")]:
        _td_resumes_exactly(build, stop)
    _td_resumes_exactly(build, (0, 10), (0, 2))
    _check_states_anywhere(build)


@pytest.mark.slow
def test_spawned_workers_resume_the_datasets_own_state():
    """Spawned, persistent workers each unpickle make_dataloader's dataset wrapper with the collate that reads through
    it: stopped in epoch 1 and resumed, the run reads the samples and every worker's draws of the uninterrupted one."""
    options = dict(multiprocessing_context="spawn", persistent_workers=True)
    _td_resumes_exactly(partial(_td_build, "make", 2, **options), (1, 7))


@pytest.mark.parametrize(
    "dataset",
    [_AugmentedDataset(), [torch.ones(n) for n in _SEQLENS], _StateDictOnly(torch.ones(n) for n in _SEQLENS)],
    ids=["stateful", "plain", "state_dict only"],
)
def test_make_dataloader_saves_the_datasets_own_state_as_it_is(dataset):
    """torchdata saves a dataset's state_dict() with the loader's where it has load_state_dict too, else None:
    make_dataloader's loader as torchdata's own, with no keys added."""
    _, loader = _td_build("make", dataset=dataset)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    expected = dataset.state_dict() if isinstance(dataset, _AugmentedDataset) else None
    assert loader.state_dict()["dataset_state"] == expected


def test_a_stateful_loader_reads_what_torchs_loader_reads():
    """TestConcurrentDataLoaders: make_dataloader with StatefulDataLoader yields the batches of torch's loader."""
    assert _td_run(partial(_td_build, "make")) == _td_run(partial(_td_build, "torch"))


def _passes(sampler, epochs):
    """A loop that counts its epochs over the sampler alone: each epoch's pass, by epoch."""
    passes = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        passes[epoch] = list(sampler)
    return passes


@pytest.mark.parametrize("epoch", [0, 1])
def test_the_samplers_state_at_an_epochs_end_resumes_as_its_empty_rest(epoch):
    """torchdata's end-of-epoch convention for the sampler's own state: saved after epoch e's last step input (the
    loop's count, steps_done=len(sampler)) and loaded through JSON, the sampler is at epoch e with nothing left of it
    (and saves that again), its horizon counts the epochs after e, and a loop that counts its epochs trains e's empty
    rest, then the uninterrupted run's epochs."""
    full = _passes(_td_sampler(), range(_TD_EPOCHS))
    sampler = _td_sampler()
    sampler.set_epoch(epoch)
    state = json.loads(json.dumps(sampler.state_dict(steps_done=len(sampler))))
    resumed = _td_sampler()
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.steps_done) == (epoch, len(resumed))
    assert resumed.state_dict() == state
    later = range(epoch + 1, _TD_EPOCHS)
    assert resumed.horizon(_TD_EPOCHS - epoch, "samples") == sum(len(ids) for e in later for ids in full[e])
    assert _passes(resumed, range(epoch, _TD_EPOCHS)) == {epoch: [], **{e: full[e] for e in later}}
