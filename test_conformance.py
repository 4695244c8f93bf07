"""Conformance: varbatch's own tests of the promises the ecosystem's suites make for the classes it stands in for.

Each section names the upstream suite whose promises it checks, and says in one line why a promise of theirs
does not apply where one does not. The tests are written for varbatch; no upstream code is copied.

- HF transformers' ``DataCollatorWithFlattening`` (tests/trainer/test_data_collator.py): `FlatCollate`.
- torch's scheduler protocol (test/optim/test_lrscheduler.py): `VariableBatchSizeLR` over torch's schedulers.
- torchdata's StatefulDataLoader (test/stateful_dataloader/test_state_dict.py): a dataset that has its own state,
  and the resume cases (0, 3 and spawned workers, persistent workers, snapshots, the end of an epoch), over
  `make_dataloader(..., dataloader_class=StatefulDataLoader)`, the sampler passed as ``batch_sampler`` and the
  sampler's own ``state_dict``.

Run: ``python -m pytest -q test_conformance.py`` (the workers' runs are marked ``slow``).
"""

import copy
import gc
import io
import json
import pickle
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
    labels, as lists, tensors or arrays."""
    theirs = _hf_collator(**options)(copy.deepcopy(samples), **keywords)
    collate = FlatCollate(**options)
    _assert_same_batch(collate(samples, **keywords), theirs)
    _assert_same_batch(collate(samples), _hf_collator(**options)(copy.deepcopy(samples)))


@_PROPERTY
@given(samples=_hf_samples(), call_separator_id=st.sampled_from([None, -7]))
def test_flat_collate_leaves_its_samples_as_they_were(samples, call_separator_id):
    """HF's immutability promise: collating changes no sample (the separator replaces a first label in the row only)."""
    before = copy.deepcopy(samples)
    FlatCollate(return_flash_attn_kwargs=True, return_seq_idx=True)(samples, separator_id=call_separator_id)
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
        (
            lambda: FlatCollate()([{"input_ids": [1]}, {"input_ids": []}]),
            ValueError,
            "sample 1 of the step input is empty",
        ),
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
# - step(epoch) (deprecated in torch; "LR is constant for a constant epoch", the closed forms): the position is given
#   by one step() per batch; step(0) only marks an epoch start (DESIGN.md, item 5).
# - the "old pattern" warning (scheduler.step() before optimizer.step()): varbatch silences torch's step-order check
#   and finds misuse from the step inputs its loader handed out (DESIGN.md, item 5).
# - resuming by constructing with last_epoch=N (test_lr_scheduler_checkpoint): the batches trained, b, cannot be told
#   from torch's last_epoch once updates are skipped; a run resumes with load_state_dict.
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


def _wrapped(name, tensor_lr=False):
    optimizer = _two_groups(tensor_lr)
    return optimizer, VariableBatchSizeLR(_SCHEDULERS[name](optimizer), _REFERENCE, _SIZES)


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
def test_wrapped_scheduler_lrs_follow_the_schedule_times_the_batch_factor(name, tensor_lr):
    """torch's `_test`: before each update the optimizer holds the wrapped schedule's LR at that step times the batch's
    factor, in every param group (a tensor LR as a float's); `_test_get_last_lr`: get_last_lr() before each step is
    that LR."""
    optimizer, scheduler = _wrapped(name, tensor_lr)
    for t, expected in enumerate(_expected(name, _STEPS)):
        _check_lrs(t, expected, [group["lr"] for group in optimizer.param_groups])
        _check_lrs(t, expected, scheduler.get_last_lr())
        optimizer.step()
        scheduler.step()


