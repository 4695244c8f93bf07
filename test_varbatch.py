"""Tests of varbatch: properties of plans, an oracle, DeepSpeed parity, LR formulas, resume, bad input.

Grouped in the order of varbatch.py's sections. Run: ``python -m pytest test_varbatch.py``.
The DeepSpeed comparisons import DeepSpeed inside the tests and are skipped where it is not installed.
"""

import copy
import functools
import json
import math
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import varbatch
from varbatch import (
    PaddedCollate,
    VariableBatchSampler,
    VariableBatchSizeLR,
    make_dataloader,
    micro_batch_loss_weight,
    pad_sample,
    plan_batches,
    scale_lr,
    seqlens_from_padded,
)

settings.register_profile("varbatch", deadline=None, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("varbatch")


def _lengths(n, low=1, high=40, seed=0):
    """``n`` reproducible seqlens in ``[low, high]``."""
    return np.random.default_rng(seed).integers(low, high + 1, n).tolist()


def _deepspeed_batch_by_seqlens():
    """DeepSpeed's own ``batch_by_seqlens``."""
    module = pytest.importorskip("deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr")
    return module.batch_by_seqlens


def test_docstring_examples_run():
    """Every example in varbatch.py's docstrings prints what it shows."""
    import doctest
    result = doctest.testmod(varbatch, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result


def test_import_defines_names_only():
    """Importing varbatch prints nothing and leaves logging unconfigured; __all__ names exist."""
    code = ("import logging, varbatch; "
            "assert not logging.getLogger().handlers and not logging.getLogger('varbatch').handlers; "
            "missing = [n for n in varbatch.__all__ if not hasattr(varbatch, n)]; assert not missing, missing")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(varbatch.__file__).parent))
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""


# =============================================================================
# Validation
# =============================================================================


@pytest.mark.parametrize("seqlens, error, names", [
    ([3, -2, 4], ValueError, "seqlens[1]=-2"),
    ([3, 0], ValueError, "seqlens[1]=0"),
    ([3, 2.5], ValueError, "seqlens[1]=2.5"),
    ([3.0, float("nan")], ValueError, "seqlens[1]=nan"),
    ([[1, 2], [3, 4]], ValueError, "shape (2, 2)"),
    (["a", "b"], TypeError, "dtype <U1"),
    ("abc", TypeError, "seqlens='abc'"),
    ([True, False], TypeError, "dtype bool"),
])
def test_bad_seqlens(seqlens, error, names):
    """Invalid seqlens raise, naming the offending value."""
    with pytest.raises(error, match=re.escape(names)):
        plan_batches(seqlens, 10)


@pytest.mark.parametrize("max_tokens, error, names", [
    (0, ValueError, "max_tokens=0"),
    (-5, ValueError, "max_tokens=-5"),
    (2.5, TypeError, "max_tokens=2.5"),
    ("10", TypeError, "max_tokens='10'"),
    (True, TypeError, "max_tokens=True"),
])
def test_bad_max_tokens(max_tokens, error, names):
    """max_tokens below 1 or not an integer raises, naming the value."""
    with pytest.raises(error, match=re.escape(names)):
        plan_batches([1, 2, 3], max_tokens)


@pytest.mark.parametrize("effective_batch_size", [0, -1])
def test_bad_effective_batch_size(effective_batch_size):
    """effective_batch_size below 1 raises, naming the value."""
    with pytest.raises(ValueError, match=re.escape(f"effective_batch_size={effective_batch_size}")):
        plan_batches([1, 2, 3], 10, effective_batch_size=effective_batch_size)


@pytest.mark.parametrize("option, value, closest", [
    ("order", "randm", "random"),
    ("order", "seqlens", "seqlen"),
    ("budget", "pad", "padded"),
    ("on_overlong", "eror", "error"),
])
def test_unknown_choice_lists_valid_ones_and_suggests_closest(option, value, closest):
    """An unknown order, budget or on_overlong names the value, lists the valid ones and the closest."""
    valid = {"order": varbatch.ORDERS, "budget": varbatch.BUDGETS, "on_overlong": ("skip", "error")}[option]
    with pytest.raises(ValueError) as info:
        plan_batches([1, 2, 3], 10, **{option: value})
    message = str(info.value)
    assert repr(value) in message
    assert f"did you mean {closest!r}" in message
    for choice in valid:
        assert repr(choice) in message


# =============================================================================
# The planner
# =============================================================================


