# varbatch.py -- token-budget ("dynamic") batching with batch-size-aware LR scaling
# Version 0.5.0. Licence: Apache-2.0.
# Vendored from the varbatch project: copy this one file into your code base.
"""Token-budget batching with learning-rate scaling for PyTorch and DeepSpeed.

Variable-length samples are packed into micro-batches by a token budget
(``max_tokens``) instead of a fixed number of samples, so the batch size B and
the padded length S change from step to step; the learning rate follows each
batch's size over all ranks and accumulation steps (linear or square-root
rule); pipeline batches get micro-batches of one shape.

Public names: DeepSpeed's ``batch_by_seqlens``, ``scale_lr``,
``dataloader_for_variable_batch_size``, ``VariableBatchSizeLR``,
``lr_scheduler_for_variable_batch_size`` and
``get_dataloader_and_lr_scheduler_for_variable_batch_size[_deepspeed]`` (with
DeepSpeed's signatures); ``plan_batches`` -> ``Plan``, ``VariableBatchSampler``,
``make_dataloader``, ``PaddedCollate``, ``pad_sample``, ``seqlens_from_padded``,
``micro_batch_loss_weight``, the record ``Batch``, HF Trainer's adapter
``hf_trainer_lr_scheduler``, and for padding-free step inputs ``FlatCollate``
and ``check_padding_free``.
Guarantees: no micro-batch costs more than ``max_tokens`` (in the seqlens
given: they count what the collate adds); every sample is trained once per
epoch or listed in ``Plan.dropped`` with a reason; every rank computes the same
plan; every epoch of a sampler has the same number of step inputs. Needs numpy
and torch (DeepSpeed and transformers only inside the functions that use them).
Tests: ``python -m pytest test_varbatch.py``.

The contract with a training loop:
- make the sampler (``VariableBatchSampler``) after torch.distributed is up, and
  the loader with ``make_dataloader``; every epoch has ``len(sampler)`` step
  inputs; call ``sampler.set_epoch(epoch)`` before each epoch, as torch asks;
- the data carries its batch: ``make_dataloader(..., batch_count=unit)`` yields
  ``(step_input, batch)``, a `Batch` record; update after the step input whose
  record says ``last``, then tell the scheduler ``step(batch)`` (or
  ``step(batch, skipped=True)`` after an update AMP skipped); without records,
  ``step()`` once per batch, as torch and DeepSpeed count;
- save ``sampler.state_dict(batch)`` and the scheduler's state in one checkpoint;
- HF Trainer and TRL: ``hf_trainer_lr_scheduler``; DeepSpeed's engine:
  ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed``.
Nothing watches the model or the loader; every ``iter()`` is a pass of its own;
a mistake is refused only where one call shows it (NOTE [the contract]).

The file has four parts. Part I is the technique in plain code, read top-down:
the settings and the plan, the orders, the greedy rule, the equal epochs, the LR
rule, the sampler and the scheduler. Part II holds the one speed path, the greedy
rule vectorized, which Part I runs on large epochs. Part III is the torch glue
and its guards (collate, loader, dealing checks); Part IV the trainer adapters
and the DeepSpeed-compatible functions. Generic argument checks come first;
each setting's own checks sit beside what it sets.
"""

from __future__ import annotations

import bisect
import contextvars
import copy
import dataclasses
import difflib
import functools
import hashlib
import inspect
import itertools
import json
import logging
import math
import numbers
import os
import typing
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Literal

import numpy as np
import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

__all__ = [  # DeepSpeed's names (deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr), then ours
    "batch_by_seqlens",
    "scale_lr",
    "dataloader_for_variable_batch_size",
    "VariableBatchSizeLR",
    "lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
    "Plan",
    "plan_batches",
    "VariableBatchSampler",
    "make_dataloader",
    "PaddedCollate",
    "pad_sample",
    "seqlens_from_padded",
    "micro_batch_loss_weight",
    "Batch",
    "hf_trainer_lr_scheduler",
    "FlatCollate",
    "check_padding_free",
]
__version__ = "0.5.0"
_logger = logging.getLogger("varbatch")

_Budget = Literal["sum", "padded"]
_Order = Literal["dataloader", "seqlen", "random", "bucket"]
_Packing = Literal["greedy", "best_fit"]
_OnOverlong = Literal["skip", "error"]
_LRMethod = Literal["linear", "sqrt", "none"]
_LRUnit = Literal["sequences", "tokens"]
_Clock = Literal["steps", "tokens", "samples"]
_BatchCount = Literal["sequences", "tokens", "label_tokens"]
_DROP_REASONS = ("over_budget", "min_batch_size", "tail", "filtered")
# `random` and `bucket` never use an unseeded generator: every rank must draw the
# same order (DeepSpeed's `random` with seed=None draws a different one per rank).
_DEFAULT_SEED = 0
# The default window of the `bucket` order (the comment above `_bucket_window`): this many blocks of
# micro-batches at the mean seqlen, the whole epoch where it holds fewer.
_BUCKET_WINDOW_BLOCKS = 512
_MAX_TOKENS_LIMIT = 2**31  # sums of up to 2**31 lengths below it stay inside int64


# =============================================================================
# Generic argument checks: each setting's own checks sit beside what it sets
# =============================================================================
# One template for every message: parameter, offending value, constraint, fix.


def _check_int(name: str, value: Any, minimum: int = 0, maximum: int | None = None, fix: str = "") -> int:
    """``value`` as an int in ``[minimum, maximum]``, or raises naming ``name`` and the value."""
    fix = f"; {fix}" if fix else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} should be an integer, but got {name}={value!r} of type {type(value).__name__}{fix}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} should be an integer {bounds}, but got {name}={value}{fix}")
    return int(value)


def _check_real(name: str, value: Any, strict: bool = True) -> float:
    """A finite number > 0 (>= 0 when not ``strict``); a one-number tensor counts as its number."""
    value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} should be a number, but got {name}={value!r} of type {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (strict and value == 0):
        raise ValueError(f"{name} should be a finite number {'>' if strict else '>='} 0, but got {name}={value!r}")
    return float(value)


def _check_choice(name: str, value: Any, choices: Any) -> str:
    """``value`` if it is one of the Literal type ``choices``; else raises naming the closest."""
    choices = typing.get_args(choices)
    if isinstance(value, str) and value in choices:
        return value
    close = difflib.get_close_matches(str(value), choices, n=1)
    raise ValueError(
        f"{name} should be one of {', '.join(map(repr, choices))}, but got {name}={value!r}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
    )


def _format_ids(ids: np.ndarray) -> str:
    """``'3 samples (ids 4, 9, 12)'``, naming at most 10 ids."""
    shown = ", ".join(str(int(i)) for i in ids[:10]) + (", ..." if len(ids) > 10 else "")
    return f"{len(ids)} sample{'s' if len(ids) != 1 else ''} (ids {shown})"


def _as_counts(
    values: Any,
    name: str = "seqlens",
    minimum: int = 1,
    fix: str = "pass one whole token count per sample",
    copy: bool = True,
) -> np.ndarray:
    """Whole numbers (seqlens, batch sizes, ids) as a read-only int64 array, or raises naming the first bad one.

    ``copy=False`` reads an int64 array in place (a read-only view of it), for a caller that keeps nothing.
    """
    if isinstance(values, (str, bytes, Mapping)) or not (hasattr(values, "__len__") and hasattr(values, "__getitem__")):
        raise TypeError(
            f"{name} should be a sequence of whole numbers (a list, array or tensor), but got {name}="
            f"{values!r:.60} of type {type(values).__name__}; {fix}"
        )
    if isinstance(values, torch.Tensor):  # bfloat16 and other torch-only dtypes: through float64
        values = values.detach().cpu()
        values = (values.double() if values.is_floating_point() else values).numpy()
    try:
        array = np.asarray(values)
    except ValueError:  # ragged nesting
        raise ValueError(f"{name} should be flat (one number per sample), but it is ragged; {fix}") from None
    array = array[:, 0] if array.ndim == 2 and array.shape[1] == 1 else array  # DeepSpeed's metric files: N x 1
    if array.ndim != 1:
        raise ValueError(f"{name} should be one-dimensional, but got shape {array.shape}; {fix}")
    if array.dtype == bool or array.dtype.kind not in "iuf":
        raise TypeError(f"{name} should hold whole numbers, but got dtype {array.dtype}; {fix}")
    bad = np.flatnonzero(
        ~np.isfinite(array) | (array != np.round(array)) | (array >= 2.0**63)
        if array.dtype.kind == "f"
        else array > np.iinfo(np.int64).max
    )
    if not len(bad):
        array = array.astype(np.int64, copy=copy).view()  # a view: the caller's array stays writable
        bad = np.flatnonzero(array < minimum)
    if len(bad):
        raise ValueError(
            f"{name} should hold whole numbers in [{minimum}, 2**63), but {name}[{bad[0]}]="
            f"{array[bad[0]].item()!r} ({len(bad)} such values); {fix}"
        )
    array.setflags(write=False)
    return array


def _as_sample_ids(sample_ids: Any, num_samples: int) -> np.ndarray:
    """A subset of sample ids (curriculum filtering): integers, each in the dataset, each once."""
    if hasattr(sample_ids, "__getitem__") and len(sample_ids) and np.asarray(sample_ids).dtype.kind not in "iu":
        raise TypeError(f"sample_ids should be integer ids, but got dtype {np.asarray(sample_ids).dtype}")
    ids = _as_counts(sample_ids, "sample_ids", minimum=0, fix="pass the ids of the samples to use")
    unique, counts = np.unique(ids, return_counts=True)
    out = np.flatnonzero(ids >= num_samples)
    if len(out):
        raise ValueError(f"sample_ids should be in [0, {num_samples}), but got sample_ids[{out[0]}]={ids[out[0]]}")
    if (counts > 1).any():
        raise ValueError(
            f"sample_ids should name each sample once, but {_format_ids(unique[counts > 1])} appear more "
            f"than once; deduplicate them (np.unique)"
        )
    return ids


def _digest(*arrays: Any) -> str | None:
    """A short sha256 of int arrays, equal on ranks that hold equal data (None for None)."""
    if arrays[0] is None:
        return None
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(np.asarray(array, dtype=np.int64)).tobytes())
    return digest.hexdigest()[:16]


def _mismatch(saved: Any, mine: dict, one: str) -> str | None:
    """``"saved with seed=1 into a sampler with seed=2"`` for the first setting that differs (likeliest first);
    settings nested under a key (a scheduler's sampler's) count as settings of their own, named ``sampler.seed``."""
    if not isinstance(saved, Mapping) or set(saved) != set(mine):
        return "saved with settings that are not this version's (pass a dict made by state_dict())"
    settings = {}  # name -> (saved value, this value)
    for key in mine:
        if isinstance(saved[key], Mapping) and isinstance(mine[key], Mapping) and set(saved[key]) == set(mine[key]):
            settings.update({f"{key}.{name}": (saved[key][name], mine[key][name]) for name in mine[key]})
        else:
            settings[key] = (saved[key], mine[key])
    likeliest = ("num_replicas", "seqlens", "sample_ids")  # the world size, then the data
    for name in sorted(settings, key=lambda name: (name.rpartition(".")[2] not in likeliest, name)):
        before, now = settings[name]
        if before == now:
            continue
        if name.rpartition(".")[2] in ("seqlens", "sample_ids", "fixed_plan", "batch_sizes", "sampler"):
            return f"saved with other {name.replace('_', ' ')} (another dataset?) than this one's"
        return f"saved with {name}={before!r} into {one} with {name}={now!r}"
    return None


def _check_state(owner: Any, state_dict: Any, expected: set) -> None:
    """A state dict of this version of varbatch, with exactly the keys ``owner.state_dict()`` makes (``expected``,
    besides ``version``), and ``owner``'s settings.

    The one check of a state's version: a state of another version (0.3's had none) is refused naming both, never
    converted; a run resumes with the varbatch that saved it.
    """
    name = type(owner).__name__
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{name}.load_state_dict expects a dict, but got {type(state_dict).__name__}")
    version = state_dict.get("version", "0.3 or older (no 'version' key)")
    if version != __version__:
        raise ValueError(
            f"cannot load a {name} state saved by varbatch {version} into varbatch {__version__}: states do not "
            f"carry over between versions; resume with the varbatch that saved it, or start the run anew"
        )
    expected = {*expected, "version"}
    unknown, missing = sorted(set(state_dict) - expected), sorted(expected - set(state_dict))
    if unknown or missing:
        raise ValueError(
            f"{name}.load_state_dict got unknown keys {unknown} and is missing keys {missing}; pass a "
            f"dict made by {name}.state_dict()"
        )
    kind = "sampler" if isinstance(owner, Sampler) else "scheduler"
    mismatch = _mismatch(state_dict["settings"], owner._state_settings(), "a sampler" if kind == "sampler" else "one")
    if mismatch:
        raise ValueError(
            f"cannot load a {kind} state {mismatch}; resume with the same dataset, config, world size and LR settings"
        )


###############################################################################
# Part I. The technique, in plain code
###############################################################################


# =============================================================================
# Settings and the plan
# =============================================================================


def _option(check: str, default: Any = dataclasses.MISSING, fix: str = "", **bounds: Any) -> Any:
    """A `_Settings` field: its ``default`` and, as its metadata, the check of its kind (`_checked_option`), its
    bounds or choices, and the fix its message names."""
    return dataclasses.field(default=default, metadata={"check": check, "fix": fix, **bounds})


@dataclasses.dataclass(frozen=True)
class _Settings:
    """Every option of a plan, validated once; each is documented in `plan_batches`.

    Built from keyword arguments, by the config reader or by the command line,
    then passed through: a new option is a field here, with its check, and a
    line there. Each field declares its kind, bounds and fix; `_check_settings`
    checks them all in one loop, then the rules that relate two of them.
    """

    max_tokens: int = _option("count", maximum=_MAX_TOKENS_LIMIT, fix="it is the token budget of one micro-batch")
    effective_batch_size: int = _option("count", 1, fix="it is train_batch_size, micro-batches per optimizer step")
    # Micro-batches per step input: DeepSpeed's train_micro_batch_size_per_gpu in its module's sense, not samples.
    micro_batch_size: int = _option("count", 1, fix="it counts micro-batches per step input, not samples")
    num_replicas: int = _option("count", 1, fix="the data-parallel size")
    budget: _Budget = _option("choice", "sum", choices=_Budget)
    order: _Order = _option("choice", "dataloader", choices=_Order, name="sequence_picking_order")
    # None: best fit for flat rows (DeepSpeed has none) in the random order (no promise of like lengths), else greedy
    packing: _Packing | None = _option("choice or None", None, choices=_Packing)
    min_batch_size: int | None = _option("bound", 1, unbounded=1, fix="or None for no bound")
    max_batch_size: int | None = _option("bound", None, unbounded=None, fix="or None for no bound")
    same_size: bool = _option("flag", False)
    same_length: bool = _option("flag", False)
    seed: int | None = _option("seed", None, fix="or None for varbatch's fixed default seed")
    bucket_size: int | None = _option("count or None", None, fix="or None for the default window")
    on_overlong: _OnOverlong = _option("choice", "skip", choices=_OnOverlong)
    padding_free: bool = _option("flag", False)
    balance_ranks: bool = _option("flag", False)
    quadratic_tokens: float | None = _option("real or None", None)

    def __post_init__(self):
        _check_settings(self)

    @classmethod
    def of(cls, **options: Any) -> _Settings:
        """Settings from keyword arguments; an unknown one is named with the closest known one."""
        known = [field.name for field in dataclasses.fields(cls)]
        for name in set(options) - set(known):
            close = difflib.get_close_matches(name, known, n=1)
            raise TypeError(
                f"unknown plan option {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}; the "
                f"options are {', '.join(known)}"
            )
        return cls(**options)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.effective_batch_size // (self.micro_batch_size * self.num_replicas)

    @property
    def unit_width(self) -> int:
        """Micro-batches packed as one block of equal micro-batches: a batch (same_size), a padded step input, or 1."""
        if self.same_size:
            return self.effective_batch_size
        if self.budget == "padded":
            return self.micro_batch_size
        return 1

    @property
    def best_fit(self) -> bool:
        """Whether micro-batches are packed by best fit (NOTE [best fit]): as asked; by default, flat rows in the random
        order where best fit applies (one micro-batch to a block, min_batch_size 1)."""
        if self.packing is not None:
            return self.packing == "best_fit"
        return self.padding_free and self.order == "random" and not self.same_size and self.min_batch_size == 1

    @property
    def step_input_bound(self) -> int:
        """The padded budget's bound on one step input's ``B x S`` tensor: ``micro_batch_size x max_tokens``."""
        return self.micro_batch_size * self.max_tokens

    @property
    def padding_group(self) -> int:
        """Adjacent micro-batches padded to one S: a batch (same_length) or a step input."""
        return self.effective_batch_size if self.same_length else self.micro_batch_size


def _check_settings(settings: _Settings) -> None:
    """Checks every option of ``settings`` as its field declares and writes each back in its one form (a bound of 0
    or None: no bound), then the rules that relate two options: run once, by `_Settings` as it is made."""
    for field in dataclasses.fields(settings):
        object.__setattr__(settings, field.name, _checked_option(field, getattr(settings, field.name)))
    _check_relations(settings)


def _checked_option(field: dataclasses.Field, value: Any) -> Any:
    """``value`` of the option ``field`` in its one form, or raises naming the option, the value and its fix."""
    meta = field.metadata
    name = meta.get("name", field.name)  # the name users know it by
    check = meta["check"]
    fix = meta["fix"]
    if check == "count":
        return _check_int(name, value, 1, meta.get("maximum"), fix)
    if check == "choice":
        return _check_choice(name, value, meta["choices"])
    if check == "flag":
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} should be a bool, but got {name}={value!r}")
        return bool(value)
    if check == "seed":
        return _DEFAULT_SEED if value is None else _check_int(name, value, fix=fix)
    if check == "bound":  # None or 0: no bound (DeepSpeed's convention)
        if value is None or (not isinstance(value, bool) and isinstance(value, numbers.Integral) and value == 0):
            return meta["unbounded"]
        return _check_int(name, value, 1, fix=fix)
    if value is None:  # "count or None", "real or None", "choice or None"
        return None
    if check == "count or None":
        return _check_int(name, value, 1, fix=fix)
    if check == "choice or None":
        return _check_choice(name, value, meta["choices"])
    if check == "real or None":
        return _check_real(name, value)
    raise AssertionError(f"_Settings.{field.name} declares the check {check!r}, which _checked_option does not know")


def _check_relations(settings: _Settings) -> None:
    """The rules that relate two options (each option checked on its own before); warns where balancing has
    nothing to do (NOTE [balanced ranks])."""
    if settings.effective_batch_size % (settings.micro_batch_size * settings.num_replicas):
        raise ValueError(
            f"effective_batch_size={settings.effective_batch_size} should be a multiple of micro_batch_size"
            f" x num_replicas = {settings.micro_batch_size} x {settings.num_replicas}; set train_batch_size = "
            f"micro batch per GPU x gradient accumulation steps x data-parallel size"
        )
    if settings.max_batch_size is not None and settings.min_batch_size > settings.max_batch_size:
        raise ValueError(
            f"min_batch_size should be <= max_batch_size, but got min_batch_size={settings.min_batch_size} "
            f"and max_batch_size={settings.max_batch_size}"
        )
    if settings.budget == "padded" and settings.same_length and not settings.same_size:
        raise ValueError(
            "budget='padded' with same_length=True needs same_size=True (the padded size of a micro-"
            "batch then depends on the whole batch); set same_size=True or budget='sum'"
        )
    if settings.padding_free and settings.budget == "padded":
        raise ValueError(
            "padding_free=True with budget='padded': a flat row has no padded B x S tensor to bound; use "
            "budget='sum', which bounds a row's tokens by micro_batch_size x max_tokens"
        )
    if settings.packing == "best_fit":
        _check_best_fit(settings)
    if not settings.balance_ranks:
        return
    if settings.quadratic_tokens is None:
        raise ValueError(
            "balance_ranks=True needs quadratic_tokens=q, but got quadratic_tokens=None; q is the length at which one"
            " sample's attention costs as much as the rest of the model: about 6 x hidden_size (12 x with a causal"
            " kernel that skips the masked blocks), or timed as the README shows; where unsure, err low"
        )
    if settings.order in ("dataloader", "seqlen"):
        raise ValueError(
            f"balance_ranks=True regroups the plan's step inputs, but sequence_picking_order={settings.order!r}"
            f" promises their order; use sequence_picking_order='random' or 'bucket', or balance_ranks=False"
        )
    if settings.same_size and settings.same_length and not settings.padding_free:
        warnings.warn(
            "balance_ranks=True does nothing with same_size=True and same_length=True (pipeline batches): every"
            " padded step input of a batch has one shape, so one cost, already; set balance_ranks=False",
            stacklevel=2,
        )


def _check_best_fit(settings: _Settings) -> None:
    """packing="best_fit" where best fit applies (NOTE [best fit]), else raises naming the setting in the way."""
    for option, value in (("budget", "sum"), ("same_size", False), ("min_batch_size", 1)):
        if getattr(settings, option) != value:
            raise ValueError(
                f"packing='best_fit' needs {option}={value!r} (it fills each micro-batch by its tokens, whatever its"
                f" size), but got {option}={getattr(settings, option)!r}; set {option}={value!r}, or packing='greedy'"
            )


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """The packing of one epoch: micro-batches grouped into batches, and the drops.

    Plain, read-only data that depends only on (seqlens, settings, seed,
    epoch): every rank computes the same plan. Micro-batch ``j`` holds
    ``sample_ids[microbatch_offsets[j]:microbatch_offsets[j + 1]]``; batch ``b``
    (one optimizer step) holds micro-batches ``b*k .. b*k + k - 1`` (``k =
    effective_batch_size``); a step input is ``micro_batch_size`` consecutive
    micro-batches collated into one ``B x S`` tensor. ``padded_seqlens`` is,
    per micro-batch, that S (its step input's longest sample; its batch's in same-length
    mode; padding-free, the T of its ``1 x T`` row). ``batch_sizes`` (the B of the LR rule),
    ``batch_tokens`` and ``batch_max_seqlens`` describe each batch; ``dropped`` maps each reason
    (``over_budget``, ``min_batch_size``, ``tail``, ``filtered``) to sorted ids.
    ``sample_ids``, one entry per sample, is int32 where the ids fit (datasets
    below 2**31 samples; int64 in a plan of given micro-batches); the other
    arrays are int64.
    """

    sample_ids: np.ndarray
    microbatch_offsets: np.ndarray
    padded_seqlens: np.ndarray
    batch_sizes: np.ndarray
    batch_tokens: np.ndarray
    batch_max_seqlens: np.ndarray
    dropped: dict
    settings: _Settings
    epoch: int

    @property
    def effective_batch_size(self) -> int:
        return self.settings.effective_batch_size

    @property
    def max_tokens(self) -> int:
        return self.settings.max_tokens

    @property
    def budget(self) -> str:
        return self.settings.budget

    @property
    def seed(self) -> int:
        return self.settings.seed

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
        return self.sample_ids[self.microbatch_offsets[j] : self.microbatch_offsets[j + 1]]

    def microbatches(self) -> list[list[int]]:
        """Every micro-batch as a list of sample ids, in plan order."""
        ids, bounds = self.sample_ids.tolist(), self.microbatch_offsets.tolist()
        return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def _amounts(self, unit: str) -> np.ndarray:
        """Per batch, in ``unit``: its real tokens (``"tokens"``), its sequences (``"sequences"``,
        ``"samples"``), or 1 (``"steps"``): what the LR rule, the clock and the horizon count."""
        if unit == "tokens":
            return self.batch_tokens
        if unit == "steps":
            return np.ones(self.num_batches, np.int64)
        return self.batch_sizes

    def microbatch_sizes(self) -> np.ndarray:
        """Samples per micro-batch."""
        return np.diff(self.microbatch_offsets)

    def fingerprint(self) -> str:
        """A short hash of the packing, equal on ranks that computed the same plan."""
        return _digest(self.sample_ids, self.microbatch_offsets, [self.effective_batch_size])

    def totals(self) -> dict:
        """The totals as plain (JSON) data: batches, drops, padding (a micro-batch costs ``n x S``; padding-free, a
        step input its row: ``padded_seqlens``), B and S.

        ``largest_step_input`` compares the largest tensor a forward pass sees
        with its bound under the padded budget, ``micro_batch_size x max_tokens``.

        Example:
            >>> t = plan_batches([3, 5, 2, 6, 4, 1], max_tokens=8, effective_batch_size=2).totals()
            >>> t["batches"], t["real_tokens"], t["padded_tokens"], t["batch_size"]["max"]
            (2, 21, 27, 4)
        """
        settings, sizes = self.settings, self.microbatch_sizes()
        per_input = settings.micro_batch_size  # micro-batches per step input
        tensor_tokens = (sizes * self.padded_seqlens).reshape(-1, per_input).sum(axis=1)  # B x S of each step input
        if settings.padding_free:
            tensor_tokens = self.padded_seqlens[::per_input]  # 1 x T: each step input's row
        real, padded = int(self.batch_tokens.sum()), int(tensor_tokens.sum())
        largest = {"sequences": 0, "padded_seqlen": 0, "tokens": 0, "bound": settings.step_input_bound}
        if len(tensor_tokens):
            big = int(np.argmax(tensor_tokens))
            largest["sequences"] = int(sizes.reshape(-1, per_input)[big].sum())
            largest["padded_seqlen"] = int(self.padded_seqlens[big * per_input])
            largest["tokens"] = int(tensor_tokens[big])
        return {
            "epoch": self.epoch,
            **{
                key: getattr(settings, key)
                for key in (
                    "max_tokens",
                    "budget",
                    "same_length",
                    "padding_free",
                    "effective_batch_size",
                    "micro_batch_size",
                    "gradient_accumulation_steps",
                    "num_replicas",
                )
            },
            "batches": self.num_batches,
            "step_inputs_per_rank": self.num_batches * settings.gradient_accumulation_steps,
            "microbatches": self.num_microbatches,
            "samples": int(self.batch_sizes.sum()),
            "dropped": {reason: len(ids) for reason, ids in self.dropped.items()},
            "num_dropped": self.num_dropped,
            "real_tokens": real,
            "padded_tokens": padded,
            "efficiency": real / padded if padded else 1.0,
            "largest_step_input": largest,
            "batch_size": _distribution(self.batch_sizes),
            "batch_tokens": _distribution(self.batch_tokens),
            "microbatch_size": _distribution(sizes),
            "padded_seqlen": _distribution(self.padded_seqlens),
        }


def _distribution(values: np.ndarray) -> dict | None:
    """``{min, median, mean, max}`` of ``values`` as plain numbers (None when empty): what the reports print."""
    if not len(values):
        return None
    return {
        "min": values.min().item(),
        "median": float(np.median(values)),
        "mean": float(values.mean()),
        "max": values.max().item(),
    }


# =============================================================================
# Packing one epoch
# =============================================================================


