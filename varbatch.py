# varbatch.py -- token-budget ("dynamic") batching with batch-size-aware LR scaling
# Version 0.1.0. Licence: Apache-2.0.
# Vendored from the varbatch project: copy this one file into your code base.
"""Token-budget batching with learning-rate scaling for PyTorch and DeepSpeed.

Variable-length samples are packed into micro-batches by a token budget
(``max_tokens``) instead of a fixed number of samples, so the batch dimension B
and the sequence dimension S change from step to step. Because B changes, the
learning rate follows it (linear or square-root rule), scaled by the *global*
batch size (all ranks, all accumulation steps).

Public names: the DeepSpeed-compatible functions ``batch_by_seqlens``,
``scale_lr``, ``dataloader_for_variable_batch_size``, ``VariableBatchSizeLR``,
``lr_scheduler_for_variable_batch_size``,
``get_dataloader_and_lr_scheduler_for_variable_batch_size`` and its
``..._deepspeed`` variant (same signatures as DeepSpeed >= 0.16.5), and
varbatch's own API: ``plan_batches`` -> ``Plan``, ``VariableBatchSampler``,
``make_dataloader``, ``pad_sample``, ``PaddedCollate``, ``seqlens_from_padded``,
``micro_batch_loss_weight``.

Guarantees: no micro-batch ever costs more than ``max_tokens``; every sample is
trained on once per epoch or listed in ``Plan.dropped`` with a reason; every rank
computes the identical plan. Depends on the standard library, numpy and torch;
DeepSpeed is imported only inside the functions that need it.
Tests: ``python -m pytest test_varbatch.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import math
import numbers
import types
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = [
    # DeepSpeed-compatible names (deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr)
    "batch_by_seqlens",
    "scale_lr",
    "dataloader_for_variable_batch_size",
    "VariableBatchSizeLR",
    "lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
    # varbatch's own API
    "Plan",
    "plan_batches",
    "VariableBatchSampler",
    "make_dataloader",
    "pad_sample",
    "PaddedCollate",
    "seqlens_from_padded",
    "micro_batch_loss_weight",
    "ORDERS",
    "BUDGETS",
    "LR_SCALING_METHODS",
    "LR_SCALING_UNITS",
    "DROP_REASONS",
]

__version__ = "0.1.0"

_logger = logging.getLogger("varbatch")

ORDERS = ("dataloader", "seqlen", "random", "bucket")
BUDGETS = ("sum", "padded")
LR_SCALING_METHODS = ("linear", "sqrt", "none")
LR_SCALING_UNITS = ("sequences", "tokens")
DROP_REASONS = ("over_budget", "min_batch_size", "tail", "filtered")
_ON_OVERLONG = ("skip", "error")

# `random` and `bucket` orders never use an unseeded generator: without a seed
# every rank would draw a different permutation (DeepSpeed's `random` order with
# seed=None does exactly that, so ranks train overlapping subsets).
_DEFAULT_SEED = 0
# Samples per sorted window of the `bucket` order (see `_picking_order`).
_DEFAULT_BUCKET_SIZE = 4096
# How many dropped ids one log line names at most.
_MAX_IDS_IN_MESSAGE = 10


# =============================================================================
# Validation
# =============================================================================
# One template for every message: parameter, offending value, constraint, fix.


def _check_int(name: str, value: Any, *, minimum: int | None = None, fix: str = "") -> int:
    """Returns ``value`` as an int, or raises naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} should be an integer, but got {name}={value!r} "
                        f"of type {type(value).__name__}{'; ' + fix if fix else ''}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} should be an integer >= {minimum}, but got {name}={value}"
                         f"{'; ' + fix if fix else ''}")
    return value


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """Returns ``value`` if it is one of ``choices``; else names the closest one."""
    if isinstance(value, str) and value in choices:
        return value
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{name} should be one of {', '.join(map(repr, choices))}, "
                     f"but got {name}={value!r}{hint}")


def _format_ids(ids: np.ndarray) -> str:
    """``'3 samples (ids 4, 9, 12)'``, naming at most `_MAX_IDS_IN_MESSAGE` ids."""
    shown = ", ".join(str(int(i)) for i in ids[:_MAX_IDS_IN_MESSAGE])
    more = ", ..." if len(ids) > _MAX_IDS_IN_MESSAGE else ""
    return f"{len(ids)} sample{'s' if len(ids) != 1 else ''} (ids {shown}{more})"


def _as_seqlens(seqlens: Any, name: str = "seqlens") -> np.ndarray:
    """Validates per-sample lengths and returns them as a read-only int64 array."""
    if isinstance(seqlens, (str, bytes)) or seqlens is None:
        raise TypeError(f"{name} should be a sequence of positive integers (one per sample), "
                        f"but got {name}={seqlens!r}")
    if isinstance(seqlens, torch.Tensor):
        seqlens = seqlens.detach().cpu().numpy()
    array = np.asarray(seqlens)
    if array.ndim == 2 and array.shape[1] == 1:  # DeepSpeed's metric files are N x 1
        array = array[:, 0]
    if array.ndim != 1:
        raise ValueError(f"{name} should be one-dimensional (one length per sample), "
                         f"but got an array of shape {array.shape}")
    if array.dtype == bool or not (np.issubdtype(array.dtype, np.integer)
                                   or np.issubdtype(array.dtype, np.floating)):
        raise TypeError(f"{name} should hold integers, but got dtype {array.dtype}; "
                        f"pass the token count of every sample")
    if np.issubdtype(array.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(array) | (array != np.round(array)))
        if len(bad):
            raise ValueError(f"{name} should hold whole token counts, but {name}[{bad[0]}]="
                             f"{array[bad[0]].item()!r} ({len(bad)} such values); "
                             f"pass the token count of every sample")
    array = array.astype(np.int64, copy=True)
    bad = np.flatnonzero(array < 1)
    if len(bad):
        raise ValueError(f"{name} should be >= 1 for every sample, but {name}[{bad[0]}]={array[bad[0]]} "
                         f"({len(bad)} such values); remove empty samples from the dataset "
                         f"or pass their real token counts")
    array.setflags(write=False)
    return array


# =============================================================================
# The planner (pure: plain data in, plain data out)
# =============================================================================


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """The packing of one epoch: micro-batches grouped into batches, and the drops.

    A plan is plain, read-only data that depends only on (seqlens, settings,
    seed, epoch), so every rank computes the same one. Micro-batch ``j`` holds
    ``sample_ids[microbatch_offsets[j]:microbatch_offsets[j + 1]]``; batch ``b``
    (one optimizer step) holds micro-batches ``b*k .. b*k + k - 1`` with
    ``k = effective_batch_size``.

    Attributes:
        sample_ids: packed sample ids, micro-batch after micro-batch.
        microbatch_offsets: ``num_microbatches + 1`` offsets into ``sample_ids``.
        effective_batch_size: micro-batches per batch (``train_batch_size``).
        batch_sizes: samples (sequences) per batch, the B of the LR rule.
        batch_tokens: real tokens (sum of seqlens) per batch.
        batch_max_seqlens: longest sample per batch, the padded S in same-length mode.
        dropped: reason -> ids of the samples not in the plan, for every reason
            in `DROP_REASONS`.
        max_tokens, budget, epoch, seed: the settings the plan was made with.
    """

    sample_ids: np.ndarray
    microbatch_offsets: np.ndarray
    effective_batch_size: int
    batch_sizes: np.ndarray
    batch_tokens: np.ndarray
    batch_max_seqlens: np.ndarray
    dropped: Mapping[str, np.ndarray]
    max_tokens: int
    budget: str
    epoch: int
    seed: int

    @property
    def num_batches(self) -> int:
        return len(self.batch_sizes)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatch_offsets) - 1

    @property
    def num_dropped(self) -> int:
        return sum(len(ids) for ids in self.dropped.values())

    def microbatch(self, j: int) -> np.ndarray:
        """The sample ids of micro-batch ``j``."""
        return self.sample_ids[self.microbatch_offsets[j]:self.microbatch_offsets[j + 1]]

    def microbatches(self) -> list[list[int]]:
        """Every micro-batch as a list of sample ids, in plan order."""
        ids = self.sample_ids.tolist()
        bounds = self.microbatch_offsets.tolist()
        return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def microbatch_sizes(self) -> np.ndarray:
        """Samples per micro-batch."""
        return np.diff(self.microbatch_offsets)

    def fingerprint(self) -> str:
        """A short hash of the packing, equal on ranks that computed the same plan."""
        digest = hashlib.sha256()
        for array in (self.sample_ids, self.microbatch_offsets):
            digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
        digest.update(str(self.effective_batch_size).encode())
        return digest.hexdigest()[:16]


def _stable_argsort(values: np.ndarray) -> np.ndarray:
    """A stable argsort; lengths below 2**16 take numpy's linear-time radix sort."""
    if len(values) and values.max() < 2 ** 16:
        values = values.astype(np.uint16)
    return np.argsort(values, kind="stable")


def _picking_order(seqlens: np.ndarray, ids: np.ndarray, order: str, rng: np.random.Generator,
                   bucket_size: int) -> np.ndarray:
    """Returns ``ids`` in the order in which the packer picks them."""
    if order == "dataloader":
        return ids
    if order == "seqlen":
        # Equal lengths in id order, whatever the order of `ids` (as DeepSpeed's sort of
        # (len, id) pairs): a stable sort by length of the ids in ascending order.
        ascending = ids if (ids[1:] > ids[:-1]).all() else np.sort(ids)
        return ascending[_stable_argsort(seqlens[ascending])]
    shuffled = ids[rng.permutation(len(ids))]
    if order == "random":
        return shuffled
    # `bucket`: sort inside windows of `bucket_size` shuffled samples, alternately
    # ascending and descending, so that a micro-batch spanning two windows joins
    # samples of similar length (long with long, short with short) instead of the
    # longest of one window with the shortest of the next.
    out = shuffled.copy()
    for w, start in enumerate(range(0, len(out), bucket_size)):
        window = out[start:start + bucket_size]
        ranked = window[_stable_argsort(seqlens[window])]
        out[start:start + bucket_size] = ranked if w % 2 == 0 else ranked[::-1]
    return out


def _pack_one_by_one(lens: list[int], max_tokens: int, padded: bool, min_bs: int,
                     max_bs: int) -> tuple[list[int], list[int], list[int]]:
    """Greedy packing of micro-batches from consecutive samples.

    Each micro-batch takes as many consecutive samples as fit: DeepSpeed's
    greedy rule, in one pass instead of DeepSpeed's re-validation of every
    candidate prefix.

    Returns:
        (ends, too_small, tail): the end position of every micro-batch (each
        starts where the previous one ended), the positions dropped because no
        micro-batch of ``min_bs`` samples fits from there, and the positions at
        the end of the order too few to make a micro-batch.
    """
    ends: list[int] = []
    too_small: list[int] = []
    n = len(lens)
    start = 0
    while start < n:
        # Invariant: lens[start:i] is a micro-batch within the budget and max_bs.
        count = total = longest = 0
        i = start
        while i < n:
            length = lens[i]
            longest_next = length if length > longest else longest
            cost = (count + 1) * longest_next if padded else total + length
            if cost > max_tokens or count + 1 > max_bs:
                break
            count += 1
            total += length
            longest = longest_next
            i += 1
        if count >= min_bs:
            ends.append(i)
            start = i
        elif i == n:  # ran out of samples, not of budget
            return ends, too_small, list(range(start, n))
        else:  # the budget cannot hold min_bs samples starting here: skip one sample
            too_small.append(start)
            start += 1
    return ends, too_small, []