def _oracle_plan(seqlens, max_tokens, *, effective_batch_size=1, budget="sum", order="dataloader",
                 min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=False, same_length=False):
    """The plan, computed slowly and obviously from DESIGN.md's semantics (dataloader and seqlen orders).

    Returns ``(fixed, leftover, dropped)``: the micro-batches whose exact content is specified, the
    leftover micro-batches (fewer than k) that the planner must re-split into exactly k parts, or
    None when that is impossible (their samples are then dropped as tail), and reason -> sorted ids.
    """
    k = effective_batch_size
    chosen = list(range(len(seqlens))) if sample_ids is None else [int(i) for i in sample_ids]
    filtered = sorted(set(range(len(seqlens))) - set(chosen)) if sample_ids is not None else []
    over_budget = sorted(i for i in chosen if seqlens[i] > max_tokens)
    todo = [i for i in chosen if seqlens[i] <= max_tokens]
    if order == "seqlen":
        todo = sorted(todo, key=lambda i: (seqlens[i], i))  # ties by id, as DeepSpeed's sort of (len, id)
    cap = max_batch_size or len(todo)

    def cost(ids, longest=None):
        if budget == "sum":
            return sum(seqlens[i] for i in ids)
        return len(ids) * (longest if longest is not None else max(seqlens[i] for i in ids))

    too_small, tail, fixed, leftover = [], [], [], []
    pos = 0
    if same_size:
        # Whole batches: n rows of k consecutive samples, column b is micro-batch b, n as large as fits.
        def columns(n):
            chunk = todo[pos:pos + n * k]
            return [chunk[b::k] for b in range(k)]

        def fits(n):
            cols = columns(n)
            if budget == "padded" and same_length:
                longest = max(seqlens[i] for col in cols for i in col)
                return all(cost(col, longest) <= max_tokens for col in cols)
            return all(cost(col) <= max_tokens for col in cols)

        while pos + k <= len(todo):
            rows_left = (len(todo) - pos) // k
            n = max([n for n in range(1, min(cap, rows_left) + 1) if fits(n)], default=0)
            if n >= min_batch_size:
                fixed += columns(n)
                pos += n * k
            elif n + 1 > rows_left:  # stopped by the end of the data
                break
            else:  # stopped by the budget short of min_batch_size rows
                too_small.append(todo[pos])
                pos += 1
        tail = todo[pos:]
    else:
        greedy = []
        while pos < len(todo):
            c = max(c for c in range(1, min(cap, len(todo) - pos) + 1) if cost(todo[pos:pos + c]) <= max_tokens)
            if c >= min_batch_size:
                greedy.append(todo[pos:pos + c])
                pos += c
            elif pos + c == len(todo):  # stopped by the end of the data
                tail = todo[pos:]
                break
            else:  # stopped by the budget short of min_batch_size samples
                too_small.append(todo[pos])
                pos += 1
        full = len(greedy) - len(greedy) % k
        fixed, leftover = greedy[:full], greedy[full:]
        # A micro-batch of s samples splits into at most s // min_batch_size parts of min_batch_size or more.
        if leftover and sum(len(mb) // min_batch_size for mb in leftover) < k:
            tail = [i for mb in leftover for i in mb] + tail
            leftover = None
    dropped = {"over_budget": over_budget, "min_batch_size": sorted(too_small), "tail": sorted(tail),
               "filtered": filtered}
    return fixed, leftover, dropped


@st.composite
def plan_cases(draw, orders=("dataloader", "seqlen"), max_n=40, max_len=20):
    """Keyword arguments of plan_batches: lengths, budgets, k, shapes, batch-size bounds, subsets."""
    n = draw(st.integers(1, max_n))
    seqlens = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    budget = draw(st.sampled_from(varbatch.BUDGETS))
    same_size = draw(st.booleans())
    same_length = draw(st.booleans())
    if budget == "padded" and same_length:
        same_size = True
    min_bs = draw(st.integers(1, 3))
    max_bs = draw(st.one_of(st.none(), st.integers(min_bs, 8)))
    sample_ids = None
    if draw(st.booleans()):
        sample_ids = draw(st.permutations(range(n)).flatmap(lambda p: st.integers(1, n).map(lambda m: p[:m])))
    return dict(seqlens=seqlens, max_tokens=draw(st.integers(1, 3 * max_len)),
                effective_batch_size=draw(st.integers(1, 4)), budget=budget, order=draw(st.sampled_from(orders)),
                min_batch_size=min_bs, max_batch_size=max_bs, sample_ids=sample_ids, same_size=same_size,
                same_length=same_length, seed=draw(st.integers(0, 3)), epoch=draw(st.integers(0, 3)),
                bucket_size=draw(st.integers(1, 8)))


def _plan_or_none(case):
    """plan_batches(**case), or None when the case has too few samples for one batch."""
    try:
        return plan_batches(**case)
    except ValueError as error:
        if "not enough samples for one batch" in str(error) or "every sample is longer" in str(error):
            return None
        raise


def _oracle_case(case):
    """The oracle's keyword arguments from a plan case (the orders it knows)."""
    return {key: value for key, value in case.items() if key not in ("seed", "epoch", "bucket_size")}


@given(case=plan_cases(orders=varbatch.ORDERS))
def test_budget_never_exceeded(case):
    """No micro-batch costs more than max_tokens, under either budget and every order."""
    plan = _plan_or_none(case)
    if plan is None:
        return
    lens = np.asarray(case["seqlens"])
    k = plan.effective_batch_size
    for j, mb in enumerate(plan.microbatches()):
        if case["budget"] == "sum":
            cost = int(lens[mb].sum())
        elif case["same_length"]:  # every sample is padded to the batch's longest
            cost = len(mb) * int(plan.batch_max_seqlens[j // k])
        else:
            cost = len(mb) * int(lens[mb].max())
        assert cost <= case["max_tokens"], f"micro-batch {j} costs {cost} > max_tokens={case['max_tokens']}"


@given(case=plan_cases(orders=varbatch.ORDERS))
def test_every_sample_packed_once_or_reported(case):
    """Packed and dropped ids are disjoint, each appears once, and together they are every sample."""
    plan = _plan_or_none(case)
    if plan is None:
        return
    packed = plan.sample_ids.tolist()
    dropped = [i for ids in plan.dropped.values() for i in ids.tolist()]
    assert len(set(packed)) == len(packed), "a sample is packed twice"
    assert len(set(dropped)) == len(dropped), "a sample is dropped twice"
    assert not set(packed) & set(dropped), "a sample is both packed and dropped"
    assert sorted(packed + dropped) == list(range(len(case["seqlens"])))
    assert set(plan.dropped) == set(varbatch.DROP_REASONS)
    assert plan.num_dropped == len(dropped)
    if case["min_batch_size"] == 1:
        assert len(plan.dropped["tail"]) < plan.effective_batch_size
        assert len(plan.dropped["min_batch_size"]) == 0


@given(case=plan_cases(orders=varbatch.ORDERS))
def test_batches_are_whole_and_statistics_match(case):
    """Every batch holds k micro-batches, and batch_sizes/tokens/max seqlens describe them."""
    plan = _plan_or_none(case)
    if plan is None:
        return
    lens = np.asarray(case["seqlens"])
    k = plan.effective_batch_size
    mbs = plan.microbatches()
    assert len(mbs) == plan.num_microbatches == k * plan.num_batches
    assert [len(mb) for mb in mbs] == plan.microbatch_sizes().tolist()
    for b in range(plan.num_batches):
        ids = [i for mb in mbs[b * k:(b + 1) * k] for i in mb]
        assert plan.batch_sizes[b] == len(ids)
        assert plan.batch_tokens[b] == lens[ids].sum()
        assert plan.batch_max_seqlens[b] == lens[ids].max()


@given(case=plan_cases(orders=varbatch.ORDERS))
def test_min_and_max_batch_size_respected(case):
    """Every micro-batch holds between min_batch_size and max_batch_size samples."""
    plan = _plan_or_none(case)
    if plan is None:
        return
    sizes = plan.microbatch_sizes()
    assert sizes.min() >= case["min_batch_size"]
    if case["max_batch_size"]:
        assert sizes.max() <= case["max_batch_size"]


@given(case=plan_cases(orders=varbatch.ORDERS))
def test_same_size_micro_batches(case):
    """With same_size, every micro-batch of a batch holds the same number of samples."""
    case = dict(case, same_size=True)
    plan = _plan_or_none(case)
    if plan is None:
        return
    sizes = plan.microbatch_sizes().reshape(plan.num_batches, plan.effective_batch_size)
    assert (sizes == sizes[:, :1]).all(), sizes


@given(case=plan_cases(orders=varbatch.ORDERS))
def test_identical_inputs_give_identical_plans(case):
    """The plan depends only on its inputs: two calls agree in every field."""
    first, second = _plan_or_none(case), _plan_or_none(copy.deepcopy(case))
    if first is None:
        assert second is None
        return
    assert first.fingerprint() == second.fingerprint()
    for field in ("sample_ids", "microbatch_offsets", "batch_sizes", "batch_tokens", "batch_max_seqlens"):
        np.testing.assert_array_equal(getattr(first, field), getattr(second, field))
    for reason in varbatch.DROP_REASONS:
        np.testing.assert_array_equal(first.dropped[reason], second.dropped[reason])


@pytest.mark.parametrize("order", ["random", "bucket"])
@given(seqlens=st.lists(st.integers(1, 30), min_size=30, max_size=80), seed=st.integers(0, 10**6))
@settings(max_examples=20)
def test_random_orders_change_with_epoch(order, seqlens, seed):
    """random and bucket orders draw a new order each epoch, the same for a given (seed, epoch)."""
    plans = [plan_batches(seqlens, 40, order=order, seed=seed, epoch=e, bucket_size=4) for e in (0, 1, 0)]
    assert plans[0].sample_ids.tolist() != plans[1].sample_ids.tolist()
    assert plans[0].fingerprint() == plans[2].fingerprint()


def test_no_seed_means_a_fixed_seed():
    """seed=None gives the same random order every call (never an unseeded generator)."""
    seqlens = _lengths(50)
    plans = [plan_batches(seqlens, 60, order="random", seed=None) for _ in range(2)]
    assert plans[0].fingerprint() == plans[1].fingerprint()
    assert plans[0].sample_ids.tolist() != sorted(plans[0].sample_ids.tolist())


def _assert_matches_oracle(case):
    """plan_batches(**case) equals the oracle's plan."""
    fixed, leftover, dropped = _oracle_plan(**_oracle_case(case))
    plan = _plan_or_none(case)
    if plan is None:
        assert not fixed and not leftover, "plan_batches refused a case the oracle can pack"
        return
    mbs = plan.microbatches()
    assert mbs[:len(fixed)] == fixed
    rest = mbs[len(fixed):]
    if not leftover:
        assert rest == []
    else:
        # The leftover is re-split into exactly k parts, each a piece of one leftover micro-batch.
        k = case["effective_batch_size"]
        assert len(rest) == k, f"leftover {leftover} re-split into {rest}, not {k} parts"
        assert [i for mb in rest for i in mb] == [i for mb in leftover for i in mb]
        assert all(len(mb) >= case["min_batch_size"] for mb in rest)
        cuts = set(np.cumsum([len(mb) for mb in rest]).tolist())
        assert set(np.cumsum([len(mb) for mb in leftover]).tolist()) <= cuts, "a part joins two micro-batches"
    for reason in varbatch.DROP_REASONS:
        assert plan.dropped[reason].tolist() == dropped[reason], reason


@given(case=plan_cases())
# single sample
@example(case=dict(seqlens=[5], max_tokens=5, effective_batch_size=1, budget="sum", order="dataloader",
                   min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=False, same_length=False))
@example(case=dict(seqlens=[5], max_tokens=4, effective_batch_size=1, budget="padded", order="seqlen",
                   min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=True, same_length=True))
# all equal lengths
@example(case=dict(seqlens=[3] * 12, max_tokens=9, effective_batch_size=2, budget="sum", order="seqlen",
                   min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=False, same_length=False))
@example(case=dict(seqlens=[4] * 10, max_tokens=8, effective_batch_size=3, budget="padded", order="dataloader",
                   min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=True, same_length=True))
# sample exactly max_tokens
@example(case=dict(seqlens=[2, 7, 7, 1, 7], max_tokens=7, effective_batch_size=1, budget="sum", order="dataloader",
                   min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=False, same_length=False))
@example(case=dict(seqlens=[3, 6, 1, 2], max_tokens=6, effective_batch_size=2, budget="padded",
                   order="dataloader", min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=True,
                   same_length=False))
# min_batch_size that cannot be met mid-epoch
@example(case=dict(seqlens=[2, 2, 9, 2, 2, 2, 2], max_tokens=10, effective_batch_size=1, budget="sum",
                   order="dataloader", min_batch_size=2, max_batch_size=None, sample_ids=None, same_size=False,
                   same_length=False))
@example(case=dict(seqlens=[1, 1, 1, 1, 8, 1, 1, 1, 1, 1], max_tokens=8, effective_batch_size=2, budget="padded",
                   order="dataloader", min_batch_size=2, max_batch_size=None, sample_ids=None, same_size=True,
                   same_length=False))
# tail re-split
@example(case=dict(seqlens=[1] * 6, max_tokens=6, effective_batch_size=3, budget="sum", order="dataloader",
                   min_batch_size=2, max_batch_size=None, sample_ids=None, same_size=False, same_length=False))
@example(case=dict(seqlens=[1, 1, 8, 8, 1, 1], max_tokens=10, effective_batch_size=3, budget="sum",
                   order="dataloader", min_batch_size=2, max_batch_size=None, sample_ids=None, same_size=False,
                   same_length=False))
@example(case=dict(seqlens=[1] * 9, max_tokens=20, effective_batch_size=4, budget="sum", order="dataloader",
                   min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=False, same_length=False))
@example(case=dict(seqlens=[2, 2, 2, 2, 2, 5, 5], max_tokens=10, effective_batch_size=2, budget="sum",
                   order="seqlen", min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=False,
                   same_length=False))
@settings(max_examples=300)
def test_plan_matches_oracle(case):
    """plan_batches packs, drops and re-splits exactly as the slow oracle says."""
    _assert_matches_oracle(case)


def _ds_microbatches(seqlens, max_tokens, **kwargs):
    """DeepSpeed's micro-batches as lists of ids; [] where DeepSpeed packs too little for one batch."""
    ds_batch_by_seqlens = _deepspeed_batch_by_seqlens()
    try:
        microbatch_ids, _, _ = ds_batch_by_seqlens(list(seqlens), max_tokens, **kwargs)
    except AssertionError:  # "not enough datapoints to create a single sample per dataloader"
        return []
    return [list(ids) for _, ids in microbatch_ids]


def _assert_deepspeed_prefix(ours, theirs, k, same_size):
    """DeepSpeed's micro-batches are ours, except that its last micro-batch (batch) may be a prefix."""
    assert len(theirs) <= len(ours)
    relaxed = len(theirs) - (k if same_size else 1)
    for j, mb in enumerate(theirs):
        if j < relaxed:
            assert mb == ours[j], f"micro-batch {j}: DeepSpeed {mb}, varbatch {ours[j]}"
        else:
            assert mb == ours[j][:len(mb)], f"micro-batch {j}: DeepSpeed {mb} is not a prefix of {ours[j]}"


@st.composite
def deepspeed_cases(draw, orders=("dataloader", "seqlen")):
    """Small sum-budget cases (DeepSpeed's packer is cubic in the number of samples)."""
    n = draw(st.integers(1, 40))
    min_bs = draw(st.integers(1, 3))
    return dict(seqlens=draw(st.lists(st.integers(1, 20), min_size=n, max_size=n)),
                max_tokens=draw(st.integers(1, 60)), effective_batch_size=draw(st.integers(1, 4)),
                min_batch_size=min_bs, max_batch_size=draw(st.one_of(st.none(), st.integers(min_bs, 6))),
                same_size=draw(st.booleans()), order=draw(st.sampled_from(orders)),
                sample_ids=draw(st.one_of(st.none(), st.permutations(range(n)).map(lambda p: p[:max(1, n - 3)]))))


def _varbatch_microbatches(case, order=None):
    try:
        return plan_batches(case["seqlens"], case["max_tokens"], effective_batch_size=case["effective_batch_size"],
                            order=order or case["order"], min_batch_size=case["min_batch_size"],
                            max_batch_size=case["max_batch_size"], sample_ids=case["sample_ids"],
                            same_size=case["same_size"]).microbatches()
    except ValueError as error:
        assert "not enough samples" in str(error) or "every sample is longer" in str(error)
        return []


@given(case=deepspeed_cases())
@example(case=dict(seqlens=[2, 2, 1, 1], max_tokens=4, effective_batch_size=1, min_batch_size=1,
                   max_batch_size=None, same_size=False, order="seqlen", sample_ids=[3, 0, 2, 1]))
@settings(max_examples=80)
def test_deepspeed_parity_in_dataloader_and_seqlen_order(case):
    """On the samples DeepSpeed packs, its micro-batches are varbatch's (dataloader and seqlen order)."""
    ours = _varbatch_microbatches(case)
    theirs = _ds_microbatches(case["seqlens"], case["max_tokens"], sequence_ids_per_mb=case["sample_ids"],
                              min_batch_size=case["min_batch_size"], max_batch_size=case["max_batch_size"],
                              sequence_picking_order=case["order"],
                              effective_batch_size=case["effective_batch_size"],
                              required_microbatches_of_same_size=case["same_size"])
    _assert_deepspeed_prefix(ours, theirs, case["effective_batch_size"], case["same_size"])


@given(case=deepspeed_cases(orders=("random",)), seed=st.integers(0, 100), epoch=st.integers(0, 3))
@settings(max_examples=50)
def test_deepspeed_parity_in_random_order(case, seed, epoch):
    """varbatch's random order packs as DeepSpeed does in dataloader order on the permuted lengths."""
    seqlens = np.asarray(case["seqlens"])
    fits = seqlens <= case["max_tokens"]
    if not fits.any():
        return
    # The picking order: one sample per micro-batch, so the packed ids are the permutation itself.
    order = plan_batches(seqlens, case["max_tokens"], order="random", seed=seed, epoch=epoch,
                         max_batch_size=1).sample_ids
    assert sorted(order.tolist()) == np.flatnonzero(fits).tolist()
    try:
        ours = plan_batches(seqlens, case["max_tokens"], effective_batch_size=case["effective_batch_size"],
                            order="random", seed=seed, epoch=epoch, min_batch_size=case["min_batch_size"],
                            max_batch_size=case["max_batch_size"], same_size=case["same_size"]).microbatches()
    except ValueError as error:
        assert "not enough samples" in str(error)
        ours = []
    theirs = _ds_microbatches(seqlens[order], case["max_tokens"], min_batch_size=case["min_batch_size"],
                              max_batch_size=case["max_batch_size"], sequence_picking_order="dataloader",
                              effective_batch_size=case["effective_batch_size"],
                              required_microbatches_of_same_size=case["same_size"])
    theirs = [[int(order[p]) for p in mb] for mb in theirs]
    _assert_deepspeed_prefix(ours, theirs, case["effective_batch_size"], case["same_size"])


def test_deepspeed_loses_data_where_varbatch_does_not():
    """DeepSpeed never packs the final sample, stops at a min_batch_size failure and trims; varbatch keeps them."""
    # The final sample.
    ds = _ds_microbatches([3, 3, 3, 3, 3], 6)
    plan = plan_batches([3, 3, 3, 3, 3], 6)
    assert ds == [[0, 1], [2, 3]]
    assert plan.microbatches() == [[0, 1], [2, 3], [4]] and plan.num_dropped == 0
    # A sample that cannot meet min_batch_size: DeepSpeed ends the epoch there.
    seqlens = [2, 2, 9, 2, 2, 2, 2]
    ds = _ds_microbatches(seqlens, 10, min_batch_size=2)
    plan = plan_batches(seqlens, 10, min_batch_size=2)
    assert ds == [[0, 1]]
    assert plan.microbatches() == [[0, 1], [3, 4, 5, 6]]
    assert plan.dropped["min_batch_size"].tolist() == [2] and plan.num_dropped == 1
    # Micro-batches that do not fill a batch: DeepSpeed drops them, varbatch re-splits them.
    seqlens = [1] * 10
    ds = _ds_microbatches(seqlens, 4, effective_batch_size=2)
    plan = plan_batches(seqlens, 4, effective_batch_size=2)
    assert ds == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.microbatches() == [[0, 1, 2, 3], [4, 5, 6, 7], [8], [9]] and plan.num_dropped == 0


def test_batch_by_seqlens_returns_deepspeed_shapes():
    """batch_by_seqlens returns (batch_id, ids) per micro-batch, batch sizes and batch max seqlens."""
    seqlens = [3, 5, 2, 6, 4, 1]
    microbatch_ids, batch_sizes, batch_max_seqlens = varbatch.batch_by_seqlens(seqlens, 8, effective_batch_size=2)
    plan = plan_batches(seqlens, 8, effective_batch_size=2)
    assert microbatch_ids == [(j // 2, mb) for j, mb in enumerate(plan.microbatches())]
    assert batch_sizes == plan.batch_sizes.tolist()
    assert batch_max_seqlens == plan.batch_max_seqlens.tolist()


@pytest.mark.parametrize("sample_ids, names", [([0, 5], "sample_ids[1]=5"), ([-1, 0], "sample_ids[0]=-1")])
def test_sample_ids_out_of_range(sample_ids, names):
    """Sample ids outside the dataset raise, naming the id."""
    with pytest.raises(ValueError, match=re.escape(names)):
        plan_batches([1, 2, 3], 10, sample_ids=sample_ids)


def test_sample_ids_duplicated():
    """A sample id given twice raises, naming it."""
    with pytest.raises(ValueError, match=re.escape("(ids 1)")):
        plan_batches([1, 2, 3], 10, sample_ids=[0, 1, 1])


def test_sample_ids_not_integers():
    """Non-integer sample ids raise a TypeError naming their dtype."""
    with pytest.raises(TypeError, match="float64"):
        plan_batches([1, 2, 3], 10, sample_ids=[0.0, 1.0])


def test_every_sample_longer_than_max_tokens():
    """A budget that no sample fits raises, naming max_tokens and the shortest sample."""
    with pytest.raises(ValueError, match=re.escape("max_tokens=3 (shortest 4)")):
        plan_batches([5, 4, 9], 3)


def test_on_overlong_error():
    """on_overlong='error' refuses samples longer than max_tokens, naming them."""
    with pytest.raises(ValueError, match=re.escape("max_tokens=5 is smaller than 2 samples (ids 1, 3)")):
        plan_batches([2, 6, 3, 7], 5, on_overlong="error")
    assert plan_batches([2, 6, 3, 7], 5).dropped["over_budget"].tolist() == [1, 3]


def test_min_batch_size_above_max_batch_size():
    """min_batch_size > max_batch_size raises, naming both."""
    with pytest.raises(ValueError, match=re.escape("min_batch_size=3 and max_batch_size=2")):
        plan_batches([1, 2, 3], 10, min_batch_size=3, max_batch_size=2)


def test_not_enough_samples_for_one_batch():
    """Too few samples for one batch raises, saying how many are needed."""
    with pytest.raises(ValueError, match=re.escape("3 eligible samples") + ".*" + re.escape("needs at least 4")):
        plan_batches([1, 1, 1], 10, effective_batch_size=4)


def test_padded_same_length_needs_same_size():
    """budget='padded' with same_length and without same_size raises, naming the fix."""
    with pytest.raises(ValueError, match=re.escape("set same_size=True")):
        plan_batches([1, 2, 3], 10, budget="padded", same_length=True)


# =============================================================================
# Learning-rate math
# =============================================================================


def test_worked_example_scale_lr():
    """DESIGN.md section 5: lr 1e-3 at reference batch 2 becomes 5e-3 at B=10 and 2e-3 at B=4."""
    assert math.isclose(scale_lr(2, 10, 1e-3), 5e-3, rel_tol=1e-12)
    assert math.isclose(scale_lr(2, 4, 1e-3), 2e-3, rel_tol=1e-12)
    assert math.isclose(scale_lr(2, 8, 1e-3, "sqrt"), 2e-3, rel_tol=1e-12)
    assert scale_lr(2, 10, 1e-3, "none") == 1e-3
    assert math.isclose(scale_lr(2, 10, 1e-3, lambda r: r ** 2), 2.5e-2, rel_tol=1e-12)


@pytest.mark.parametrize("base_batch_size", [0, -2, float("nan")])
def test_scale_lr_bad_base_batch_size(base_batch_size):
    """scale_lr with base_batch_size <= 0 raises, naming the value."""
    with pytest.raises(ValueError, match=re.escape(f"base_batch_size={base_batch_size!r}")):
        scale_lr(base_batch_size, 4)


def test_unknown_lr_scaling_method():
    """An unknown LR method names the value, lists the valid ones and suggests the closest."""
    with pytest.raises(ValueError) as info:
        scale_lr(2, 4, method="lineer")
    message = str(info.value)
    assert "'lineer'" in message and "did you mean 'linear'" in message
    assert all(repr(m) in message for m in varbatch.LR_SCALING_METHODS)


def _token_dataset(seqlens, dim=3, seed=0):
    """Sample i: (inputs L_i x dim, targets L_i), float64."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, dim, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen,
                                                                                  dtype=torch.float64))
            for n in seqlens]


@pytest.mark.parametrize("unit", ["samples", "tokens"])
def test_loss_weights_give_the_full_batch_gradient(unit):
    """Weighted step-input losses, averaged over ranks and accumulation steps, give the batch mean's gradient."""
    num_replicas, gas, mbs = 2, 2, 1
    seqlens = _lengths(60, 1, 12, seed=4)
    data = _token_dataset(seqlens)
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    samplers = [VariableBatchSampler(seqlens, 24, micro_batch_size=mbs, gradient_accumulation_steps=gas,
                                     num_replicas=num_replicas, rank=r, order="random", seed=1)
                for r in range(num_replicas)]
    plan = samplers[0].plan
    steps = [list(s) for s in samplers]

    def token_losses(ids):  # one tensor per sample: per-token squared error
        return [(model(data[i][0]).squeeze(-1) - data[i][1]) ** 2 for i in ids]

    def step_loss(ids):
        losses = token_losses(ids)
        if unit == "samples":
            return torch.stack([l.mean() for l in losses]).mean(), len(ids)
        return torch.cat(losses).mean(), int(sum(seqlens[i] for i in ids))

    def gradient(weighted):
        model.zero_grad()
        for r in range(num_replicas):
            for a in range(gas):
                ids = steps[r][b * gas + a]
                loss, count = step_loss(ids)
                batch_count = plan.batch_sizes[b] if unit == "samples" else plan.batch_tokens[b]
                weight = micro_batch_loss_weight(count, int(batch_count), num_replicas=num_replicas,
                                                 gradient_accumulation_steps=gas) if weighted else 1.0
                (loss * weight / gas).backward()  # DeepSpeed divides the loss by gas ...
        return [p.grad / num_replicas for p in model.parameters()]  # ... and averages over ranks

    unweighted_differs = False
    for b in range(plan.num_batches):
        batch_ids = [i for r in range(num_replicas) for a in range(gas) for i in steps[r][b * gas + a]]
        assert sorted(batch_ids) == sorted(i for j in range(b * 4, b * 4 + 4) for i in plan.microbatch(j))
        model.zero_grad()
        full, _ = step_loss(batch_ids)
        full.backward()
        expected = [p.grad.clone() for p in model.parameters()]
        for got, want in zip(gradient(weighted=True), expected):
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), f"batch {b}: {got} != {want}"
        unweighted_differs |= not all(torch.allclose(g, w) for g, w in zip(gradient(weighted=False), expected))
    assert unweighted_differs, "the data never has micro-batches of different sizes: the test proves nothing"


# =============================================================================
# Torch adapters: padding, collate, the batch sampler
# =============================================================================


@given(seqlens=st.lists(st.integers(1, 9), min_size=1, max_size=6), width=st.integers(0, 3))
@settings(max_examples=30)
def test_padded_collate_round_trip(seqlens, width):
    """PaddedCollate pads to B x S x ...; seqlens_from_padded recovers the real lengths."""
    shape = (lambda n: (n,)) if width == 0 else (lambda n: (n, width))
    samples = [torch.randint(1, 5, shape(n)) for n in seqlens]
    padded, lens = PaddedCollate()(samples)
    assert padded.shape == (len(seqlens), max(seqlens), *shape(1)[1:])
    assert lens.tolist() == seqlens
    assert seqlens_from_padded((padded, lens)) == seqlens
    assert seqlens_from_padded(padded) == seqlens
    for row, sample, n in zip(padded, samples, seqlens):
        assert torch.equal(row[:n], sample) and not row[n:].any()
    tokens, targets, lens = PaddedCollate(pad_value=0)([(s, s.sum(0)) for s in samples])
    assert tokens.shape[:2] == (len(seqlens), max(seqlens)) and targets.shape[0] == len(seqlens)
    assert lens.tolist() == seqlens


def test_pad_sample():
    """pad_sample pads the first dimension with pad_value and keeps the sample."""
    out = pad_sample(torch.tensor([[1, 2], [3, 4]]), 4, pad_value=-1)
    assert out.tolist() == [[1, 2], [3, 4], [-1, -1], [-1, -1]]
    assert pad_sample([5, 6, 7], 3).tolist() == [5, 6, 7]
    assert functools.partial(pad_sample, pad_value=9)(torch.tensor([1]), 2).tolist() == [1, 9]


def test_pad_sample_shorter_than_sample():
    """pad_sample to a length below the sample's raises, naming both lengths."""
    with pytest.raises(ValueError, match=re.escape("seqlen 3 to length=2")):
        pad_sample(torch.ones(3), 2)


def test_callbacks_are_picklable():
    """PaddedCollate, pad_sample and the internal collate survive pickling (spawned workers)."""
    samples = [torch.arange(1, n + 1) for n in (3, 1, 2)]
    collate = pickle.loads(pickle.dumps(PaddedCollate(pad_value=0)))
    assert collate(samples)[1].tolist() == [3, 1, 2]
    assert pickle.loads(pickle.dumps(pad_sample))(torch.ones(1), 3).tolist() == [1, 0, 0]
    inner = varbatch._Collate(samples, PaddedCollate(), pad_sample)
    restored = pickle.loads(pickle.dumps(inner))
    x, lens = restored([(0, (0, 2), 3), (0, (1,), 3)])
    # Padded to the batch's max seqlen, but the lengths reported are the real ones.
    assert x.shape == (3, 3) and lens.tolist() == [3, 2, 1]


@pytest.mark.parametrize("num_replicas, micro_batch_size, gas", [(1, 1, 1), (2, 1, 3), (3, 2, 1), (2, 2, 2)])
@pytest.mark.parametrize("order", ["dataloader", "random", "bucket"])
def test_sampler_ranks_split_the_plan(num_replicas, micro_batch_size, gas, order):
    """Equal exact len on every rank, and the ranks' step inputs together are the plan's samples, once."""
    seqlens = _lengths(150, 1, 30, seed=2)
    samplers = [VariableBatchSampler(seqlens, 50, micro_batch_size=micro_batch_size, gradient_accumulation_steps=gas,
                                     num_replicas=num_replicas, rank=r, order=order, seed=7, bucket_size=16)
                for r in range(num_replicas)]
    plan = samplers[0].plan
    lengths = [len(s) for s in samplers]
    runs = [list(s) for s in samplers]
    assert set(lengths) == {plan.num_batches * gas}
    assert [len(run) for run in runs] == lengths
    union = [i for run in runs for step in run for i in step]
    assert sorted(union) == sorted(plan.sample_ids.tolist())
    for b in range(plan.num_batches):  # the step inputs of batch b hold exactly batch b's samples
        ids = [i for run in runs for step in run[b * gas:(b + 1) * gas] for i in step]
        assert len(ids) == plan.batch_sizes[b]


@pytest.mark.parametrize("num_replicas, micro_batch_size, gas", [(2, 1, 2), (3, 2, 1), (2, 2, 3)])
def test_sampler_interleaving_matches_deepspeed(num_replicas, micro_batch_size, gas):
    """Each rank gets DeepSpeed's micro-batches: micro-batch j to rank j % num_replicas."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
        dataloader_for_variable_batch_size)
    seqlens = _lengths(120, 1, 30, seed=3)
    k = num_replicas * micro_batch_size * gas
    plan = plan_batches(seqlens, 45, effective_batch_size=k)
    microbatch_ids = [(j // k, mb) for j, mb in enumerate(plan.microbatches())]
    for rank in range(num_replicas):
        loader, _ = dataloader_for_variable_batch_size(
            list(range(len(seqlens))), microbatch_ids, plan.batch_max_seqlens.tolist(), dataloader_rank=rank,
            dataloader_batch_size=micro_batch_size, dataloader_num_replicas=num_replicas, dataloader_num_workers=0)
        sampler = VariableBatchSampler(seqlens, 45, micro_batch_size=micro_batch_size,
                                       gradient_accumulation_steps=gas, num_replicas=num_replicas, rank=rank)
        assert list(sampler) == [list(step) for step in loader]


def test_sampler_set_epoch_and_auto_advance():
    """set_epoch changes the random order; a full iteration advances to the next epoch by itself."""
    seqlens = _lengths(80, seed=5)
    sampler = VariableBatchSampler(seqlens, 60, order="random", seed=3)
    first = list(sampler)
    assert sampler.epoch == 1
    second = list(sampler)
    assert sampler.epoch == 2
    assert first != second
    assert second == [mb for mb in sampler.plan_for_epoch(1).microbatches()]
    sampler.set_epoch(0)
    assert list(sampler) == first
    sampler.set_epoch(5)
    fifth = list(sampler)
    assert fifth == sampler.plan_for_epoch(5).microbatches() and fifth not in (first, second)


def test_make_dataloader_with_workers():
    """make_dataloader with two worker processes yields the sampler's step inputs, epoch after epoch."""
    seqlens = _lengths(40, 1, 10, seed=6)
    dataset = [torch.full((n,), i + 1) for i, n in enumerate(seqlens)]
    options = dict(micro_batch_size=2, gradient_accumulation_steps=1, num_replicas=1, order="random", seed=2)
    reference = VariableBatchSampler(seqlens, 25, **options)
    loader = make_dataloader(dataset, VariableBatchSampler(seqlens, 25, **options), collate_fn=PaddedCollate(),
                             num_workers=2)
    for _ in range(2):
        expected = list(reference)
        got = list(loader)
        assert len(got) == len(expected) == len(loader)
        for ids, (x, lens) in zip(expected, got):
            assert (x[:, 0] - 1).tolist() == ids
            assert lens.tolist() == [seqlens[i] for i in ids]


@given(seqlens=st.lists(st.integers(1, 12), min_size=8, max_size=40), num_replicas=st.integers(1, 2),
       gas=st.integers(1, 2), micro_batch_size=st.integers(1, 2), budget=st.sampled_from(varbatch.BUDGETS))
@settings(max_examples=20)
def test_same_length_step_inputs_have_the_batch_shape(seqlens, num_replicas, gas, micro_batch_size, budget):
    """Pipeline mode: every step input of a batch has the same count per micro-batch and S = batch max seqlen."""
    dataset = [torch.full((n,), i + 1) for i, n in enumerate(seqlens)]
    options = dict(micro_batch_size=micro_batch_size, gradient_accumulation_steps=gas, num_replicas=num_replicas,
                   budget=budget, same_size=True, same_length=True, order="seqlen")
    try:
        samplers = [VariableBatchSampler(seqlens, 24, rank=r, **options) for r in range(num_replicas)]
    except ValueError as error:
        assert "not enough samples" in str(error)
        return
    plan = samplers[0].plan
    runs = [list(make_dataloader(dataset, s, collate_fn=PaddedCollate(), sample_padding_fn=pad_sample))
            for s in samplers]
    for b in range(plan.num_batches):
        per_micro = plan.microbatch_sizes()[b * plan.effective_batch_size]
        for run in runs:
            for x, _ in run[b * gas:(b + 1) * gas]:
                assert x.shape == (per_micro * micro_batch_size, plan.batch_max_seqlens[b])
                assert seqlens_from_padded(x) == [seqlens[int(i) - 1] for i in x[:, 0]]


def test_make_dataloader_needs_padding_fn_in_same_length_mode():
    """Same-length mode without sample_padding_fn raises, naming the parameter and the fix."""
    sampler = VariableBatchSampler([3, 4, 5, 2], 10, same_size=True, same_length=True)
    with pytest.raises(ValueError, match=re.escape("sample_padding_fn is None")):
        make_dataloader([torch.ones(n) for n in (3, 4, 5, 2)], sampler)
    with pytest.raises(ValueError, match=re.escape("sample_padding_fn is None")):
        varbatch.dataloader_for_variable_batch_size([torch.ones(3)], [(0, [0])], [3],
                                                    required_microbatches_of_same_seqlen=True)


def test_padding_fn_returning_the_wrong_length():
    """A sample_padding_fn that does not pad to the batch max raises, naming both lengths."""
    seqlens = [3, 5, 2, 4]
    sampler = VariableBatchSampler(seqlens, 20, same_size=True, same_length=True)
    loader = make_dataloader([torch.ones(n) for n in seqlens], sampler, sample_padding_fn=lambda s, n: s)
    with pytest.raises(ValueError, match=r"sample of length 5, but returned length [234] for sample"):
        list(loader)


@pytest.mark.parametrize("kwargs, error, names", [
    (dict(micro_batch_size=0), ValueError, "micro_batch_size=0"),
    (dict(gradient_accumulation_steps=1.5), TypeError, "gradient_accumulation_steps=1.5"),
    (dict(num_replicas=2, rank=2), ValueError, "rank=2 with num_replicas=2"),
    (dict(seed=-1), ValueError, "seed=-1"),
])
def test_bad_sampler_arguments(kwargs, error, names):
    """Invalid sampler arguments raise, naming the value."""
    with pytest.raises(error, match=re.escape(names)):
        VariableBatchSampler([1, 2, 3, 4], 10, **kwargs)


def test_make_dataloader_needs_a_variable_batch_sampler():
    """make_dataloader refuses another sampler, naming its type."""
    with pytest.raises(TypeError, match="BatchSampler"):
        make_dataloader([1, 2], torch.utils.data.BatchSampler(range(2), 1, False))


def test_make_dataloader_refuses_seqlens_of_another_dataset_size():
    """Seqlens for 3 samples with a dataset of 4 is refused before any batch, naming both sizes."""
    sampler = VariableBatchSampler([2, 2, 2], 4)
    with pytest.raises(ValueError, match=r"dataset has 4 samples.*3 seqlens"):
        make_dataloader([torch.ones(2)] * 4, sampler)


def test_samples_that_disagree_with_their_seqlens_are_refused():
    """A sample whose real length differs from the planned seqlen fails loudly, naming the sample."""
    dataset = [torch.ones(2), torch.ones(5), torch.ones(2)]  # sample 1 is 5 long, planned as 2
    loader = make_dataloader(dataset, VariableBatchSampler([2, 2, 2], 4), collate_fn=PaddedCollate())
    with pytest.raises(ValueError, match=r"sample 1 has length 5, but it was planned with seqlen 2"):
        list(loader)


_TWO_RANK_SCRIPT = """
import datetime, json, os, sys
import numpy as np, torch, torch.distributed as dist
import varbatch
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
seqlens = np.random.default_rng(3).integers(1, 50, 101)  # 101 samples: no even split over 2 ranks
sampler = varbatch.VariableBatchSampler(seqlens, 120, micro_batch_size=2, gradient_accumulation_steps=3,
                                        order="random", seed=5)
seen, steps = [], 0
for epoch in range(2):
    sampler.set_epoch(epoch)
    for ids in sampler:
        signal = torch.tensor([1.0])
        dist.all_reduce(signal)  # a collective every step: unequal step counts would hang here
        seen.append(ids)
        steps += 1
print(json.dumps({"rank": rank, "steps": steps, "len": len(sampler), "seen": seen}))
dist.destroy_process_group()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_take_equal_steps_on_an_uneven_dataset(tmp_path):
    """With 2 real gloo ranks and 101 samples, both ranks take the same steps and together train the plan."""
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANK_SCRIPT)
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=str(Path(varbatch.__file__).parent))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0]["steps"] == outs[1]["steps"] > 0
    seqlens = np.random.default_rng(3).integers(1, 50, 101)
    for epoch in range(2):
        plan = plan_batches(seqlens, 120, effective_batch_size=12, order="random", seed=5, epoch=epoch)
        steps = plan.num_batches * 3
        both = [ids for out in outs for ids in out["seen"][epoch * steps:(epoch + 1) * steps]]
        trained = sorted(i for ids in both for i in ids)
        assert trained == sorted(plan.sample_ids.tolist()), f"epoch {epoch}: the ranks did not split the plan"
        assert len(trained) + plan.num_dropped == 101


# =============================================================================
# The LR scheduler
# =============================================================================

_BASE_LR = 0.1


def _optimizer(lr=_BASE_LR):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _check_lr(t, expected, got):
    assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-15), \
        f"LR is wrong at step {t}: expected {expected}, got {got}"


def _train(sampler, scheduler, optimizer, epochs, realign=False):
    """A training loop over ``epochs`` epochs; returns (t, epoch, batch, lr) at each optimizer step."""
    gas = sampler.gradient_accumulation_steps
    seen, t = [], 0
    for epoch in range(epochs):
        assert sampler.epoch == epoch
        if realign:
            scheduler.step(0)
        for i, _ in enumerate(sampler):
            if i % gas == 0:
                lr = optimizer.param_groups[0]["lr"]
                assert scheduler.get_last_lr()[0] == lr
                seen.append((t, epoch, i // gas, lr))
            if i % gas == gas - 1:
                optimizer.step()
                scheduler.step()
                t += 1
    return seen


def _sampler(**kwargs):
    options = dict(micro_batch_size=2, gradient_accumulation_steps=2, num_replicas=1, order="random", seed=11)
    options.update(kwargs)
    return VariableBatchSampler(_lengths(120, 1, 40, seed=8), 70, **options)


def _mean_size(sampler, unit="sequences"):
    plan = sampler.plan_for_epoch(0)
    return float((plan.batch_tokens if unit == "tokens" else plan.batch_sizes).mean())


_WARMUP = 5


def _warmup(t):
    return min(1.0, (t + 1) / _WARMUP)


_SCHEDULES = {
    # name: (make the wrapped scheduler, its closed form schedule(t) / base lr)
    "LambdaLR warmup": (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup), _warmup),
    "LinearLR warmup": (lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=4),
                        lambda t: 0.2 + 0.8 * min(t, 4) / 4),
    "SequentialLR": (lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4),
              torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)], milestones=[4]),
        lambda t: 0.25 + 0.75 * t / 4 if t < 4 else 0.9 ** (t - 4)),
    "ChainedScheduler": (lambda opt: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=3),
         torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)]),
        lambda t: (0.5 if t < 3 else 1.0) * 0.95 ** t),
    "constant (optimizer)": (lambda opt: opt, lambda t: 1.0),
}


@pytest.mark.parametrize("schedule", list(_SCHEDULES))
@pytest.mark.parametrize("method", ["linear", "sqrt"])
def test_lr_closed_form_over_epochs(schedule, method):
    """lr_t = schedule(t) x s(B_t / B_ref) at every step of 3 epochs, with a new plan each epoch."""
    sampler = _sampler()
    optimizer = _optimizer()
    make, closed_form = _SCHEDULES[schedule]
    reference = _mean_size(sampler)
    scheduler = VariableBatchSizeLR(make(optimizer), reference, sampler, lr_scaling_method=method)
    scale = (lambda r: r) if method == "linear" else math.sqrt
    seen = _train(sampler, scheduler, optimizer, epochs=3)
    assert [e for _, e, _, _ in seen].count(0) == sampler.plan_for_epoch(0).num_batches
    assert sampler.plan_for_epoch(0).batch_sizes.tolist() != sampler.plan_for_epoch(1).batch_sizes.tolist()
    for t, epoch, b, lr in seen:
        size = sampler.plan_for_epoch(epoch).batch_sizes[b]
        _check_lr(t, _BASE_LR * closed_form(t) * scale(size / reference), lr)


def test_lr_mean_reference():
    """base_batch_size='mean' divides by each epoch's mean batch size, so the epoch's mean factor is 1."""
    sampler = _sampler()
    optimizer = _optimizer()
    scheduler = VariableBatchSizeLR(optimizer, "mean", sampler)
    seen = _train(sampler, scheduler, optimizer, epochs=3)
    for epoch in range(3):
        sizes = sampler.plan_for_epoch(epoch).batch_sizes
        lrs = [lr for _, e, _, lr in seen if e == epoch]
        assert math.isclose(np.mean(lrs), _BASE_LR, rel_tol=1e-9)
        for (t, _, b, lr) in [s for s in seen if s[1] == epoch]:
            _check_lr(t, _BASE_LR * sizes[b] / sizes.mean(), lr)


def test_lr_tokens_unit():
    """lr_scaling_unit='tokens' scales by the batch's real token count."""
    sampler = _sampler()
    optimizer = _optimizer()
    reference = _mean_size(sampler, "tokens")
    scheduler = VariableBatchSizeLR(torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup), reference, sampler,
                                    lr_scaling_method="sqrt", lr_scaling_unit="tokens")
    for t, epoch, b, lr in _train(sampler, scheduler, optimizer, epochs=3):
        tokens = sampler.plan_for_epoch(epoch).batch_tokens[b]
        _check_lr(t, _BASE_LR * _warmup(t) * math.sqrt(tokens / reference), lr)


def test_step_zero_realigns_without_restarting():
    """step(0) at each epoch start changes nothing in sync, never restarts the schedule, and realigns."""
    runs = []
    for realign in (False, True):
        sampler = _sampler()
        optimizer = _optimizer()
        base = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup)
        scheduler = VariableBatchSizeLR(base, _mean_size(sampler), sampler)
        runs.append(_train(sampler, scheduler, optimizer, epochs=3, realign=realign))
        assert base.last_epoch == scheduler.last_epoch == len(runs[-1])
    assert runs[0] == runs[1]
    sampler.set_epoch(7)
    scheduler.step(0)
    assert scheduler.steps_in_epoch == 0
    assert scheduler.batch_size == sampler.plan_for_epoch(7).batch_sizes[0]
    assert base.last_epoch == scheduler.last_epoch == len(runs[-1])


def test_lr_worked_example_through_scheduler():
    """DESIGN.md section 5 through the scheduler: 1e-3 at B_ref=2 is 5e-3 at B=10, then 2e-3 at B=4."""
    optimizer = _optimizer(lr=1e-3)
    with pytest.warns(UserWarning, match="mean LR factor"):  # mean factor 3.5: the unit-trap warning
        scheduler = VariableBatchSizeLR(optimizer, 2, [10, 4])
    _check_lr(0, 5e-3, scheduler.get_last_lr()[0])
    optimizer.step()
    scheduler.step()
    _check_lr(1, 2e-3, scheduler.get_last_lr()[0])
    _check_lr(1, 2e-3, optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("schedule", ["LambdaLR warmup", "SequentialLR", "ChainedScheduler", "constant (optimizer)"])
def test_no_warnings_while_stepping(schedule):
    """Building and stepping the scheduler emits no warning when the mean LR factor is in [0.5, 2]."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = _sampler()
        optimizer = _optimizer()
        scheduler = VariableBatchSizeLR(_SCHEDULES[schedule][0](optimizer), _mean_size(sampler), sampler,
                                        lr_scaling_method="sqrt")
        _train(sampler, scheduler, optimizer, epochs=3, realign=True)
        scheduler.get_last_lr()
        scheduler.load_state_dict(scheduler.state_dict())


def test_warns_once_when_mean_factor_is_far_from_one(caplog):
    """With DeepSpeed's default reference (micro-batches, not sequences): one warning naming the fix, then each
    epoch's factors are logged, not warned again."""
    sampler = _sampler(gradient_accumulation_steps=1)
    optimizer = _optimizer()
    assert _mean_size(sampler) > 2 * sampler.effective_batch_size
    with pytest.warns(UserWarning, match="mean LR factor of epoch 0 .*lr_scaling_reference='mean'"):
        scheduler = VariableBatchSizeLR(optimizer, sampler.effective_batch_size, sampler)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO", logger="varbatch"):
        warnings.simplefilter("always")
        _train(sampler, scheduler, optimizer, epochs=2)
    assert [str(w.message) for w in caught] == []
    logged = [r.getMessage() for r in caplog.records if "LR factor mean" in r.getMessage()]
    assert [m.split(":")[0] for m in logged] == ["epoch 1", "epoch 2"], logged


def test_lr_factor_report_only_on_rank_0(caplog):
    """Rank 1 neither warns nor logs the LR factors: one report per job, not one per rank."""
    sampler = _sampler(gradient_accumulation_steps=1, num_replicas=2, rank=1)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO", logger="varbatch"):
        warnings.simplefilter("always")
        VariableBatchSizeLR(_optimizer(), sampler.effective_batch_size, sampler)
    assert caught == [] and not [r for r in caplog.records if "LR factor" in r.getMessage()]


class _WrappedOptimizer:
    """Stands for DeepSpeed's optimizer wrappers (ZeRO, fp16): .optimizer, .step, .param_groups."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.steps = 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        self.steps += 1
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()


@pytest.mark.parametrize("wrap_scheduler", [False, True])
def test_deepspeed_style_optimizer_wrapper(wrap_scheduler):
    """A DeepSpeed-style optimizer wrapper is unwrapped: constant LR, and the scheduler never steps it."""
    sampler = _sampler()
    inner = _optimizer()
    wrapper = _WrappedOptimizer(inner)
    reference = _mean_size(sampler)
    if wrap_scheduler:
        base = torch.optim.lr_scheduler.LambdaLR(inner, _warmup)
        scheduler = varbatch.lr_scheduler_for_variable_batch_size(reference, sampler, None, base)
    else:
        scheduler = varbatch.lr_scheduler_for_variable_batch_size(reference, sampler, None, wrapper)
    assert scheduler.optimizer is inner
    form = _warmup if wrap_scheduler else (lambda t: 1.0)
    seen = _train(sampler, scheduler, wrapper, epochs=3)
    assert wrapper.steps == len(seen), "the scheduler stepped the optimizer"
    for t, epoch, b, lr in seen:
        _check_lr(t, _BASE_LR * form(t) * sampler.plan_for_epoch(epoch).batch_sizes[b] / reference, lr)


def test_scheduler_step_with_an_epoch():
    """step(5) raises, naming the argument and the fix."""
    scheduler = VariableBatchSizeLR(_optimizer(), 2, [2, 2])
    with pytest.raises(ValueError, match=re.escape("epoch=5")):
        scheduler.step(5)


def test_scheduler_bad_arguments():
    """Unknown LR method, tokens without a sampler and a bad reference raise, naming the value."""
    with pytest.raises(ValueError, match=re.escape("'sqr' (did you mean 'sqrt'?)")):
        VariableBatchSizeLR(_optimizer(), 2, [2, 2], lr_scaling_method="sqr")
    with pytest.raises(ValueError, match=re.escape("lr_scaling_unit='tokens'")):
        VariableBatchSizeLR(_optimizer(), 2, [2, 2], lr_scaling_unit="tokens")
    with pytest.raises(ValueError, match=re.escape("base_batch_size=0")):
        VariableBatchSizeLR(_optimizer(), 0, [2, 2])
    with pytest.raises(ValueError, match=re.escape("batch_sizes=[]")):
        VariableBatchSizeLR(_optimizer(), 2, [])
    with pytest.raises(TypeError, match="lr_scheduler_or_optimizer is None"):
        varbatch.lr_scheduler_for_variable_batch_size(2, [2], None, None)


# -- resume ------------------------------------------------------------------

_RESUME_SEQLENS = _lengths(40, 1, 20, seed=9)
_RESUME_STEPS = 60  # step inputs of the reference run: more than 3 epochs


class _Run:
    """One rank's training loop: sampler, wrapped LR schedule, and what it has trained on."""

    GAS = 2

    def __init__(self):
        self.sampler = VariableBatchSampler(_RESUME_SEQLENS, 30, micro_batch_size=1,
                                            gradient_accumulation_steps=self.GAS, num_replicas=2, rank=1,
                                            order="random", seed=5)
        self.optimizer = _optimizer()
        base = torch.optim.lr_scheduler.SequentialLR(
            self.optimizer, [torch.optim.lr_scheduler.LinearLR(self.optimizer, start_factor=0.5, total_iters=3),
                             torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=0.97)], milestones=[3])
        self.scheduler = VariableBatchSizeLR(base, 4.0, self.sampler, lr_scaling_method="sqrt")
        self.done = 0  # step inputs trained on, saved with the checkpoint (as a training loop does)
        self.iterator = iter(self.sampler)

    def next(self):
        """Trains on the next step input; returns it with the LR it was trained with."""
        try:
            step = next(self.iterator)
        except StopIteration:  # the epoch is over; the sampler advanced by itself
            self.iterator = iter(self.sampler)
            step = next(self.iterator)
        lr = self.optimizer.param_groups[0]["lr"]
        assert self.scheduler.get_last_lr() == [lr]
        self.done += 1
        if self.done % self.GAS == 0:
            self.optimizer.step()
            self.scheduler.step()
        return tuple(step), lr

    def state(self):
        """The checkpoint, through JSON: state_dict()s are plain data."""
        return json.loads(json.dumps({"sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict(),
                                      "done": self.done}))

    @classmethod
    def resumed(cls, state):
        run = cls()
        run.sampler.load_state_dict(state["sampler"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.done = state["done"]
        run.iterator = iter(run.sampler)
        return run


@functools.lru_cache(maxsize=None)
def _reference_run():
    run = _Run()
    return tuple(run.next() for _ in range(_RESUME_STEPS))


class ResumeMachine(RuleBasedStateMachine):
    """Stopping anywhere and resuming from state_dict()s into fresh objects changes no step input nor LR."""

    def __init__(self):
        super().__init__()
        self.run = _Run()
        self.trained = []

    @rule(steps=st.integers(1, 9))
    def train(self, steps):
        for _ in range(min(steps, _RESUME_STEPS - len(self.trained))):
            self.trained.append(self.run.next())

    @rule()
    def stop_and_resume(self):
        self.run = _Run.resumed(self.run.state())

    @invariant()
    def same_as_uninterrupted(self):
        reference = _reference_run()
        assert self.trained == list(reference[:len(self.trained)])


ResumeMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=25, deadline=None)
TestResume = ResumeMachine.TestCase


def test_reference_run_spans_several_epochs():
    """The resume test's reference run crosses epoch boundaries (else it would prove little)."""
    run = _Run()
    per_epoch = len(run.sampler)
    assert _RESUME_STEPS > 3 * per_epoch
    assert run.sampler.plan_for_epoch(0).fingerprint() != run.sampler.plan_for_epoch(1).fingerprint()


@pytest.mark.parametrize("owner", ["sampler", "scheduler"])
def test_load_state_dict_rejects_unknown_keys_and_keeps_its_argument(owner):
    """load_state_dict names an unknown key, and never mutates the dict it is given."""
    run = _Run()
    for _ in range(5):
        run.next()
    target = getattr(_Run(), owner)
    state = getattr(run, owner).state_dict()
    before = copy.deepcopy(state)
    target.load_state_dict(state)
    assert state == before
    with pytest.raises(ValueError, match=re.escape("unknown keys ['bogus']")):
        target.load_state_dict(dict(state, bogus=1))


def test_sampler_refuses_another_seed_config_or_world_size():
    """A sampler state saved with another seed, max_tokens, dataset or world size is refused, naming it."""
    seqlens = _lengths(60, seed=10)
    state = VariableBatchSampler(seqlens, 50, num_replicas=2, rank=0, order="random", seed=1).state_dict()
    before = copy.deepcopy(state)
    with pytest.raises(ValueError, match=re.escape("seed=1 into a sampler with seed=2")):
        VariableBatchSampler(seqlens, 50, num_replicas=2, rank=0, order="random", seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=re.escape("max_tokens=50 into a sampler with max_tokens=51")):
        VariableBatchSampler(seqlens, 51, num_replicas=2, rank=0, order="random", seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=re.escape("num_replicas=2 into a sampler with num_replicas=1")):
        VariableBatchSampler(seqlens, 50, num_replicas=1, rank=0, order="random", seed=1).load_state_dict(state)
    other = list(seqlens)
    other[0] += 1
    with pytest.raises(ValueError, match=re.escape("other seqlens (another dataset?)")):
        VariableBatchSampler(other, 50, num_replicas=2, rank=0, order="random", seed=1).load_state_dict(state)
    assert state == before, "load_state_dict changed its argument"


def test_scheduler_refuses_another_seed_or_settings():
    """A scheduler state saved for other batch sizes or LR settings is refused."""
    seqlens = _lengths(60, seed=10)
    samplers = [VariableBatchSampler(seqlens, 50, order="random", seed=s) for s in (1, 2)]
    assert samplers[0].plan.batch_sizes.tolist() != samplers[1].plan.batch_sizes.tolist()
    state = VariableBatchSizeLR(_optimizer(), "mean", samplers[0]).state_dict()
    with pytest.raises(ValueError, match=re.escape("sampler was saved with seed=1 into a sampler with seed=2")):
        VariableBatchSizeLR(_optimizer(), "mean", samplers[1]).load_state_dict(state)
    # Batch sizes alone (a list, no sampler to compare settings with): refused by their fingerprint.
    listed = VariableBatchSizeLR(_optimizer(), "mean", samplers[0].plan.batch_sizes.tolist()).state_dict()
    with pytest.raises(ValueError, match="other batch sizes"):
        VariableBatchSizeLR(_optimizer(), "mean", samplers[1].plan.batch_sizes.tolist()).load_state_dict(listed)
    with pytest.raises(ValueError, match=re.escape("lr_scaling_method='linear' into one with "
                                                   "lr_scaling_method='sqrt'")):
        VariableBatchSizeLR(_optimizer(), "mean", samplers[0], lr_scaling_method="sqrt").load_state_dict(state)


# =============================================================================
# DeepSpeed glue
# =============================================================================


def test_dynamic_batching_config_unknown_key():
    """An unknown key in the dynamic_batching section is named, with the closest valid key."""
    config = {"data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": True, "max_token": 10}}}}
    with pytest.raises(ValueError, match=re.escape("unknown key 'max_token'") + ".*"
                       + re.escape("did you mean 'max_tokens'?")):
        varbatch._read_dynamic_batching(config)