def test_chained_scheduler_wrapped_once_before_any_step():
    """torch's chained `get_last_lr` before a step is its last scheduler's: wrapped once, times batch 0's factor."""
    optimizer = _two_groups()
    schedulers = [LinearLR(optimizer, start_factor=0.4, total_iters=3), MultiStepLR(optimizer, [4, 8, 10], 0.1)]
    chained = ChainedScheduler(schedulers)
    unscaled = [float(lr) for lr in schedulers[-1].get_last_lr()]
    scheduler = VariableBatchSizeLR(chained, _REFERENCE, _SIZES)
    _check_lrs(0, [lr * _SIZES[0] / _REFERENCE for lr in unscaled], scheduler.get_last_lr())


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


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float LRs", "a tensor LR"])
@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("name", list(_SCHEDULERS))
def test_state_dict_round_trips_through_torch_save_and_load(name, weights_only, tensor_lr):
    """torch's state_dict load test: a state saved mid-run loads through torch.save/torch.load (weights_only True
    and False) unchanged; a new wrapper that loads it has the same state and LRs, and steps on as the first."""
    optimizer, scheduler = _wrapped(name, tensor_lr)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    other_optimizer, other = _wrapped(name, tensor_lr)
    _reloaded(scheduler, other, weights_only)
    for t in range(5, _STEPS):
        _check_lrs(t, [float(lr) for lr in scheduler.get_last_lr()], other.get_last_lr())
        _check_lrs(t, [float(lr) for lr in scheduler.get_last_lr()], [g["lr"] for g in other_optimizer.param_groups])
        for opt, sched in ((optimizer, scheduler), (other_optimizer, other)):
            opt.step()
            sched.step()


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


def test_the_loop_torch_recommends_raises_no_warning():
    """torch's new-pattern test: construction and 35 of optimizer.step(); scheduler.step() warn nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer, scheduler = _wrapped("StepLR")
        for _ in range(35):
            optimizer.step()
            scheduler.step()
    assert [str(warning.message) for warning in caught] == []


def test_wrapper_leaves_no_reference_to_the_optimizer():
    """torch's no-cyclic-references test: once the scheduler is deleted nothing refers to its optimizer."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.empty(10))], lr=0.5)
    scheduler = VariableBatchSizeLR(LambdaLR(optimizer, lambda step: 1.0), _REFERENCE, _SIZES)
    del scheduler
    assert gc.get_referrers(optimizer) == []


def test_stepping_makes_no_reference_cycle():
    """torch's no-cycle-in-step test: with the garbage collector off, a stepped scheduler is freed when it goes out
    of reach (its optimizer hooks hold it weakly)."""

    def run():
        parameter = torch.empty(10, requires_grad=True)
        optimizer = torch.optim.SGD([parameter], lr=0.5)
        scheduler = VariableBatchSizeLR(LambdaLR(optimizer, lambda step: 1.0), _REFERENCE, _SIZES)
        parameter.sum().backward()
        optimizer.step()
        scheduler.step()
        return weakref.ref(scheduler)

    gc.collect()
    gc.disable()
    try:
        reference = run()
        assert reference() is None
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
# Two loader modes: make_dataloader(..., dataloader_class=StatefulDataLoader) ("make") and
# StatefulDataLoader(dataset, batch_sampler=sampler) ("direct"); the sampler's own state_dict where the promise is
# the sampler's. The loop is torchdata's tests': it counts its epochs itself (calling set_epoch(epoch), or not) and
# saves its count with the loader's state. The dataset draws from its own generator (`_AugmentedDataset`): its
# state is saved and restored with the loader's, so a resumed run must read the same samples and the same draws.
# Worker cases are marked slow.
# Not applicable, one line each:
# - iterable-style datasets (the Iterable, Generator, dynamic-state and iter()-count tests): varbatch plans the ids
#   of a map-style dataset; an iterable one has no ids to plan.
# - in_order=False (the out-of-order tests): make_dataloader refuses it, the plan's order is the order trained.
# - a sampler that is not stateful, fast-forwarded (TestNotStatefulSamplerSDL): varbatch's sampler is stateful.
# - num_workers changed between save and load (TestNumWorkersMismatch): torchdata's assertion on its own format,
#   which varbatch leaves as it is (the sampler's own state, epoch and steps_done, loads with any worker count).
# - worker init and iteration errors: torch's error propagation, which varbatch's loader does not touch.
# - torch's global RNG as a dataset's state (DummyMapDataset): a dataset's own generator stands for it; the global
#   RNG of workers is seeded by torch from the loader's base seed, which torchdata saves, not varbatch.
# - set_epoch(e + 1) right after a direct loader's load_state_dict: torchdata restores the sampler only when its
#   next iterator starts, after that set_epoch, so the loop gets the saved epoch's rest first (as with torchdata's
#   own StatefulDistributedSampler); make_dataloader's loader restores at load_state_dict and keeps it.

