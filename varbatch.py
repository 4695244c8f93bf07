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
                             f"{array[bad[0]]!r} ({len(bad)} such values); "
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


def _picking_order(seqlens: np.ndarray, ids: np.ndarray, order: str, rng: np.random.Generator,
                   bucket_size: int) -> np.ndarray:
    """Returns ``ids`` in the order in which the packer picks them."""
    if order == "dataloader":
        return ids
    if order == "seqlen":
        # Stable, so equal lengths keep index order (as DeepSpeed's sort of (len, id) pairs).
        return ids[np.argsort(seqlens[ids], kind="stable")]
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
        ranked = window[np.argsort(seqlens[window], kind="stable")]
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


def _pack_same_size(lens: list[int], k: int, max_tokens: int, padded: bool, same_length: bool,
                    min_bs: int, max_bs: int) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Greedy packing of whole batches of ``k`` micro-batches of equal size.

    A batch of ``n`` samples per micro-batch takes the next ``n * k`` samples;
    micro-batch ``b`` holds every k-th of them starting at ``b`` (DeepSpeed's
    interleaving, which balances lengths across micro-batches in seqlen order).
    ``n`` is the largest for which every micro-batch fits.

    Returns:
        (batches, too_small, tail): ``(start, n)`` per batch, the positions
        skipped because not even ``min_bs`` rows fit, and the tail positions.
    """
    batches: list[tuple[int, int]] = []
    too_small: list[int] = []
    total_len = len(lens)
    start = 0
    while start + k <= total_len:
        # Invariant: rows 0..n-1 (samples lens[start:start + n*k]) form k micro-batches
        # within the budget; column b of the rows is micro-batch b.
        col_sum = [0] * k
        col_max = [0] * k
        batch_max = 0
        n = 0
        while start + (n + 1) * k <= total_len and n + 1 <= max_bs:
            row = lens[start + n * k:start + (n + 1) * k]
            if padded and same_length:  # every micro-batch is padded to the batch's longest sample
                fits = (n + 1) * max(batch_max, max(row)) <= max_tokens
            elif padded:
                fits = all((n + 1) * max(m, x) <= max_tokens for m, x in zip(col_max, row))
            else:
                fits = all(s + x <= max_tokens for s, x in zip(col_sum, row))
            if not fits:
                break
            col_sum = [s + x for s, x in zip(col_sum, row)]
            col_max = [max(m, x) for m, x in zip(col_max, row)]
            batch_max = max(batch_max, max(row))
            n += 1
        if n >= min_bs:
            batches.append((start, n))
            start += n * k
        elif start + (n + 1) * k > total_len or n + 1 > max_bs:  # ran out of samples
            break
        else:
            too_small.append(start)
            start += 1
    return batches, too_small, list(range(start, total_len))


def _resplit_leftover(bounds: list[tuple[int, int]], k: int, min_bs: int) -> list[tuple[int, int]] | None:
    """Splits fewer than ``k`` micro-batches into exactly ``k``, or returns None.

    A part of a micro-batch never costs more than the whole (under either
    budget), so splitting keeps every micro-batch within the budget. The
    largest is halved until there are ``k``; None when a half would hold fewer
    than ``min_bs`` samples.
    """
    parts = list(bounds)
    while len(parts) < k:
        j = max(range(len(parts)), key=lambda p: parts[p][1] - parts[p][0])
        a, b = parts[j]
        if b - a < 2 * min_bs:
            return None
        mid = a + (b - a) // 2
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
        order: ``"dataloader"`` (index order), ``"seqlen"`` (ascending, stable),
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
            (default 4096). Larger: less padding, less randomness.
        on_overlong: ``"skip"`` reports samples longer than ``max_tokens`` as
            ``over_budget`` drops (with one warning); ``"error"`` refuses them.

    Returns:
        The `Plan`. Fewer than ``k`` samples (``k x min_batch_size`` with a
        minimum) are dropped as ``tail``; a sample is dropped as
        ``min_batch_size`` only where no micro-batch of ``min_batch_size``
        samples starting with it fits the budget.

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
    picked = _picking_order(lengths, ids, order, rng, bucket_size)
    lens = lengths[picked].tolist()
    padded = budget == "padded"
    big = len(lens) + 1
    if same_size:
        batch_rows, too_small, tail = _pack_same_size(lens, k, max_tokens, padded, same_length, min_bs,
                                                      max_bs or big)
        # Micro-batch b of a batch is every k-th sample from b: permute each
        # batch's samples column by column so micro-batches are contiguous.
        positions: list[int] = []
        offsets = [0]
        for start, n in batch_rows:
            for b in range(k):
                positions.extend(range(start + b, start + n * k, k))
                offsets.append(offsets[-1] + n)
        position_array = np.asarray(positions, dtype=np.int64)
    else:
        ends, too_small, tail = _pack_one_by_one(lens, max_tokens, padded, min_bs, max_bs or big)
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
        position_array = np.asarray([p for a, b in bounds for p in range(a, b)], dtype=np.int64)
        offsets = [0]
        for a, b in bounds:
            offsets.append(offsets[-1] + b - a)
    packed = picked[position_array] if len(position_array) else np.zeros(0, dtype=np.int64)
    offsets_array = np.asarray(offsets, dtype=np.int64)
    num_micro = len(offsets_array) - 1
    if num_micro == 0:
        raise ValueError(_not_enough_samples_message(len(ids), k, min_bs))

    # 4. Shuffle whole batches in `bucket` order: windows are sorted, batches need not be.
    if order == "bucket":
        num_batches = num_micro // k
        batch_order = rng.permutation(num_batches)
        sizes = np.diff(offsets_array)
        new_packed = []
        new_sizes = []
        for b in batch_order:
            lo, hi = offsets_array[b * k], offsets_array[(b + 1) * k]
            new_packed.append(packed[lo:hi])
            new_sizes.append(sizes[b * k:(b + 1) * k])
        packed = np.concatenate(new_packed)
        offsets_array = np.concatenate([[0], np.cumsum(np.concatenate(new_sizes))]).astype(np.int64)

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
        _logger.info(_plan_summary(plan))
    k = plan.effective_batch_size
    microbatch_ids = [(j // k, ids) for j, ids in enumerate(plan.microbatches())]
    return microbatch_ids, plan.batch_sizes.tolist(), plan.batch_max_seqlens.tolist()


def _log_drops(plan: Plan) -> None:
    """One warning per reason with a count and the first ids; never an unbounded line."""
    for reason in ("over_budget", "min_batch_size", "tail"):
        ids = plan.dropped[reason]
        if len(ids):
            _logger.warning("epoch %d: dropped %s as %s", plan.epoch, _format_ids(ids), reason)


def _plan_summary(plan: Plan) -> str:
    sizes = plan.batch_sizes
    return (f"epoch {plan.epoch}: {plan.num_batches} batches of {plan.effective_batch_size} micro-batches, "
            f"{int(sizes.sum())} samples, batch size min/mean/max {int(sizes.min())}/{sizes.mean():.1f}/"
            f"{int(sizes.max())}, {plan.num_dropped} dropped "
            f"({', '.join(f'{r}={len(v)}' for r, v in plan.dropped.items())})")