# =============================================================================
# DeepSpeed glue and the example (integration)
# =============================================================================
# The glue's config reading, seqlen cache and plan check run against a stand-in
# engine (what the glue reads from DeepSpeed's: the raw config, the batch
# sizes, the optimizer and scheduler). The example runs under the DeepSpeed
# launcher with 2 CPU ranks (gloo), DDP and pipeline; its rank-0 step lines
# are compared with a plan computed here from the dataset's real seqlens.

_ROOT = os.path.dirname(os.path.abspath(__file__))
_STEP_LINE = re.compile(r"^step +(\d+) \| epoch (\d+) \| B ([\d,]+) \| S ([\d,]+) \| tokens (\d+) \| "
                        r"padding ([\d.]+)% \| lr (\S+) \| loss (\S+)$", re.M)
_SUMMARY_LINE = re.compile(r"^summary \| .*\| samples trained (\d+) \| dropped (.*?) \|", re.M)
# Small runs: a few seconds of training each; the launcher's start-up dominates.
_NUM_SAMPLES, _EPOCHS = 800, 5
_SMALL_RUN = ["--num-samples", str(_NUM_SAMPLES), "--epochs", str(_EPOCHS)]
_LAUNCH_TIMEOUT_S = 600


def _run(cmd, timeout=_LAUNCH_TIMEOUT_S, cwd=_ROOT):
    """Runs ``cmd`` in its own process group; on timeout kills the whole group (launcher and ranks)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s (a hang):\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _launch(script, args, num_gpus=2, cwd=_ROOT):
    """``deepspeed --num_gpus N script args`` (the launcher's own entry point, this Python)."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_gpus),
           "--master_port", str(_free_port()), script, *args]
    return _run(cmd, cwd=cwd)