def plan_batches(
    seqlens: Sequence[int] | np.ndarray,
    max_tokens: int,
    *,
    effective_batch_size: int = 1,
    sample_ids: Sequence[int] | np.ndarray | None = None,
    epoch: int = 0,
    **options: Any,
) -> Plan:
    """Packs one epoch of samples into micro-batches and batches under a token budget.

    Args:
        seqlens: the token count of every sample of the dataset (``L_i >= 1``),
            as the collate function makes it: BOS/EOS it adds included.
        max_tokens: the budget of one micro-batch: with ``budget="sum"`` the sum
            of its seqlens (DeepSpeed's meaning); with ``"padded"``, ``n x S``,
            its padded ``B x S`` tensor (S: the longest sample of its step
            input; of its batch when ``same_length``), a bound on the tensors a
            forward pass sees as far as the seqlens count their tokens.
        effective_batch_size: ``k``, micro-batches per batch (one optimizer step):
            micro-batches per step input x accumulation steps x data-parallel ranks.
        sample_ids: the samples to pack (curriculum filtering; in ``dataloader``
            order, in the order given); the others are dropped as ``filtered``.
        epoch: ``random`` and ``bucket`` draw a new order each epoch.
        **options: ``budget``, as above. ``order``: ``"dataloader"`` (index
            order), ``"seqlen"`` (ascending, ties by id), ``"random"`` (drawn
            from ``(seed, epoch)``) or ``"bucket"`` (random, sorted inside
            windows of samples drawn at random, batches then shuffled: random
            with little padding). ``packing``: ``"greedy"`` (DeepSpeed's rule:
            the next samples while they fit) or ``"best_fit"`` (each into the
            open micro-batch it fills most snugly: full rows, new every epoch;
            the sum budget, no same_size, min_batch_size 1; NOTE [best fit]);
            None: best fit for flat rows in the random order, else greedy.
            ``min_batch_size``, ``max_batch_size``: bounds on a
            micro-batch's samples (None or 0: none). ``same_size``: every
            micro-batch of a batch as many samples (pipelines); ``same_length``:
            every sample padded to its batch's longest (needs ``same_size`` under
            the padded budget). ``micro_batch_size``, ``num_replicas``:
            micro-batches per step input, data-parallel ranks (a padded step
            input shares one S: its tensor is <= ``micro_batch_size x max_tokens``).
            ``seed``: of ``random``/``bucket`` (None: a fixed one, never
            unseeded). ``bucket_size``: samples per window, on average; by default 512
            blocks' worth at the mean length (a block: a batch with ``same_size``, a
            padded step input, else a micro-batch; best fit: 4,096 samples), all the
            samples where they are fewer (a set of a few thousand: the same
            micro-batches every epoch);
            smaller, fresher micro-batches and more padding (the trade measured:
            BENCHMARKS.md). ``on_overlong``: samples
            longer than ``max_tokens`` are dropped as ``over_budget`` (``"skip"``)
            or refused (``"error"``). ``padding_free``: each step input one
            flat row of its samples, under the sum budget (same_length: a
            batch's rows padded to its longest row; see `FlatCollate`).
            ``balance_ranks``: the step inputs (unchanged) grouped so that the
            ranks' step inputs at each accumulation step cost nearly the same,
            ``n S + n S^2 / q`` padded, ``sum(L) + sum(L^2) / q`` flat, with ``q``
            = ``quadratic_tokens`` (NOTE [balanced ranks]; not with the
            ``dataloader`` or ``seqlen`` order, which promise one).

    Returns:
        The `Plan`. Micro-batches that do not fill a last batch are cut into
        ``k`` where they can be: with ``min_batch_size=1`` fewer than ``k``
        samples are dropped as ``tail``, in the ``random`` and ``bucket``
        orders other ones each epoch (NOTE [the tail moves]). A sample is
        dropped as ``min_batch_size`` only where no micro-batch (or block) of
        that many samples starting with it fits.

    Raises:
        TypeError, ValueError: bad input, naming the value and the fix; or no batch to pack.

    Example:
        >>> plan = plan_batches([3, 5, 2, 6, 4, 1], max_tokens=8, effective_batch_size=2)
        >>> plan.microbatches(), plan.batch_sizes.tolist()
        ([[0, 1], [2, 3], [4], [5]], [4, 2])
    """
    lengths = _as_counts(seqlens, copy=False)  # planned at once, not kept: no copy
    settings = _Settings.of(max_tokens=max_tokens, effective_batch_size=effective_batch_size, **options)
    ids = None if sample_ids is None else _as_sample_ids(sample_ids, len(lengths))
    epoch = _check_int("epoch", epoch)
    planner = _Planner(lengths, settings, ids)
    if planner.reference.num_batches == 0:
        raise ValueError(_empty_plan_message(planner.reference))
    return planner(epoch)