_TD_EPOCHS = 3
_SEQLENS = [int(n) for n in np.random.default_rng(0).integers(1, 30, 120)]


class _Samples:
    """A map-style dataset of ``len(seqlens)`` samples, sample i of ``seqlens[i]`` tokens."""

    def __init__(self, seqlens):
        self.seqlens = seqlens

    def __len__(self):
        return len(self.seqlens)


class _AugmentedDataset(_Samples):
    """Sample i is ``seqlens[i]`` copies of ``1000 i + noise``, the noise drawn from the dataset's own RNG at each
    read (an augmentation): its state is what torchdata saves for it."""

    def __init__(self, seqlens, seed=7):
        super().__init__(seqlens)
        self.rng = np.random.default_rng(seed)

    def __getitem__(self, index):
        return torch.full((self.seqlens[index],), 1000 * index + int(self.rng.integers(1000)))

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state_dict):
        self.rng.bit_generator.state = state_dict["rng"]


class _CountingDataset(_Samples):
    """Counts its reads; a sample is the count at its read: the state is one number."""

    def __init__(self, seqlens):
        super().__init__(seqlens)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return torch.full((self.seqlens[index],), self.reads)

    def state_dict(self):
        return {"reads": self.reads}

    def load_state_dict(self, state_dict):
        self.reads = state_dict["reads"]


class _StateDictOnly(_Samples):
    """A dataset with state_dict but no load_state_dict: not Stateful to torchdata."""

    def __getitem__(self, index):
        return torch.ones(self.seqlens[index])

    def state_dict(self):
        return {}


def _td_sampler(**options):
    return VariableBatchSampler(_SEQLENS, 64, order="random", num_replicas=1, rank=0, **options)


def _td_build(arm, workers=0, dataset=None, **options):
    """A dataset (by default a fresh `_AugmentedDataset`, its generator at its seed), sampler and stateful loader:
    varbatch's sampler through make_dataloader ("make") or passed as batch_sampler ("direct"), or torchdata's own
    BatchSampler over its RandomSampler ("torchdata", the reference: its sampler is None to the loop)."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    dataset = _AugmentedDataset(_SEQLENS) if dataset is None else dataset
    options = dict(collate_fn=varbatch.PaddedCollate(), num_workers=workers, **options)
    if arm == "torchdata":
        order = stateful.sampler.RandomSampler(dataset, generator=torch.Generator().manual_seed(5))
        batches = stateful.sampler.BatchSampler(order, 4, drop_last=False)
        return None, stateful.StatefulDataLoader(dataset, batch_sampler=batches, **options)
    sampler = _td_sampler()
    if arm == "make":
        return sampler, make_dataloader(dataset, sampler, dataloader_class=stateful.StatefulDataLoader, **options)
    return sampler, stateful.StatefulDataLoader(dataset, batch_sampler=sampler, **options)


def _rows(batch):
    """A batch's first column: ``1000 i + draw`` per sample, as read."""
    x, _ = batch
    return tuple(x[:, 0].tolist())