def _check_ok(result):
    assert result.returncode == 0, (f"exit code {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}"
                                    f"\n--- stderr ---\n{result.stderr[-4000:]}")


def _steps(stdout):
    """The rank-0 step lines as dicts, in order."""
    return [dict(step=int(m[1]), epoch=int(m[2]), B=[int(x) for x in m[3].split(",")],
                 S=[int(x) for x in m[4].split(",")], tokens=int(m[5]), padding=m[6], lr=m[7], loss=float(m[8]))
            for m in _STEP_LINE.finditer(stdout)]


def _example_config(path=None):
    with open(path or os.path.join(_ROOT, "ds_config.json")) as f:
        return json.load(f)


def _example_plan(config, epoch, pipeline, num_samples=_NUM_SAMPLES, seed=0):
    """The plan the example should train, computed here from the dataset's real seqlens."""
    import example
    seqlens = example.RunningSumSequences(num_samples, seed=seed).seqlens.numpy()
    section = config["data_efficiency"]["data_sampling"]["dynamic_batching"]
    plan = varbatch.plan_batches(
        seqlens, section["max_tokens"], effective_batch_size=config["train_batch_size"], budget=section["budget"],
        order=section["sequence_picking_order"], min_batch_size=section.get("min_batch_size", 1),
        seed=config["data_efficiency"]["seed"], epoch=epoch, same_size=pipeline, same_length=pipeline)
    return plan, seqlens