def _pack_same_size(lens: np.ndarray, k: int, max_tokens: int, padded: bool, same_length: bool,
                    min_bs: int, max_bs: int) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Greedy packing of whole batches of ``k`` micro-batches of equal size.

    A batch of ``n`` samples per micro-batch takes the next ``n * k`` samples,
    seen as ``n`` rows of ``k``; micro-batch ``b`` is column ``b``, every k-th
    sample from ``b`` (DeepSpeed's interleaving, which balances lengths across
    micro-batches in seqlen order). ``n`` is the largest for which every
    micro-batch fits. Rows are checked in numpy blocks whose height starts at
    the previous batch's ``n`` and doubles while every row fits, so the work
    stays linear in the samples with few Python steps per batch.

    Returns:
        (batches, too_small, tail): ``(start, n)`` per batch, the positions
        skipped because not even ``min_bs`` rows fit, and the tail positions.
    """
    batches: list[tuple[int, int]] = []
    too_small: list[int] = []
    total_len = len(lens)
    start = 0
    # First guess at the rows of a batch: how many samples of mean length fit; then the last batch's.
    guess = max(1, int(max_tokens // max(1.0, float(lens.mean())))) + 1 if total_len else 1
    while start + k <= total_len:
        rows_left = min((total_len - start) // k, max_bs)
        rows = min(guess, rows_left)
        while True:
            block = lens[start:start + rows * k].reshape(rows, k)  # rows x k: column b is micro-batch b
            if padded and same_length:  # every micro-batch is padded to the batch's longest sample
                fits = np.arange(1, rows + 1) * np.maximum.accumulate(block.max(axis=1)) <= max_tokens
            elif padded:
                count = np.arange(1, rows + 1)[:, None]
                fits = (count * np.maximum.accumulate(block, axis=0) <= max_tokens).all(axis=1)
            else:
                fits = (np.cumsum(block, axis=0) <= max_tokens).all(axis=1)
            # `fits` is True for the first n rows and False after: costs only grow with rows.
            n = rows if fits.all() else int(fits.argmin())
            if n < rows or rows == rows_left:
                break
            rows = min(2 * rows, rows_left)
        guess = n + 1
        if n >= min_bs:
            batches.append((start, n))
            start += n * k
        elif n == rows_left:  # ran out of samples, not of budget
            break
        else:  # the budget cannot hold min_bs rows starting here: skip one sample
            too_small.append(start)
            start += 1
    return batches, too_small, list(range(start, total_len))


def _resplit_leftover(bounds: list[tuple[int, int]], k: int, min_bs: int) -> list[tuple[int, int]] | None:
    """Splits fewer than ``k`` micro-batches into exactly ``k``, or returns None.

    A part of a micro-batch never costs more than the whole (under either
    budget), so splitting keeps every micro-batch within the budget. The
    largest is cut in two until there are ``k``, at a multiple of ``min_bs``
    near its middle: a part of ``s`` samples can make ``s // min_bs`` parts,
    and such a cut keeps that room (halving 6 samples into 3 + 3 would leave
    room for 2 parts of 2, not 3). So this returns None exactly when the
    leftover cannot make ``k`` parts: when the sum of ``s // min_bs`` is below ``k``.
    """
    parts = list(bounds)
    while len(parts) < k:
        j = max(range(len(parts)), key=lambda p: parts[p][1] - parts[p][0])
        a, b = parts[j]
        if b - a < 2 * min_bs:  # the largest, so every part, is too small to cut
            return None
        mid = a + min_bs * (((b - a) // min_bs) // 2)
        parts[j:j + 1] = [(a, mid), (mid, b)]
    return parts


def plan_batches(
    seqlens: Sequence[int] | np.ndarray,
    max_tokens: int,
    *,
    effective_batch_size: int = 1,
    budget: str = "sum",
    order: str = "dataloader",
    min_batch_size: int | None = 1,
    max_batch_size: int | None = None,
    sample_ids: Sequence[int] | np.ndarray | None = None,
    same_size: bool = False,
    same_length: bool = False,
    seed: int | None = None,
    epoch: int = 0,
    bucket_size: int | None = None,
    on_overlong: str = "skip",
) -> Plan:
    """Packs one epoch of samples into micro-batches and batches under a token budget.

    Args:
        seqlens: the token count of every sample in the dataset (``L_i >= 1``).
        max_tokens: the budget of one micro-batch. With ``budget="sum"`` it
            bounds the sum of the seqlens of the micro-batch (DeepSpeed's
            meaning); with ``budget="padded"`` it bounds ``n x S``, the size of
            the padded ``B x S`` tensor, where S is the micro-batch's longest
            sample (the batch's longest when ``same_length``).
        effective_batch_size: ``k``, micro-batches per batch (one optimizer
            step): micro-batches per GPU x accumulation steps x data-parallel ranks.
        budget: ``"sum"`` or ``"padded"``, as above.
        order: ``"dataloader"`` (index order), ``"seqlen"`` (ascending, ties by id),
            ``"random"`` (a permutation drawn from ``(seed, epoch)``) or
            ``"bucket"`` (random, sorted inside windows of ``bucket_size``
            samples, then the batches shuffled: random with little padding).
        min_batch_size, max_batch_size: bounds on the samples per micro-batch
            (None or 0: unbounded, as in DeepSpeed).
        sample_ids: the subset of samples to pack (curriculum filtering); the
            rest is reported as ``filtered``. In ``dataloader`` order they are
            packed in the given order.
        same_size: every micro-batch of a batch holds the same number of samples
            (pipeline parallelism).
        same_length: every sample of a batch is padded to the batch's longest;
            only changes the ``padded`` budget, which then requires ``same_size``.
        seed: seed of the ``random`` and ``bucket`` orders; None means a fixed
            default, never an unseeded generator.
        epoch: the epoch; ``random`` and ``bucket`` draw a new order per epoch.
        bucket_size: samples per sorted window of the ``bucket`` order
            (default 4096, times ``k`` with ``same_size``: a same-size batch
            spans k micro-batches of a window). Larger: less padding, less
            randomness.
        on_overlong: ``"skip"`` reports samples longer than ``max_tokens`` as
            ``over_budget`` drops (with one warning); ``"error"`` refuses them.

    Returns:
        The `Plan`. With ``min_batch_size=1`` fewer than ``k`` samples are
        dropped as ``tail``; with a larger one, the micro-batches that do not
        fill a last batch are dropped as ``tail`` only when they cannot be cut
        into ``k`` micro-batches of ``min_batch_size`` samples or more (plus
        fewer than ``min_batch_size`` samples at the very end). A sample is
        dropped as ``min_batch_size`` only where no micro-batch of
        ``min_batch_size`` samples starting with it fits the budget.

    Raises:
        TypeError, ValueError: on bad input, naming the value and the fix.

    Example:
        >>> plan = plan_batches([3, 5, 2, 6, 4, 1], max_tokens=8, effective_batch_size=2)
        >>> plan.microbatches(), plan.batch_sizes.tolist()
        ([[0, 1], [2, 3], [4], [5]], [4, 2])
    """
    # 1. Validate everything before any work.
    lengths = _as_seqlens(seqlens)
    max_tokens = _check_int("max_tokens", max_tokens, minimum=1,
                            fix="set it to the number of tokens one micro-batch may hold")
    k = _check_int("effective_batch_size", effective_batch_size, minimum=1,
                   fix="it counts micro-batches per optimizer step (train_batch_size)")
    budget = _check_choice("budget", budget, BUDGETS)
    order = _check_choice("sequence_picking_order", order, ORDERS)
    on_overlong = _check_choice("on_overlong", on_overlong, _ON_OVERLONG)
    min_bs = 1 if min_batch_size in (None, 0) else _check_int("min_batch_size", min_batch_size, minimum=1)
    max_bs = None if max_batch_size in (None, 0) else _check_int("max_batch_size", max_batch_size, minimum=1)
    if max_bs is not None and min_bs > max_bs:
        raise ValueError(f"min_batch_size should be <= max_batch_size, but got min_batch_size={min_bs} "
                         f"and max_batch_size={max_bs}; lower min_batch_size or raise max_batch_size")
    seed = _DEFAULT_SEED if seed is None else _check_int("seed", seed, minimum=0)
    epoch = _check_int("epoch", epoch, minimum=0)
    bucket_size_arg = bucket_size
    bucket_size = _DEFAULT_BUCKET_SIZE if bucket_size is None else _check_int("bucket_size", bucket_size, minimum=1)
    if not isinstance(same_size, bool) or not isinstance(same_length, bool):
        raise TypeError(f"same_size and same_length should be bools, but got same_size={same_size!r}, "
                        f"same_length={same_length!r}")
    if budget == "padded" and same_length and not same_size:
        raise ValueError("budget='padded' with same_length=True needs same_size=True: the padded size of "
                         "a micro-batch then depends on the whole batch; set same_size=True (as the "
                         "pipeline mode does) or use budget='sum'")
    num_samples = len(lengths)
    if sample_ids is None:
        ids = np.arange(num_samples, dtype=np.int64)
    else:
        ids = _as_sample_ids(sample_ids, num_samples)

    # 2. Samples that alone exceed the budget can never be packed.
    overlong_mask = lengths[ids] > max_tokens
    overlong = ids[overlong_mask]
    if len(overlong):
        if on_overlong == "error":
            raise ValueError(f"max_tokens={max_tokens} is smaller than {_format_ids(overlong)} "
                             f"(longest {int(lengths[overlong].max())}); raise max_tokens, "
                             f"truncate them, or pass on_overlong='skip'")
        if len(overlong) == len(ids):
            raise ValueError(f"every sample is longer than max_tokens={max_tokens} (shortest "
                             f"{int(lengths[ids].min())}); raise max_tokens")
        ids = ids[~overlong_mask]

    # 3. Put the samples in picking order and pack them.
    rng = np.random.default_rng((seed, epoch))
    if order == "bucket" and bucket_size_arg is None and same_size:
        # A same-size batch spans n x k samples of a window, not n: a window k times
        # larger keeps the lengths inside a batch as close as a micro-batch's.
        bucket_size *= k
    picked = _picking_order(lengths, ids, order, rng, bucket_size)
    padded = budget == "padded"
    big = len(picked) + 1
    if same_size and k > 1:
        batch_rows, too_small, tail = _pack_same_size(lengths[picked], k, max_tokens, padded, same_length,
                                                      min_bs, max_bs or big)
        # Batch (start, n) lists position start + r*k + b as the r-th sample of micro-batch b.
        starts = np.asarray([start for start, _ in batch_rows], dtype=np.int64)
        rows = np.asarray([n for _, n in batch_rows], dtype=np.int64)
        micro_sizes = np.repeat(rows, k)
        per_sample_batch = np.repeat(np.arange(len(rows)), rows * k)
        local = np.arange(int((rows * k).sum())) - np.repeat(np.cumsum(rows * k) - rows * k, rows * k)
        n_of = rows[per_sample_batch]
        position_array = starts[per_sample_batch] + (local % n_of) * k + local // n_of
    else:
        # With k == 1 every batch is one micro-batch: same-size holds trivially.
        ends, too_small, tail = _pack_one_by_one(lengths[picked].tolist(), max_tokens, padded, min_bs,
                                                 max_bs or big)
        starts = [0] + ends[:-1]
        # Drops in the middle break contiguity: a micro-batch starts at its first kept position.
        skipped = set(too_small)
        bounds = []
        for a, b in zip(starts, ends):
            while a in skipped:
                a += 1
            bounds.append((a, b))
        full = len(bounds) - len(bounds) % k
        leftover = bounds[full:]
        bounds = bounds[:full]
        if leftover:
            resplit = _resplit_leftover(leftover, k, min_bs)
            if resplit is None:
                tail = [p for a, b in leftover for p in range(a, b)] + tail
            else:
                bounds += resplit
        first = np.asarray([a for a, _ in bounds], dtype=np.int64)
        micro_sizes = np.asarray([b for _, b in bounds], dtype=np.int64) - first
        # Micro-batch j holds the consecutive positions first[j] .. first[j] + size - 1.
        position_array = np.arange(int(micro_sizes.sum())) + np.repeat(first - (np.cumsum(micro_sizes) - micro_sizes),
                                                                       micro_sizes)
    packed = picked[position_array]
    num_micro = len(micro_sizes)
    if num_micro == 0:
        raise ValueError(_not_enough_samples_message(len(ids), k, min_bs))

    # 4. Shuffle whole batches in `bucket` order: windows are sorted, batches need not be.
    if order == "bucket":
        batch_order = rng.permutation(num_micro // k)
        batch_bounds = np.concatenate([[0], np.cumsum(micro_sizes)])[::k]
        batch_lens = np.diff(batch_bounds)[batch_order]
        new_starts = np.cumsum(batch_lens) - batch_lens
        packed = packed[np.arange(len(packed)) + np.repeat(batch_bounds[batch_order] - new_starts, batch_lens)]
        micro_sizes = micro_sizes.reshape(-1, k)[batch_order].ravel()
    offsets_array = np.concatenate([[0], np.cumsum(micro_sizes)]).astype(np.int64)

    # 5. Per-batch statistics for the LR rule and for padding.
    batch_starts = offsets_array[:-1:k]
    packed_lens = lengths[packed]
    batch_sizes = np.diff(offsets_array[::k])
    batch_tokens = np.add.reduceat(packed_lens, batch_starts)
    batch_max = np.maximum.reduceat(packed_lens, batch_starts)
    dropped = {
        "over_budget": np.sort(overlong),
        "min_batch_size": np.sort(picked[np.asarray(too_small, dtype=np.int64)]),
        "tail": np.sort(picked[np.asarray(tail, dtype=np.int64)]),
        "filtered": _filtered_ids(num_samples, sample_ids, ids, overlong),
    }
    for array in (packed, offsets_array, batch_sizes, batch_tokens, batch_max, *dropped.values()):
        array.setflags(write=False)
    return Plan(sample_ids=packed, microbatch_offsets=offsets_array, effective_batch_size=k,
                batch_sizes=batch_sizes, batch_tokens=batch_tokens, batch_max_seqlens=batch_max,
                dropped=types.MappingProxyType(dropped), max_tokens=max_tokens, budget=budget,
                epoch=epoch, seed=seed)


def _as_sample_ids(sample_ids: Any, num_samples: int) -> np.ndarray:
    """Validates a subset of sample ids (curriculum filtering)."""
    if isinstance(sample_ids, torch.Tensor):
        sample_ids = sample_ids.detach().cpu().numpy()
    ids = np.asarray(sample_ids)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0) or ids.dtype == bool:
        raise TypeError(f"sample_ids (dataset_filter_ids) should be a 1-D sequence of integer sample ids, "
                        f"but got dtype {ids.dtype} and shape {ids.shape}")
    ids = ids.astype(np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= num_samples))
    if len(bad):
        raise ValueError(f"sample_ids should be in [0, {num_samples}) (the dataset has {num_samples} "
                         f"samples), but got sample_ids[{bad[0]}]={ids[bad[0]]}; "
                         f"remove ids that are not in the dataset")
    unique, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        dup = unique[counts > 1]
        raise ValueError(f"sample_ids should name each sample once, but {_format_ids(dup)} appear "
                         f"more than once; deduplicate them (np.unique)")
    return ids


def _filtered_ids(num_samples: int, sample_ids: Any, kept: np.ndarray, overlong: np.ndarray) -> np.ndarray:
    """The samples left out by the ``sample_ids`` subset."""
    if sample_ids is None:
        return np.zeros(0, dtype=np.int64)
    mask = np.ones(num_samples, dtype=bool)
    mask[kept] = False
    mask[overlong] = False
    return np.flatnonzero(mask).astype(np.int64)


def _not_enough_samples_message(num_eligible: int, k: int, min_bs: int) -> str:
    return (f"not enough samples for one batch: {num_eligible} eligible samples, but a batch of "
            f"effective_batch_size={k} micro-batches of at least min_batch_size={min_bs} samples "
            f"needs at least {k * min_bs}; use more data, fewer ranks or accumulation steps, "
            f"or a smaller min_batch_size")


# =============================================================================
# Learning-rate math
# =============================================================================
# Linear rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): when the batch
# is k times larger, multiply the LR by k. Square-root rule (Krizhevsky 2014, "One
# weird trick"): multiply it by sqrt(k), which keeps the variance of the gradient
# step constant. The linear rule suits SGD with warmup; the square-root rule is the
# usual choice for Adam-type optimizers and large batches.


def _check_lr_method(method: Any) -> Any:
    """Returns a valid LR scaling method: a name in `LR_SCALING_METHODS`, None or a callable."""
    if method is None or callable(method):
        return method
    if isinstance(method, str) and method.lower() in LR_SCALING_METHODS:
        return method.lower()
    return _check_choice("lr_scaling_method", method, LR_SCALING_METHODS)


def _lr_factor(ratio: float, method: Any) -> float:
    """The LR multiplier for a batch ``ratio`` times the reference batch."""
    if method is None or method == "none":
        return 1.0
    if method == "linear":
        return ratio
    if method == "sqrt":
        return math.sqrt(ratio)
    factor = method(ratio)
    if not isinstance(factor, numbers.Real) or not math.isfinite(factor) or factor < 0:
        raise ValueError(f"lr_scaling_method={method!r} should return a finite factor >= 0, "
                         f"but returned {factor!r} for the batch-size ratio {ratio}")
    return float(factor)


def _reference_batch_size(sizes: np.ndarray, reference: Any) -> float:
    """``B_ref`` as a number: ``reference`` itself, or the mean of ``sizes`` for ``"mean"``."""
    if isinstance(reference, str) and reference == "mean":
        return float(np.mean(sizes))
    return float(reference)


def _lr_factors(sizes: np.ndarray, reference: Any, method: Any) -> np.ndarray:
    """``s(B / B_ref)`` for every batch size ``B`` in ``sizes``."""
    reference = _reference_batch_size(sizes, reference)
    return np.array([_lr_factor(b / reference, method) for b in np.asarray(sizes).tolist()], dtype=np.float64)


def scale_lr(base_batch_size, batch_size, base_lr=1, method="linear"):
    """The learning rate for ``batch_size``, given ``base_lr`` tuned at ``base_batch_size``.

    Args:
        base_batch_size: the reference batch size ``B_ref`` (> 0).
        batch_size: the batch size ``B`` of the step, in the same unit.
        base_lr: the LR at the reference batch size.
        method: ``"linear"`` (``lr x B/B_ref``), ``"sqrt"`` (``lr x sqrt(B/B_ref)``),
            ``"none"`` or None (``lr``), or a callable ``f(B/B_ref) -> factor``.

    Example:
        >>> scale_lr(2, 10, 1e-3), scale_lr(2, 4, 1e-3), scale_lr(4, 16, 1.0, "sqrt")
        (0.005, 0.002, 2.0)
    """
    if isinstance(base_batch_size, bool) or not isinstance(base_batch_size, numbers.Real) \
            or not base_batch_size > 0 or not math.isfinite(base_batch_size):
        raise ValueError(f"base_batch_size should be a number > 0 (the batch size the LR was tuned for), "
                         f"but got base_batch_size={base_batch_size!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Real) or not batch_size >= 0:
        raise ValueError(f"batch_size should be a number >= 0, but got batch_size={batch_size!r}")
    return base_lr * _lr_factor(batch_size / base_batch_size, _check_lr_method(method))


def micro_batch_loss_weight(count, batch_count, *, num_replicas=1, gradient_accumulation_steps=1):
    """The weight of one step input's mean loss, so the batch's gradient is the batch mean's.

    Micro-batches of one batch hold different numbers of samples (or tokens).
    Averaging their mean losses would weight a sample of a small micro-batch more
    than one of a large micro-batch. Multiplying each step input's mean loss by
    ``count / batch_count`` makes the *sum* over all step inputs of the batch (all
    ranks, all accumulation steps) the mean over the batch. Engines that *average*
    gradients over ranks and accumulation steps (DDP, DeepSpeed's ``backward``)
    divide by ``num_replicas x gradient_accumulation_steps``; pass both so the
    weight undoes that.

    Args:
        count: samples (or real tokens) in this step input.
        batch_count: samples (or real tokens) in the whole batch.
        num_replicas, gradient_accumulation_steps: what the engine averages over
            (1 and 1 for a plain loop that sums ``loss.backward()`` calls).

    Example:
        >>> micro_batch_loss_weight(3, 12), micro_batch_loss_weight(3, 12, num_replicas=2)
        (0.25, 0.5)
    """
    if not batch_count > 0:
        raise ValueError(f"batch_count should be > 0, but got batch_count={batch_count!r}")
    return count / batch_count * num_replicas * gradient_accumulation_steps


# =============================================================================
# Plan reports, and DeepSpeed's entry point to the planner
# =============================================================================
# Totals of a plan as plain data and as text: the verbose training log and the
# command line print the same numbers. `batch_by_seqlens` sits here, after the
# LR math and the reports it logs with, rather than beside `plan_batches`.


def _plan_lr_factors(plan: Plan, lr_scaling_method="linear", lr_scaling_reference=None,
                     lr_scaling_unit="sequences") -> np.ndarray:
    """The LR factor ``s(B_t / B_ref)`` of every batch of ``plan``, as `VariableBatchSizeLR` applies it.

    Args:
        lr_scaling_method: ``"linear"``, ``"sqrt"``, ``"none"``/None or a callable (see `scale_lr`).
        lr_scaling_reference: ``B_ref``: None for ``plan.effective_batch_size``
            (``train_batch_size``, DeepSpeed's default), a number, or ``"mean"``.
        lr_scaling_unit: ``"sequences"`` or ``"tokens"``: the unit of ``B_t`` and ``B_ref``.

    Example:
        >>> plan = plan_batches([3, 5, 2, 6, 4, 1], max_tokens=8, effective_batch_size=2)
        >>> _plan_lr_factors(plan).tolist(), _plan_lr_factors(plan, "linear", "mean").tolist()
        ([2.0, 1.0], [1.3333333333333333, 0.6666666666666666])
    """
    method = _check_lr_method(lr_scaling_method)
    unit = _check_choice("lr_scaling_unit", lr_scaling_unit, LR_SCALING_UNITS)
    sizes = plan.batch_tokens if unit == "tokens" else plan.batch_sizes
    return _lr_factors(sizes, _lr_reference(plan, lr_scaling_reference, unit), method)


def _lr_reference(plan: Plan, lr_scaling_reference, lr_scaling_unit: str) -> float:
    """``B_ref`` as a number: ``train_batch_size`` when None, the plan's mean batch size for ``"mean"``."""
    if lr_scaling_reference is None:
        return float(plan.effective_batch_size)
    if not (isinstance(lr_scaling_reference, str) and lr_scaling_reference == "mean"):
        scale_lr(lr_scaling_reference, 1)  # validates it
    sizes = plan.batch_tokens if lr_scaling_unit == "tokens" else plan.batch_sizes
    return _reference_batch_size(sizes, lr_scaling_reference)


def _accumulation_steps(k: int, micro_batch_size: int, num_replicas: int) -> int:
    """``k / (micro_batch_size x num_replicas)``, or raises when it is not whole."""
    if k % (micro_batch_size * num_replicas):
        raise ValueError(f"effective_batch_size={k} should be a multiple of micro_batch_size x num_replicas = "
                         f"{micro_batch_size} x {num_replicas}; set train_batch_size = micro batch per GPU x "
                         f"gradient accumulation steps x data-parallel size")
    return k // (micro_batch_size * num_replicas)


def _padded_seqlens(plan: Plan, seqlens: np.ndarray, *, same_length: bool = False, micro_batch_size: int = 1,
                    num_replicas: int = 1) -> np.ndarray:
    """The padded S of every micro-batch: the longest sample of the tensor it is collated into.

    A step input collates ``micro_batch_size`` micro-batches of one rank into
    one tensor, padded to their longest sample; in same-length mode (pipeline)
    every sample of a batch is padded to the batch's longest.
    """
    k = plan.effective_batch_size
    if same_length:
        return np.repeat(plan.batch_max_seqlens, k)
    # No micro-batch is empty, so reduceat sees no empty segment.
    own = np.maximum.reduceat(seqlens[plan.sample_ids], plan.microbatch_offsets[:-1])
    if micro_batch_size == 1:
        return own
    accumulation = _accumulation_steps(k, micro_batch_size, num_replicas)
    # Micro-batch i of a batch goes to rank i % num_replicas; that rank's
    # (i // num_replicas)-th micro-batch, in step input (i // num_replicas) //
    # micro_batch_size (the sampler's dealing, see VariableBatchSampler._step_keys).
    j = np.arange(plan.num_microbatches)
    i = j % k
    rank, position = i % num_replicas, i // num_replicas
    step_input = ((j // k) * num_replicas + rank) * accumulation + position // micro_batch_size
    longest = np.zeros(int(step_input.max()) + 1, dtype=np.int64)
    np.maximum.at(longest, step_input, own)
    return longest[step_input]


def _distribution(values: np.ndarray) -> dict:
    """min / median / mean / max of ``values`` as plain numbers."""
    values = np.asarray(values)
    return {"min": values.min().item(), "median": float(np.median(values)), "mean": float(values.mean()),
            "max": values.max().item()}


def _plan_totals(plan: Plan, seqlens, *, same_length: bool = False, micro_batch_size: int = 1,
                 num_replicas: int = 1, lr_scaling: Mapping | None = None) -> dict:
    """The totals of a plan as plain data: batches, drops, padding, distributions of B and S.

    Shared by ``python varbatch.py plan`` and the verbose training log; turn it
    into text with `_format_plan_totals`. Padding counts each micro-batch as
    ``n x S`` with S the longest sample of the tensor it is collated into (see
    `_padded_seqlens`); ``largest_padded_microbatch`` compares the largest such
    ``n x S`` with ``max_tokens``, which bounds it only with ``budget="padded"``.

    Args:
        plan: the plan.
        seqlens: the token count of every sample of the dataset (indexed by sample id).
        same_length: samples are padded to their batch's longest (pipeline mode).
        micro_batch_size, num_replicas: micro-batches per step input and
            data-parallel ranks (``k`` must be a multiple of their product);
            the accumulation steps are ``k / (micro_batch_size x num_replicas)``.
        lr_scaling: None to leave out the LR factors, or a dict with the keys
            ``method``, ``reference`` and ``unit`` (see `_plan_lr_factors`).

    Returns:
        A JSON-serializable dict.

    Example:
        >>> plan = plan_batches([3, 5, 2, 6, 4, 1], max_tokens=8, effective_batch_size=2)
        >>> totals = _plan_totals(plan, [3, 5, 2, 6, 4, 1])
        >>> totals["batches"], totals["real_tokens"], totals["padded_tokens"], totals["batch_size"]["max"]
        (2, 21, 27, 4)
    """
    seqlens = _as_seqlens(seqlens)
    k = plan.effective_batch_size
    micro_batch_size = _check_int("micro_batch_size", micro_batch_size, minimum=1)
    num_replicas = _check_int("num_replicas", num_replicas, minimum=1)
    accumulation = _accumulation_steps(k, micro_batch_size, num_replicas)
    padded_s = _padded_seqlens(plan, seqlens, same_length=same_length, micro_batch_size=micro_batch_size,
                               num_replicas=num_replicas)
    sizes = plan.microbatch_sizes()
    padded = sizes * padded_s
    largest = int(np.argmax(padded))
    real = int(plan.batch_tokens.sum())
    totals = {
        "epoch": plan.epoch,
        "max_tokens": plan.max_tokens,
        "budget": plan.budget,
        "effective_batch_size": k,
        "micro_batch_size": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "num_replicas": num_replicas,
        "same_length": bool(same_length),
        "batches": plan.num_batches,
        "optimizer_steps_per_epoch": plan.num_batches,
        "step_inputs_per_rank": plan.num_batches * accumulation,
        "microbatches": plan.num_microbatches,
        "samples": int(plan.batch_sizes.sum()),
        "dropped": {reason: len(ids) for reason, ids in plan.dropped.items()},
        "num_dropped": plan.num_dropped,
        "real_tokens": real,
        "padded_tokens": int(padded.sum()),
        "efficiency": real / float(padded.sum()),
        "largest_padded_microbatch": {"microbatch": largest, "sequences": int(sizes[largest]),
                                      "padded_seqlen": int(padded_s[largest]), "tokens": int(padded[largest]),
                                      "over_max_tokens": float(padded[largest] / plan.max_tokens)},
        "batch_size": _distribution(plan.batch_sizes),
        "batch_tokens": _distribution(plan.batch_tokens),
        "microbatch_size": _distribution(sizes),
        "padded_seqlen": _distribution(padded_s),
    }
    if lr_scaling is not None:
        unknown = sorted(set(lr_scaling) - {"method", "reference", "unit"})
        if unknown:
            raise ValueError(f"lr_scaling has unknown keys {unknown}; use 'method', 'reference' and 'unit'")
        method = lr_scaling.get("method", "linear")
        reference = lr_scaling.get("reference")
        unit = lr_scaling.get("unit", "sequences")
        factors = _plan_lr_factors(plan, method, reference, unit)
        totals["lr_factor"] = {**_distribution(factors),
                               "method": ("none" if method is None else method if isinstance(method, str)
                                          else "callable"),
                               "reference": reference if reference is not None else "train_batch_size",
                               "reference_value": _lr_reference(plan, reference, unit), "unit": unit}
    return totals


def _plural(count: int, word: str, plural: str | None = None) -> str:
    """``'1 rank'``, ``'2 ranks'``."""
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _number(value: float) -> str:
    """A statistic for people: whole numbers as such, else 3 significant digits, never 1e+03."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"


def _format_plan_totals(totals: Mapping) -> str:
    """`_plan_totals` as a few lines of text (the same words as the JSON keys).

    Example:
        >>> plan = plan_batches([3, 5, 2, 6, 4, 1], max_tokens=8, effective_batch_size=2)
        >>> print(_format_plan_totals(_plan_totals(plan, [3, 5, 2, 6, 4, 1])).splitlines()[3])
        tokens: 21 real / 27 padded = 77.8% efficiency
    """
    t = totals

    def dist(d: Mapping) -> str:
        return " / ".join(f"{key} {_number(d[key])}" for key in ("min", "median", "mean", "max"))

    big = t["largest_padded_microbatch"]
    drops = ", ".join(f"{count} {reason}" for reason, count in t["dropped"].items())
    lines = [
        f"epoch {t['epoch']}: {_plural(t['batches'], 'batch', 'batches')} of "
        f"{_plural(t['effective_batch_size'], 'micro-batch', 'micro-batches')} ({t['micro_batch_size']} per "
        f"step input x {_plural(t['gradient_accumulation_steps'], 'accumulation step')} x "
        f"{_plural(t['num_replicas'], 'rank')}), {t['microbatches']} micro-batches in all",
        f"steps per epoch: {t['optimizer_steps_per_epoch']} optimizer steps, {t['step_inputs_per_rank']} "
        f"step inputs per rank",
        f"samples: {t['samples']} trained, {t['num_dropped']} dropped ({drops})",
        f"tokens: {t['real_tokens']} real / {t['padded_tokens']} padded = {t['efficiency']:.1%} efficiency",
        f"largest padded micro-batch: {big['sequences']} x {big['padded_seqlen']} = {big['tokens']} tokens = "
        f"{big['over_max_tokens']:.2f} x max_tokens={t['max_tokens']} (budget {t['budget']}"
        f"{', same length' if t['same_length'] else ''})",
        f"B (sequences per batch): {dist(t['batch_size'])}",
        f"sequences per micro-batch: {dist(t['microbatch_size'])}",
        f"S (padded seqlen per micro-batch): {dist(t['padded_seqlen'])}",
    ]
    lr = t.get("lr_factor")
    if lr is not None:
        lines.append(f"LR factor ({lr['method']} rule, B_ref={lr['reference']} = "
                     f"{_number(lr['reference_value'])} {lr['unit']}): {dist(lr)}")
        if not 0.5 <= lr["mean"] <= 2.0:
            lines.append(f"warning: the configured LR is multiplied by {lr['mean']:.3g} on average, because "
                         f"B_ref={lr['reference_value']:g} is far from the mean batch size; set "
                         f"lr_scaling_reference to \"mean\" or to the batch size (in {lr['unit']}) your LR "
                         f"was tuned for")
    return "\n".join(lines)


def batch_by_seqlens(
    seqlens,
    max_tokens,
    sequence_ids_per_mb=None,
    min_batch_size=1,
    max_batch_size=None,
    sequence_picking_order="dataloader",
    effective_batch_size=1,
    required_microbatches_of_same_size=False,
    verbose=False,
    seed=None,
    *,
    budget="sum",
    epoch=0,
    required_microbatches_of_same_seqlen=False,
    bucket_size=None,
    on_overlong="skip",
):
    """DeepSpeed's ``batch_by_seqlens``, without its data loss and in linear time.

    Same arguments and return values as DeepSpeed's; ``max_tokens`` counts the
    sum of seqlens of a micro-batch (``budget="sum"``) or its padded ``n x S``
    size (``budget="padded"``). See `plan_batches` for every argument;
    ``sequence_ids_per_mb`` is its ``sample_ids`` (the samples to use).

    Returns:
        ``(microbatch_ids, batch_sizes, batch_max_seqlens)``: a list of
        ``(batch_id, [sample ids])`` per micro-batch, the samples per batch,
        and the longest sample per batch.
    """
    plan = plan_batches(seqlens, max_tokens, effective_batch_size=effective_batch_size, budget=budget,
                        order=sequence_picking_order, min_batch_size=min_batch_size,
                        max_batch_size=max_batch_size, sample_ids=sequence_ids_per_mb,
                        same_size=bool(required_microbatches_of_same_size),
                        same_length=bool(required_microbatches_of_same_seqlen), seed=seed, epoch=epoch,
                        bucket_size=bucket_size, on_overlong=on_overlong)
    _log_drops(plan)
    if verbose:
        _logger.info(_format_plan_totals(_plan_totals(plan, seqlens)))
    k = plan.effective_batch_size
    microbatch_ids = [(j // k, ids) for j, ids in enumerate(plan.microbatches())]
    return microbatch_ids, plan.batch_sizes.tolist(), plan.batch_max_seqlens.tolist()


def _log_drops(plan: Plan) -> None:
    """One warning per reason with a count and the first ids; never an unbounded line."""
    for reason in ("over_budget", "min_batch_size", "tail"):
        ids = plan.dropped[reason]
        if len(ids):
            _logger.warning("epoch %d: dropped %s as %s", plan.epoch, _format_ids(ids), reason)



# =============================================================================
# Torch adapters: padding, collate, the batch sampler
# =============================================================================


def pad_sample(sample, length, pad_value=0):
    """Pads a sample ``S x ...`` to ``length x ...`` along its first dimension.

    The default ``sample_padding_fn``; picklable, so it works in spawned workers.
    Use ``functools.partial(pad_sample, pad_value=...)`` for another pad value.

    Example:
        >>> pad_sample(torch.ones(2, 3), 4).shape
        torch.Size([4, 3])
    """
    tensor = torch.as_tensor(sample)
    if tensor.dim() == 0:
        raise ValueError(f"pad_sample needs a sample with a sequence dimension, but got a scalar {sample!r}")
    seqlen = tensor.shape[0]
    if length < seqlen:
        raise ValueError(f"cannot pad a sample of seqlen {seqlen} to length={length}: the plan's "
                         f"max seqlen is smaller than the sample; the seqlens given to varbatch "
                         f"do not match the dataset")
    if length == seqlen:
        return tensor
    pad = tensor.new_full((length - seqlen, *tensor.shape[1:]), pad_value)
    return torch.cat([tensor, pad], dim=0)


class PaddedCollate:
    """Collates samples of different seqlens into ``B x S x ...`` plus their real lengths.

    Samples are tensors ``S_i x ...`` (or tuples of them: every field is padded
    along its first dimension and stacked, 0-dim fields are stacked). Returns
    ``(padded, seqlens)`` or ``(*fields, seqlens)`` where ``seqlens`` is a
    ``B`` int64 tensor of the first field's real lengths. ``S`` is the longest
    sample given: in same-length mode the samples arrive already padded to the
    batch's max seqlen, so every step input of a batch has the same ``S``.

    Example:
        >>> x, lens = PaddedCollate()([torch.ones(2, 4), torch.ones(3, 4)])
        >>> tuple(x.shape), lens.tolist()
        ((2, 3, 4), [2, 3])
    """

    def __init__(self, pad_value=0):
        self.pad_value = pad_value

    def _stack(self, items):
        tensors = [torch.as_tensor(item) for item in items]
        if tensors[0].dim() == 0:
            return torch.stack(tensors)
        longest = max(t.shape[0] for t in tensors)
        return torch.stack([pad_sample(t, longest, self.pad_value) for t in tensors])  # B x S x ...

    def __call__(self, samples, seqlens=None):
        """Collates ``samples``; ``seqlens`` are their real lengths when they arrive padded.

        `make_dataloader` passes ``seqlens`` in same-length mode, where the samples
        were padded to the batch's max seqlen before collation.
        """
        if len(samples) == 0:
            raise ValueError("PaddedCollate got an empty list of samples")
        tuples = isinstance(samples[0], (tuple, list))
        if seqlens is None:
            seqlens = [len(s[0]) if tuples else len(s) for s in samples]
        lengths = torch.as_tensor(seqlens, dtype=torch.int64)
        if tuples:
            return (*[self._stack(column) for column in zip(*samples)], lengths)
        return self._stack(samples), lengths

    def __repr__(self):
        return f"PaddedCollate(pad_value={self.pad_value!r})"


def seqlens_from_padded(batch, pad_value=0):
    """The real length of every sample of a collated batch (a ``batch_seqlens_fn``).

    Takes the ``seqlens`` that `PaddedCollate` appends when present; else, for a
    ``B x S x ...`` tensor (or a tuple whose first item is one), a position is
    real when any of its values differs from ``pad_value``, and a sample's length
    runs to its last real position.

    Example:
        >>> seqlens_from_padded(torch.tensor([[5, 6, 0], [7, 0, 0]]))
        [2, 1]
    """
    if isinstance(batch, (tuple, list)):
        last = batch[-1]
        if isinstance(last, torch.Tensor) and last.dim() == 1 and not last.dtype.is_floating_point \
                and len(batch) > 1:
            return [int(x) for x in last]
        batch = batch[0]
    tensor = torch.as_tensor(batch)
    if tensor.dim() < 2:
        raise ValueError(f"seqlens_from_padded needs a B x S (x ...) batch, but got shape {tuple(tensor.shape)}")
    real = (tensor != pad_value).reshape(tensor.shape[0], tensor.shape[1], -1).any(dim=2)  # B x S
    positions = torch.arange(1, tensor.shape[1] + 1)
    return [int(x) for x in (real * positions).max(dim=1).values]


def _identity(x):
    return x


class _KeyDataset(Dataset):
    """A dataset whose item ``key`` is ``key``: the sampler yields micro-batch keys."""

    def __getitem__(self, key):
        return key

    def __len__(self):
        # DeepSpeed's engine.deepspeed_io() takes only datasets with __getitem__ and
        # __len__ (the returned deepspeed_io_kwargs go there); the keys come from the
        # sampler, so there is no length to give.
        raise TypeError("_KeyDataset has no length: its items are the micro-batch keys its sampler yields")


class _Collate:
    """Loads the samples of a step input's micro-batch keys, pads them, collates them.

    A key is ``(batch_index, sample_ids, pad_to)``: ``pad_to`` is the batch's max
    seqlen in same-length mode, else 0. With ``seqlens`` (the plan's), every
    sample's length is checked against it, so a dataset that disagrees with the
    lengths it was planned with fails loudly instead of overshooting the budget.
    Picklable, so it runs in worker processes.
    """

    def __init__(self, dataset, collate_fn=None, sample_padding_fn=None, seqlens=None):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.sample_padding_fn = sample_padding_fn
        self.seqlens = seqlens

    def __call__(self, keys):
        samples = []
        real_lengths = []
        for _, sample_ids, pad_to in keys:
            for i in sample_ids:
                sample = self.dataset[i]
                got = _length_of(sample)
                if self.seqlens is not None and got is not None and got != self.seqlens[i]:
                    raise ValueError(f"sample {i} has length {got}, but it was planned with seqlen "
                                     f"{int(self.seqlens[i])}; the seqlens given to varbatch do not match "
                                     f"the dataset (recompute them, or delete a stale seqlen cache)")
                real_lengths.append(got)
                if pad_to:
                    sample = self.sample_padding_fn(sample, pad_to)
                    padded = _length_of(sample)
                    if padded is not None and padded != pad_to:
                        raise ValueError(f"sample_padding_fn should return a sample of length {pad_to}, "
                                         f"but returned length {padded} for sample {i}; it must pad the "
                                         f"sequence dimension (the first) to exactly `length`")
                samples.append(sample)
        if self.collate_fn is None:
            return samples
        if isinstance(self.collate_fn, PaddedCollate) and None not in real_lengths:
            return self.collate_fn(samples, seqlens=real_lengths)  # the real lengths, not the padded S
        return self.collate_fn(samples)


def _length_of(sample) -> int | None:
    """A sample's sequence length when it can be read, else None."""
    if isinstance(sample, (tuple, list)) and sample and hasattr(sample[0], "__len__"):
        sample = sample[0]
    try:
        return len(sample)
    except TypeError:
        return None


def _distributed_defaults(num_replicas, rank):
    """``num_replicas`` and ``rank`` from torch.distributed when not given."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if num_replicas is None:
        num_replicas = torch.distributed.get_world_size() if initialized else 1
    if rank is None:
        rank = torch.distributed.get_rank() if initialized else 0
    num_replicas = _check_int("num_replicas", num_replicas, minimum=1)
    rank = _check_int("rank", rank, minimum=0)
    if rank >= num_replicas:
        raise ValueError(f"rank should be in [0, num_replicas - 1], but got rank={rank} "
                         f"with num_replicas={num_replicas}")
    return num_replicas, rank


class VariableBatchSampler(Sampler[list[int]]):
    """Yields this rank's step inputs of a token-budget plan, a new plan every epoch.

    The algorithm: every rank computes the same `Plan` for the epoch (see
    `plan_batches`): micro-batches of at most ``max_tokens`` tokens, grouped
    into batches of ``k = micro_batch_size x gradient_accumulation_steps x
    num_replicas`` micro-batches. The micro-batches of a batch are dealt to the
    ranks in turn (micro-batch ``j`` to rank ``j % num_replicas``, as
    DeepSpeed's interleaving), and each rank groups its share into
    ``gradient_accumulation_steps`` step inputs of ``micro_batch_size``
    micro-batches. A step input is the list of its sample ids.

    Every rank yields the same number of step inputs (``len(sampler)``), so no
    collective waits forever. Iterating to the end advances the epoch, so a
    loop that never calls `set_epoch` still gets a new order per epoch in
    ``random`` and ``bucket`` order; `set_epoch` sets it explicitly.

    Tuning: ``max_tokens`` is the memory knob (with ``budget="padded"`` it is
    the size of the padded tensor); ``order="bucket"`` with ``budget="padded"``
    gives random batches with little padding; ``bucket_size`` trades padding
    (larger) against randomness (smaller).

    Args:
        seqlens: token count of every sample.
        max_tokens: budget of one micro-batch (sum of seqlens, or padded
            ``n x S`` with ``budget="padded"``).
        micro_batch_size: micro-batches per step input
            (DeepSpeed's ``train_micro_batch_size_per_gpu``).
        gradient_accumulation_steps: step inputs per rank per batch.
        num_replicas, rank: data-parallel size and rank (default: from
            torch.distributed, else 1 and 0).
        seed: seed of the ``random``/``bucket`` orders (None: a fixed default).
        **plan_options: ``budget``, ``order``, ``min_batch_size``,
            ``max_batch_size``, ``sample_ids``, ``same_size``, ``same_length``,
            ``bucket_size``, ``on_overlong``: see `plan_batches`.

    Example:
        >>> sampler = VariableBatchSampler([3, 5, 2, 6, 4, 1], max_tokens=8)
        >>> list(sampler), len(sampler)
        ([[0, 1], [2, 3], [4, 5]], 3)
    """

    def __init__(self, seqlens, max_tokens, *, micro_batch_size=1, gradient_accumulation_steps=1,
                 num_replicas=None, rank=None, seed=None, budget="sum", order="dataloader",
                 min_batch_size=1, max_batch_size=None, sample_ids=None, same_size=False,
                 same_length=False, bucket_size=None, on_overlong="skip", verbose=False):
        self.micro_batch_size = _check_int("micro_batch_size", micro_batch_size, minimum=1,
                                           fix="it is train_micro_batch_size_per_gpu, micro-batches per step input")
        self.gradient_accumulation_steps = _check_int("gradient_accumulation_steps",
                                                      gradient_accumulation_steps, minimum=1)
        self.num_replicas, self.rank = _distributed_defaults(num_replicas, rank)
        self.effective_batch_size = self.micro_batch_size * self.gradient_accumulation_steps * self.num_replicas
        self.seqlens = _as_seqlens(seqlens)
        self.seed = _DEFAULT_SEED if seed is None else _check_int("seed", seed, minimum=0)
        self.verbose = bool(verbose)
        self._options = dict(max_tokens=max_tokens, effective_batch_size=self.effective_batch_size,
                             budget=budget, order=order, min_batch_size=min_batch_size,
                             max_batch_size=max_batch_size, sample_ids=sample_ids, same_size=same_size,
                             same_length=same_length, seed=self.seed, bucket_size=bucket_size,
                             on_overlong=on_overlong)
        self.same_length = same_length
        self.epoch = 0
        self._start_step = 0   # first step input of the epoch to yield (mid-epoch resume)
        self._steps_done = 0   # step inputs yielded so far in this epoch
        self._plans: dict[int, Plan] = {}
        self._plans[0] = self._make_plan(0)  # validates every option now, before training

    # -- plans --------------------------------------------------------------

    def _make_plan(self, epoch: int) -> Plan:
        plan = plan_batches(self.seqlens, epoch=epoch, **self._options)
        if self.rank == 0:
            _log_drops(plan)
            if self.verbose:
                _logger.info(_format_plan_totals(_plan_totals(
                    plan, self.seqlens, same_length=self.same_length, micro_batch_size=self.micro_batch_size,
                    num_replicas=self.num_replicas)))
        return plan

    def plan_for_epoch(self, epoch: int) -> Plan:
        """The plan of ``epoch`` (computed once; the last few are kept)."""
        epoch = _check_int("epoch", epoch, minimum=0)
        if epoch not in self._plans:
            if len(self._plans) >= 3:
                del self._plans[min(self._plans)]
            self._plans[epoch] = self._make_plan(epoch)
        return self._plans[epoch]

    @property
    def plan(self) -> Plan:
        """The plan of the current epoch."""
        return self.plan_for_epoch(self.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of the next iteration (a new order in ``random``/``bucket``)."""
        epoch = _check_int("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self._start_step = 0
        self.epoch = epoch

    def __len__(self) -> int:
        """Step inputs per epoch on this rank (equal on every rank)."""
        return self.plan.num_batches * self.gradient_accumulation_steps

    # -- iteration ----------------------------------------------------------

    def _step_keys(self, plan: Plan, step: int) -> list[tuple[int, tuple[int, ...], int]]:
        """The micro-batch keys of this rank's step input ``step`` of ``plan``."""
        k, gas, mbs = plan.effective_batch_size, self.gradient_accumulation_steps, self.micro_batch_size
        batch, accumulation = divmod(step, gas)
        pad_to = int(plan.batch_max_seqlens[batch]) if self.same_length else 0
        keys = []
        for m in range(mbs):
            # Micro-batch j of the batch goes to rank j % num_replicas (DeepSpeed's interleaving).
            j = batch * k + self.rank + self.num_replicas * (accumulation * mbs + m)
            keys.append((batch, tuple(plan.microbatch(j).tolist()), pad_to))
        return keys

    def _iter_steps(self) -> Iterator[list[tuple[int, tuple[int, ...], int]]]:
        plan = self.plan
        epoch = self.epoch
        start, self._start_step = self._start_step, 0
        steps = plan.num_batches * self.gradient_accumulation_steps
        for step in range(start, steps):
            self._steps_done = step + 1
            yield self._step_keys(plan, step)
        if self.epoch == epoch:  # not changed by set_epoch meanwhile
            self.epoch = epoch + 1
            self._steps_done = 0

    def __iter__(self) -> Iterator[list[int]]:
        for keys in self._iter_steps():
            yield [i for _, ids, _ in keys for i in ids]

    def microbatch_keys(self) -> "_MicrobatchKeySampler":
        """A sampler of this rank's micro-batch keys, for `make_dataloader`."""
        return _MicrobatchKeySampler(self)

    # -- state --------------------------------------------------------------

    def _settings(self) -> dict:
        """Everything the plans depend on besides the epoch, as plain data (seqlens as a hash)."""
        def digest(array):
            return None if array is None else hashlib.sha256(
                np.ascontiguousarray(np.asarray(array, dtype=np.int64)).tobytes()).hexdigest()[:16]
        settings = {key: value for key, value in self._options.items() if key != "sample_ids"}
        settings.update(seqlens=digest(self.seqlens), sample_ids=digest(self._options["sample_ids"]),
                        micro_batch_size=self.micro_batch_size,
                        gradient_accumulation_steps=self.gradient_accumulation_steps, num_replicas=self.num_replicas)
        return settings

    def state_dict(self, steps_done: int | None = None) -> dict:
        """The position to resume from: the epoch and the step inputs done in it.

        Args:
            steps_done: step inputs of the current epoch already trained on. By
                default the number this sampler has yielded, which is exact for
                a `DataLoader` without worker processes; with workers the
                loader prefetches ahead, so pass the count your loop trained
                (``scheduler.steps_in_epoch`` of `VariableBatchSizeLR` times
                ``gradient_accumulation_steps``).
        """
        done = self._steps_done if steps_done is None else _check_int("steps_done", steps_done, minimum=0)
        return {"epoch": self.epoch, "steps_done": done, "rank": self.rank, "settings": self._settings()}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restores a `state_dict`: the next iteration continues where it stopped."""
        expected = {"epoch", "steps_done", "rank", "settings"}
        _check_state_keys("VariableBatchSampler", state_dict, expected)
        mismatch = _settings_mismatch(state_dict["settings"], self._settings())
        if mismatch:
            raise ValueError(f"cannot load a sampler state saved with {mismatch}; resume with the same dataset, "
                             f"config and world size")
        epoch = _check_int("epoch", state_dict["epoch"], minimum=0)
        steps = _check_int("steps_done", state_dict["steps_done"], minimum=0)
        self.epoch = epoch
        total = self.plan.num_batches * self.gradient_accumulation_steps
        if steps > total:
            raise ValueError(f"steps_done={steps} is more than the {total} step inputs of epoch {epoch}")
        if steps == total:  # the epoch was finished
            self.epoch, steps = epoch + 1, 0
        self._start_step = steps
        self._steps_done = steps


def _settings_mismatch(saved: Any, mine: dict) -> str | None:
    """``"seed=1 into a sampler with seed=2"`` for the first setting that differs, else None.

    The likeliest causes are named first: the world size, then the data.
    """
    if not isinstance(saved, Mapping) or set(saved) != set(mine):
        return "settings that are not a VariableBatchSampler's (pass a dict made by state_dict())"
    for key in sorted(mine, key=lambda k: (k not in ("num_replicas", "seqlens", "sample_ids"), k)):
        if saved[key] != mine[key]:
            if key in ("seqlens", "sample_ids"):
                return f"other {key} (another dataset?) than this one's"
            return f"{key}={saved[key]!r} into a sampler with {key}={mine[key]!r}"
    return None


def _check_state_keys(owner: str, state_dict: Mapping, expected: set) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{owner}.load_state_dict expects a dict, but got {type(state_dict).__name__}")
    unknown = sorted(set(state_dict) - expected)
    missing = sorted(expected - set(state_dict))
    if unknown or missing:
        raise ValueError(f"{owner}.load_state_dict got unknown keys {unknown} and is missing keys {missing}; "
                         f"pass a dict made by {owner}.state_dict()")


class _MicrobatchKeySampler(Sampler):
    """This rank's micro-batch keys, in the order of its step inputs."""

    def __init__(self, batch_sampler: VariableBatchSampler):
        self.batch_sampler = batch_sampler

    def __iter__(self):
        for keys in self.batch_sampler._iter_steps():
            yield from keys

    def __len__(self):
        return len(self.batch_sampler) * self.batch_sampler.micro_batch_size


def make_dataloader(dataset, batch_sampler: VariableBatchSampler, *, collate_fn=None, sample_padding_fn=None,
                    num_workers=0, pin_memory=False, **dataloader_kwargs) -> DataLoader:
    """A `DataLoader` over ``batch_sampler``'s step inputs, padded in same-length mode.

    Each item is ``collate_fn(samples)`` (the list of samples without
    ``collate_fn``) for one step input. In same-length mode
    (``same_length=True``) every sample is first padded with
    ``sample_padding_fn(sample, length)`` to its batch's max seqlen, so every
    step input of a batch has the same padded S. Works with ``num_workers > 0``
    (also under spawn), ``pin_memory`` and ``persistent_workers``. The loader's
    ``variable_batch_sampler`` attribute is ``batch_sampler`` (for `set_epoch`,
    ``state_dict`` and ``plan``), also on loaders made by the DeepSpeed-compatible
    functions.

    Raises:
        ValueError: same-length mode without ``sample_padding_fn``, or a
            dataset whose size differs from the number of seqlens.
    """
    if not isinstance(batch_sampler, VariableBatchSampler):
        raise TypeError(f"batch_sampler should be a VariableBatchSampler, but got {type(batch_sampler).__name__}")
    if hasattr(dataset, "__len__") and len(dataset) != len(batch_sampler.seqlens):
        raise ValueError(f"the dataset has {len(dataset)} samples but the sampler was given "
                         f"{len(batch_sampler.seqlens)} seqlens; give one seqlen per sample of this dataset")
    if batch_sampler.same_length and sample_padding_fn is None:
        raise ValueError("sample_padding_fn is None, but same-length mode pads every sample of a batch to "
                         "the batch's max seqlen; pass sample_padding_fn=varbatch.pad_sample (tensors) or "
                         "your own fn(sample, length)")
    loader = DataLoader(_KeyDataset(), batch_size=batch_sampler.micro_batch_size,
                        sampler=batch_sampler.microbatch_keys(),
                        collate_fn=_Collate(dataset, collate_fn, sample_padding_fn, batch_sampler.seqlens),
                        num_workers=num_workers, pin_memory=pin_memory, **dataloader_kwargs)
    loader.variable_batch_sampler = batch_sampler  # for set_epoch, state_dict and the plan
    return loader


# =============================================================================
# The LR scheduler
# =============================================================================


def _torch_optimizer(optimizer):
    """The torch `Optimizer` inside DeepSpeed's wrappers (ZeRO stages, fp16, bf16)."""
    seen = 0
    while not isinstance(optimizer, Optimizer):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or seen > 8:
            raise TypeError(f"expected a torch Optimizer, an LR scheduler, or a DeepSpeed optimizer wrapper "
                            f"around one, but got {type(optimizer).__name__}")
        optimizer, seen = inner, seen + 1
    return optimizer


def _find_batch_sampler(obj) -> VariableBatchSampler | None:
    """The `VariableBatchSampler` behind a sampler, a key sampler or a DataLoader, if any."""
    for candidate in (obj, getattr(obj, "variable_batch_sampler", None), getattr(obj, "batch_sampler", None),
                      getattr(obj, "sampler", None),
                      getattr(getattr(obj, "batch_sampler", None), "sampler", None),
                      getattr(obj, "data_sampler", None)):
        if isinstance(candidate, VariableBatchSampler):
            return candidate
        if isinstance(candidate, _MicrobatchKeySampler):
            return candidate.batch_sampler
    return None


# Messages that torch emits when a wrapped scheduler is stepped from inside
# another scheduler (before the first optimizer step, at construction).
_TORCH_STEP_ORDER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


class VariableBatchSizeLR(LRScheduler):
    """Scales any LR schedule by the size of each batch: ``lr_t = schedule(t) x s(B_t / B_ref)``.

    ``schedule(t)`` is the wrapped scheduler's LR at global optimizer step ``t``
    (or the optimizer's constant LR); ``s`` is the linear, square-root, none or
    user scaling (see `scale_lr`); ``B_t`` is the size of the batch trained at
    step ``t`` in sequences or tokens; ``B_ref`` is the batch size the schedule
    was tuned for. Call `step` after every optimizer step (DeepSpeed's engine
    does). The wrapped schedule is never restarted: ``step(0)`` at an epoch
    start only realigns the batch index with the sampler's epoch.

    NOTE [the unit trap]: DeepSpeed's default reference is ``train_batch_size``,
    a number of *micro-batches*, while ``B_t`` counts *sequences*; each
    micro-batch holds many sequences, so the LR comes out 16x to 256x the
    configured one on typical data. varbatch keeps that default for
    compatibility but logs each epoch's mean/min/max LR factor and warns when
    the mean leaves [0.5, 2]; ``base_batch_size="mean"`` makes the configured
    LR the epoch's average LR.

    Args:
        lr_scheduler: the schedule to scale: a torch `LRScheduler` (any, also
            `SequentialLR`/`ChainedScheduler`), a DeepSpeed scheduler, or an
            `Optimizer` (constant LR). DeepSpeed's optimizer wrappers are unwrapped.
        base_batch_size: ``B_ref``: a number > 0, or ``"mean"``.
        batch_sizes: the size of every batch: a `VariableBatchSampler` (a new
            plan each epoch) or a sequence (cycled, as DeepSpeed does).
        dataloader: unused unless it carries a `VariableBatchSampler` and
            ``batch_sizes`` is a sequence (then the sampler's plans are used).
        lr_scaling_method: ``"linear"``, ``"sqrt"``, ``"none"``/None, or a callable.
        last_epoch: -1 for a new scheduler (torch's convention).
        verbose: log the LR of every step.
        lr_scaling_unit: ``"sequences"`` (default) or ``"tokens"`` (needs a sampler).
    """

    def __init__(self, lr_scheduler, base_batch_size, batch_sizes, dataloader=None, lr_scaling_method="linear",
                 last_epoch=-1, verbose=False, *, lr_scaling_unit="sequences"):
        # 1. What is scaled, and where the LR is written.
        # DeepSpeed's optimizer wrappers (ZeRO, fp16, bf16) also have `step` and
        # `optimizer`, but an optimizer has `param_groups` and a scheduler has not:
        # stepping a wrapper here would take a second optimizer step.
        if isinstance(lr_scheduler, Optimizer) or not hasattr(lr_scheduler, "step") \
                or not hasattr(lr_scheduler, "optimizer") or hasattr(lr_scheduler, "param_groups"):
            self._base = None
            self.optimizer = _torch_optimizer(lr_scheduler)
        else:
            self._base = lr_scheduler
            self.optimizer = _torch_optimizer(lr_scheduler.optimizer)
        # 2. Where the batch sizes come from.
        self._sampler = _find_batch_sampler(batch_sizes) or _find_batch_sampler(dataloader)
        self.lr_scaling_unit = _check_choice("lr_scaling_unit", lr_scaling_unit, LR_SCALING_UNITS)
        if self._sampler is None:
            if isinstance(batch_sizes, (str, bytes)) or not hasattr(batch_sizes, "__len__") or len(batch_sizes) == 0:
                raise ValueError(f"batch_sizes should be a VariableBatchSampler or a non-empty sequence of batch "
                                 f"sizes, but got batch_sizes={batch_sizes!r}")
            self._fixed_sizes = _as_seqlens(batch_sizes, "batch_sizes")
            if self.lr_scaling_unit == "tokens":
                raise ValueError("lr_scaling_unit='tokens' needs the plan's token counts; pass the "
                                 "VariableBatchSampler as batch_sizes instead of a list")
        self.lr_scaling_method = _check_lr_method(lr_scaling_method)
        if not (isinstance(base_batch_size, str) and base_batch_size == "mean"):
            scale_lr(base_batch_size, 1)  # validates it
        self.base_batch_size = base_batch_size
        self.verbose = bool(verbose)
        # 3. Position: global step t (torch's `last_epoch`), and the batch within the plan's epoch.
        self.last_epoch = 0
        self._epoch = self._sampler.epoch if self._sampler is not None else 0
        self._batch = 0
        self._step_count = 1
        self.base_lrs = [group.get("initial_lr", group["lr"]) for group in self.optimizer.param_groups]
        self._constant_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self._unscaled_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self._reported_epoch = None
        self._warned = False
        self._apply()

    # -- batch sizes --------------------------------------------------------

    def _sizes(self, epoch: int) -> np.ndarray:
        if self._sampler is None:
            return self._fixed_sizes
        plan = self._sampler.plan_for_epoch(epoch)
        return plan.batch_tokens if self.lr_scaling_unit == "tokens" else plan.batch_sizes

    def _reference(self, epoch: int) -> float:
        return _reference_batch_size(self._sizes(epoch), self.base_batch_size)

    @property
    def batch_size(self) -> int:
        """``B_t``: the size of the batch trained at the current step, in ``lr_scaling_unit``."""
        sizes = self._sizes(self._epoch)
        return int(sizes[self._batch % len(sizes)])

    @property
    def lr_factor(self) -> float:
        """``s(B_t / B_ref)`` at the current step."""
        return _lr_factor(self.batch_size / self._reference(self._epoch), self.lr_scaling_method)

    @property
    def steps_in_epoch(self) -> int:
        """Batches (optimizer steps) done in the current epoch."""
        return self._batch

    def _report(self, epoch: int) -> None:
        """Logs each epoch's LR factors once, on rank 0; warns once when their mean is far from 1."""
        if self._reported_epoch == epoch:
            return
        self._reported_epoch = epoch
        rank = self._sampler.rank if self._sampler is not None else (
            torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized()
            else 0)
        if rank != 0:
            return
        reference = self._reference(epoch)
        factors = _lr_factors(self._sizes(epoch), reference, self.lr_scaling_method)
        _logger.info("epoch %d: LR factor mean %.3g, min %.3g, max %.3g (B_ref=%g %s)", epoch, factors.mean(),
                     factors.min(), factors.max(), reference, self.lr_scaling_unit)
        if not 0.5 <= factors.mean() <= 2.0 and not self._warned:
            self._warned = True  # once per scheduler: the cause is a setting, not an epoch
            warnings.warn(
                f"the mean LR factor of epoch {epoch} is {factors.mean():.3g}: the configured LR is multiplied by "
                f"{factors.mean():.3g} on average, because base_batch_size={self.base_batch_size!r} is far from the "
                f"mean batch size {self._sizes(epoch).mean():.1f} ({self.lr_scaling_unit}); set "
                f"lr_scaling_reference='mean' (base_batch_size='mean') or the batch size your LR was tuned for",
                stacklevel=3)

    # -- stepping -----------------------------------------------------------

    def _apply(self) -> None:
        """Writes ``schedule(t) x s(B_t / B_ref)`` into the optimizer."""
        self._report(self._epoch)
        factor = self.lr_factor
        self._last_lr = [lr * factor for lr in self._unscaled_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
        if self.verbose:
            _logger.info("step %d (epoch %d, batch %d): B=%d, LR factor %.4g, lr %s", self.last_epoch,
                         self._epoch, self._batch, self.batch_size, factor, self._last_lr)

    def _num_batches(self, epoch: int) -> int:
        return len(self._sizes(epoch))

    def step(self, epoch=None):
        """Advances to the next batch (``step()``), or realigns at an epoch start (``step(0)``).

        ``step()`` moves the global step ``t`` and the batch index by one and
        rolls over into the next epoch's plan after the last batch. ``step(0)``
        does not move ``t`` nor restart the wrapped schedule: it points the batch
        index at batch 0 of the sampler's current epoch.
        """
        if epoch is None:
            self.last_epoch += 1
            self._step_count += 1
            self._batch += 1
            if self._batch >= self._num_batches(self._epoch):
                self._epoch, self._batch = self._epoch + 1, 0
            if self._base is None:
                self._unscaled_lrs = list(self._constant_lrs)
            else:
                # The wrapped scheduler may compute its next LR from the current one
                # (chainable torch schedulers), so give it back its own, unscaled LR.
                for group, lr in zip(self.optimizer.param_groups, self._unscaled_lrs):
                    group["lr"] = lr
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=_TORCH_STEP_ORDER_WARNING)
                    self._base.step()
                self._unscaled_lrs = [group["lr"] for group in self.optimizer.param_groups]
        elif isinstance(epoch, numbers.Integral) and not isinstance(epoch, bool) and epoch == 0:
            if self._sampler is not None:
                self._epoch = self._sampler.epoch
            self._batch = 0
        else:
            raise ValueError(f"VariableBatchSizeLR.step takes no argument (next batch) or 0 (realign at an epoch "
                             f"start), but got epoch={epoch!r}; call step() after every optimizer step")
        self._apply()

    def get_lr(self):
        return list(self._last_lr)

    def get_last_lr(self):
        """The scaled LRs of the current step, one per parameter group."""
        return list(self._last_lr)

    # -- state --------------------------------------------------------------

    def _sizes_fingerprint(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self._sizes(self._epoch)).tobytes()).hexdigest()[:16]

    def state_dict(self):
        """Plain data: the position, the unscaled LRs and the wrapped scheduler's state."""
        method = self.lr_scaling_method if not callable(self.lr_scaling_method) else "callable"
        return {
            "last_epoch": self.last_epoch,
            "epoch": self._epoch,
            "batch": self._batch,
            "unscaled_lrs": list(self._unscaled_lrs),
            "base_batch_size": self.base_batch_size,
            "lr_scaling_method": method,
            "lr_scaling_unit": self.lr_scaling_unit,
            "batch_sizes_fingerprint": self._sizes_fingerprint(),
            "plan_settings": None if self._sampler is None else self._sampler._settings(),
            "base_lr_scheduler": None if self._base is None else self._base.state_dict(),
        }

    def load_state_dict(self, state_dict):
        """Restores a `state_dict`: the next `step` continues exactly where it stopped."""
        expected = {"last_epoch", "epoch", "batch", "unscaled_lrs", "base_batch_size", "lr_scaling_method",
                    "lr_scaling_unit", "batch_sizes_fingerprint", "plan_settings", "base_lr_scheduler"}
        _check_state_keys("VariableBatchSizeLR", state_dict, expected)
        method = self.lr_scaling_method if not callable(self.lr_scaling_method) else "callable"
        for key, mine in (("base_batch_size", self.base_batch_size), ("lr_scaling_method", method),
                          ("lr_scaling_unit", self.lr_scaling_unit)):
            if state_dict[key] != mine:
                raise ValueError(f"cannot load a scheduler state saved with {key}={state_dict[key]!r} into one "
                                 f"with {key}={mine!r}; resume with the same LR settings")
        if len(state_dict["unscaled_lrs"]) != len(self.optimizer.param_groups):
            raise ValueError(f"the state has {len(state_dict['unscaled_lrs'])} parameter groups, the optimizer "
                             f"{len(self.optimizer.param_groups)}; resume with the same model and optimizer")
        if state_dict["plan_settings"] is not None and self._sampler is not None:
            mismatch = _settings_mismatch(state_dict["plan_settings"], self._sampler._settings())
            if mismatch:
                raise ValueError(f"cannot load a scheduler state whose sampler was saved with {mismatch}; resume "
                                 f"with the same dataset, config and world size")
        position = (self._epoch, self._batch)
        self._epoch, self._batch = int(state_dict["epoch"]), int(state_dict["batch"])
        if state_dict["batch_sizes_fingerprint"] != self._sizes_fingerprint():
            self._epoch, self._batch = position
            raise ValueError("cannot load a scheduler state saved for other batch sizes (another dataset, seed, "
                             "max_tokens or world size); resume with the same data and settings")
        if (state_dict["base_lr_scheduler"] is None) != (self._base is None):
            raise ValueError("the state and this scheduler disagree on whether an LR scheduler is wrapped; "
                             "wrap the same kind of scheduler as when the state was saved")
        if self._base is not None:
            self._base.load_state_dict(state_dict["base_lr_scheduler"])
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = self.last_epoch + 1
        self._unscaled_lrs = list(state_dict["unscaled_lrs"])
        self._apply()


def lr_scheduler_for_variable_batch_size(base_batch_size, batch_sizes, dataloader, lr_scheduler_or_optimizer,
                                         lr_scaling_method="linear", verbose=False, *,
                                         lr_scaling_unit="sequences"):
    """A `VariableBatchSizeLR` over an LR scheduler or an optimizer (constant LR).

    DeepSpeed's signature; DeepSpeed's optimizer wrappers (ZeRO, fp16) are
    accepted. See `VariableBatchSizeLR` for every argument.
    """
    if lr_scheduler_or_optimizer is None:
        raise TypeError("lr_scheduler_or_optimizer is None; pass the optimizer (constant LR) or the LR scheduler "
                        "whose LR is scaled")
    return VariableBatchSizeLR(lr_scheduler_or_optimizer, base_batch_size=base_batch_size, batch_sizes=batch_sizes,
                               dataloader=dataloader, lr_scaling_method=lr_scaling_method, verbose=verbose,
                               lr_scaling_unit=lr_scaling_unit)


# =============================================================================
# DeepSpeed-compatible dataloader functions
# =============================================================================


class _FixedKeySampler(Sampler):
    """One rank's share of a fixed list of micro-batch keys (DeepSpeed's interleaving)."""

    def __init__(self, keys, rank, num_replicas):
        self.keys = keys
        self.rank = rank
        self.num_replicas = num_replicas

    def __iter__(self):
        return iter(self.keys[self.rank::self.num_replicas])

    def __len__(self):
        return len(self.keys[self.rank::self.num_replicas])


def dataloader_for_variable_batch_size(
    dataset,
    microbatch_ids,
    batch_max_seqlens,
    dataloader_rank=0,
    dataloader_batch_size=1,
    dataloader_num_replicas=1,
    dataloader_collate_fn=None,
    dataloader_num_workers=2,
    dataloader_pin_memory=False,
    required_microbatches_of_same_seqlen=False,
    sample_padding_fn=None,
):
    """A DataLoader over the micro-batches of `batch_by_seqlens` (DeepSpeed's signature).

    Returns:
        ``(dataloader, deepspeed_io_kwargs)``: the loader of this rank's step
        inputs, and the keyword arguments for ``engine.deepspeed_io`` that
        build the same loader inside DeepSpeed.
    """
    rank = _check_int("dataloader_rank", dataloader_rank, minimum=0)
    replicas = _check_int("dataloader_num_replicas", dataloader_num_replicas, minimum=1)
    if rank >= replicas:
        raise ValueError(f"dataloader_rank should be < dataloader_num_replicas={replicas}, but got {rank}")
    batch_size = _check_int("dataloader_batch_size", dataloader_batch_size, minimum=1)
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise ValueError("sample_padding_fn is None, but required_microbatches_of_same_seqlen=True pads every "
                         "sample to its batch's max seqlen; pass sample_padding_fn=varbatch.pad_sample or your own")
    if len(microbatch_ids) % replicas:
        raise ValueError(f"{len(microbatch_ids)} micro-batches cannot be dealt evenly to {replicas} ranks; "
                         f"make them with effective_batch_size a multiple of the data-parallel size")
    keys = [(int(b), tuple(int(i) for i in ids),
             int(batch_max_seqlens[b]) if required_microbatches_of_same_seqlen else 0)
            for b, ids in microbatch_ids]
    sampler = _FixedKeySampler(keys, rank, replicas)
    collate = _Collate(dataset, dataloader_collate_fn, sample_padding_fn)
    dataloader = DataLoader(_KeyDataset(), batch_size=batch_size, sampler=sampler, collate_fn=collate,
                            num_workers=dataloader_num_workers, pin_memory=dataloader_pin_memory)
    deepspeed_io_kwargs = dict(dataset=_KeyDataset(), batch_size=batch_size, pin_memory=dataloader_pin_memory,
                               data_sampler=sampler, collate_fn=collate,
                               num_local_io_workers=dataloader_num_workers)
    return dataloader, deepspeed_io_kwargs


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
    dataset,
    dataset_seqlens,
    max_tokens,
    effective_batch_size,
    dataset_filter_ids=None,
    lr_scaling_method="linear",
    min_batch_size=1,
    max_batch_size=None,
    sequence_picking_order="dataloader",
    dataloader_batch_size=1,
    dataloader_rank=0,
    dataloader_num_replicas=1,
    dataloader_num_workers=0,
    dataloader_collate_fn=None,
    dataloader_pin_memory=False,
    lr_scheduler_or_optimizer=None,
    required_microbatches_of_same_size=False,
    required_microbatches_of_same_seqlen=False,
    sample_padding_fn=None,
    verbose=False,
    seed=None,
    *,
    budget="sum",
    lr_scaling_unit="sequences",
    lr_scaling_reference=None,
    bucket_size=None,
    on_overlong="skip",
):
    """The dataloader and LR scheduler of a token-budget plan (DeepSpeed's signature).

    Unlike DeepSpeed's, the loader makes a new plan every epoch in ``random``
    and ``bucket`` order, and the scheduler follows it. ``max_tokens`` counts
    the sum of seqlens of a micro-batch (``budget="sum"``) or its padded
    ``n x S`` (``budget="padded"``). ``lr_scaling_reference`` is ``B_ref``
    (default ``effective_batch_size``, DeepSpeed's; a number; or ``"mean"``).

    Returns:
        ``(dataloader, lr_scheduler, deepspeed_io_kwargs)``; ``lr_scheduler``
        is None when ``lr_scheduler_or_optimizer`` is None.
    """
    k = _check_int("effective_batch_size", effective_batch_size, minimum=1,
                   fix="it is train_batch_size, micro-batches per optimizer step")
    mbs = _check_int("dataloader_batch_size", dataloader_batch_size, minimum=1)
    replicas = _check_int("dataloader_num_replicas", dataloader_num_replicas, minimum=1)
    if k % (mbs * replicas):
        raise ValueError(f"effective_batch_size={k} should be a multiple of dataloader_batch_size x "
                         f"dataloader_num_replicas = {mbs} x {replicas}; set train_batch_size = "
                         f"micro batch per GPU x gradient accumulation steps x data-parallel size")
    sampler = VariableBatchSampler(
        dataset_seqlens, max_tokens, micro_batch_size=mbs, gradient_accumulation_steps=k // (mbs * replicas),
        num_replicas=replicas, rank=dataloader_rank, seed=seed, budget=budget, order=sequence_picking_order,
        min_batch_size=min_batch_size, max_batch_size=max_batch_size, sample_ids=dataset_filter_ids,
        same_size=bool(required_microbatches_of_same_size), same_length=bool(required_microbatches_of_same_seqlen),
        bucket_size=bucket_size, on_overlong=on_overlong, verbose=verbose)
    if len(sampler.seqlens) != len(dataset):
        raise ValueError(f"dataset_seqlens has {len(sampler.seqlens)} entries but the dataset has {len(dataset)} "
                         f"samples; give one seqlen per sample (delete a stale seqlen cache)")
    dataloader = make_dataloader(dataset, sampler, collate_fn=dataloader_collate_fn,
                                 sample_padding_fn=sample_padding_fn, num_workers=dataloader_num_workers,
                                 pin_memory=dataloader_pin_memory)
    deepspeed_io_kwargs = dict(dataset=dataloader.dataset, batch_size=mbs, pin_memory=dataloader_pin_memory,
                               data_sampler=dataloader.sampler, collate_fn=dataloader.collate_fn,
                               num_local_io_workers=dataloader_num_workers)
    lr_scheduler = None
    if lr_scheduler_or_optimizer is not None:
        reference = k if lr_scaling_reference is None else lr_scaling_reference
        lr_scheduler = lr_scheduler_for_variable_batch_size(
            reference, sampler, dataloader, lr_scheduler_or_optimizer, lr_scaling_method=lr_scaling_method,
            verbose=verbose, lr_scaling_unit=lr_scaling_unit)
    return dataloader, lr_scheduler, deepspeed_io_kwargs


# =============================================================================
# DeepSpeed glue
# =============================================================================
# The config section is data_efficiency -> data_sampling -> dynamic_batching, as
# in DeepSpeed. DeepSpeed's keys keep their meaning; varbatch adds its own.

_DEEPSPEED_KEYS = ("enabled", "max_tokens", "lr_scaling_method", "min_batch_size", "max_batch_size",
                   "sequence_picking_order", "sentence_picking_order", "metrics_path", "verbose")
_VARBATCH_KEYS = ("seed", "num_workers", "pin_memory", "budget", "lr_scaling_unit", "lr_scaling_reference",
                  "bucket_size", "on_overlong")
_DYNAMIC_BATCHING_KEYS = _DEEPSPEED_KEYS + _VARBATCH_KEYS
_SEQLEN_CACHE = "varbatch_seqlens.npy"


def _read_dynamic_batching(config: Mapping) -> dict:
    """Validated settings from a DeepSpeed config dict (the whole config, as in ds_config.json).

    Raises:
        ValueError: the section is missing or disabled, a key is unknown (the
            closest valid one is named), or a value is invalid.
    """
    data_efficiency = config.get("data_efficiency", {}) or {}
    data_sampling = data_efficiency.get("data_sampling", {}) or {}
    section = data_sampling.get("dynamic_batching")
    if not isinstance(section, Mapping):
        raise ValueError("the DeepSpeed config has no data_efficiency.data_sampling.dynamic_batching section; "
                         "add one with at least \"enabled\": true and \"max_tokens\"")
    for key in section:
        if key not in _DYNAMIC_BATCHING_KEYS:
            close = difflib.get_close_matches(key, _DYNAMIC_BATCHING_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown key {key!r} in data_efficiency.data_sampling.dynamic_batching{hint} "
                             f"(valid keys: {', '.join(_DYNAMIC_BATCHING_KEYS)})")
    if not section.get("enabled", False):
        raise ValueError("dynamic_batching.enabled is false; set \"enabled\": true in "
                         "data_efficiency.data_sampling.dynamic_batching")
    if "max_tokens" not in section:
        raise ValueError("dynamic_batching.max_tokens is missing; set it to the tokens one micro-batch may hold")
    if "sequence_picking_order" in section and "sentence_picking_order" in section \
            and section["sequence_picking_order"] != section["sentence_picking_order"]:
        raise ValueError(f"dynamic_batching sets both sequence_picking_order={section['sequence_picking_order']!r} "
                         f"and its older spelling sentence_picking_order={section['sentence_picking_order']!r}; "
                         f"keep one")
    order = section.get("sequence_picking_order", section.get("sentence_picking_order", "dataloader"))
    reference = section.get("lr_scaling_reference")
    if reference is not None and reference != "mean":
        scale_lr(reference, 1)  # validates it
    settings = {
        "max_tokens": _check_int("dynamic_batching.max_tokens", section["max_tokens"], minimum=1),
        "lr_scaling_method": _check_lr_method(section.get("lr_scaling_method", "linear")),
        "min_batch_size": section.get("min_batch_size", 1),
        "max_batch_size": section.get("max_batch_size"),
        "order": _check_choice("dynamic_batching.sequence_picking_order", order, ORDERS),
        "metrics_path": section.get("metrics_path"),
        "verbose": bool(section.get("verbose", False)),
        "seed": section.get("seed", data_efficiency.get("seed", 1234)),
        "num_workers": section.get("num_workers", data_sampling.get("num_workers", 0)),
        "pin_memory": bool(section.get("pin_memory", data_sampling.get("pin_memory", False))),
        "budget": _check_choice("dynamic_batching.budget", section.get("budget", "sum"), BUDGETS),
        "lr_scaling_unit": _check_choice("dynamic_batching.lr_scaling_unit",
                                         section.get("lr_scaling_unit", "sequences"), LR_SCALING_UNITS),
        "lr_scaling_reference": reference,
        "bucket_size": section.get("bucket_size"),
        "on_overlong": _check_choice("dynamic_batching.on_overlong", section.get("on_overlong", "skip"),
                                     _ON_OVERLONG),
    }
    _check_int("dynamic_batching.num_workers", settings["num_workers"], minimum=0)
    return settings


def _engine_config_dict(engine) -> dict:
    """The config dict the user gave DeepSpeed (unprocessed, so unknown keys are seen)."""
    config = getattr(engine, "_config", None)
    raw = getattr(config, "_param_dict", None)
    if isinstance(raw, Mapping):
        return dict(raw)
    raise TypeError(f"expected a DeepSpeed engine (from deepspeed.initialize), but got {type(engine).__name__}")


def _data_parallel(engine) -> tuple[int, int]:
    """``(rank, size)`` of this process in the engine's data-parallel group."""
    grid = getattr(engine, "grid", None)
    if grid is not None:  # PipelineEngine
        return int(grid.data_parallel_id), int(grid.data_parallel_size)
    if not torch.distributed.is_initialized():
        return 0, 1
    group = getattr(engine, "data_parallel_group", None)
    return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)


def _world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` without torch.distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    """``obj`` of every rank (a list of one without torch.distributed)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _load_cached_seqlens(metrics_path: str, num_samples: int) -> np.ndarray | None:
    """Seqlens cached in ``metrics_path`` (varbatch's .npy, or DeepSpeed's metric files), if any."""
    import os
    path = os.path.join(metrics_path, _SEQLEN_CACHE)
    deepspeed_path = os.path.join(metrics_path, "seqlen", "seqlen_sample_to_metric")
    if os.path.exists(path):
        seqlens = np.load(path)
    elif os.path.exists(deepspeed_path + ".bin") and os.path.exists(deepspeed_path + ".idx"):
        # Written by DeepSpeed's DataAnalyzer: one N x 1 metric row per sample.
        from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
        metric = MMapIndexedDataset(deepspeed_path, skip_warmup=True)
        seqlens = np.concatenate([np.asarray(metric[i]).reshape(-1) for i in range(len(metric))])
    else:
        return None
    if len(seqlens) != num_samples:
        _logger.warning("the seqlen cache in %s has %d entries but the dataset %d samples: recomputing it",
                        metrics_path, len(seqlens), num_samples)
        return None
    return seqlens.astype(np.int64)


def _seqlens_of(dataset, ids: np.ndarray, batch_seqlens_fn, collate_fn, progress: bool = False,
                batch_size: int = 256) -> np.ndarray:
    """``batch_seqlens_fn(collate_fn(samples))`` over the samples ``ids``, ``batch_size`` at a time.

    As in DeepSpeed, ``batch_seqlens_fn`` gets a batch collated by the
    training collate function and returns one length per sample.
    """
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="varbatch: seqlens", unit="sample")
        except ImportError:  # no progress bar without tqdm; DeepSpeed installs it
            pass
    lengths = np.zeros(len(ids), dtype=np.int64)
    for start in range(0, len(ids), batch_size):
        chunk = ids[start:start + batch_size]
        samples = [dataset[int(i)] for i in chunk]
        got = batch_seqlens_fn(collate_fn(samples) if collate_fn is not None else samples)
        if isinstance(got, torch.Tensor):
            got = got.detach().cpu().reshape(-1).tolist()
        got = list(got)
        if len(got) != len(chunk):
            raise ValueError(f"batch_seqlens_fn returned {len(got)} lengths for a batch of {len(chunk)} samples "
                             f"(ids {int(chunk[0])}..{int(chunk[-1])}); it must return one length per sample of "
                             f"the batch that dataloader_collate_fn made")
        lengths[start:start + len(chunk)] = [int(x) for x in got]
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return lengths


# How many cached seqlens are recomputed to check that a cache belongs to the dataset.
_CACHE_SPOT_CHECKS = 16


def _dataset_seqlens(dataset, settings, batch_seqlens_fn, collate_fn) -> np.ndarray:
    """Seqlens from the cache in ``metrics_path``, else computed once (sharded over ranks) and cached."""
    import os
    num_samples = len(dataset)
    metrics_path = settings["metrics_path"]
    if metrics_path:
        cached = _load_cached_seqlens(metrics_path, num_samples)
        if cached is not None and batch_seqlens_fn is not None and num_samples:
            # A cache outlives the dataset it was made for: recompute a few entries (the
            # same on every rank, so all ranks take the same branch) before trusting it.
            ids = np.unique(np.linspace(0, num_samples - 1, min(num_samples, _CACHE_SPOT_CHECKS)).astype(np.int64))
            fresh = _seqlens_of(dataset, ids, batch_seqlens_fn, collate_fn)
            stale = np.flatnonzero(fresh != cached[ids])
            if len(stale):
                i = int(ids[stale[0]])
                _logger.warning("the seqlen cache in %s says sample %d has seqlen %d but batch_seqlens_fn gives %d: "
                                "the cache is from another dataset; recomputing it", metrics_path, i,
                                int(cached[i]), int(fresh[stale[0]]))
                cached = None
        if cached is not None:
            return cached
    if batch_seqlens_fn is None:
        raise ValueError("no dataset_seqlens, no seqlen cache in metrics_path, and batch_seqlens_fn is None; "
                         "pass dataset_seqlens, or batch_seqlens_fn (e.g. varbatch.seqlens_from_padded) to "
                         "compute them once")
    # Each rank measures every world_size-th sample, then all ranks gather the shards.
    rank, world_size = _world()
    shard = np.arange(rank, num_samples, world_size, dtype=np.int64)
    lengths = _seqlens_of(dataset, shard, batch_seqlens_fn, collate_fn, progress=rank == 0)
    seqlens = np.zeros(num_samples, dtype=np.int64)
    for ids, part in _gather((shard, lengths)):
        seqlens[ids] = part
    if metrics_path and rank == 0:
        os.makedirs(metrics_path, exist_ok=True)
        tmp = os.path.join(metrics_path, f".{_SEQLEN_CACHE}.{os.getpid()}.npy")
        np.save(tmp, seqlens)
        os.replace(tmp, os.path.join(metrics_path, _SEQLEN_CACHE))  # atomic: no rank reads half a file
    if world_size > 1:
        torch.distributed.barrier()
    return seqlens


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset,
                                                                      engine,
                                                                      dataset_seqlens=None,
                                                                      dataset_filter_ids=None,
                                                                      dataloader_collate_fn=None,
                                                                      sample_padding_fn=None,
                                                                      batch_seqlens_fn=None):
    """The dataloader and LR scheduler for a DeepSpeed engine, from its config.

    Reads ``data_efficiency.data_sampling.dynamic_batching`` (see README), takes
    ``train_batch_size``, ``train_micro_batch_size_per_gpu``, the gradient
    accumulation steps and the data-parallel rank and size from the engine,
    turns on same-size and same-length micro-batches for a ``PipelineEngine``,
    checks that every rank planned the same epoch, and installs the scheduler
    as ``engine.lr_scheduler`` (wrapping the engine's scheduler, or its
    optimizer's constant LR; ZeRO and fp16 wrappers are unwrapped) so
    ``engine.step()`` and ``engine.train_batch()`` step it and checkpoints
    save it.

    Seqlens: ``dataset_seqlens`` if given; else the cache in ``metrics_path``
    (varbatch's ``varbatch_seqlens.npy`` or DeepSpeed's
    ``seqlen/seqlen_sample_to_metric`` files), spot-checked with
    ``batch_seqlens_fn`` when given; else computed once with
    ``batch_seqlens_fn`` (which gets a batch made by ``dataloader_collate_fn``
    and returns one length per sample), each rank a shard, gathered, and
    cached in ``metrics_path``.

    Returns:
        ``(dataloader, lr_scheduler, deepspeed_io_kwargs)``: the loader of this
        rank's step inputs, the `VariableBatchSizeLR` (None when the engine has
        no optimizer), and the keyword arguments of ``engine.deepspeed_io``
        that build the same loader inside DeepSpeed.

    Raises:
        ValueError: the config section is missing, disabled, has an unknown
            key or a bad value, or the engine's batch sizes disagree.
        RuntimeError: the ranks planned different epochs.
    """
    settings = _read_dynamic_batching(_engine_config_dict(engine))
    dp_rank, dp_size = _data_parallel(engine)
    k, mbs = engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    if k != mbs * gas * dp_size:
        raise ValueError(f"train_batch_size={k} should be train_micro_batch_size_per_gpu x "
                         f"gradient_accumulation_steps x data-parallel size = {mbs} x {gas} x {dp_size}; "
                         f"fix the batch sizes in the DeepSpeed config")
    if dataset_seqlens is None:
        dataset_seqlens = _dataset_seqlens(dataset, settings, batch_seqlens_fn, dataloader_collate_fn)
    pipeline = hasattr(engine, "train_batch") and getattr(engine, "grid", None) is not None
    base = engine.lr_scheduler if getattr(engine, "lr_scheduler", None) is not None else engine.optimizer
    if isinstance(base, VariableBatchSizeLR):
        # Called again on the same engine: scale the original schedule, not the scaled one.
        for group, lr in zip(base.optimizer.param_groups, base._unscaled_lrs):
            group["lr"] = lr
        base = base._base if base._base is not None else base.optimizer
    dataloader, lr_scheduler, io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset=dataset,
        dataset_seqlens=dataset_seqlens,
        max_tokens=settings["max_tokens"],
        effective_batch_size=k,
        dataset_filter_ids=dataset_filter_ids,
        lr_scaling_method=settings["lr_scaling_method"],
        min_batch_size=settings["min_batch_size"],
        max_batch_size=settings["max_batch_size"],
        sequence_picking_order=settings["order"],
        dataloader_batch_size=mbs,
        dataloader_rank=dp_rank,
        dataloader_num_replicas=dp_size,
        dataloader_num_workers=settings["num_workers"],
        dataloader_collate_fn=dataloader_collate_fn,
        dataloader_pin_memory=settings["pin_memory"],
        lr_scheduler_or_optimizer=base,
        required_microbatches_of_same_size=pipeline,
        required_microbatches_of_same_seqlen=pipeline,
        sample_padding_fn=sample_padding_fn,
        verbose=settings["verbose"],
        seed=settings["seed"],
        budget=settings["budget"],
        lr_scaling_unit=settings["lr_scaling_unit"],
        lr_scaling_reference=settings["lr_scaling_reference"],
        bucket_size=settings["bucket_size"],
        on_overlong=settings["on_overlong"],
    )
    # Every rank must train on the same plan, else samples are trained twice or never
    # and the ranks disagree on the number of steps (a hang at the first collective
    # that one rank never reaches). Pipeline stages are compared too.
    sampler = _find_batch_sampler(dataloader)
    fingerprints = _gather(sampler.plan.fingerprint())
    differ = [r for r, fingerprint in enumerate(fingerprints) if fingerprint != fingerprints[0]]
    if differ:
        raise RuntimeError(f"rank {differ[0]} planned a different epoch than rank 0 (plan fingerprint "
                           f"{fingerprints[differ[0]]} != {fingerprints[0]}; {len(differ)} rank(s) differ): the "
                           f"ranks see different seqlens, dataset_filter_ids or configs; give every rank the same "
                           f"dataset, seqlens and config (delete a seqlen cache in metrics_path that is not shared)")
    if lr_scheduler is not None:
        engine.lr_scheduler = lr_scheduler
    return dataloader, lr_scheduler, io_kwargs


# =============================================================================
# Command line: python varbatch.py plan ...
# =============================================================================
# `python varbatch.py plan` shows what a config does to a dataset before any
# training: its batches, their padding and LR factors, and the drops. The
# totals come from `_plan_totals` / `_format_plan_totals`, which the verbose
# training log uses too, so the command line and the log always agree.

# Lengths used when no --seqlens is given: lognormal like natural text
# (median about 240 tokens, a long tail), clipped to [8, 4096], fixed seed.
_SYNTHETIC_NUM_SAMPLES = 2000
_SYNTHETIC_MAX_TOKENS = 4096


def _synthetic_seqlens() -> np.ndarray:
    """The default lengths of ``python varbatch.py plan`` (deterministic)."""
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(5.5, 0.9, _SYNTHETIC_NUM_SAMPLES), 8, 4096).astype(np.int64)


def _plan_rows(plan: Plan, padded_s: np.ndarray, lr_factors: np.ndarray, num_rows: int) -> list[dict]:
    """One dict per batch (the first ``num_rows``): its micro-batches, padding and LR factor."""
    k = plan.effective_batch_size
    sizes = plan.microbatch_sizes()
    rows = []
    for b in range(min(num_rows, plan.num_batches)):
        n = sizes[b * k:(b + 1) * k]
        s = padded_s[b * k:(b + 1) * k]
        slots = int((n * s).sum())
        rows.append({"batch": b, "sequences": int(plan.batch_sizes[b]), "microbatches": k,
                     "microbatch_sizes": n.tolist(), "padded_seqlens": s.tolist(),
                     "real_tokens": int(plan.batch_tokens[b]), "padded_tokens": slots,
                     "padding": 1.0 - int(plan.batch_tokens[b]) / slots, "lr_factor": float(lr_factors[b])})
    return rows


def _short_list(values: Sequence[int], limit: int = 6) -> str:
    """``'5,6,4'``, one value when all are equal, at most ``limit`` shown."""
    if len(set(values)) == 1:
        return str(values[0])
    shown = ",".join(str(v) for v in values[:limit])
    return shown + (f",...(+{len(values) - limit})" if len(values) > limit else "")


def _format_rows(rows: list[dict]) -> str:
    """The per-batch table as aligned text."""
    header = ("batch", "B", "micro-batches", "B per micro-batch", "padded S", "real tokens", "padding %",
              "LR factor")
    cells = [header] + [(str(r["batch"]), str(r["sequences"]), str(r["microbatches"]),
                         _short_list(r["microbatch_sizes"]), _short_list(r["padded_seqlens"]),
                         str(r["real_tokens"]), f"{100 * r['padding']:.1f}", f"{r['lr_factor']:.3g}")
                        for r in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in cells)


# -- the picture --------------------------------------------------------------


def _draw_plan(path: str, seqlens: np.ndarray, panels: Sequence[dict], *, title: str, num_batches: int = 2,
               max_microbatches: int = 6) -> None:
    """Draws plans as rows of token cells, side by side, over histograms of B and LR factor.

    Each sample is a row: its tokens filled, its padding (up to the padded S
    of its micro-batch) empty. Micro-batches are labelled ``BxSxE, N tokens``
    (B samples padded to S, E the embedding width, N real tokens) and grouped
    into batches. Below, the distribution of B and of the LR factor over the
    whole epoch.

    Args:
        path: the image file to write (the format follows the suffix).
        seqlens: the token count of every sample.
        panels: one dict per plan with ``heading``, ``plan``, ``padded_s``
            (per micro-batch), ``lr_factors`` (per batch) and ``totals``.
        title: the figure's title.
        num_batches: batches drawn per plan.
        max_microbatches: micro-batches drawn per batch (the rest is counted).
    """
    # matplotlib is optional: imported here only (the caller checked that it exists).
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.collections import PatchCollection

    token_color, pad_edge = "#3b75af", "#9a9a9a"
    # What is drawn: per plan, per batch, the first micro-batches.
    drawn = []
    for panel in panels:
        plan, k = panel["plan"], panel["plan"].effective_batch_size
        batches = []
        for b in range(min(num_batches, plan.num_batches)):
            js = list(range(b * k, b * k + min(k, max_microbatches)))
            batches.append((b, js, k - len(js)))
        drawn.append(batches)
    longest = max(int(panel["padded_s"][j]) for panel, batches in zip(panels, drawn)
                  for _, js, _ in batches for j in js)
    # Vertical layout in rows (one row per sample). Text lines and gaps take a
    # fixed share of the height, so they stay legible however many rows there are.
    line, mb_gap, batch_gap = 0.032, 0.012, 0.02
    height = 0.0
    for panel, batches in zip(panels, drawn):
        rows = sum(len(panel["plan"].microbatch(j)) for _, js, _ in batches for j in js)
        share = sum(line * (1 + bool(rest)) + mb_gap * len(js) + batch_gap for _, js, rest in batches)
        height = max(height, rows / max(1.0 - share, 0.3))
    line, mb_gap, batch_gap = line * height, mb_gap * height, batch_gap * height
    cells = longest <= 48  # draw every token as a cell when they are wide enough to see
    label_space = 0.55 * longest

    fig = Figure(figsize=(14, 10.5), dpi=90, layout="constrained")
    grid = fig.add_gridspec(2, len(panels), height_ratios=[3.2, 1])
    fig.suptitle(title, fontsize=11)
    for c, (panel, batches) in enumerate(zip(panels, drawn)):
        ax = fig.add_subplot(grid[0, c])
        plan, padded_s, factors = panel["plan"], panel["padded_s"], panel["lr_factors"]
        filled, empty = [], []
        y = 0.0
        for b, js, rest in batches:
            ax.text(0, y + 0.8 * line, f"batch {b}: B={int(plan.batch_sizes[b])} sequences, "
                                f"{int(plan.batch_tokens[b])} tokens, LR factor {factors[b]:.3g}",
                    fontsize=8.5, fontweight="bold", va="bottom")
            y += line
            for j in js:
                ids = plan.microbatch(j)
                s = int(padded_s[j])
                for row, i in enumerate(ids.tolist()):
                    length = int(seqlens[i])
                    if cells:
                        filled += [Rectangle((x, y + row), 1, 0.9) for x in range(length)]
                        empty += [Rectangle((x, y + row), 1, 0.9) for x in range(length, s)]
                    else:
                        filled.append(Rectangle((0, y + row), length, 0.9))
                        if s > length:
                            empty.append(Rectangle((length, y + row), s - length, 0.9))
                real = int(seqlens[ids].sum())
                ax.text(s + 0.02 * longest, y + len(ids) / 2, f"{len(ids)}x{s}xE, {real} tokens",
                        fontsize=7.5, va="center")
                y += len(ids) + mb_gap
            if rest:
                ax.text(0, y + 0.5 * line, f"... {rest} more micro-batch{'es' if rest > 1 else ''} in this batch",
                        fontsize=7.5, style="italic", va="center")
                y += line
            y += batch_gap
        ax.add_collection(PatchCollection(filled, facecolor=token_color, edgecolor="white" if cells else "none",
                                          linewidth=0.4))
        ax.add_collection(PatchCollection(empty, facecolor="white", edgecolor=pad_edge, linewidth=0.4))
        ax.set_xlim(0, longest + label_space)
        ax.set_ylim(height, 0)
        ax.set_yticks([])
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
        ax.set_xlabel("tokens (padded S)")
        totals = panel["totals"]
        ax.set_title(f"{panel['heading']}\n{totals['batches']} batches, {totals['efficiency']:.1%} of padded "
                     f"tokens are real, largest padded micro-batch {totals['largest_padded_microbatch']['tokens']}"
                     f" tokens", fontsize=9.5)
        if c == 0:
            ax.legend(handles=[Patch(facecolor=token_color, label="token"),
                               Patch(facecolor="white", edgecolor=pad_edge, label="padding")],
                      loc="lower right", fontsize=8, frameon=False)
    # Histograms over the whole epoch.
    ax_b = fig.add_subplot(grid[1, 0])
    ax_lr = fig.add_subplot(grid[1, len(panels) - 1]) if len(panels) > 1 else None
    all_sizes = np.concatenate([panel["plan"].batch_sizes for panel in panels])
    low, high = int(all_sizes.min()), int(all_sizes.max())
    size_bins = np.arange(low - 0.5, high + 1.5) if high - low <= 60 else 40  # one bar per B when few
    all_factors = np.concatenate([panel["lr_factors"] for panel in panels])
    factor_bins = np.linspace(all_factors.min() - 0.05, all_factors.max() + 0.05, 41)
    # Solid and dashed outlines, so equal distributions stay visible on top of each other.
    for panel, color, style in zip(panels, (token_color, "#d9822b"), ("-", "--")):
        name = panel["heading"].split(":")[0]
        ax_b.hist(panel["plan"].batch_sizes, bins=size_bins, histtype="step", linewidth=1.5, color=color,
                  linestyle=style, label=name)
        if ax_lr is not None:
            ax_lr.hist(panel["lr_factors"], bins=factor_bins, histtype="step", linewidth=1.5, color=color,
                       linestyle=style, label=name)
    ax_b.set_xlabel("B: sequences per batch")
    ax_b.set_ylabel("batches")
    ax_b.set_title("batch size B over the epoch", fontsize=9.5)
    ax_b.legend(fontsize=8, frameon=False, loc="upper right")
    if ax_lr is not None:
        lr = panels[0]["totals"].get("lr_factor", {})
        ax_lr.axvline(1.0, color="black", linewidth=0.8, linestyle=":")
        ax_lr.set_xlabel(f"LR factor s(B / B_ref), {lr.get('method')} rule, B_ref={lr.get('reference')}"
                         f" = {_number(lr.get('reference_value', 0))} {lr.get('unit')}")
        ax_lr.set_ylabel("batches")
        ax_lr.set_title("LR factor over the epoch (dotted: the configured LR)", fontsize=9.5)
        ax_lr.legend(fontsize=8, frameon=False, loc="upper right")
    fig.savefig(path)


# -- argument parsing ---------------------------------------------------------

_PLAN_EPILOG = """\
where the numbers come from:
  Settings come from --config (a DeepSpeed config with a
  data_efficiency.data_sampling.dynamic_batching section, read and validated
  as training does); a flag overrides the config's value. Without --config:
  max_tokens 4096, budget sum, order dataloader, one micro-batch per batch.

  Micro-batches per batch (train_batch_size, k) are resolved as DeepSpeed does:
  train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps
  x world size; a missing one of the three is derived from the others, a
  missing accumulation defaults to 1. --world-size N sets the world size (else
  it is train_batch_size / (micro batch x accumulation), or 1). The padded S of
  a micro-batch is the longest sample of the step input it is collated into
  (train_micro_batch_size_per_gpu micro-batches of one rank); with --pipeline,
  the longest sample of its batch.

  The LR factor is s(B / B_ref) with the config's lr_scaling_method (linear),
  lr_scaling_unit (sequences) and lr_scaling_reference (a number, "mean", or by
  default train_batch_size, as DeepSpeed does).

  Without --seqlens: 2000 synthetic lengths, lognormal (median about 240
  tokens), clipped to [8, 4096], always the same.

examples:
  python varbatch.py plan
  python varbatch.py plan --config ds_config.json --seqlens lengths.npy --world-size 8
  python varbatch.py plan --seqlens lengths.txt --order bucket --budget padded
  cut -f2 lengths.tsv | python varbatch.py plan --seqlens - --max-tokens 8192 --json
  python varbatch.py plan --config ds_config.json --pipeline --plot plan.png
"""


def _make_parser():
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            # One line, like every other error of this command; the usage is in --help.
            self.exit(2, f"varbatch: error: {message} (see {self.prog} --help)\n")

    def int_at_least(minimum):
        def parse(text):
            try:
                value = int(text)
            except ValueError:
                value = minimum - 1
            if value < minimum:
                raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
            return value
        return parse

    positive_int, non_negative_int = int_at_least(1), int_at_least(0)

    def reference(text):
        if text == "mean":
            return text
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a number > 0 or 'mean', got {text!r}")
        return int(value) if value.is_integer() else value

    parser = Parser(prog="python varbatch.py", allow_abbrev=False,
                    description="Plan token-budget batches for a list of sequence lengths, before training.",
                    epilog="Run 'python varbatch.py plan --help' for its flags.")
    parser.add_argument("--version", action="version", version=f"varbatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    p = sub.add_parser("plan", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_PLAN_EPILOG,
                       allow_abbrev=False,
                       help="plan one epoch: print its batches and totals, optionally draw it",
                       description="Plan one epoch of token-budget batches, as training will, and print a\n"
                                   "table of the first batches and the totals of the epoch (or JSON, or a picture).")
    p.add_argument("--config", metavar="FILE",
                   help="DeepSpeed config (ds_config.json) with a dynamic_batching section: max_tokens, budget, "
                        "order, seed, min/max batch size, LR scaling, and the batch sizes")
    p.add_argument("--seqlens", metavar="FILE",
                   help="the length of every sample: a .npy array, a text file with one length per line, or - "
                        "to read those lines from stdin (default: 2000 synthetic lengths)")
    p.add_argument("--world-size", type=positive_int, metavar="N",
                   help="data-parallel ranks (GPUs divided by pipeline stages): train_batch_size = micro "
                        "batch per GPU x accumulation steps x N (default: derived from the config, else 1)")
    p.add_argument("--pipeline", action="store_true",
                   help="pipeline-parallel plan: same number of samples in every micro-batch of a batch, every "
                        "sample padded to its batch's longest")
    p.add_argument("--epoch", type=non_negative_int, default=0, metavar="E",
                   help="epoch to plan; random and bucket orders change every epoch (default 0)")
    p.add_argument("--max-tokens", type=positive_int, metavar="N",
                   help="token budget of one micro-batch (default: the config's max_tokens, else 4096)")
    p.add_argument("--budget", choices=BUDGETS,
                   help="what max_tokens bounds: sum of seqlens (DeepSpeed's) or padded n x S "
                        "(default: the config's, else sum)")
    p.add_argument("--order", choices=ORDERS,
                   help="sequence picking order (default: the config's sequence_picking_order, else dataloader)")
    p.add_argument("--effective-batch-size", type=positive_int, metavar="K",
                   help="micro-batches per batch, replacing train_batch_size (one micro-batch per step input)")
    p.add_argument("--seed", type=non_negative_int, metavar="S",
                   help="seed of the random and bucket orders (default: the config's, else 0)")
    p.add_argument("--lr-scaling-method", choices=LR_SCALING_METHODS,
                   help="LR rule for the LR factor column (default: the config's, else linear)")
    p.add_argument("--lr-scaling-reference", type=reference, metavar="B_REF",
                   help="batch size the LR was tuned for, a number or 'mean' (default: the config's, else "
                        "train_batch_size)")
    p.add_argument("--lr-scaling-unit", choices=LR_SCALING_UNITS,
                   help="unit of B and B_ref: sequences or tokens (default: the config's, else sequences)")
    p.add_argument("--batches", type=non_negative_int, default=10, metavar="N",
                   help="batches listed in the table (and in the JSON); 0 lists all (default 10)")
    p.add_argument("--json", action="store_true",
                   help="print settings, totals and the listed batches as JSON instead of text")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the plan, regular (DDP) and pipeline side by side, with histograms of B and "
                        "the LR factor (needs matplotlib)")
    p.add_argument("--plot-batches", type=positive_int, default=2, metavar="N",
                   help="batches drawn per plan in the picture (default 2)")
    return parser


# -- inputs ---------------------------------------------------------------------


def _prefixed(source: str, fn: Callable, *args):
    """``fn(*args)``, with ``source`` (a file name) in front of its error message."""
    try:
        return fn(*args)
    except (ValueError, TypeError) as error:
        raise type(error)(f"{source}: {error}") from None


def _read_seqlens_file(path: str) -> np.ndarray:
    """Lengths from a .npy file, a text file with one length per line, or ``-`` (stdin)."""
    import sys
    if path != "-" and path.endswith(".npy"):
        try:
            array = np.load(path, allow_pickle=False)
        except OSError:
            raise
        except Exception as error:  # a corrupt or non-array file: np.load raises many kinds
            raise ValueError(f"cannot read {path} as a .npy array of lengths ({error})") from None
        return _prefixed(path, _as_seqlens, array)
    name = "stdin" if path == "-" else path
    lengths = []
    lines = sys.stdin if path == "-" else open(path)
    try:
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text:
                continue
            try:
                lengths.append(int(text))
            except ValueError:
                raise ValueError(f"line {number} of {name} is {text[:40]!r}, not a whole number; give one "
                                 f"length per line") from None
    finally:
        if path != "-":
            lines.close()
    if not lengths:
        raise ValueError(f"{name} holds no lengths; give one length per line")
    return _prefixed(name, _as_seqlens, lengths)


def _read_config(path: str) -> tuple[dict, dict]:
    """The config dict and its validated dynamic_batching settings."""
    import json
    with open(path) as f:
        try:
            config = json.load(f)
        except ValueError as error:
            raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} should hold a JSON object (a DeepSpeed config), but holds a "
                         f"{type(config).__name__}")
    return config, _prefixed(path, _read_dynamic_batching, config)


def _batch_geometry(config: Mapping, world_size: int | None,
                    effective_batch_size: int | None) -> tuple[int, int, int, int]:
    """``(k, micro_batch_size, gradient_accumulation_steps, world_size)``, resolved as DeepSpeed does."""
    if effective_batch_size is not None:
        ranks = world_size or 1
        if effective_batch_size % ranks:
            raise ValueError(f"--effective-batch-size {effective_batch_size} should be a multiple of "
                             f"--world-size {ranks}")
        return effective_batch_size, 1, effective_batch_size // ranks, ranks
    values = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if config.get(key) is not None:
            values[key] = _check_int(key, config[key], minimum=1)
    train, micro, accumulation = (values.get("train_batch_size"), values.get("train_micro_batch_size_per_gpu"),
                                  values.get("gradient_accumulation_steps"))
    fix = "set train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size"
    if world_size is None:
        if train is not None and micro is not None and accumulation is not None:
            if train % (micro * accumulation):
                raise ValueError(f"train_batch_size={train} is not a multiple of train_micro_batch_size_per_gpu="
                                 f"{micro} x gradient_accumulation_steps={accumulation}; {fix}")
            world_size = train // (micro * accumulation)
        else:
            world_size = 1
    if train is not None and micro is not None and accumulation is not None:
        if train != micro * accumulation * world_size:
            raise ValueError(f"train_batch_size={train} != train_micro_batch_size_per_gpu={micro} x "
                             f"gradient_accumulation_steps={accumulation} x world size {world_size}; {fix}, "
                             f"or pass --effective-batch-size")
    elif train is not None and micro is not None:
        if train % (micro * world_size):
            raise ValueError(f"train_batch_size={train} is not a multiple of train_micro_batch_size_per_gpu="
                             f"{micro} x world size {world_size}; {fix}")
        accumulation = train // (micro * world_size)
    elif train is not None:
        accumulation = accumulation or 1
        if train % (accumulation * world_size):
            raise ValueError(f"train_batch_size={train} is not a multiple of gradient_accumulation_steps="
                             f"{accumulation} x world size {world_size}; {fix}")
        micro = train // (accumulation * world_size)
    else:
        micro, accumulation = micro or 1, accumulation or 1
    return micro * accumulation * world_size, micro, accumulation, world_size


# -- the command ------------------------------------------------------------------


def _main(argv=None) -> int:
    """``python varbatch.py plan ...``: returns the exit code (0, or 2 on bad input)."""
    import json
    import sys
    args = _make_parser().parse_args(argv)
    try:
        if args.plot:
            try:
                import matplotlib  # noqa: F401  (optional: only --plot needs it)
            except ImportError:
                raise ValueError("--plot needs matplotlib, which is not installed; pip install matplotlib, "
                                 "or leave out --plot") from None
        config, settings = _read_config(args.config) if args.config else ({}, {})
        if args.seqlens:
            seqlens = _read_seqlens_file(args.seqlens)
            source = "stdin" if args.seqlens == "-" else args.seqlens
        else:
            seqlens = _synthetic_seqlens()
            source = "synthetic lengths"
        k, micro, accumulation, world_size = _batch_geometry(config, args.world_size, args.effective_batch_size)
        options = dict(
            max_tokens=args.max_tokens or settings.get("max_tokens", _SYNTHETIC_MAX_TOKENS),
            effective_batch_size=k,
            budget=args.budget or settings.get("budget", "sum"),
            order=args.order or settings.get("order", "dataloader"),
            min_batch_size=settings.get("min_batch_size", 1),
            max_batch_size=settings.get("max_batch_size"),
            seed=args.seed if args.seed is not None else settings.get("seed"),
            epoch=args.epoch,
            bucket_size=settings.get("bucket_size"),
        )
        lr_scaling = {
            "method": args.lr_scaling_method or settings.get("lr_scaling_method", "linear"),
            "reference": (args.lr_scaling_reference if args.lr_scaling_reference is not None
                          else settings.get("lr_scaling_reference")),
            "unit": args.lr_scaling_unit or settings.get("lr_scaling_unit", "sequences"),
        }
        # Both kinds of plan for the picture; the table and JSON show the one asked for.
        panels = {}
        for pipeline in ((False, True) if args.plot else (args.pipeline,)):
            plan = plan_batches(seqlens, same_size=pipeline, same_length=pipeline, **options)
            padded_s = _padded_seqlens(plan, seqlens, same_length=pipeline, micro_batch_size=micro,
                                       num_replicas=world_size)
            totals = _plan_totals(plan, seqlens, same_length=pipeline, micro_batch_size=micro,
                                  num_replicas=world_size, lr_scaling=lr_scaling)
            heading = ("pipeline: same-size, same-length micro-batches" if pipeline
                       else "regular (DDP): micro-batches padded to their own longest sample")
            panels[pipeline] = dict(heading=heading, plan=plan, padded_s=padded_s, totals=totals,
                                    lr_factors=_plan_lr_factors(plan, **{f"lr_scaling_{key}": value
                                                                         for key, value in lr_scaling.items()}))
        shown = panels[args.pipeline]
        plan = shown["plan"]
        header = (f"{len(seqlens)} samples ({source}), max_tokens={plan.max_tokens} ({plan.budget} budget), "
                  f"order {options['order']}, {_plural(k, 'micro-batch', 'micro-batches')} per batch, "
                  f"epoch {plan.epoch}")
        if args.plot:
            _draw_plan(args.plot, seqlens, [panels[False], panels[True]], title=header,
                       num_batches=args.plot_batches)
    except (OSError, ValueError, TypeError) as error:
        if isinstance(error, OSError) and error.filename is not None:
            error = f"{error.filename}: {error.strerror}"
        message = " ".join(str(error).split())  # one line
        print(f"varbatch: error: {message}", file=sys.stderr)
        return 2
    rows = _plan_rows(plan, shown["padded_s"], shown["lr_factors"], args.batches or plan.num_batches)
    if args.json:
        settings_out = {key: value for key, value in options.items()}
        settings_out.update(seqlens=source, num_samples=len(seqlens), pipeline=args.pipeline,
                            seed=plan.seed, micro_batch_size=micro, gradient_accumulation_steps=accumulation,
                            world_size=world_size, lr_scaling=lr_scaling)
        out = {"settings": settings_out, "totals": shown["totals"], "batches": rows,
               "dropped_ids": {reason: ids.tolist() for reason, ids in plan.dropped.items()}}
        print(json.dumps(out, indent=2))
    else:
        mode = "pipeline (same-size, same-length micro-batches)" if args.pipeline else "regular (DDP)"
        print(f"plan: {header}, {mode}")
        print()
        print(_format_rows(rows))
        if len(rows) < plan.num_batches:
            print(f"... {plan.num_batches - len(rows)} more batches (--batches 0 lists all)")
        print()
        print(_format_plan_totals(shown["totals"]))
        for reason, ids in plan.dropped.items():
            if len(ids):
                print(f"dropped as {reason}: {_format_ids(ids)}")
    if args.plot:
        print(f"varbatch: wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(_main())
    except BrokenPipeError:  # stdout closed early (`| head`): not an error of ours
        import os
        import sys
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1)