def _ids(batches):
    return [[row // 1000 for row in rows] for _, rows in batches]


def _td_loop(sampler, loader, epochs, set_epoch=True):
    """torchdata's tests' loop, counting its epochs: yields (epoch, rows) per batch, and (epoch, None) once each
    epoch's ``for`` over the loader has ended."""
    for epoch in epochs:
        if set_epoch and sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, _rows(batch)
        yield epoch, None


def _td_full(build, set_epoch=True):
    return [(e, rows) for e, rows in _td_loop(*build(), range(_TD_EPOCHS), set_epoch) if rows is not None]


def _td_head(sampler, loader, epoch, stop, set_epoch=True):
    """The batches up to a save, and the loader's state saved there: inside epoch ``epoch``'s loop after its
    ``stop``-th batch ("last": its last, before the loop ends), or once its loop ended (``stop="end"``)."""
    head, loop = [], _td_loop(sampler, loader, range(_TD_EPOCHS), set_epoch)
    stop = len(loader) if stop == "last" else stop
    for e, rows in loop:
        if rows is not None:
            head.append((e, rows))
        if e == epoch and (rows is None if stop == "end" else sum(x == e for x, _ in head) == stop):
            break
    state = loader.state_dict()
    loop.close()
    return head, state


def _td_resumed(build, head, state, epoch, stop, set_epoch=True):
    """The rest of the run from ``state``, in a new dataset, sampler and loader: the loop's count resumes at the
    epoch it saved (the next one once the epoch's loop had ended)."""
    sampler, loader = build()
    loader.load_state_dict(state)
    start = epoch + 1 if stop == "end" else epoch
    return [(e, rows) for e, rows in _td_loop(sampler, loader, range(start, _TD_EPOCHS), set_epoch) if rows is not None]


def _check_resumed(full, head, rest, where):
    assert len(head) + len(rest) == len(full), f"{where}: {len(head)} + {len(rest)} batches for {len(full)}"
    assert _ids(head + rest) == _ids(full), f"{where}: the resumed run read other samples than the uninterrupted one"
    assert head + rest == full, f"{where}: the same samples, but the dataset's own draws differ"


def _td_resumes_exactly(arm, epoch, stop, set_epoch=True, workers=0, full=None, **options):
    build = partial(_td_build, arm, workers)
    full = _td_full(build, set_epoch) if full is None else full
    head, state = _td_head(*_td_build(arm, workers, **options), epoch, stop, set_epoch)
    rest = _td_resumed(partial(_td_build, arm, workers, **options), head, state, epoch, stop, set_epoch)
    _check_resumed(full, head, rest, f"{arm}, saved in epoch {epoch} at {stop}")


def test_the_loader_saves_the_datasets_state_as_it_is():
    """The wrapper adds no keys: the loader's dataset_state is the dataset's state_dict(), after the reads so far."""
    dataset = _CountingDataset(_SEQLENS)
    _, loader = _td_build("make", dataset=dataset)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    assert dataset.reads > 0
    assert loader.state_dict()["dataset_state"] == dataset.state_dict() == {"reads": dataset.reads}


@pytest.mark.parametrize(
    "dataset", [[torch.ones(n) for n in _SEQLENS], _StateDictOnly(_SEQLENS)], ids=["plain", "state_dict only"]
)
def test_a_dataset_without_state_gives_the_wrapper_none(dataset):
    """torchdata checks for both methods: a dataset lacking one gets a wrapper with neither, and torchdata saves no
    dataset state, as without varbatch."""
    _, loader = _td_build("make", dataset=dataset)
    assert not hasattr(loader.dataset, "state_dict") and not hasattr(loader.dataset, "load_state_dict")
    next(iter(loader))
    assert loader.state_dict()["dataset_state"] is None


def test_a_pickled_wrapper_reaches_the_dataset_its_collate_reads():
    """A spawned worker unpickles the loader's dataset and collate together: the wrapper's state then follows the
    reads the collate makes, and a state loaded through it is the one the collate reads with."""
    _, loader = _td_build("make", dataset=_CountingDataset(_SEQLENS))
    (key,) = next(iter(loader.batch_sampler))
    wrapper, collate = pickle.loads(pickle.dumps((loader.dataset, loader.collate_fn)))
    assert wrapper.state_dict() == {"reads": 0}
    wrapper.load_state_dict({"reads": 100})
    x, _ = collate([key])
    assert x[:, 0].tolist() == list(range(101, 101 + len(key.sample_ids)))
    assert wrapper.state_dict() == {"reads": 100 + len(key.sample_ids)}


@pytest.mark.slow
def test_spawned_workers_resume_the_datasets_own_state():
    """Spawned, persistent workers each unpickle the wrapper with the collate that reads through it: stopped in
    epoch 1 and resumed, the run reads the samples and every worker's dataset draws of the uninterrupted one."""
    full = _td_full(partial(_td_build, "make", 2, persistent_workers=True))  # forked workers draw alike, started sooner
    _td_resumes_exactly("make", 1, 7, workers=2, full=full, multiprocessing_context="spawn", persistent_workers=True)


@pytest.mark.parametrize("set_epoch", [True, False], ids=["set_epoch", "no set_epoch"])
@pytest.mark.parametrize(
    "epoch, stop",
    [(0, 1), (0, 10), (1, 7), (0, "last"), (1, "last"), (0, "end"), (1, "end")],
    ids=["first batch", "batch 10", "epoch 1", "end, in the loop", "end of 1, in", "end, loop ended", "end of 1"],
)
@pytest.mark.parametrize("arm", ["make", "direct"])
def test_a_loop_counting_its_epochs_resumes_exactly(arm, epoch, stop, set_epoch):
    """torchdata's interrupted-run, multi-epoch and end-of-epoch resumes, 0 workers: saved after any batch, after an
    epoch's last batch inside its loop, or after its loop ended, and resumed by a loop that counts its epochs itself,
    the run reads the samples and the dataset's draws of the uninterrupted run, none twice."""
    _td_resumes_exactly(arm, epoch, stop, set_epoch)


@pytest.mark.parametrize("arm", ["make", "direct", "torchdata"])
def test_an_end_of_epoch_state_resumes_as_torchdata_says(arm):
    """TestEndOfEpochBehavior: a state saved after an epoch's last batch, inside its loop, resumes as an empty pass
    (then the next epoch); one saved after the loop ended, as the next epoch's full pass. varbatch's arms as
    torchdata's own sampler."""
    _, loader = _td_build(arm)
    for _ in loader:
        inside = loader.state_dict()
    after = loader.state_dict()
    next_epoch = [_rows(batch) for batch in loader]
    for state, passes in ((inside, [[], next_epoch]), (after, [next_epoch])):
        _, resumed = _td_build(arm)
        resumed.load_state_dict(state)
        assert [[_rows(batch) for batch in resumed] for _ in passes] == passes


@pytest.mark.parametrize("then", ["set_epoch(e)", "no set_epoch", "set_epoch(e + 1)"])
def test_a_make_dataloader_loader_restores_an_epochs_end_as_the_sampler_does(then):
    """Right after loader.load_state_dict() of a state saved after epoch e's last batch, sampler.epoch is e and
    steps_done len(sampler); set_epoch(e) (or none) gives the empty rest, then e + 1 follows; set_epoch(e + 1)
    starts e + 1. Saved after the loop ended, sampler.epoch is e + 1 at once, steps_done 0."""
    full = _td_full(partial(_td_build, "make"))
    epoch_2 = [rows for e, rows in full if e == 2]
    sampler, loader = _td_build("make")
    _, inside = _td_head(sampler, loader, 1, "last")
    sampler, loader = _td_build("make")
    loader.load_state_dict(inside)
    assert (sampler.epoch, sampler.steps_done) == (1, len(sampler))
    if then != "no set_epoch":
        sampler.set_epoch(1 if then == "set_epoch(e)" else 2)
    passes = [[_rows(batch) for batch in loader] for _ in range(1 if then == "set_epoch(e + 1)" else 2)]
    assert passes == ([epoch_2] if then == "set_epoch(e + 1)" else [[], epoch_2])
    _, after = _td_head(*_td_build("make"), 1, "end")
    sampler, loader = _td_build("make")
    loader.load_state_dict(after)
    assert (sampler.epoch, sampler.steps_done) == (2, 0)


def _sampler_epochs(sampler, epochs):
    return {e: list(sampler) for e in epochs if sampler.set_epoch(e) is None}


@pytest.mark.parametrize("then", ["set_epoch(e)", "no set_epoch", "set_epoch(e + 1)"])
@pytest.mark.parametrize("epoch", [0, 1])
def test_the_samplers_own_state_at_an_epochs_end_restores_its_empty_rest(epoch, then):
    """The sampler's state_dict after epoch e's last step input, through JSON, loads as epoch e with steps_done
    len(sampler) (and saves as it loaded); set_epoch(e) or none gives the empty rest, then e + 1; set_epoch(e + 1)
    starts e + 1; a loop that counts its epochs trains exactly the uninterrupted run's step inputs."""

    build = _td_sampler
    full = _sampler_epochs(build(), range(3))
    sampler = build()
    _sampler_epochs(sampler, range(epoch + 1))
    state = json.loads(json.dumps(sampler.state_dict()))
    resumed = build()
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.steps_done) == (epoch, len(resumed))
    assert resumed.state_dict() == state
    if then == "set_epoch(e + 1)":
        resumed.set_epoch(epoch + 1)
        assert list(resumed) == full[epoch + 1]
    else:
        if then == "set_epoch(e)":
            resumed.set_epoch(epoch)
        assert list(resumed) == []
        assert (resumed.epoch, resumed.steps_done) == (epoch + 1, 0)
        assert list(resumed) == full[epoch + 1]
    counted = build()
    counted.load_state_dict(state)
    assert _sampler_epochs(counted, range(epoch, 3)) == {epoch: [], **{e: full[e] for e in range(epoch + 1, 3)}}


@pytest.mark.parametrize("unit", ["tokens", "samples"])
def test_horizon_after_an_end_of_epoch_restore_counts_the_epochs_left(unit):
    """Restored at epoch 1's end (epoch 1, nothing left of it), horizon(E - epoch) is the plans of epochs 2 .. E-1,
    as the uninterrupted sampler's (already at epoch 2) horizon(E - epoch); at the next epoch's start, the same."""
    epochs = 5
    sampler = _td_sampler()
    plans = [sampler.plan_for_epoch(e) for e in range(epochs)]
    left = sum(int(plan._amounts(unit).sum()) for plan in plans[2:])
    _sampler_epochs(sampler, range(2))
    resumed = _td_sampler()
    resumed.load_state_dict(sampler.state_dict())
    assert (sampler.epoch, resumed.epoch) == (2, 1)
    for owner in (sampler, resumed):
        assert owner.horizon(epochs - owner.epoch, unit) == left, f"epoch {owner.epoch}"
    assert list(resumed) == []
    assert resumed.horizon(epochs - resumed.epoch, unit) == left


def _example_run(sampler, loader, gas, epochs, max_steps, steps=0):
    """example.py's loop as it keeps the sampler's position (its section 4 and 5): per epoch from sampler.epoch,
    set_epoch, the batches from sampler.steps_done // gas, `gas` step inputs each, the step inputs trained
    counted; its checkpoint, sampler.state_dict(steps_done=trained). Each batch as its step inputs' sample ids (the
    example saves no dataset state)."""
    trained, batches_trained = sampler.steps_done, []
    for epoch in range(sampler.epoch, epochs):
        if steps >= max_steps:
            break
        sampler.set_epoch(epoch)
        plan, b0, batches = sampler.plan, sampler.steps_done // gas, iter(loader)
        for b in range(b0, plan.num_batches):
            step_inputs = [_rows(next(batches)) for _ in range(gas)]
            batches_trained.append((epoch, [[row // 1000 for row in rows] for rows in step_inputs]))
            trained, steps = (b + 1) * gas, steps + 1
            if steps >= max_steps:
                break
    return batches_trained, steps, sampler.state_dict(steps_done=trained)


@pytest.mark.parametrize("stop", ["end of epoch 0", "end of epoch 1", "inside epoch 1"])
def test_the_examples_resume_at_an_epochs_end_trains_the_uninterrupted_batches(stop):
    """example.py's stop and resume (its loop and checkpoint, over make_dataloader's loader): stopped by max-steps at
    an epoch's end or inside one, the resumed run trains the batches of the uninterrupted one."""
    gas, epochs = 2, 3

    def build():
        sampler = _td_sampler(gradient_accumulation_steps=gas)
        return sampler, make_dataloader(_AugmentedDataset(_SEQLENS), sampler, collate_fn=varbatch.PaddedCollate())

    sampler, loader = build()
    per_epoch = len(sampler) // gas
    full, _, _ = _example_run(sampler, loader, gas, epochs, 10**9)
    at = {"end of epoch 0": per_epoch, "end of epoch 1": 2 * per_epoch, "inside epoch 1": per_epoch + 3}[stop]
    head, steps, state = _example_run(*build(), gas, epochs, at)
    sampler, loader = build()
    sampler.load_state_dict(state)
    rest, _, _ = _example_run(sampler, loader, gas, epochs, 10**9, steps)
    assert len(head) + len(rest) == len(full), f"{len(head)} + {len(rest)} batches for {len(full)}"
    assert head + rest == full


@pytest.mark.parametrize("arm", ["make", "direct"])
def test_a_loader_state_loads_anywhere_and_through_json(arm):
    """TestSnapshotZero, TestSnapshotEnd, the interrupted-shuffle and JSON tests, and load-then-state: a state saved
    right after iter() resumes the whole epoch, also loaded into a loader in the middle of its own epoch; a state
    loaded into the loader that saved it, after it moved on, rewinds it; a state through json.dumps/loads resumes
    exactly; right after load_state_dict the loader's state_dict is the loaded one."""
    _, loader = _td_build(arm)
    batches = iter(loader)
    at_start = loader.state_dict()
    epoch_0 = [_rows(batch) for batch in batches]
    _, other = _td_build(arm)
    moved = iter(other)
    next(moved), next(moved)
    other.load_state_dict(at_start)
    assert [_rows(batch) for batch in other] == epoch_0
    _, loader = _td_build(arm)
    batches = iter(loader)
    head = [_rows(next(batches)) for _ in range(4)]
    state = loader.state_dict()
    tail = [_rows(batch) for batch in batches]
    loader.load_state_dict(state)
    assert [_rows(batch) for batch in loader] == tail, "loaded into the loader that saved it"
    _, fresh = _td_build(arm)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == json.loads(json.dumps(state))
    assert head + [_rows(batch) for batch in fresh] == epoch_0


def test_a_stateful_loader_reads_what_torchs_loader_reads():
    """TestConcurrentDataLoaders: make_dataloader with StatefulDataLoader yields the batches of torch's loader."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    runs = []
    for loader_class in (None, stateful.StatefulDataLoader):
        sampler = _td_sampler()
        loader = make_dataloader(
            _AugmentedDataset(_SEQLENS), sampler, collate_fn=varbatch.PaddedCollate(), dataloader_class=loader_class
        )
        runs.append([_rows(batch) for epoch in range(2) if sampler.set_epoch(epoch) is None for batch in loader])
    assert runs[0] == runs[1]


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent workers"])
@pytest.mark.parametrize("arm", ["make", "direct", "torchdata"])
def test_resumes_with_3_workers_read_what_the_uninterrupted_run_reads(arm, persistent):
    """torchdata's worker resumes, 3 workers, a loop that calls no set_epoch: the uninterrupted run trains each
    epoch's plan; saved mid-epoch (snapshots every 3 steps), after an epoch's last batch inside its loop, after its
    loop ended, and 2 batches after a restore (the fast state request), the resumed run reads the samples and every
    worker's dataset draws of the uninterrupted one, varbatch's arms as torchdata's own sampler. In make mode,
    set_epoch(e + 1) after an end-of-epoch restore starts e + 1."""
    build = partial(_td_build, arm, 3, persistent_workers=persistent)
    full = _td_full(build, set_epoch=False)
    if arm != "torchdata":  # each epoch's plan (not epoch 0's again: a persistent iterator restarts on each pass)
        epochs = _sampler_epochs(_td_sampler(), range(_TD_EPOCHS))
        assert _ids(full) == [ids for e in range(_TD_EPOCHS) for ids in epochs[e]]
    for epoch, stop, snapshots in [(0, 10, 3), (0, "last", 1), (1, "end", 1)]:
        saving = partial(build, snapshot_every_n_steps=snapshots)
        head, state = _td_head(*saving(), epoch, stop, set_epoch=False)
        rest = _td_resumed(saving, head, state, epoch, stop, set_epoch=False)
        _check_resumed(full, head, rest, f"saved in epoch {epoch} at {stop}")
    head, state = _td_head(*build(), 0, 10, set_epoch=False)
    _, loader = build()
    loader.load_state_dict(state)
    batches = iter(loader)
    head += [(0, _rows(next(batches))) for _ in range(2)]
    rest = _td_resumed(build, head, loader.state_dict(), 0, 12, set_epoch=False)
    _check_resumed(full, head, rest, "saved 2 batches after a restore")
    if arm == "make":
        _, inside = _td_head(*build(), 0, "last", set_epoch=False)
        sampler, loader = build()
        loader.load_state_dict(inside)
        sampler.set_epoch(1)
        assert _ids([(1, _rows(batch)) for batch in loader]) == _ids([b for b in full if b[0] == 1])