def _rank0_shapes(plan, seqlens, b, num_replicas, same_length):
    """(B, S) of rank 0's step inputs of batch ``b``: micro-batch j goes to rank j % num_replicas."""
    k = plan.effective_batch_size
    shapes = []
    for j in range(b * k, (b + 1) * k, num_replicas):
        ids = plan.microbatch(j)
        seqlen = int(plan.batch_max_seqlens[b]) if same_length else int(seqlens[ids].max())
        shapes.append((len(ids), seqlen))
    return shapes


_PATHS = {"ddp": [], "pipeline": ["--pipeline-num-stages", "2"]}


@pytest.fixture(scope="module")
def example_runs():
    """One uninterrupted run of each path, shared by the tests below (each launch costs ~15 s)."""
    runs = {}

    def get(path):
        if path not in runs:
            runs[path] = _launch("example.py", _PATHS[path] + _SMALL_RUN)
        return runs[path]
    return get


@pytest.mark.parametrize("path", ["ddp", "pipeline"])
def test_example_trains_the_plan_and_the_loss_goes_down(example_runs, path):
    """2 ranks: every step's B, S, real tokens and LR are the plan's; the loss goes down; drops are reported."""
    result = example_runs(path)
    _check_ok(result)
    steps = _steps(result.stdout)
    config = _example_config()
    pipeline = path == "pipeline"
    num_replicas = 1 if pipeline else 2  # 2 ranks: 2 stages x 1, or 2 data-parallel ranks
    section = config["data_efficiency"]["data_sampling"]["dynamic_batching"]
    max_lr = config["scheduler"]["params"]["warmup_max_lr"]
    warmup = config["scheduler"]["params"]["warmup_num_steps"]
    expected_steps, samples, drops = [], 0, {reason: 0 for reason in varbatch.DROP_REASONS}
    for epoch in range(_EPOCHS):
        plan, seqlens = _example_plan(config, epoch, pipeline)
        samples += int(plan.batch_sizes.sum())
        for reason, ids in plan.dropped.items():
            drops[reason] += len(ids)
        for b in range(plan.num_batches):
            expected_steps.append((epoch, _rank0_shapes(plan, seqlens, b, num_replicas, pipeline),
                                   int(plan.batch_tokens[b]), int(plan.batch_sizes[b]) / plan.batch_sizes.mean()))
    assert [s["step"] for s in steps] == list(range(1, len(expected_steps) + 1)), \
        f"expected steps 1..{len(expected_steps)}, got {[s['step'] for s in steps]}"
    for s, (epoch, shapes, tokens, factor) in zip(steps, expected_steps):
        assert s["epoch"] == epoch, f"step {s['step']}: epoch {s['epoch']}, expected {epoch}"
        assert list(zip(s["B"], s["S"])) == shapes, f"step {s['step']}: B x S {list(zip(s['B'], s['S']))}, " \
                                                    f"expected {shapes}"
        assert all(n * seqlen <= section["max_tokens"] for n, seqlen in shapes)  # budget="padded"
        assert s["tokens"] == tokens, f"step {s['step']}: {s['tokens']} real tokens, expected {tokens}"
        if s["step"] > warmup + 1:  # after the warmup, LR = max_lr x B_t / mean B (lr_scaling_reference "mean")
            assert math.isclose(float(s["lr"]), max_lr * factor, rel_tol=1e-5), \
                f"LR is wrong at step {s['step']}: expected {max_lr * factor}, got {s['lr']}"
    losses = [s["loss"] for s in steps]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), f"the loss did not go down: {losses}"
    summary = _SUMMARY_LINE.search(result.stdout)
    assert summary, result.stdout[-2000:]
    assert int(summary[1]) == samples
    assert summary[2] == " ".join(f"{reason}={count}" for reason, count in drops.items())
    progress = re.findall(r"^progress \| step (\d+)/(\d+) \| tokens/s (\d+) \| ETA ([\d.]+) s$", result.stdout, re.M)
    assert 5 <= len(progress) <= 15, f"expected a progress line about every tenth of the run, got {progress}"
    # The last one comes within a tenth of the end; the total is estimated from the first epoch's plan.
    assert len(expected_steps) - int(progress[-1][0]) <= len(expected_steps) // 10
    assert abs(int(progress[-1][1]) - len(expected_steps)) <= _EPOCHS
    assert all(int(tokens_per_s) > 0 for _, _, tokens_per_s, _ in progress)