def _pack(
    seqlens: np.ndarray, settings: _Settings, sample_ids: np.ndarray | None, epoch: int, attempt: int = 0
) -> Plan:
    """The packing of one epoch as its orders draw it (without a batch when the samples cannot fill one: then all
    are in its drops); ``attempt`` n > 0 draws the epoch's n-th other order (see NOTE [every epoch the same length]).

    Raises:
        ValueError: from `_overlong`.
    """
    rng = np.random.default_rng((settings.seed, epoch, _PLAN_STREAM, attempt))  # attempt 0: as (seed, epoch, stream)
    picked, overlong = _picked(seqlens, sample_ids, settings, rng)
    lengths = _gathered(seqlens, picked, settings)  # read once: in picking order here, in plan order below
    positions, sizes, too_small, tail = _microbatches(lengths, settings)
    if settings.order == "bucket":  # the windows are sorted: shuffle whole batches
        order = rng.permutation(len(sizes) // settings.effective_batch_size)
        positions, sizes = _reordered_batches(positions, sizes, order, settings)
    dropped = {
        "over_budget": np.sort(overlong),
        "min_batch_size": np.sort(picked[too_small]),
        "tail": np.sort(picked[tail]),
        "filtered": np.zeros(0, np.int64) if sample_ids is None else np.setdiff1d(np.arange(len(seqlens)), sample_ids),
    }
    dropped = {reason: ids.astype(np.int64) for reason, ids in dropped.items()}
    ids, lengths = picked[positions], lengths[positions]  # in plan order
    del picked, positions  # let go at once: on 100M samples each is 400 MB
    arrays = _plan_arrays(ids, sizes, lengths, settings)
    for array in (*arrays.values(), *dropped.values()):
        array.setflags(write=False)
    return Plan(**arrays, dropped=dropped, settings=settings, epoch=epoch)


def _gathered(seqlens: np.ndarray, ids: np.ndarray, settings: _Settings) -> np.ndarray:
    """``seqlens[ids]``, packable: int32 where max_tokens keeps them below 2**31, gathered `_CHUNK` at a time (no
    int64 copy of them all on the way)."""
    if settings.max_tokens >= 2**31:
        return seqlens[ids]
    lengths = np.empty(len(ids), np.int32)
    for start in range(0, len(ids), _CHUNK):
        lengths[start : start + _CHUNK] = seqlens[ids[start : start + _CHUNK]]
    return lengths


# NOTE [one dispatch]: the greedy rule is written below as loops over samples: the form to read, and the one that
# runs on up to `_PLAIN_UP_TO` samples (every test-sized plan). A Python step per sample costs seconds on an epoch
# of millions, so on more `_microbatches` runs Part II's vectorized form (`_pack_rows_fast`), which places the same
# blocks with a Python step per micro-batch. This is the one place that chooses; every other step of a plan has one
# form, in numpy, here. Tests reach either form through `plan_batches` and the sampler by setting `_PLAIN_UP_TO`
# (and `_CHUNK`).
_PLAIN_UP_TO = 4096  # samples
_CHUNK = 2**16  # positions per numpy pass: temporaries stay small and in cache


def _microbatches(lens: np.ndarray, settings: _Settings) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The micro-batches of whole batches over ``lens``, the seqlens in picking order: the positions of their
    samples, micro-batch after micro-batch, and their sizes; and the positions dropped as ``min_batch_size`` and as
    ``tail``."""
    if settings.best_fit:
        positions, sizes = _best_fit_rows(lens, settings)
        positions, sizes, tail = _fill_last_batch(positions, sizes, settings)
        return positions, sizes, np.zeros(0, np.int64), tail
    if len(lens) > _PLAIN_UP_TO:  # NOTE [one dispatch]
        table, too_small, end = _pack_rows_fast(lens, settings)
    elif settings.unit_width == 1:
        table, too_small, end = _greedy_rows(lens, settings)
    else:
        table, too_small, end = _pack_rows(lens, settings)
    positions, sizes = _positions(table, settings.unit_width, _index_dtype(len(lens)))
    positions, sizes, tail = _fill_last_batch(positions, sizes, settings)
    return positions, sizes, np.asarray(too_small, np.int64), np.concatenate([tail, np.arange(end, len(lens))])


# The greedy rule (DeepSpeed's). A micro-batch of n samples costs the sum of their seqlens (budget "sum") or n x the
# longest of them (budget "padded", with one micro-batch per step input; with more, n x the longest of its padding
# group: `_pack_rows`), and max_tokens bounds that cost. Both grow with every sample added, so from each
# position in picking order the packer adds samples while the cost stays within max_tokens; the first sample that
# does not fit starts the next micro-batch.


def _greedy_rows(lens: np.ndarray, settings: _Settings) -> tuple[np.ndarray, list[int], int]:
    """The greedy rule over ``lens``, the seqlens in picking order, one micro-batch to a block (``unit_width`` 1).

    A micro-batch takes at most ``max_batch_size`` samples; where fewer than
    ``min_batch_size`` fit, its first sample is dropped and the next one tried.
    Returns what `_pack_rows` returns: the blocks' table (`_block_table`), the
    positions dropped as ``min_batch_size``, and where the tail starts.
    """
    values = lens.tolist()  # Python ints: the loop reads them one at a time
    total = len(values)
    cap = settings.max_batch_size or total
    starts = []
    rows = []
    too_small = []
    start = 0
    # Invariant: positions [0, start) are each in one placed micro-batch or in `too_small`; [start, total) is unplaced.
    while start < total:
        rows_left = min(total - start, cap)
        n = 0
        tokens = 0
        longest = 0
        while n < rows_left:  # add samples while the budget holds
            tokens += values[start + n]
            longest = max(longest, values[start + n])
            cost = tokens if settings.budget == "sum" else (n + 1) * longest
            if cost > settings.max_tokens:
                break
            n += 1
        if n >= settings.min_batch_size:
            starts.append(start)
            rows.append(n)
            start += n
        elif n == rows_left:  # ran out of samples, not of budget: the rest is the tail
            break
        else:
            too_small.append(start)
            start += 1
    return _block_table(starts, rows), too_small, start


# NOTE [best fit]: the greedy rule closes a micro-batch at the first sample that does not fit, so each is short by
# about half a sample (86% of a 4,096-token row on SFT-like lengths). Best fit puts each sample into the open
# micro-batch with the least room left that still holds it (a new one where none does); a micro-batch closes once no
# sample of the epoch fits its room or it holds max_batch_size, and where more than `_BEST_FIT_WINDOW` are open the
# fullest closes; the plan takes them as they close. Samples placed longest first leave gaps that the shorter ones
# fill: best-fit decreasing over the whole set (TRL's packing) comes within a fraction of a point of what the lengths
# allow, with the same rows every epoch. So under best fit the drawn orders come in windows of samples drawn at random
# (`_BEST_FIT_WINDOW`; `bucket`: `bucket_size`), each longest first in steps of max_tokens / `_BEST_FIT_STEPS` (NOTE
# [the orders, as sorts]): samples of like share of a row keep their drawn order, so rows are new every epoch, even in
# one window (fill, pairs again: BENCHMARKS.md). The room is the sum budget's, a flat row's. By default best fit packs
# flat rows, which DeepSpeed does not plan, in the random order, which promises nothing of lengths: the bucket order
# promises like lengths (a padded tensor costs n x S), and every plan DeepSpeed makes stays greedy. same_size blocks
# and min_batch_size ask for counts that best fit, closing full micro-batches, ignores.
_BEST_FIT_WINDOW = 4096  # samples
_BEST_FIT_STEPS = 16


def _best_fit_rows(lens: np.ndarray, settings: _Settings) -> tuple[np.ndarray, np.ndarray]:
    """Best fit over ``lens``, the seqlens in picking order (NOTE [best fit]): the positions of the micro-batches'
    samples, micro-batch after micro-batch as they close (the last open ones as they opened), and their sizes."""
    values = lens.tolist()  # Python ints: the loop reads them one at a time
    shortest = min(values)
    cap = settings.max_batch_size or len(values)
    rooms = []  # (room left, micro-batch) of each open micro-batch, least room first
    microbatch_of = []  # per position
    sizes = []  # per micro-batch, in the order they open
    closed = []  # the micro-batches, in the order they close
    for length in values:
        at = bisect.bisect_left(rooms, (length,))  # the least room that still holds it
        if at < len(rooms):
            room, j = rooms.pop(at)
        else:
            room, j = settings.max_tokens, len(sizes)
            sizes.append(0)
        microbatch_of.append(j)
        sizes[j] += 1
        room -= length
        if room < shortest or sizes[j] == cap:
            closed.append(j)
            continue
        bisect.insort(rooms, (room, j))
        if len(rooms) > _BEST_FIT_WINDOW:
            closed.append(rooms.pop(0)[1])  # the fullest
    closed += sorted(j for _, j in rooms)
    rank = np.empty(len(sizes), np.int64)  # each micro-batch's place in the plan
    rank[closed] = np.arange(len(closed))
    return np.argsort(rank[microbatch_of], kind="stable"), np.asarray(sizes, np.int64)[closed]


# The greedy rule, generalized to blocks. A block is `_Settings.unit_width` micro-batches of one size n packed
# together (a padded step input, or a batch with same_size): DeepSpeed interleaves them, row r of micro-batch b
# being position start + r x width + b; where that places fewer than min_batch_size rows, consecutive micro-batches
# are tried (`_block_rows`). Under the padded budget a micro-batch's S is the longest seqlen of its padding group
# (`_Settings.padding_group`). With width 1 a block is one micro-batch, and this is `_greedy_rows`
# (test_the_greedy_rule_is_its_generalization_to_blocks_at_width_one).


def _pack_rows(lens: np.ndarray, settings: _Settings) -> tuple[np.ndarray, list[int], int]:
    """Blocks of ``width`` micro-batches of ``n`` samples each from consecutive positions, ``n`` as large as fits.

    ``lens`` are the seqlens in picking order; ``width`` is ``unit_width``. ``n``
    is at most ``max_batch_size``; a block of fewer than ``min_batch_size`` rows
    is never placed. Returns the blocks' table (`_block_table`), the positions
    dropped as ``min_batch_size``, and where the tail starts.
    """
    values = lens.tolist()  # Python ints: the loop below reads them one at a time
    width = settings.unit_width
    total = len(values)
    cap = settings.max_batch_size or total
    starts = []
    rows = []
    consecutives = []
    too_small = []
    start = 0
    # Invariant: positions [0, start) are each in one block of the table (n >= min_batch_size rows,
    # every micro-batch within the budget) or in `too_small` (no block starts there); the blocks
    # are in position order and [start, total) is unplaced.
    while start + width <= total:
        rows_left = min((total - start) // width, cap)
        n, consecutive = _block_rows(values, start, rows_left, settings)
        if n >= settings.min_batch_size:
            starts.append(start)
            rows.append(n)
            consecutives.append(consecutive)
            start += n * width
        elif n == rows_left:  # ran out of samples, not of budget: the rest is the tail
            break
        else:
            too_small.append(start)
            start += 1
    return _block_table(starts, rows, consecutives), too_small, start


def _block_rows(
    lens: Sequence[int], start: int, rows_left: int, settings: _Settings, interleaved: int | None = None
) -> tuple[int, bool]:
    """How many rows ``n`` the block at ``start`` takes, and whether it is consecutive.

    The most interleaved rows that fit (``interleaved``, counted by `_interleaved_rows`
    unless the caller has it) where they reach ``min_batch_size`` (or all ``rows_left``);
    else the most consecutive rows that fit where they do; else the interleaved ``n``,
    too few to place.
    """
    if interleaved is None:
        interleaved = _interleaved_rows(lens, start, rows_left, settings)
    n = min(interleaved, rows_left)
    if n < settings.min_batch_size <= rows_left:
        consecutive = _consecutive_rows(lens, start, rows_left, settings)
        if consecutive is not None:
            return consecutive, True
    return n, False


def _interleaved_rows(lens: Sequence[int], start: int, rows_left: int, settings: _Settings) -> int:
    """The most rows ``n <= rows_left`` of the interleaved block at ``start`` whose micro-batches all fit.

    Row r of micro-batch b is position ``start + r*width + b`` (with ``width`` 1:
    one micro-batch, the greedy rule itself). Every micro-batch's cost grows with
    each row, so rows are added while all still fit. Under the padded budget each
    padding group of micro-batches fits iff ``n x`` its longest seqlen does.
    """
    width = settings.unit_width
    group = settings.padding_group if settings.budget == "padded" else width
    costs = [0] * width  # per micro-batch: its tokens (sum budget), or its padding group's longest seqlen
    n = 0
    while n < rows_left:
        row = lens[start + n * width : start + n * width + width]
        if settings.budget == "sum":
            grown = [cost + length for cost, length in zip(costs, row)]
            fits = max(grown) <= settings.max_tokens
        else:
            longest = [max(row[g : g + group]) for g in range(0, width, group)]
            grown = [max(cost, longest[b // group]) for b, cost in enumerate(costs)]
            fits = (n + 1) * max(grown) <= settings.max_tokens
        if not fits:
            break
        costs = grown
        n += 1
    return n


def _consecutive_rows(lens: Sequence[int], start: int, rows_left: int, settings: _Settings) -> int | None:
    """The most rows, at least ``min_batch_size``, of a consecutive block at ``start`` that fit; or None.

    The block's micro-batch b takes samples ``start + b*n .. start + b*n + n - 1``.
    Whether n rows fit is not monotone in n (each n regroups the samples): every
    n is tried, largest first, from the most that the first micro-batch allows.
    """
    width = settings.unit_width
    most = int((_prefix_costs(np.asarray(lens[start : start + rows_left]), settings) <= settings.max_tokens).sum())
    for n in range(most, settings.min_batch_size - 1, -1):
        if _microbatches_fit(np.asarray(lens[start : start + n * width]).reshape(width, n), settings):
            return n
    return None


def _microbatches_fit(block: np.ndarray, settings: _Settings) -> bool:
    """Whether every micro-batch of a consecutive ``block`` fits: ``width x n``, row b being micro-batch b."""
    if settings.budget == "sum":
        cost = block.sum(axis=1)
    else:  # n x the longest of each padding group of rows
        width, n = block.shape
        cost = np.int64(n) * block.reshape(width // settings.padding_group, -1).max(axis=1)
    return bool((cost <= settings.max_tokens).all())


def _prefix_costs(lens: np.ndarray, settings: _Settings) -> np.ndarray:
    """The cost of the first 1, 2, ... rows of ``lens`` (one sample per row) as one micro-batch."""
    if settings.budget == "sum":
        return np.cumsum(lens, axis=0)
    rows = np.arange(1, len(lens) + 1)
    longest = np.maximum.accumulate(lens, axis=0)
    return (rows if lens.ndim == 1 else rows[:, None]) * longest


def _block_table(starts: list[int], rows: list[int], consecutive: list[bool] | None = None) -> np.ndarray:
    """The packer's blocks as one int64 table: a row ``(start, n, consecutive)`` per block, in position order."""
    table = np.zeros((len(starts), 3), np.int64)
    table[:, 0] = starts
    table[:, 1] = rows
    if consecutive is not None:
        table[:, 2] = consecutive
    return table


def _positions(table: np.ndarray, width: int, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """The positions (in picking order) of the blocks' samples, micro-batch after micro-batch, and each one's size.

    Row r of micro-batch b of block ``(start, n, consecutive)`` is position
    ``start + b*n + r`` if consecutive, else (interleaved) ``start + r*width + b``:
    micro-batch b's first position, then steps of 1, or of ``width``.
    """
    sizes = np.repeat(table[:, 1], width)
    consecutive = np.repeat(table[:, 2], width) == 1
    place = np.tile(np.arange(width), len(table))  # b: each micro-batch's place in its block
    firsts = np.repeat(table[:, 0], width) + np.where(consecutive, place * sizes, place)
    steps = np.where(consecutive, 1, width)
    return _progressions(firsts, sizes, steps, dtype), sizes


def _progressions(firsts: np.ndarray, counts: np.ndarray, steps: np.ndarray, dtype: type) -> np.ndarray:
    """``first, first + step, ..., first + (count - 1) * step`` for each triple (``count`` >= 1), concatenated
    (``dtype``): the running sum of each term less the one before, made in place (one array)."""
    terms = np.repeat(steps.astype(dtype), counts)  # each term less the one before ...
    lasts = firsts + (counts - 1) * steps
    terms[_offsets(counts)[:-1]] = firsts - np.concatenate([[0], lasts[:-1]])  # ... the first: less the last one's
    return np.cumsum(terms, dtype=dtype, out=terms)


def _fill_last_batch(
    positions: np.ndarray, sizes: np.ndarray, settings: _Settings
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole batches of k micro-batches: the blocks that cannot fill a last one, re-split or given up.

    They are cut into exactly ``k / width`` blocks where they can be (see
    `_resplit`; a same-size block is a whole batch, so none is ever left).
    Returns the positions and micro-batch sizes of the batches, and the
    positions left over (the tail, also when the cut cannot be made).
    """
    width = settings.unit_width
    per_batch = settings.effective_batch_size // width  # blocks
    kept = len(sizes) - len(sizes) // width % per_batch * width  # micro-batches in whole batches
    samples = int(sizes[:kept].sum())
    if kept == len(sizes):
        return positions, sizes, positions[:0].copy()  # not a view: it would keep the positions alive
    pieces = np.split(positions[samples:], np.cumsum(sizes[kept:])[:-1])
    cut = _resplit([pieces[u : u + width] for u in range(0, len(pieces), width)], per_batch, settings.min_batch_size)
    if cut is None:
        return positions[:samples], sizes[:kept], positions[samples:].copy()
    microbatches = [mb for block in cut for mb in block]
    positions = np.concatenate([positions[:samples], *microbatches])
    sizes = np.concatenate([sizes[:kept], [len(mb) for mb in microbatches]]).astype(np.int64)
    return positions, sizes, positions[:0].copy()


def _resplit(blocks: list[list[np.ndarray]], count: int, min_bs: int) -> list[list[np.ndarray]] | None:
    """Cuts fewer than ``count`` blocks (lists of equal-size micro-batches) into exactly ``count``, or None.

    A part of a micro-batch never costs more than the whole. The block of most
    rows is cut at a multiple of ``min_bs`` near its middle: ``r`` rows make at
    most ``r // min_bs`` blocks and such a cut keeps that room, so this is None
    exactly when the sum of ``r // min_bs`` is below ``count``.
    """
    blocks = list(blocks)
    while len(blocks) < count:
        j = max(range(len(blocks)), key=lambda p: len(blocks[p][0]))
        rows = len(blocks[j][0])
        if rows < 2 * min_bs:  # the largest, so every block, is too small to cut
            return None
        cut = min_bs * (rows // min_bs // 2)
        blocks[j : j + 1] = [[mb[:cut] for mb in blocks[j]], [mb[cut:] for mb in blocks[j]]]
    return blocks


def _offsets(sizes: np.ndarray) -> np.ndarray:
    """Where each micro-batch of ``sizes`` samples starts in the plan's ids, and the end (int64, one pass)."""
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


def _reordered_batches(
    samples: np.ndarray, sizes: np.ndarray, order: np.ndarray, settings: _Settings
) -> tuple[np.ndarray, np.ndarray]:
    """Whole batches of k micro-batches, of ``sizes`` samples each, in the order ``order`` (batch indices): their
    samples (positions or ids) and their micro-batches' sizes, reordered."""
    k = settings.effective_batch_size
    batch_samples = sizes.reshape(-1, k).sum(axis=1)
    batch_starts = _offsets(batch_samples)[:-1]
    steps = np.ones(len(order), np.int64)
    moved = _progressions(batch_starts[order], batch_samples[order], steps, _index_dtype(len(samples)))
    return samples[moved], sizes.reshape(-1, k)[order].ravel()


def _plan_arrays(ids: np.ndarray, sizes: np.ndarray, lengths: np.ndarray, settings: _Settings) -> dict:
    """The `Plan`'s arrays for ``ids`` (of seqlens ``lengths``), in micro-batches of ``sizes`` samples, k to a batch.
    Padding-free, a micro-batch's padded seqlen is its step input's flat row: its tokens (its batch's longest row,
    same_length)."""
    k = settings.effective_batch_size
    group = settings.padding_group
    offsets = _offsets(sizes)
    longest = np.maximum.reduceat(lengths, offsets[:-1]).astype(np.int64)
    tokens = np.add.reduceat(lengths, offsets[:-1], dtype=lengths.dtype).astype(np.int64)  # each <= max_tokens
    widths = longest
    if settings.padding_free:
        m = settings.micro_batch_size
        widths = np.repeat(tokens.reshape(-1, m).sum(axis=1), m)
    return dict(
        sample_ids=ids,
        microbatch_offsets=offsets,
        padded_seqlens=np.repeat(widths.reshape(-1, group).max(axis=1), group).astype(np.int64),
        batch_sizes=np.diff(offsets[::k]),
        batch_tokens=tokens.reshape(-1, k).sum(axis=1),
        batch_max_seqlens=longest.reshape(-1, k).max(axis=1),
    )


def _picked(
    seqlens: np.ndarray, sample_ids: np.ndarray | None, settings: _Settings, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The packable ids in picking order and the over-long ids (see `_overlong`). The ids are int32 where every id of
    the dataset fits, as the `Plan`'s ``sample_ids`` are."""
    id_dtype = _index_dtype(len(seqlens))
    if sample_ids is None:
        ids = np.arange(len(seqlens), dtype=id_dtype)
        lengths = seqlens
    else:
        ids = sample_ids.astype(id_dtype)
        lengths = seqlens[ids]
    overlong = _overlong(lengths, ids, settings)
    if len(overlong):
        fits = lengths <= settings.max_tokens
        ids = ids[fits]
        lengths = lengths[fits]
    return _picking_order(ids, lengths, settings, rng), overlong


def _index_dtype(count: int) -> type:
    """The dtype of indices below ``count`` (ids, positions): int32 where they fit."""
    return np.int32 if count <= 2**31 else np.int64


def _overlong(lengths: np.ndarray, ids: np.ndarray, settings: _Settings) -> np.ndarray:
    """The ``ids`` (of seqlens ``lengths``) longer than ``max_tokens``, which fit no micro-batch under either budget.

    Raises:
        ValueError: there is one and ``on_overlong="error"``, or every sample is one.
    """
    overlong = ids[lengths > settings.max_tokens]
    if len(overlong) and settings.on_overlong == "error":
        raise ValueError(
            f"max_tokens={settings.max_tokens} is smaller than {_format_ids(overlong)} (longest "
            f"{int(lengths.max())}); raise max_tokens, truncate them, or pass on_overlong='skip'"
        )
    if len(overlong) and len(overlong) == len(ids):
        raise ValueError(
            f"every sample is longer than max_tokens={settings.max_tokens} "
            f"(shortest {int(lengths.min())}); raise max_tokens"
        )
    return overlong


# NOTE [the orders, as sorts]: each order is a sort of the packable samples by a key.
# - `dataloader`: the ids as given; `seqlen`: (seqlen, id).
# - `random`: (r, id), r drawn uniformly below 2**(64 - id bits) for each sample: the ids come out in a
#   uniformly random order (of N samples, about N^2 / 2^(65 - id bits) pairs draw equal r and keep their id
#   order).
# - `bucket`: (w, seqlen, r, id), from one draw per sample below W' x 2**s: its window w (the high part,
#   uniform over the W' = ceil(N / window size) windows) and tie-breaking bits r (the low s bits, what
#   64 bits leave beside window, seqlen and id), seqlen descending in odd windows. The windows come one
#   after another, each ~window size samples (binomial) drawn at random and sorted by length, odd ones
#   descending, ties in a random order (a set of one window still draws new micro-batches from its ties
#   every epoch): a micro-batch that spans two windows joins samples of like length.
# - Under best fit, `random` and `bucket` both take the `bucket` key with every window descending by the seqlen in
#   steps of max_tokens / `_BEST_FIT_STEPS` (NOTE [best fit]); `random`'s windows hold `_BEST_FIT_WINDOW` samples.
# The draws are bounded so that a key fits one 64-bit integer (NOTE [the orders, as packed keys]). The generator
# of an epoch is seeded with (seed, epoch, `_PLAN_STREAM`): numpy seeds (seed, 0) as it seeds seed alone, so
# without the third word epoch 0 would draw the very numbers of a `default_rng(seed)` that made the data's lengths
# (synthetic sets do), and sort by them. A fourth word, the attempt, draws an epoch again (NOTE [every epoch the
# same length]); attempt 0 seeds as the three words alone.
_KEY_BITS = 64
_PLAN_STREAM = 0x76617262  # b"varb": the plans' own stream of a seed


def _picking_order(ids: np.ndarray, lengths: np.ndarray, settings: _Settings, rng: np.random.Generator) -> np.ndarray:
    """``ids`` (of seqlens ``lengths``) in the order in which the packer picks them: see NOTE [the orders, as
    sorts]."""
    if settings.order == "dataloader":
        return ids
    if settings.order == "seqlen":  # ties by id, whatever the order of `ids` (as DeepSpeed's sort of (len, id))
        return _sorted_by(ids, [(lengths, _field_bits(lengths))])
    if settings.order == "random" and not settings.best_fit:
        draw_bits = _KEY_BITS - _field_bits(ids)
        return _sorted_by(ids, [(rng.integers(0, 2**draw_bits, len(ids), dtype=np.uint64), draw_bits)])
    step = max(1, settings.max_tokens // _BEST_FIT_STEPS) if settings.best_fit else None
    return _sorted_by(ids, _bucket_fields(ids, lengths, _bucket_window(lengths, settings), rng, step))


def _bucket_fields(
    ids: np.ndarray, lengths: np.ndarray, window: int, rng: np.random.Generator, best_fit_step: int | None = None
) -> list[tuple[np.ndarray, int]]:
    """The fields of the `bucket` keys of ``ids`` (of seqlens ``lengths``) before the id, as ``(values, bits)``:
    each one's window of ``window`` samples on average; its seqlen, complemented (``2**bits - 1`` less it: it sorts
    descending) in odd windows; and the bits that break ties. Best fit's: every window descending, by the seqlen in
    steps of ``best_fit_step`` tokens. Where they fit one key beside the id, they are laid side by side as one
    field, written over the draws `_CHUNK` at a time."""
    windows = max(1, math.ceil(len(ids) / window))
    window_bits = _bits(windows)
    length_bits = _field_bits(lengths)
    tie_bits = max(0, _KEY_BITS - window_bits - length_bits - _field_bits(ids))
    drawn = rng.integers(0, windows << tie_bits, len(ids), dtype=np.uint64)  # the window, then the tie bits
    one = window_bits + length_bits + _field_bits(ids) <= _KEY_BITS  # one key holds them (tie bits fill it)
    length_fields = drawn if one else np.empty_like(drawn)  # (with no tie bits, the draw is the window)
    for start in range(0, len(ids), _CHUNK):
        part = drawn[start : start + _CHUNK]
        window_of = part >> np.uint64(tie_bits)
        seqlens = lengths[start : start + _CHUNK] // (best_fit_step or 1)
        flip = (window_of & np.uint64(1)) | np.uint64(best_fit_step is not None)  # odd windows (best fit: all) ...
        field = flip * np.uint64(2**length_bits - 1)  # ... as all ones, where ...
        field ^= seqlens.astype(np.uint64)  # ... flipping every bit complements the seqlen
        if not one:
            length_fields[start : start + _CHUNK] = field
            continue
        part &= np.uint64(2**tie_bits - 1)  # the tie bits, below ...
        part |= ((window_of << np.uint64(length_bits)) | field) << np.uint64(tie_bits)  # ... the window and seqlen
    if one:
        return [(drawn, window_bits + length_bits + tie_bits)]
    return [(drawn, window_bits), (length_fields, length_bits)]


# NOTE [the orders, as packed keys]: fields of fixed widths, each below 2**width, laid side by side in one integer
# (the first field in the highest bits) compare as integers exactly as their tuples compare: the first field that
# differs decides, as it outweighs all the bits below it. The id, the last field, makes every key distinct, so one
# sort of N uint64 keys orders the tuples, and the ids come back from the keys' low bits: nothing is read in a
# random order. Sorting the fields one after another (`np.lexsort`), then reading the ids in that order, costs
# several times as much (BENCHMARKS.md); it runs only where the fields need more than 64 bits.


def _sorted_by(ids: np.ndarray, fields: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """``ids`` sorted by the tuples (*fields, id), each field a ``(values, bits)`` pair, a value below 2**bits for
    each id (NOTE [the orders, as packed keys]). The fields are taken from the list as they are packed, each let go
    once in the keys (the first one's values written over where they are uint64)."""
    id_bits = _field_bits(ids)
    if sum(bits for _, bits in fields) + id_bits > _KEY_BITS:
        return ids[np.lexsort([ids, *(values for values, _ in reversed(fields))])]
    keys = fields.pop(0)[0].astype(np.uint64, copy=False)
    fields.append((ids, id_bits))
    while fields:
        values, bits = fields.pop(0)
        keys <<= np.uint64(bits)
        keys |= values.view(f"u{values.itemsize}")  # the same bits, unsigned: no copy
    keys.sort()
    keys &= np.uint64(2**id_bits - 1)  # the ids
    return keys.astype(ids.dtype)


def _bits(bound: int) -> int:
    """The bits that hold every integer below ``bound`` (at least one)."""
    return max(1, (bound - 1).bit_length())


def _field_bits(values: np.ndarray) -> int:
    """The bits of a key's field that holds every one of ``values`` (non-negative integers)."""
    return _bits(int(values.max()) + 1 if len(values) else 1)


# The `bucket` order's window trades real tokens for fresh micro-batches, and the default is chosen for real tokens:
# padding is compute paid for on every step, where pairs of samples that share a micro-batch again next epoch cost
# little next to it. A micro-batch (or a pipeline's batch, padded to one S) takes length neighbours in its window
# and spans ~1 / (blocks per window) of its length quantiles, so the window is counted in blocks
# (`_Settings.unit_width` micro-batches, B x unit_width samples at the mean length): its fill is then about the same
# whatever N, max_tokens or mode. A set smaller than the window is sorted whole: the same micro-batches every epoch,
# as fairseq's `batch_by_size` gives. A smaller `bucket_size` buys fresh ones with padding. No planner escapes the
# trade: if a sample's B - 1 mates come from the share s of all N samples nearest its length, two that met meet
# again with probability at least (B - 1) / (s N) (Cauchy-Schwarz: uniform draws are the least), 1 / s times the
# random share, while s sets the spread of lengths a micro-batch pads. The trade measured: BENCHMARKS.md.


def _bucket_window(lengths: np.ndarray, settings: _Settings) -> int:
    """Samples per sorted window of the `bucket` order (under best fit, of both drawn orders) over the packable
    samples, of seqlens ``lengths``."""
    if settings.bucket_size is not None and settings.order == "bucket":
        return settings.bucket_size
    if settings.best_fit:
        return _BEST_FIT_WINDOW
    samples_per_block = settings.unit_width * settings.max_tokens * len(lengths) / max(int(lengths.sum()), 1)
    return max(1, math.ceil(_BUCKET_WINDOW_BLOCKS * samples_per_block))


# =============================================================================
# Every epoch the same length
# =============================================================================


# NOTE [every epoch the same length]: loops read len(loader) once (HF Trainer sizes every epoch by
# epoch 0's, Lightning keeps its first num_training_batches unless told to reload, tqdm totals,
# `len(loader) * epochs // G` schedules), so every epoch of a sampler has the same number of batches,
# C, fixed by epoch 0's packing (B0 batches), and each epoch's plan is made to have it:
# - C. The deterministic orders pack every epoch alike: C = B0. A drawn order's count is a renewal
#   count (batches fill up with tokens until the epoch's tokens are spent), so it spreads over epochs
#   by about sqrt(B0) x the coefficient of variation of a batch's tokens, here the interquartile
#   range / 1.349 over the median, which the small last batch of the leftovers does not move (its fit to
#   the measured spread: BENCHMARKS.md). C = B0 + twice that, at most B0 /
#   `_MARGIN_SHARE` (1 at least): few epochs pack longer, and the micro-batches added stay a small
#   share. C is also at most B0 + the batches of epoch 0 that can be cut, so that epoch 0 reaches C.
# - An epoch that packs B <= C batches gets its C - B batches of most samples, among those that can be
#   cut, each cut in two (`_lengthened`): `_resplit` cuts a batch's blocks into twice as many, and
#   each part of a micro-batch holds some of its rows (min_batch_size at least, max_batch_size at
#   most). A part never costs more than its micro-batch under either budget: fewer seqlens to sum;
#   fewer rows padded to at most the same S, as a block is a padding group or a run of whole ones (a
#   padded step input, or a batch with same_size) and so is each part. A same-size block's parts keep
#   one size each; no other batch moves; nothing is dropped or added: the drops are the packing's.
# - An epoch that packs more than C batches, or fewer with too few batches that can be cut, is drawn
#   again, from (seed, epoch, attempt) for attempt 1, 2, ... below `_REDRAWS` (`_pack`).
# - Under best fit (NOTE [best fit]) the micro-batches are full, so the count varies with the room the last ones
#   leave, which the batches' tokens do not show: C is also at least the most batches of `_BEST_FIT_PROBES` other
#   draws of epoch 0 (attempts 1, 2, ...), within the same bounds.
# - The last resort cannot fail: epoch 0's plan (C batches; its budgets held) with its batches in an
#   order drawn from (seed, epoch, `_REDRAWS`), and its drops (`_reshuffled`).
# Each epoch's plan thus depends only on (seqlens, settings, seed, epoch), through epoch 0's: the same
# on every rank and in any order of epochs. Epoch 0's plan is its packing with its cuts: unchanged
# where C = B0, as in every plan of a deterministic order or of given micro-batches.
_DRAWN_ORDERS = ("random", "bucket")
_MARGIN_SPREADS = 2
_MARGIN_SHARE = 400  # C - B0 <= B0 / 400: at most 0.25% more micro-batches than epoch 0 packs
_REDRAWS = 8  # the packings drawn for an epoch before the last resort
_BEST_FIT_PROBES = 2


@dataclasses.dataclass(frozen=True, eq=False)
class _Planner:
    """epoch -> `Plan` of one dataset and settings, or always one ``fixed`` plan (DeepSpeed's micro-batch lists)."""

    seqlens: np.ndarray | None
    settings: _Settings
    sample_ids: np.ndarray | None = None
    fixed: Plan | None = None

    @functools.cached_property
    def reference(self) -> Plan:
        """Epoch 0's plan, computed once: every epoch has its number of batches (the fixed plan: the plan)."""
        return self.fixed if self.fixed is not None else _reference_plan(self.seqlens, self.settings, self.sample_ids)

    def __call__(self, epoch: int) -> Plan:
        if self.fixed is not None:
            return self.fixed
        return _balanced(_equal_plan(self.seqlens, self.settings, self.sample_ids, epoch, self.reference), self.seqlens)


def _reference_plan(seqlens: np.ndarray, settings: _Settings, sample_ids: np.ndarray | None) -> Plan:
    """Epoch 0's plan, whose number of batches every epoch has (see NOTE [every epoch the same length])."""
    plan = _pack(seqlens, settings, sample_ids, 0)
    if settings.order not in _DRAWN_ORDERS or plan.num_batches == 0:
        return plan
    low, median, high = np.percentile(plan.batch_tokens, [25, 50, 75])
    spread = math.sqrt(plan.num_batches) * (high - low) / 1.349 / median  # robust to the leftovers' last batch
    margin = math.floor(_MARGIN_SPREADS * spread)
    for attempt in range(1, _BEST_FIT_PROBES + 1 if settings.best_fit else 1):
        margin = max(margin, _pack(seqlens, settings, sample_ids, 0, attempt).num_batches - plan.num_batches)
    margin = min(margin, max(1, plan.num_batches // _MARGIN_SHARE))
    return _lengthened(plan, seqlens, plan.num_batches + min(margin, int(_cuttable(plan).sum())))


def _equal_plan(
    seqlens: np.ndarray, settings: _Settings, sample_ids: np.ndarray | None, epoch: int, reference: Plan
) -> Plan:
    """The plan of ``epoch``, with as many batches as ``reference``, epoch 0's (`_reference_plan`): in a drawn
    order, `_drawn_plan` with its tail moved (NOTE [the tail moves])."""
    if settings.order not in _DRAWN_ORDERS:  # the deterministic orders pack every epoch alike
        return dataclasses.replace(reference, epoch=epoch)
    return _traded_tail(_drawn_plan(seqlens, settings, sample_ids, epoch, reference), seqlens)


def _drawn_plan(
    seqlens: np.ndarray, settings: _Settings, sample_ids: np.ndarray | None, epoch: int, reference: Plan
) -> Plan:
    """The plan of ``epoch`` in a drawn order before its tail moves: ``reference`` itself (epoch 0), or the epoch's
    packing lengthened, or one drawn again, or the last resort (see NOTE [every epoch the same length])."""
    if epoch == 0:
        return reference
    for attempt in range(_REDRAWS):
        plan = _lengthened(_pack(seqlens, settings, sample_ids, epoch, attempt), seqlens, reference.num_batches)
        if plan is not None:
            return plan
    return _reshuffled(reference, epoch)


def _lengthened(plan: Plan, seqlens: np.ndarray, batches: int) -> Plan | None:
    """``plan`` with ``batches`` batches, its fullest batches that can be cut each cut in two; None where it has
    more, or too few that can be cut (see NOTE [every epoch the same length])."""
    cuts = batches - plan.num_batches
    if cuts <= 0:
        return plan if cuts == 0 else None
    cuttable = np.flatnonzero(_cuttable(plan))
    if len(cuttable) < cuts:
        return None
    fullest = np.sort(cuttable[np.argsort(-plan.batch_sizes[cuttable], kind="stable")[:cuts]]).tolist()
    settings = plan.settings
    k, width = settings.effective_batch_size, settings.unit_width
    halves = []  # the micro-batches of the cut batches, two batches' worth each
    for b in fullest:
        microbatches = [plan.microbatch(j) for j in range(b * k, b * k + k)]
        blocks = [microbatches[u : u + width] for u in range(0, k, width)]
        halves += [mb for block in _resplit(blocks, 2 * len(blocks), settings.min_batch_size) for mb in block]
    cut = np.concatenate(halves)
    theirs = _plan_arrays(cut, np.array([len(mb) for mb in halves], np.int64), seqlens[cut], settings)
    starts = (plan.microbatch_offsets[::k], theirs["microbatch_offsets"][::k])  # where each batch's samples start
    fresh = {"sample_ids": _spliced(plan.sample_ids, cut, fullest, starts)}
    for name in ("microbatch_offsets", "padded_seqlens", "batch_sizes", "batch_tokens", "batch_max_seqlens"):
        mine, new = getattr(plan, name), theirs[name]  # a row per batch (of micro-batches: their sizes)
        if name == "microbatch_offsets":
            mine, new = np.diff(mine), np.diff(new)
        fresh[name] = _spliced(mine.reshape(plan.num_batches, -1), new.reshape(2 * cuts, -1), fullest).ravel()
    fresh["microbatch_offsets"] = _offsets(fresh["microbatch_offsets"])
    for array in fresh.values():
        array.setflags(write=False)
    return dataclasses.replace(plan, **fresh)


def _cuttable(plan: Plan) -> np.ndarray:
    """Per batch of ``plan``, whether `_resplit` cuts its blocks into twice as many (its docstring's condition)."""
    settings = plan.settings
    width = settings.unit_width
    rows = plan.microbatch_sizes()[::width].reshape(plan.num_batches, settings.effective_batch_size // width)
    return (rows // settings.min_batch_size).sum(axis=1) >= 2 * rows.shape[1]


def _spliced(mine: np.ndarray, theirs: np.ndarray, cut: list[int], bounds: tuple | None = None) -> np.ndarray:
    """``mine``'s batches (rows, or runs between ``bounds``: where each batch starts, and the end, in each array)
    with batch ``cut[i]`` replaced by ``theirs``' batches 2i and 2i + 1: one copy, whatever the arrays' size."""
    starts = (np.arange(len(mine) + 1), np.arange(len(theirs) + 1)) if bounds is None else bounds
    pieces, done = [], 0
    for i, b in enumerate(cut):
        pieces += [mine[starts[0][done] : starts[0][b]], theirs[starts[1][2 * i] : starts[1][2 * i + 2]]]
        done = b + 1
    return np.concatenate([*pieces, mine[starts[0][done] :]])


def _reshuffled(plan: Plan, epoch: int) -> Plan:
    """``plan``'s batches in an order drawn from (seed, ``epoch``, `_REDRAWS`), as the plan of ``epoch``: the last
    resort of NOTE [every epoch the same length]; its drops stay, and each batch's arrays move with it."""
    settings = plan.settings
    order = np.random.default_rng((settings.seed, epoch, _PLAN_STREAM, _REDRAWS)).permutation(plan.num_batches)
    ids, sizes = _reordered_batches(plan.sample_ids, plan.microbatch_sizes(), order, settings)
    fresh = dict(
        sample_ids=ids,
        microbatch_offsets=_offsets(sizes),
        padded_seqlens=plan.padded_seqlens.reshape(-1, settings.effective_batch_size)[order].ravel(),
        **{name: getattr(plan, name)[order] for name in ("batch_sizes", "batch_tokens", "batch_max_seqlens")},
    )
    for array in fresh.values():
        array.setflags(write=False)
    return dataclasses.replace(plan, **fresh, epoch=epoch)


def _rebuilt(plan: Plan, ids: np.ndarray, sizes: np.ndarray, seqlens: np.ndarray, **changes: Any) -> Plan:
    """``plan`` (of the ``seqlens``) made anew of the micro-batches of ``sizes`` samples of ``ids``, k to a batch,
    read-only as every plan, with ``changes`` to its other fields: each array follows from the micro-batches."""
    settings = plan.settings
    fresh = _plan_arrays(ids, sizes, _gathered(seqlens, ids, settings), settings)
    for array in fresh.values():
        array.setflags(write=False)
    return dataclasses.replace(plan, **fresh, **changes)


# =============================================================================
# The tail: other samples left over each epoch
# =============================================================================


# NOTE [the tail moves]: a packing leaves over, as `tail`, the last samples of its picking order that fill no batch
# (fewer than k where min_batch_size is 1). A drawn order is new every epoch, but its end need not be: a set of one
# `bucket` window (below the default window, a few thousand samples) is sorted by length every epoch, so its longest
# sample could be left out of every epoch and never train. So in the drawn orders each tail sample in turn trades places
# with a sample drawn uniformly, from (seed, epoch), among itself and the packed samples whose place it can take within
# the budget (their `_room`). An epoch's possible tails are then n, the sample left over and the places it can take, and
# over E epochs a sample is left over about E / n times at most, at the cost of a little padding (both measured:
# BENCHMARKS.md). The trade keeps all that NOTE [every epoch the same length] made: the micro-batches' sizes, the
# batches and their order, their number; only who sits where changes. Why not another packing: the order begun at a
# drawn place, tried first, needs more batches than epoch 0 where that packs tight (padded, one sorted window) and then
# fits no epoch, and packing without samples drawn to be left over moves every micro-batch after them, which can leave
# another tail. A plan that drops no tail is left as it is, bit for bit. The `dataloader` and `seqlen` orders promise
# one order for every epoch, so one tail: `_log_plan` says so, once, with the fixes.
_TAIL_STREAM = 0x7461696C  # b"tail": the trades' own stream of a seed


def _traded_tail(plan: Plan, seqlens: np.ndarray) -> Plan:
    """``plan`` (of the ``seqlens``) with each sample of its tail in turn traded for one drawn from (seed, epoch)
    among itself and the packed samples whose place it can take within the budget (NOTE [the tail moves])."""
    if not len(plan.dropped["tail"]):
        return plan
    settings = plan.settings
    rng = np.random.default_rng((settings.seed, plan.epoch, _TAIL_STREAM))
    ids = plan.sample_ids.copy()
    sizes = plan.microbatch_sizes()
    offsets = _offsets(sizes)
    span = settings.padding_group if settings.budget == "padded" else 1  # the micro-batches a trade changes
    room = _room(ids, sizes, seqlens, settings)
    tail = plan.dropped["tail"].copy()
    for t, sample in enumerate(tail.tolist()):
        places = np.flatnonzero(room >= seqlens[sample])
        choice = rng.integers(len(places) + 1)  # len(places): the sample itself stays left over
        if choice == len(places):
            continue
        place = places[choice]
        tail[t], ids[place] = ids[place], sample
        first = int(np.searchsorted(offsets, place, side="right")) - 1  # the place's micro-batch ...
        first -= first % span  # ... and the first of its padding group
        a, b = offsets[first], offsets[first + span]
        room[a:b] = _room(ids[a:b], sizes[first : first + span], seqlens, settings)
    tail.sort()
    tail.setflags(write=False)
    return _rebuilt(plan, ids, sizes, seqlens, dropped={**plan.dropped, "tail": tail})


def _room(ids: np.ndarray, sizes: np.ndarray, seqlens: np.ndarray, settings: _Settings) -> np.ndarray:
    """Per position of ``ids`` (whole padding groups of micro-batches of ``sizes`` samples, of the ``seqlens``), the
    longest seqlen whose sample can take the place of the one there with its micro-batch within the budget: under
    "sum", max_tokens less the others' seqlens; under "padded", its padding group's longest seqlen, or up to
    max_tokens // the group's most rows where that is more (rows x S <= max_tokens, S the group's new longest)."""
    lens = seqlens[ids].astype(np.int64)
    starts = _offsets(sizes)[:-1]
    if settings.budget == "sum":
        tokens = np.add.reduceat(lens, starts)
        return settings.max_tokens - np.repeat(tokens, sizes) + lens
    group = settings.padding_group
    longest = np.maximum.reduceat(lens, starts).reshape(-1, group).max(axis=1)
    rows = sizes.reshape(-1, group).max(axis=1)
    room = np.maximum(longest, settings.max_tokens // rows)
    return np.repeat(np.repeat(room, group), sizes)


# =============================================================================
# Balanced ranks
# =============================================================================


# NOTE [balanced ranks]: every rank waits at each gradient reduction for the slowest (ZeRO and FSDP reduce at every
# accumulation step, DDP under `no_sync` once per batch), and a token budget evens out the tokens of step inputs, not
# their cost. A step input costs, padded, n S + n S^2 / q (n samples padded to S); flat (`padding_free`, a kernel
# that skips the masked blocks), T + sum(L^2) / q (T: its row's length, sum(L) outside pipelines); q
# (`quadratic_tokens`) is the length at which a sample's attention costs as much as the rest of the model. Whole
# step inputs move (a micro-batch moved alone could break n x S <= max_tokens): the step inputs, their count and the
# epoch's length stay as packed. In each window:
# 1. Sort the step inputs by cost; each R neighbours make one accumulation step. No grouping R to a step has a
#    smaller sum of the steps' maxima: the costliest sets its step's maximum whatever joins it, and the next R - 1
#    add nothing to it there; and so on down.
# 2. Shuffle the steps and take them G to a batch: this changes neither idle share (a rank's sum over balanced
#    steps is balanced), and batches mix costs at random.
# 3. Deal the odd steps of a batch in reverse: a rank's sum over the batch (what DDP under `no_sync` waits for)
#    takes the costliest of every other step only, which halves that idle share.
# The window is the epoch (smaller windows, further apart in cost, leave the ranks idle longer); a pipeline batch's (one
# shape: `same_size`, `same_length`) is the batch, its step inputs only dealt anew; padded pipeline batches, of one
# cost, stay as they are. A q too large sorts nearly by tokens, which the budget evened out already, and costs more idle
# time than one as much too small: err low (BENCHMARKS.md). The shuffle draws from (seed, epoch, `_BALANCE_STREAM`): the
# packing's draws stay as they were.
_BALANCE_STREAM = 0x62616C61  # b"bala"


def _balanced(plan: Plan, seqlens: np.ndarray) -> Plan:
    """``plan`` (of the ``seqlens``) with its step inputs regrouped so that the R step inputs of each accumulation
    step cost nearly the same (NOTE [balanced ranks]); ``plan`` itself where balancing is off or has nothing to do
    (one rank; padded pipeline batches)."""
    settings = plan.settings
    one_shape = settings.same_size and settings.same_length and not settings.padding_free
    if not settings.balance_ranks or settings.num_replicas == 1 or one_shape or plan.num_batches == 0:
        return plan  # (an empty plan is refused by its caller, naming its counts)
    costs = _step_input_costs(plan, seqlens)
    window = len(costs)
    if settings.same_size or settings.same_length:  # a pipeline's batch keeps its step inputs
        window = settings.gradient_accumulation_steps * settings.num_replicas
    rng = np.random.default_rng((settings.seed, plan.epoch, _BALANCE_STREAM))
    return _regrouped(plan, seqlens, _balanced_order(costs, settings, window, rng))


def _step_input_costs(plan: Plan, seqlens: np.ndarray) -> np.ndarray:
    """What each step input of ``plan`` costs a forward and backward pass, in plan order (float64): padded, ``n S +
    n S^2 / q``; flat, ``T + sum(L^2) / q`` (NOTE [balanced ranks]; ``q``: ``quadratic_tokens``)."""
    settings = plan.settings
    quadratic_tokens, m = settings.quadratic_tokens, settings.micro_batch_size
    width = plan.padded_seqlens[::m].astype(np.float64)  # S, or the row's T: one for a step input's micro-batches
    if settings.padding_free:
        lengths = seqlens[plan.sample_ids].astype(np.float64)
        return width + np.add.reduceat(lengths**2, plan.microbatch_offsets[:-1:m]) / quadratic_tokens
    samples = np.diff(plan.microbatch_offsets[::m])
    return samples * width * (1 + width / quadratic_tokens)


def _balanced_order(costs: np.ndarray, settings: _Settings, window: int, rng: np.random.Generator) -> np.ndarray:
    """The step inputs (indices into ``costs``) in balanced plan order: in each window of ``window`` step inputs (a
    multiple of G x R), R cost neighbours to an accumulation step, the steps shuffled inside the window and taken G
    to a batch, the odd steps of a batch dealt in reverse (NOTE [balanced ranks], steps 1-3). By the dealing rule,
    step a of batch b is then step inputs (b G + a) R .. (b G + a) R + R - 1, one to each rank."""
    ranks = settings.num_replicas
    windows = costs.reshape(-1, window)
    by_cost = np.argsort(windows, axis=1, kind="stable")  # cheapest first; ties in plan order
    by_cost += np.arange(0, len(costs), window).reshape(-1, 1)  # indices into costs
    steps = by_cost.reshape(len(windows), -1, ranks)  # window x accumulation step x rank
    shuffle = np.argsort(rng.random(steps.shape[:2]), axis=1)  # each window's steps in a random order
    batches = np.take_along_axis(steps, shuffle[:, :, np.newaxis], axis=1)
    batches = batches.reshape(-1, settings.gradient_accumulation_steps, ranks)  # batch x accumulation step x rank
    batches[:, 1::2] = batches[:, 1::2, ::-1]
    return batches.ravel()


def _regrouped(plan: Plan, seqlens: np.ndarray, order: np.ndarray) -> Plan:
    """``plan`` with its step inputs in ``order`` (indices of step inputs), its arrays made anew from the
    ``seqlens``: the same micro-batches, each at its new place."""
    m = plan.settings.micro_batch_size
    microbatches = (order.reshape(-1, 1) * m + np.arange(m)).ravel()  # the micro-batches in their new order
    sizes = plan.microbatch_sizes()[microbatches]
    offsets = _offsets(sizes)
    # A sample's old place: its micro-batch's old start, plus its place in the micro-batch.
    old_places = np.repeat(plan.microbatch_offsets[microbatches] - offsets[:-1], sizes) + np.arange(offsets[-1])
    return _rebuilt(plan, plan.sample_ids[old_places], sizes, seqlens)


# =============================================================================
# The learning rate
# =============================================================================


# lr = lr_ref x s(B / B_ref). Linear, s(r) = r: Goyal et al. 2017, SGD with warmup.
# Square root, s(r) = sqrt(r): Krizhevsky 2014 derives it from the gradient's variance
# (and reports the linear rule working better in his runs); Hoffer et al. 2017 use it
# for SGD, Malladi et al. 2022 for Adam (also rescaling Adam's betas and epsilon). All
# compare whole runs at fixed batch sizes: scaling each step by its own batch is a
# heuristic built on them. B's unit should match the loss: tokens for a loss averaged
# over tokens (a token budget keeps it nearly constant), sequences for one over sequences.


def scale_lr(base_batch_size, batch_size, base_lr=1, method="linear"):
    """The learning rate for ``batch_size``, given ``base_lr`` tuned at ``base_batch_size`` (same unit).

    ``method``: ``"linear"`` (``lr x B/B_ref``), ``"sqrt"`` (``lr x sqrt(B/B_ref)``),
    ``"none"`` or None (``lr``), or a callable ``f(B/B_ref) -> factor``.

    Example:
        >>> scale_lr(2, 10, 1e-3), scale_lr(2, 4, 1e-3), scale_lr(4, 16, 1.0, "sqrt")
        (0.005, 0.002, 2.0)
    """
    ratio = _check_real("batch_size", batch_size, strict=False) / _check_real("base_batch_size", base_batch_size)
    if isinstance(base_lr, bool) or not isinstance(base_lr, (numbers.Real, torch.Tensor)):
        raise TypeError(f"base_lr should be a number (or a tensor), but got base_lr={base_lr!r}")
    return base_lr * _lr_factor(ratio, _check_lr_method(method))


def _lr_factor(ratio: float, method: Any) -> float:
    """The LR multiplier for a batch ``ratio`` times the reference batch."""
    if method in ("linear", "sqrt", "none", None):
        if not math.isfinite(ratio):
            raise ValueError(
                f"the batch-size ratio B / B_ref is {ratio}: B_ref is too small; set it (lr_scaling_reference, "
                f"base_batch_size) to the batch size the LR was tuned for"
            )
        if method == "linear":
            return ratio
        return math.sqrt(ratio) if method == "sqrt" else 1.0
    factor = method(ratio)
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor) or factor < 0:
        raise ValueError(
            f"lr_scaling_method={method!r} should return a finite factor >= 0, but returned {factor!r} "
            f"for the batch-size ratio {ratio}"
        )
    return float(factor)


def _lr_factors(
    sizes: np.ndarray, reference: Any, method: Any, default: float, index: int | None = None
) -> tuple[np.ndarray, float]:
    """``s(B / B_ref)`` for the batch sizes ``sizes`` (or only ``sizes[index]``), and ``B_ref``.

    The one computation of both. ``B_ref`` is ``default`` (``train_batch_size``)
    for None, the mean of ``sizes`` for ``"mean"``, else ``reference``.
    """
    if reference is None:
        b_ref = float(default)
    else:
        b_ref = float(np.mean(sizes)) if reference == "mean" else reference
    chosen = np.asarray(sizes).tolist() if index is None else [int(sizes[index])]
    return np.array([_lr_factor(b / b_ref, method) for b in chosen]), b_ref


def micro_batch_loss_weight(count, batch_count, *, num_replicas=1, gradient_accumulation_steps=1):
    """The weight of one step input's mean loss, so the batch's gradient is the gradient of the batch mean.

    Micro-batches of one batch hold different numbers of samples (or tokens):
    averaging their mean losses would weight a sample of a small micro-batch
    more. ``count / batch_count`` makes the *sum* over the batch's step inputs
    (all ranks, all accumulation steps) the batch mean; engines that *average*
    over ranks and accumulation steps (DDP, DeepSpeed) divide by ``num_replicas
    x gradient_accumulation_steps``, which the weight undoes (1 and 1 for a
    plain loop that sums ``loss.backward()`` calls). `make_dataloader` with
    ``batch_count`` yields each step input's ``batch_count`` beside it.

    Weight only a loss that is a mean over its own step input. HF Trainer
    already weights an HF model's loss: it divides each step input's loss sum
    by ``num_items_in_batch``, the label tokens of the whole batch, and undoes
    the averages, which gives the batch token mean's gradient; a weight on top
    makes it wrong. It does so for ``*ForCausalLM`` models (or
    ``model.loss_type = "ForCausalLM"``; GPT2LMHeadModel is not recognised);
    a custom model or a ``compute_loss`` returning a per-step-input mean needs
    the weight, with ``count`` the step input's label tokens (README: "Loss weighting").

    Example:
        >>> micro_batch_loss_weight(3, 12), micro_batch_loss_weight(3, 12, num_replicas=2)
        (0.25, 0.5)
    """
    batch_count, count = _check_real("batch_count", batch_count), _check_real("count", count, strict=False)
    if count > batch_count:
        raise ValueError(
            f"count should be <= batch_count (a step input is part of its batch), but got count="
            f"{count:g} and batch_count={batch_count:g}"
        )
    return (
        count
        / batch_count
        * _check_int("num_replicas", num_replicas, minimum=1)
        * _check_int("gradient_accumulation_steps", gradient_accumulation_steps, minimum=1)
    )


# =============================================================================
# The batch sampler
# =============================================================================


# The dealing rule, written once (`_dealt`): step input g of an epoch is micro-batches g*m .. g*m + m - 1 of the plan
# (m = micro_batch_size), and rank r trains step inputs r, r + R, r + 2R, ... (R ranks), its t-th being g = t*R + r.
# A batch is k = m*G*R micro-batches (G = gradient_accumulation_steps), so every rank trains G step inputs of every
# batch: its step input t is accumulation step t % G of the epoch's batch t // G. With m = 1, micro-batch j goes to
# rank j % R, as in DeepSpeed. The loader deals by this rule itself (NOTE [the loader deals itself]).


class Batch(typing.NamedTuple):
    """The batch a step input is part of: `make_dataloader` yields it beside each step input where asked.

    It travels with its step input, through loader workers, prefetchers and
    resumes, so the loop reads where it is from the data instead of counting:
    it updates after the step input whose record says ``last``, then calls
    ``scheduler.step(batch)``; it saves ``sampler.state_dict(batch)``.

    Attributes:
        index: b, the batches of the run before it: ``epoch x batches per epoch``
            + its place in its epoch (every epoch has as many batches).
        epoch: the epoch it was planned in.
        count: its count over all ranks and accumulation steps, in make_dataloader's
            ``batch_count`` unit: its mean loss's denominator (`micro_batch_loss_weight`).
        last: whether this is this rank's last step input of the batch.
        step_input: t, this rank's step input of the epoch (``0 .. len(sampler) - 1``).
    """

    index: int
    epoch: int
    count: int
    last: bool
    step_input: int


class VariableBatchSampler(Sampler[list[int]]):
    """Yields this rank's step inputs of a token-budget plan, a new plan every epoch, each of one length.

    Every rank computes the same `Plan` per epoch (see `plan_batches`): micro-
    batches of at most ``max_tokens`` tokens, ``k = micro_batch_size x
    gradient_accumulation_steps x num_replicas`` per batch. A step input is
    ``micro_batch_size`` consecutive micro-batches, yielded as its sample ids;
    rank r takes step inputs r, r + R, ... Every rank yields ``len(sampler)``,
    so no collective waits forever, in every epoch (NOTE [every epoch the
    same length]), so a loop that reads ``len()`` once is right.

    Passes are torch's: ``set_epoch(epoch)`` selects the epoch, as for
    `DistributedSampler` (call it before each epoch: without it every pass is
    of the same epoch), and every ``iter()`` is a pass over it from its start,
    independent of any other: a peek, ``list(sampler)`` or a train-set loss
    moves nothing, as nothing is tracked. A position restored by
    `load_state_dict` is taken by the next pass of its epoch, once.

    Tune ``max_tokens`` for memory (``budget="padded"``: the padded tensor's
    size, with seqlens that count what the collate adds; `make_dataloader`'s
    loader refuses a tensor over it); ``order="bucket"`` with the padded budget
    gives random batches with little padding; ``bucket_size`` trades padding
    (larger) for randomness.

    Args:
        seqlens, max_tokens: token count of every sample; budget of one micro-batch.
        micro_batch_size: micro-batches collated into one step input (DeepSpeed's
            ``train_micro_batch_size_per_gpu``, which counts micro-batches here, not
            samples: a micro-batch holds as many samples as fit ``max_tokens``).
        gradient_accumulation_steps: step inputs per rank per batch (one update).
        num_replicas, rank: data-parallel size and rank (default: torch.distributed's).
        sample_ids: the samples to use (see `plan_batches`).
        verbose: log each epoch's plan totals (rank 0).
        **options: `plan_batches`' options (``budget``, ``order``, ``seed``, ...).

    Attributes:
        epoch: the epoch the next pass iterates (``set_epoch``'s, or a restored state's).

    Example:
        >>> sampler = VariableBatchSampler([3, 5, 2, 6, 4, 1], max_tokens=8)
        >>> list(sampler), len(sampler)
        ([[0, 1], [2, 3], [4, 5]], 3)
    """

    _STATE = ("epoch", "steps_done", "rank", "settings")  # the keys of state_dict()

    def __init__(
        self,
        seqlens,
        max_tokens,
        *,
        micro_batch_size=1,
        gradient_accumulation_steps=1,
        num_replicas=None,
        rank=None,
        sample_ids=None,
        verbose=False,
        **options,
    ):
        num_replicas, rank, alone = _sampler_world(num_replicas, rank, options)
        k = (
            _check_int("micro_batch_size", micro_batch_size, minimum=1)
            * _check_int("gradient_accumulation_steps", gradient_accumulation_steps, minimum=1)
            * num_replicas
        )
        lengths = _as_counts(seqlens)
        settings = _Settings.of(
            max_tokens=max_tokens,
            effective_batch_size=k,
            micro_batch_size=micro_batch_size,
            num_replicas=num_replicas,
            **options,
        )
        ids = None if sample_ids is None else _as_sample_ids(sample_ids, len(lengths))
        self._setup(_Planner(lengths, settings, ids), rank, verbose, alone)

    @classmethod
    def _of(cls, planner: _Planner, rank: int, verbose: bool = False) -> VariableBatchSampler:
        """A sampler over ``planner``'s plans (the DeepSpeed-compatible functions make their own settings)."""
        sampler = cls.__new__(cls)
        sampler._setup(planner, rank, verbose)
        return sampler

    def _setup(self, planner: _Planner, rank: int, verbose: bool, alone: bool = False) -> None:
        settings = planner.settings
        self._planner = planner
        self.settings = settings
        self.seqlens = planner.seqlens
        self.rank = rank
        self.verbose = verbose
        self.num_replicas = settings.num_replicas
        self.micro_batch_size = settings.micro_batch_size
        self.effective_batch_size = settings.effective_batch_size
        self.gradient_accumulation_steps = settings.gradient_accumulation_steps
        self.same_length = settings.same_length
        self.epoch = 0
        # (epoch, steps_done) of load_state_dict, until a pass takes it, and the epoch selected before (see `_Pass`)
        self._restored: tuple[int, int, int] | None = None
        self._plans: dict[int, Plan] = {}
        self._logged: set[int] = set()  # the epochs whose plan was logged
        self._alone = alone  # dealt to 1 rank by default: torch.distributed was not up (see `_Pass`)
        if self.plan_for_epoch(0).num_batches == 0:  # checked before training: every epoch has its batches
            raise ValueError(_empty_plan_message(self._plans[0]))

    def plan_for_epoch(self, epoch: int) -> Plan:
        """The plan of ``epoch`` (computed once; the last three are kept)."""
        epoch = _check_int("epoch", epoch, minimum=0)
        if epoch not in self._plans:
            if len(self._plans) >= 3:
                del self._plans[min(self._plans)]
            self._plans[epoch] = self._planner(epoch)
        return self._plans[epoch]

    def _batches_per_epoch(self) -> int:
        """The batches of every epoch (see NOTE [every epoch the same length]): ``len(self)`` is G of them each."""
        return self._planner.reference.num_batches

    @property
    def plan(self) -> Plan:
        """The plan of `epoch`."""
        return self.plan_for_epoch(self.epoch)

    @property
    def steps_done(self) -> int:
        """Step inputs of `epoch` on this rank that its next pass skips: a restored position until a pass of the
        epoch takes it, else 0."""
        return self._restored_at(self.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next pass iterates (a new order in ``random``/``bucket``); nothing else moves."""
        self.epoch = _check_int("epoch", epoch)

    def __len__(self) -> int:
        """Step inputs per epoch on this rank: the same on every rank and in every epoch."""
        return self._batches_per_epoch() * self.gradient_accumulation_steps

    def horizon(self, epochs: int, unit: _Clock) -> int:
        """Real tokens (``unit="tokens"``) or samples (``"samples"``) from where the next pass starts to the end of
        ``epochs`` epochs: what is left of `epoch` after `steps_done`, plus the next ``epochs - 1`` epochs, from their
        plans. Optimizer steps need no plan: every epoch has ``len(sampler) // G``.

        Example:
            >>> VariableBatchSampler([3, 5, 2, 6, 4, 1], max_tokens=8).horizon(4, "tokens")
            84
        """
        epochs, unit = _check_int("epochs", epochs, minimum=1), _check_choice("unit", unit, _Clock)
        if unit == "steps":  # every epoch has len(sampler) // G of them: no plan is needed
            raise ValueError(
                f"horizon(unit='steps') is len(sampler) // gradient_accumulation_steps x epochs, the same in "
                f"every epoch: {len(self) // self.gradient_accumulation_steps} x {epochs}; count tokens or samples"
            )
        if unit == "tokens":
            _check_tokens_known(self, "horizon(unit='tokens')")

        def amount(plan, skip):
            return int(plan._amounts(unit)[skip:].sum())

        epoch = self.epoch
        total = amount(self.plan_for_epoch(epoch), self.steps_done // self.gradient_accumulation_steps)
        if self.settings.order in ("dataloader", "seqlen") or self._planner.fixed is not None:
            return total + (epochs - 1) * amount(self.plan_for_epoch(epoch), 0)  # one plan for every epoch
        return total + sum(amount(self._planner(e), 0) for e in range(epoch + 1, epoch + epochs))

    def __iter__(self) -> Iterator[list[int]]:
        """A pass over `epoch`: this rank's step inputs from a restored position (or the start), each as its sample
        ids; its t-th is step input g = t*R + rank (the dealing rule above)."""
        return _Pass(self)

    def state_dict(self, batch: Batch | None = None, *, steps_done: int | None = None) -> dict:
        """The position to resume from (an epoch, and this rank's step inputs of it done) and the settings, as
        plain data: where the next pass starts (`epoch` at `steps_done`), or after what the loop says it trained.

        Nothing here counts what a loop trained (loader workers read ahead of it): a loop tells it, by the `Batch`
        record of the last step input it trained (``batch``: the position after it, in its epoch), or by its count
        of the step inputs of `epoch` it trained (``steps_done``).
        """
        if batch is not None and steps_done is not None:
            raise TypeError("state_dict takes batch or steps_done, not both: the record holds its step input")
        if steps_done is not None:
            return self._state(
                self.epoch,
                _check_int("steps_done", steps_done, 0, len(self), "pass the step inputs of the epoch trained"),
            )
        if batch is None:
            return self._state(self.epoch, self.steps_done)
        if not isinstance(batch, Batch):
            raise TypeError(
                f"state_dict takes the Batch record of the last step input trained (make_dataloader(..., "
                f"batch_count=...) yields it), but got {type(batch).__name__}"
            )
        return self._state(batch.epoch, batch.step_input + 1)

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restores a `state_dict`: `epoch` is its epoch, whose next pass continues where it stopped (a state saved
        after an epoch's last step input: its empty rest, as torchdata's samplers resume)."""
        epoch, steps_done = self._position(state_dict)
        self._restored = (epoch, steps_done, self.epoch)
        self.epoch = epoch

    def _state(self, epoch: int, steps_done: int) -> dict:
        settings = self._state_settings()
        return {
            "version": __version__,
            "epoch": epoch,
            "steps_done": steps_done,
            "rank": self.rank,
            "settings": settings,
        }

    def _position(self, state_dict: Mapping) -> tuple[int, int]:
        """``(epoch, steps_done)`` of a `state_dict` of this sampler, checked."""
        _check_state(self, state_dict, set(self._STATE))
        epoch = _check_int("epoch", state_dict["epoch"], minimum=0)
        return epoch, _check_int("steps_done", state_dict["steps_done"], minimum=0, maximum=len(self))

    def _restored_at(self, epoch: int, take: bool = False) -> int:
        """Where the next pass of ``epoch`` starts: at a restored position of that epoch, else at 0; with ``take``,
        the pass that begins now takes the position (once)."""
        if self._restored is None or self._restored[0] != epoch:
            return 0
        start = self._restored[1]
        if take:
            self._restored = None
        return start

    def _undo_restore(self) -> None:
        """Drops a position `load_state_dict` restored and puts back the epoch selected before it: a pass restored
        from its own state replaces it (see `_Pass.load_state_dict`)."""
        if self._restored is not None:
            self.epoch = self._restored[2]
            self._restored = None

    def _state_settings(self) -> dict:
        """What the plans depend on besides the epoch, as plain data (the data as hashes)."""
        if "_data" not in self.__dict__:  # hashed once: StatefulDataLoader asks for the state at every batch
            fixed = self._planner.fixed
            self._data = {
                "seqlens": _digest(self.seqlens),
                "sample_ids": _digest(self._planner.sample_ids),
                "fixed_plan": fixed and fixed.fingerprint(),
            }
        return {**dataclasses.asdict(self.settings), **self._data}


# NOTE [a pass's position]: a pass's epoch is its sampler's as it is made (`iter()`, as `DistributedSampler` reads its
# epoch), and it starts at its first step input, from a position restored for that epoch or from the epoch's start:
# an iterator made and dropped unread takes nothing (torch's worker iterator makes two iterators of the sampler and
# drops the first unread: torch/utils/data/dataloader.py, its `_reset`). Its position, this rank's step inputs it
# handed out, is its own state, which torchdata's StatefulDataLoader saves as it sends each step input to a worker and
# gives back beside the step input the loop gets (its sampler-iterator protocol: `state_dict` and `load_state_dict`),
# so a loader's state is what the loop got, whatever the workers read ahead. A pass restored from its state is the whole
# position: torchdata restores a batch sampler's own state when the loader's next iterator starts, after the loop's
# set_epoch, then the state of the pass it makes, so that pass replaces the sampler's restore and puts back the epoch
# selected before it (a fresh pass after a state saved once the loop ended is of the epoch the loop set since).
_PASS_NUMBERS = itertools.count(1)  # a number per pass, by which the loader's dealing check tells passes apart


class _Pass:
    """One pass of a sampler over an epoch: this rank's step inputs (``every_rank``: every rank's, in the order g =
    0, 1, ...), each as `_item` makes it (here its sample ids); see NOTE [a pass's position]."""

    def __init__(self, sampler: VariableBatchSampler, every_rank: bool = False):
        self.sampler = sampler
        self.every_rank = every_rank
        self.epoch = sampler.epoch
        self.number = next(_PASS_NUMBERS)
        self.start: int | None = None  # this rank's first step input: its own restored one, or taken as it begins
        self.steps_done = 0  # this rank's step inputs of the epoch handed out (counted from 0), once begun
        self._items: Iterator | None = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._items is None:
            self._begin()
        return next(self._items)

    def _begin(self) -> None:
        sampler = self.sampler
        if sampler._alone and _world()[1] > 1:
            raise RuntimeError(
                f"this VariableBatchSampler was made before torch.distributed was initialized, so it "
                f"deals to 1 rank, but the job now has {_world()[1]}: every rank would train every "
                f"sample; make it after init_process_group, or pass num_replicas and rank"
            )
        if self.start is None:
            self.start = sampler._restored_at(self.epoch, take=True)
        self.steps_done = self.start
        plan = sampler.plan_for_epoch(self.epoch)
        if self.epoch not in sampler._logged and _on_rank_zero(sampler.rank):  # once per epoch, for the whole job
            sampler._logged.add(self.epoch)
            _log_plan(plan, sampler.verbose)
        self._items = self._read(plan)

    def _read(self, plan: Plan) -> Iterator:
        rank, ranks = self.sampler.rank, self.sampler.num_replicas
        for t, g, ids, lens in _dealt(self.sampler, plan, self.start, self.every_rank):
            if g % ranks == rank:
                self.steps_done = t + 1
            yield self._item(plan, t, g, ids, lens)

    def _item(self, plan: Plan, t: int, g: int, ids: list[int], lens: list[int] | None) -> Any:
        return ids

    def state_dict(self) -> dict:
        """The pass's position, in its sampler's state format: where a pass that continues it starts."""
        if self._items is not None:
            return self.sampler._state(self.epoch, self.steps_done)
        start = self.start if self.start is not None else self.sampler._restored_at(self.epoch)
        return self.sampler._state(self.epoch, start)  # not begun: where it will start

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Continues the pass of a state, in place of a position and an epoch restored into the sampler (torchdata
        restores a batch sampler's state, then its new iterator's: NOTE [a pass's position])."""
        self.epoch, self.start = self.sampler._position(state_dict)
        self.sampler._undo_restore()
        self.steps_done = self.start
        self._items = None


_KEY_RUN = 256  # step inputs (of every rank) whose ids `_dealt` reads as one list


def _dealt(
    sampler: VariableBatchSampler, plan: Plan, start: int, every_rank: bool
) -> Iterator[tuple[int, int, list[int], list[int] | None]]:
    """The dealing rule over ``plan``: this rank's step inputs t from ``start`` (with ``every_rank``, every rank's
    of each t), each as ``(t, g, sample ids, their seqlens)``. The plan is read a run of `_KEY_RUN` steps t at a time:
    a numpy call per step input would cost more than the rest of it."""
    m, ranks, rank = sampler.micro_batch_size, sampler.num_replicas, sampler.rank
    for run in range(start, len(sampler), _KEY_RUN):
        steps = range(run, min(run + _KEY_RUN, len(sampler)))
        first = steps.start * ranks  # the run's first step input g, of any rank
        offsets = plan.microbatch_offsets[first * m : steps.stop * ranks * m + 1 : m]
        run_ids = plan.sample_ids[offsets[0] : offsets[-1]]
        lens = None if sampler.seqlens is None else sampler.seqlens[run_ids].tolist()
        ids, bounds = run_ids.tolist(), (offsets - offsets[0]).tolist()
        for t in steps:
            for g in range(t * ranks, (t + 1) * ranks) if every_rank else (t * ranks + rank,):
                a, b = bounds[g - first], bounds[g - first + 1]
                yield t, g, ids[a:b], None if lens is None else lens[a:b]


def _world(group: Any = None) -> tuple[int, int]:
    """``(rank, size)`` of this process in torch.distributed (in ``group``); ``(0, 1)`` without it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    return 0, 1


def _on_rank_zero(rank: int) -> bool:
    """Whether this process reports for the job: global rank 0, or ``rank`` 0 without torch.distributed."""
    return (_world()[0] if _world()[1] > 1 else rank) == 0


# The messages of `_log_plan` on tails dropped in every epoch given in this process: each is given once (Python's
# own once-per-message registry is emptied whenever a warnings filter changes, as at every scheduler step).
_SAME_TAILS_TOLD: set[str] = set()


def _log_plan(plan: Plan, verbose: bool) -> None:
    """The drops, one warning per reason with a count and the first ids (never an unbounded line); with
    ``verbose`` the plan's totals. A tail that an order of one plan for every epoch drops in each is warned of
    once, with the settings that change it (NOTE [the tail moves])."""
    for reason in ("over_budget", "min_batch_size", "tail"):
        if len(plan.dropped[reason]):
            _logger.warning("epoch %d: dropped %s as %s", plan.epoch, _format_ids(plan.dropped[reason]), reason)
    if len(plan.dropped["tail"]) and plan.settings.order not in _DRAWN_ORDERS:
        message = _same_tail_message(plan)
        if message not in _SAME_TAILS_TOLD:
            _SAME_TAILS_TOLD.add(message)
            warnings.warn(message, stacklevel=2)
    if verbose:
        # One line of JSON with sorted keys: a log line a script parses back (json.loads) and that compares key by
        # key with another epoch's; the table for people is `python plan.py`, kept out of the vendored file.
        _logger.info("epoch %d plan totals: %s", plan.epoch, json.dumps(plan.totals(), sort_keys=True))


def _sampler_world(num_replicas: Any, rank: Any, options: dict) -> tuple[int, int, bool]:
    """A sampler's ``num_replicas`` and ``rank`` (torch.distributed's where None), checked, and whether it deals to
    1 rank by default (torch.distributed not, or not yet, up: see `_Pass`); ``options`` may not hold
    ``effective_batch_size``, which the sampler computes."""
    if "effective_batch_size" in options:
        raise TypeError(
            f"VariableBatchSampler got effective_batch_size={options['effective_batch_size']!r}, which "
            f"it computes as micro_batch_size x gradient_accumulation_steps x num_replicas; pass those"
        )
    world_rank, world_size = _world()
    alone = num_replicas is None and world_size == 1
    num_replicas = _check_int("num_replicas", world_size if num_replicas is None else num_replicas, 1)
    rank = _check_int("rank", world_rank if rank is None else rank)
    if rank >= num_replicas:
        raise ValueError(
            f"rank should be in [0, num_replicas - 1], but got rank={rank} with num_replicas={num_replicas}"
        )
    return num_replicas, rank, alone


def _check_tokens_known(sampler: VariableBatchSampler, what: str) -> None:
    """Raises when the plans have no token counts: given micro-batches come without their seqlens."""
    if sampler._planner.fixed is not None:
        raise ValueError(
            f"{what} counts tokens, but a loader over given micro-batches (dataloader_for_variable_"
            f"batch_size) has no seqlens; count sequences, or plan with get_dataloader_and_lr_"
            f"scheduler_for_variable_batch_size or make_dataloader, which have them"
        )


def _empty_plan_message(plan: Plan) -> str:
    """Why a plan has no batch, in numbers that add up, and what to change."""
    settings, counts = plan.settings, {reason: len(ids) for reason, ids in plan.dropped.items()}
    return (
        f"not enough samples for one batch in epoch {plan.epoch}: of {plan.num_dropped - counts['filtered']} samples,"
        f" {counts['over_budget']} are longer than max_tokens={settings.max_tokens}, {counts['min_batch_size']} cannot"
        f" start a micro-batch of min_batch_size={settings.min_batch_size} within it, and the other {counts['tail']}"
        f" cannot fill one batch of effective_batch_size={settings.effective_batch_size} micro-batches of at least"
        f" min_batch_size samples (at least {settings.effective_batch_size * settings.min_batch_size}); use more"
        f" data, fewer ranks or accumulation steps, or a smaller min_batch_size"
    )


def _same_tail_message(plan: Plan) -> str:
    """What a plan of one order for every epoch drops as ``tail`` in each, and the settings that change it (NOTE
    [the tail moves])."""
    settings = plan.settings
    fixes = "order='random' or 'bucket' (sequence_picking_order), which leave other samples over each epoch"
    if settings.min_batch_size > 1:
        fixes += f", or a min_batch_size below {settings.min_batch_size}, which cuts the leftover into more parts"
    return (
        f"order={settings.order!r} drops the same {_format_ids(plan.dropped['tail'])} as tail in every epoch, never"
        f" trained; use {fixes}"
    )


# =============================================================================
# The LR scheduler
# =============================================================================


class VariableBatchSizeLR(LRScheduler):
    """Scales any LR schedule by the size of each batch: ``lr = schedule(t) x s(B_b / B_ref)``.

    ``b``: the batch the next update trains, counted over the run from 0
    (skipped updates included; every epoch has one length, so b gives its
    epoch and place); ``t``: the updates taken, the wrapped schedule's steps;
    ``schedule(t)``: the wrapped scheduler's LR there (or the optimizer's
    constant LR); ``s``: the linear, square-root, none or user rule
    (`scale_lr`); ``B_b``: the size of batch b, in sequences or real tokens;
    ``B_ref``: the batch size the schedule was tuned for. The schedule is never
    restarted.

    NOTE [the contract]: the loop gives the position, as torch's schedulers are
    given theirs; nothing watches the data, the parameters or the gradients.
    After each batch's update, taken or skipped (``skipped=True``: AMP found
    inf/nan; t stays, b moves on):
    - told: ``step(batch)``, ``batch`` the `Batch` record of the batch's last
      step input: b becomes ``batch.index + 1`` at every call, so read-ahead,
      resumes and other passes cannot shift it; an untold skip or cut costs at
      most one update at a neighbouring batch's factor;
    - counted, as torch and DeepSpeed count: ``step()`` moves b on by one, and
      ``step(0)`` (DeepSpeed's idiom at an epoch's start) says that the loop cut
      the epoch: b moves to the next epoch's start. An untold skip or cut
      shifts b by one batch from there on. Trainers that skip updates without
      stepping tell it through an adapter (the DeepSpeed glue follows the
      engine's ``skipped_steps``, `hf_trainer_lr_scheduler` HF's ``global_step``).
    Before batch b's update the optimizer holds ``schedule(t) x s(B_b /
    B_ref)``: written at each step and again by an optimizer step-pre hook
    (`_param_groups`: ZeRO narrows ``optimizer.param_groups`` around its inner
    step). Refused at the call that shows it: a record that is not its batch's
    last, or whose index goes back; under an adapter whose trainer steps after
    updates only, a ``step()`` with no update since the last.

    One scheduler per optimizer: a second `VariableBatchSizeLR` on it detaches
    the first, whose next ``step()`` raises (stack schedules with one wrapper
    over ``ChainedScheduler([...])``).

    Args:
        lr_scheduler: a torch scheduler (``SequentialLR``, ``ChainedScheduler``
            too), a DeepSpeed scheduler, or an optimizer (constant LR); DeepSpeed's
            and HF Accelerate's optimizer wrappers are unwrapped.
        base_batch_size: ``B_ref``: a number, ``"mean"`` (each epoch's mean batch:
            the configured LR is the mean LR under the linear rule), or None
            (``train_batch_size``).
        batch_sizes: a `VariableBatchSampler` or a loader made with one, or a
            sequence of batch sizes (cycled, as DeepSpeed's); ``dataloader`` is
            searched for a sampler too.
        lr_scaling_method: ``"linear"``, ``"sqrt"``, ``"none"``/None or a callable.
        lr_scaling_unit: ``"sequences"`` or ``"tokens"``; clock, clock_step: see NOTE [clocks] (`_check_clock`).

    Raises:
        TypeError: a ReduceLROnPlateau (it steps on a metric, not on batches), or a VariableBatchSizeLR.
    """

    _STATE = ("last_epoch", "_step_count", "base_lrs", "_last_lr", "_unscaled", "_batches", "_seen", "_skipped_seen")

    def __init__(
        self,
        lr_scheduler,
        base_batch_size,
        batch_sizes,
        dataloader=None,
        lr_scaling_method="linear",
        last_epoch=-1,
        verbose=False,
        *,
        lr_scaling_unit="sequences",
        clock="steps",
        clock_step=1,
    ):
        self._base, optimizer = _schedule_to_wrap(lr_scheduler)
        # (`is None`, never truthiness: a sampler whose epoch is empty has len() 0)
        found = _find_sampler(batch_sizes)
        self._sampler = found if found is not None else _find_sampler(dataloader)
        self.lr_scaling_unit = _check_choice("lr_scaling_unit", lr_scaling_unit, _LRUnit)
        self.lr_scaling_method = _check_lr_method(lr_scaling_method)
        self.base_batch_size = _check_reference(base_batch_size, "base_batch_size")
        self.clock, self.clock_step = _check_clock(clock, clock_step)
        self.verbose = bool(verbose)
        resumed = _check_int("last_epoch", last_epoch, minimum=-1) != -1
        if resumed and any("initial_lr" not in group for group in optimizer.param_groups):
            raise ValueError(
                f"last_epoch={last_epoch} resumes a schedule whose param groups hold 'initial_lr', but "
                f"these do not; make it with last_epoch=-1 and resume with load_state_dict()"
            )
        self._listed = _listed_batch_sizes(batch_sizes, self)
        self._batches = 0  # b, the position (see NOTE [the contract])
        self._seen = 0  # what the clock counted: tokens or samples of the updates taken
        self._skipped, self._skipped_seen = None, 0  # an engine's count of skipped steps (_follow_skipped_steps)
        self._updates_precede_steps = False  # an adapter's trainer steps the scheduler after an update only
        self._updates_since_step = 0  # optimizer updates since the last step()
        self._just_restored = False  # restored, and no record told since
        self._reported = -1  # the last epoch whose LR factors were logged
        self._groups = list(optimizer.param_groups)  # the dicts the LRs are written into (see `_param_groups`)
        self._unscaled = [_lr_value(group["lr"]) for group in optimizer.param_groups]
        self._detached = False
        previous = _WRAPPERS.get(optimizer)
        if previous is not None and previous() is not None:
            previous()._detach()
        _WRAPPERS[optimizer] = weakref.ref(self)
        self._hooks = [
            optimizer.register_step_pre_hook(_weakly(self._before_update)),
            optimizer.register_step_post_hook(_weakly(self._after_update)),
        ]
        super().__init__(optimizer, last_epoch)  # torch's first step: the LRs of batch 0
        factors, b_ref = self._factors(0)
        if _is_unit_trap(factors.mean(), self.base_batch_size is None) and self._rank_zero():
            warnings.warn(_lr_warning(factors.mean(), b_ref, self.lr_scaling_unit), stacklevel=2)
        _warn_if_balance_swings_lr(self, factors)

    # -- the position -------------------------------------------------------------------------------------------

    @property
    def batches_trained(self) -> int:
        """``b``: the batches trained since the run began, skipped updates included (see NOTE [the contract])."""
        self._catch_up()
        return self._batches

    def _batches_per_epoch(self) -> int:
        return len(self._listed) if self._sampler is None else self._sampler._batches_per_epoch()

    def _where(self) -> tuple[int, int]:
        """``(epoch, batch)`` of batch b: every epoch has the same number of batches."""
        return divmod(self._batches, self._batches_per_epoch())

    def _sizes(self, epoch: int, unit: str | None = None) -> np.ndarray:
        if self._sampler is None:
            return self._listed
        return self._sampler.plan_for_epoch(epoch)._amounts(unit or self.lr_scaling_unit)

    def _factors(self, epoch: int, index: int | None = None) -> tuple[np.ndarray, float]:
        return _lr_factors(
            self._sizes(epoch),
            self.base_batch_size,
            self.lr_scaling_method,
            self._sampler.effective_batch_size if self._sampler is not None else 1,
            index,
        )

    def _factor(self) -> float:
        """``s(B_b / B_ref)`` of batch b, as it stands (queries bring b up to date first)."""
        epoch, batch = self._where()
        return float(self._factors(epoch, batch)[0][0])

    def _rank_zero(self) -> bool:
        return _on_rank_zero(self._sampler.rank if self._sampler is not None else 0)

    @property
    def batch_size(self) -> int:
        """``B_b``: the size of the batch trained now, in ``lr_scaling_unit``."""
        self._catch_up()
        epoch, batch = self._where()
        return int(self._sizes(epoch)[batch])

    @property
    def lr_factor(self) -> float:
        """``s(B_b / B_ref)`` of the batch trained now."""
        self._catch_up()
        return self._factor()

    @property
    def steps_in_epoch(self) -> int:
        """Batches of the current epoch trained (stepped, or skipped)."""
        self._catch_up()
        return self._where()[1]

    def get_last_lr(self):
        self._catch_up()
        return super().get_last_lr()

    def get_lr(self):
        factor = self._factor()
        return [lr * factor for lr in self._unscaled]

    def _write(self) -> None:
        """Writes ``get_lr()``, the LRs of batch b, into the optimizer; ``t`` unchanged."""
        self._last_lr = self.get_lr()
        for group, lr in zip(self._param_groups(), self._last_lr):
            _set_lr(group, lr)

    def _param_groups(self) -> list[dict]:
        """The optimizer's param-group dicts: its own list where it holds them all, else (ZeRO narrows it to the
        group it steps, around its inner step) the list as it last held them all. Never only the dicts held since
        construction: the optimizer's load_state_dict makes new ones."""
        groups = self.optimizer.param_groups
        if len(groups) == len(self._unscaled):
            self._groups = list(groups)
        return self._groups

    def _catch_up(self) -> None:
        """Brings b up to date with the steps an engine skipped since the last look (`_follow_skipped_steps`),
        writing the LRs if b moved."""
        if self._skipped is None:
            return
        count = self._skipped()
        if count > self._skipped_seen:
            self._batches += count - self._skipped_seen
            self._skipped_seen = count
            self._write()

    # -- the contract ---------------------------------------------------------------------------------------------

    def step(self, batch=None, *, skipped=False):
        """Moves on after a batch's update, or a skipped one (``skipped=True``): to the batch after ``batch``, a
        `Batch` record (told), or to the next batch (no argument: counted). ``step(0)``: the loop cut the epoch it
        trains; b moves to the next epoch's start. See NOTE [the contract].

        Raises:
            ValueError: another argument; RuntimeError: a mistake this call shows (see NOTE [the contract]).
        """
        if self._step_count == 0:  # torch's initial step, from __init__
            return super().step()
        if self._detached:
            raise RuntimeError(
                "this VariableBatchSizeLR was detached: another VariableBatchSizeLR was made on its optimizer since, "
                "and two would each scale the LR (and a second would lose the first's schedule); wrap the schedules "
                "once, as VariableBatchSizeLR(ChainedScheduler([first, second]), ...)"
            )
        if not isinstance(skipped, bool):
            raise ValueError(f"skipped should be True or False, but got skipped={skipped!r}")
        self._catch_up()
        if batch is not None and not isinstance(batch, Batch):
            return self._cut_epoch(batch)
        if batch is not None:
            self._check_told(batch)
            self._batches = batch.index
            self._just_restored = False
        elif self._updates_precede_steps and not self._updates_since_step and not skipped:
            raise RuntimeError(
                "VariableBatchSizeLR.step() was called again with no optimizer update since the last call (or since "
                "it was made or restored), but the trainer steps it after each update itself; leave the stepping to "
                "the trainer (DeepSpeed: delete your own lr_scheduler.step() after engine.step())"
            )
        epoch, index = self._where()
        if not skipped:
            size = int(self._sizes(epoch, "tokens" if self.clock == "tokens" else "sequences")[index])
            self._step_wrapped(self._clock_ticks(size))
            self._seen += size
            self._step_count += 1
            self.last_epoch += 1
        self._log_factors_once(epoch)
        self._batches += 1
        self._updates_since_step = 0
        self._write()
        if self.verbose:
            _logger.info("step %d (epoch %d, batch %d): next lr %s", self.last_epoch, epoch, index, self._last_lr)

    def _check_told(self, batch: Batch) -> None:
        """Raises where the record ``batch`` shows a mistake (NOTE [the contract]); a refused call moves nothing."""
        if not batch.last:
            gas = (
                ""
                if self._sampler is None
                else f" (gradient_accumulation_steps={self._sampler.gradient_accumulation_steps})"
            )
            raise RuntimeError(
                f"step(batch) was told batch {batch.index} at step input {batch.step_input} of epoch {batch.epoch} on "
                f"this rank, which is not the batch's last: the loop updates before the sampler's batch is trained"
                f"{gas}; update and step where batch.last is True"
            )
        if batch.index >= self._batches:
            return
        if self._just_restored:
            raise RuntimeError(
                f"step(batch) was told batch {batch.index}, but the scheduler was restored after batch "
                f"{self._batches - 1}: the sampler resumed from another point than the scheduler; save "
                f"sampler.state_dict(batch) with the scheduler's state after the same batch, and restore both"
            )
        if batch.index == self._batches - 1:
            raise RuntimeError(
                f"step(batch) was told batch {batch.index} a second time: call it once per batch, after its update"
            )
        raise RuntimeError(
            f"step(batch) was told batch {batch.index} (epoch {batch.epoch}) after batch {self._batches - 1}: the loop "
            f"trains an epoch again; call sampler.set_epoch(epoch) before each epoch"
        )

    def _cut_epoch(self, epoch: Any) -> None:
        """``step(0)``: the loop cut the epoch b is in (DeepSpeed's idiom at each epoch start, where b already is)."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch != 0:
            raise ValueError(
                f"VariableBatchSizeLR.step takes a Batch record (the batch stepped), nothing (the next batch) or 0 (the "
                f"loop cut an epoch, at the next one's start), but got {epoch!r}; call it once per batch, after its "
                f"update"
            )
        per_epoch = self._batches_per_epoch()
        self._batches = -(-self._batches // per_epoch) * per_epoch
        self._write()

    def _log_factors_once(self, epoch: int) -> None:
        """Logs the LR factors of the epoch trained, once per epoch (rank 0)."""
        if epoch == self._reported or not self._rank_zero():
            return
        self._reported = epoch
        factors, b_ref = self._factors(epoch)
        _logger.info(
            "epoch %d: LR factor mean %.3g, min %.3g, max %.3g (B_ref=%g %s)",
            epoch,
            factors.mean(),
            factors.min(),
            factors.max(),
            b_ref,
            self.lr_scaling_unit,
        )

    def _clock_ticks(self, size: int) -> int:
        """The wrapped schedule's steps for a batch of ``size`` tokens or samples (see NOTE [clocks])."""
        if self.clock == "steps":
            return 1
        return (self._seen + size) // self.clock_step - self._seen // self.clock_step

    def _step_wrapped(self, ticks: int) -> None:
        """Steps the wrapped scheduler ``ticks`` times.

        NOTE [the wrapped scheduler steps first]: the new LRs are the wrapped
        schedule's LR times the next batch's factor: so the wrapped scheduler
        steps, on its own unscaled LRs (a chainable scheduler computes from the
        LR in the optimizer), before this one writes. An exception from it
        reaches the caller and ends the training: this scheduler has not
        moved, the optimizer holds the unscaled LRs.
        """
        if self._base is None or not ticks:
            return
        groups = self._param_groups()
        for group, lr in zip(groups, self._unscaled):
            _set_lr(group, lr)
        with warnings.catch_warnings():  # torch's step-order check, which this class's own step makes
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for _ in range(ticks):
                self._base.step()
        self._unscaled = [_lr_value(group["lr"]) for group in groups]

    def _before_update(self, *hook_args) -> None:
        """An optimizer step-pre hook: the update of batch b uses its LR (b brought up to date first)."""
        self._catch_up()
        self._write()

    def _after_update(self, *hook_args) -> None:
        self._updates_since_step += 1

    def _before_forward(self, *hook_args) -> None:
        """A forward pre-hook an adapter installs (the DeepSpeed glue's): b brought up to date before the forward."""
        if not self._detached:
            self._catch_up()

    def _detach(self) -> None:
        """Removes this scheduler's hooks (a new one was made on its optimizer): it no longer moves the LRs."""
        for handle in self._hooks:
            handle.remove()
        self._detached = True

    def _follow_skipped_steps(self, skipped: Callable[[], int], updates_precede_steps: bool) -> None:
        """Takes an adapter's count of the updates a trainer skipped without stepping this scheduler (the DeepSpeed
        glue's): each moves b on, t stays. It is read whenever b is brought up to date (`_catch_up`: before each
        update and forward, at each `step`, at each query), and `state_dict` saves the last count read.
        ``updates_precede_steps``: whether the trainer steps this scheduler after an update only (NOTE [the
        contract])."""
        self._skipped, self._skipped_seen = skipped, skipped()
        self._updates_precede_steps = updates_precede_steps

    # -- state ----------------------------------------------------------------------------------------------------

    def _state_settings(self) -> dict:
        return {
            "base_batch_size": self.base_batch_size,
            "lr_scaling_unit": self.lr_scaling_unit,
            "clock": self.clock,
            "lr_scaling_method": "callable" if callable(self.lr_scaling_method) else self.lr_scaling_method,
            "clock_step": self.clock_step,
            "batch_sizes": _digest(self._listed) if self._sampler is None else None,
            "sampler": None if self._sampler is None else self._sampler._state_settings(),
        }

    def state_dict(self):
        """Torch's position and LRs, b, and the wrapped scheduler's state: plain data but for what that scheduler
        keeps (MultiStepLR's milestones are a Counter: save with torch.save, not JSON)."""
        self._catch_up()
        state = {key: copy.deepcopy(value) for key, value in super().state_dict().items() if key in self._STATE}
        return {
            "version": __version__,
            **state,
            "settings": self._state_settings(),
            "base_lr_scheduler": None if self._base is None else self._base.state_dict(),
        }

    def load_state_dict(self, state_dict):
        """Restores a `state_dict` (never mutating it): the next `step` continues exactly where it stopped.

        A state saved by another version of varbatch is refused (`_check_state`).
        """
        _check_state(self, state_dict, {*self._STATE, "settings", "base_lr_scheduler"})
        other_kind = (state_dict["base_lr_scheduler"] is None) != (self._base is None)
        if other_kind or len(state_dict["_unscaled"]) != len(self._groups):
            raise ValueError("the state wraps another kind of schedule or optimizer; resume with the same ones")
        _check_int("_batches", state_dict["_batches"], minimum=0, fix="pass a dict made by state_dict()")
        if self._base is not None:
            self._base.load_state_dict(copy.deepcopy(state_dict["base_lr_scheduler"]))
        super().load_state_dict({key: copy.deepcopy(state_dict[key]) for key in self._STATE})
        self._updates_since_step = 0
        self._just_restored = True
        self._write()


def _schedule_to_wrap(lr_scheduler: Any) -> tuple[Any, Optimizer]:
    """The scheduler a `VariableBatchSizeLR` wraps (None for an optimizer: a constant LR), and the torch optimizer."""
    if isinstance(lr_scheduler, VariableBatchSizeLR):
        raise TypeError(
            "lr_scheduler is a VariableBatchSizeLR already: wrapping it would scale the LR twice; wrap "
            "the schedule (or optimizer) it wraps"
        )
    if isinstance(lr_scheduler, ReduceLROnPlateau):
        raise TypeError(
            "ReduceLROnPlateau steps on a validation metric, not on batches, so VariableBatchSizeLR "
            "cannot wrap it; wrap a step-based schedule (LambdaLR, CosineAnnealingLR, OneCycleLR, ...) "
            "or the optimizer itself (constant LR)"
        )
    # DeepSpeed's optimizer wrappers have `step` and `optimizer` as schedulers do, but also `param_groups`.
    wraps = (
        hasattr(lr_scheduler, "step")
        and hasattr(lr_scheduler, "optimizer")
        and not hasattr(lr_scheduler, "param_groups")
    )
    given = lr_scheduler.optimizer if wraps else lr_scheduler
    return (lr_scheduler if wraps else None), _torch_optimizer(given)


def _torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch `Optimizer` inside DeepSpeed's wrappers (ZeRO stages, fp16, bf16) and HF Accelerate's.

    Accelerate's ``AcceleratedOptimizer`` (``accelerate/optimizer.py``) is an `Optimizer` in type only: it never runs
    ``Optimizer.__init__``, so it has no step hooks; the optimizer it steps is its ``.optimizer``.
    """
    for _ in range(8):
        if isinstance(optimizer, Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    raise TypeError(
        "expected a torch Optimizer, an LR scheduler, or a DeepSpeed or HF Accelerate optimizer wrapper around one"
    )


def _find_sampler(obj: Any, depth: int = 0) -> VariableBatchSampler | None:
    """The `VariableBatchSampler` behind a sampler, a loader, or a launcher's wrapper of either."""
    if isinstance(obj, VariableBatchSampler) or obj is None or depth > 4 or isinstance(obj, (str, bytes, Sequence)):
        return obj if isinstance(obj, VariableBatchSampler) else None
    for name in ("variable_batch_sampler", "batch_sampler", "sampler", "data_sampler", "base_dataloader"):
        found = _find_sampler(getattr(obj, name, None), depth + 1)
        if found is not None:
            return found
    return None


def _listed_batch_sizes(batch_sizes: Any, scheduler: VariableBatchSizeLR) -> np.ndarray | None:
    """``scheduler``'s listed batch sizes (None with a sampler); raises on its options that need the plans."""
    sampler = scheduler._sampler
    if sampler is not None:
        for name in ("lr_scaling_unit", "clock"):
            if getattr(scheduler, name) == "tokens":
                _check_tokens_known(sampler, f"{name}='tokens'")
        return None
    if isinstance(batch_sizes, (str, bytes)) or not hasattr(batch_sizes, "__len__") or not len(batch_sizes):
        raise ValueError(
            f"batch_sizes should be a VariableBatchSampler, a loader made with one, or a non-empty "
            f"sequence of batch sizes, but got batch_sizes={batch_sizes!r}"
        )
    listed = _as_counts(batch_sizes, "batch_sizes", fix="pass the size of every batch")
    for name, needs_plans in (
        ("lr_scaling_unit", scheduler.lr_scaling_unit != "sequences"),
        ("clock", scheduler.clock != "steps"),
        ("base_batch_size", scheduler.base_batch_size is None),
    ):
        if needs_plans:
            raise ValueError(
                f"{name}={getattr(scheduler, name)!r} needs the plans (their tokens and train_batch_size); pass the "
                f"VariableBatchSampler as batch_sizes, not a list"
            )
    return listed


def _check_lr_method(method: Any) -> Any:
    """A valid LR scaling method: a name of `_LRMethod`, None (no scaling) or a callable."""
    if method is None or callable(method):
        return method
    return _check_choice("lr_scaling_method", method.lower() if isinstance(method, str) else method, _LRMethod)


def _check_reference(reference: Any, name: str = "lr_scaling_reference") -> Any:
    """``B_ref`` as given: None (the default, ``train_batch_size``), ``"mean"``, or a number > 0."""
    return (
        reference
        if reference is None or (isinstance(reference, str) and reference == "mean")
        else _check_real(name, reference)
    )


def _check_clock(clock: Any, clock_step: Any, names: tuple = ("clock", "clock_step")) -> tuple[str, int]:
    """What advances the wrapped schedule (see `VariableBatchSizeLR`) and by how much, checked together.

    NOTE [clocks]: with ``clock="tokens"`` (``"samples"``) the wrapped schedule
    steps once per ``clock_step`` tokens (samples) of the updates taken, so its
    position is ``floor(seen / clock_step)``: warmup and decay land at their
    token counts whatever the batch sizes. Any step-based torch scheduler works;
    size it with ``sampler.horizon(epochs, "tokens") // clock_step``. For a
    function ``f`` of tokens: ``LambdaLR(optimizer, lambda s: f(s * clock_step))``.
    """
    clock, step = (
        _check_choice(names[0], clock, _Clock),
        _check_int(names[1], clock_step, 1, fix="the tokens (samples) per schedule step"),
    )
    if clock == "steps" and step != 1:
        raise ValueError(
            f"{names[1]}={step} counts tokens or samples, but {names[0]}='steps' steps the schedule once "
            f"per optimizer step; set {names[0]} to 'tokens' or 'samples', or {names[1]} to 1"
        )
    return clock, step


def _is_unit_trap(mean: float, default_reference: bool) -> bool:
    """Whether `_lr_warning` is due: the default ``B_ref`` (``train_batch_size``) puts the mean LR factor ``mean``
    outside [0.5, 2]. The plan command's totals ask it.

    NOTE [the unit trap]: DeepSpeed's ``B_ref`` is ``train_batch_size``, a count
    of micro-batches, against ``B`` in sequences: the LR comes out about
    ``max_tokens / mean seqlen`` times the configured one. It stays the default
    (None) for compatibility, with a warning; each trained epoch's factors are logged.
    """
    return default_reference and not 0.5 <= mean <= 2.0


def _lr_warning(mean: float, b_ref: float, unit: str) -> str:
    """What the default ``B_ref`` does to the LR, and the setting that fixes it."""
    return (
        f"the configured LR is multiplied by {mean:.3g} on average: the default B_ref=train_batch_size={b_ref:g} "
        f"counts micro-batches, B counts {unit} (about max_tokens / mean seqlen of them per micro-batch); set "
        f'lr_scaling_reference to "mean" or to the batch size (in {unit}) your LR was tuned for'
    )


def _warn_if_balance_swings_lr(scheduler: VariableBatchSizeLR, factors: np.ndarray) -> None:
    """Warns (rank 0) where balanced ranks scale the LR by each batch's sequence count, which they make swing (like
    costs, like lengths: NOTE [balanced ranks]); ``factors``: the LR factors of epoch 0."""
    sampler = scheduler._sampler
    if sampler is None or not sampler.settings.balance_ranks or sampler.num_replicas == 1:
        return
    if scheduler.lr_scaling_method in (None, "none") or scheduler.lr_scaling_unit != "sequences":
        return
    tokens = _lr_factors(scheduler._sizes(0, "tokens"), "mean", scheduler.lr_scaling_method, 1)[0]
    if scheduler._rank_zero():
        warnings.warn(
            f"balance_ranks=True groups step inputs of like cost, so a batch's sequence count swings: its LR factor "
            f"spans {factors.max() / factors.min():.3g}x in sequences, {tokens.max() / tokens.min():.3g}x in tokens;"
            f" the unit should match the loss: a loss averaged over tokens goes with lr_scaling_unit='tokens'",
            stacklevel=3,
        )


# The optimizer each VariableBatchSizeLR scales, and the last one made on it: a new one detaches the one before.
_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lr_value(lr: Any) -> Any:
    """An LR as a value of its own: a tensor LR (fused and capturable optimizers') is the optimizer's, written in
    place by the schedulers, so it is copied."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def _set_lr(group: dict, lr: Any) -> None:
    """Writes ``lr`` into a param group: in place into a tensor LR, as torch's schedulers do (the optimizer may hold
    that very tensor), else as it is."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(float(lr))
    else:
        group["lr"] = lr


def _weakly(method: Callable) -> Callable:
    """``method`` as a hook that does not keep its object alive (and does nothing once it is gone)."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        target = ref()
        return None if target is None else target(*args)

    return hook


###############################################################################
# Part II. The speed paths
###############################################################################


# One step of a plan has a speed path: the greedy rule, whose Part I loops take a Python step per sample. On epochs
# of more than `_PLAIN_UP_TO` samples `_microbatches` runs `_pack_rows_fast` instead (NOTE [one dispatch]), which
# returns what `_pack_rows` returns (and, with one micro-batch to a block, `_greedy_rows`) with a Python step per
# micro-batch: test_both_forms_of_the_greedy_rule_pack_as_the_sample_by_sample_walk,
# test_both_forms_pack_interleaved_blocks_as_the_row_by_row_check and test_the_fast_form_plans_as_the_plain_form
# compare the two, over chunks of any size.


# NOTE [the greedy rule, vectorized]: `_interleaved_rows` adds a block's rows one at a time, a Python
# step per sample. With one micro-batch per block, `_fitting_rows` finds for a whole chunk of
# positions i the samples n(i) that fit from i, in a few numpy passes, so that the Python loop of
# `_single_rows` runs once per micro-batch, not once per sample. With L the seqlens in picking
# order and e(i) = i + n(i), the first position that cannot join the micro-batch from i:
# - budget "sum": with C the running sums (C[0] = 0, C[j + 1] = C[j] + L[j]), e(i) is the last
#   e with C[e] - C[i] <= max_tokens: one searchsorted over the sorted C.
# - budget "padded" (one sample per micro-batch's S): sample j fits a micro-batch of at most
#   c_j = max_tokens // L[j] samples, so position e can join iff e - i + 1 <= c_j for every j in
#   [i, e]: e(i) = min over j >= i of max(j, i + c_j). Let d_j = j - c_j and J(i) the first j with
#   d_j >= i (every j < i has d_j < i, as c_j >= 1, so J(i) is the first j whose running max of d
#   reaches i: the count of running maxima below i, as they are sorted; len(L) where none).
#   For j in [i, J(i)), d_j < i makes max(j, i + c_j) = i + c_j; j = J(i) gives J(i) (i + c_j <= j);
#   every j > J(i) gives at least j > J(i). So e(i) = min(J(i), i + min(c[i:J(i)])): a range
#   minimum, which `_range_extrema` answers from minima over windows of 2**k.
# Both are capped at `reach`, the most samples a micro-batch can take (max_batch_size, or
# max_tokens // the shortest seqlen): c_j is clipped to it, so n(i) comes out as min(n(i), reach),
# which is what the plain loop finds (it stops at the rows left, and no micro-batch takes more than
# `reach`), and a chunk needs `reach` positions past its last one to see every micro-batch to its end.
#
# NOTE [interleaved blocks, vectorized]: an interleaved block of width w at position p puts
# sample p + r*w + b in row r of micro-batch b. Its first n rows fit iff every micro-batch's first
# n samples fit, and that is the greedy rule along strided samples:
# - budget "sum": micro-batch b fits iff the column p + b, p + b + w, ... fits as one micro-batch
#   would, so n(p) = min over b < w of g(p + b), g(q) the greedy rule along every w-th sample
#   from q (`_strided_fitting_rows`): a minimum over w consecutive g.
# - budget "padded": the padding groups split the block's columns, but every group fits (n x
#   its longest <= max_tokens) iff n x the longest of all of them does. Row r's longest is
#   M(p + r*w), M(q) = max(L[q : q + w]) (`_window_extrema`), so n(p) is the greedy rule of one
#   micro-batch along M(p), M(p + w), ...: g over the M.
# Either way whether the first n rows fit is True up to n(p), then False (every micro-batch's cost
# grows with n), so min(n(p), rows left) is what `_interleaved_rows` finds row by row (a column may
# run a sample past the block's whole rows: the min drops it). n(p) is capped at `reach` as in the
# single case, and M exists only where a whole row starts (q + w <= len(L)).


def _pack_rows_fast(lens: np.ndarray, settings: _Settings) -> tuple[np.ndarray, list[int], int]:
    """`_pack_rows`, with the interleaved rows of a chunk of positions counted at once (NOTE [interleaved blocks,
    vectorized]); with ``width`` 1, `_single_rows`."""
    width = settings.unit_width
    if width == 1:
        return _single_rows(lens, settings)
    total = len(lens)
    cap = settings.max_batch_size or total
    reach = max(1, min(cap, settings.max_tokens // int(lens.min()), total // width)) if total else 1
    starts = []
    rows = []
    consecutives = []
    too_small = []
    start = 0
    # Invariant: that of `_pack_rows`; `most` holds the interleaved rows that fit (`_interleaved_fits`) at
    # positions [first, first + count).
    while start + width <= total:
        first = start
        count = min(max(_CHUNK, reach * width), total - width + 1 - first)
        most = _interleaved_fits(lens, first, count, reach, settings)
        while start < first + count:
            rows_left = min((total - start) // width, cap)
            n, consecutive = _block_rows(lens, start, rows_left, settings, interleaved=most.item(start - first))
            if n >= settings.min_batch_size:
                starts.append(start)
                rows.append(n)
                consecutives.append(consecutive)
                start += n * width
            elif n == rows_left:  # ran out of samples, not of budget: the rest is the tail
                return _block_table(starts, rows, consecutives), too_small, start
            else:
                too_small.append(start)
                start += 1
    return _block_table(starts, rows, consecutives), too_small, start


def _single_rows(lens: np.ndarray, settings: _Settings) -> tuple[np.ndarray, list[int], int]:
    """`_greedy_rows` (`_pack_rows` with one micro-batch per block): the greedy rule for a chunk of positions at a
    time, then a walk from micro-batch to micro-batch (NOTE [the greedy rule, vectorized])."""
    total = len(lens)
    cap = settings.max_batch_size or total
    reach = min(cap, settings.max_tokens // int(lens.min()), total) if total else 1
    chunk = max(_CHUNK, reach)
    min_batch_size = settings.min_batch_size
    starts = []
    rows = []
    too_small = []
    start = 0
    # Invariant: that of `_pack_rows`; `most` holds n(i) for positions [first, first + count).
    while start < total:
        first = start
        count = min(chunk, total - first)
        most = _fitting_rows(lens[first : first + count + reach], count, reach, settings)
        while start < first + count:
            n = most.item(start - first)  # at most the rows left: min(total - start, cap)
            if n >= min_batch_size:
                starts.append(start)
                rows.append(n)
                start += n
            elif n == min(total - start, cap):  # ran out of samples, not of budget: the rest is the tail
                return _block_table(starts, rows), too_small, start
            else:
                too_small.append(start)
                start += 1
    return _block_table(starts, rows), too_small, start


def _fitting_rows(lens: np.ndarray, count: int, reach: int, settings: _Settings) -> np.ndarray:
    """For each of the first ``count`` positions of ``lens``, the most samples from it, at most ``reach``, that fit
    one micro-batch (see NOTE [the greedy rule, vectorized]; ``lens`` runs ``reach`` past them, or to the end)."""
    here = np.arange(count)
    if settings.budget == "sum":
        sums = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=sums[1:])
        ends = np.searchsorted(sums, sums[:count] + settings.max_tokens, side="right") - 1
        return np.minimum(ends - here, reach)
    most = np.minimum(settings.max_tokens // lens, reach)  # c_j, clipped
    late = np.maximum.accumulate(np.arange(len(lens)) - most)  # the running max of d_j = j - c_j
    # J(i) = #{j : late[j] < i} (late is sorted): late + 1 counted into bins 0..count, then summed up to i
    stops = np.cumsum(np.bincount(np.clip(late + 1, 0, count), minlength=count + 1))[:count]
    return np.minimum(stops, here + _range_extrema(most, here, stops)) - here


def _range_extrema(
    values: np.ndarray, starts: np.ndarray, stops: np.ndarray, extremum: np.ufunc = np.minimum
) -> np.ndarray:
    """``extremum.reduce(values[a:b])`` for each pair ``a < b`` of ``starts`` and ``stops`` (the minimum by default).

    Windows of 2**k samples cover ``[a, b)`` twice over where ``2**k <= b - a < 2**(k + 1)``: its
    extremum is that of the windows at ``a`` and at ``b - 2**k``. The extrema over windows of 2**k
    are built from those of 2**(k - 1), one level at a time, each pair answered at its level.
    """
    level = np.frexp(stops - starts)[1] - 1  # floor(log2(b - a)), exactly
    extrema = np.empty(len(starts), values.dtype)
    windows = values  # windows[a] = extremum over values[a : a + 2**k]
    for k in range(int(level.max()) + 1 if len(level) else 0):
        chosen = np.flatnonzero(level == k)
        extrema[chosen] = extremum(windows[starts[chosen]], windows[stops[chosen] - 2**k])
        windows = extremum(windows[: -(2**k)], windows[2**k :])
    return extrema


def _interleaved_fits(lens: np.ndarray, first: int, count: int, reach: int, settings: _Settings) -> np.ndarray:
    """`_interleaved_rows` at each of the positions ``first .. first + count - 1`` (each with a whole row left),
    capped at ``reach`` (see NOTE [interleaved blocks, vectorized])."""
    width = settings.unit_width
    window = lens[first : first + count + (reach + 1) * width]
    if settings.budget == "padded":
        longest = _window_extrema(window, width, np.maximum)  # M, one per whole row
        return _strided_fitting_rows(longest, count, reach, width, settings)
    columns = _strided_fitting_rows(window, min(count + width - 1, len(window)), reach, width, settings)
    return _window_extrema(columns, width, np.minimum)[:count]


def _strided_fitting_rows(values: np.ndarray, count: int, reach: int, width: int, settings: _Settings) -> np.ndarray:
    """For each of the first ``count`` positions q of ``values``, the most samples q, q + width, q + 2*width, ...,
    at most ``reach``, that fit one micro-batch (``values`` runs ``reach`` rows past them, or to the end)."""
    most = np.empty(count, np.int64)
    for offset in range(min(width, count)):
        column = values[offset::width]
        most[offset::width] = _fitting_rows(column, len(range(offset, count, width)), reach, settings)
    return most


def _window_extrema(values: np.ndarray, width: int, extremum: np.ufunc) -> np.ndarray:
    """``extremum.reduce(values[q : q + width])`` for every ``q`` with ``q + width <= len(values)``, by
    `_range_extrema`."""
    starts = np.arange(len(values) - width + 1)
    return _range_extrema(values, starts, starts + width, extremum)


###############################################################################
# Part III. Torch glue and guards
###############################################################################


# =============================================================================
# Padding and collating
# =============================================================================


# A sample is one sequence (a tensor, array or list of numbers, sequence first), a
# tuple (or list) of fields (`(label, tokens)`), or a dict (Hugging Face style): a list
# of lists is fields, so per-token features come as a tensor or array. Fields with a
# sequence dimension are padded along it; others are kept. len() means nothing here.
def _is_one_sequence(sample: Any) -> bool:
    """A tensor, an array, or a flat list of numbers (not a tuple of fields)."""
    return isinstance(sample, (torch.Tensor, np.ndarray)) or (
        isinstance(sample, (list, tuple)) and all(isinstance(x, numbers.Number) for x in sample)
    )


# NOTE [same-length lengths reach PaddedCollate]: in same-length mode the samples
# reach the collate padded to their batch's longest seqlen, so their real lengths
# can no longer be measured. A collate_fn with a `seqlens` parameter gets them as an
# argument; any other (a lambda, a partial, a class, a wrapper of a wrapper) may
# call PaddedCollate without them. So `_LoadStepInput` sets this variable to the
# plan's lengths around the collate call (in the loader's worker, in the thread
# that runs the collate), and PaddedCollate given no seqlens takes them from it.
# A context variable, not a global: each thread sees its own, and a collate run
# inside another is restored by `reset`. Unpadded samples are measured as before:
# their lengths in the tensor are what the collate made of them (BOS/EOS included).
_PADDED_SEQLENS = contextvars.ContextVar("varbatch_padded_seqlens", default=None)


class PaddedCollate:
    """Collates samples of different seqlens into ``B x S x ...`` tensors plus their real lengths.

    One-sequence samples give ``(padded, seqlens)``; tuples ``(*fields,
    seqlens)`` (sequence fields padded, scalars stacked, text kept as lists);
    dicts a dict of padded fields plus ``seqlens_key`` (None leaves it out, e.g.
    for ``model(**batch)``). ``seqlens`` (``B``, int64) are the lengths
    `make_dataloader` passes (the plan's, also for samples padded to their
    batch's S in same-length mode), else the first sequence field's. Called
    without ``seqlens`` inside varbatch's loader in same-length mode, by any
    collate_fn, it takes the plan's (see NOTE [same-length lengths reach
    PaddedCollate]) and refuses another number of samples than the step input's.

    Example:
        >>> x, lens = PaddedCollate()([torch.ones(2, 4), torch.ones(3, 4)])
        >>> tuple(x.shape), lens.tolist()
        ((2, 3, 4), [2, 3])
    """

    def __init__(self, pad_value=0, seqlens_key="seqlens"):
        self.pad_value = pad_value
        self.seqlens_key = seqlens_key

    def __call__(self, samples, seqlens=None):
        if len(samples) == 0:
            raise ValueError("PaddedCollate got an empty list of samples")
        columns = _columns(samples, "PaddedCollate")
        out = _collated(columns, self.pad_value)
        if seqlens is None:
            seqlens = self._lengths(columns, len(samples))
        if len(seqlens) != len(samples):
            raise ValueError(f"PaddedCollate got {len(seqlens)} seqlens for {len(samples)} samples")
        lengths = torch.as_tensor(list(seqlens), dtype=torch.int64)
        if not isinstance(samples[0], Mapping):
            return _PaddedBatch((*out, lengths))
        batch = {key: tensor for (key, *_), tensor in zip(columns, out)}
        return {**batch, self.seqlens_key: lengths} if self.seqlens_key is not None else batch

    @staticmethod
    def _lengths(columns: list, count: int) -> list[int]:
        """The plan's lengths of ``count`` samples varbatch padded, else the first sequence field's, measured."""
        planned = _PADDED_SEQLENS.get()
        if planned is not None:
            if len(planned) != count:
                raise ValueError(
                    f"PaddedCollate got {count} samples in same-length mode, where they arrive padded to their "
                    f"batch's longest seqlen, but the step input has {len(planned)}: it cannot tell their real "
                    f"lengths; pass seqlens= (a collate_fn with a seqlens parameter gets the step input's)"
                )
            return list(planned)
        first = next(_sequence_columns(columns), None)
        if first is None:
            raise ValueError("PaddedCollate found no field with a sequence dimension; pass seqlens")
        return [len(tensor) for tensor in first[1]]

    def __repr__(self):
        return f"PaddedCollate(pad_value={self.pad_value!r}, seqlens_key={self.seqlens_key!r})"


def _columns(samples: list, collate: str) -> list[tuple[Any, list, list]]:
    """``(key, values, tensors)`` per field: one value per sample (dicts list theirs in any order), and the values
    as tensors (None for a value that is not numeric); the same fields in all."""
    if isinstance(samples[0], torch.Tensor):  # the common case, kept cheap: no look at every sample
        return [(None, samples, samples)]
    rows = [dict(_fields(sample)) for sample in samples]
    odd = next((i for i, row in enumerate(rows) if row.keys() != rows[0].keys()), None)
    if odd is not None:
        raise ValueError(
            f"{collate} needs samples with the same fields, but sample 0 has fields "
            f"{list(rows[0])} and sample {odd} has {list(rows[odd])}"
        )
    columns = []
    for key in rows[0]:
        values = [row[key] for row in rows]
        columns.append((key, values, [_as_tensor(value) for value in values]))
    return columns


def _sequence_columns(columns: list) -> Iterator[tuple[Any, list]]:
    """``(key, tensors)`` of each field (`_columns`) with a sequence dimension: numeric, and not one number a sample."""
    for key, _, column in columns:
        if not any(t is None or t.dim() == 0 for t in column):
            yield key, column


def _collated(columns: list, pad_value: Any, flat_pad: int | None = None) -> list:
    """Each field of the samples (`_columns`) collated: text kept as a list, numbers stacked (``B``), sequences
    padded to the longest with the field's ``pad_value`` (``B x S x ...``), or with ``flat_pad`` concatenated into
    one row that ends in that many padding tokens (``1 x T x ...``)."""
    out = []
    for key, values, column in columns:
        value = _field_pad_value(pad_value, key)
        if any(t is None for t in column):  # not numeric (text): kept as a list
            out.append(values)
        elif column[0].dim() == 0:
            out.append(torch.stack(column))
        elif flat_pad is None:
            out.append(torch.nn.utils.rnn.pad_sequence(column, batch_first=True, padding_value=value))
        else:
            padding = column[0].new_full((flat_pad, *column[0].shape[1:]), value)
            out.append(torch.cat([*column, padding])[None])
    return out


class _PaddedBatch(tuple):
    """`PaddedCollate`'s ``(*fields, seqlens)``: its type tells `seqlens_from_padded` what the last item is."""

    __slots__ = ()


def seqlens_from_padded(batch, pad_value=0, seqlens_key="seqlens"):
    """The real length of every sample of a collated batch (a ``batch_seqlens_fn``).

    `PaddedCollate`'s lengths are recognised by its output's type (tuples) or
    the ``seqlens_key`` key (dicts: pass PaddedCollate's own, e.g. with
    ``functools.partial``); a dict's ``attention_mask`` gives its row
    sums. Anything else is measured on its first tensor (a tuple's first item,
    a dict's first field), ``B x S x ...``: a sample runs to its last position
    holding a value other than ``pad_value``.

    Example:
        >>> seqlens_from_padded(torch.tensor([[5, 6, 0], [7, 0, 0]]))
        [2, 1]
    """
    if isinstance(batch, _PaddedBatch):
        return [int(x) for x in batch[-1]]
    if isinstance(batch, Mapping) and batch.get(seqlens_key) is not None:
        return [int(x) for x in batch[seqlens_key]]
    if isinstance(batch, Mapping) and "attention_mask" in batch:
        return [int(x) for x in torch.as_tensor(batch["attention_mask"]).sum(dim=1)]
    batch = next(iter(batch.values())) if isinstance(batch, Mapping) else batch
    while isinstance(batch, (tuple, list)) and len(batch) and not _is_one_sequence(batch):
        batch = batch[0]
    tensor = torch.as_tensor(batch)
    if tensor.dim() < 2:
        raise ValueError(
            f"seqlens_from_padded needs a collated B x S (x ...) batch, but got shape {tuple(tensor.shape)}"
            f"; collate the samples first (e.g. with varbatch.PaddedCollate())"
        )
    real = (tensor != pad_value).reshape(tensor.shape[0], tensor.shape[1], -1).any(dim=2)  # B x S
    return [int(x) for x in (real * torch.arange(1, tensor.shape[1] + 1)).max(dim=1).values]


def _padded_tensor(batch: Any, depth: int = 0) -> torch.Tensor | None:
    """The ``B x S (x ...)`` tensor of a collated step input, or None where none is seen.

    The batch itself; a dict's ``input_ids``, else its first field with a
    sequence dimension; a tuple's first (PaddedCollate's output, ``(x, lengths)``),
    two levels deep. Fields only, never the samples: lists are not looked into.
    """
    if isinstance(batch, torch.Tensor):
        return batch if batch.dim() > 1 else None
    if depth == 2:
        return None
    if isinstance(batch, Mapping):
        fields = [batch["input_ids"]] if isinstance(batch.get("input_ids"), torch.Tensor) else batch.values()
    elif isinstance(batch, tuple):
        fields = batch
    else:
        return None
    return next((t for t in (_padded_tensor(field, depth + 1) for field in fields) if t is not None), None)


def pad_sample(sample, length, pad_value=0, fields=None):
    """Pads a sample to ``length`` along its sequence (first) dimension: the default ``sample_padding_fn``.

    ``sample``: one sequence (tensor, array, list of numbers), a tuple of
    fields, or a dict of fields; ``pad_value``: a number, or a dict field ->
    number (``{"labels": -100}``; others get 0); ``fields``: the dict keys or
    tuple positions to pad (default: every field with a sequence dimension).
    Returns the sample in its own structure, padded fields as tensors. Picklable.

    Example:
        >>> pad_sample(torch.ones(2, 3), 4).shape, pad_sample({"ids": [5, 6], "label": 1}, 3)
        (torch.Size([4, 3]), {'ids': tensor([5, 6, 0]), 'label': 1})
    """
    length = _check_int("length", length)
    padded, chosen = [], []
    for key, value in _fields(sample):
        tensor = _as_tensor(value)
        chosen.append(key is None or (tensor is not None and tensor.dim() > 0 if fields is None else key in fields))
        padded.append(_pad_field(value, length, pad_value, key) if chosen[-1] else value)
    if not any(chosen):
        raise ValueError(
            f"pad_sample found no field to pad in a {type(sample).__name__} sample (fields="
            f"{fields!r}): it pads numeric fields with a sequence dimension; name them with fields=..., "
            f"or pass your own sample_padding_fn (e.g. one that pads text)"
        )
    if isinstance(sample, Mapping):
        return dict(zip(sample, padded))
    if _fields(sample)[0][0] is None:
        return padded[0]
    return type(sample)(*padded) if hasattr(sample, "_fields") else type(sample)(padded)  # namedtuples too


def _pad_field(value: Any, length: int, pad_value: Any, key: Any) -> torch.Tensor:
    """One field padded along its first dimension to ``length``."""
    tensor = _as_tensor(value)
    where = "" if key is None else f" (field {key!r})"
    if tensor is None or tensor.dim() == 0:
        raise ValueError(
            f"cannot pad {type(value).__name__}{where} to length={length}: it has no sequence dimension; "
            f"name the fields to pad with fields=..., or pass your own sample_padding_fn"
        )
    if tensor.shape[0] > length:
        raise ValueError(
            f"cannot pad a sample{where} of seqlen {tensor.shape[0]} to length={length}: the planned length "
            f"is shorter than the sample; the seqlens given to varbatch do not match the dataset"
        )
    value = _field_pad_value(pad_value, key)
    return torch.cat([tensor, tensor.new_full((length - tensor.shape[0], *tensor.shape[1:]), value)])


def _field_pad_value(pad_value: Any, key: Any) -> Any:
    """The padding value of the field ``key``: ``pad_value``, or, where it is a dict, the field's (0 if it names
    none)."""
    return pad_value.get(key, 0) if isinstance(pad_value, Mapping) else pad_value


def _fields(sample: Any) -> list[tuple[Any, Any]]:
    """``(key, value)`` per field: dict keys, tuple positions, or ``(None, sample)`` for one sequence."""
    if isinstance(sample, Mapping):
        return list(sample.items())
    if _is_one_sequence(sample) or not isinstance(sample, (tuple, list)):
        return [(None, sample)]
    return list(enumerate(sample))


def _as_tensor(value: Any) -> torch.Tensor | None:
    """``value`` as a tensor, or None for what is not numeric (text, None)."""
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None


# =============================================================================
# Padding-free step inputs
# =============================================================================


# NOTE [the flat row]: transformers finds the samples of a row from `position_ids`
# only when `attention_mask` is None and no cache is made (transformers/masking_utils.py,
# its packed-sequence detection), so an HF row keeps no `attention_mask` (a mask of ones
# turns the detection off) and no `seqlens` (`model(**batch)` would refuse it); each
# sample's first label is `separator_id`, so that no sample's last token learns to predict
# the next sample's first. In a pipeline the loader sets `_FLAT_ROW` to the batch's longest
# row (as `_PADDED_SEQLENS`): the row ends in a padding segment of its own (positions from
# 0, labels `separator_id`), so the stages pass tensors of one shape and read every mask
# from `position_ids`; `cu_seqlens`, whose length changes with the samples, need not cross.
_FLAT_ROW = contextvars.ContextVar("varbatch_flat_row", default=0)


class FlatCollate:
    """Collates the samples of a step input into one flat row, positions restarting at each: no padding.

    Dict samples with ``input_ids`` give what ``transformers.DataCollatorWithFlattening`` gives, under its
    argument names: ``1 x T`` int64 ``input_ids``, ``labels`` (the sample's own, else its ``input_ids``) and
    ``position_ids``; on request ``cu_seq_lens_q/k`` (int32), ``max_length_q/k`` (ints) and ``seq_idx``; no
    ``attention_mask``. Other samples keep `PaddedCollate`'s structure, sequence fields concatenated into ``1 x
    T x ...``, with ``cu_seqlens`` (int32, ``n + 1`` offsets), ``max_seqlen`` (an int) and ``position_ids`` (``1
    x T``) for its ``seqlens``. A sample longer than its planned seqlen (``seqlens``) is refused: it could break
    its row's bound. ``pad_value`` (a number, or a field -> number dict) fills a pipeline row's padding segment
    (see NOTE [the flat row]). As HF's collators, it takes ``return_tensors`` (keyword-only, at construction and at
    call; ``"pt"``, the one kind it returns) and, at call, ``separator_id`` (keyword-only); ``seqlens`` stays the
    call's second parameter.

    Example:
        >>> FlatCollate()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])["position_ids"]
        tensor([[0, 1, 2, 0, 1]])
        >>> x, cu_seqlens, max_seqlen, position_ids = FlatCollate()([torch.ones(3, 4), torch.ones(2, 4)])
        >>> tuple(x.shape), cu_seqlens.tolist(), max_seqlen
        ((1, 5, 4), [0, 3, 5], 3)
    """

    def __init__(
        self,
        return_position_ids=True,
        separator_id=-100,
        return_flash_attn_kwargs=False,
        return_seq_idx=False,
        position_ids_start=0,
        pad_value=0,
        *,
        return_tensors="pt",
    ):
        self.return_position_ids = return_position_ids
        self.return_flash_attn_kwargs = return_flash_attn_kwargs
        self.return_seq_idx = return_seq_idx
        self.pad_value = pad_value
        for name in ("return_position_ids", "return_flash_attn_kwargs", "return_seq_idx"):
            value = getattr(self, name)
            if isinstance(value, bool):
                continue
            hint = ""
            if isinstance(value, str):  # HF's collators take return_tensors first: FlatCollate("pt")
                hint = "; pass return_tensors by keyword: FlatCollate(return_tensors='pt')"
            raise TypeError(f"{name} should be a bool, but got {name}={value!r}{hint}")
        self.separator_id = _check_separator_id(separator_id)
        self.position_ids_start = _check_int("position_ids_start", position_ids_start)
        self.return_tensors = _check_return_tensors(return_tensors)

    def __call__(self, samples, seqlens=None, *, return_tensors=None, separator_id=None):
        """Collates ``samples`` into one flat row.

        Args:
            samples: the samples of a step input.
            seqlens: their planned seqlens (`make_dataloader` passes them), each a bound on its sample's length.
            return_tensors: ``"pt"``, or None for the construction's (HF's collators take it here too).
            separator_id: each sample's first label and the labels of a pipeline row's padding, or None for the
                construction's.
        """
        if isinstance(seqlens, (str, bytes)):  # HF's collators take return_tensors second: collate(samples, "pt")
            raise TypeError(
                f"seqlens should be the samples' planned seqlens (a sequence of ints) or None, but got "
                f"seqlens={seqlens!r}; pass return_tensors by keyword: collate(samples, return_tensors={seqlens!r})"
            )
        if return_tensors is not None:
            _check_return_tensors(return_tensors)
        if separator_id is None:
            separator_id = self.separator_id
        else:
            separator_id = _check_separator_id(separator_id)
        if len(samples) == 0:
            raise ValueError("FlatCollate got an empty list of samples")
        if isinstance(samples[0], Mapping) and "input_ids" in samples[0]:
            return self._hf_row(samples, seqlens, separator_id)
        return self._fields_row(samples, seqlens)

    def _fields_row(self, samples: list, seqlens: Any) -> Any:
        """PaddedCollate's structure (a tuple, or a dict of the samples' fields) as ``1 x T`` rows, and the flat
        attention's ``cu_seqlens``, ``max_seqlen`` and ``position_ids``."""
        columns = _columns(samples, "FlatCollate")
        lengths = _sequence_lengths(columns)
        pad = self._padding(lengths, seqlens)
        out = _collated(columns, self.pad_value, flat_pad=pad)
        cu_seqlens = _cu_seqlens(lengths, pad)
        flat = (cu_seqlens, int(cu_seqlens.diff().max()), self._positions(cu_seqlens))  # 1 x T x ..., n + 1, 1 x T
        if not isinstance(samples[0], Mapping):
            return (*out, *flat)
        return {**{key: field for (key, *_), field in zip(columns, out)}, **dict(zip(_FLAT_KEYS, flat))}

    def _hf_row(self, samples: list, seqlens: Any, separator_id: int) -> dict:
        """`DataCollatorWithFlattening`'s keys, dtypes and values for HF-style samples (and a padding segment).

        Where HF's collator goes on with samples it cannot align (it drops an
        empty sample, takes labels from all samples or none as the first sample
        has them, and shifts every later label by a sample whose labels are
        shorter than its input_ids), these are refused: each would silently
        train other tokens than the user meant.
        """
        labelled = ["labels" in sample for sample in samples]
        if not all(labelled) and any(labelled):
            raise ValueError(
                f"FlatCollate needs labels in every sample of a step input or in none, but samples "
                f"{[i for i, x in enumerate(labelled) if x]} of {len(samples)} have them; give every sample labels"
            )
        ids = [_token_ids(sample, "input_ids") for sample in samples]
        labels = [_token_ids(sample, "labels" if labelled[0] else "input_ids").clone() for sample in samples]
        odd = next((i for i, (x, y) in enumerate(zip(ids, labels)) if len(x) != len(y)), None)
        if odd is not None:
            raise ValueError(
                f"FlatCollate needs one label per token, but sample {odd} of the step input has {len(labels[odd])} "
                f"labels for {len(ids[odd])} input_ids; give it one label per token (-100 where none is learned)"
            )
        pad = self._padding([len(x) for x in ids], seqlens)
        for sample_labels in labels:
            sample_labels[0] = separator_id
        cu_seqlens = _cu_seqlens([len(x) for x in ids], pad)
        batch = {  # 1 x T
            "input_ids": torch.cat([*ids, torch.zeros(pad, dtype=torch.int64)])[None],
            "labels": torch.cat([*labels, torch.full((pad,), separator_id)])[None],
        }
        if self.return_position_ids:
            batch["position_ids"] = self._positions(cu_seqlens)
        if self.return_seq_idx:
            sizes = cu_seqlens.diff()
            batch["seq_idx"] = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), sizes)[None]
        if self.return_flash_attn_kwargs:
            longest = int(cu_seqlens.diff().max())
            batch.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens.clone())
            batch.update(max_length_q=longest, max_length_k=longest)
        return batch

    @staticmethod
    def _padding(lengths: list[int], seqlens: Any) -> int:
        """The tokens of the row's padding segment (a pipeline's, up to `_FLAT_ROW`), after checking the seqlens."""
        if 0 in lengths:
            raise ValueError(
                f"sample {lengths.index(0)} of the step input is empty, but varbatch plans seqlens >= 1 (HF's "
                f"collator drops such a sample); leave empty samples out of the dataset, or give them tokens"
            )
        planned = seqlens if seqlens is not None else [math.inf] * len(lengths)
        longer = [i for i, (length, bound) in enumerate(zip(lengths, planned)) if length > bound]
        if len(planned) != len(lengths) or longer:
            raise ValueError(
                f"FlatCollate got samples of seqlens {lengths} for planned seqlens {list(planned)}: a sample "
                f"longer than planned could break its row's bound; give varbatch the seqlens of this dataset"
            )
        row = _FLAT_ROW.get()
        if row and sum(lengths) > row:
            raise ValueError(f"FlatCollate got {sum(lengths)} tokens for a pipeline row of {row}")
        return max(0, row - sum(lengths))

    def _positions(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``1 x T`` int64 positions, restarting at ``position_ids_start`` at every segment."""
        sizes = cu_seqlens.diff().to(torch.int64)
        starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), sizes)
        return (torch.arange(int(cu_seqlens[-1])) - starts + self.position_ids_start)[None]


_FLAT_KEYS = ("cu_seqlens", "max_seqlen", "position_ids")  # what a dict sample's row has for `seqlens`


def _check_return_tensors(return_tensors: Any) -> str:
    """``"pt"``, the one kind of tensors `FlatCollate` returns; else raises naming the value."""
    if not (isinstance(return_tensors, str) and return_tensors == "pt"):
        raise ValueError(
            f"FlatCollate returns torch tensors only (return_tensors='pt'), but got return_tensors="
            f"{return_tensors!r}; pass return_tensors='pt' or leave it out"
        )
    return return_tensors


def _check_separator_id(separator_id: Any) -> int:
    """A label id: any int64 (HF's collator's default, -100, is the loss's ignore index)."""
    return _check_int("separator_id", separator_id, -(2**63), 2**63 - 1)


def _sequence_lengths(columns: list) -> list[int]:
    """The samples' lengths: those of every field (`_columns`) with a sequence dimension, which must agree."""
    lengths = None
    for key, column in _sequence_columns(columns):
        if lengths is not None and [len(t) for t in column] != lengths:
            raise ValueError(f"FlatCollate got samples whose field {key!r} has other seqlens than their first")
        lengths = [len(t) for t in column]
    if lengths is None:
        raise ValueError("FlatCollate found no field with a sequence dimension; give each sample a tensor field")
    return lengths


def _token_ids(sample: Mapping, key: str) -> torch.Tensor:
    """A sample's ``input_ids`` or ``labels`` as a 1-D int64 tensor."""
    tensor = _as_tensor(sample[key])
    if tensor is None or tensor.dim() != 1:
        raise ValueError(f"FlatCollate needs {key} of one id per token, but got {sample[key]!r:.60}")
    return tensor.to(torch.int64)


def _cu_seqlens(lengths: list[int], pad: int = 0) -> torch.Tensor:
    """int32 offsets of the samples in the row, ``[0, L_0, L_0 + L_1, ...]``, and of a padding segment of ``pad``."""
    sizes = torch.as_tensor([*lengths, pad] if pad else lengths, dtype=torch.int64)
    return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).to(torch.int32)


# The largest difference allowed between a sample's outputs in a flat row and alone, relative to the largest output:
# a few hundred units in the last place (matmuls of other shapes sum in another order). Samples that attend to each
# other move outputs by percents.
_CHECK_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


# NOTE [checking padding-free on the model itself]: when the samples of a flat row
# attend to each other, the loss stays within a fraction of a percent while the
# gradients are far off (a tiny Llama: 0.13% and 98%), and nothing in the row shows
# it: transformers decides in the forward call (NOTE [the flat row]), and an HF model
# makes a cache whenever `config.use_cache` is True (`LlamaConfig`'s default), in
# training mode too. So the check runs the model, once, on the plain model: under
# ZeRO-3 a forward pass on one rank waits for the others, and a PipelineModule's
# stages live on other ranks.
def check_padding_free(model, samples, collate_fn=None, rtol=None):
    """Refuses a model and collate under which the samples of a flat step input attend to each other.

    Runs ``model`` (an HF model, as ``model(**batch)``, or any callable from a collated batch to per-token
    outputs, ``T x ...`` or ``1 x T x ...``) on ``collate_fn(samples)`` (default `FlatCollate`) and on each of
    at least two ``samples`` alone, in eval mode (every module's mode restored after) under ``torch.no_grad()``,
    and raises a ValueError naming the fix where a sample's outputs differ by more than ``rtol`` (by dtype:
    1e-4 in float32) times the largest; TypeError for a DeepSpeed engine, a PipelineModule or ZeRO-3's
    parameters. Returns the largest difference. Run it once before training, before ``deepspeed.initialize``.

    Example:
        >>> dense = torch.nn.Linear(4, 3)
        >>> check_padding_free(lambda batch: dense(batch[0]), [torch.ones(2, 4), torch.ones(3, 4)])
        0.0
    """
    if isinstance(model, torch.nn.Module) and (
        type(model).__name__ in ("PipelineModule", "DeepSpeedEngine", "PipelineEngine")
        or any(hasattr(parameter, "ds_id") for parameter in model.parameters())
    ):
        raise TypeError(
            f"check_padding_free runs the whole model on one rank, which a {type(model).__name__} (or a model under "
            f"ZeRO-3) cannot; run it on the plain model (a pipeline's layers as torch.nn.Sequential) before "
            f"deepspeed.initialize"
        )
    collate_fn = FlatCollate() if collate_fn is None else collate_fn
    samples = list(samples)
    if len(samples) < 2:
        raise ValueError(f"check_padding_free needs at least 2 samples, but got {len(samples)}")
    modes = [(module, module.training) for module in model.modules()] if isinstance(model, torch.nn.Module) else []
    try:
        for module, _ in modes:
            module.training = False
        with torch.no_grad():
            row = _output(model, collate_fn(samples))
            alone = [_output(model, collate_fn([sample])) for sample in samples]
    finally:
        for module, training in modes:
            module.training = training
    if row.dim() > 1 and row.shape[0] == 1:  # a batch-first model's one row (of >= 2 tokens): 1 x T x ...
        row, alone = row[0], [out[0] for out in alone]
    row, alone = row.reshape(len(row), -1), [out.reshape(len(out), -1) for out in alone]  # T x F
    if len(row) != sum(len(out) for out in alone):
        raise ValueError(
            f"check_padding_free got {len(row)} outputs for the row and {[len(out) for out in alone]} for the "
            f"samples alone; pass a model (or a wrapper) that returns one output per token"
        )
    rtol = _check_real("rtol", _CHECK_RTOL.get(row.dtype, 0.0) if rtol is None else rtol, strict=False)
    scale = max(float(out.abs().max()) for out in alone)
    pieces = torch.split(row, [len(out) for out in alone])
    worst = max(float((piece.double() - out.double()).abs().max()) for piece, out in zip(pieces, alone))
    if not worst <= rtol * scale:  # NaN fails too
        cache = ""
        if getattr(getattr(model, "config", None), "use_cache", False):
            cache = " (this model's config has use_cache=True)"
        raise ValueError(
            f"check_padding_free: a sample's outputs in the flat row differ from its outputs alone by {worst:.3g}, "
            f"over rtol={rtol:g} x the largest output {scale:.3g}: the samples of a row attend to each other, and "
            f"training on such rows is silently wrong (the loss looks right, the gradients are not); give it "
            f"positions that restart at every sample, use_cache=False{cache}, no attention_mask, and an attention "
            f"implementation that honours the positions (a plain model: a block-diagonal causal mask)"
        )
    return worst


def _output(model: Any, batch: Any) -> torch.Tensor:
    """The model's output tensor on a collated batch: ``model(**batch)`` for an HF model, else ``model(batch)``."""
    hf = isinstance(batch, Mapping) and isinstance(model, torch.nn.Module) and hasattr(model, "config")
    output = model(**batch) if hf else model(batch)
    output = getattr(output, "logits", output)
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor) or output.dim() == 0:
        raise TypeError(f"check_padding_free needs per-token output tensors, but the model returned {output!r:.60}")
    return output


# =============================================================================
# The loader
# =============================================================================


def _check_batch_count(batch_count: Any, sampler: VariableBatchSampler, dataset: Any) -> str | np.ndarray | None:
    """`make_dataloader`'s ``batch_count``: None, a unit, or one count per sample of ``dataset`` (read-only int64)."""
    if batch_count is None:
        return None
    if isinstance(batch_count, str):
        unit = _check_choice("batch_count", batch_count, _BatchCount)
        if unit != "sequences":
            _check_tokens_known(sampler, f"batch_count={unit!r}")
        return unit
    fix = "pass what each sample adds to the loss's denominator, e.g. its label tokens, or a unit such as 'tokens'"
    counts = _as_counts(batch_count, "batch_count", minimum=0, fix=fix)
    size = len(dataset) if hasattr(dataset, "__len__") else None
    if sampler.seqlens is not None:
        size = len(sampler.seqlens)
    if size is not None and len(counts) != size:
        raise ValueError(f"batch_count should hold one count per sample ({size}), but got {len(counts)} counts; {fix}")
    return counts


def make_dataloader(
    dataset,
    batch_sampler: VariableBatchSampler,
    *,
    collate_fn=None,
    sample_padding_fn=None,
    num_workers=0,
    pin_memory=False,
    dataloader_class=None,
    batch_count=None,
    **dataloader_kwargs,
) -> DataLoader:
    """A `DataLoader` over ``batch_sampler``'s step inputs: ``collate_fn(samples)`` for each (the list without one).

    In same-length mode every sample is first padded with
    ``sample_padding_fn(sample, length)`` to its batch's longest seqlen; with
    ``padding_free`` none is (the collate, by default `FlatCollate`, makes one
    row of a step input; in same-length mode, of its batch's longest row). A
    ``collate_fn`` with a ``seqlens`` parameter (as `PaddedCollate`) gets the
    plan's real lengths of its samples, also when they arrive padded; any other
    that calls `PaddedCollate` without them gets them there in same-length mode
    (see NOTE [same-length lengths reach PaddedCollate]). Under the padded budget
    a collated tensor (see `_padded_tensor`) over ``micro_batch_size x
    max_tokens`` is an error, as is a padding-free row over it: the seqlens must count what ``collate_fn`` adds. Works with
    workers (also spawned), ``pin_memory`` and ``persistent_workers``, under
    torchrun, DeepSpeed, HF Accelerate's ``prepare`` and Lightning (see README);
    ``dataloader_class`` (a DataLoader subclass, e.g. torchdata's
    ``StatefulDataLoader``) replaces torch's; a dataset with ``state_dict`` and
    ``load_state_dict`` (an augmentation RNG) has its state saved and restored by
    it as without varbatch (see NOTE [the dataset's own state]), and restores a
    pass exactly where the loop got to (NOTE [a pass's position]).
    ``loader.variable_batch_sampler`` is ``batch_sampler``. Under torch.distributed with ``num_replicas > 1`` it is
    a collective: every process calls it, and the processes check that they
    planned the same epoch (see `_check_ranks_agree`).

    The batch each step input is part of: with ``batch_count`` (default None:
    each step input as it is) the loader yields ``(step_input, batch)``,
    ``batch`` its `Batch` record (NOTE [the batch travels with the step
    input]): its index over the run, its epoch, whether the step input is this
    rank's last of it (update there, then ``scheduler.step(batch)``), and its
    ``count`` over all ranks and accumulation steps of what the loss averages
    over: ``"sequences"``, ``"tokens"`` (the seqlens), ``"label_tokens"`` (a
    causal LM's labels are its shifted inputs: ``L - 1`` per sequence of ``L``,
    as in a `FlatCollate` row), or one count per sample (label tokens where
    prompts are masked). Weight the step input's mean loss with
    ``micro_batch_loss_weight(count, batch.count, ...)``, ``count`` its own
    denominator. Leave it None under HF Trainer and TRL: they pass the step
    input to the model as it is, and weight an HF model's loss themselves.

    Raises:
        TypeError, ValueError: another sampler, same-length mode without
        ``sample_padding_fn``, a dataset of another size than the seqlens, a
        ``batch_count`` that is no unit or of another size, or a DataLoader
        option the sampler decides (batch size, shuffling); while
        iterating, ValueError: a collated tensor over the padded budget;
        RuntimeError: the processes planned differently.
    """
    if not isinstance(batch_sampler, VariableBatchSampler):
        raise TypeError(f"batch_sampler should be a VariableBatchSampler, but got {type(batch_sampler).__name__}")
    for name, fn in (("collate_fn", collate_fn), ("sample_padding_fn", sample_padding_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} should be a function or None, but got {name}={fn!r}")
    taken = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(dataloader_kwargs))
    if dataloader_kwargs.get("in_order", True) is not True:  # workers would hand step inputs out of the plan's order
        taken.append("in_order")
    if taken:
        raise TypeError(f"make_dataloader got {taken}, which the VariableBatchSampler decides; leave them out")
    seqlens = batch_sampler.seqlens
    if hasattr(dataset, "__len__") and seqlens is not None and len(dataset) != len(seqlens):
        raise ValueError(
            f"the dataset has {len(dataset)} samples but the sampler was given {len(seqlens)} seqlens; give "
            f"one seqlen per sample of this dataset"
        )
    batch_count = _check_batch_count(batch_count, batch_sampler, dataset)
    settings = batch_sampler.settings
    if settings.padding_free and collate_fn is None:
        collate_fn = FlatCollate()
    if batch_sampler.same_length and not settings.padding_free and sample_padding_fn is None:
        raise ValueError(
            "sample_padding_fn is None, but same-length mode pads every sample of a batch to the batch's "
            "max seqlen; pass sample_padding_fn=varbatch.pad_sample or your own fn(sample, length)"
        )
    loader_class = _Loader
    if dataloader_class is not None:  # varbatch's dealing over the given class
        loader_class = type(f"_{dataloader_class.__name__}", (_Loader, dataloader_class), {})
    load_step_input = _LoadStepInput(dataset, settings, batch_sampler.rank, collate_fn, sample_padding_fn)
    # torchdata checks a dataset for state_dict and load_state_dict (its Stateful protocol): see NOTE [the
    # dataset's own state]
    stateful = callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))
    loader = loader_class(
        _StatefulKeyDataset(batch_sampler, dataset) if stateful else _KeyDataset(batch_sampler),
        batch_size=1,
        sampler=_StepInputKeys(batch_sampler, every_rank=True, batched=False, batch_count=batch_count),
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=load_step_input,
        **dataloader_kwargs,
    )
    # see NOTE [the loader deals itself]
    loader._local = _StepInputKeys(batch_sampler, every_rank=False, batched=True, batch_count=batch_count)
    loader.variable_batch_sampler = batch_sampler
    if batch_sampler.num_replicas > 1 and _world()[1] > 1:  # one plan dealt over ranks: every process planned it?
        _check_ranks_agree(batch_sampler)
    return loader


class _Loader(DataLoader):
    """`make_dataloader`'s loader: launchers see every rank's step inputs, its iterators take this rank's.

    NOTE [the loader deals itself]: launchers deal a loader's batches to the
    processes themselves, or replace its sampler; a loader of this rank's step
    inputs would be dealt twice. So the attributes launchers read show every
    rank's step inputs, and the loader deals them where torch reads:

    - HF Accelerate's ``prepare`` rebuilds a plain `DataLoader` from the
      loader's public attributes and wraps its ``batch_sampler`` in a
      ``BatchSamplerShard``, of which process p keeps the batches with
      ``idx % R == p`` (accelerate/data_loader.py). Here ``batch_sampler``
      batches by one the keys of every rank in the order g = 0, 1, ..., so its
      dealing is varbatch's and each process trains its own step inputs.
    - Lightning injects a distributed sampler into a loader unless its
      ``sampler`` is a `DistributedSampler` (its distributed sampler injection,
      pytorch_lightning/trainer/connectors/data_connector.py): ``sampler``,
      every rank's keys, is one in type, so Lightning leaves the loader as it is.
    - torch's iterators and ``len()`` read the private ``_index_sampler``, not
      ``batch_sampler`` (torch/utils/data/dataloader.py): here, this rank's
      keys, so the loader iterated as it is takes this rank's step inputs.

    A loader rebuilt as its own class (Lightning's, when it injects a sampler
    anyway) lacks this rank's keys and refuses to iterate; `_LoadStepInput`
    checks the dealing, so any other re-dealing fails at the first batch.
    """

    @property
    def _index_sampler(self):
        if "_local" not in self.__dict__:
            raise RuntimeError(
                "this DataLoader was rebuilt from varbatch's loader and lost its dealing of step "
                "inputs to the ranks; use varbatch's loader as it is (Lightning: use_distributed_"
                "sampler=False)"
            )
        return self.__dict__["_local"]


class _KeyDataset(Dataset):
    """Item ``key`` is ``key``: the loader's sampler yields step-input keys, `_LoadStepInput` loads their samples.

    Its ``set_epoch`` is ``sampler``'s: accelerate's ``DataLoaderShard.set_epoch``
    falls back to its dataset's where its batch sampler hides the sampler, as in
    the loader that accelerate's ``skip_first_batches`` rebuilds from a prepared
    one (a ``SkipBatchSampler`` over a ``BatchSamplerShard``; HF Trainer resumes
    inside an epoch with it), whose epoch would otherwise stay the sampler's last.
    """

    def __init__(self, sampler: VariableBatchSampler | None = None, dataset: Any = None):
        self.variable_batch_sampler = sampler
        self.dataset = dataset  # the user's, where its state is saved with the loader's (`_StatefulKeyDataset`)

    def __reduce__(self):  # a loader worker's copy: no sampler (no copy of its plans)
        return (type(self), (None, self.dataset))

    def set_epoch(self, epoch):
        if self.variable_batch_sampler is not None:
            self.variable_batch_sampler.set_epoch(epoch)

    def __getitem__(self, key):
        return key

    def __len__(self):  # DeepSpeed's deepspeed_io() takes only datasets that have one
        raise TypeError("varbatch's key dataset has no length: its items are the keys its sampler yields")


class _StatefulKeyDataset(_KeyDataset):
    """A `_KeyDataset` whose ``state_dict``/``load_state_dict`` are the user's dataset's, as they are.

    NOTE [the dataset's own state]: torchdata's StatefulDataLoader saves a
    map-style dataset's state (an augmentation RNG, a curriculum) with the
    loader's, and in each worker that worker's copy, when the dataset has
    both methods (``isinstance(dataset, Stateful)``, a protocol checked by
    attribute: torchdata/stateful_dataloader/stateful.py). The dataset it sees is
    this wrapper, so the wrapper has them exactly when the user's dataset does
    (a `_KeyDataset` has neither: torchdata then saves None, as without
    varbatch), and forwards them without adding keys. They must reach the very
    object the samples are read from, `_LoadStepInput`'s ``dataset``: a forked
    worker inherits both references to one object, and a spawned worker
    unpickles the loader's dataset and collate in one pickle (the worker
    process's arguments), whose memo keeps them one object; so ``__reduce__``
    keeps ``dataset``.
    """

    def state_dict(self):
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict):
        self.dataset.load_state_dict(state_dict)


class _StepInputKey(typing.NamedTuple):
    """One step input as the sampler hands it to the loader: what a loader worker needs to load its samples, pad
    and collate them, and check that it was dealt to this rank (a tuple of plain data: it travels to workers)."""

    sample_ids: tuple[int, ...]
    seqlens: tuple[int, ...] | None  # the plan's real lengths of the samples (None: given micro-batches)
    pad_to: int  # the batch's longest seqlen in same-length mode, else 0 (no padding)
    epoch: int
    pass_number: int  # the pass that dealt it (`_Pass.number`)
    pass_start: int  # this rank's step input t that the pass started at
    step_input: int  # g, its index among the epoch's step inputs of all ranks (see the dealing rule)
    every_rank: bool = False  # from the view of every rank's step inputs that launchers deal (see `_StepInputKeys`)
    batch: Batch | None = None  # its batch, yielded beside it where the loop asked (NOTE [the batch travels ...])


class _StepInputKeys(DistributedSampler):
    """The `_StepInputKey` of each step input of ``sampler``'s passes: every rank's (``every_rank``: the ``sampler``
    and ``batch_sampler`` launchers see) or this rank's (what the loader iterates); ``[key]`` each when ``batched``
    (a batch sampler's batch of one), else the keys themselves (a sampler a loader batches by one).

    A `DistributedSampler` in type only (its ``__init__`` is not called): see NOTE [the loader deals itself]. Each
    ``iter()`` is a `_KeyPass`, whose state torchdata's StatefulDataLoader saves (NOTE [a pass's position]).
    """

    def __init__(self, sampler: VariableBatchSampler, *, every_rank: bool, batched: bool, batch_count: Any = None):
        self.variable_batch_sampler = sampler
        self.every_rank = every_rank
        self.batched = batched
        self.batch_count = batch_count  # what the records count per batch (see `make_dataloader`), or None

    def __iter__(self):
        return _KeyPass(self)

    def __len__(self):
        sampler = self.variable_batch_sampler
        return len(sampler) * sampler.num_replicas if self.every_rank else len(sampler)

    def set_epoch(self, epoch):  # a launcher's, through the loader
        self.variable_batch_sampler.set_epoch(epoch)


# NOTE [the batch travels with the step input]: a step input's loss weight is its own count over its batch's
# (`micro_batch_loss_weight`), and the scheduler is told the batch it stepped. The loop knows its own count (its
# loss's denominator), not which batch a step input is part of: after a resume a pass starts inside an epoch (inside a
# batch, too), and loader workers read ahead. So each step input's `Batch` record is made from the plan into its key,
# which the loader's workers get (their `_KeyDataset` holds no plan), and yielded beside the step input, as HF Trainer
# passes `num_items_in_batch` beside each of its step inputs. The count, not the weight: the weight's factors R and G
# depend on what the engine averages (DDP averages over ranks; DeepSpeed and Accelerate divide the loss by G, a loop
# that sums its backward calls does not), which the loader cannot see.
class _KeyPass(_Pass):
    """A pass of a `_StepInputKeys`: its step inputs as keys (``[key]`` each when batched), with their records."""

    def __init__(self, keys: _StepInputKeys):
        super().__init__(keys.variable_batch_sampler, keys.every_rank)
        self.batched = keys.batched
        self.batch_count = keys.batch_count
        self._counts: list | None = None

    def _item(self, plan: Plan, t: int, g: int, ids: list[int], lens: list[int] | None) -> Any:
        sampler = self.sampler
        gas = sampler.gradient_accumulation_steps
        batch = None
        if self.batch_count is not None:
            if self._counts is None:
                self._counts = _batch_counts(plan, self.batch_count)
            index = self.epoch * sampler._batches_per_epoch() + t // gas
            batch = Batch(index, self.epoch, self._counts[t // gas], t % gas == gas - 1, t)
        key = _StepInputKey(
            sample_ids=tuple(ids),
            seqlens=None if lens is None else tuple(lens),
            pad_to=int(plan.padded_seqlens[g * sampler.micro_batch_size]) if sampler.same_length else 0,
            epoch=self.epoch,
            pass_number=self.number,
            pass_start=self.start,
            step_input=g,
            every_rank=self.every_rank,  # marked, so that the dealing check can tell a view that was not dealt
            batch=batch,
        )
        return [key] if self.batched else key


def _batch_counts(plan: Plan, batch_count: str | np.ndarray) -> list[int]:
    """Per batch of ``plan``: its sequences, tokens (the seqlens), label tokens (tokens less sequences: a causal
    LM's labels are its shifted inputs), or the sum of the given per-sample counts over its samples."""
    if isinstance(batch_count, np.ndarray):
        k = plan.effective_batch_size
        running = np.concatenate([[0], np.cumsum(batch_count[plan.sample_ids])])  # before each sample of the plan
        return np.diff(running[plan.microbatch_offsets[::k]]).tolist()  # batch b: micro-batches b*k .. b*k + k - 1
    if batch_count == "label_tokens":
        return (plan.batch_tokens - plan.batch_sizes).tolist()
    return plan._amounts(batch_count).tolist()


class _LoadStepInput:
    """The loader's collate: loads the samples of a step-input key, checks that the key was dealt to this rank,
    pads the samples in same-length mode and collates them (in the loader's workers, if it has any).

    The collated tensor is checked against ``micro_batch_size x max_tokens``
    under the padded budget and for padding-free rows. Padding-free, no sample
    is padded; a pipeline's row length reaches the collate (NOTE [the flat row]).
    """

    def __init__(self, dataset, settings: _Settings, rank=0, collate_fn=None, sample_padding_fn=None):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.sample_padding_fn = sample_padding_fn
        self.num_replicas, self.rank = settings.num_replicas, rank  # the dealing this rank's step inputs follow
        self.padding_free = settings.padding_free
        bounded = settings.budget == "padded" or settings.padding_free
        self.step_input_bound = settings.step_input_bound if bounded else None
        self._last_seen = (None, -1)  # ((epoch, pass number), step input g) of the last key this copy got
        try:  # a collate_fn with a `seqlens` parameter gets the plan's real lengths
            self.pass_seqlens = collate_fn is not None and "seqlens" in inspect.signature(collate_fn).parameters
        except (TypeError, ValueError):
            self.pass_seqlens = False

    def _check_dealing(self, key: _StepInputKey) -> None:
        """Raises unless ``key`` is a step input that this copy of the collate should get next on this rank.

        The invariant it relies on: with ``in_order=True`` (make_dataloader
        refuses another) torch hands the step inputs of a pass to the W workers
        in turn (worker w gets the indices w, w + W, ... of the pass), each
        worker with its own copy of this collate (W = 1 without workers), so
        each copy sees every (R x W)-th step input of its rank: after step input
        g, g + R x W. A pass's first key in a copy is one of this rank's, at or
        after the step input the pass started at.
        """
        info = torch.utils.data.get_worker_info()
        workers = 1 if info is None else info.num_workers
        ranks, rank = self.num_replicas, self.rank
        g = key.step_input
        this_pass = (key.epoch, key.pass_number)
        dealt = g % ranks == rank and g >= key.pass_start * ranks
        if self._last_seen[0] == this_pass:
            expected = f"{self._last_seen[1] + ranks * workers}"
            dealt = dealt and g == self._last_seen[1] + ranks * workers
        else:
            expected = f"one of {key.pass_start * ranks + rank}, +{ranks}, ..."
        self._last_seen = (this_pass, g)
        if not dealt:
            raise RuntimeError(
                f"rank {rank} got step input {g} of epoch {key.epoch}, not {expected}: " + self._misdealt(key)
            )

    def _misdealt(self, key: _StepInputKey) -> str:
        """The cause and the fix of a step input this rank should not get: the view of every rank's step inputs
        iterated without varbatch's dealing (HF Trainer's resume skip over a loader it did not prepare), or a
        launcher that re-dealt this rank's own step inputs."""
        ranks = self.num_replicas
        see = 'see the README section "Use with torchrun, DeepSpeed, Accelerate, Lightning"'
        if not key.every_rank:
            return (
                f"something re-dealt varbatch's loader, which deals the step inputs to its num_replicas={ranks} "
                f"ranks itself (rank r trains r, r + {ranks}, ...); turn the launcher's dealing off (HF Accelerate: "
                f"dispatch_batches=False and split_batches=False), {see}"
            )
        return (
            f"this process iterates every rank's step inputs, the view varbatch's loader shows launchers (its "
            f"batch_sampler), without dealing them to its num_replicas={ranks} ranks: a DataLoader rebuilt from a "
            f"loader that was not prepared, as accelerate's skip_first_batches makes (HF Trainer calls it to resume "
            f"from a checkpoint inside an epoch), or an Accelerator that deals to another number of processes; HF "
            f"Trainer: return self.accelerator.prepare(loader) from get_train_dataloader, whose skip deals, as the "
            f"README's HF Trainer recipe does; HF Accelerate: one process per rank, dispatch_batches=False and "
            f"split_batches=False; {see}"
        )

    def __call__(self, keys):
        (key,) = keys  # the loader batches the keys by one
        self._check_dealing(key)
        samples = [self.dataset[i] for i in key.sample_ids]
        if key.pad_to and not self.padding_free:  # same-length mode: every sample of the batch to the batch's longest
            samples = [self.sample_padding_fn(sample, key.pad_to) for sample in samples]
            wrong = [
                (i, len(x))
                for i, x in zip(key.sample_ids, samples)
                if isinstance(x, torch.Tensor) and len(x) != key.pad_to
            ]
            if wrong:
                raise ValueError(
                    f"sample_padding_fn should return a sample of length {key.pad_to}, but returned length "
                    f"{wrong[0][1]} for sample {wrong[0][0]}; it must pad the first dimension to `length`"
                )
        if self.collate_fn is None:
            return _with_batch(samples, key)
        padded = _PADDED_SEQLENS.set(key.seqlens if key.pad_to and not self.padding_free else None)
        row = _FLAT_ROW.set(key.pad_to if self.padding_free else 0)  # NOTE [same-length ...], NOTE [the flat row]
        try:
            if self.pass_seqlens and key.seqlens is not None:
                batch = self.collate_fn(samples, seqlens=list(key.seqlens))
            else:
                batch = self.collate_fn(samples)
        finally:
            _FLAT_ROW.reset(row)
            _PADDED_SEQLENS.reset(padded)
        if self.step_input_bound is not None:
            self._check_budget(batch, key)
        return _with_batch(batch, key)

    def _check_budget(self, batch: Any, key: _StepInputKey) -> None:
        """Raises when the collated step input's ``B x S`` tensor is over the padded budget's bound.

        NOTE [a collate that adds tokens]: the plan bounds the tensors its
        seqlens describe; a collate_fn that adds tokens the seqlens do not count
        (BOS/EOS: TRL appends EOS; padding to a multiple of 8) makes larger ones,
        the memory bound the budget promised is gone. This is an error, not a
        warning: the seqlens are wrong about the data (as for a sample longer
        than its planned length, which `pad_sample` refuses), a collate that
        adds tokens to every sample shows it within the first step inputs
        (packed up to the budget), and an exception raised in a
        loader worker reaches the training process once (torch re-raises it
        there), where a warning would print once in every worker process, out of
        reach of the user's warning filters. Under the sum budget the tensor is
        not bounded (``B x S`` may exceed ``max_tokens`` by design): there the
        seqlens must count the same tokens, or the real tokens exceed the sum.
        """
        tensor = _padded_tensor(batch)
        if tensor is not None and self.padding_free and key.pad_to and tuple(tensor.shape[:2]) != (1, key.pad_to):
            raise ValueError(
                f"step input {key.step_input} of epoch {key.epoch} was collated into a {tuple(tensor.shape[:2])} "
                f"tensor, but a padding-free pipeline's step inputs are rows of their batch's longest, 1 x "
                f"{key.pad_to}: collate with varbatch.FlatCollate (or call it inside your collate_fn)"
            )
        if tensor is None or tensor.shape[0] * tensor.shape[1] <= self.step_input_bound:
            return
        budget = "padding-free rows'" if self.padding_free else "padded budget's"
        raise ValueError(
            f"step input {key.step_input} of epoch {key.epoch} was collated into a {tensor.shape[0]} x "
            f"{tensor.shape[1]} tensor of {tensor.shape[0] * tensor.shape[1]} tokens, over the {budget} "
            f"micro_batch_size x max_tokens = {self.step_input_bound}: collate_fn adds tokens the seqlens do not "
            f"count (BOS/EOS, padding to a multiple); count them in the seqlens (e.g. [len(ids) + 1 for ids in "
            f"tokenized] for an EOS the collate appends)"
        )


def _with_batch(step_input: Any, key: _StepInputKey) -> Any:
    """``(step_input, batch)`` where the loop asked for the record (see `make_dataloader`), else the step input."""
    return step_input if key.batch is None else (step_input, key.batch)


def _check_ranks_agree(sampler: VariableBatchSampler) -> None:
    """Raises unless every process planned the same epoch and the ranks 0 .. R-1 each appear alike.

    A collective: every process calls it. Ranks that planned differently train
    samples twice or never and disagree on the number of steps (a hang at the
    first collective that one rank never reaches).
    """
    everyone = _gather((sampler.plan.fingerprint(), sampler.num_replicas, sampler.rank))
    differ = [r for r, (fingerprint, replicas, _) in enumerate(everyone) if (fingerprint, replicas) != everyone[0][:2]]
    if differ:
        raise RuntimeError(
            f"rank {differ[0]} planned a different epoch than rank 0 ({len(differ)} rank(s) differ): the "
            f"ranks see different seqlens, sample_ids or settings; give every rank the same dataset, "
            f"seqlens and config (delete a seqlen cache in metrics_path that is not shared)"
        )
    dealt = [rank for _, _, rank in everyone]
    if sorted(set(dealt)) != list(range(sampler.num_replicas)) or len({dealt.count(r) for r in set(dealt)}) > 1:
        raise RuntimeError(
            f"the processes deal to ranks {dealt}, not to each of 0 .. {sampler.num_replicas - 1} "
            f"alike: pass every process its own data-parallel rank"
        )


def _gather(obj: Any) -> list:
    """``obj`` of every rank (a list of one without torch.distributed)."""
    if _world()[1] == 1:
        return [obj]
    out = [None] * _world()[1]
    torch.distributed.all_gather_object(out, obj)
    return out


###############################################################################
# Part IV. Trainer adapters and DeepSpeed
###############################################################################


# =============================================================================
# HF Trainer and TRL
# =============================================================================


def hf_trainer_lr_scheduler(trainer, lr_scheduler, base_batch_size, batch_sizes, **options):
    """A `VariableBatchSizeLR` for an HF ``transformers.Trainer`` (TRL's trainers too), told of the updates it skips.

    Call it in the Trainer's ``create_scheduler``, on the schedule the Trainer built there (``lr_scheduler_type``,
    warmup: ``super().create_scheduler(...)``); it returns the scheduler to install as ``trainer.lr_scheduler``.

    NOTE [HF Trainer's skipped updates]: for each update the Trainer
    (transformers/trainer.py, ``Trainer._run_epoch``) steps the optimizer,
    steps the scheduler unless ``accelerator.optimizer_step_was_skipped`` (AMP
    found inf/nan; under DeepSpeed the engine steps it, and skips it alike),
    adds one to ``state.global_step`` either way, calls the callbacks'
    ``on_step_end``, and then saves a checkpoint if one is due (``scheduler.pt``
    beside ``trainer_state.json``, which holds ``global_step``). So
    ``global_step`` counts the batches trained, skipped ones included: b. A
    callback added here calls ``step(skipped=True)`` at each ``on_step_end``,
    and at ``on_train_begin``, while ``global_step`` is ahead of b: each
    checkpoint holds one count in both files, and a resumed run restores them
    together. The Trainer resumes inside an epoch by skipping its
    ``(global_step % updates per epoch) x gradient_accumulation_steps`` trained
    step inputs with accelerate's ``skip_first_batches``, over the loader
    ``get_train_dataloader`` returned: exact with the loader prepared
    (``self.accelerator.prepare(loader)``), whose rebuilt loader skips this
    rank's step inputs and reaches the sampler's ``set_epoch`` through
    `_KeyDataset`; rebuilt from an unprepared one, it would iterate every rank's.

    Args:
        trainer: the ``transformers.Trainer`` whose scheduler this is.
        lr_scheduler, base_batch_size, batch_sizes, **options: as `VariableBatchSizeLR`'s.

    Raises:
        TypeError: ``trainer`` is not an HF Trainer; ValueError: its gradient_accumulation_steps is not the
        sampler's; RuntimeError, when training starts or at an update: a resume the Trainer would not make exact
        (``ignore_data_skip=True`` inside an epoch, an unprepared loader), or a scheduler stepped besides the Trainer.
    """
    import transformers  # here, not at the top: varbatch imports without it

    if not all(hasattr(trainer, name) for name in ("args", "add_callback", "accelerator")):
        raise TypeError(
            f"trainer should be a transformers.Trainer (or a TRL trainer), but got {type(trainer).__name__}; "
            f"call hf_trainer_lr_scheduler(self, ...) in your Trainer subclass's create_scheduler"
        )
    sampler = _find_sampler(batch_sizes)
    if sampler is not None and trainer.args.gradient_accumulation_steps != sampler.gradient_accumulation_steps:
        raise ValueError(
            f"the Trainer accumulates gradient_accumulation_steps={trainer.args.gradient_accumulation_steps} step "
            f"inputs per update, but the sampler's batch is gradient_accumulation_steps="
            f"{sampler.gradient_accumulation_steps} per rank; make the sampler with gradient_accumulation_steps="
            f"self.args.gradient_accumulation_steps"
        )
    scheduler = VariableBatchSizeLR(lr_scheduler, base_batch_size, batch_sizes, **options)
    # The Trainer steps the scheduler after each update it takes (under DeepSpeed the engine does: see its glue).
    scheduler._updates_precede_steps = not getattr(trainer, "is_deepspeed_enabled", False)

    class TellSkippedUpdates(transformers.TrainerCallback):
        """Moves b on to ``state.global_step`` (see NOTE [HF Trainer's skipped updates])."""

        def on_train_begin(self, args, state, control, lr_scheduler=None, train_dataloader=None, **kwargs):
            if _is_the_trainers(scheduler, lr_scheduler):  # not a scheduler that another train() call replaced
                _check_trainer_resume(args, state.global_step, scheduler, train_dataloader)
                _tell_skipped_updates(scheduler, state.global_step)

        def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
            if _is_the_trainers(scheduler, lr_scheduler):
                _tell_skipped_updates(scheduler, state.global_step)

    trainer.add_callback(TellSkippedUpdates())
    return scheduler


def _is_the_trainers(scheduler: VariableBatchSizeLR, given: Any) -> bool:
    """Whether ``given``, the scheduler HF's callbacks get, is ``scheduler`` (or an Accelerate wrapper of it)."""
    return scheduler in (given, getattr(given, "scheduler", None))


def _tell_skipped_updates(scheduler: VariableBatchSizeLR, global_step: int) -> None:
    """``step(skipped=True)`` while HF's ``global_step`` is ahead of b (see NOTE [HF Trainer's skipped updates])."""
    while global_step > scheduler.batches_trained:
        scheduler.step(skipped=True)
    if scheduler.batches_trained > global_step:
        raise RuntimeError(
            f"VariableBatchSizeLR counts {scheduler.batches_trained} batches, but the Trainer's global_step is "
            f"{global_step}: something steps the scheduler besides the Trainer (a callback, compute_loss, a loop of "
            f"your own), or it was restored from another checkpoint than the Trainer's state; let the Trainer step it "
            f"and resume with resume_from_checkpoint"
        )


def _check_trainer_resume(args: Any, global_step: int, scheduler: VariableBatchSizeLR, loader: Any) -> None:
    """Raises when an HF Trainer resumes at ``global_step`` where its data would not be the uninterrupted run's."""
    if not global_step:
        return
    if args.ignore_data_skip and global_step % scheduler._batches_per_epoch():
        raise RuntimeError(
            f"the Trainer resumes at global_step={global_step}, inside an epoch, with ignore_data_skip=True: it "
            f"would train that epoch again from its start at the LRs of later batches; leave ignore_data_skip "
            f"False (skipping varbatch's trained step inputs reads no samples)"
        )
    if isinstance(loader, _Loader):
        raise RuntimeError(
            "the Trainer resumes over varbatch's loader as make_dataloader made it: its skip of the trained step "
            "inputs (accelerate's skip_first_batches) would rebuild it over every rank's, and its set_epoch would "
            "not reach the sampler; return self.accelerator.prepare(loader) from get_train_dataloader (see the "
            "README's HF Trainer recipe)"
        )


# =============================================================================
# DeepSpeed-compatible functions
# =============================================================================


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
    required_microbatches_of_same_seqlen=False,
    epoch=0,
    **options,
):
    """DeepSpeed's ``batch_by_seqlens`` without its data loss, in linear time (see `plan_batches`).

    Returns ``(microbatch_ids, batch_sizes, batch_max_seqlens)``: ``(batch_id, [sample ids])``
    per micro-batch, the samples and the longest sample per batch.
    """
    plan = plan_batches(
        seqlens,
        max_tokens,
        effective_batch_size=effective_batch_size,
        epoch=epoch,
        sample_ids=sequence_ids_per_mb,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
        order=sequence_picking_order,
        same_size=bool(required_microbatches_of_same_size),
        same_length=bool(required_microbatches_of_same_seqlen),
        seed=seed,
        **options,
    )
    if _on_rank_zero(0):
        _log_plan(plan, verbose)
    k = plan.effective_batch_size
    return (
        [(j // k, ids) for j, ids in enumerate(plan.microbatches())],
        plan.batch_sizes.tolist(),
        plan.batch_max_seqlens.tolist(),
    )


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
    """A loader over given micro-batches, the same every epoch (DeepSpeed's signature; see `make_dataloader`).

    Returns ``(dataloader, deepspeed_io_kwargs)``.
    """
    batch_ids = np.asarray([int(b) for b, _ in microbatch_ids], dtype=np.int64)
    per_batch = np.bincount(batch_ids) if len(batch_ids) else np.zeros(1, np.int64)
    if not per_batch[0] or (per_batch != per_batch[0]).any() or (np.diff(batch_ids) < 0).any():
        raise ValueError(
            "microbatch_ids should be (batch_id, sample ids) pairs in batch order, as many per batch, as "
            "batch_by_seqlens returns them"
        )
    sizes = np.asarray([len(ids) for _, ids in microbatch_ids], dtype=np.int64)
    batch_max = _as_counts(batch_max_seqlens, "batch_max_seqlens")[: len(per_batch)]
    k = int(per_batch[0])  # micro-batches per batch
    same = bool(required_microbatches_of_same_seqlen)
    settings = _Settings(
        max_tokens=int(batch_max.max()),
        effective_batch_size=k,
        same_size=same,
        same_length=same,
        micro_batch_size=dataloader_batch_size,
        num_replicas=dataloader_num_replicas,
    )
    fixed = Plan(
        sample_ids=_as_counts([i for _, ids in microbatch_ids for i in ids], "microbatch_ids", minimum=0),
        microbatch_offsets=np.concatenate([[0], np.cumsum(sizes)]),
        padded_seqlens=np.repeat(batch_max, k),
        batch_sizes=sizes.reshape(-1, k).sum(axis=1),
        batch_tokens=np.zeros(len(batch_max), np.int64),
        batch_max_seqlens=batch_max,
        dropped={r: np.zeros(0, np.int64) for r in _DROP_REASONS},
        settings=settings,
        epoch=0,
    )
    loader = _deepspeed_loader(
        dataset,
        _Planner(None, settings, fixed=fixed),
        dataloader_rank,
        dataloader_collate_fn,
        sample_padding_fn,
        dataloader_num_workers,
        dataloader_pin_memory,
        verbose=False,
    )
    return loader, _deepspeed_io_kwargs(loader)


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
    lr_scaling_unit="sequences",
    lr_scaling_reference=None,
    lr_clock="steps",
    lr_clock_step=1,
    batch_count=None,
    **options,
):
    """The loader and LR scheduler of a token-budget plan (DeepSpeed's signature).

    Unlike DeepSpeed's, the loader makes a new plan every epoch in ``random`` and
    ``bucket`` order and the scheduler follows it. ``lr_scaling_reference``:
    ``B_ref`` (None: ``effective_batch_size``, DeepSpeed's; a number; ``"mean"``);
    ``lr_clock``/``lr_clock_step``: what drives the schedule (`VariableBatchSizeLR`);
    ``lr_scheduler_or_optimizer`` may also be a function of the sampler that makes
    the schedule (see the DeepSpeed glue's ``lr_scheduler_fn``); ``batch_count``:
    the loader yields each step input beside its `Batch` record (`make_dataloader`);
    ``**options``: plan options (``budget``, ``bucket_size``, ...).

    Returns ``(dataloader, lr_scheduler, deepspeed_io_kwargs)``; no scheduler without ``lr_scheduler_or_optimizer``.
    """
    settings = _Settings.of(
        max_tokens=max_tokens,
        effective_batch_size=effective_batch_size,
        order=sequence_picking_order,
        micro_batch_size=dataloader_batch_size,
        num_replicas=dataloader_num_replicas,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
        seed=seed,
        same_size=bool(required_microbatches_of_same_size),
        same_length=bool(required_microbatches_of_same_seqlen),
        **options,
    )
    seqlens = _as_counts(dataset_seqlens, "dataset_seqlens")
    ids = None if dataset_filter_ids is None else _as_sample_ids(dataset_filter_ids, len(seqlens))
    loader = _deepspeed_loader(
        dataset,
        _Planner(seqlens, settings, ids),
        dataloader_rank,
        dataloader_collate_fn,
        sample_padding_fn,
        dataloader_num_workers,
        dataloader_pin_memory,
        verbose=verbose,
        batch_count=batch_count,
    )
    sampler = loader.variable_batch_sampler
    schedule = lr_scheduler_or_optimizer
    if callable(schedule) and not hasattr(schedule, "step"):  # a function of the sampler that makes the schedule
        schedule = schedule(sampler)
    scheduler = None
    if schedule is not None:
        scheduler = VariableBatchSizeLR(
            schedule,
            lr_scaling_reference,
            sampler,
            lr_scaling_method=lr_scaling_method,
            verbose=verbose,
            lr_scaling_unit=lr_scaling_unit,
            clock=lr_clock,
            clock_step=lr_clock_step,
        )
    return loader, scheduler, _deepspeed_io_kwargs(loader)


def _deepspeed_loader(
    dataset,
    planner: _Planner,
    rank: Any,
    collate_fn,
    sample_padding_fn,
    num_workers,
    pin_memory,
    *,
    verbose: bool,
    batch_count: Any = None,
) -> DataLoader:
    """The loader of the functions above: `make_dataloader`'s, over a sampler of ``planner``'s plans for the
    data-parallel ``rank``, with the loader arguments of DeepSpeed's signatures (``dataloader_collate_fn``, ...)."""
    rank = _check_int("dataloader_rank", rank, minimum=0, maximum=planner.settings.num_replicas - 1)
    sampler = VariableBatchSampler._of(planner, rank, verbose)
    return make_dataloader(
        dataset,
        sampler,
        collate_fn=collate_fn,
        sample_padding_fn=sample_padding_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
        batch_count=batch_count,
    )


def _deepspeed_io_kwargs(loader: DataLoader) -> dict:
    """The keyword arguments of ``engine.deepspeed_io()`` that make ``loader``'s loader (this rank's step inputs)."""
    return dict(
        dataset=loader.dataset,
        batch_size=1,
        pin_memory=loader.pin_memory,
        data_sampler=_StepInputKeys(loader.variable_batch_sampler, every_rank=False, batched=False),
        collate_fn=loader.collate_fn,
        num_local_io_workers=loader.num_workers,
    )


def lr_scheduler_for_variable_batch_size(
    base_batch_size,
    batch_sizes,
    dataloader,
    lr_scheduler_or_optimizer,
    lr_scaling_method="linear",
    verbose=False,
    **options,
):
    """A `VariableBatchSizeLR` (DeepSpeed's signature; ``**options``: ``lr_scaling_unit``, ``clock``, ``clock_step``)."""
    if lr_scheduler_or_optimizer is None:
        raise TypeError(
            "lr_scheduler_or_optimizer is None; pass the optimizer (constant LR) or the LR scheduler whose LR is scaled"
        )
    return VariableBatchSizeLR(
        lr_scheduler_or_optimizer,
        base_batch_size,
        batch_sizes,
        dataloader,
        lr_scaling_method=lr_scaling_method,
        verbose=verbose,
        **options,
    )


# =============================================================================
# DeepSpeed glue: the config section, the seqlens, the engine
# =============================================================================


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
    dataset,
    engine,
    dataset_seqlens=None,
    dataset_filter_ids=None,
    dataloader_collate_fn=None,
    sample_padding_fn=None,
    batch_seqlens_fn=None,
    *,
    lr_scheduler_fn=None,
    batch_count=None,
):
    """The dataloader and LR scheduler for a DeepSpeed engine, from its config (DeepSpeed's signature).

    Reads ``data_efficiency.data_sampling.dynamic_batching`` (README: "The
    ``dynamic_batching`` config section"); takes
    the batch sizes and the data-parallel rank and size from the engine; turns
    on same-size, same-length micro-batches for a ``PipelineEngine`` (with
    ``padding_free``, rows of one length per batch: see `FlatCollate`); checks
    that every rank planned the same epoch; installs the scheduler as
    ``engine.lr_scheduler`` (wrapping the engine's scheduler, or its optimizer's
    constant LR), so ``engine.step()`` steps it and checkpoints save it, and
    the LR follows the batch trained also when the engine skips a step (fp16
    overflow). Seqlens: ``dataset_seqlens``; else the cache in ``metrics_path``
    (spot-checked with ``batch_seqlens_fn``); else computed once with
    ``batch_seqlens_fn``, each rank a shard, and cached there. ``lr_scheduler_fn``,
    if given, makes the schedule to scale from the sampler, so that it can be
    sized by it: ``len(sampler) // gradient_accumulation_steps`` optimizer steps every epoch
    (e.g. ``lambda sampler: OneCycleLR(...)``). ``batch_count``: the loader yields each step
    input beside its `Batch` record (`make_dataloader`); tell the scheduler through
    ``engine.step(lr_kwargs={"batch": batch})``, or let the engine count.

    Returns:
        ``(dataloader, lr_scheduler, deepspeed_io_kwargs)``; ``lr_scheduler`` is
        None when the engine has no optimizer.

    Raises:
        ValueError: a bad config section or batch sizes; RuntimeError: the ranks planned differently.
    """
    config = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if not isinstance(config, Mapping):
        raise TypeError(f"expected a DeepSpeed engine (from deepspeed.initialize), but got {type(engine).__name__}")
    plan_options, lr_options, other = _read_config(config)
    grid = getattr(engine, "grid", None)  # a PipelineEngine's
    if grid is not None:
        dp_rank, dp_size = int(grid.data_parallel_id), int(grid.data_parallel_size)
    else:
        dp_rank, dp_size = _world(getattr(engine, "data_parallel_group", None))
    k = engine.train_batch_size()
    mbs = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    _check_batch_geometry(k, mbs, gas, dp_size, "fix the batch sizes in the config")
    if dataset_seqlens is None:
        dataset_seqlens = _dataset_seqlens(dataset, other["metrics_path"], batch_seqlens_fn, dataloader_collate_fn)
    pipeline = grid is not None and hasattr(engine, "train_batch")
    base = engine.lr_scheduler if getattr(engine, "lr_scheduler", None) is not None else engine.optimizer
    if isinstance(base, VariableBatchSizeLR):  # called again: scale the original schedule, not the scaled one
        base._detach()
        for group, lr in zip(base.optimizer.param_groups, base._unscaled):
            _set_lr(group, lr)
        base = base._base if base._base is not None else base.optimizer
    if "order" in plan_options:  # sequence_picking_order in DeepSpeed's signature
        plan_options["sequence_picking_order"] = plan_options.pop("order")
    loader, scheduler, io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset,
        dataset_seqlens,
        effective_batch_size=k,
        dataset_filter_ids=dataset_filter_ids,
        dataloader_batch_size=mbs,
        dataloader_rank=dp_rank,
        dataloader_num_replicas=dp_size,
        dataloader_num_workers=other["num_workers"],
        dataloader_collate_fn=dataloader_collate_fn,
        dataloader_pin_memory=other["pin_memory"],
        lr_scheduler_or_optimizer=lr_scheduler_fn or base,
        # padding-free pipeline rows need one length per batch, not one sample count
        required_microbatches_of_same_size=pipeline and not plan_options.get("padding_free"),
        required_microbatches_of_same_seqlen=pipeline,
        sample_padding_fn=sample_padding_fn,
        verbose=other["verbose"],
        batch_count=batch_count,
        **lr_options,
        **plan_options,
    )
    if dp_size == 1 and _world()[1] > 1:  # pipeline stages of one data-parallel rank (make_dataloader checks more)
        _check_ranks_agree(loader.variable_batch_sampler)
    if scheduler is not None:
        engine.lr_scheduler = scheduler
        # The DeepSpeed adapter: on an fp16 overflow the engine adds to its skipped_steps and steps neither the
        # optimizer nor this scheduler, but the data moves on; engine.load_checkpoint restores skipped_steps. The
        # engine steps the scheduler itself. Before each forward the scheduler catches up with the skips, so that
        # engine.get_lr() between a forward and its step shows the LR that step applies.
        # With torch's autocast and a GradScaler (ZeRO 0) the engine steps it after an update the scaler skipped too.
        autocast_scaler = getattr(engine, "torch_autocast_z0_gradscaler", None) is not None
        scheduler._follow_skipped_steps(lambda: int(getattr(engine, "skipped_steps", 0)), not autocast_scaler)
        module = getattr(engine, "module", None)
        if isinstance(module, torch.nn.Module):
            module.register_forward_pre_hook(_weakly(scheduler._before_forward))
    return loader, scheduler, io_kwargs


_SECTION = ("data_efficiency", "data_sampling", "dynamic_batching")


# Each key of the section, and the plan option (or scheduler option, or loader setting) it sets.
_PLAN_KEYS = {
    "max_tokens": "max_tokens",
    "min_batch_size": "min_batch_size",
    "max_batch_size": "max_batch_size",
    "sequence_picking_order": "order",
    "sentence_picking_order": "order",
    "packing": "packing",
    "seed": "seed",
    "budget": "budget",
    "bucket_size": "bucket_size",
    "on_overlong": "on_overlong",
    "padding_free": "padding_free",
    "balance_ranks": "balance_ranks",
    "quadratic_tokens": "quadratic_tokens",
}


_LR_DEFAULTS = {
    "lr_scaling_method": "linear",
    "lr_scaling_unit": "sequences",
    "lr_scaling_reference": None,
    "lr_clock": "steps",
    "lr_clock_step": 1,
}


_OTHER_KEYS = ("enabled", "metrics_path", "verbose", "num_workers", "pin_memory")


_SEQLEN_CACHE = "varbatch_seqlens.npy"


def _read_config(config: Any) -> tuple[dict, dict, dict]:
    """``(plan options, LR options, loader settings)`` from a DeepSpeed config's dynamic_batching section.

    The one reader of the section: training and the plan command both call it.
    Every value is validated here, each error naming its key path.
    """
    data_efficiency, data_sampling, section = _find_section(config)
    path = ".".join(_SECTION)
    _check_section_keys(section, path)
    plan = {option: section[key] for key, option in _PLAN_KEYS.items() if key in section}
    if plan.get("seed") is None:  # absent or null: the data_efficiency seed, as DeepSpeed's data sampling uses
        plan["seed"] = data_efficiency.get("seed", 1234)
    lr = {key: section.get(key, default) for key, default in _LR_DEFAULTS.items()}
    try:  # every value now, before any engine or data is touched
        _Settings.of(**plan)
        _check_lr_method(lr["lr_scaling_method"])
        _check_reference(lr["lr_scaling_reference"])
        _check_choice("lr_scaling_unit", lr["lr_scaling_unit"], _LRUnit)
        _check_clock(lr["lr_clock"], lr["lr_clock_step"], ("lr_clock", "lr_clock_step"))
    except (TypeError, ValueError) as error:
        raise type(error)(f"in {path}: {error}") from None
    return plan, lr, _loader_settings(section, data_sampling, path)


def _find_section(config: Any) -> tuple[Mapping, Mapping, Mapping]:
    """``(data_efficiency, data_sampling, dynamic_batching)`` of a DeepSpeed config; the first two may be empty."""
    nodes, path = [config], "the DeepSpeed config"  # the objects along the section's key path; where the last is
    for key in _SECTION:
        if not isinstance(nodes[-1], Mapping):
            raise ValueError(f"{path} should be a JSON object (a dict), but is {nodes[-1]!r:.60}")
        path = ".".join(_SECTION[: len(nodes)])
        nodes.append(nodes[-1].get(key, {} if key != "dynamic_batching" else None))
    section = nodes[-1]
    if section is None:
        raise ValueError(f'the DeepSpeed config has no {path} section; add one with "enabled": true and "max_tokens"')
    if not isinstance(section, Mapping):
        raise ValueError(f"{path} should be a JSON object (a dict), but is {section!r:.60}")
    return nodes[1], nodes[2], section


def _check_section_keys(section: Mapping, path: str) -> None:
    """The section's keys are known ones, it is enabled, has max_tokens and at most one picking order."""
    known = (*_PLAN_KEYS, *_LR_DEFAULTS, *_OTHER_KEYS)
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown key {key!r} in {path}{hint} (valid keys: {', '.join(known)})")
    if section.get("enabled") is not True:
        raise ValueError(
            f'{path}.enabled is {section.get("enabled")!r}, not true (a JSON boolean); set "enabled": '
            f"true to use dynamic batching"
        )
    if "max_tokens" not in section:
        raise ValueError(f"{path}.max_tokens is missing; set it to the tokens one micro-batch may hold")
    orders = {section[key] for key in ("sequence_picking_order", "sentence_picking_order") if key in section}
    if len(orders) > 1:
        raise ValueError(
            f"{path} sets sequence_picking_order and its older spelling sentence_picking_order to "
            f"different values {sorted(map(str, orders))}; keep one"
        )


def _check_batch_geometry(k: int, micro: int, gas: int, world: int, fix: str) -> None:
    """DeepSpeed's batch relation: train_batch_size = micro-batches per rank's step x accumulation steps x ranks."""
    if k != micro * gas * world:
        raise ValueError(
            f"train_batch_size={k} should be train_micro_batch_size_per_gpu x gradient_accumulation_steps"
            f" x data-parallel size = {micro} x {gas} x {world}; {fix}"
        )


def _loader_settings(section: Mapping, data_sampling: Mapping, path: str) -> dict:
    """The section's loader settings, checked; ``num_workers`` and ``pin_memory`` default to data_sampling's."""
    settings = {
        "metrics_path": section.get("metrics_path"),
        "verbose": section.get("verbose", False),
        "num_workers": section.get("num_workers", data_sampling.get("num_workers", 0)),
        "pin_memory": section.get("pin_memory", data_sampling.get("pin_memory", False)),
    }
    for key, value in settings.items():
        where = path if key in section else ".".join(_SECTION[:2])  # num_workers, pin_memory: data_sampling's
        try:
            if key == "num_workers":
                _check_int(key, value)
            elif key == "metrics_path" and value is not None and not isinstance(value, str):
                raise TypeError(f"metrics_path should be a folder path (a string), but got metrics_path={value!r}")
            elif key != "metrics_path" and not isinstance(value, bool):
                raise TypeError(f"{key} should be true or false, but got {key}={value!r}")
        except (TypeError, ValueError) as error:
            raise type(error)(f"in {where}: {error}") from None
    return settings


def _dataset_seqlens(dataset, metrics_path: str | None, batch_seqlens_fn, collate_fn) -> np.ndarray:
    """Seqlens from the cache in ``metrics_path`` (spot-checked), else computed once, sharded over ranks, cached."""
    if not hasattr(dataset, "__len__"):
        raise ValueError("the dataset has no __len__, so its seqlens cannot be computed; pass dataset_seqlens")
    num_samples = len(dataset)
    cached = _cached_seqlens(metrics_path, num_samples) if metrics_path else None
    if cached is not None and batch_seqlens_fn is not None and num_samples:
        # A cache outlives the dataset it was made for: recompute 16 entries (the same on every rank).
        ids = np.unique(np.linspace(0, num_samples - 1, min(num_samples, 16)).astype(np.int64))
        stale = np.flatnonzero(_seqlens_of(dataset, ids, batch_seqlens_fn, collate_fn) != cached[ids])
        if len(stale):
            _logger.warning(
                "the seqlen cache in %s disagrees with batch_seqlens_fn on sample %d: it is from another "
                "dataset; recomputing it",
                metrics_path,
                int(ids[stale[0]]),
            )
            cached = None
    if not all(_gather(cached is not None)):  # a cache some ranks lack or find stale (node-local disks): all compute
        cached = None
    if cached is not None:
        return cached
    if batch_seqlens_fn is None:
        raise ValueError(
            "no dataset_seqlens, no seqlen cache in metrics_path, and batch_seqlens_fn is None; pass "
            "dataset_seqlens, or batch_seqlens_fn (e.g. varbatch.seqlens_from_padded) to compute them once"
        )
    rank, world_size = _world()  # each rank measures every world_size-th sample, then all gather
    shard = np.arange(rank, num_samples, world_size, dtype=np.int64)
    seqlens = np.zeros(num_samples, dtype=np.int64)
    for ids, part in _gather((shard, _seqlens_of(dataset, shard, batch_seqlens_fn, collate_fn))):
        seqlens[ids] = part
    if metrics_path and rank == 0:
        os.makedirs(metrics_path, exist_ok=True)
        tmp = os.path.join(metrics_path, f".{_SEQLEN_CACHE}.{os.getpid()}.npy")
        np.save(tmp, seqlens)
        os.replace(tmp, os.path.join(metrics_path, _SEQLEN_CACHE))  # atomic: no rank reads half a file
    if world_size > 1:
        torch.distributed.barrier()
    return seqlens


def _seqlens_of(dataset, ids: np.ndarray, batch_seqlens_fn: Callable, collate_fn: Callable | None) -> np.ndarray:
    """``batch_seqlens_fn(collate_fn(samples))`` over the samples ``ids``, 256 at a time.

    As in DeepSpeed, ``batch_seqlens_fn`` gets a batch made by the training
    collate function (without one, by `PaddedCollate`) and returns one length per sample.
    """
    lengths = np.zeros(len(ids), dtype=np.int64)
    for start in range(0, len(ids), 256):
        chunk = ids[start : start + 256]
        got = batch_seqlens_fn((collate_fn or PaddedCollate())([dataset[int(i)] for i in chunk]))
        got = got.detach().cpu().reshape(-1).tolist() if isinstance(got, torch.Tensor) else list(got)
        if len(got) != len(chunk):
            raise ValueError(
                f"batch_seqlens_fn returned {len(got)} lengths for a batch of {len(chunk)} samples; it "
                f"must return one length per sample of the batch that dataloader_collate_fn made"
            )
        lengths[start : start + len(chunk)] = _as_counts(got, "batch_seqlens_fn's lengths")
    return lengths


def _cached_seqlens(metrics_path: str, num_samples: int) -> np.ndarray | None:
    """Seqlens cached in ``metrics_path`` (varbatch's .npy or DeepSpeed's metric files) for this many samples."""
    ours = os.path.join(metrics_path, _SEQLEN_CACHE)
    theirs = os.path.join(metrics_path, "seqlen", "seqlen_sample_to_metric")
    if os.path.exists(ours):
        seqlens = np.load(ours)
    elif os.path.exists(theirs + ".bin") and os.path.exists(theirs + ".idx"):  # DeepSpeed's DataAnalyzer: N x 1
        from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

        metric = MMapIndexedDataset(theirs, skip_warmup=True)
        seqlens = np.concatenate([np.asarray(metric[i]).reshape(-1) for i in range(len(metric))])
    else:
        return None
    if len(seqlens) != num_samples:
        _logger.warning(
            "the seqlen cache in %s has %d entries but the dataset %d samples: recomputing it",
            metrics_path,
            len(seqlens),
            num_samples,
        )
        return None
    return seqlens.astype(np.int64)