@pytest.mark.parametrize("path", ["ddp", "pipeline"])
def test_example_stop_and_resume_reproduces_the_uninterrupted_run(example_runs, path, tmp_path):
    """Stopped mid-epoch and resumed, the run trains the same batches with the same LRs and losses."""
    full = example_runs(path)
    _check_ok(full)
    plan, _ = _example_plan(_example_config(), 0, path == "pipeline")
    stop = plan.num_batches + 2  # batch 2 of epoch 1: mid-epoch, after an epoch boundary
    checkpoint = str(tmp_path / "ckpt")
    first = _launch("example.py", _PATHS[path] + _SMALL_RUN + ["--max-steps", str(stop),
                                                               "--checkpoint-dir", checkpoint])
    _check_ok(first)
    second = _launch("example.py", _PATHS[path] + _SMALL_RUN + ["--checkpoint-dir", checkpoint, "--resume"])
    _check_ok(second)
    assert f"at step {stop}: epoch 1, batch 2" in second.stdout
    expected, got = _steps(full.stdout), _steps(first.stdout) + _steps(second.stdout)
    assert [s["step"] for s in got] == [s["step"] for s in expected]
    for a, b in zip(got, expected):
        same = ("epoch", "B", "S", "tokens", "lr")
        assert [a[key] for key in same] == [b[key] for key in same], \
            f"step {a['step']} differs after resuming at step {stop}: {a} != {b}"
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7), \
            f"loss is wrong at step {a['step']}: expected {b['loss']}, got {a['loss']}"


def test_example_pipeline_on_one_process_fails_at_once_with_the_command_that_works():
    """One process cannot hold 2 stages: the example says which command works, and never hangs."""
    fix = "deepspeed --num_gpus 2 example.py --pipeline-num-stages 2"
    launched = _run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port",
                     str(_free_port()), "example.py", "--pipeline-num-stages", "2"], timeout=120)
    plain = _run([sys.executable, "example.py", "--pipeline-num-stages", "2"], timeout=120)
    for result in (launched, plain):
        assert result.returncode != 0
        assert fix in result.stderr + result.stdout, result.stderr[-2000:]
        assert "needs a multiple of 2 processes" in result.stderr + result.stdout


def test_example_a_stalled_rank_makes_the_job_fail_within_the_timeout():
    """Rank 1 frozen mid-training: rank 0 fails at its next collective after --dist-timeout, no 30-minute hang."""
    psutil = pytest.importorskip("psutil")  # a DeepSpeed dependency
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
           "example.py", "--dist-timeout", "10", "--num-samples", "4000", "--epochs", "50"]
    proc = subprocess.Popen(cmd, cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    frozen = []
    try:
        for line in proc.stdout:  # wait until training runs
            if _STEP_LINE.match(line.strip()):
                break
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "--local_rank=1" in " ".join(p.cmdline())]
        assert ranks, "rank 1's process was not found"
        for p in ranks:
            p.suspend()
            frozen.append(p)
        started = time.monotonic()
        proc.stdout.read()
        proc.wait(timeout=240)
        waited = time.monotonic() - started
    finally:
        for p in frozen:
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass  # the launcher ended it, as it should
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode != 0, "the job went on with a frozen rank"
    assert waited < 180, f"the job took {waited:.0f} s to fail with --dist-timeout 10"
    print(f"the job failed {waited:.1f} s after rank 1 froze")


# A training script written against DeepSpeed's module, in the style of DeepSpeed's
# example for the feature: its import line is the only thing varbatch changes.
_DEEPSPEED_STYLE_SCRIPT = '''
import argparse
import random

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import PipelineModule
from torch import nn
from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--pipeline", action="store_true")
parser.add_argument("--metrics-path", required=True)
args = parser.parse_args()
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the CPU comm op
deepspeed.init_distributed()
MAX_SEQLEN, EMBED = 12, 4


class Sequences(torch.utils.data.Dataset):
    def __init__(self, count, seed=0):
        rng = random.Random(seed)
        self.items = [torch.ones(rng.randrange(2, MAX_SEQLEN + 1), EMBED) for _ in range(count)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], len(self.items[i])


def collate(batch):
    seqs, labels = zip(*batch)
    return nn.utils.rnn.pad_sequence(seqs, batch_first=True), torch.tensor(labels, dtype=torch.float32)


def padding(sample, length):
    seq, label = sample
    return F.pad(seq, (0, 0, 0, length - len(seq))), label


def seqlens(batch):
    seqs, _ = batch
    return (seqs[:, :, 0] != 0).sum(dim=1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(EMBED, 1)

    def forward(self, x):
        return self.fc(F.pad(x, (0, 0, 0, MAX_SEQLEN - x.shape[1]))).sum(dim=(1, 2))


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.scale


loss_fn = lambda out, labels: F.mse_loss(out.float(), labels.float())
if args.pipeline:
    model = PipelineModule(layers=[Net(), Scale()], num_stages=2, loss_fn=loss_fn)
else:
    model = nn.Sequential(Net(), Scale())
config = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 1,
    "steps_per_print": 100000,
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "data_efficiency": {
        "enabled": True,
        "seed": 42,
        "data_sampling": {
            "num_workers": 0,
            "pin_memory": False,
            "dynamic_batching": {
                "enabled": True,
                "max_tokens": 40,
                "metrics_path": args.metrics_path,
                "lr_scaling_method": "linear",
                "sentence_picking_order": "seqlen",
                "min_batch_size": 1,
                "max_batch_size": 10,
                "verbose": True,
            },
        },
    },
}
engine, optimizer, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
dataset = Sequences(200)
dataloader, lr_scheduler, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
    dataset=dataset, engine=engine, dataloader_collate_fn=collate, sample_padding_fn=padding,
    batch_seqlens_fn=seqlens)
engine.training_dataloader = dataloader
lrs = []
for epoch in range(2):
    if args.pipeline:
        data_iter = iter(dataloader)
        for _ in range(len(dataloader) // engine.gradient_accumulation_steps()):
            engine.reset_activation_shape()
            lrs.append((engine.get_lr()[0], lr_scheduler.get_last_lr()[0]))
            loss = engine.train_batch(data_iter=data_iter)
    else:
        for i, (seqs, labels) in enumerate(dataloader):
            if i % engine.gradient_accumulation_steps() == 0:
                lrs.append((engine.get_lr()[0], lr_scheduler.get_last_lr()[0]))
            loss = loss_fn(engine(seqs.to(engine.device)), labels.to(engine.device))
            engine.backward(loss)
            engine.step()
    if engine.data_parallel_group.rank() == 0:
        print(f"epoch {epoch} loss {loss.item():.4f} LRs {lr_scheduler.get_lr()}", flush=True)
if torch.distributed.get_rank() == 0:
    print("optimizer", type(engine.optimizer).__name__, flush=True)
    print("lrs", lrs, flush=True)
'''


def test_deepspeed_style_script_runs_unchanged_on_varbatch_with_zero_stage_1(tmp_path):
    """A script for DeepSpeed's module runs on varbatch (import line swapped): DDP, then pipeline, ZeRO-1.

    DeepSpeed 0.19.8's own function fails on this script (its DataAnalyzer
    crashes on CPU, and it rejects ZeRO's optimizer wrapper). The first run
    computes the seqlens with ``batch_seqlens_fn`` (progress bar) and caches
    them in ``metrics_path``; the second reads the cache. The LR in ZeRO's
    optimizer is varbatch's: base LR x B_t / train_batch_size.
    """
    script = _DEEPSPEED_STYLE_SCRIPT.replace(
        "from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import", "from varbatch import")
    assert script != _DEEPSPEED_STYLE_SCRIPT
    (tmp_path / "train.py").write_text(script)
    (tmp_path / "varbatch.py").write_text(open(os.path.join(_ROOT, "varbatch.py")).read())
    metrics = str(tmp_path / "metrics")
    for mode, computes in (([], True), (["--pipeline"], False)):
        result = _launch("train.py", ["--metrics-path", metrics, *mode], cwd=str(tmp_path))
        _check_ok(result)
        assert ("varbatch: seqlens" in result.stderr) == computes, f"{mode}: seqlens computed={not computes}"
        assert os.path.exists(os.path.join(metrics, "varbatch_seqlens.npy"))
        assert "optimizer DeepSpeedZeroOptimizer" in result.stdout
        lrs = eval(re.search(r"^lrs (.*)$", result.stdout, re.M)[1])
        assert all(math.isclose(engine_lr, scheduler_lr) for engine_lr, scheduler_lr in lrs), lrs
        batch_sizes = [lr / 1e-3 * 4 for lr, _ in lrs]  # B_t = lr / base_lr x train_batch_size
        assert all(abs(b - round(b)) < 1e-6 and b >= 4 for b in batch_sizes), batch_sizes
        assert len({round(b) for b in batch_sizes}) > 1, "the LR never followed the batch size"


# -- the glue against a stand-in engine ---------------------------------------


class _Engine:
    """What the glue reads from a DeepSpeed engine: its raw config, batch sizes, optimizer, scheduler."""

    def __init__(self, config, optimizer=None, lr_scheduler=None, gradient_accumulation_steps=None):
        self._config = types.SimpleNamespace(_param_dict=config)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self._gas = gradient_accumulation_steps

    def train_batch_size(self):
        return self._config._param_dict["train_batch_size"]

    def train_micro_batch_size_per_gpu(self):
        return self._config._param_dict.get("train_micro_batch_size_per_gpu", 1)

    def gradient_accumulation_steps(self):
        return self._gas or self.train_batch_size() // self.train_micro_batch_size_per_gpu()


def _glue_config(**section):
    # B_ref "mean" keeps the LR factors near 1, so these tests do not trip the unit-trap warning.
    dynamic_batching = {"enabled": True, "max_tokens": 16, "lr_scaling_reference": "mean", **section}
    return {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
            "data_efficiency": {"data_sampling": {"dynamic_batching": dynamic_batching}}}


def _glue(config, dataset=None, **kwargs):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    engine = _Engine(config, optimizer=optimizer)
    dataset = dataset if dataset is not None else [torch.ones(n) for n in [3, 5, 2, 7, 4, 6, 1, 8]]
    out = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine, **kwargs)
    return engine, out


def _microbatch_ids(loader):
    """The sample ids of every step input of a one-rank loader, in order (its VariableBatchSampler's)."""
    return [list(ids) for ids in loader.sampler.batch_sampler]


def test_deepspeed_glue_rejects_an_unknown_key_naming_the_closest_one():
    with pytest.raises(ValueError, match=r"'max_token'.*did you mean 'max_tokens'"):
        _glue(_glue_config(max_token=16), dataset_seqlens=[3, 5, 2, 7, 4, 6, 1, 8])
    with pytest.raises(ValueError, match=r"'sentence_picking_ordre'.*'sentence_picking_order'"):
        _glue(_glue_config(sentence_picking_ordre="seqlen"), dataset_seqlens=[3, 5, 2, 7, 4, 6, 1, 8])


def test_deepspeed_glue_reads_both_spellings_of_the_picking_order():
    """``sentence_picking_order`` (DeepSpeed's older key) and ``sequence_picking_order`` give the same plan."""
    seqlens = [3, 5, 2, 7, 4, 6, 1, 8]
    _, (old, _, _) = _glue(_glue_config(sentence_picking_order="seqlen"), dataset_seqlens=seqlens)
    _, (new, _, _) = _glue(_glue_config(sequence_picking_order="seqlen"), dataset_seqlens=seqlens)
    expected = varbatch.plan_batches(seqlens, 16, effective_batch_size=2, order="seqlen", seed=1234)
    for loader in (old, new):
        assert _microbatch_ids(loader) == expected.microbatches()


def test_deepspeed_glue_rejects_batch_sizes_that_do_not_multiply():
    engine = _Engine(_glue_config(), optimizer=None, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match=r"train_batch_size=2 should be .* 1 x 3 x 1"):
        varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed([torch.ones(2)] * 4, engine,
                                                                                   dataset_seqlens=[2] * 4)


def test_deepspeed_glue_installs_the_scheduler_and_does_not_scale_twice():
    """The scheduler becomes engine.lr_scheduler; calling the glue again scales the original LR, not the scaled one."""
    seqlens = [3, 5, 2, 7, 4, 6, 1, 8]
    engine, (_, first, _) = _glue(_glue_config(), dataset_seqlens=seqlens)
    assert engine.lr_scheduler is first
    expected = first.get_last_lr()
    second = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        [torch.ones(n) for n in seqlens], engine, dataset_seqlens=seqlens)[1]
    assert engine.lr_scheduler is second
    assert second.get_last_lr() == pytest.approx(expected), \
        f"LR is wrong at step 0: expected {expected}, got {second.get_last_lr()}"


def test_deepspeed_glue_computes_seqlens_once_then_reads_the_cache(tmp_path):
    """batch_seqlens_fn gets collated batches; the cache in metrics_path is read back, and a stale one is redone."""
    seqlens = [3, 5, 2, 7, 4, 6, 1, 8] * 40
    dataset = [torch.arange(1, n + 1) for n in seqlens]
    calls = []

    def batch_seqlens(batch):
        padded, lengths = batch  # made by dataloader_collate_fn
        calls.append(len(lengths))
        return lengths

    config = _glue_config(metrics_path=str(tmp_path))
    kwargs = dict(dataloader_collate_fn=varbatch.PaddedCollate(), batch_seqlens_fn=batch_seqlens)
    _, (loader, _, _) = _glue(config, dataset, **kwargs)
    assert sum(calls) == len(seqlens)
    assert np.load(tmp_path / "varbatch_seqlens.npy").tolist() == seqlens
    expected = varbatch.plan_batches(seqlens, 16, effective_batch_size=2, seed=1234)
    assert _microbatch_ids(loader) == expected.microbatches()
    calls.clear()
    _glue(config, dataset, **kwargs)  # from the cache: only a spot check is measured
    assert 0 < sum(calls) < len(seqlens)
    changed = [torch.arange(1, n + 2) for n in seqlens]  # same size, other lengths: the cache is stale
    calls.clear()
    _glue(config, changed, **kwargs)
    assert sum(calls) > len(seqlens)  # spot check, then every sample
    assert np.load(tmp_path / "varbatch_seqlens.npy").tolist() == [n + 1 for n in seqlens]


def test_deepspeed_glue_reads_deepspeed_metric_files(tmp_path):
    """Seqlens written by DeepSpeed's DataAnalyzer (seqlen/seqlen_sample_to_metric.bin/.idx) are used as they are."""
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDatasetBuilder
    seqlens = [3, 5, 2, 7, 4, 6, 1, 8]
    os.makedirs(tmp_path / "seqlen")
    prefix = str(tmp_path / "seqlen" / "seqlen_sample_to_metric")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int64)
    for n in seqlens:
        builder.add_item(torch.tensor([n], dtype=torch.int64))
    builder.finalize(prefix + ".idx")
    _, (loader, _, _) = _glue(_glue_config(metrics_path=str(tmp_path)), [torch.ones(n) for n in seqlens])
    expected = varbatch.plan_batches(seqlens, 16, effective_batch_size=2, seed=1234)
    assert _microbatch_ids(loader) == expected.microbatches()


def test_deepspeed_glue_without_any_seqlens_source_says_what_to_pass():
    with pytest.raises(ValueError, match="batch_seqlens_fn"):
        _glue(_glue_config(), [torch.ones(2)] * 4)


_RANKS_DISAGREE_SCRIPT = '''
import os, sys, types
import torch
import varbatch
torch.distributed.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
rank = torch.distributed.get_rank()
config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
          "data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 16}}}}
engine = types.SimpleNamespace(_config=types.SimpleNamespace(_param_dict=config), optimizer=None,
                               lr_scheduler=None, data_parallel_group=None, train_batch_size=lambda: 2,
                               train_micro_batch_size_per_gpu=lambda: 1, gradient_accumulation_steps=lambda: 1)
seqlens = [3, 5, 2, 7, 4, 6, 1, 8] if rank == 0 else [8] * 8  # rank 1 sees other lengths
try:
    varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        [torch.ones(n) for n in seqlens], engine, dataset_seqlens=seqlens)
except RuntimeError as error:
    print(f"rank {rank}: {error}", flush=True)
    torch.distributed.destroy_process_group()
    sys.exit(3)
'''


def test_deepspeed_glue_fails_on_every_rank_when_the_ranks_plan_differently(tmp_path):
    """Ranks with different seqlens get a clear error at the start, on every rank, instead of a hang."""
    (tmp_path / "disagree.py").write_text(_RANKS_DISAGREE_SCRIPT)
    port = str(_free_port())
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=_ROOT)
    procs = [subprocess.Popen([sys.executable, "disagree.py"], cwd=tmp_path, env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=120))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("the ranks hung instead of failing")
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 3, f"{out}\n{err}"
        assert "planned a different epoch than rank 0" in out
        assert "give every rank the same dataset" in out


# =============================================================================
# Command line: python varbatch.py plan ...
# =============================================================================


VARBATCH = str(Path(varbatch.__file__).resolve())

# A small dataset whose plans have several batches, padding and a tail.
LENGTHS = [3, 5, 2, 6, 4, 1, 7, 7, 2, 3, 8, 1, 1, 4, 6, 2, 5, 3, 3, 9, 2, 4]


def _run_cli(*args, stdin=None):
    """``python varbatch.py ARGS`` in a fresh interpreter: (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, VARBATCH, *args], input=stdin, capture_output=True, text=True,
                          timeout=120)
    return done.returncode, done.stdout, done.stderr


def _main(capsys, *args):
    """``varbatch._main(ARGS)`` in this process: (exit code, stdout, stderr)."""
    code = varbatch._main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def npy_file(tmp_path):
    path = tmp_path / "lengths.npy"
    np.save(path, np.array(LENGTHS))
    return str(path)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(x) for x in LENGTHS) + "\n")
    return str(path)


def _padded_tokens_oracle(plan, seqlens, same_length=False):
    """Padded n x S of every micro-batch, one micro-batch at a time (micro_batch_size 1)."""
    k = plan.effective_batch_size
    out = []
    for j, ids in enumerate(plan.microbatches()):
        s = int(plan.batch_max_seqlens[j // k]) if same_length else max(seqlens[i] for i in ids)
        out.append(len(ids) * s)
    return out


def _cell_values(cell, k):
    """A table cell of per-micro-batch values: one value stands for k equal ones."""
    values = [int(x) for x in cell.split(",")]
    return values * k if len(values) == 1 else values


def _table_rows(stdout):
    """The rows of the printed per-batch table, as lists of cells."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "B"])
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or not line.split()[0].isdigit():
            break
        rows.append(line.split())
    return rows


# =============================================================================
# The table and the totals
# =============================================================================


@pytest.mark.parametrize("pipeline", [False, True])
def test_table_and_totals_match_plan_batches(capsys, npy_file, pipeline):
    """Every batch of the table and every total equals what plan_batches and a slow recount give."""
    flags = ["--pipeline"] if pipeline else []
    code, out, err = _main(capsys, "plan", "--seqlens", npy_file, "--max-tokens", "10", "--world-size", "2",
                           "--batches", "0", *flags)
    assert code == 0, err
    plan = plan_batches(LENGTHS, 10, effective_batch_size=2, same_size=pipeline, same_length=pipeline)
    padded = _padded_tokens_oracle(plan, LENGTHS, same_length=pipeline)
    rows = _table_rows(out)
    assert len(rows) == plan.num_batches
    for b, row in enumerate(rows):
        batch, sequences, microbatches, sizes, _, real, padding, factor = row
        mb = [len(ids) for ids in plan.microbatches()[2 * b:2 * b + 2]]
        assert (int(batch), int(sequences), int(microbatches)) == (b, plan.batch_sizes[b], 2)
        assert _cell_values(sizes, 2) == mb
        assert int(real) == plan.batch_tokens[b]
        slots = padded[2 * b] + padded[2 * b + 1]
        assert float(padding) == pytest.approx(100 * (1 - plan.batch_tokens[b] / slots), abs=0.051)
        # Default reference: train_batch_size = 2 micro-batches, linear rule.
        assert float(factor) == pytest.approx(plan.batch_sizes[b] / 2, rel=1e-3)
    assert f"epoch 0: {plan.num_batches} batches of 2 micro-batches" in out
    assert f"tokens: {sum(LENGTHS[i] for i in plan.sample_ids)} real / {sum(padded)} padded" in out
    assert f"samples: {plan.batch_sizes.sum()} trained, {plan.num_dropped} dropped" in out


def test_json_matches_plan_batches(capsys, npy_file):
    """--json holds the settings, totals, rows and dropped ids of the same plan."""
    code, out, err = _main(capsys, "plan", "--seqlens", npy_file, "--max-tokens", "10", "--effective-batch-size",
                           "3", "--order", "random", "--seed", "5", "--epoch", "2", "--batches", "0", "--json",
                           "--lr-scaling-method", "sqrt", "--lr-scaling-reference", "mean")
    assert code == 0, err
    data = json.loads(out)
    plan = plan_batches(LENGTHS, 10, effective_batch_size=3, order="random", seed=5, epoch=2)
    totals = data["totals"]
    assert totals["batches"] == plan.num_batches == len(data["batches"])
    assert totals["samples"] + totals["num_dropped"] == len(LENGTHS)
    assert totals["dropped"] == {reason: len(ids) for reason, ids in plan.dropped.items()}
    assert data["dropped_ids"] == {reason: ids.tolist() for reason, ids in plan.dropped.items()}
    assert totals["real_tokens"] == int(plan.batch_tokens.sum())
    assert totals["padded_tokens"] == sum(_padded_tokens_oracle(plan, LENGTHS))
    assert totals["efficiency"] == pytest.approx(totals["real_tokens"] / totals["padded_tokens"])
    sizes = plan.microbatch_sizes().tolist()
    mean = plan.batch_sizes.mean()
    for b, row in enumerate(data["batches"]):
        assert row["microbatch_sizes"] == sizes[3 * b:3 * b + 3]
        assert row["real_tokens"] == plan.batch_tokens[b]
        assert row["lr_factor"] == pytest.approx(varbatch.scale_lr(mean, int(plan.batch_sizes[b]), 1.0, "sqrt"))
    assert totals["lr_factor"]["mean"] == pytest.approx(np.mean([r["lr_factor"] for r in data["batches"]]))
    assert data["settings"]["seed"] == 5 and data["settings"]["epoch"] == 2


def test_totals_largest_padded_microbatch_is_the_largest(capsys, npy_file):
    """The largest padded micro-batch is the max over micro-batches of n x S, compared with max_tokens."""
    code, out, _ = _main(capsys, "plan", "--seqlens", npy_file, "--max-tokens", "10", "--json")
    assert code == 0
    largest = json.loads(out)["totals"]["largest_padded_microbatch"]
    plan = plan_batches(LENGTHS, 10)
    assert largest["tokens"] == max(_padded_tokens_oracle(plan, LENGTHS))
    assert largest["over_max_tokens"] == pytest.approx(largest["tokens"] / 10)
    assert largest["tokens"] == largest["sequences"] * largest["padded_seqlen"]


def test_synthetic_default_runs_alone(capsys):
    """`python varbatch.py plan` without files plans the documented 2000 synthetic lengths."""
    code, out, err = _main(capsys, "plan", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["settings"]["num_samples"] == 2000 and data["settings"]["max_tokens"] == 4096
    assert data["totals"]["samples"] + data["totals"]["num_dropped"] == 2000
    assert data["totals"]["real_tokens"] == int(varbatch._synthetic_seqlens().sum())


def test_lr_unit_trap_is_flagged(capsys, npy_file):
    """The totals warn when the mean LR factor is far from 1, and not when B_ref is the mean."""
    _, trap, _ = _main(capsys, "plan", "--seqlens", npy_file, "--max-tokens", "20")
    _, fixed, _ = _main(capsys, "plan", "--seqlens", npy_file, "--max-tokens", "20", "--lr-scaling-reference",
                        "mean")
    assert "warning: the configured LR is multiplied by" in trap and "lr_scaling_reference" in trap
    assert "warning" not in fixed


# =============================================================================
# Inputs: .npy, text, stdin, a DeepSpeed config
# =============================================================================


def test_npy_text_and_stdin_give_the_same_plan(capsys, npy_file, text_file):
    """The three ways to pass lengths give the same JSON (but for the source's name)."""
    outs = []
    for source in (npy_file, text_file):
        code, out, err = _main(capsys, "plan", "--seqlens", source, "--max-tokens", "10", "--json")
        assert code == 0, err
        outs.append(json.loads(out))
    code, out, err = _run_cli("plan", "--seqlens", "-", "--max-tokens", "10", "--json",
                              stdin="\n".join(map(str, LENGTHS)) + "\n\n")
    assert code == 0, err
    outs.append(json.loads(out))
    for data in outs:
        data["settings"].pop("seqlens")
    assert outs[0] == outs[1] == outs[2]


def _write_config(tmp_path, **batch_keys):
    config = dict(batch_keys)
    config["data_efficiency"] = {"data_sampling": {"dynamic_batching": {
        "enabled": True, "max_tokens": 12, "lr_scaling_method": "sqrt", "lr_scaling_reference": 4}}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("batch_keys, world_size, expected", [
    # (k, micro batch per GPU, accumulation, ranks), resolved as DeepSpeed does
    (dict(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2), None, (8, 2, 2, 2)),
    (dict(train_batch_size=8, train_micro_batch_size_per_gpu=1), "4", (8, 1, 2, 4)),
    (dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3), "2", (12, 2, 3, 2)),
    (dict(train_batch_size=6), None, (6, 6, 1, 1)),
    (dict(train_batch_size=6, gradient_accumulation_steps=3), "2", (6, 1, 3, 2)),
])
def test_config_batch_geometry(capsys, tmp_path, npy_file, batch_keys, world_size, expected):
    """train_batch_size = micro batch per GPU x accumulation x world size, any one of them derived."""
    config = _write_config(tmp_path, **batch_keys)
    flags = ["--world-size", world_size] if world_size else []
    code, out, err = _main(capsys, "plan", "--config", config, "--seqlens", npy_file, "--json", *flags)
    assert code == 0, err
    data = json.loads(out)
    s = data["settings"]
    assert (s["effective_batch_size"], s["micro_batch_size"], s["gradient_accumulation_steps"],
            s["world_size"]) == expected
    assert s["max_tokens"] == 12 and data["totals"]["lr_factor"]["method"] == "sqrt"
    assert data["totals"]["lr_factor"]["reference_value"] == 4


def test_config_world_size_that_contradicts_it_is_an_error(capsys, tmp_path, npy_file):
    config = _write_config(tmp_path, train_batch_size=4, train_micro_batch_size_per_gpu=1,
                           gradient_accumulation_steps=2)
    code, out, err = _main(capsys, "plan", "--config", config, "--seqlens", npy_file, "--world-size", "3")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "train_batch_size=4" in err and "world size 3" in err


def test_step_input_padding_follows_the_sampler():
    """With micro_batch_size > 1 a micro-batch is padded to the longest sample of its rank's step input."""
    seqlens = np.array(LENGTHS * 3)
    for micro, accumulation, replicas in [(2, 1, 1), (2, 2, 2), (3, 1, 2)]:
        sampler = VariableBatchSampler(seqlens, 10, micro_batch_size=micro, gradient_accumulation_steps=accumulation,
                                       num_replicas=replicas, rank=0)
        plan = sampler.plan
        padded = varbatch._padded_seqlens(plan, seqlens, micro_batch_size=micro, num_replicas=replicas)
        s_of_sample = {i: int(padded[j]) for j, ids in enumerate(plan.microbatches()) for i in ids}
        for rank in range(replicas):
            for step in VariableBatchSampler(seqlens, 10, micro_batch_size=micro, num_replicas=replicas, rank=rank,
                                             gradient_accumulation_steps=accumulation):
                longest = int(seqlens[step].max())
                assert [s_of_sample[i] for i in step] == [longest] * len(step), (micro, accumulation, replicas)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=4, max_size=80), max_tokens=st.integers(30, 90),
       k=st.integers(1, 4), pipeline=st.booleans(), budget=st.sampled_from(varbatch.BUDGETS))
def test_plan_totals_properties(lengths, max_tokens, k, pipeline, budget):
    """Totals count every sample once, padding never below the real tokens, padded budget never exceeded."""
    plan = plan_batches(lengths, max_tokens, effective_batch_size=k, budget=budget, same_size=pipeline,
                        same_length=pipeline)
    totals = varbatch._plan_totals(plan, lengths, same_length=pipeline)
    assert totals["samples"] + totals["num_dropped"] == len(lengths)
    assert totals["real_tokens"] <= totals["padded_tokens"] == sum(_padded_tokens_oracle(plan, lengths, pipeline))
    assert 0 < totals["efficiency"] <= 1
    if budget == "padded":
        assert totals["largest_padded_microbatch"]["tokens"] <= max_tokens
    text = varbatch._format_plan_totals(totals)
    assert f"{totals['padded_tokens']} padded" in text and "LR factor" not in text


# =============================================================================
# Errors: one line, exit code 2
# =============================================================================


def test_bad_flag_exits_2_with_one_line():
    code, out, err = _run_cli("plan", "--max-tokenz", "5")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("varbatch: error:") and "--max-tokenz" in err


@pytest.mark.parametrize("args", [["plan", "--budget", "sideways"], ["plan", "--max-tokens", "0"],
                                  ["plan", "--lr-scaling-reference", "-1"], []])
def test_bad_flag_values_exit_2_with_one_line(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        varbatch._main(args)
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("varbatch: error:")


def test_missing_file_exits_2_with_one_line(tmp_path):
    missing = str(tmp_path / "nope.npy")
    code, out, err = _run_cli("plan", "--seqlens", missing)
    assert code == 2 and out == ""
    assert err == f"varbatch: error: {missing}: No such file or directory\n"


@pytest.mark.parametrize("content, names", [
    ("3\n4\nfour\n", "line 3"),
    ("3\n0\n", "seqlens[1]=0"),
    ("\n\n", "no lengths"),
])
def test_bad_text_file_exits_2_naming_the_problem(capsys, tmp_path, content, names):
    path = tmp_path / "lengths.txt"
    path.write_text(content)
    code, out, err = _main(capsys, "plan", "--seqlens", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and names in err and str(path) in err


@pytest.mark.parametrize("content, names", [
    ('{"train_batch_size": ', "not valid JSON"),
    ('{"data_efficiency": {}}', "dynamic_batching"),
    ('{"data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": true, "max_tokenz": 5}}}}',
     "max_tokens"),
])
def test_bad_config_exits_2_naming_the_problem(capsys, tmp_path, content, names):
    path = tmp_path / "ds_config.json"
    path.write_text(content)
    code, out, err = _main(capsys, "plan", "--config", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and names in err


def test_corrupt_npy_exits_2(capsys, tmp_path):
    path = tmp_path / "lengths.npy"
    path.write_bytes(b"")
    code, _, err = _main(capsys, "plan", "--seqlens", str(path))
    assert code == 2 and err.count("\n") == 1 and str(path) in err


def test_help_explains_every_flag():
    code, out, _ = _run_cli("plan", "--help")
    assert code == 0
    parser = varbatch._make_parser()
    plan_parser = parser._subparsers._group_actions[0].choices["plan"]
    for action in plan_parser._actions:
        assert action.help, f"flag {action.option_strings} has no help"
        for flag in action.option_strings:
            assert flag in out
    assert "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps" in out
    assert "synthetic" in out


# =============================================================================
# The picture
# =============================================================================


def test_plot_writes_a_png(capsys, tmp_path, npy_file):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    code, out, err = _main(capsys, "plan", "--seqlens", npy_file, "--max-tokens", "10", "--world-size", "2",
                           "--plot", str(path))
    assert code == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert f"wrote {path}" in err and "epoch 0:" in out


def test_plot_without_matplotlib_says_how_to_get_it(capsys, monkeypatch, tmp_path, npy_file):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    path = tmp_path / "plan.png"
    code, out, err = _main(capsys, "plan", "--seqlens", npy_file, "--plot", str(path))
    assert code == 2 and out == "" and not path.exists()
    assert err.count("\n") == 1 and "pip install matplotlib" in err


def test_plan_without_plot_works_without_matplotlib(capsys, monkeypatch, npy_file):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, _ = _main(capsys, "plan", "--seqlens", npy_file, "--max-tokens", "10")
    assert code == 0 and "epoch 0:" in out


# =============================================================================
# README: every command and program in it runs, with the output it shows
# =============================================================================
# ```bash blocks hold commands: each line runs (installation aside: `pip install
# X && cmd` runs cmd). Plain ``` blocks whose lines start with `$ ` show a command
# and its exact output. ```python blocks are complete programs and run; ```py
# blocks are fragments of a larger script and are not run. The benchmark's
# commands run with --quick added: the same code on smaller sizes, since a full
# benchmark takes minutes and its numbers are not what a test checks.

_README = Path(varbatch.__file__).with_name("README.md")
_README_TEST_COMMAND = "python -m pytest -q test_varbatch.py"


def _readme_steps():
    """``(kind, text, expected_output)`` for every command and program of the README, in order."""
    steps = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", _README.read_text(), re.S | re.M):
        if lang == "bash":
            for line in body.splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith("pip install"):
                    if "&&" not in line:
                        continue  # installation only
                    line = line.split("&&", 1)[1].strip()
                steps.append(("command", line, None))
        elif lang == "python":
            steps.append(("program", body, None))
        elif lang == "" and body.startswith("$ "):
            for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
                command, _, output = chunk.partition("\n")
                steps.append(("command", command.strip(), output))
    return steps


def test_readme_test_command_is_what_ci_runs():
    """The README's test command is the one .ci/run runs, and both README commands come first."""
    readme = _README.read_text()
    first_block = re.search(r"^```bash\n(.*?)^```", readme, re.S | re.M).group(1).splitlines()
    assert first_block == [
        "pip install -r requirements.txt && deepspeed --num_gpus 2 example.py --pipeline-num-stages 2",
        f"pip install -r requirements.txt && {_README_TEST_COMMAND}"]
    ci = _README.with_name(".ci").joinpath("run").read_text()
    assert re.search(rf"^{re.escape(_README_TEST_COMMAND)}$", ci, re.M), "CI does not run the README's command"


def test_readme_commands_run_and_print_what_it_shows(tmp_path):
    """Every README command exits 0 (or 2 where it shows an error) and prints exactly the output shown."""
    root = _README.parent
    for name in ("varbatch.py", "example.py", "ds_config.json", "bench.py"):
        (tmp_path / name).write_bytes((root / name).read_bytes())
    steps = _readme_steps()
    assert sum(kind == "command" for kind, _, _ in steps) >= 10, "the README lost its commands"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(tmp_path))
    seen = set()
    for kind, text, expected in steps:
        if text.startswith("python bench.py") and "--quick" not in text:
            text = text.replace("python bench.py", "python bench.py --quick", 1)
        key = (kind, re.sub(r"\s+#.*$", "", text) if kind == "command" else text, expected)
        if text == _README_TEST_COMMAND or key in seen:
            continue  # this suite itself; a command shown twice runs once
        seen.add(key)
        started = time.perf_counter()
        args = [sys.executable, "-c", text] if kind == "program" else ["bash", "-c", text]
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                              start_new_session=True)
        print(f"{time.perf_counter() - started:6.1f} s  {text[:100]!r}")
        shows_error = expected is not None and expected.startswith("varbatch: error:")
        assert done.returncode == (2 if shows_error else 0), f"{text!r} exited {done.returncode}:\n{done.stderr[-3000:]}"
        if expected is not None:
            got = (done.stderr if shows_error else done.stdout).rstrip("\n").splitlines()
            assert [line.rstrip() for line in got] == [line.rstrip() for line in expected.rstrip("\n").splitlines()], \
                f"README output of {text!r} differs:\n{done.stdout}{done.stderr}"
