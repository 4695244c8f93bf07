"""Tests of varbatch, in the order of DESIGN.md's contract.

Budget, order, shapes (pipeline, same size, same length, step inputs), nothing lost, LR, loss
weights, seqlens source, resume, bad input (one table per entry point); then the ``plan``
command, then the runs launched with several processes (marked ``slow``, at the end).

Run: ``python -m pytest -q test_varbatch.py test_conformance.py`` (CI's command: everything, a few minutes on two
cores) or ``python -m pytest -q -m "not slow" test_varbatch.py`` (about a minute). Comparisons
with DeepSpeed's own module import DeepSpeed inside the tests and skip where it is missing. The launched runs share
their launches: all of them run, two at a time, when the first slow test asks (about two minutes), so one slow test
picked with ``-k`` costs as much as all of them.
"""

import ast
import collections
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import io
import itertools
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
import unittest.mock
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

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

settings.register_profile(
    "varbatch",
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("varbatch")

# The choices varbatch accepts (its own lists are private).
ORDERS = ("dataloader", "seqlen", "random", "bucket")
BUDGETS = ("sum", "padded")
DROP_REASONS = ("over_budget", "min_batch_size", "tail", "filtered")
LR_METHODS = ("linear", "sqrt", "none")
PUBLIC_NAMES = {
    # DeepSpeed's names
    "batch_by_seqlens",
    "scale_lr",
    "dataloader_for_variable_batch_size",
    "VariableBatchSizeLR",
    "lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
    # varbatch's own
    "Batch",
    "Plan",
    "plan_batches",
    "VariableBatchSampler",
    "make_dataloader",
    "PaddedCollate",
    "pad_sample",
    "seqlens_from_padded",
    "micro_batch_loss_weight",
    "hf_trainer_lr_scheduler",
    "FlatCollate",
    "check_padding_free",
}
_ROOT = os.path.dirname(os.path.abspath(__file__))


def _lengths(n, low=1, high=40, seed=0):
    """``n`` reproducible seqlens in ``[low, high]``."""
    return np.random.default_rng(seed).integers(low, high + 1, n).tolist()


def _first_seed(holds, seeds=range(1000)):
    """The first seed of a random-order case for which ``holds(seed)``: the case's could-not-fail condition, found
    rather than assumed of one seed (any change to the random orders moves every seed's plan)."""
    return next(seed for seed in seeds if holds(seed))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deepspeed_module():
    """DeepSpeed's own variable_batch_size_and_lr module (skips the test without DeepSpeed)."""
    return pytest.importorskip("deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr")


def _optimizer(lr=0.1):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _id_dataset(seqlens):
    """Sample i is ``torch.full((seqlens[i],), i + 1)``: every row of a padded batch names its sample (pad 0)."""
    return [torch.full((n,), i + 1) for i, n in enumerate(seqlens)]


def _ids_of(x):
    """The sample ids of the rows of a batch collated from `_id_dataset`."""
    return (x[:, 0] - 1).tolist()


class _Engine:
    """What the DeepSpeed glue reads from an engine: its raw config, batch sizes, optimizer, scheduler."""

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
    """A config whose dynamic_batching section holds ``section`` (B_ref "mean": no unit-trap warning)."""
    dynamic_batching = {"enabled": True, "max_tokens": 16, "lr_scaling_reference": "mean", **section}
    return {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "data_efficiency": {"data_sampling": {"dynamic_batching": dynamic_batching}},
    }


_GLUE_SEQLENS = [3, 5, 2, 7, 4, 6, 1, 8]


def _glue(config, dataset=None, **kwargs):
    """The DeepSpeed glue on a stand-in engine: ``(engine, (dataloader, lr_scheduler, deepspeed_io_kwargs))``."""
    engine = _Engine(config, optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    dataset = dataset if dataset is not None else [torch.ones(n) for n in _GLUE_SEQLENS]
    return engine, varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine, **kwargs)


# transformers is imported inside the functions and tests that use it: its import takes seconds.
def _hf_arguments(output_dir, **arguments):
    """HF TrainingArguments for the tests' Trainers: on the CPU, offline, quiet, the dataset's extra columns kept;
    nothing logged or saved unless ``arguments`` say so."""
    import transformers

    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_pin_memory=False,
        **{"logging_strategy": "no", "save_strategy": "no", **arguments},
    )


def _tiny_llama_config(**options):
    """The tests' tiny LlamaForCausalLM (one layer, width 16, vocabulary 64), built from a config: no download."""
    import transformers

    sizes = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=64)
    return transformers.LlamaConfig(**sizes, **options)


# =============================================================================
# The module
# =============================================================================


@pytest.mark.parametrize("module", ["varbatch", pytest.param("plan", marks=pytest.mark.project)])
def test_docstring_examples_run(module):
    """Every example in varbatch.py's and plan.py's docstrings prints what it shows."""
    import doctest

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result


def test_import_defines_names_only():
    """Importing varbatch prints nothing, leaves logging unconfigured, and imports no DeepSpeed, transformers or
    matplotlib."""
    code = (
        "import logging, sys, varbatch; "
        "assert not logging.getLogger().handlers and not logging.getLogger('varbatch').handlers; "
        "loaded = [m for m in ('deepspeed', 'transformers', 'matplotlib') if m in sys.modules]; assert not loaded, loaded; "
        "missing = [n for n in varbatch.__all__ if not hasattr(varbatch, n)]; assert not missing, missing"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""


def test_public_api_is_the_nineteen_names():
    """__all__ is exactly the 19 public names, and every other name varbatch defines starts with '_'."""
    assert sorted(varbatch.__all__) == sorted(PUBLIC_NAMES) and len(varbatch.__all__) == 19
    own = [
        name
        for name, value in vars(varbatch).items()
        if getattr(value, "__module__", None) == "varbatch" and not name.startswith("_")
    ]
    assert sorted(own) == sorted(PUBLIC_NAMES), sorted(set(own) - PUBLIC_NAMES)


def _top_level_names(tree):
    """``(name, statement)`` of each name a module defines at its top level: functions, classes, assigned names."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            yield node.name, node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [name for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]
            yield from ((name.id, node) for name in names)


def _evaluated_at_import(node):
    """The expressions of a module-level statement that Python evaluates when it runs: a function's decorators and
    defaults (not its body or annotations, which `from __future__ import annotations` leaves unevaluated), a class's
    bases, keywords, decorators and body statements, any other statement whole."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
    if isinstance(node, ast.ClassDef):
        inside = [part for item in node.body for part in _evaluated_at_import(item)]
        return [*node.decorator_list, *node.bases, *(k.value for k in node.keywords), *inside]
    if isinstance(node, ast.AnnAssign):
        return [node.value] if node.value is not None else []
    return [node]


def test_varbatch_runs_no_name_before_its_definition():
    """Every module-level statement of varbatch.py uses only names defined above it (what Python needs to import
    it); function bodies may call what a part defines below them, so each part reads top-down."""
    tree = ast.parse(Path(_ROOT, "varbatch.py").read_text(encoding="utf-8"))
    defined = {}  # module-level name -> the line of its first definition
    for name, node in _top_level_names(tree):
        defined.setdefault(name, node.lineno)
    early = [
        f"line {name.lineno}: {name.id} (defined at line {defined[name.id]})"
        for node in tree.body
        for expression in _evaluated_at_import(node)
        for name in ast.walk(expression)
        if isinstance(name, ast.Name) and defined.get(name.id, 0) > node.lineno
    ]
    assert not early, "names used before their definition:\n" + "\n".join(early)


_PARTS = ("I", "II", "III", "IV")


def _part_one_reach(source: str) -> tuple[list[str], bool]:
    """What Part I refers to (by `ast`, bodies included) of Parts II-IV but the fast form `_pack_rows_fast` that its
    one dispatch runs, and whether it runs that form; the parts' banners come in order."""
    lines = source.splitlines()
    banners = [next(i + 1 for i, line in enumerate(lines) if line.startswith(f"# Part {part}. ")) for part in _PARTS]
    assert banners == sorted(banners), f"the parts are out of order: {banners}"
    tree = ast.parse(source)
    owner = {}  # module-level name -> its part (0: the header and the argument checks before Part I)
    for name, node in _top_level_names(tree):
        owner.setdefault(name, sum(node.lineno > banner for banner in banners))
    reached = set()  # (name, its part) of every module-level name Part I refers to
    for node in tree.body:
        if banners[0] < node.lineno < banners[1]:
            reached |= {(n.id, owner[n.id]) for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in owner}
    later = sorted(name for name, part in reached if part >= 2 and name != "_pack_rows_fast")
    return later, ("_pack_rows_fast", 2) in reached


def test_part_one_is_the_technique_on_its_own():
    """varbatch.py has its four parts in order, marked by banners; Part I's definitions refer to nothing of Parts
    III and IV and, of Part II, only to the greedy rule's fast form, which its one dispatch runs."""
    later, dispatches = _part_one_reach(Path(_ROOT, "varbatch.py").read_text(encoding="utf-8"))
    assert not later, f"Part I refers to definitions of the later parts: {later}"
    assert dispatches, "Part I should run the greedy rule's fast form of Part II on large epochs"


def test_the_part_check_finds_a_reference_to_a_later_part():
    """The check above names a Part III definition that Part I calls."""
    lines = [
        "# Part I. The technique",
        "def plan():",
        "    return _pack_rows_fast(glue)()",
        "# Part II. The speed paths",
        "def _pack_rows_fast(f):",
        "    return f",
        "# Part III. Glue",
        "def glue():",
        "    return 1",
        "# Part IV. Adapters",
        "x = 1",
    ]
    assert _part_one_reach("\n".join(lines)) == (["glue"], True)
    lines[2] = "    return 1"
    assert _part_one_reach("\n".join(lines)) == ([], False)


# =============================================================================
# 1. Budget
# =============================================================================


@st.composite
def plan_cases(draw, orders=("dataloader", "seqlen"), max_n=40, max_len=20):
    """Keyword arguments of plan_batches: lengths, budgets, step-input and batch geometry, bounds, subsets."""
    n = draw(st.integers(1, max_n))
    seqlens = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    budget = draw(st.sampled_from(BUDGETS))
    same_size = draw(st.booleans())
    same_length = draw(st.booleans())
    if budget == "padded" and same_length:
        same_size = True
    micro_batch_size = draw(st.integers(1, 2))
    step_inputs = draw(st.integers(1, 3))  # per batch: accumulation steps x ranks
    num_replicas = draw(st.sampled_from([r for r in (1, 2, 3) if step_inputs % r == 0]))
    min_bs = draw(st.integers(1, 3))
    packing = draw(st.sampled_from([None, "greedy", "best_fit"]))
    if packing == "best_fit":  # where best fit applies (NOTE [best fit])
        budget, same_size, min_bs = "sum", False, 1
    max_bs = draw(st.one_of(st.none(), st.integers(min_bs, 8)))
    sample_ids = None
    if draw(st.booleans()):
        sample_ids = draw(st.permutations(range(n)).flatmap(lambda p: st.integers(1, n).map(lambda m: p[:m])))
    return dict(
        seqlens=seqlens,
        max_tokens=draw(st.integers(1, 3 * max_len)),
        effective_batch_size=micro_batch_size * step_inputs,
        micro_batch_size=micro_batch_size,
        num_replicas=num_replicas,
        budget=budget,
        order=draw(st.sampled_from(orders)),
        packing=packing,
        min_batch_size=min_bs,
        max_batch_size=max_bs,
        sample_ids=sample_ids,
        same_size=same_size,
        same_length=same_length,
        seed=draw(st.integers(0, 3)),
        epoch=draw(st.integers(0, 3)),
        bucket_size=draw(st.none() | st.integers(1, 8)),  # None: the default window
    )


def _case(seqlens, max_tokens, **options):
    """A plan case with the defaults of `plan_cases` (for @example)."""
    case = dict(
        seqlens=seqlens,
        max_tokens=max_tokens,
        effective_batch_size=1,
        micro_batch_size=1,
        num_replicas=1,
        budget="sum",
        order="dataloader",
        packing=None,
        min_batch_size=1,
        max_batch_size=None,
        sample_ids=None,
        same_size=False,
        same_length=False,
        seed=0,
        epoch=0,
        bucket_size=4,
    )
    case.update(options)
    return case


def _plan_or_none(case):
    """plan_batches(**case), or None when the case has too few samples for one batch."""
    try:
        return plan_batches(**case)
    except ValueError as error:
        if "not enough samples for one batch" in str(error) or "every sample is longer" in str(error):
            return None
        raise


def _settings_of(case):
    """The `_Settings` and sample ids of a plan case."""
    options = {key: value for key, value in case.items() if key not in ("seqlens", "sample_ids", "epoch")}
    ids = None if case["sample_ids"] is None else np.asarray(case["sample_ids"], np.int64)
    return varbatch._Settings.of(**options), ids


def _tensor_seqlens(plan, seqlens):
    """Per micro-batch, the S of the tensor it is collated into, recomputed from DESIGN.md section 1.

    A step input (``micro_batch_size`` consecutive micro-batches) is one ``B x S`` tensor, S its
    longest sample; in same-length mode every sample of a batch is padded to the batch's longest.
    """
    k, m = plan.effective_batch_size, plan.settings.micro_batch_size
    mbs = plan.microbatches()
    span = k if plan.settings.same_length else m
    return [
        max(seqlens[i] for mb in mbs[j // span * span : (j // span + 1) * span] for i in mb) for j in range(len(mbs))
    ]


def _assert_valid_plan(plan, case):
    """Every budget and bound of DESIGN.md holds in ``plan``, its statistics and totals describe its batches, and every
    sample is packed once or dropped once with a reason (fewer than k as tail where min_batch_size is 1)."""
    lens = case["seqlens"]
    k, m = plan.effective_batch_size, plan.settings.micro_batch_size
    mbs = plan.microbatches()
    tensor_s = _tensor_seqlens(plan, lens)
    for j, mb in enumerate(mbs):
        cost = sum(lens[i] for i in mb) if case["budget"] == "sum" else len(mb) * tensor_s[j]
        assert cost <= case["max_tokens"], f"micro-batch {j} costs {cost} > max_tokens={case['max_tokens']}"
        assert case["min_batch_size"] <= len(mb) <= (case["max_batch_size"] or len(mb)), f"micro-batch {j}: {mb}"
    assert plan.padded_seqlens.tolist() == tensor_s, "padded_seqlens is not the S of each micro-batch's tensor"
    assert len(mbs) == plan.num_microbatches == k * plan.num_batches
    for b in range(plan.num_batches):
        batch = mbs[b * k : (b + 1) * k]
        ids = [i for mb in batch for i in mb]
        assert [plan.batch_sizes[b], plan.batch_tokens[b], plan.batch_max_seqlens[b]] == [
            len(ids),
            sum(lens[i] for i in ids),
            max(lens[i] for i in ids),
        ]
        if case["same_size"]:
            assert len({len(mb) for mb in batch}) == 1, f"batch {b} is not of one size: {batch}"
    # totals() names the largest B x S tensor a forward pass sees, against its bound (the padded budget holds it)
    step_inputs = [sum(len(mbs[j]) * tensor_s[j] for j in range(g, g + m)) for g in range(0, len(mbs), m)]
    largest = plan.totals()["largest_step_input"]
    assert largest["tokens"] == max(step_inputs) == largest["sequences"] * largest["padded_seqlen"]
    assert largest["bound"] == m * case["max_tokens"]
    assert case["budget"] == "sum" or largest["tokens"] <= largest["bound"]
    packed = plan.sample_ids.tolist()
    dropped = [i for ids in plan.dropped.values() for i in ids.tolist()]
    assert sorted(packed + dropped) == list(range(len(lens))), "a sample is lost or twice in the plan"
    assert set(plan.dropped) == set(DROP_REASONS) and plan.num_dropped == len(dropped)
    if case["min_batch_size"] == 1:
        assert len(plan.dropped["tail"]) < k and len(plan.dropped["min_batch_size"]) == 0


# the audit's padded case: one long sample per step input of 33 samples
_LONG_AMONG_SHORT = [1] * 64 + [64] + [1] * 64 + [64]
# Every plan, of every epoch, in every order, holds `_assert_valid_plan`:
# test_every_epoch_has_epoch_0s_batches_and_holds_every_budget and test_plan_matches_oracle (section 4).


# -- a sample's len() means nothing: the seqlens are the truth -------------------


def _text_collate(samples):
    """Tokenizes text in the collate (one token per word): a sample's len() counts characters."""
    tokens = [torch.tensor([len(word) for word in text.split()]) for text in samples]
    return torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True)


def _bos_eos_collate(samples):
    """Adds BOS and EOS tokens: the tensor is 2 longer than the planned seqlen."""
    return PaddedCollate()([torch.cat([torch.tensor([101]), torch.as_tensor(s), torch.tensor([102])]) for s in samples])


@pytest.mark.parametrize(
    "kind", ["dicts, in pipeline mode", "text tokenized in the collate", "(label, tokens) tuples", "BOS/EOS collate"]
)
def test_a_samples_len_means_nothing(kind):
    """Samples whose len() is not their token count are planned by their seqlens and all trained once; in pipeline
    mode dict samples are padded field by field (labels with -100) and their real lengths reported."""
    seqlens = _lengths(30, 1, 9, seed=12)
    sampler = VariableBatchSampler(seqlens, 20, order="random", seed=2)
    padding = None
    if kind == "dicts, in pipeline mode":  # the audit's example: len() counts the keys
        data = [
            {"input_ids": torch.full((n,), i + 1), "labels": torch.arange(n), "id": i} for i, n in enumerate(seqlens)
        ]
        collate = PaddedCollate()
        padding = functools.partial(pad_sample, pad_value={"labels": -100})
        pipeline = dict(gradient_accumulation_steps=2, budget="padded", same_size=True, same_length=True)
        sampler = VariableBatchSampler(seqlens, 20, order="random", seed=2, **pipeline)
    elif kind == "text tokenized in the collate":
        data = [" ".join(["w" * (i % 5 + 1)] * n) for i, n in enumerate(seqlens)]
        collate = _text_collate
    elif kind == "(label, tokens) tuples":
        data = [(i, torch.full((n,), i + 1)) for i, n in enumerate(seqlens)]
        collate = PaddedCollate()
    else:
        data = [list(range(1, n + 1)) for n in seqlens]
        collate = _bos_eos_collate
    plan = sampler.plan
    planned = [list(step) for step in plan.microbatches()]
    batches = list(make_dataloader(data, sampler, collate_fn=collate, sample_padding_fn=padding))
    assert len(batches) == len(planned)
    for j, (ids, batch) in enumerate(zip(planned, batches)):
        if kind == "dicts, in pipeline mode":
            lens = batch["seqlens"].tolist()
            assert batch["id"].tolist() == ids and lens == [seqlens[i] for i in ids]
            assert batch["input_ids"].shape[1] == batch["labels"].shape[1] == plan.batch_max_seqlens[j // 2]
            for row, n in zip(batch["labels"], lens):
                assert row[:n].tolist() == list(range(n)) and (row[n:] == -100).all()
        elif kind == "text tokenized in the collate":
            assert batch.shape == (len(ids), max(seqlens[i] for i in ids))
        elif kind == "(label, tokens) tuples":
            labels, _tokens, lens = batch
            assert labels.tolist() == ids and lens.tolist() == [seqlens[i] for i in ids]
        else:
            _padded, lens = batch
            assert lens.tolist() == [seqlens[i] + 2 for i in ids]
    assert sorted(i for ids in planned for i in ids) == list(range(30))


# -- a collate that adds tokens the seqlens do not count -----------------------


def _eos_collate(samples, form):
    """Appends an EOS token (-1) to every sample, as TRL's collator does, and returns the batch as ``form``."""
    batch = PaddedCollate()([torch.cat([torch.as_tensor(s), torch.tensor([-1])]) for s in samples])
    x, lengths = batch
    forms = {
        "PaddedCollate's": batch,
        "a tensor": x,
        "(x, lengths)": (x, lengths),
        "a dict's input_ids": {"seqlens": lengths, "input_ids": x},
        "a dict's first sequence field": {"label": lengths, "tokens": x, "mask": x != 0},
        "nested tuples": ((lengths, x), x),
    }
    return forms[form]


def _first_over(plan, seqlens, bound):
    """The first step input (of one micro-batch) whose tensor is over ``bound`` once an EOS is appended."""
    sizes = [len(ids) * (max(seqlens[i] for i in ids) + 1) for ids in plan.microbatches()]
    return next((t for t, size in enumerate(sizes) if size > bound), len(sizes))


def _error_after(loader):
    """``(step inputs yielded, message)`` of the ValueError iterating ``loader`` raises (message None: none).

    The exception's traceback is dropped at once: it holds the loader's iterator in a reference cycle (torch's
    re-raising frame holds the exception), and the garbage collector's shutdown of its worker processes waits
    out torch's timeouts (10 s); freed by reference counting, the iterator shuts them down at once."""
    yielded = 0
    try:
        for _ in loader:
            yielded += 1
    except ValueError as error:
        error.__traceback__ = None
        return yielded, str(error)
    return yielded, None


@pytest.mark.parametrize(
    ("form", "workers"),
    [
        ("PaddedCollate's", 0),
        ("PaddedCollate's", 2),
        ("a tensor", 0),
        ("(x, lengths)", 0),
        ("a dict's input_ids", 0),
        ("a dict's first sequence field", 2),
        ("nested tuples", 0),
    ],
)
def test_a_collate_that_adds_tokens_is_refused_at_its_first_step_input_over_the_padded_budget(form, workers):
    """budget='padded': a collated tensor over micro_batch_size x max_tokens stops the loader at that step input,
    naming the cause (the audit: 95 of 256 step inputs over, the largest 1.66x, silently)."""
    seqlens = _lengths(256, 2, 30, seed=3)
    sampler = VariableBatchSampler(seqlens, 64, budget="padded", order="bucket", seed=1)
    first = _first_over(sampler.plan, seqlens, 64)
    assert first < sampler.plan.num_batches, "no step input goes over: the test proves nothing"
    collate = functools.partial(_eos_collate, form=form)
    loader = make_dataloader(_id_dataset(seqlens), sampler, collate_fn=collate, num_workers=workers)
    yielded, message = _error_after(loader)
    assert yielded == first and "collate_fn adds tokens the seqlens do not count" in message
    assert f"step input {first} of epoch 0" in message and "max_tokens = 64" in message


@pytest.mark.parametrize("case", ["the seqlens count the EOS", "the sum budget", "two micro-batches per step input"])
def test_a_collate_that_adds_tokens_the_seqlens_count_trains_every_step_input(case):
    """Siblings that go on: seqlens that count what the collate adds (the README's step 1), the sum budget (it
    bounds sums, not tensors), and step inputs of two micro-batches, bounded by 2 x max_tokens."""
    seqlens = _lengths(256, 2, 30, seed=3)
    planned = [n + 1 for n in seqlens] if case == "the seqlens count the EOS" else seqlens
    options = dict(budget="sum" if case == "the sum budget" else "padded", order="bucket", seed=1)
    if case == "two micro-batches per step input":
        planned = [n + 1 for n in seqlens]
        options["micro_batch_size"] = 2
    sampler = VariableBatchSampler(planned, 64, **options)
    collate = functools.partial(_eos_collate, form="PaddedCollate's")
    batches = list(make_dataloader(_id_dataset(seqlens), sampler, collate_fn=collate))
    assert len(batches) == sampler.plan_for_epoch(0).num_batches
    largest = max(x.shape[0] * x.shape[1] for x, _ in batches)
    if case == "the seqlens count the EOS":
        assert largest <= 64
    else:  # over max_tokens: within the bound of two micro-batches, or unbounded under the sum budget
        assert largest > 64 and (largest <= 2 * 64 or case == "the sum budget")


# -- the plain and the fast forms (NOTE [one dispatch]) -------------------------------------------------------------


def _in_form(form, chunk, **case):
    """plan_batches(**case) with the greedy rule in ``form``, "plain" or "fast" (over chunks of ``chunk`` positions),
    whatever its size (NOTE [one dispatch]), or None without a batch; checks that the dispatch ran that form."""
    fast = varbatch._pack_rows_fast
    ran = []

    def counted(lens, settings):
        ran.append(len(lens))
        return fast(lens, settings)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(varbatch, "_PLAIN_UP_TO", 10**9 if form == "plain" else 0)
        patch.setattr(varbatch, "_CHUNK", chunk)
        patch.setattr(varbatch, "_pack_rows_fast", counted)
        plan = _plan_or_none(case)
    greedy = plan is not None and not plan.settings.best_fit  # best fit has one form (section 4b)
    assert not greedy or bool(ran) == (form == "fast"), f"the {form} form asked for; the fast one ran: {ran}"
    return plan


def _plan_arrays(plan):
    """Everything a plan holds, as plain data with its arrays' dtypes, to compare plans exactly (None: no plan)."""
    if plan is None:
        return None
    names = ("sample_ids", "microbatch_offsets", "padded_seqlens", "batch_sizes", "batch_tokens", "batch_max_seqlens")
    arrays = [(getattr(plan, name).dtype.str, getattr(plan, name).tolist()) for name in names]
    return [*arrays, {reason: ids.tolist() for reason, ids in plan.dropped.items()}]


@st.composite
def greedy_cases(draw):
    """Plan cases in index order: up to 120 lengths within max_tokens (some at it, many tied), a budget, bounds, and
    batches of one micro-batch or of 2 to 6 same-size ones, padded in groups of any divisor."""
    max_tokens = draw(st.integers(1, 64))
    short = draw(st.integers(1, max_tokens))
    seqlens = draw(
        st.lists(
            st.sampled_from(sorted({1, short, max(1, max_tokens // 2), max_tokens})) | st.integers(1, max_tokens),
            min_size=1,
            max_size=120,
        )
    )
    width = draw(st.sampled_from([1, 1, 2, 3, 4, 6]))  # one micro-batch a batch as often as two to six
    min_bs = draw(st.integers(1, 4))
    return _case(
        seqlens,
        max_tokens,
        budget=draw(st.sampled_from(BUDGETS)),
        min_batch_size=min_bs,
        max_batch_size=draw(st.one_of(st.none(), st.integers(min_bs, 12))),
        effective_batch_size=width,
        micro_batch_size=draw(st.sampled_from([g for g in range(1, width + 1) if width % g == 0])),
        same_size=width > 1,
    )


@given(
    case=plan_cases(orders=ORDERS) | greedy_cases(),
    chunk=st.sampled_from([1, 2, 3, 7, 16, 2**16]),
    epoch=st.integers(0, 3),
)
@settings(max_examples=200)
def test_the_fast_form_plans_as_the_plain_form(case, chunk, epoch):
    """The greedy rule's fast form (NOTE [the greedy rule, vectorized], NOTE [interleaved blocks, vectorized]), over
    chunks of any size, gives the plain form's plan: the same arrays, dtypes and drops, in every order, budget and
    shape (NOTE [one dispatch]); the plain loop of one micro-batch to a block, `_greedy_rows`, places what its
    generalization to blocks, `_pack_rows`, places (the plain form against the oracle: test_plan_matches_oracle)."""
    case = {**case, "epoch": epoch}
    assert _plan_arrays(_in_form("fast", chunk, **case)) == _plan_arrays(_in_form("plain", chunk, **case))
    settings, _ = _settings_of(case)
    if settings.unit_width == 1:
        lens = np.array(case["seqlens"], np.int64)
        greedy = varbatch._greedy_rows(lens, settings)  # (the blocks' table, positions too small, the tail's start)
        blocks = varbatch._pack_rows(lens, settings)
        assert (greedy[0].tolist(), *greedy[1:]) == (blocks[0].tolist(), *blocks[1:])


def _bits(bound):
    """Bits that hold 0 .. bound - 1, at least one (the oracle's own count)."""
    return max(1, len(bin(bound - 1)) - 2) if bound > 1 else 1


def _oracle_random_order(ids, rng, key_bits=64):
    """NOTE [the orders, as sorts], slowly: each id draws random bits; ids ordered by (bits, id)."""
    id_bits = _bits(max(ids, default=0) + 1)
    noise = rng.integers(0, 2 ** (key_bits - id_bits), len(ids), dtype=np.uint64).tolist()
    return [i for _, i in sorted(zip(noise, ids))]


def _oracle_bucket_order(ids, lengths, window, rng, key_bits=64):
    """NOTE [the orders, as sorts], slowly: each id draws a window of ceil(N / window) and random bits from what
    window, length and id leave of the key's bits; ids ordered by window, then length (descending in odd windows),
    then those bits, then id. Returns the ids and their lengths in that order."""
    windows = max(1, math.ceil(len(ids) / window))
    spare = max(0, key_bits - _bits(windows) - _bits(max(lengths, default=0) + 1) - _bits(max(ids, default=0) + 1))
    drawn = rng.integers(0, windows << spare, len(ids), dtype=np.uint64).tolist()
    rows = sorted(
        zip(drawn, ids, lengths),
        key=lambda row: (row[0] >> spare, -row[2] if (row[0] >> spare) % 2 else row[2], row[0] % 2**spare, row[1]),
    )
    return [i for _, i, _ in rows], [length for _, _, length in rows]


@given(
    seqlens=st.lists(st.integers(1, 40), min_size=1, max_size=300),
    order=st.sampled_from(["random", "bucket"]),
    seed=st.integers(0, 2**32 - 1),
    bucket_size=st.integers(1, 50),
    key_bits=st.sampled_from([64, 12]),
)
# window, length and id bits beyond a key of 12 bits: the fields sorted one after another
@example(
    seqlens=[35, 3, 29, 1, 37, 2, 28, 4, 36, 10, 20, 22, 33, 17, 5, 9],
    order="bucket",
    seed=1,
    bucket_size=1,
    key_bits=12,
)
def test_random_orders_sort_random_keys(seqlens, order, seed, bucket_size, key_bits):
    """One sample per batch, the samples given in reverse: the random orders pick them as the slow oracles sort
    their keys (NOTE [the orders, as sorts]), drawn from (seed, epoch 0, the plans' stream); `bucket` then shuffles
    the batches with the next draw of the same generator. With keys of 12 bits the `bucket` fields often need
    more: their sort one field after another (NOTE [the orders, as packed keys]) gives the same order."""
    ids = list(range(len(seqlens)))[::-1]  # not the positions themselves
    rng = np.random.default_rng((seed, 0, varbatch._PLAN_STREAM))
    if order == "random":
        expected = _oracle_random_order(ids, rng, key_bits)
    else:
        expected, _ = _oracle_bucket_order(ids, [seqlens[i] for i in ids], bucket_size, rng, key_bits)
        expected = [expected[b] for b in rng.permutation(len(expected))]
    case = dict(seqlens=seqlens, max_tokens=64, order=order, seed=seed, bucket_size=bucket_size, max_batch_size=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(varbatch, "_KEY_BITS", key_bits)
        plan = plan_batches(**case, sample_ids=ids)
    assert plan.sample_ids.tolist() == expected


# =============================================================================
# 2. Order
# =============================================================================
# The dataloader and seqlen orders (ascending, ties by id, whatever the order of sample_ids): the oracle's, section 4.


@pytest.mark.parametrize("order", ["random", "bucket"])
@given(seqlens=st.lists(st.integers(1, 30), min_size=30, max_size=80), seed=st.none() | st.integers(0, 10**6))
@settings(max_examples=20)
def test_random_orders_change_with_epoch(order, seqlens, seed):
    """random and bucket orders draw a new order each epoch, the same for a given (seed, epoch); no seed is a fixed
    seed, never an unseeded generator."""
    plans = [plan_batches(seqlens, 40, order=order, seed=seed, epoch=e, bucket_size=4) for e in (0, 1, 0)]
    assert plans[0].sample_ids.tolist() != plans[1].sample_ids.tolist()
    assert plans[0].fingerprint() == plans[2].fingerprint()


def test_bucket_order_is_random_with_little_padding():
    """order='bucket' pads far less than 'random' (its new order each epoch, its batches shuffled: the random
    orders' tests above)."""
    seqlens = np.clip(np.random.default_rng(3).lognormal(3.5, 0.8, 3000), 2, 256).astype(int)
    options = dict(effective_batch_size=2, budget="padded", seed=4, bucket_size=256)
    efficiency = {
        order: plan_batches(seqlens, 512, order=order, **options).totals()["efficiency"]
        for order in ("random", "bucket")
    }
    assert efficiency["bucket"] > efficiency["random"] + 0.15, efficiency


def test_both_spellings_of_the_picking_order_are_read():
    """sentence_picking_order (DeepSpeed's older key) and sequence_picking_order give the same plan."""
    _, (old, _, _) = _glue(_glue_config(sentence_picking_order="seqlen"), dataset_seqlens=_GLUE_SEQLENS)
    _, (new, _, _) = _glue(_glue_config(sequence_picking_order="seqlen"), dataset_seqlens=_GLUE_SEQLENS)
    expected = plan_batches(_GLUE_SEQLENS, 16, effective_batch_size=2, order="seqlen", seed=1234)
    for loader in (old, new):
        assert loader.variable_batch_sampler.plan.microbatches() == expected.microbatches()
    assert expected.microbatches() != plan_batches(_GLUE_SEQLENS, 16, effective_batch_size=2).microbatches()


@pytest.mark.parametrize(
    "data_efficiency_seed, expected_seed",
    [(None, 1234), (7, 7)],
    ids=["no data_efficiency seed", "data_efficiency seed 7"],
)
def test_a_null_config_seed_is_read_as_an_absent_one(data_efficiency_seed, expected_seed):
    """ "seed": null in the section plans with data_efficiency.seed (else 1234), as without the key; not with 0."""

    def planned(**seed):
        config = _glue_config(sequence_picking_order="random", **seed)
        if data_efficiency_seed is not None:
            config["data_efficiency"]["seed"] = data_efficiency_seed
        _, (loader, _, _) = _glue(config, dataset_seqlens=_GLUE_SEQLENS)
        return loader.variable_batch_sampler.plan.microbatches()

    expected = plan_batches(_GLUE_SEQLENS, 16, effective_batch_size=2, order="random", seed=expected_seed)
    assert planned(seed=None) == planned() == expected.microbatches()
    assert planned(seed=0) != expected.microbatches(), "seed 0 plans as the expected seed: the case shows nothing"


# The default window of the `bucket` order: a function of (seed, epoch) that sorts a small set whole. Its real tokens
# (>= 99% from 100k long-tailed samples) and fresh micro-batches (at 1M) are bench.py's targets (2d).


def _long_tailed(num_samples: int, seed: int) -> np.ndarray:
    """bench.py's long-tailed lengths: lognormal(5.5, 0.9) rounded and clipped to 8..4096."""
    raw = np.round(np.random.default_rng(seed).lognormal(5.5, 0.9, num_samples))
    return np.clip(raw, 8, 4096).astype(np.int64)


def test_default_bucket_window_sorts_a_small_set_whole():
    """At N = 2,000 long-tailed lengths the default window holds every sample: the plan of one sorted window."""
    seqlens = _long_tailed(2000, seed=0)
    for pipeline in (False, True):
        options = dict(
            effective_batch_size=8, budget="padded", order="bucket", same_size=pipeline, same_length=pipeline
        )
        plan = plan_batches(seqlens, 16384, epoch=1, **options)
        whole = plan_batches(seqlens, 16384, epoch=1, bucket_size=len(seqlens), **options)
        assert plan.microbatches() == whole.microbatches(), f"pipeline={pipeline}: not one sorted window"
        thirds = plan_batches(seqlens, 16384, epoch=1, bucket_size=667, **options)
        assert thirds.microbatches() != whole.microbatches(), "the case shows nothing: windows of a third plan alike"


# =============================================================================
# 3. Shapes: pipeline (same size, same length), step inputs, padding and collate
# =============================================================================


def _samplers(seqlens, max_tokens, num_replicas, **options):
    """A VariableBatchSampler for each rank (the drawn case is skipped where it has too few samples for one batch)."""
    try:
        return [
            VariableBatchSampler(seqlens, max_tokens, num_replicas=num_replicas, rank=rank, **options)
            for rank in range(num_replicas)
        ]
    except ValueError as error:
        assert "not enough samples" in str(error)
        assume(False)


@given(
    seqlens=st.lists(st.integers(1, 30), min_size=4, max_size=60),
    max_tokens=st.integers(30, 90),
    micro_batch_size=st.integers(1, 3),
    gas=st.integers(1, 2),
    num_replicas=st.integers(1, 2),
    order=st.sampled_from(ORDERS),
    budget=st.sampled_from(BUDGETS),
    pipeline=st.booleans(),
)
# the audit's case: 65 x 64 slots per step input before, 2 x 64 allowed
@example(
    seqlens=_LONG_AMONG_SHORT,
    max_tokens=64,
    micro_batch_size=2,
    gas=1,
    num_replicas=1,
    order="dataloader",
    budget="padded",
    pipeline=False,
)
@settings(max_examples=60)
def test_every_step_input_tensor_is_within_its_bound_and_of_its_batchs_shape(
    seqlens, max_tokens, micro_batch_size, gas, num_replicas, order, budget, pipeline
):
    """Each rank's loader yields B x S tensors of the plan's S with their samples' real lengths: under budget='padded'
    at most micro_batch_size x max_tokens; in pipeline mode (same size, same length) every step input of a
    batch has the same count per micro-batch and S = the batch's max seqlen."""
    options = dict(
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gas,
        budget=budget,
        order=order,
        seed=1,
        same_size=pipeline,
        same_length=pipeline,
    )
    dataset = _id_dataset(seqlens)
    for rank, sampler in enumerate(_samplers(seqlens, max_tokens, num_replicas, **options)):
        plan = sampler.plan
        loader = make_dataloader(dataset, sampler, collate_fn=PaddedCollate(), sample_padding_fn=pad_sample)
        for t, (x, lens) in enumerate(loader):
            j = (t * num_replicas + rank) * micro_batch_size  # the step input's first micro-batch in the plan
            assert lens.tolist() == [seqlens[i] for i in _ids_of(x)]
            assert x.shape[1] == plan.padded_seqlens[j]
            if budget == "padded":
                assert x.shape[0] * x.shape[1] <= micro_batch_size * max_tokens, f"rank {rank}, step input {t}"
            if pipeline:
                b = j // plan.effective_batch_size
                per_micro = plan.microbatch_sizes()[j]
                assert x.shape == (per_micro * micro_batch_size, plan.batch_max_seqlens[b]), f"step input {t}"


def _wrap(samples):
    """A user's wrapper without a seqlens parameter."""
    x, lengths = PaddedCollate()(samples)
    return x, lengths


def _wrap_given_seqlens(samples, seqlens=None):
    """A user's wrapper with a seqlens parameter: the loader gives it the plan's lengths."""
    x, lengths = PaddedCollate()(samples, seqlens=seqlens)
    return x, lengths


def _wrap_wrapper(samples):
    return _wrap([s.float() for s in samples])


class _WrappingCollate:
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, samples):
        return self.inner(samples)


def _wrap_with(collate, samples):
    return collate(samples)


_WRAPPERS = {
    "a function": _wrap,
    "a lambda": lambda samples: tuple(PaddedCollate()(samples)),
    "functools.partial": functools.partial(_wrap_with, PaddedCollate(seqlens_key=None)),
    "a class with __call__": _WrappingCollate(PaddedCollate()),
    "nested wrappers": _WrappingCollate(_wrap_wrapper),
    "a function with a seqlens parameter": _wrap_given_seqlens,
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("wrapper", list(_WRAPPERS))
def test_a_wrapping_collate_gets_the_real_lengths(wrapper, workers):
    """Same-length mode: PaddedCollate inside any collate_fn, given the loader's seqlens or called without them,
    reports the plan's real lengths, not the batch's S (the audit: 19 of 19 step inputs at padded lengths)."""
    seqlens = _lengths(64, 2, 20, seed=7)
    sampler = VariableBatchSampler(
        seqlens, 64, gradient_accumulation_steps=2, budget="padded", same_size=True, same_length=True
    )
    collate = _WRAPPERS[wrapper]
    loader = make_dataloader(
        _id_dataset(seqlens), sampler, collate_fn=collate, sample_padding_fn=pad_sample, num_workers=workers
    )
    batches = [batch[:2] for batch in loader]
    plan = sampler.plan_for_epoch(0)
    assert len(batches) == len(plan.microbatches())
    padded = 0
    for b, (x, lengths) in enumerate(batches):
        assert x.shape[1] == plan.batch_max_seqlens[b // 2]
        assert lengths.tolist() == [seqlens[i] for i in _ids_of(x.long())]
        padded += (lengths != x.shape[1]).any().item()
    assert padded, "every sample is as long as its batch's longest: the test proves nothing"


# -- step inputs and ranks -------------------------------------------------------------------------


def _step_inputs_oracle(plan, micro_batch_size):
    """Every rank's step inputs in the order dealt: step input g is micro-batches g*m .. g*m + m - 1."""
    mbs, m = plan.microbatches(), micro_batch_size
    return [[i for mb in mbs[g * m : (g + 1) * m] for i in mb] for g in range(len(mbs) // m)]


# The views of a sampler's passes: what the loop iterates, and the views launchers see and deal themselves.
_VIEWS = {
    "the sampler": lambda sampler, loader: sampler,
    "the loader": lambda sampler, loader: loader,
    "loader.sampler": lambda sampler, loader: loader.sampler,  # every rank's keys (Lightning's and Accelerate's)
    "loader.batch_sampler": lambda sampler, loader: loader.batch_sampler,  # every rank's, by one (Accelerate deals it)
    "deepspeed_io's data_sampler": lambda sampler, loader: varbatch._deepspeed_io_kwargs(loader)["data_sampler"],
}
_EVERY_RANK_VIEWS = ("loader.sampler", "loader.batch_sampler")


def _dealing_oracle(view, sampler, every_input, start):
    """A pass of ``view`` over the sampler's epoch from this rank's step input ``start``, by the dealing rule: ``(g,
    sample ids, Batch record counting sequences)`` of this rank's step inputs g = t*R + rank (every rank's views:
    every g from t = start on), None where the view does not show it."""
    ranks, gas, epoch = sampler.num_replicas, sampler.gradient_accumulation_steps, sampler.epoch
    plan = sampler.plan_for_epoch(epoch)
    every_rank = view in _EVERY_RANK_VIEWS
    dealt = []
    for g in range(start * ranks, len(every_input)):
        t = g // ranks
        b = t // gas
        record = varbatch.Batch(epoch * plan.num_batches + b, epoch, int(plan.batch_sizes[b]), t % gas == gas - 1, t)
        if every_rank or g % ranks == sampler.rank:
            shown_g = None if view in ("the sampler", "the loader") else g
            shown_record = None if view in ("the sampler", "deepspeed_io's data_sampler") else record
            dealt.append((shown_g, every_input[g], shown_record))
    return dealt


def _read(view, items, seqlens):
    """The ``items`` of ``view`` as `_dealing_oracle` gives them (a key's seqlens checked)."""
    dealt = []
    for item in items:
        if view == "the sampler":
            dealt.append((None, item, None))
        elif view == "the loader":  # (the samples of the dataset list(range(N)), the record)
            dealt.append((None, *item))
        else:
            key = item[0] if view == "loader.batch_sampler" else item
            assert key.seqlens == tuple(seqlens[i] for i in key.sample_ids), f"key {key} carries other lengths"
            dealt.append((key.step_input, list(key.sample_ids), key.batch))
    return dealt


@given(
    seqlens=st.lists(st.integers(1, 30), min_size=1, max_size=120),
    micro_batch_size=st.integers(1, 3),
    gas=st.integers(1, 3),
    num_replicas=st.integers(1, 3),
    order=st.sampled_from(ORDERS),
    budget=st.sampled_from(BUDGETS),
    epoch=st.integers(0, 2),
    key_run=st.integers(1, 5),
    data=st.data(),
)
@settings(max_examples=40)
def test_every_view_of_a_pass_deals_the_one_rule_and_passes_are_independent(
    seqlens, micro_batch_size, gas, num_replicas, order, budget, epoch, key_run, data
):
    """Rank r trains step inputs r, r + R, ... of the epoch set; step input g is micro-batches g*m .. g*m + m - 1.
    Every view of a pass deals them (the sampler, make_dataloader's loader with each step input's Batch record, the
    keys launchers see), the plan read in runs of any length. A position restored into the sampler is taken by the
    next pass of its epoch, once (not by a pass of another epoch, nor by an iterator left unread). A pass started in
    the middle of another yields the whole epoch, and the first goes on as it was; a pass's state_dict() in
    mid-pass, loaded into a fresh pass, continues this rank's step inputs exactly. Each view's len() is its pass's
    length, so a loop that reads it once trains every epoch whole (each epoch has epoch 0's batches: section 4)."""
    ranks, rank = num_replicas, data.draw(st.integers(0, num_replicas - 1))
    options = dict(micro_batch_size=micro_batch_size, gradient_accumulation_steps=gas, order=order, budget=budget)
    sampler = _samplers(seqlens, 45, ranks, seed=3, **options)[rank]
    loader = make_dataloader(list(range(len(seqlens))), sampler, batch_count="sequences")
    sampler.set_epoch(epoch + 1)
    next_epoch = _step_inputs_oracle(sampler.plan, micro_batch_size)
    sampler.set_epoch(epoch)
    every_input = _step_inputs_oracle(sampler.plan, micro_batch_size)
    assert len(sampler) == sampler.plan.num_batches * gas and len(every_input) == len(sampler) * ranks
    start = data.draw(st.integers(0, len(sampler) - 1))
    state = sampler.state_dict(steps_done=start)
    sampler.load_state_dict(state)
    sampler.set_epoch(epoch + 1)
    assert next(iter(sampler)) == next_epoch[rank], "a pass of another epoch started at the restored position"
    sampler.set_epoch(epoch)
    iter(sampler)  # made and left unread
    assert sampler.steps_done == start
    with unittest.mock.patch.object(varbatch, "_KEY_RUN", key_run):
        for view, of in _VIEWS.items():
            sampler.load_state_dict(state)
            source = of(sampler, loader)
            first = iter(source)
            expected = _dealing_oracle(view, sampler, every_input, start)
            got = _read(view, itertools.islice(first, data.draw(st.integers(1, len(expected)), label=view)), seqlens)
            assert sampler.steps_done == 0, f"{view}: the restored position was not taken"
            saved = first.state_dict() if hasattr(first, "state_dict") else None  # torch's iterators keep none
            whole = _read(view, source, seqlens)
            rest = _read(view, first, seqlens)
            assert got + rest == expected, view
            assert whole == _dealing_oracle(view, sampler, every_input, 0), view
            assert len(source) == len(whole), f"{view}: len() is not its pass's length"
            if saved is None:
                continue
            again = iter(source)
            again.load_state_dict(saved)
            continued = _read(view, again, seqlens)
            if view in _EVERY_RANK_VIEWS:  # a state is this rank's position: every rank's keys from the t it reached
                continued, rest = ([d for d in dealt if d[0] % ranks == rank] for dealt in (continued, rest))
            assert continued == rest, view


@pytest.mark.parametrize("num_replicas, gas", [(2, 2), (3, 1), (2, 3)])
def test_sampler_interleaving_matches_deepspeed(num_replicas, gas):
    """With one micro-batch per step input, each rank gets DeepSpeed's micro-batches: j to rank j % num_replicas."""
    module = _deepspeed_module()
    seqlens = _lengths(120, 1, 30, seed=3)
    k = num_replicas * gas
    plan = plan_batches(seqlens, 45, effective_batch_size=k)
    microbatch_ids = [(j // k, mb) for j, mb in enumerate(plan.microbatches())]
    for rank in range(num_replicas):
        loader, _ = module.dataloader_for_variable_batch_size(
            list(range(len(seqlens))),
            microbatch_ids,
            plan.batch_max_seqlens.tolist(),
            dataloader_rank=rank,
            dataloader_batch_size=1,
            dataloader_num_replicas=num_replicas,
            dataloader_num_workers=0,
        )
        sampler = VariableBatchSampler(
            seqlens, 45, gradient_accumulation_steps=gas, num_replicas=num_replicas, rank=rank
        )
        assert list(sampler) == [list(step) for step in loader]


_STOPS_MID_EPOCH = """
import torch, varbatch
lengths = list(range(3, 60)) * 4
dataset = [torch.ones(n) for n in lengths]
iterators = []
for workers in (0, 2):  # a loop that stopped mid-epoch, its loader's iterator alive at exit
    sampler = varbatch.VariableBatchSampler(lengths, 128, order="bucket")
    loader = varbatch.make_dataloader(dataset, sampler, collate_fn=varbatch.PaddedCollate(), num_workers=workers)
    iterators.append(iter(loader))
    next(iterators[-1])
sampler = varbatch.VariableBatchSampler(lengths, 128, order="random", gradient_accumulation_steps=2)
keys = iter(sampler)  # the sampler's own iterator
next(keys)
loader = varbatch.make_dataloader(dataset, sampler, collate_fn=varbatch.PaddedCollate())
data_iter = iter(loader)  # DeepSpeed style: engine.train_batch(data_iter) until a step count
for step in range(3):
    next(data_iter)
    next(data_iter)
print("stopped")
"""


def test_a_loop_that_stops_mid_epoch_exits_cleanly():
    """Iterators alive at interpreter exit (without and with workers, the sampler's own, a DeepSpeed-style
    stop at a step count) close silently (no 'Exception ignored in: <generator ...>')."""
    done = subprocess.run(
        [sys.executable, "-c", _STOPS_MID_EPOCH], cwd=_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == "stopped\n", done.stderr[-800:]
    assert done.stderr == "", done.stderr[-800:]


# -- padding and collate ---------------------------------------------------------------------------

_Pair = collections.namedtuple("_Pair", "tokens label")


# (sample, length, keyword arguments, the padded sample as plain data) by the kind of sample
_PADDINGS = {
    "tensor 2-D": (torch.tensor([[1, 2], [3, 4]]), 4, dict(pad_value=-1), [[1, 2], [3, 4], [-1, -1], [-1, -1]]),
    "array": (np.array([5, 6]), 3, {}, [5, 6, 0]),
    "list at length": ([5, 6, 7], 3, {}, [5, 6, 7]),
    "tuple with a scalar": ((3, [1, 2, 3]), 5, {}, (3, [1, 2, 3, 0, 0])),
    "tuple of tensors": (
        (torch.ones(2, 3), torch.tensor([1, 2])),
        3,
        {},
        ([[1.0] * 3, [1.0] * 3, [0.0] * 3], [1, 2, 0]),
    ),
    "namedtuple": (_Pair(torch.tensor([1, 2]), 3), 4, {}, _Pair([1, 2, 0, 0], 3)),
    "dict with pad values": (
        {"input_ids": [1, 2], "labels": [3, 4], "label": 7},
        4,
        dict(pad_value={"labels": -100}),
        {"input_ids": [1, 2, 0, 0], "labels": [3, 4, -100, -100], "label": 7},
    ),
    "dict, chosen fields": (
        {"input_ids": [1, 2], "labels": [3, 4]},
        3,
        dict(fields=["input_ids"]),
        {"input_ids": [1, 2, 0], "labels": [3, 4]},
    ),
}


@pytest.mark.parametrize("sample, length, kwargs, expected", list(_PADDINGS.values()), ids=list(_PADDINGS))
def test_pad_sample_pads_sequence_fields_and_keeps_the_rest(sample, length, kwargs, expected):
    """pad_sample pads one sequence, the sequence fields of a tuple, namedtuple or dict, and keeps scalars."""

    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, dict):
            return {key: plain(v) for key, v in value.items()}
        if isinstance(value, tuple):
            return type(value)(*map(plain, value)) if hasattr(value, "_fields") else tuple(map(plain, value))
        return value

    out = pad_sample(sample, length, **kwargs)
    assert type(out) is (torch.Tensor if isinstance(sample, (torch.Tensor, np.ndarray, list)) else type(sample))
    assert plain(out) == expected


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


def test_padded_collate_handles_lists_tuples_and_dicts():
    """Lists of numbers pad; tuples give (*fields, seqlens); dicts give padded fields, text as lists, seqlens_key."""
    x, lens = PaddedCollate()([[1, 2, 3], [4, 5]])
    assert x.tolist() == [[1, 2, 3], [4, 5, 0]] and lens.tolist() == [3, 2]
    label, tokens, lens = PaddedCollate(pad_value=-1)([(1, torch.tensor([7, 8, 9])), (0, torch.tensor([6]))])
    assert label.tolist() == [1, 0] and tokens.tolist() == [[7, 8, 9], [6, -1, -1]] and lens.tolist() == [3, 1]
    samples = [
        {"input_ids": [1, 2, 3], "labels": [1, 1, 1], "text": "abc"},
        {"input_ids": [4], "labels": [2], "text": "d"},
    ]
    out = PaddedCollate(pad_value={"labels": -100})(samples)
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert out["labels"].tolist() == [[1, 1, 1], [2, -100, -100]]
    assert out["text"] == ["abc", "d"] and out["seqlens"].tolist() == [3, 1]
    assert set(PaddedCollate(seqlens_key=None)(samples)) == {"input_ids", "labels", "text"}
    assert PaddedCollate(seqlens_key="lengths")(samples)["lengths"].tolist() == [3, 1]
    assert PaddedCollate()(samples, seqlens=[2, 1])["seqlens"].tolist() == [2, 1]  # given: the plan's lengths


@st.composite
def dict_samples(draw):
    """Dict samples with the same fields, each listing its keys in its own order: token fields of the sample's
    length whose values name the field, sample and position, and maybe a scalar label naming the sample."""
    names = draw(
        st.lists(st.sampled_from(["input_ids", "labels", "attention_mask"]), min_size=1, max_size=3, unique=True)
    ) + (["label"] if draw(st.booleans()) else [])
    samples = []
    for i, n in enumerate(draw(st.lists(st.integers(1, 6), min_size=1, max_size=6))):
        fields = {
            name: 1000 + i if name == "label" else [100 * (f + 1) + 10 * i + j for j in range(n)]
            for f, name in enumerate(names)
        }
        samples.append({name: fields[name] for name in draw(st.permutations(names))})
    return samples


@given(samples=dict_samples())
# the audit's case: the second sample lists its keys the other way round (its fields were swapped)
@example(samples=[{"input_ids": [1, 2, 3], "labels": [7, 8, 9]}, {"labels": [5], "input_ids": [4]}])
@settings(max_examples=50)
def test_padded_collate_collates_dict_fields_by_key(samples):
    """Dicts listing their keys in any order: every row of every output field is its own sample's field, padded."""
    out = PaddedCollate()(samples)
    lengths = [len(next(v for v in sample.values() if isinstance(v, list))) for sample in samples]
    longest = max(lengths)
    assert set(out) == set(samples[0]) | {"seqlens"} and out["seqlens"].tolist() == lengths
    for key, value in samples[0].items():
        if isinstance(value, list):
            assert [row.tolist() for row in out[key]] == [s[key] + [0] * (longest - len(s[key])) for s in samples], key
        else:
            assert out[key].tolist() == [s[key] for s in samples], key


# =============================================================================
# 4. Nothing lost
# =============================================================================


# -- every epoch the same length (NOTE [every epoch the same length]) ----------------------------------


def _batches_of(plan):
    """Each batch of ``plan`` as a tuple of its micro-batches' tuples of ids."""
    k, mbs = plan.effective_batch_size, plan.microbatches()
    return [tuple(map(tuple, mbs[b * k : (b + 1) * k])) for b in range(plan.num_batches)]


def _planner_of(case):
    """``(settings, ids, seqlens, planner, epoch 0's plan)`` of a drawn case; the case is skipped where epoch 0 has
    no batch (every sample over max_tokens, or too few)."""
    settings, ids = _settings_of(case)
    seqlens = np.asarray(case["seqlens"])
    planner = varbatch._Planner(seqlens, settings, ids)
    try:
        reference = planner.reference
    except ValueError:  # every sample over max_tokens
        reference = None
    assume(reference is not None and reference.num_batches > 0)
    return settings, ids, seqlens, planner, reference


# An order whose packings leave some epochs without a batch (two micro-batches of two samples each needed).
_UNLUCKY = dict(seqlens=[9, 1, 9, 5, 4], max_tokens=10, order="random", min_batch_size=2)


def _packs_an_empty_epoch(seed):
    """Whether the packing of one of epochs 1..5 of the unlucky case at ``seed`` has no batch, epoch 0's one."""
    options = {key: value for key, value in _UNLUCKY.items() if key != "seqlens"}
    settings = varbatch._Settings.of(effective_batch_size=2, seed=seed, **options)
    counts = [varbatch._pack(np.array(_UNLUCKY["seqlens"]), settings, None, e).num_batches for e in range(6)]
    return counts[0] > 0 and 0 in counts[1:]


@given(case=plan_cases(orders=ORDERS), order=st.permutations(range(6)))
# an epoch whose packing has no batch (drawn again, or epoch 0's batches reshuffled)
@example(case=_case(**_UNLUCKY, effective_batch_size=2, seed=_first_seed(_packs_an_empty_epoch)), order=list(range(6)))
@example(case=_case(_lengths(60, 1, 20, seed=2), 30, effective_batch_size=2, order="random"), order=list(range(6)))
# the audit's padded case, two micro-batches of one S a step input, in a drawn order
@example(
    case=_case(_LONG_AMONG_SHORT, 64, effective_batch_size=4, micro_batch_size=2, budget="padded", order="random"),
    order=list(range(6)),
)
@example(
    case=_case(
        _lengths(60, 1, 20, seed=2),
        40,
        effective_batch_size=4,
        budget="padded",
        order="bucket",
        micro_batch_size=2,
        same_size=True,
        same_length=True,
        bucket_size=8,
    ),
    order=[5, 4, 3, 2, 1, 0],
)
@settings(max_examples=150, deadline=None)
def test_every_epoch_has_epoch_0s_batches_and_holds_every_budget(case, order):
    """Every epoch of a plan's settings has epoch 0's number of batches and a valid plan: its packing lengthened, or
    the first packing drawn again that fits, or epoch 0's batches reshuffled, then its tail traded (NOTE [the tail
    moves]); the deterministic orders' packing itself. A plan depends only on its inputs: planned again, in any order
    of epochs, each plan is the same, and plan_batches(epoch=e) is that plan."""
    settings, ids, seqlens, planner, reference = _planner_of(case)
    count = reference.num_batches
    plans = {e: planner(e) for e in range(6)}
    shuffled = varbatch._Planner(seqlens, settings, ids)
    for e in order:
        assert _plan_arrays(shuffled(e)) == _plan_arrays(plans[e]), f"epoch {e} planned after others differs"
    for e, plan in plans.items():
        assert plan.num_batches == count and plan.epoch == e
        _assert_valid_plan(plan, case)
        for reason in ("over_budget", "filtered"):
            assert plan.dropped[reason].tolist() == reference.dropped[reason].tolist()
        packings = [varbatch._pack(seqlens, settings, ids, e, attempt) for attempt in range(varbatch._REDRAWS)]
        if case["order"] in ("dataloader", "seqlen"):  # one packing for every epoch: the plan, bit for bit
            assert _plan_arrays(plan) == _plan_arrays(packings[0]) == _plan_arrays(reference)
            continue
        fitting = [varbatch._lengthened(p, seqlens, count) for p in packings] if e else [reference]
        first = next((p for p in fitting if p is not None), None)
        if first is None:  # the last resort: epoch 0's batches, each whole, in another order
            first = varbatch._reshuffled(reference, e)
            assert sorted(_batches_of(first)) == sorted(_batches_of(reference))
            assert _plan_arrays(first)[-1] == _plan_arrays(reference)[-1]
        _assert_tail_traded(plan, first)
    with contextlib.suppress(ValueError):
        for e in (0, 3):
            assert _plan_arrays(plan_batches(**{**case, "epoch": e})) == _plan_arrays(plans[e])


def _assert_tail_traded(plan, before):
    """``plan`` is ``before`` (a plan of the same epoch) with its tail traded (NOTE [the tail moves]): bit for bit
    where ``before`` drops no tail; else the same micro-batches' sizes, with at most one place per tail sample
    taken by a tail sample, whose sample is left over in its stead."""
    if len(before.dropped["tail"]) == 0:
        assert _plan_arrays(plan) == _plan_arrays(before), "a plan without a tail changed"
        return
    assert plan.microbatch_offsets.tolist() == before.microbatch_offsets.tolist()
    assert plan.sample_ids.dtype == before.sample_ids.dtype
    tail = set(before.dropped["tail"].tolist())
    places = np.flatnonzero(plan.sample_ids != before.sample_ids)
    assert len(places) <= len(tail)
    taken = set(plan.sample_ids[places].tolist())
    assert taken <= tail, "a place went to a sample that was not left over"
    left = (tail - taken) | set(before.sample_ids[places].tolist())
    assert plan.dropped["tail"].tolist() == sorted(left)
    for reason in ("over_budget", "min_batch_size", "filtered"):
        assert plan.dropped[reason].tolist() == before.dropped[reason].tolist()


# -- the tail moves (NOTE [the tail moves]) ----------------------------------------------------------------------


def _places_it_can_take(plan, sample, case):
    """The positions (in ``plan.sample_ids``) whose sample ``sample`` can replace with every micro-batch still within
    the budget of DESIGN.md section 1, found by putting it there and costing its padding group again."""
    lens, k, m = case["seqlens"], case["effective_batch_size"], case["micro_batch_size"]
    span = k if case["same_length"] else m  # micro-batches padded to one S
    mbs = plan.microbatches()
    places, position = [], 0
    for j, mb in enumerate(mbs):
        for row in range(len(mb)):
            group = [list(other) for other in mbs[j - j % span : j - j % span + span]]
            group[j % span][row] = sample
            longest = max(lens[i] for other in group for i in other)
            if case["budget"] == "sum":
                fits = sum(lens[i] for i in group[j % span]) <= case["max_tokens"]
            else:
                fits = all(len(other) * longest <= case["max_tokens"] for other in group)
            if fits:
                places.append(position)
            position += 1
    return places


def _most_expected(mean, risk):
    """The largest count that a sum of independent 0/1 draws with this ``mean`` exceeds with probability at most
    ``risk`` (Chernoff: P(X >= b) <= e^-mean (e mean / b)^b for b > mean)."""
    if mean == 0:
        return 0
    b = math.floor(mean) + 1
    while -mean + b * (1 + math.log(mean / b)) > math.log(risk):
        b += 1
    return b - 1


@given(case=plan_cases(orders=("random", "bucket")), two_ranks=st.booleans(), one_window=st.booleans())
@example(  # one bucket window, sorted whole, ending with the longest sample: left over in every epoch until it moved
    case=_case([*_lengths(30, 1, 20, seed=4), 25], 30, effective_batch_size=2, order="bucket"),
    two_ranks=False,
    one_window=True,
)
@settings(max_examples=60, deadline=None)
def test_no_sample_is_left_over_more_often_than_its_possible_tails_allow(case, two_ranks, one_window):
    """Over 40 epochs of a drawn order with batches of two micro-batches (a tail of one sample at most), each
    epoch's tail is drawn among the sample its packing leaves over and the samples whose place that one can take
    within the budget (found here by putting it there): a sample is left over no more often than E / (possible
    tails) allows, by a bound that a fair draw exceeds with probability below 1e-9; never where it could not be."""
    m = case["micro_batch_size"]
    case = {**case, "effective_batch_size": 2, "num_replicas": 2 if m == 1 and two_ranks else 1, "min_batch_size": 1}
    if one_window:  # the default window holds every sample of a set this small
        case["bucket_size"] = None
    settings, ids, seqlens, planner, reference = _planner_of(case)
    epochs = 40
    chances = np.zeros(len(seqlens))  # per sample, the sum over epochs of its chance to be left over
    left_over = np.zeros(len(seqlens), np.int64)
    for epoch in range(epochs):
        before = varbatch._drawn_plan(seqlens, settings, ids, epoch, reference)
        tail = planner(epoch).dropped["tail"].tolist()
        if not len(before.dropped["tail"]):
            assert tail == []
            continue
        (sample,) = before.dropped["tail"].tolist()
        choices = [sample, *before.sample_ids[_places_it_can_take(before, sample, case)].tolist()]
        assert len(tail) == 1 and tail[0] in choices, f"epoch {epoch}: {tail} is not among {choices}"
        chances[choices] += 1 / len(choices)
        left_over[tail[0]] += 1
    for i in range(len(seqlens)):
        most = _most_expected(chances[i], 1e-9 / len(seqlens))
        assert left_over[i] <= most, f"sample {i} left over in {left_over[i]} of {epochs} epochs, chance {chances[i]}"


# -- the planner against a slow, obviously correct oracle ------------------------------------------


def _oracle_fits(mbs, seqlens, max_tokens, budget, group):
    """Whether the micro-batches ``mbs`` hold the budget; padded: each ``group`` adjacent ones padded to one S."""
    if budget == "sum":
        return all(sum(seqlens[i] for i in mb) <= max_tokens for mb in mbs)
    for g in range(0, len(mbs), group):
        longest = max(seqlens[i] for mb in mbs[g : g + group] for i in mb)
        if any(len(mb) * longest > max_tokens for mb in mbs[g : g + group]):
            return False
    return True


def _oracle_layout(chunk, n, width, consecutive):
    """``width`` micro-batches of ``n`` samples from ``chunk``: consecutive, or interleaved (every width-th)."""
    if consecutive:
        return [chunk[b * n : (b + 1) * n] for b in range(width)]
    return [chunk[b::width] for b in range(width)]


def _oracle_blocks(todo, seqlens, max_tokens, width, group, budget, min_batch_size, cap):
    """The greedy rule in blocks of ``width`` micro-batches, slowly, over ``todo``.

    A block takes the next ``n x width`` samples: interleaved (micro-batch b is
    every width-th sample from b) with n as large as fits; where that n is below
    min_batch_size, consecutive (micro-batch b is samples b*n .. b*n + n - 1) with
    the largest n >= min_batch_size that fits; where neither fits, the first
    sample is dropped as min_batch_size. Returns ``(blocks, too_small, pos)``: the
    blocks packed, the samples dropped as min_batch_size, and where the walk stopped.
    """

    def block(pos, n, consecutive):
        return _oracle_layout(todo[pos : pos + n * width], n, width, consecutive)

    def fits(mbs):
        return _oracle_fits(mbs, seqlens, max_tokens, budget, group)

    units, too_small, pos = [], [], 0
    while pos + width <= len(todo):
        rows_left = min(cap, (len(todo) - pos) // width)
        n = max([n for n in range(1, rows_left + 1) if fits(block(pos, n, False))], default=0)
        consecutive = False
        if n < min_batch_size <= rows_left:
            fallback = max([r for r in range(min_batch_size, rows_left + 1) if fits(block(pos, r, True))], default=0)
            if fallback:
                n, consecutive = fallback, True
        if n >= min_batch_size:
            units.append(block(pos, n, consecutive))
            pos += n * width
        elif n == rows_left:  # stopped by the end of the data
            break
        else:  # stopped by the budget short of min_batch_size rows
            too_small.append(todo[pos])
            pos += 1
    return units, too_small, pos


def _oracle_plan(
    seqlens,
    max_tokens,
    *,
    effective_batch_size=1,
    micro_batch_size=1,
    num_replicas=1,
    budget="sum",
    order="dataloader",
    min_batch_size=1,
    max_batch_size=None,
    sample_ids=None,
    same_size=False,
    same_length=False,
    packing=None,
):
    """The plan, computed slowly and obviously from DESIGN.md's semantics (dataloader and seqlen orders).

    Samples are packed in blocks of ``width`` micro-batches of ``n`` samples each (`_oracle_blocks`):
    whole batches (k micro-batches) with same_size; a step input (m micro-batches sharing one S) under
    the padded budget; else single micro-batches.

    Returns ``(fixed, leftover, width, dropped)``: the micro-batches whose content is specified, the
    leftover micro-batches (fewer than a batch) that the planner must re-split into exactly k parts,
    or None when that is impossible (their samples are then tail), and reason -> sorted ids.
    """
    k, m = effective_batch_size, micro_batch_size
    width = k if same_size else (m if budget == "padded" else 1)
    group = (k if same_length else m) if same_size else width  # adjacent micro-batches padded to one S
    chosen = list(range(len(seqlens))) if sample_ids is None else [int(i) for i in sample_ids]
    filtered = sorted(set(range(len(seqlens))) - set(chosen)) if sample_ids is not None else []
    over_budget = sorted(i for i in chosen if seqlens[i] > max_tokens)
    todo = [i for i in chosen if seqlens[i] <= max_tokens]
    if order == "seqlen":
        todo = sorted(todo, key=lambda i: (seqlens[i], i))  # ties by id, as DeepSpeed's sort of (len, id)
    cap = max_batch_size or len(todo)
    if packing == "best_fit":  # one micro-batch to a block (section 4b)
        units, too_small, pos = [[mb] for mb in _oracle_best_fit(todo, seqlens, max_tokens, cap)], [], len(todo)
    else:
        units, too_small, pos = _oracle_blocks(todo, seqlens, max_tokens, width, group, budget, min_batch_size, cap)
    tail = todo[pos:]
    per_batch = k // width
    full = len(units) - len(units) % per_batch
    fixed = [mb for unit in units[:full] for mb in unit]
    leftover = [mb for unit in units[full:] for mb in unit]
    # A block of r rows splits into at most r // min_batch_size blocks of min_batch_size rows or more.
    if leftover and sum(len(unit[0]) // min_batch_size for unit in units[full:]) < per_batch:
        tail = [i for mb in leftover for i in mb] + tail
        leftover = None
    dropped = {
        "over_budget": over_budget,
        "min_batch_size": sorted(too_small),
        "tail": sorted(tail),
        "filtered": filtered,
    }
    return fixed, leftover, width, dropped


def _oracle_case(case):
    """The oracle's keyword arguments from a plan case (the orders it knows)."""
    return {key: value for key, value in case.items() if key not in ("seed", "epoch", "bucket_size")}


def _assert_matches_oracle(case):
    """plan_batches(**case) is valid and equals the oracle's plan."""
    fixed, leftover, width, dropped = _oracle_plan(**_oracle_case(case))
    plan = _plan_or_none(case)
    if plan is None:
        assert not fixed and not leftover, "plan_batches refused a case the oracle can pack"
        return
    _assert_valid_plan(plan, case)
    mbs = plan.microbatches()
    assert mbs[: len(fixed)] == fixed
    rest = mbs[len(fixed) :]
    if not leftover:
        assert rest == []
    else:
        # The leftover is re-split into exactly k parts (blocks of `width` equal micro-batches),
        # each a run of one leftover micro-batch, together tiling every leftover micro-batch.
        k = case["effective_batch_size"]
        assert len(rest) == k, f"leftover {leftover} re-split into {rest}, not {k} parts"
        assert all(len(mb) >= case["min_batch_size"] for mb in rest)
        for b in range(0, k, width):
            assert len({len(mb) for mb in rest[b : b + width]}) == 1, f"a re-split block is not of equal sizes: {rest}"
        for whole in leftover:
            pieces = sorted((whole.index(mb[0]), mb) for mb in rest if mb[0] in whole)
            assert [i for _, mb in pieces for i in mb] == whole, f"{whole} is not tiled by its pieces in {rest}"
        if width == 1:
            assert [i for mb in rest for i in mb] == [i for mb in leftover for i in mb]
    for reason in DROP_REASONS:
        assert plan.dropped[reason].tolist() == dropped[reason], reason


@given(case=plan_cases() | greedy_cases())
# padded: a sample that fits alone stops a micro-batch where a later, shorter one would not
@example(case=_case([5, 1, 1], 10, budget="padded"))
@example(case=_case([1] * 9, 4, budget="padded", max_batch_size=3))
@example(case=_case([5, 1, 1, 1, 6, 2, 1, 9], 10, budget="padded", effective_batch_size=2, same_size=True))
# single sample
@example(case=_case([5], 5))
@example(case=_case([5], 4, budget="padded", order="seqlen", same_size=True, same_length=True))
# all equal lengths
@example(case=_case([3] * 12, 9, effective_batch_size=2, order="seqlen"))
@example(case=_case([4] * 10, 8, effective_batch_size=3, budget="padded", same_size=True, same_length=True))
# sample exactly max_tokens
@example(case=_case([2, 7, 7, 1, 7], 7))
@example(case=_case([3, 6, 1, 2], 6, effective_batch_size=2, budget="padded", same_size=True))
# min_batch_size that cannot be met mid-epoch
@example(case=_case([2, 2, 9, 2, 2, 2, 2], 10, min_batch_size=2))
@example(
    case=_case(
        [1, 1, 1, 1, 8, 1, 1, 1, 1, 1], 8, effective_batch_size=2, budget="padded", min_batch_size=2, same_size=True
    )
)
# same size: the consecutive layout where the interleaved one cannot reach min_batch_size
@example(case=_case([1, 9, 1, 9, 1, 1, 1, 1], 10, effective_batch_size=2, min_batch_size=2, same_size=True))
@example(case=_case([1, 9, 1, 9], 10, effective_batch_size=2, min_batch_size=2, same_size=True))
@example(case=_case([1, 4, 1, 4, 1, 4], 6, effective_batch_size=2, budget="padded", min_batch_size=2, same_size=True))
# tail re-split
@example(case=_case([1] * 6, 6, effective_batch_size=3, min_batch_size=2))
@example(case=_case([1, 1, 8, 8, 1, 1], 10, effective_batch_size=3, min_batch_size=2))
@example(case=_case([1] * 9, 20, effective_batch_size=4))
@example(case=_case([2, 2, 2, 2, 2, 5, 5], 10, effective_batch_size=2, order="seqlen"))
# step inputs of two micro-batches packed as one block under the padded budget
@example(case=_case(_LONG_AMONG_SHORT, 64, effective_batch_size=2, micro_batch_size=2, budget="padded"))
@example(case=_case([2, 2, 2, 2, 2, 2, 2, 2, 2, 9], 12, effective_batch_size=4, micro_batch_size=2, budget="padded"))
# same length: every micro-batch padded to its batch's longest
@example(case=_case([1, 1, 1, 8, 1, 1], 8, effective_batch_size=2, budget="padded", same_size=True, same_length=True))
@settings(max_examples=300)
def test_plan_matches_oracle(case):
    """plan_batches packs, drops and re-splits exactly as the slow oracle says, which checks every count of rows: in
    index and seqlen order, batches of one micro-batch or of same-size ones, lengths at max_tokens and tied."""
    _assert_matches_oracle(case)


# -- DeepSpeed's packing, and what it loses --------------------------------------------------------


def _ds_microbatches(seqlens, max_tokens, **kwargs):
    """DeepSpeed's micro-batches as lists of ids; [] where DeepSpeed packs too little for one batch."""
    try:
        microbatch_ids, _, _ = _deepspeed_module().batch_by_seqlens(list(seqlens), max_tokens, **kwargs)
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
            assert mb == ours[j][: len(mb)], f"micro-batch {j}: DeepSpeed {mb} is not a prefix of {ours[j]}"


@st.composite
def deepspeed_cases(draw):
    """Small sum-budget cases (DeepSpeed's packer is cubic in the number of samples)."""
    n = draw(st.integers(1, 40))
    min_bs = draw(st.integers(1, 3))
    return _case(
        draw(st.lists(st.integers(1, 20), min_size=n, max_size=n)),
        draw(st.integers(1, 60)),
        effective_batch_size=draw(st.integers(1, 4)),
        min_batch_size=min_bs,
        max_batch_size=draw(st.one_of(st.none(), st.integers(min_bs, 6))),
        same_size=draw(st.booleans()),
        order=draw(st.sampled_from(["dataloader", "seqlen", "random"])),
        sample_ids=draw(st.one_of(st.none(), st.permutations(range(n)).map(lambda p: p[: max(1, n - 3)]))),
        seed=draw(st.integers(0, 100)),
        epoch=draw(st.integers(0, 3)),
    )


@given(case=deepspeed_cases())
@example(case=_case([2, 2, 1, 1], 4, order="seqlen", sample_ids=[3, 0, 2, 1]))
@settings(max_examples=130)
def test_deepspeed_parity(case):
    """On the samples DeepSpeed packs, its micro-batches are varbatch's: in dataloader and seqlen order; in random
    order, as DeepSpeed packs in dataloader order the lengths permuted as varbatch picks them (its packing: the plan
    then makes every epoch one length, see test_every_epoch_has_epoch_0s_batches_and_holds_every_budget)."""
    seqlens = np.asarray(case["seqlens"])
    options = dict(
        min_batch_size=case["min_batch_size"],
        max_batch_size=case["max_batch_size"],
        effective_batch_size=case["effective_batch_size"],
        required_microbatches_of_same_size=case["same_size"],
    )
    if case["order"] != "random":
        plan = _plan_or_none(case)
        ours = [] if plan is None else plan.microbatches()  # [] where it has too few samples for one batch
        options.update(sequence_ids_per_mb=case["sample_ids"], sequence_picking_order=case["order"])
        theirs = _ds_microbatches(seqlens, case["max_tokens"], **options)
    else:
        fits = seqlens <= case["max_tokens"]
        assume(fits.any())
        # The picking order: one sample per micro-batch, so the packed ids are the permutation itself.
        picking = dict(order="random", seed=case["seed"], epoch=case["epoch"], max_batch_size=1)
        order = plan_batches(seqlens, case["max_tokens"], **picking).sample_ids
        assert sorted(order.tolist()) == np.flatnonzero(fits).tolist()
        settings, _ = _settings_of(case)
        ours = varbatch._pack(seqlens, settings, None, case["epoch"]).microbatches()  # [] where it packs no batch
        theirs = _ds_microbatches(seqlens[order], case["max_tokens"], **options, sequence_picking_order="dataloader")
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


# -- later epochs and empty plans ------------------------------------------------------------------


def test_the_last_resort_is_epoch_0s_batches_reshuffled(monkeypatch):
    """With no packing drawn, an epoch is epoch 0's plan with its batches in an order drawn from (seed, epoch) (here
    one without a tail, which would then move: test_every_epoch_has_epoch_0s_batches_and_holds_every_budget)."""
    monkeypatch.setattr(varbatch, "_REDRAWS", 0)
    lengths = _lengths(300, 1, 60, seed=3)
    options = dict(effective_batch_size=4, order="random", budget="padded")
    options["seed"] = _first_seed(
        lambda seed: len(plan_batches(lengths, 100, seed=seed, **options).dropped["tail"]) == 0
    )
    first = plan_batches(lengths, 100, **options)
    orders = []
    for epoch in (1, 2):
        plan = plan_batches(lengths, 100, epoch=epoch, **options)
        assert sorted(_batches_of(plan)) == sorted(_batches_of(first)) and _batches_of(plan) != _batches_of(first)
        assert _plan_arrays(plan)[-1] == _plan_arrays(first)[-1]
        orders.append(_batches_of(plan))
    assert orders[0] != orders[1]


@given(case=plan_cases(orders=ORDERS, max_n=6))
# the audit's unlucky later epoch
@example(case=_case(**_UNLUCKY, effective_batch_size=2, epoch=1))
def test_an_empty_plan_is_refused_with_counts_that_add_up(case):
    """plan_batches refuses a plan without a batch; its message's counts add up to the samples considered."""
    try:
        plan_batches(**case)
    except ValueError as error:
        message = str(error)
    else:
        assume(False)
    assume("every sample is longer" not in message)
    numbers = re.search(
        r"of (\d+) samples, (\d+) are longer than max_tokens=\d+, (\d+) cannot start .*"
        r"the (?:remaining|other) (\d+) cannot fill",
        message,
    )
    assert numbers, message
    total, over, too_small, rest = map(int, numbers.groups())
    considered = range(len(case["seqlens"])) if case["sample_ids"] is None else case["sample_ids"]
    assert total == len(considered) == over + too_small + rest, message
    assert over == sum(case["seqlens"][i] > case["max_tokens"] for i in considered), message
    assert "epoch 0" in message  # every epoch has epoch 0's batches: it is the one that has none


# -- Lightning, a loop that reads len() once: every epoch has that many step inputs --------------------


def _hf_never_and_twice(sampler, trained, epochs):
    """Per epoch, the planned samples never trained and the samples trained more than once."""
    counts = collections.Counter(trained)
    never = sum(
        len(set(sampler.plan_for_epoch(e).sample_ids.tolist()) - {i for ep, i in counts if ep == e}) for e in epochs
    )
    return never, sum(n > 1 for n in counts.values())


def _packings_differ(lengths, max_tokens, epochs, **options):
    """A seed whose packings (before the epochs are made one length) of ``epochs`` differ in batches: a case the
    rule must act on, so that a loop reading len() once could cut an epoch without it."""
    settings = varbatch._Settings.of(max_tokens=max_tokens, **options)
    for seed in range(200):
        seeded = dataclasses.replace(settings, seed=seed)
        counts = {varbatch._pack(np.asarray(lengths), seeded, None, e).num_batches for e in epochs}
        if len(counts) > 1:
            return seed
    raise AssertionError("no seed whose packings differ in length")


def test_lightning_amp_steps_the_scheduler_after_every_update_skipped_or_not():
    """Lightning, automatic optimization, {"interval": "step"}, accumulate_grad_batches=2 (the sampler's), 16-mixed
    with a real GradScaler skipping 3 updates: Lightning steps the scheduler after each batch, update or skip (b and t
    both move: torch's meaning), and nothing else is needed: every update at schedule(b) x B_b / mean(B), every planned
    sample once in each of two epochs whose packings differ in length (Lightning keeps the len(loader) it read first
    unless it reloads the loader)."""
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.plugins.precision import MixedPrecision

    lengths = _lengths(200, 3, 40)
    seed = _packings_differ(lengths, 128, (0, 1), order="random", effective_batch_size=2)
    sampler = VariableBatchSampler(lengths, 128, order="random", seed=seed, gradient_accumulation_steps=2)
    data = [torch.full((n, 1), float(i)) for i, n in enumerate(lengths)]
    skips, trained, applied, batches = {2, 9, 10}, [], [], [0]

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def train_dataloader(self):
            return make_dataloader(data, sampler, collate_fn=varbatch.PaddedCollate())

        def training_step(self, batch, index):
            trained.extend((sampler.epoch, int(v)) for v in batch[0][:, 0, 0])
            loss = (self.layer(batch[0] * 0) ** 2).mean() + 1
            return loss * math.inf if batches[0] in skips else loss

        def on_train_batch_end(self, outputs, batch, index):
            batches[0] += index % 2  # a batch ends with its second step input

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.9**t)
            scheduler = VariableBatchSizeLR(schedule, "mean", sampler)
            optimizer.register_step_pre_hook(lambda opt, *_: applied.append((batches[0], opt.param_groups[0]["lr"])))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    trainer = pl.Trainer(  # one CPU process, 2 epochs, nothing written (no logger, checkpoint or bars)
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=2,
        plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=1.0))],  # skips: ours only
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on CPU AMP and on workers
        trainer.fit(Model())
    per_epoch = sampler._batches_per_epoch()
    assert batches[0] == 2 * per_epoch and trainer.lr_scheduler_configs[0].scheduler.batches_trained == batches[0]
    assert [b for b, _ in applied] == [b for b in range(batches[0]) if b not in skips], "the GradScaler skipped none"
    assert _hf_never_and_twice(sampler, trained, (0, 1)) == (0, 0)
    for b, lr in applied:  # Lightning stepped the scheduler plainly after the skipped updates too: t = b
        epoch, batch = divmod(b, per_epoch)
        sizes = sampler.plan_for_epoch(epoch).batch_sizes
        _check_lr(b, 0.1 * 0.9**b * sizes[batch] / sizes.mean(), lr)


# -- drops are logged once per epoch -------------------------------------------------------------------


def _messages(caplog, text):
    return [r.getMessage() for r in caplog.records if r.name == "varbatch" and text in r.getMessage()]


def test_drops_and_verbose_totals_are_logged_once_per_epoch_on_rank_0(caplog):
    """An epoch's drops, and with verbose=True its plan's totals as one line of JSON, are logged as its first pass
    begins, once, on rank 0; planning ahead, an iterator left unread, another pass and other ranks log nothing."""
    seqlens = [*_lengths(60, 1, 20, seed=15), 99, 98]  # two samples over budget in every epoch
    with caplog.at_level("INFO", logger="varbatch"):
        sampler = VariableBatchSampler(seqlens, 40, order="random", seed=2, verbose=True)
        other_rank = VariableBatchSampler(seqlens, 40, order="random", seed=2, num_replicas=2, rank=1, verbose=True)
        sampler.plan_for_epoch(1), sampler.plan_for_epoch(2), len(sampler), iter(sampler)
        assert _messages(caplog, "epoch") == []
        for epoch in (0, 0, 1, 0):
            sampler.set_epoch(epoch)
            other_rank.set_epoch(epoch)
            list(sampler), list(other_rank)
    assert _messages(caplog, ": dropped") == [
        "epoch 0: dropped 2 samples (ids 60, 61) as over_budget",
        "epoch 1: dropped 2 samples (ids 60, 61) as over_budget",
    ]
    lines = _messages(caplog, "plan totals")
    assert [line.partition(": ")[0] for line in lines] == ["epoch 0 plan totals", "epoch 1 plan totals"], lines
    for epoch, line in enumerate(lines):
        assert "\n" not in line
        assert json.loads(line.partition(": ")[2]) == sampler.plan_for_epoch(epoch).totals(), line


def test_a_tail_dropped_in_every_epoch_is_warned_of_once_with_its_fix(monkeypatch):
    """The orders of one plan for every epoch drop one tail in each: one warning (on rank 0, not one per epoch, though
    catch_warnings between epochs, as at every scheduler step, empties Python's own once-registry) naming its ids and
    the orders that move it, and min_batch_size where that is above 1; none in a drawn order."""
    monkeypatch.setattr(varbatch, "_SAME_TAILS_TOLD", set())
    cases = [  # (seqlens, order, min_batch_size, the ids dropped as tail)
        ([3, 5, 2, 6, 4, 1, 7], "seqlen", 1, "1 sample (ids 6)"),
        ([3, 5, 2, 6, 4, 1, 7, 2, 3, 1, 2, 1], "dataloader", 2, "1 sample (ids 11)"),
        ([3, 5, 2, 6, 4, 1, 7, 2, 3, 1, 2, 1], "bucket", 2, None),
    ]
    for seqlens, order, min_batch_size, ids in cases:
        options = dict(order=order, min_batch_size=min_batch_size)
        sampler = VariableBatchSampler(seqlens, 8, gradient_accumulation_steps=2, **options)
        other_rank = VariableBatchSampler(seqlens, 8, num_replicas=2, rank=1, **options)  # the same plan, k = 2
        assert len(sampler.plan.dropped["tail"]) > 0  # the case has a tail
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for epoch in range(3):
                sampler.set_epoch(epoch)
                other_rank.set_epoch(epoch)
                list(sampler), list(other_rank)
                with warnings.catch_warnings():
                    pass
        told = [str(w.message) for w in caught if "as tail in every epoch" in str(w.message)]
        if ids is None:
            assert told == [], order
            continue
        (message,) = told
        assert f"order={order!r} drops the same {ids}" in message and "order='random' or 'bucket'" in message
        assert ("min_batch_size below 2" in message) == (min_batch_size == 2), message


def test_drop_log_lines_are_bounded(caplog):
    """A thousand drops are logged as a count and a few ids, never as an unbounded line."""
    with caplog.at_level("INFO", logger="varbatch"):
        list(VariableBatchSampler([1] * 10 + [50] * 1000, 10))
    (line,) = _messages(caplog, "dropped")
    assert "1000 samples" in line and len(line) < 200, line


# =============================================================================
# 4b. Full rows: best fit, fresh every epoch (DESIGN.md, item 13)
# =============================================================================
# Best fit (NOTE [best fit]) is drawn by the shared strategy `plan_cases`, so the properties of sections 1-4 (budgets
# and bounds, nothing lost, equal epochs, the tail that moves, the oracle) check it too; `balance_cases` draws it
# through flat rows in the random order. Here: its placement against a slow oracle, its fill against best-fit decreasing, its freshness,
# where it is the default, and what it refuses.


def _oracle_best_fit(todo, seqlens, max_tokens, cap, most_open=None):
    """The micro-batches best fit makes of the ids ``todo`` in that order, slowly, as NOTE [best fit] says: each
    sample joins the open micro-batch of least room (max_tokens less its seqlens) that holds it, the first opened
    among equals, else a new one; a micro-batch closes when no sample of ``todo`` fits its room or it holds ``cap``
    samples, and where more than ``most_open`` are open, the one of least room closes. Returns the closed ones in
    the order they closed, then the open ones in the order they opened."""
    most_open = most_open or varbatch._BEST_FIT_WINDOW
    shortest = min((seqlens[i] for i in todo), default=0)
    opened, closed = [], []  # opened: the open micro-batches, in the order they opened

    def room(microbatch):
        return max_tokens - sum(seqlens[i] for i in microbatch)

    for i in todo:
        holding = [microbatch for microbatch in opened if room(microbatch) >= seqlens[i]]
        if holding:
            target = min(holding, key=room)  # min keeps the first of equals: the first opened
        else:
            target = []
            opened.append(target)
        target.append(i)
        if room(target) < shortest or len(target) == cap:
            opened.remove(target)
            closed.append(target)
        elif len(opened) > most_open:
            fullest = min(opened, key=room)
            opened.remove(fullest)
            closed.append(fullest)
    return closed + opened


@given(
    seqlens=st.lists(st.integers(1, 20), min_size=1, max_size=60),
    max_tokens=st.integers(20, 60),
    max_batch_size=st.none() | st.integers(1, 8),
    most_open=st.integers(1, 4),
    order=st.sampled_from(["dataloader", "seqlen"]),
)
@example(seqlens=[6, 6, 3, 3], max_tokens=9, max_batch_size=None, most_open=1, order="dataloader")  # the fullest closes
def test_best_fit_places_every_sample_where_the_slow_oracle_does(seqlens, max_tokens, max_batch_size, most_open, order):
    """With any bound on the micro-batches open and on their samples, one micro-batch to a batch: the plan is the
    oracle's micro-batches, in the order they close."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(varbatch, "_BEST_FIT_WINDOW", most_open)
        plan = plan_batches(seqlens, max_tokens, order=order, packing="best_fit", max_batch_size=max_batch_size)
    todo = sorted(range(len(seqlens)), key=lambda i: (seqlens[i], i) if order == "seqlen" else i)
    cap = max_batch_size or len(todo)
    assert plan.microbatches() == _oracle_best_fit(todo, seqlens, max_tokens, cap, most_open)
    assert plan.num_dropped == 0


def _best_fit_decreasing_rows(seqlens, max_tokens):
    """The rows best-fit decreasing makes of the whole set, once (TRL's packing), slowly: the longest sample first,
    each into the row of least room that holds it, else a new row."""
    rooms = []
    for length in sorted(seqlens, reverse=True):
        holding = [row for row, room in enumerate(rooms) if room >= length]
        if holding:
            rooms[min(holding, key=rooms.__getitem__)] -= length
        else:
            rooms.append(max_tokens - length)
    return len(rooms)


def _length_set(name, n=2_000):
    """``n`` seqlens of a named distribution: SFT-like (lognormal, median ~400, clipped to 8..4096), uniform 10..499,
    or sets whose rows best fit fills by pairing long samples (mostly short with long ones; uniform up to a row)."""
    rng = np.random.default_rng(1)
    if name == "lognormal":
        return np.clip(np.round(rng.lognormal(np.log(400), 0.9, n)), 8, 4096).astype(np.int64).tolist()
    if name == "uniform":
        return rng.integers(10, 500, n).tolist()
    if name == "bimodal":
        return np.where(rng.random(n) < 0.7, rng.integers(20, 200, n), rng.integers(1500, 3000, n)).tolist()
    return rng.integers(1, 4097, n).tolist()  # "up to a row"


@pytest.mark.parametrize("order", ["random", "bucket"])
@pytest.mark.parametrize("max_tokens", [4096, 16384])
@pytest.mark.parametrize("lengths", ["lognormal", "uniform", "bimodal", "up to a row"])
def test_best_fit_rows_come_within_a_point_of_best_fit_decreasing(lengths, max_tokens, order):
    """Flat rows of 2,000 samples packed by best fit: every epoch's real tokens / (rows x max_tokens) is within one
    point of what best-fit decreasing reaches over the whole set, and at least the greedy rule's."""
    seqlens = _length_set(lengths)
    limit = sum(seqlens) / (_best_fit_decreasing_rows(seqlens, max_tokens) * max_tokens)
    greedy = plan_batches(seqlens, max_tokens, order=order, padding_free=True, packing="greedy")
    options = dict(order=order, padding_free=True, packing="best_fit", num_replicas=1, rank=0)
    sampler = VariableBatchSampler(seqlens, max_tokens, **options)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        plan = sampler.plan
        fill = plan.batch_tokens.sum() / (plan.num_microbatches * max_tokens)
        assert fill >= limit - 0.01, f"epoch {epoch}: {fill:.2%} against best-fit decreasing's {limit:.2%}"
        assert fill >= greedy.batch_tokens.sum() / (greedy.num_microbatches * max_tokens)


def _pairs_again(first, second, num_samples):
    """Of the pairs of samples that share a micro-batch in plan ``first``, the share that share one in ``second``."""
    where = np.full(num_samples, -1)
    where[second.sample_ids] = np.repeat(np.arange(second.num_microbatches), second.microbatch_sizes())
    again = total = 0
    for microbatch in first.microbatches():
        mates = collections.Counter(where[microbatch].tolist())
        again += sum(n * (n - 1) // 2 for mate, n in mates.items() if mate >= 0)
        total += len(microbatch) * (len(microbatch) - 1) // 2
    return again / total


@pytest.mark.parametrize("order", ["random", "bucket"])
@pytest.mark.parametrize(("lengths", "max_tokens"), [("lognormal", 4096), ("uniform", 16384)])
def test_best_fit_rows_are_new_every_epoch(lengths, max_tokens, order):
    """100,000 samples in flat rows: at most 5% of the pairs that share a row in one epoch share one in the next."""
    seqlens = _length_set(lengths, 100_000)
    options = dict(order=order, padding_free=True, packing="best_fit", num_replicas=1, rank=0)
    sampler = VariableBatchSampler(seqlens, max_tokens, **options)
    first = sampler.plan
    sampler.set_epoch(1)
    assert _pairs_again(first, sampler.plan, len(seqlens)) <= 0.05


@pytest.mark.parametrize("order", ORDERS)
def test_best_fit_is_the_default_for_flat_rows_in_the_random_order_only(order):
    """packing=None packs flat rows in the random order by best fit; it keeps the greedy rule in the bucket order (its
    like lengths), in the orders DeepSpeed has, for padded tensors (every plan DeepSpeed makes), and where best fit
    cannot apply (blocks of one size, a lower bound on a micro-batch's samples)."""
    seqlens = _lengths(300, 1, 40, seed=7)
    for options in (
        dict(padding_free=True),
        dict(),
        dict(budget="padded"),
        dict(padding_free=True, same_size=True, effective_batch_size=2),
        dict(padding_free=True, min_batch_size=2),
    ):
        plan = plan_batches(seqlens, 64, order=order, epoch=1, **options)
        best_fit = order == "random" and options == dict(padding_free=True)
        greedy = plan_batches(seqlens, 64, order=order, epoch=1, packing="greedy", **options)
        assert (_plan_arrays(plan) == _plan_arrays(greedy)) != best_fit, options
        if best_fit:
            assert _plan_arrays(plan) == _plan_arrays(
                plan_batches(seqlens, 64, order=order, epoch=1, packing="best_fit", **options)
            )


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (dict(packing="best"), "packing='best' (did you mean 'best_fit'?)"),
        (dict(packing=1), "packing=1"),
        (dict(packing="best_fit", budget="padded"), "budget='padded'"),
        (dict(packing="best_fit", same_size=True, effective_batch_size=2), "same_size=True"),
        (dict(packing="best_fit", min_batch_size=2), "min_batch_size=2"),
    ],
    ids=["unknown", "not a string", "padded budget", "same size", "min_batch_size"],
)
def test_a_packing_that_cannot_be_followed_is_refused_naming_it(options, names):
    """A packing varbatch does not know, or best fit where it cannot apply, is a ValueError naming the value and the
    setting that fixes it."""
    with pytest.raises(ValueError, match=re.escape(names)):
        plan_batches([3, 5, 2, 6], 8, **options)


def test_the_config_and_the_plan_command_choose_the_packing():
    """The section's packing key and plan.py's --packing reach the plan; the section refuses a bad one by its path."""
    section = dict(packing="greedy", padding_free=True, sequence_picking_order="random")
    plan_options, _, _ = varbatch._read_config(_glue_config(**section))
    assert plan_options["packing"] == "greedy" and not varbatch._Settings.of(**plan_options).best_fit
    with pytest.raises(ValueError, match=re.escape("dynamic_batching: packing='best_fit' needs budget='sum'")):
        varbatch._read_config(_glue_config(packing="best_fit", budget="padded"))
    for packing, header in (("best_fit", "order random, best fit,"), ("greedy", "order random, 1 micro-batch")):
        code, out, err = _cli("--padding-free", "--order", "random", "--packing", packing)
        assert code == 0 and header in out.splitlines()[0], (err, out)


# =============================================================================
# 5. LR
# =============================================================================

_BASE_LR = 0.1


def _check_lr(t, expected, got):
    assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-15), (
        f"LR is wrong at step {t}: expected {expected}, got {got}"
    )


def _train(sampler, scheduler, optimizer, epochs, realign=False):
    """A training loop over ``epochs`` epochs, each set before its pass; returns (t, epoch, batch, lr) at each
    optimizer step."""
    gas = sampler.gradient_accumulation_steps
    seen, t = [], 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
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


_SCHEDULES = {
    # name: (make the wrapped scheduler, its closed form schedule(t) / base lr); each of torch's schedulers wrapped, in
    # two param groups: test_conformance.py
    "SequentialLR": (
        lambda opt: torch.optim.lr_scheduler.SequentialLR(
            opt,
            [
                torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4),
                torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
            ],
            milestones=[4],
        ),
        lambda t: 0.25 + 0.75 * t / 4 if t < 4 else 0.9 ** (t - 4),
    ),
    "constant (optimizer)": (lambda opt: opt, lambda t: 1.0),
}


def test_the_worked_example_in_scale_lr_and_through_the_scheduler():
    """DESIGN.md section 5: lr 1e-3 at reference batch 2 becomes 5e-3 at B=10 and 2e-3 at B=4, in scale_lr (each rule)
    and through the scheduler, whose batch sizes given as a list cycle, as in DeepSpeed."""
    assert math.isclose(scale_lr(2, 10, 1e-3), 5e-3, rel_tol=1e-12)
    assert math.isclose(scale_lr(2, 4, 1e-3), 2e-3, rel_tol=1e-12)
    assert math.isclose(scale_lr(2, 8, 1e-3, "sqrt"), 2e-3, rel_tol=1e-12)
    assert scale_lr(2, 10, 1e-3, "none") == scale_lr(2, 10, 1e-3, None) == 1e-3
    assert math.isclose(scale_lr(2, 10, 1e-3, lambda r: r**2), 2.5e-2, rel_tol=1e-12)
    optimizer = _optimizer(lr=1e-3)
    scheduler = varbatch.lr_scheduler_for_variable_batch_size(2, [10, 4], None, optimizer)
    for t, expected in enumerate([5e-3, 2e-3, 5e-3]):
        _check_lr(t, expected, scheduler.get_last_lr()[0])
        _check_lr(t, expected, optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("schedule", list(_SCHEDULES))
@pytest.mark.parametrize("method, unit", [("linear", "sequences"), ("sqrt", "tokens")])
def test_lr_closed_form_over_epochs(schedule, method, unit):
    """lr_t = schedule(t) x s(B_t / B_ref) at every step of 3 epochs, with a new plan each epoch; B_t counts the
    batch's sequences or its real tokens. step(0) at each epoch's start (DeepSpeed's example) changes nothing and never
    restarts the schedule; building, stepping and restoring the scheduler warn nothing (PyTorch's warnings included).
    (B_ref "mean", cut epochs and skipped updates: test_every_loop_trains_each_batch_once_at_its_lr.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = _sampler()
        optimizer = _optimizer()
        make, closed_form = _SCHEDULES[schedule]
        reference = _mean_size(sampler, unit)
        scheduler = VariableBatchSizeLR(
            make(optimizer), reference, sampler, lr_scaling_method=method, lr_scaling_unit=unit
        )
        seen = _train(sampler, scheduler, optimizer, epochs=3, realign=True)
        scheduler.load_state_dict(scheduler.state_dict())
    scale = (lambda r: r) if method == "linear" else math.sqrt
    assert [e for _, e, _, _ in seen].count(0) == sampler.plan_for_epoch(0).num_batches
    assert sampler.plan_for_epoch(0).batch_sizes.tolist() != sampler.plan_for_epoch(1).batch_sizes.tolist()
    for t, epoch, b, lr in seen:
        plan = sampler.plan_for_epoch(epoch)
        size = (plan.batch_tokens if unit == "tokens" else plan.batch_sizes)[b]
        _check_lr(t, _BASE_LR * closed_form(t) * scale(size / reference), lr)


def test_lr_factors_are_logged_once_per_trained_epoch_and_the_unit_trap_is_warned_on_rank_0(caplog):
    """Each epoch's LR factors are logged once, when its first batch has been stepped, never for an untrained epoch; a
    B_ref far off the mean batch warns, naming the fix, only where it is the default (given, it is logged only). Rank 1
    neither warns nor logs: one report per job, not one per rank."""
    sampler = _sampler(gradient_accumulation_steps=1)
    assert _mean_size(sampler) > 2 * sampler.effective_batch_size  # train_batch_size is far off the mean batch
    optimizer = _optimizer()
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="varbatch"):
        warnings.simplefilter("error")  # B_ref = train_batch_size set on purpose: no warning
        scheduler = VariableBatchSizeLR(optimizer, sampler.effective_batch_size, sampler)
        assert _messages(caplog, "LR factor") == []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for _ in sampler:
                optimizer.step()
                scheduler.step()
                logged = [message.split(":")[0] for message in _messages(caplog, "LR factor")]
                assert logged == [f"epoch {e}" for e in range(epoch + 1)]
    with pytest.warns(UserWarning, match="lr_scaling_reference"):
        VariableBatchSizeLR(_optimizer(), None, sampler)
    caplog.clear()
    rank_1 = _sampler(gradient_accumulation_steps=1, num_replicas=2, rank=1)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO", logger="varbatch"):
        warnings.simplefilter("always")
        optimizer = _optimizer()
        _train(rank_1, VariableBatchSizeLR(optimizer, None, rank_1), optimizer, epochs=1)
    assert caught == [] and _messages(caplog, "LR factor") == []


class _NarrowingOptimizer:
    """Stands for DeepSpeed's optimizer wrappers (ZeRO, fp16): .optimizer, .step, .param_groups; it steps its optimizer
    one param group at a time, its ``param_groups`` narrowed to that group (as ZeRO's optimizer does around each inner
    step)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        groups = self.optimizer.param_groups
        for group in groups:
            self.optimizer.param_groups = [group]
            self.optimizer.step()
        self.optimizer.param_groups = groups


@pytest.mark.parametrize("case", ["optimizer restored after the scheduler was made", "DeepSpeed-style wrapper"])
def test_the_lr_reaches_the_param_groups_the_optimizer_steps(case):
    """Two param groups: each update uses each group's base LR x B_b / mean(B), also after the optimizer's
    load_state_dict made new param-group dicts (a resume) and under a DeepSpeed-style wrapper, which is unwrapped, never
    stepped by the scheduler, and narrows param_groups to the group it steps (ZeRO). (A wrapped schedule over the inner
    optimizer: test_lr_closed_form_over_epochs.)"""
    sampler = _sampler(gradient_accumulation_steps=1)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    inner = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]], "lr": 2 * _BASE_LR}], lr=_BASE_LR)
    optimizer = _NarrowingOptimizer(inner) if case == "DeepSpeed-style wrapper" else inner
    scheduler = VariableBatchSizeLR(optimizer, "mean", sampler)
    assert scheduler.optimizer is inner
    if case != "DeepSpeed-style wrapper":
        inner.load_state_dict(inner.state_dict())  # new dicts, holding batch 0's LRs
    applied = []  # registered after the scheduler's pre-step hook: the LR of each group each inner step uses
    inner.register_step_pre_hook(lambda opt, args, kwargs: applied.extend(g["lr"] for g in opt.param_groups))
    sizes = sampler.plan.batch_sizes
    assert len({int(size) for size in sizes[:4]}) > 1, "the first batches have one size: the case could not fail"
    for b, _ in zip(range(4), sampler):
        optimizer.step()
        scheduler.step()
        factor = sizes[b] / sizes.mean()
        _check_lr(b, _BASE_LR * factor, applied[-2])
        _check_lr(b, 2 * _BASE_LR * factor, applied[-1])
    assert len(applied) == 2 * 4, "the scheduler stepped the optimizer"


def test_deepspeed_glue_called_again_replaces_the_scheduler_and_detaches_the_old_one():
    """The glue's scheduler becomes engine.lr_scheduler. Called again on one engine, it scales the original LR, not the
    scaled one; the replaced scheduler's hooks are gone, so the LR an update uses is the new scheduler's (after skipped
    steps too)."""
    seqlens = _lengths(40, 1, 8, seed=31)

    def lr_differs(seed):  # batch 1's LR under the old (8 samples) and the new (40) plans of one seed
        old_plan, new_plan = (
            plan_batches(s, 16, effective_batch_size=2, order="random", seed=seed) for s in (_GLUE_SEQLENS, seqlens)
        )
        if old_plan.num_batches < 2:
            return False
        ratios = [plan.batch_sizes[1] / plan.batch_sizes.mean() for plan in (old_plan, new_plan)]
        return not math.isclose(*ratios)

    config = _glue_config(sequence_picking_order="random", seed=_first_seed(lr_differs))
    engine, (old_loader, old, _) = _glue(config, dataset_seqlens=_GLUE_SEQLENS)
    assert engine.lr_scheduler is old
    scaled = engine.optimizer.param_groups[0]["lr"]
    assert not math.isclose(scaled, _BASE_LR), "batch 0's factor is 1: a second scaling could not show"
    new_loader, new, _ = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        [torch.ones(n) for n in seqlens], engine, dataset_seqlens=seqlens
    )
    assert engine.lr_scheduler is new and old is not None  # the old one stays alive: only detaching silences it
    new_plan, old_plan = new_loader.variable_batch_sampler.plan, old_loader.variable_batch_sampler.plan
    expected = _BASE_LR * new_plan.batch_sizes[1] / new_plan.batch_sizes.mean()
    stale = _BASE_LR * old_plan.batch_sizes[1] / old_plan.batch_sizes.mean()
    assert not math.isclose(expected, stale), "both schedulers give batch 1 one LR: the test could not fail"
    optimizer = engine.optimizer
    applied = []  # registered last: the LR the update uses, after every pre-step hook
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: applied.append(opt.param_groups[0]["lr"]))
    engine.skipped_steps = 1  # an fp16 overflow skipped batch 0's update: batch 1 is next
    _check_lr(1, expected, new.get_last_lr()[0])  # read before the update, as example.py's loop does
    optimizer.step()
    _check_lr(1, expected, applied[0])


def test_a_second_wrapper_on_an_optimizer_detaches_the_first():
    """Two VariableBatchSizeLR on one optimizer (as torch's tests stack two schedulers): the second detaches the
    first, whose next step() raises naming ChainedScheduler (one wrapper over ChainedScheduler trains both decays:
    test_conformance.py)."""
    sampler = _sampler()
    optimizer = _optimizer()
    first = VariableBatchSizeLR(torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5), "mean", sampler)
    second = VariableBatchSizeLR(torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9), "mean", sampler)
    with pytest.raises(RuntimeError, match=re.escape("ChainedScheduler([first, second])")):
        first.step()
    second.step()


# -- an exception from the wrapped schedule reaches the caller ------------------------------------------


def _first_error(make_schedule):
    """The exception a fresh schedule ``make_schedule(optimizer)``, stepped on its own, raises first."""
    schedule = make_schedule(_optimizer())
    with warnings.catch_warnings():  # torch's step-order check: no optimizer steps here
        warnings.simplefilter("ignore")
        for _ in range(10**5):
            try:
                schedule.step()
            except Exception as error:
                return error
    raise AssertionError("the schedule never raised: the test could not fail")


@pytest.mark.parametrize("case", ["OneCycleLR past total_steps", "OneCycleLR past total_steps, token clock"])
def test_an_exception_from_the_wrapped_schedule_reaches_the_caller(case):
    """A wrapped schedule that raises in step(): its exception reaches the caller, with the schedule's own message."""
    sampler = _sampler(gradient_accumulation_steps=1)
    tokens = sampler.plan.batch_tokens
    clock = dict(clock="tokens", clock_step=1) if "token clock" in case else {}
    lr_scheduler = torch.optim.lr_scheduler
    good_steps, make = {  # the updates whose step() the schedule takes, and the schedule
        "OneCycleLR past total_steps": (3, lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=3)),
        # the second update's ticks run past the end half-way through
        "OneCycleLR past total_steps, token clock": (
            1,
            lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=int(tokens[0] + tokens[1] // 2)),
        ),
    }[case]
    expected = _first_error(make)
    optimizer = _optimizer()
    scheduler = VariableBatchSizeLR(make(optimizer), "mean", sampler, **clock)
    for _ in range(good_steps):
        optimizer.step()
        scheduler.step()
    optimizer.step()
    with pytest.raises(type(expected)) as raised:
        scheduler.step()
    assert str(raised.value) == str(expected), f"the caller got {raised.value!r}, the schedule raised {expected!r}"


# -- fp16 overflow: DeepSpeed skips a step, the data moves on ------------------------------------

_OVERFLOW_SEQLENS = [5, 3, 7, 2, 6, 4, 1, 8, 3, 3, 2, 6, 5, 1, 7, 2, 4, 4, 6, 3]
# Global batch indices whose step overflows (5 batches an epoch): one alone, then two in a row across the epoch end, in
# a loop that never asks the scheduler (the glue reads the engine's skip count before each forward and update).
_OVERFLOW_AT = [1, 4, 5]
_OVERFLOW_CONFIG = {
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 1,
    "steps_per_print": 10**6,
    "data_efficiency": {
        "seed": 4,
        "data_sampling": {
            "dynamic_batching": {
                "enabled": True,
                "max_tokens": 10,
                "sequence_picking_order": "random",
                "lr_scaling_reference": "mean",
            }
        },
    },
}


def _overflow_run(deepspeed):
    """A one-process DeepSpeed engine trained 2 epochs, its fp16 optimizer overflowing at the batches `_OVERFLOW_AT`, in
    a loop that never asks the scheduler: {"starts": (epoch, batch, steps_in_epoch, get_last_lr(), engine.get_lr()
    after the forward) at each batch's start; "after": (engine.get_lr(), get_last_lr()) right after each
    engine.step(); "applied": the LR of every optimizer step; "skipped": the engine's count; "schedule_steps": the
    wrapped schedule's}."""
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=_BASE_LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.9**t)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=schedule, config=copy.deepcopy(_OVERFLOW_CONFIG)
    )
    loader, scheduler, _ = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        [torch.ones(n, 1) for n in _OVERFLOW_SEQLENS],
        engine,
        dataset_seqlens=_OVERFLOW_SEQLENS,
        dataloader_collate_fn=PaddedCollate(),
    )
    applied = []  # the LR of every optimizer step, as the update uses it
    optimizer.register_step_post_hook(lambda opt, args, kwargs: applied.append(opt.param_groups[0]["lr"]))
    starts, after, batch = [], [], 0
    gas = engine.gradient_accumulation_steps()
    for epoch in range(2):
        loader.variable_batch_sampler.set_epoch(epoch)
        for i, (x, _) in enumerate(loader):
            loss = engine(x).sum()
            if i % gas == 0:
                engine_lr = engine.get_lr()[0]  # after the forward pass, nothing of varbatch's touched since the step
                starts.append((epoch, i // gas, scheduler.steps_in_epoch, scheduler.get_last_lr()[0], engine_lr))
            engine.backward(loss)
            if i % gas == gas - 1:
                engine.optimizer.overflow = batch in _OVERFLOW_AT  # what DeepSpeed's fp16 optimizer sets
            engine.step()
            if i % gas == gas - 1:
                after.append((engine.get_lr()[0], scheduler.get_last_lr()[0]))  # the first: what the monitor logged
                engine.optimizer.overflow = False
                batch += 1
    return dict(
        starts=starts, after=after, applied=applied, skipped=engine.skipped_steps, schedule_steps=schedule.last_epoch
    )


def test_fp16_overflow_lr_and_position_follow_the_batch_trained(monkeypatch):
    """A one-process DeepSpeed engine trained 2 epochs with overflows at `_OVERFLOW_AT`. Every update's LR is
    schedule(t) x s(B_b / B_ref) of the batch b it trains, t the steps not skipped (the wrapped schedule stays). At a
    batch's start steps_in_epoch and get_last_lr() are that batch's, and so is engine.get_lr() read between
    the batch's forward and its step, nothing of varbatch's touched since the step before (the glue's forward pre-hook
    catches the scheduler up with the engine's skips). Right after engine.step(): get_last_lr() is the next batch's,
    skipped step or not; engine.get_lr() (what DeepSpeed's monitor logs at the end of engine.step) is the next batch's
    after a step taken and the skipped batch's after a skipped one (nothing of varbatch runs inside the engine between
    its skip and that read)."""
    deepspeed = pytest.importorskip("deepspeed")
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)  # no JIT build of the comm op
    deepspeed.init_distributed()
    try:
        out = _overflow_run(deepspeed)
    finally:
        torch.distributed.destroy_process_group()  # later tests run without a process group
    plans = [
        plan_batches(_OVERFLOW_SEQLENS, 10, effective_batch_size=2, order="random", seed=4, epoch=e) for e in range(2)
    ]
    batches = [(e, b) for e, plan in enumerate(plans) for b in range(plan.num_batches)]
    sizes = [int(plans[e].batch_sizes[b]) for e, b in batches]
    assert all(sizes[j] != sizes[j + 1] for j in _OVERFLOW_AT if j + 1 < len(sizes)), (
        f"an overflowed batch and the next have one size {sizes}: the test could not fail"
    )
    expected = []  # schedule(t) x B_b / mean B, t = the steps not skipped before batch b
    for j, (e, b) in enumerate(batches):
        t = j - sum(1 for s in _OVERFLOW_AT if s < j)
        expected.append(_BASE_LR * 0.9**t * plans[e].batch_sizes[b] / plans[e].batch_sizes.mean())
    assert len(out["applied"]) == len(batches) and out["skipped"] == len(_OVERFLOW_AT)
    for j, lr in enumerate(out["applied"]):
        _check_lr(j, expected[j], lr)
    assert out["schedule_steps"] == len(batches) - len(_OVERFLOW_AT), "the wrapped schedule moved on skipped steps"
    assert [(e, b) for e, b, *_ in out["starts"]] == batches
    for j, (e, b, steps_in_epoch, last_lr, engine_lr) in enumerate(out["starts"]):
        assert steps_in_epoch == b, f"epoch {e}, batch {b}: steps_in_epoch={steps_in_epoch}"
        _check_lr(j, expected[j], last_lr)
        _check_lr(j, expected[j], engine_lr)
    assert len(out["after"]) == len(batches)
    for j, (engine_lr, last_lr) in enumerate(out["after"][:-1]):
        _check_lr(j, expected[j + 1], last_lr)
        _check_lr(j, expected[j] if j in _OVERFLOW_AT else expected[j + 1], engine_lr)


# -- every loop, told or counted: each batch once, at its LR, its loss weighted to the batch mean ------------------

_LOOP_SEQLENS = _lengths(32, 2, 12, seed=31)  # every sample has a label token
_LOOP_DATASET = _id_dataset(_LOOP_SEQLENS)
_LOOP_COUNTS = _lengths(32, 1, 5, seed=32)  # a count per sample (label tokens where prompts are masked)
_LOOP_FEATURES = torch.randn(32, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
_LOOP_KINDS = (
    "told, make_dataloader",
    "told, make_dataloader, each loss divided by G",  # as DeepSpeed and Accelerate average accumulation steps
    "counted, make_dataloader",
    "counted, torch's DataLoader",
    "counted, a list of the pass",
    "counted, the sampler",
)
# What a loop may do after a step input (after its update, where it ends a batch) besides training: a peek at a new
# pass, a train-set loss pass over the same loader or sampler, set_epoch of the next epoch (its plan read) and back, a
# break out of the epoch (said with step(0) at the next one's start), a checkpoint (the sampler's and scheduler's
# states saved after the last update), a crash (a fresh run restored from the last checkpoint).
_LOOP_EVENTS = ("peek", "side pass", "look", "cut", "checkpoint", "crash")


def _loop_count(unit, i):
    """Sample i's count in ``unit``: what its loss sums over (a causal LM's labels: its tokens shifted by one)."""
    seqlen = _LOOP_SEQLENS[i]
    return {"sequences": 1, "tokens": seqlen, "label_tokens": seqlen - 1, "per sample": _LOOP_COUNTS[i]}[unit]


class _Loop:
    """One rank's training loop of one of `_LOOP_KINDS`: a linear model whose loss sums ``w . v_i`` over the counted
    items of each sample i (``v_i``: its row of `_LOOP_FEATURES`), so the batch mean's gradient is ``sum(c_i v_i) /
    sum(c_i)``; the LR 0.1 x 0.9^t x B_b / mean(B), t the updates taken (on a token or sample clock, their tokens // 16
    or samples // 2). Each update is checked as it happens: its step inputs are its batch's on this rank, in order, its
    LR is its batch's; told, each record is its step input's and the gradient is the rank's share of the batch mean's,
    R x ``sum(c_i v_i)`` over the rank's samples / the batch's count (DDP averages the R shares to the batch mean's).
    ``timeline``: the run's updates, ``(taken or skipped, epoch, batch)``, and cuts, ``("cut", epoch, None)``, as the
    resumes leave it."""

    def __init__(self, kind, gas, world, unit, clock, workers, events, skips):
        self.kind = kind
        self.gas = gas
        self.num_replicas, self.rank = world
        self.unit = unit
        self.clock = clock
        self.workers = workers
        self.events = events  # the number of a step input the loop got (over the run) -> what it does after it
        self.skips = skips  # the numbers of the updates (over the run) that AMP skips
        self.got = 0
        self.reached = 0
        self.timeline = []
        self.checkpoint = None
        self.build()

    def build(self):
        """The loop's start: fresh objects, restored from the last checkpoint (the timeline cut back to it)."""
        self.sampler = VariableBatchSampler(
            _LOOP_SEQLENS,
            16,
            gradient_accumulation_steps=self.gas,
            num_replicas=self.num_replicas,
            rank=self.rank,
            order="random",
            seed=5,
        )
        self.param = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        self.optimizer = torch.optim.SGD([self.param], lr=_BASE_LR)
        schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda t: 0.9**t)
        clock_step = {"steps": 1, "tokens": 16, "samples": 2}[self.clock]
        self.scheduler = VariableBatchSizeLR(schedule, "mean", self.sampler, clock=self.clock, clock_step=clock_step)
        self.applied = []  # registered after the scheduler's step-pre hook: the LR each update uses
        self.optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.applied.append(opt.param_groups[0]["lr"]))
        if self.kind == "counted, torch's DataLoader":
            self.loader = torch.utils.data.DataLoader(_LOOP_DATASET, batch_sampler=self.sampler, collate_fn=list)
        elif "make_dataloader" in self.kind:
            told = self.kind.startswith("told")
            count = _LOOP_COUNTS if self.unit == "per sample" else self.unit
            self.loader = make_dataloader(
                _LOOP_DATASET, self.sampler, num_workers=self.workers, batch_count=count if told else None
            )
        self.pending = []  # (epoch, t, sample ids, record) of the step inputs since the last update
        self.saved = None  # the states after the last update
        updates = 0
        if self.checkpoint is not None:
            sampler_state, scheduler_state, updates = self.checkpoint
            self.sampler.load_state_dict(sampler_state)
            self.scheduler.load_state_dict(scheduler_state)
        del self.timeline[updates:]

    def passes(self):
        """A new pass over the selected epoch: (each step input's samples, its record or None)."""
        if self.kind.startswith("told"):
            return iter(self.loader)
        if self.kind == "counted, a list of the pass":
            steps = list(self.sampler)
            return (([_LOOP_DATASET[i] for i in ids], None) for ids in steps)
        if self.kind == "counted, the sampler":
            return (([_LOOP_DATASET[i] for i in ids], None) for ids in self.sampler)
        return ((samples, None) for samples in self.loader)

    def run(self, epochs):
        """Trains ``epochs`` epochs, resuming after each crash."""
        while self.train(epochs) == "crash":
            self.build()

    def train(self, epochs):
        """The loop, from where the sampler's state says; returns "crash" where it crashed."""
        cut = False
        for epoch in range(self.sampler.epoch, epochs):
            self.sampler.set_epoch(epoch)
            if cut:  # the loop broke out of the last epoch: it says so, as DeepSpeed's loops do at each epoch's start
                self.scheduler.step(0)
            cut = False
            start = self.sampler.steps_done  # the loop's own count of the epoch's step inputs starts there
            for t, (samples, batch) in enumerate(self.passes(), start=start):
                event = self.step_input(epoch, t, samples, batch)
                if event == "crash":
                    return event
                # A cut before the epoch's first update leaves b at the epoch's start, where step(0) moves nothing: it
                # cannot tell that from the end of the epoch before, so the loop cuts after an update only.
                if event == "cut" and t + 1 >= self.gas:  # a batch left half-accumulated is not trained
                    self.optimizer.zero_grad()
                    self.pending.clear()
                    self.timeline.append(("cut", epoch, None))
                    cut = True
                    break
        return "done"

    def step_input(self, epoch, t, samples, batch):
        """Trains on step input t, updates where it ends its batch, then does the drawn event; returns the event."""
        ids = [int(sample[0]) - 1 for sample in samples]
        self.pending.append((epoch, t, ids, batch))
        counts = [_loop_count(self.unit, i) for i in ids]
        loss = sum(c * (self.param @ _LOOP_FEATURES[i]) for c, i in zip(counts, ids)) / sum(counts)  # its own mean
        if batch is not None:
            averaged = self.gas if self.kind.endswith("divided by G") else 1  # the weight undoes the engine's average
            weight = micro_batch_loss_weight(
                sum(counts), batch.count, num_replicas=self.num_replicas, gradient_accumulation_steps=averaged
            )
            loss = loss * weight / averaged
        loss.backward()
        ends = (t + 1) % self.gas == 0 if batch is None else batch.last  # told: where the record says
        if ends:
            self.update(epoch, t // self.gas, batch)
        event = self.events.get(self.got)
        self.got += 1
        self.between(event)
        return event

    def update(self, epoch, j, batch):
        """The update of batch j of ``epoch``, or its skip, checked; the states after it kept."""
        plan = self.sampler.plan_for_epoch(epoch)
        steps = range(j * self.gas, (j + 1) * self.gas)  # the batch's step inputs on this rank
        assert [(e, t) for e, t, _, _ in self.pending] == [(epoch, t) for t in steps], "not one batch's step inputs"
        for _, t, ids, _ in self.pending:  # step input t is micro-batch t R + r (micro_batch_size 1)
            expected = plan.microbatch(t * self.num_replicas + self.rank).tolist()
            assert ids == expected, f"epoch {epoch}, step input {t}: not the plan's samples"
        if batch is not None:
            self.check_told(plan, j)
        skipped = self.reached in self.skips
        self.reached += 1
        if not skipped:
            self.optimizer.step()
            sizes = plan.batch_sizes
            expected = _BASE_LR * 0.9 ** self.schedule_step() * sizes[j] / sizes.mean()
            _check_lr(len(self.timeline), expected, self.applied[-1])
        self.optimizer.zero_grad()
        if batch is not None:
            self.scheduler.step(batch, skipped=skipped)
            position = self.sampler.state_dict(batch)
        else:
            self.scheduler.step(skipped=skipped)
            position = self.sampler.state_dict(steps_done=steps.stop)
        self.timeline.append(("skipped" if skipped else "taken", epoch, j))
        self.pending.clear()
        self.saved = (position, self.scheduler.state_dict(), len(self.timeline))

    def check_told(self, plan, j):
        """Each record of batch j is its step input's, and the gradient is the rank's share of the batch mean's."""
        k = plan.effective_batch_size
        count = sum(_loop_count(self.unit, i) for g in range(j * k, (j + 1) * k) for i in plan.microbatch(g).tolist())
        index = plan.epoch * len(self.sampler) // self.gas + j
        for epoch, t, _, batch in self.pending:
            assert batch == varbatch.Batch(index, epoch, count, t % self.gas == self.gas - 1, t), batch
        mine = [i for _, _, ids, _ in self.pending for i in ids]
        share = sum(_loop_count(self.unit, i) * _LOOP_FEATURES[i] for i in mine) / count * self.num_replicas
        assert torch.allclose(self.param.grad, share, rtol=1e-10, atol=0), f"batch {index}: not the batch mean's"

    def schedule_step(self):
        """The wrapped schedule's t before the next update: the updates taken, or their tokens // 16 (samples // 2)."""
        taken = [(epoch, j) for kind, epoch, j in self.timeline if kind == "taken"]
        if self.clock == "steps":
            return len(taken)
        unit, step = ("batch_tokens", 16) if self.clock == "tokens" else ("batch_sizes", 2)
        return sum(int(getattr(self.sampler.plan_for_epoch(epoch), unit)[j]) for epoch, j in taken) // step

    def between(self, event):
        """A peek, a side pass, a look at the next epoch's plan or a checkpoint (see `_LOOP_EVENTS`)."""
        epoch = self.sampler.epoch
        if event == "peek":
            next(self.passes())
        elif event == "side pass":
            with torch.no_grad():
                assert sum(1 for _ in self.passes()) == len(self.sampler)
        elif event == "look":
            self.sampler.set_epoch(epoch + 1)
            assert self.sampler.plan.epoch == epoch + 1
            self.sampler.set_epoch(epoch)
        elif event == "checkpoint" and self.saved is not None:
            self.checkpoint = json.loads(json.dumps(self.saved))  # plain data, as a checkpoint file holds


@given(
    kind=st.sampled_from(_LOOP_KINDS),
    gas=st.sampled_from([1, 2]),
    world=st.sampled_from([(1, 0), (2, 1)]),
    unit=st.sampled_from(["sequences", "tokens", "label_tokens", "per sample"]),
    clock=st.sampled_from(["steps", "tokens", "samples"]),
    workers=st.just(0),
    epochs=st.integers(1, 3),
    events=st.dictionaries(st.integers(0, 40), st.sampled_from(_LOOP_EVENTS), max_size=6),
    skips=st.sets(st.integers(0, 20), max_size=3),
)
# loader workers reading ahead of a told loop whose engine divides each loss by G: a peek and a side pass, a crash
# inside an accumulation step
@example(
    kind="told, make_dataloader, each loss divided by G",
    gas=2,
    world=(1, 0),
    unit="label_tokens",
    clock="steps",
    workers=2,
    epochs=2,
    events={1: "peek", 3: "checkpoint", 4: "side pass", 6: "crash"},
    skips={1},
)
# loader workers, a count-path loop of rank 1 of 2: a cut epoch, a checkpoint at an epoch's end, a crash in the next
@example(
    kind="counted, make_dataloader",
    gas=1,
    world=(2, 1),
    unit="sequences",
    clock="tokens",
    workers=2,
    epochs=3,
    events={2: "cut", 11: "checkpoint", 12: "crash"},
    skips={4},
)
def test_every_loop_trains_each_batch_once_at_its_lr(kind, gas, world, unit, clock, workers, epochs, events, skips):
    """Loops that tell the scheduler each batch's record, and loops on the count path over make_dataloader, torch's
    DataLoader, a list of the pass and the sampler, with peeks, side passes, looks at other epochs, cuts (said with
    step(0)), AMP skips (step(..., skipped=True)), checkpoints and crashes between their step inputs: every update
    trains its batch at schedule(t) x B_b / mean(B), told loops weight each step input's loss to the batch mean's
    gradient, and every epoch trains its batches once each, in order, all of them unless the loop cut it."""
    loop = _Loop(kind, gas, world, unit, clock, workers, events, skips)
    loop.run(epochs)
    per_epoch = len(loop.sampler) // gas
    assert [epoch for _, epoch, _ in loop.timeline] == sorted(epoch for _, epoch, _ in loop.timeline)
    for epoch in range(epochs):
        batches = [j for kind, e, j in loop.timeline if e == epoch and kind != "cut"]
        assert batches == list(range(len(batches))), f"epoch {epoch}: batches {batches}"
        if ("cut", epoch, None) not in loop.timeline:
            assert len(batches) == per_epoch, f"epoch {epoch}: {len(batches)} of {per_epoch} batches trained"


# -- refused at the call that shows the mistake; what the count path cannot see ------------------------------------


def _told(gas=1):
    """A sampler over `_LOOP_SEQLENS`, its loader yielding each step input's record, an optimizer and its scheduler."""
    sampler = VariableBatchSampler(_LOOP_SEQLENS, 24, gradient_accumulation_steps=gas, order="random", seed=5)
    loader = make_dataloader(_LOOP_DATASET, sampler, batch_count="sequences")
    optimizer = _optimizer()
    return sampler, loader, optimizer, VariableBatchSizeLR(optimizer, "mean", sampler)


def _told_until(records, scheduler, index):
    """Steps the scheduler with the records of ``records`` (a pass) up to batch ``index``; returns that record."""
    for _, batch in records:
        scheduler.step(batch)
        if batch.index == index:
            return batch
    raise AssertionError(f"the pass has no batch {index}")


@pytest.mark.parametrize("case", ["not its batch's last", "told twice", "restored from another point", "epoch again"])
def test_a_record_that_is_not_its_batchs_last_or_goes_back_is_refused_naming_the_cause(case):
    """step(batch) is refused at once, naming the record and the fix, the scheduler unmoved, where the record is not
    its batch's last (the loop updates after each step input, the sampler's batch has 2), or its batch is before
    the scheduler's position: told a second time; the first after a restore, the sampler restored from an earlier
    point than the scheduler; an epoch trained again without set_epoch."""
    sampler, loader, _, scheduler = _told(gas=2 if case == "not its batch's last" else 1)
    records = iter(loader)
    if case == "not its batch's last":
        _, batch = next(records)
        names = ["batch 0 at step input 0 of epoch 0", "gradient_accumulation_steps=2", "where batch.last is True"]
    elif case == "told twice":
        batch = _told_until(records, scheduler, 1)
        names = ["told batch 1 a second time", "once per batch"]
    elif case == "restored from another point":
        early = sampler.state_dict(_told_until(records, scheduler, 0))
        _told_until(records, scheduler, 2)
        sampler, loader, _, restored = _told()
        sampler.load_state_dict(early)
        restored.load_state_dict(scheduler.state_dict())
        scheduler = restored
        _, batch = next(iter(loader))
        names = ["told batch 1", "restored after batch 2", "save sampler.state_dict(batch)"]
    else:
        _told_until(records, scheduler, len(sampler) - 1)  # epoch 0 whole
        _, batch = next(iter(loader))  # the next pass: epoch 0 again
        names = [f"told batch 0 (epoch 0) after batch {len(sampler) - 1}", "call sampler.set_epoch(epoch)"]
    position = (scheduler.batches_trained, scheduler.last_epoch)
    with pytest.raises(RuntimeError) as refused:
        scheduler.step(batch)
    assert all(name in str(refused.value) for name in names), refused.value
    assert (scheduler.batches_trained, scheduler.last_epoch) == position


@pytest.mark.parametrize("trainer", ["HF Trainer", "DeepSpeed engine"])
def test_a_plain_step_with_no_update_since_the_last_is_refused_where_the_trainer_steps(trainer):
    """Where the trainer steps the scheduler after each update (HF Trainer without DeepSpeed, the DeepSpeed glue's
    engine), a step() with no optimizer update since the last one, or since it was made, is refused naming the fix; a
    step after an update, and a skipped update told, go on."""
    if trainer == "HF Trainer":
        pytest.importorskip("transformers")
        hf_trainer = _fake_trainer(gradient_accumulation_steps=2)  # the sampler's
        scheduler = varbatch.hf_trainer_lr_scheduler(hf_trainer, _optimizer(), "mean", _sampler())
        fix = "leave the stepping to the trainer"
    else:
        _, (_, scheduler, _) = _glue(_glue_config(), dataset_seqlens=_GLUE_SEQLENS)
        fix = "delete your own lr_scheduler.step() after engine.step()"
    with pytest.raises(RuntimeError, match=re.escape(fix)):
        scheduler.step()
    scheduler.optimizer.step()
    scheduler.step()
    scheduler.step(skipped=True)
    with pytest.raises(RuntimeError, match=r"called again with no optimizer update since the last call") as refused:
        scheduler.step()
    assert fix in str(refused.value)
    assert scheduler.batches_trained == 2


@pytest.mark.parametrize("told", [False, True], ids=["counted", "told"])
def test_an_untold_skip_shifts_the_count_path_and_costs_a_told_loop_one_update(told):
    """AMP skips the update of batch 2 and the loop steps the scheduler after updates taken only (no skipped=True).
    Counted (as torch's and DeepSpeed's schedulers count), every later update is at the factor of the batch before
    its own, across the epoch's end too; told, the next update is at the skipped batch's factor, then the next record
    re-anchors b: every later update is at its own."""
    sampler, loader, optimizer, scheduler = _told()
    per_epoch = len(sampler)
    factors = []  # s(B_b / mean B) of every batch b of 2 epochs
    for epoch in range(2):
        sizes = sampler.plan_for_epoch(epoch).batch_sizes
        factors.extend(sizes / sizes.mean())
    assert all(factors[b] != factors[b + 1] for b in (2, per_epoch - 1)), "the case could not fail"
    applied = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: applied.append(opt.param_groups[0]["lr"]))
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for _, batch in loader:
            if batch.index == 2:  # skipped, and not said
                continue
            optimizer.step()
            scheduler.step(batch if told else None)  # None: the count path's step()
    trained = [b for b in range(2 * per_epoch) if b != 2]
    if told:
        expected = [factors[2 if b == 3 else b] for b in trained]
    else:
        expected = [factors[b if b < 2 else b - 1] for b in trained]
    for b, factor, lr in zip(trained, expected, applied):
        _check_lr(b, _BASE_LR * factor, lr)
    assert len(applied) == len(trained)


# -- horizons and clocks: schedules over epochs of different plans -------------------------------

_HORIZON_SEQLENS = np.random.default_rng(4).integers(3, 60, 500)
_HORIZON_EPOCHS = 5


def _horizon_sampler(seed=0, **kwargs):
    return VariableBatchSampler(_HORIZON_SEQLENS, 256, order="random", seed=seed, min_batch_size=2, **kwargs)


_HORIZON_SCHEDULES = {
    "OneCycleLR": lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=total),
    "CosineAnnealingLR": lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=0.01),
    "warmup + cosine SequentialLR": lambda opt, total: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=total // 10),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - total // 10, eta_min=0.01),
        ],
        milestones=[total // 10],
    ),
}


@pytest.mark.parametrize("clock, clock_step", [("steps", 1), ("tokens", 64), ("samples", 4)])
@pytest.mark.parametrize("schedule", list(_HORIZON_SCHEDULES))
def test_schedules_sized_with_the_horizon_end_exactly(schedule, clock, clock_step):
    """Sized with len(sampler) x epochs (steps) or sampler.horizon (tokens, samples), a schedule steps exactly to its
    end over epochs of different plans."""
    sampler = _horizon_sampler()
    counts = [sampler.plan_for_epoch(e).num_batches for e in range(_HORIZON_EPOCHS)]
    if clock == "steps":
        total = len(sampler) * _HORIZON_EPOCHS
    else:
        total = sampler.horizon(_HORIZON_EPOCHS, clock) // clock_step
    optimizer = _optimizer(lr=1.0)
    base = _HORIZON_SCHEDULES[schedule](optimizer, total)
    scheduler = VariableBatchSizeLR(base, "mean", sampler, clock=clock, clock_step=clock_step)
    assert len(_train(sampler, scheduler, optimizer, _HORIZON_EPOCHS)) == sum(counts)
    assert base.last_epoch == total, f"the schedule ended at step {base.last_epoch} of {total}"
    if "Cosine" in schedule:
        assert base.get_last_lr()[0] == pytest.approx(0.01, abs=1e-9)


def test_horizon_counts_the_plans_from_where_the_next_pass_starts():
    """horizon(E, unit) sums the tokens or samples of the next E epochs' plans from where the next pass starts: the
    epoch's start, or a restored position; a pass, which moves nothing, leaves it."""
    sampler = _horizon_sampler(gradient_accumulation_steps=2)
    plans = [sampler.plan_for_epoch(e) for e in range(4)]
    values = {"tokens": [p.batch_tokens for p in plans], "samples": [p.batch_sizes for p in plans]}
    assert len({int(v.sum()) for v in values["tokens"]}) > 1, "the epochs' plans no longer differ in tokens"
    for _ in zip(range(10), sampler):  # a pass left after 5 batches
        pass
    for unit, per_plan in values.items():
        assert sampler.horizon(3, unit) == sum(int(v.sum()) for v in per_plan[:3])
    sampler.load_state_dict(json.loads(json.dumps(sampler.state_dict(steps_done=10))))  # 5 batches of epoch 0 done
    for unit, per_plan in values.items():
        assert sampler.horizon(2, unit) == int(per_plan[0][5:].sum()) + int(per_plan[1].sum())
    fixed = VariableBatchSampler(_HORIZON_SEQLENS, 256, order="seqlen")
    assert fixed.horizon(4, "tokens") == 4 * int(fixed.plan.batch_tokens.sum())


# =============================================================================
# 6. Loss weights
# =============================================================================


@given(
    seqlens=st.lists(st.integers(1, 30), min_size=40, max_size=240),  # epochs of several batches
    micro_batch_size=st.integers(1, 2),
    gas=st.integers(1, 3),
    num_replicas=st.integers(1, 3),
    order=st.sampled_from(ORDERS),
    budget=st.sampled_from(BUDGETS),
    unit=st.sampled_from(["sequences", "tokens", "label_tokens", "per sample"]),
    data=st.data(),
)
@settings(max_examples=40)
def test_the_loader_yields_each_step_input_beside_its_batchs_record(
    seqlens, micro_batch_size, gas, num_replicas, order, budget, unit, data
):
    """With batch_count, every rank's loader yields each step input beside its batch's record, from any resume
    position, balanced or not (oracle: the dealing rule over the plan): rank r's t-th step input is step input g = t R
    + r (micro-batches g m .. g m + m - 1), of batch t // G, its index epoch x batches per epoch + t // G, its last
    where t % G = G - 1, its count the sum over the batch's k micro-batches."""
    options = dict(micro_batch_size=micro_batch_size, gradient_accumulation_steps=gas, num_replicas=num_replicas)
    options.update(order=order, budget=budget, seed=3)
    try:
        sampler = VariableBatchSampler(seqlens, 45, rank=0, **options)
    except ValueError as error:
        assert "not enough samples" in str(error)
        assume(False)
    if order in ("random", "bucket") and data.draw(st.booleans(), label="balance_ranks"):
        options.update(balance_ranks=True, quadratic_tokens=20.0)
    per_sample = {
        "sequences": [1] * len(seqlens),
        "tokens": seqlens,
        "label_tokens": [n - 1 for n in seqlens],  # a causal LM's labels: its inputs shifted by one
        "per sample": data.draw(st.lists(st.integers(0, 5), min_size=len(seqlens), max_size=len(seqlens))),
    }[unit]
    rank = data.draw(st.integers(0, num_replicas - 1), label="rank")
    epoch = data.draw(st.integers(0, 1), label="epoch")
    start = data.draw(st.integers(0, len(sampler) - 1), label="resumed at")
    sampler = VariableBatchSampler(seqlens, 45, rank=rank, **options)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": epoch, "steps_done": start})
    plan, k, m = sampler.plan, sampler.effective_batch_size, micro_batch_size
    loader = make_dataloader(
        list(range(len(seqlens))), sampler, batch_count=per_sample if unit == "per sample" else unit
    )
    got = list(loader)
    assert [batch.step_input for _, batch in got] == list(range(start, len(sampler)))
    for ids, batch in got:
        t, b = batch.step_input, batch.step_input // gas
        g = t * num_replicas + rank
        assert ids == [i for j in range(g * m, (g + 1) * m) for i in plan.microbatch(j).tolist()], f"step input {t}"
        count = sum(per_sample[i] for j in range(b * k, (b + 1) * k) for i in plan.microbatch(j).tolist())
        expected = varbatch.Batch(epoch * len(sampler) // gas + b, epoch, count, t % gas == gas - 1, t)
        assert batch == expected, f"step input {t}: {batch} != {expected}"


# Worked by hand: 15 samples in the dataloader order, micro-batches of at most 8 tokens (the greedy rule), 2 ranks x 2
# accumulation steps: batch 0 is micro-batches [0, 1] [2, 3] [4, 5, 6] [7, 8] (9 sequences, 29 tokens, 20 label
# tokens), batch 1 is [9] [10, 11] [12] [13, 14] (6 sequences, 27 tokens, 21 label tokens). Rank r's t-th step input
# is micro-batch 2t + r: rank 0 trains [0, 1] [4, 5, 6] [9] [12], rank 1 [2, 3] [7, 8] [10, 11] [13, 14].
_WORKED_SEQLENS = [4, 4, 3, 5, 2, 2, 2, 6, 1, 7, 3, 3, 8, 2, 4]
_WORKED_STEPS = {  # rank: (its step input's samples, its batch in the epoch, whether the batch's last) for t = 0 .. 3
    0: [([0, 1], 0, False), ([4, 5, 6], 0, True), ([9], 1, False), ([12], 1, True)],
    1: [([2, 3], 0, False), ([7, 8], 0, True), ([10, 11], 1, False), ([13, 14], 1, True)],
}


@pytest.mark.parametrize(
    "unit, counts",
    [
        ("sequences", [9, 6]),
        ("tokens", [29, 27]),
        ("label_tokens", [20, 21]),  # a causal LM's labels are its tokens shifted: one less per sequence
        (list(range(15)), [0 + 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8, 9 + 10 + 11 + 12 + 13 + 14]),  # sample i counts i
    ],
    ids=["sequences", "tokens", "label_tokens", "per sample"],
)
def test_each_records_count_and_place_on_a_case_worked_by_hand(unit, counts):
    """On the case worked by hand above, each rank's records in epochs 0 and 1: the batch's count in each unit, its
    index epoch x 2 + its batch in the epoch, its epoch, whether the step input is the rank's last of it, and t."""
    for rank, steps in _WORKED_STEPS.items():
        sampler = VariableBatchSampler(_WORKED_SEQLENS, 8, gradient_accumulation_steps=2, num_replicas=2, rank=rank)
        assert sampler.plan.microbatches() == [[0, 1], [2, 3], [4, 5, 6], [7, 8], [9], [10, 11], [12], [13, 14]]
        loader = make_dataloader(list(range(15)), sampler, batch_count=unit)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            expected = [
                (ids, varbatch.Batch(2 * epoch + b, epoch, counts[b], last, t))
                for t, (ids, b, last) in enumerate(steps)
            ]
            assert list(loader) == expected, f"rank {rank}, epoch {epoch}"


def _causal_lm_collate(samples):
    """HF causal-LM inputs: input_ids, attention_mask, labels (-100 on padding)."""
    ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=0)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s), dtype=torch.int64) for s in samples], batch_first=True)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_hf_trainer_num_items_in_batch_alone_gives_the_batch_token_mean(tmp_path):
    """The README's rule: under HF Trainer a *ForCausalLM model's loss, divided by the Trainer's
    num_items_in_batch, already gives the gradient of the batch's token mean over accumulation steps; no
    micro_batch_loss_weight. GPT2LMHeadModel gets no loss type (the README's exception)."""
    transformers = pytest.importorskip("transformers")
    vocab, gas = 64, 2
    seqlens = _lengths(96, 5, 40, seed=8)
    generator = torch.Generator().manual_seed(1)
    dataset = [torch.randint(1, vocab, (n,), generator=generator) for n in seqlens]
    sampler = VariableBatchSampler(seqlens, 256, budget="padded", order="bucket", gradient_accumulation_steps=gas)
    loader = make_dataloader(dataset, sampler, collate_fn=_causal_lm_collate)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_llama_config())
    reference = copy.deepcopy(model)
    seen, grads = [], []

    class Trainer(transformers.Trainer):
        def get_train_dataloader(self):
            return loader

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append({key: value.clone() for key, value in inputs.items()})
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Grab(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))

    args = _hf_arguments(tmp_path, max_steps=1, gradient_accumulation_steps=gas, max_grad_norm=0.0)
    Trainer(model=model, args=args, callbacks=[Grab()]).train()
    assert len(grads) == 1 and len(seen) == gas
    total, count = 0.0, 0
    for inputs in seen:  # the batch's token mean: every label token of both step inputs, shifted
        logits = reference(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        labels = inputs["labels"][:, 1:]
        total = total + torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        count += int((labels != -100).sum())
    (total / count).backward()
    want = torch.cat([p.grad.flatten() for p in reference.parameters()])
    error = float((grads[0] - want).norm() / want.norm())
    assert error < 1e-5, f"the Trainer's gradient is {error:.2g} off the batch token mean's"
    shares = [int((inputs["labels"][:, 1:] != -100).sum()) / count * gas for inputs in seen]
    assert max(abs(share - 1) for share in shares) > 0.01, "a weight would change nothing: the test proves nothing"
    assert model.loss_type == "ForCausalLM"
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=vocab))
    assert gpt2.loss_type is None


# =============================================================================
# 7. Seqlens source
# =============================================================================

_X = torch.tensor([[5, 6, 0], [7, 0, 0]])  # real lengths [2, 1] when measured


@pytest.mark.parametrize(
    "batch, kwargs, expected",
    [
        # read, not measured: PaddedCollate's lengths (by type, or by its key in a dict), a dict's attention_mask
        pytest.param(lambda: PaddedCollate()([torch.tensor([5, 0, 0]), torch.tensor([7])]), {}, [3, 1], id="tuple"),
        pytest.param(
            lambda: PaddedCollate()([{"ids": torch.tensor([5, 0])}, {"ids": torch.tensor([7])}]), {}, [2, 1], id="dict"
        ),
        pytest.param(
            lambda: PaddedCollate(seqlens_key="n")([{"ids": torch.tensor([5, 0])}, {"ids": torch.tensor([7])}]),
            dict(seqlens_key="n"),
            [2, 1],
            id="dict, own key",
        ),
        pytest.param(
            lambda: {"input_ids": _X, "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])},
            {},
            [3, 1],
            id="attention_mask",
        ),
        # the rest: measured from its tensor
        pytest.param(lambda: {"input_ids": _X, "labels": torch.tensor([3, 9])}, {}, [2, 1], id="dict measured"),
        pytest.param(lambda: (_X, torch.tensor([3, 9])), {}, [2, 1], id="(x, labels)"),  # 1-D int labels: not lengths
        pytest.param(lambda: [_X, torch.tensor([3, 9])], {}, [2, 1], id="[x, labels]"),
        pytest.param(lambda: _X, {}, [2, 1], id="tensor"),
        pytest.param(
            lambda: torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[0.0, 2.0], [3.0, 0.0]]]), {}, [1, 2], id="B x S x E"
        ),
        pytest.param(
            lambda: torch.tensor([[5, -1, 6, -1], [-1, -1, -1, -1]]), dict(pad_value=-1), [3, 0], id="pad_value"
        ),
    ],
)
def test_seqlens_from_padded_recognises_padded_collate_and_measures_the_rest(batch, kwargs, expected):
    """PaddedCollate's lengths are recognised by type or key, a dict's attention_mask is read; anything else is measured
    from its tensor."""
    assert seqlens_from_padded(batch(), **kwargs) == expected


def test_deepspeed_glue_computes_seqlens_once_then_reads_the_cache(tmp_path):
    """batch_seqlens_fn gets collated batches; the cache in metrics_path is read back, and a stale one is redone."""
    seqlens = _GLUE_SEQLENS * 40
    dataset = [torch.arange(1, n + 1) for n in seqlens]
    calls = []

    def batch_seqlens(batch):
        _padded, lengths = batch  # made by dataloader_collate_fn
        calls.append(len(lengths))
        return lengths

    config = _glue_config(metrics_path=str(tmp_path))
    kwargs = dict(dataloader_collate_fn=PaddedCollate(), batch_seqlens_fn=batch_seqlens)
    _, (loader, _, _) = _glue(config, dataset, **kwargs)
    assert sum(calls) == len(seqlens)
    assert np.load(tmp_path / "varbatch_seqlens.npy").tolist() == seqlens
    expected = plan_batches(seqlens, 16, effective_batch_size=2, seed=1234)
    assert loader.variable_batch_sampler.plan.microbatches() == expected.microbatches()
    calls.clear()
    _glue(config, dataset, **kwargs)  # from the cache: only a spot check is measured
    assert 0 < sum(calls) < len(seqlens)
    changed = [torch.arange(1, n + 2) for n in seqlens]  # same size, other lengths: the cache is stale
    calls.clear()
    _glue(config, changed, **kwargs)
    assert sum(calls) > len(seqlens)  # spot check, then every sample
    assert np.load(tmp_path / "varbatch_seqlens.npy").tolist() == [n + 1 for n in seqlens]


@pytest.mark.parametrize("kind", ["tensors", "(label, tokens) tuples", "dicts"])
def test_deepspeed_glue_measures_seqlens_of_samples_it_collates_itself(kind):
    """Without a collate function the glue collates with PaddedCollate, so seqlens_from_padded gets real lengths."""
    seqlens = _GLUE_SEQLENS * 3
    tokens = [torch.arange(1, n + 1) for n in seqlens]
    data = {
        "tensors": tokens,
        "(label, tokens) tuples": [(i % 2, x) for i, x in enumerate(tokens)],
        "dicts": [{"input_ids": x, "label": i % 2} for i, x in enumerate(tokens)],
    }[kind]
    _, (loader, _, _) = _glue(_glue_config(), data, batch_seqlens_fn=seqlens_from_padded)
    expected = plan_batches(seqlens, 16, effective_batch_size=2, seed=1234)
    assert loader.variable_batch_sampler.plan.microbatches() == expected.microbatches()


def test_deepspeed_glue_reads_deepspeed_metric_files(tmp_path):
    """Seqlens written by DeepSpeed's DataAnalyzer (seqlen/seqlen_sample_to_metric.bin/.idx) are used as they are."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDatasetBuilder

    os.makedirs(tmp_path / "seqlen")
    prefix = str(tmp_path / "seqlen" / "seqlen_sample_to_metric")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int64)
    for n in _GLUE_SEQLENS:
        builder.add_item(torch.tensor([n], dtype=torch.int64))
    builder.finalize(prefix + ".idx")
    _, (loader, _, _) = _glue(_glue_config(metrics_path=str(tmp_path)), [torch.ones(n) for n in _GLUE_SEQLENS])
    expected = plan_batches(_GLUE_SEQLENS, 16, effective_batch_size=2, seed=1234)
    assert loader.variable_batch_sampler.plan.microbatches() == expected.microbatches()


class _NoLen:
    """A map-style dataset without __len__: sample i is ``torch.full((seqlens[i],), i + 1)``."""

    def __init__(self, seqlens):
        self.seqlens = seqlens

    def __getitem__(self, i):
        return torch.full((self.seqlens[i],), i + 1)


def test_a_dataset_without_len_is_sized_by_its_seqlens():
    """A dataset without __len__ is accepted (by the DeepSpeed-named function and the make_dataloader it calls): its
    size is the number of seqlens."""
    seqlens = _lengths(30, 1, 9, seed=17)
    loader, _, _ = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size(
        _NoLen(seqlens),
        seqlens,
        max_tokens=20,
        effective_batch_size=2,
        dataloader_collate_fn=PaddedCollate(),
        lr_scheduler_or_optimizer=_optimizer(),
        lr_scaling_reference="mean",
    )
    plan = loader.variable_batch_sampler.plan
    trained = [i for x, _ in loader for i in _ids_of(x)]
    assert sorted(trained) == sorted(plan.sample_ids.tolist()) and len(trained) + plan.num_dropped == 30


# =============================================================================
# 8. Determinism and resume
# =============================================================================
# Resumes from checkpoints, after a crash inside a batch too: test_every_loop_trains_each_batch_once_at_its_lr.


@pytest.mark.parametrize("owner", ["sampler", "scheduler"])
@pytest.mark.parametrize(
    "edit, names",
    [
        pytest.param(lambda state: dict(state, bogus=1), ["unknown keys ['bogus']"], id="unknown key"),
        pytest.param(
            lambda state: {key: value for key, value in state.items() if key != "version"},
            ["varbatch 0.3", varbatch.__version__],
            id="0.3 (no version)",
        ),
        pytest.param(lambda state: dict(state, version="0.3.0"), ["varbatch 0.3.0", varbatch.__version__], id="0.3.0"),
        pytest.param(lambda state: dict(state, version="0.4.0"), ["varbatch 0.4.0", varbatch.__version__], id="0.4.0"),
    ],
)
def test_load_state_dict_refuses_an_unknown_key_or_another_version_and_keeps_its_argument(owner, edit, names):
    """A sampler's or scheduler's state of a run loads into fresh objects and is left as it was; with an unknown key, or
    saved by another varbatch (0.3's had no version), it is refused naming the key or both versions."""

    def objects():
        sampler = _sampler()
        optimizer = _optimizer()
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
        return sampler, optimizer, VariableBatchSizeLR(schedule, "mean", sampler, clock="tokens", clock_step=16)

    sampler, optimizer, scheduler = objects()
    _train(sampler, scheduler, optimizer, epochs=1)
    state = {"sampler": sampler.state_dict(steps_done=4), "scheduler": scheduler.state_dict()}[owner]
    before = copy.deepcopy(state)
    fresh_sampler, _, fresh_scheduler = objects()
    target = fresh_sampler if owner == "sampler" else fresh_scheduler
    target.load_state_dict(state)
    assert state == before, "load_state_dict changed its argument"
    with pytest.raises(ValueError) as refused:
        target.load_state_dict(edit(state))
    assert all(name in str(refused.value) for name in names), refused.value


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
    """A scheduler state saved for other batch sizes or LR settings (clock included) is refused, naming them."""
    seqlens = _lengths(60, seed=10)
    samplers = [VariableBatchSampler(seqlens, 50, order="random", seed=s) for s in (1, 2)]
    assert samplers[0].plan.batch_sizes.tolist() != samplers[1].plan.batch_sizes.tolist()
    state = VariableBatchSizeLR(_optimizer(), "mean", samplers[0]).state_dict()
    with pytest.raises(ValueError, match=re.escape("saved with sampler.seed=1 into one with sampler.seed=2")):
        VariableBatchSizeLR(_optimizer(), "mean", samplers[1]).load_state_dict(state)
    # Batch sizes alone (a list, no sampler to compare settings with): refused by their fingerprint.
    listed = VariableBatchSizeLR(_optimizer(), "mean", samplers[0].plan.batch_sizes.tolist()).state_dict()
    with pytest.raises(ValueError, match="other batch sizes"):
        VariableBatchSizeLR(_optimizer(), "mean", samplers[1].plan.batch_sizes.tolist()).load_state_dict(listed)
    with pytest.raises(
        ValueError, match=re.escape("lr_scaling_method='linear' into one with lr_scaling_method='sqrt'")
    ):
        VariableBatchSizeLR(_optimizer(), "mean", samplers[0], lr_scaling_method="sqrt").load_state_dict(state)
    with pytest.raises(ValueError, match=re.escape("clock='steps' into one with clock='tokens'")):
        VariableBatchSizeLR(_optimizer(), "mean", samplers[0], clock="tokens").load_state_dict(state)


def test_plans_samplers_and_loaders_pickle_and_deep_copy():
    """A Plan, a sampler with a restored position pending and its same-length loader (its PaddedCollate and partial of
    pad_sample: spawned workers) survive pickle (as broadcast_object_list sends them) and deepcopy: a clone's next
    pass continues from the position, padded with the real lengths, the pass after it is the whole epoch."""
    seqlens = [*_lengths(80, 1, 30, seed=16), 99]
    options = dict(gradient_accumulation_steps=2, order="random", seed=3, same_size=True, same_length=True)
    sampler = VariableBatchSampler(seqlens, 60, **options)
    padding = functools.partial(pad_sample, pad_value=0)
    loader = make_dataloader(_id_dataset(seqlens), sampler, collate_fn=PaddedCollate(), sample_padding_fn=padding)
    plan = sampler.plan
    assert plan.dropped["over_budget"].tolist() == [80]
    for clone in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
        assert clone.fingerprint() == plan.fingerprint() and clone.epoch == plan.epoch
        assert clone.totals() == plan.totals()
        for reason in DROP_REASONS:
            np.testing.assert_array_equal(clone.dropped[reason], plan.dropped[reason])
    sampler.set_epoch(1)
    sampler.load_state_dict(sampler.state_dict(steps_done=2))
    clones = [pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)]
    samplers = [pickle.loads(pickle.dumps(sampler)), copy.deepcopy(sampler)]
    assert all(s.state_dict() == sampler.state_dict() for s in samplers + [c.variable_batch_sampler for c in clones])
    expected = [list(sampler) for _ in range(2)]
    assert expected[0] == expected[1][2:]
    for clone in samplers:
        assert [list(clone) for _ in range(2)] == expected
    for clone in clones:
        shown = [[(_ids_of(x), lens.tolist()) for x, lens in clone] for _ in range(2)]
        assert shown == [[(ids, [seqlens[i] for i in ids]) for ids in step_inputs] for step_inputs in expected]


def test_state_dicts_are_plain_data_also_from_numpy_settings():
    """Settings given as numpy numbers give JSON-serialisable states that load into plain-int objects."""
    seqlens = _lengths(60, seed=18)
    options = dict(micro_batch_size=1, gradient_accumulation_steps=2, seed=3, min_batch_size=1, max_batch_size=9)
    numpy_options = {name: np.int64(value) for name, value in options.items()}
    numpy_options["gradient_accumulation_steps"] = np.int32(2)  # numpy's other integer width too
    sampler = VariableBatchSampler(np.asarray(seqlens, dtype=np.int32), np.int64(50), order="random", **numpy_options)
    optimizer = _optimizer()
    scheduler = VariableBatchSizeLR(optimizer, np.float64(4.0), sampler)
    _train(sampler, scheduler, optimizer, epochs=1)
    states = json.loads(json.dumps({"sampler": sampler.state_dict(), "scheduler": scheduler.state_dict()}))
    plain = VariableBatchSampler(seqlens, 50, order="random", **options)
    plain.load_state_dict(states["sampler"])
    VariableBatchSizeLR(_optimizer(), 4.0, plain).load_state_dict(states["scheduler"])
    assert plain.state_dict() == states["sampler"]


# -- HF Trainer and TRL: hf_trainer_lr_scheduler (NOTE [HF Trainer's skipped updates]) ---------------------------


class _HFRecorder:
    """Per real optimizer update: the LR applied and the (epoch, sample ids) of the step inputs it trained."""

    def __init__(self, sampler):
        self.sampler, self.pending, self.updates, self.trained = sampler, [], [], []

    def collate(self, samples):
        inputs = _causal_lm_collate([s["input_ids"] for s in samples])
        return {**inputs, "idx": torch.tensor([s["idx"] for s in samples]), "epoch": torch.tensor(self.sampler.epoch)}

    def hook(self, optimizer, args, kwargs):  # a torch optimizer pre-step hook: one per real update
        self.updates.append((optimizer.param_groups[0]["lr"], list(self.pending)))


def _hf_trainer(tmp_path, lengths, *, order, seed, epochs=2, prepared=True, sampler_options=(), skips=(), **arguments):
    """An HF Trainer subclass over varbatch's loader (``prepared``: as the README's recipe returns it) and the
    Trainer's own schedule (``lr_scheduler_type``, constant by default) scaled by B_b / mean(B) through
    `hf_trainer_lr_scheduler`, ``epochs`` epochs; the loss is inf at the updates ``skips`` (give its accelerator a
    GradScaler, and a non-fused optim, to skip them)."""
    import transformers

    sampler = VariableBatchSampler(lengths, 256, budget="padded", order=order, seed=seed, **dict(sampler_options))
    record = _HFRecorder(sampler)
    tokens = torch.randint(0, 63, (sum(lengths),), generator=torch.Generator().manual_seed(1)).split(lengths)
    data = [{"idx": i, "input_ids": ids} for i, ids in enumerate(tokens)]
    loader = make_dataloader(data, sampler, collate_fn=record.collate)
    made = []

    class VarbatchTrainer(transformers.Trainer):
        def get_train_dataloader(self):
            if not made:
                made.append(self.accelerator.prepare(loader) if prepared else loader)
            return made[0]

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                schedule = super().create_scheduler(num_training_steps, optimizer)
                self.lr_scheduler = varbatch.hf_trainer_lr_scheduler(self, schedule, "mean", sampler)
                self.optimizer.optimizer.register_step_pre_hook(record.hook)  # Accelerate's wrapper holds it
            return self.lr_scheduler

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            idx, epoch = inputs.pop("idx"), int(inputs.pop("epoch"))
            record.pending.extend((epoch, int(i)) for i in idx)
            record.trained.extend((epoch, int(i)) for i in idx)
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss * math.inf if self.state.global_step in skips else loss

    class Clear(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            record.pending.clear()

    torch.manual_seed(0)
    arguments = {"lr_scheduler_type": "constant", **arguments}
    args = _hf_arguments(tmp_path, num_train_epochs=epochs, learning_rate=1e-3, **arguments)
    trainer = VarbatchTrainer(model=transformers.LlamaForCausalLM(_tiny_llama_config()), args=args, callbacks=[Clear()])
    return trainer, sampler, record


def _hf_updates_off(sampler, record, lr=1e-3, schedule=None, skips=()):
    """Real updates whose LR is not lr x schedule(t) x B_b / mean(B) of the one batch b whose samples they trained, t
    the updates taken before it (b less the ``skips`` before b; ``schedule`` None: constant)."""
    off = 0
    for applied, pending in record.updates:
        (epoch,) = {e for e, _ in pending}
        plan = sampler.plan_for_epoch(epoch)
        where = {int(i): j // plan.effective_batch_size for j, mb in enumerate(plan.microbatches()) for i in mb}
        (batch,) = {where[i] for _, i in pending}
        b = epoch * plan.num_batches + batch
        factor = 1.0 if schedule is None else schedule(b - sum(1 for skip in skips if skip < b))
        want = lr * factor * plan.batch_sizes[batch] / plan.batch_sizes.mean()
        off += not math.isclose(applied, want, rel_tol=1e-6, abs_tol=1e-15)
    return off


def _hf_linear(total, warmup):
    """HF's ``lr_scheduler_type="linear"`` factor at update t (transformers' get_linear_schedule_with_warmup)."""

    def factor(t):
        if t < warmup:
            return t / max(1, warmup)
        return max(0.0, (total - t) / max(1, total - warmup))

    return factor


def test_hf_trainer_tells_skipped_updates_and_resumes_inside_a_later_epoch_exactly(tmp_path):
    """HF Trainer with hf_trainer_lr_scheduler over the prepared loader, 2 epochs whose packings differ, the Trainer's
    linear schedule with warmup, a real GradScaler skipping 3 updates (in epoch 0, right before the checkpoint inside
    epoch 1, after it): every update at schedule(t) x B_b / mean(B) (t the updates taken before it), every logged
    learning_rate its batch's, b = global_step and t = global_step - 3 at the end; resumed from the checkpoint by the
    Trainer's own skip, the rest of the run trains the same batches at the same LRs; resumed over the unprepared
    loader, or with ignore_data_skip=True, it is refused before any update, naming the fix."""
    pytest.importorskip("transformers")
    lengths = torch.randint(5, 40, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    seed = _packings_differ(lengths, 256, (0, 1), budget="padded", order="random")
    gas = {"gradient_accumulation_steps": 2}
    common = dict(order="random", seed=seed, sampler_options=gas, optim="adamw_torch", max_grad_norm=0.0, **gas)
    probe = VariableBatchSampler(lengths, 256, budget="padded", order="random", seed=seed, **gas)
    per_epoch = probe._batches_per_epoch()
    at, skips = per_epoch + 3, {2, per_epoch + 2, per_epoch + 5}  # checkpoint-{at}: epoch 1, after its batch 2
    schedule = _hf_linear(2 * per_epoch, 2)
    run = dict(lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps", save_steps=at, skips=skips)
    first, sampler, record = _hf_trainer(
        tmp_path / "a", lengths, logging_strategy="steps", logging_steps=1, **run, **common
    )
    first.accelerator.scaler = torch.amp.GradScaler("cpu")  # Accelerate makes none on CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    try:
        first.train()
        resumed, _, rest = _hf_trainer(tmp_path / "b", lengths, **run, **common)
        resumed.accelerator.scaler = torch.amp.GradScaler("cpu")  # the checkpoint holds the scaler's state
        resumed.train(resume_from_checkpoint=str(tmp_path / "a" / f"checkpoint-{at}"))
        refusals = {}
        for name, options in (("unprepared", {"prepared": False}), ("ignore_data_skip", {"ignore_data_skip": True})):
            refused, _, never = _hf_trainer(tmp_path / name, lengths, **options, **common)
            refused.accelerator.scaler = torch.amp.GradScaler("cpu")
            with pytest.raises(RuntimeError) as caught:
                refused.train(resume_from_checkpoint=str(tmp_path / "a" / f"checkpoint-{at}"))
            refusals[name] = (str(caught.value), len(never.updates))
    finally:
        torch.set_num_threads(threads)
    total = 2 * per_epoch
    assert len(record.updates) == total - len(skips), "the GradScaler did not skip the updates"
    assert (first.state.global_step, first.lr_scheduler.batches_trained) == (total, total)
    assert first.lr_scheduler.last_epoch == total - len(skips), "the wrapped schedule moved on skipped updates"
    assert _hf_updates_off(sampler, record, schedule=schedule, skips=skips) == 0
    assert _hf_never_and_twice(sampler, record.trained, (0, 1)) == (0, 0)
    logged = [(entry["step"], entry["learning_rate"]) for entry in first.state.log_history if "learning_rate" in entry]
    assert [step for step, _ in logged] == list(range(1, total + 1))
    for step, lr in logged:  # the skipped updates' entries too: the LR their update would have used
        epoch, batch = divmod(step - 1, per_epoch)
        sizes = probe.plan_for_epoch(epoch).batch_sizes
        t = step - 1 - sum(1 for skip in skips if skip < step - 1)
        _check_lr(step - 1, 1e-3 * schedule(t) * sizes[batch] / sizes.mean(), lr)
    after = record.updates[at - sum(1 for skip in skips if skip < at) :]  # the real updates from batch `at` on
    assert [pending for _, pending in rest.updates] == [pending for _, pending in after], "not the rest of the run"
    assert [lr for lr, _ in rest.updates] == pytest.approx([lr for lr, _ in after], rel=1e-12), "LRs differ"
    assert (resumed.state.global_step, resumed.lr_scheduler.batches_trained) == (total, total)
    assert refusals["unprepared"][1] == refusals["ignore_data_skip"][1] == 0, "trained before the refusal"
    assert "self.accelerator.prepare(loader)" in refusals["unprepared"][0], refusals
    assert "ignore_data_skip=True" in refusals["ignore_data_skip"][0], refusals


def _fake_trainer(gradient_accumulation_steps=1, ignore_data_skip=False):
    """What hf_trainer_lr_scheduler reads of an HF Trainer: its args, add_callback (the callbacks kept in a list)."""
    args = types.SimpleNamespace(
        gradient_accumulation_steps=gradient_accumulation_steps, ignore_data_skip=ignore_data_skip
    )
    callbacks = []
    return types.SimpleNamespace(args=args, add_callback=callbacks.append, accelerator=None, callbacks=callbacks)


def test_hf_adapter_moves_b_to_global_step_and_refuses_a_scheduler_ahead_of_it():
    """The adapter's callback at on_step_end: step(skipped=True) while HF's global_step is ahead of b (t stays); a
    scheduler ahead of global_step (stepped besides the Trainer) is refused naming it; the callback of a scheduler that
    another train() replaced does nothing; on_train_begin moves b to a resumed global_step the same way."""
    pytest.importorskip("transformers")
    trainer = _fake_trainer(gradient_accumulation_steps=2)  # the sampler's
    sampler = _sampler(order="random")
    scheduler = varbatch.hf_trainer_lr_scheduler(trainer, _optimizer(_BASE_LR), "mean", sampler)
    (callback,) = trainer.callbacks
    state, args = types.SimpleNamespace(global_step=3), trainer.args
    callback.on_step_end(args, state, None, lr_scheduler=scheduler)
    assert (scheduler.batches_trained, scheduler.last_epoch) == (3, 0), "b moves to global_step, t stays"
    sizes = sampler.plan_for_epoch(0).batch_sizes
    _check_lr(3, _BASE_LR * sizes[3] / sizes.mean(), scheduler.get_last_lr()[0])
    callback.on_step_end(args, types.SimpleNamespace(global_step=99), None, lr_scheduler=object())
    assert scheduler.batches_trained == 3, "the callback of a replaced scheduler moved it"
    callback.on_train_begin(args, types.SimpleNamespace(global_step=5), None, lr_scheduler=scheduler)
    assert scheduler.batches_trained == 5
    with pytest.raises(RuntimeError, match=r"global_step is 4.*besides the Trainer"):
        callback.on_step_end(args, types.SimpleNamespace(global_step=4), None, lr_scheduler=scheduler)


def test_hf_adapter_lets_ignore_data_skip_resume_at_an_epochs_start():
    """on_train_begin of a run resumed at an epoch's start with ignore_data_skip=True (nothing to skip) goes on, b at
    global_step. (Inside an epoch, or over a loader not prepared, it is refused naming the fix:
    test_hf_trainer_tells_skipped_updates_and_resumes_inside_a_later_epoch_exactly.)"""
    pytest.importorskip("transformers")
    trainer = _fake_trainer(gradient_accumulation_steps=2, ignore_data_skip=True)
    sampler = _sampler(order="random")
    scheduler = varbatch.hf_trainer_lr_scheduler(trainer, _optimizer(), "mean", sampler)
    state = types.SimpleNamespace(global_step=sampler._batches_per_epoch())
    prepared = object()  # a loader Accelerate prepared
    trainer.callbacks[0].on_train_begin(trainer.args, state, None, lr_scheduler=scheduler, train_dataloader=prepared)
    assert scheduler.batches_trained == state.global_step


# -- accelerate's skip_first_batches over a loader that was not prepared, on 2 ranks ------------------------------

_UNDEALT_SKIP = r"skip_first_batches.*self\.accelerator\.prepare\(loader\).*README's HF Trainer recipe"


@pytest.mark.parametrize("skip", [2, 3])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_resume_skip_over_a_loader_that_was_not_prepared_names_the_cause_and_the_fix(rank, skip):
    """accelerate's skip_first_batches (HF Trainer's resume skip) over an unprepared loader of rank 0 or 1 of 2
    rebuilds a DataLoader over every rank's step inputs: stopped at the first or second step input, naming
    skip_first_batches and the fix, the loader prepared as the README's HF Trainer recipe returns it."""
    accelerate = pytest.importorskip("accelerate")
    sampler = VariableBatchSampler(_lengths(80, 1, 40, seed=8), 70, num_replicas=2, rank=rank, order="random", seed=4)
    loader = make_dataloader(_id_dataset(sampler.seqlens), sampler)
    got = []
    with pytest.raises(RuntimeError, match=_UNDEALT_SKIP):
        for step in accelerate.skip_first_batches(loader, skip):
            got.append(step)
    assert len(got) <= 1


# =============================================================================
# 9. Bad input: one table per entry point
# =============================================================================
# One row per distinct refusal: a check, or another path to it; each row's call raises the exception type it names,
# with a message that names the fix (the setting to change, or what to pass).


def _refusal(case, error, names, call, /, *args, **kwargs):
    """A table row: ``call(*args, **kwargs)`` raises ``error``, its message naming each of ``names``, the words of
    a string."""
    return pytest.param(functools.partial(call, *args, **kwargs), error, names, id=case)


def _check_refused(call, error, names):
    """``call()`` raises ``error``, its message naming each word of ``names``."""
    with pytest.raises(error) as info:
        call()
    for name in names.split():
        assert name in str(info.value), f"the message does not name {name!r}: {info.value}"


def _bad_plan(case, error, names, seqlens=(1, 2, 3), max_tokens=10, **options):
    """A row of plan_batches' table: ``plan_batches(seqlens, max_tokens, **options)`` is refused."""
    return _refusal(case, error, names, plan_batches, seqlens, max_tokens, **options)


_BAD_PLAN_BATCHES = [
    # seqlens: each path to the one check of a sequence of whole numbers
    _bad_plan("seqlens 0", ValueError, "seqlens", [3, 0]),
    _bad_plan("seqlens a fraction", ValueError, "seqlens", [3, 2.5]),
    _bad_plan("seqlens beyond int64", ValueError, "seqlens", np.array([2**63 + 5, 3], np.uint64)),
    _bad_plan("seqlens two-dimensional", ValueError, "seqlens", [[1, 2], [3, 4]]),
    _bad_plan("seqlens ragged", ValueError, "seqlens", [[1, 2], [3]]),
    _bad_plan("seqlens not numbers", TypeError, "seqlens", ["a", "b"]),
    _bad_plan("seqlens a string", TypeError, "seqlens", "abc"),
    _bad_plan("seqlens a generator", TypeError, "seqlens", (n for n in [3, 2])),
    # each kind of setting (the fields of a kind share one check), then the rules that relate two settings
    _bad_plan("max_tokens 0", ValueError, "max_tokens", max_tokens=0),
    _bad_plan("max_tokens over its limit", ValueError, "max_tokens", max_tokens=2**62),
    _bad_plan("max_tokens a fraction", TypeError, "max_tokens", max_tokens=2.5),
    _bad_plan("max_tokens a bool", TypeError, "max_tokens", max_tokens=True),
    _bad_plan("min_batch_size 0.0", TypeError, "min_batch_size", min_batch_size=0.0),
    _bad_plan("max_batch_size False", TypeError, "max_batch_size", max_batch_size=False),
    _bad_plan("same_size not a bool", TypeError, "same_size", same_size="yes"),
    _bad_plan("seed negative", ValueError, "seed", seed=-1),
    _bad_plan("bucket_size 0", ValueError, "bucket_size", bucket_size=0),
    _bad_plan("quadratic_tokens 0", ValueError, "quadratic_tokens", quadratic_tokens=0),
    _bad_plan("unknown option", TypeError, "'bucket_size'", bucketsize=3),
    _bad_plan("batch of part step inputs", ValueError, "train_batch_size", effective_batch_size=3, micro_batch_size=2),
    _bad_plan("min above max", ValueError, "min_batch_size max_batch_size", min_batch_size=3, max_batch_size=2),
    _bad_plan("padded same_length alone", ValueError, "same_size=True", budget="padded", same_length=True),
    _bad_plan("padding-free padded", ValueError, "budget='sum'", budget="padded", padding_free=True),
    _bad_plan("balanced without q", ValueError, "quadratic_tokens=q", order="random", balance_ranks=True),
    _bad_plan(
        "balanced in order", ValueError, "sequence_picking_order='random'", balance_ranks=True, quadratic_tokens=9
    ),
    # the epoch, the subset, and lengths the settings cannot plan
    _bad_plan("epoch negative", ValueError, "epoch", epoch=-1),
    _bad_plan("sample_ids out of range", ValueError, "sample_ids", sample_ids=[0, 5]),
    _bad_plan("sample_ids negative", ValueError, "sample_ids", sample_ids=[-1, 0]),
    _bad_plan("sample_ids twice", ValueError, "sample_ids", sample_ids=[0, 1, 1]),
    _bad_plan("sample_ids floats", TypeError, "sample_ids", sample_ids=[0.0, 1.0]),
    _bad_plan("sample_ids a set", TypeError, "sample_ids", sample_ids={0, 1}),
    _bad_plan("overlong", ValueError, "max_tokens=5 (ids 1, 2) on_overlong='skip'", [2, 6, 7], 5, on_overlong="error"),
    _bad_plan("every sample over budget", ValueError, "max_tokens=3 (shortest 4)", [5, 4, 9], 3),
    _bad_plan("too few samples", ValueError, "effective_batch_size min_batch_size", [1, 1, 1], effective_batch_size=4),
]


@pytest.mark.parametrize("call, error, names", _BAD_PLAN_BATCHES)
def test_bad_input_plan_batches(call, error, names):
    """plan_batches refuses bad input with a TypeError/ValueError naming the value and its fix."""
    _check_refused(call, error, names)


_BAD_SCALE_LR = [
    _refusal("base_batch_size 0", ValueError, "base_batch_size", scale_lr, 0, 4),
    _refusal("base_batch_size a string", TypeError, "base_batch_size", scale_lr, "2", 4),
    _refusal("batch_size negative", ValueError, "batch_size", scale_lr, 2, -1),
    _refusal("base_lr a string", TypeError, "base_lr", scale_lr, 2, 4, "x"),
    _refusal("method returns a negative factor", ValueError, "lr_scaling_method", scale_lr, 2, 4, method=lambda r: -r),
    _refusal("B / B_ref overflows", ValueError, "lr_scaling_reference base_batch_size", scale_lr, 1e-320, 4),
]


@pytest.mark.parametrize("call, error, names", _BAD_SCALE_LR)
def test_bad_input_scale_lr(call, error, names):
    """scale_lr refuses bad input with a TypeError/ValueError naming the value."""
    _check_refused(call, error, names)


_BAD_LOSS_WEIGHT = [
    _refusal("num_replicas a fraction", TypeError, "num_replicas", micro_batch_loss_weight, 2, 10, num_replicas=1.5),
    _refusal(
        "gradient_accumulation_steps negative",
        ValueError,
        "gradient_accumulation_steps",
        micro_batch_loss_weight,
        2,
        10,
        gradient_accumulation_steps=-1,
    ),
    _refusal("batch_count 0", ValueError, "batch_count", micro_batch_loss_weight, 0, 0),
    _refusal("count negative", ValueError, "count", micro_batch_loss_weight, -1, 10),
    _refusal("count above batch_count", ValueError, "count batch_count", micro_batch_loss_weight, 11, 10),
]


@pytest.mark.parametrize("call, error, names", _BAD_LOSS_WEIGHT)
def test_bad_input_micro_batch_loss_weight(call, error, names):
    """micro_batch_loss_weight refuses bad input with a TypeError/ValueError naming the value."""
    _check_refused(call, error, names)


def _given_microbatches_loader():
    """A loader over given micro-batches (dataloader_for_variable_batch_size): its fixed plan has no seqlens."""
    microbatch_ids, _, batch_max_seqlens = varbatch.batch_by_seqlens(_GLUE_SEQLENS, 10)
    loader, _ = varbatch.dataloader_for_variable_batch_size(
        [torch.ones(n) for n in _GLUE_SEQLENS], microbatch_ids, batch_max_seqlens, dataloader_num_workers=0
    )
    return loader


def _given_sampler():
    """The sampler of `_given_microbatches_loader`, whose plans have no token counts."""
    return _given_microbatches_loader().variable_batch_sampler


def _load_state_saved_with(option):
    """A sampler with ``option`` off loads the state of one with it on."""
    options = dict(num_replicas=1, rank=0, order="random", quadratic_tokens=9)
    state = VariableBatchSampler([3, 5, 2, 6, 4, 1], 8, **{option: True}, **options).state_dict()
    VariableBatchSampler([3, 5, 2, 6, 4, 1], 8, **options).load_state_dict(state)


def _four_samples(**options):
    """A sampler of four samples, seqlens 1 to 4, max_tokens 10."""
    return VariableBatchSampler([1, 2, 3, 4], 10, **options)


_BAD_SAMPLER = [
    _refusal("micro_batch_size 0", ValueError, "micro_batch_size", _four_samples, micro_batch_size=0),
    _refusal(
        "accumulation 1.5", TypeError, "gradient_accumulation_steps", _four_samples, gradient_accumulation_steps=1.5
    ),
    _refusal("num_replicas 0", ValueError, "num_replicas", _four_samples, num_replicas=0),
    _refusal("rank negative", ValueError, "rank", _four_samples, rank=-1),
    _refusal("rank out of range", ValueError, "rank num_replicas", _four_samples, num_replicas=2, rank=2),
    _refusal(
        "effective_batch_size given",
        TypeError,
        "micro_batch_size gradient_accumulation_steps num_replicas",
        _four_samples,
        effective_batch_size=4,
    ),
    _refusal("too few samples", ValueError, "min_batch_size", VariableBatchSampler, [1, 1, 1], 10, micro_batch_size=4),
    _refusal("set_epoch negative", ValueError, "epoch", lambda: _four_samples().set_epoch(-1)),
    _refusal("horizon of 0 epochs", ValueError, "epochs", lambda: _four_samples().horizon(0, "tokens")),
    _refusal("horizon in steps", ValueError, "tokens samples", lambda: _four_samples().horizon(3, "steps")),
    _refusal(
        "horizon in tokens, no seqlens", ValueError, "make_dataloader", lambda: _given_sampler().horizon(2, "tokens")
    ),
    _refusal("state_dict of no Batch", TypeError, "Batch str", lambda: _four_samples().state_dict("batch 0")),
    _refusal(
        "state_dict of a Batch and a count",
        TypeError,
        "batch steps_done",
        lambda: _four_samples().state_dict(varbatch.Batch(0, 0, 4, True, 0), steps_done=1),
    ),
    _refusal("state_dict at step -1", ValueError, "steps_done=-1", lambda: _four_samples().state_dict(steps_done=-1)),
    _refusal("state_dict past the end", ValueError, "steps_done=2", lambda: _four_samples().state_dict(steps_done=2)),
    _refusal("load_state_dict not a dict", TypeError, "dict", lambda: _four_samples().load_state_dict("state")),
    _refusal(
        "load_state_dict past the epoch's end",
        ValueError,
        "steps_done",
        lambda: _four_samples().load_state_dict(dict(_four_samples().state_dict(), steps_done=999)),
    ),
    # the settings that change a plan's form are part of a state's settings
    _refusal("a padding-free state", ValueError, "padding_free=True", _load_state_saved_with, "padding_free"),
    _refusal("a balanced state", ValueError, "balance_ranks=True", _load_state_saved_with, "balance_ranks"),
]


@pytest.mark.parametrize("call, error, names", _BAD_SAMPLER)
def test_bad_input_VariableBatchSampler(call, error, names):
    """VariableBatchSampler and its methods refuse bad input with a TypeError/ValueError naming the value."""
    _check_refused(call, error, names)


def _same_length_loader(sample_padding_fn, collate_fn=None):
    """The step inputs of a same-size, same-length loader over four samples (one step input), padded by
    ``sample_padding_fn``."""
    sampler = VariableBatchSampler([3, 5, 2, 4], 20, same_size=True, same_length=True)
    dataset = [torch.ones(n) for n in [3, 5, 2, 4]]
    return list(make_dataloader(dataset, sampler, collate_fn=collate_fn, sample_padding_fn=sample_padding_fn))


def _three_samples_loader(**options):
    """make_dataloader over three samples of seqlen 2, max_tokens 4."""
    return make_dataloader([torch.ones(2)] * 3, VariableBatchSampler([2, 2, 2], 4), **options)


def _flat_pipeline_rows(collate_fn):
    """The rows of a padding-free pipeline's loader over four samples, collated by ``collate_fn``."""
    sampler = VariableBatchSampler([3, 5, 2, 4], 8, padding_free=True, same_length=True, gradient_accumulation_steps=2)
    return list(make_dataloader([torch.ones(n) for n in [3, 5, 2, 4]], sampler, collate_fn=collate_fn))


_BAD_MAKE_DATALOADER = [
    _refusal("another sampler", TypeError, "VariableBatchSampler", make_dataloader, [1], [[0]]),
    _refusal("what the sampler decides", TypeError, "VariableBatchSampler", _three_samples_loader, batch_size=2),
    _refusal("out of the plan's order", TypeError, "VariableBatchSampler", _three_samples_loader, in_order=False),
    _refusal("collate_fn not callable", TypeError, "collate_fn", _three_samples_loader, collate_fn=3),
    _refusal("an unknown keyword", TypeError, "'read_ahead'", _three_samples_loader, read_ahead=1),
    _refusal("batch_count of another size", ValueError, "batch_count", _three_samples_loader, batch_count=[1, 1]),
    _refusal(
        "seqlens of another size", ValueError, "seqlen", make_dataloader, [[2]] * 4, VariableBatchSampler([2, 2, 2], 4)
    ),
    _refusal("same length, no padding", ValueError, "sample_padding_fn=varbatch.pad_sample", _same_length_loader, None),
    _refusal(
        "padding that does not pad", ValueError, "sample_padding_fn", _same_length_loader, lambda sample, n: sample
    ),
    _refusal(
        "batch_count in tokens, no seqlens",
        ValueError,
        "batch_count make_dataloader",
        lambda: make_dataloader(_GLUE_SEQLENS, _given_sampler(), batch_count="tokens"),
    ),
    _refusal(
        "unpadded pipeline rows", ValueError, "varbatch.FlatCollate", _flat_pipeline_rows, lambda s: torch.cat(s)[None]
    ),
]


@pytest.mark.parametrize("call, error, names", _BAD_MAKE_DATALOADER)
def test_bad_input_make_dataloader(call, error, names):
    """make_dataloader refuses bad input, before the first batch where it can, naming the value."""
    _check_refused(call, error, names)


_BAD_PADDING = [
    _refusal("pad_sample shorter than the sample", ValueError, "seqlens", pad_sample, torch.ones(3), 2),
    _refusal("pad_sample length negative", ValueError, "length", pad_sample, [1], -1),
    _refusal("a field of no sequence", ValueError, "fields sample_padding_fn", pad_sample, {"a": 3}, 4, fields=["a"]),
    _refusal("no sequence field", ValueError, "fields sample_padding_fn", pad_sample, {"label": 1, "id": 2}, 4),
    _refusal(
        "fields none of the sample's", ValueError, "fields sample_padding_fn", pad_sample, {"ids": [1]}, 4, fields=["x"]
    ),
    _refusal("PaddedCollate no samples", ValueError, "samples", PaddedCollate(), []),
    _refusal("PaddedCollate no sequence field", ValueError, "seqlens", PaddedCollate(), [{"a": 1}, {"a": 2}]),
    _refusal(
        "PaddedCollate dicts of other keys", ValueError, "fields", PaddedCollate(), [{"x": [1], "y": [3]}, {"x": [5]}]
    ),
    _refusal("PaddedCollate tuples of other lengths", ValueError, "fields", PaddedCollate(), [([1, 2],), ([3], [4])]),
    _refusal(
        "PaddedCollate seqlens of another count", ValueError, "seqlens", PaddedCollate(), [[1, 2], [1]], seqlens=[2]
    ),
    _refusal("seqlens_from_padded not a batch", ValueError, "PaddedCollate", seqlens_from_padded, torch.tensor([1, 2])),
    # same length: the samples arrive padded, so PaddedCollate cannot tell the real lengths of part of a step input
    _refusal(
        "PaddedCollate of half a same-length step input",
        ValueError,
        "PaddedCollate 2 same-length seqlens=",
        _same_length_loader,
        pad_sample,
        lambda samples: PaddedCollate()(samples[: len(samples) // 2]),
    ),
]


@pytest.mark.parametrize("call, error, names", _BAD_PADDING)
def test_bad_input_padding_and_collate(call, error, names):
    """pad_sample, PaddedCollate and seqlens_from_padded refuse what they cannot handle, naming it."""
    _check_refused(call, error, names)


def _scheduler(*args, **options):
    """VariableBatchSizeLR over a fresh optimizer."""
    return VariableBatchSizeLR(_optimizer(), *args, **options)


_BAD_SCHEDULER = [
    _refusal(
        "ReduceLROnPlateau",
        TypeError,
        "LambdaLR",
        lambda: VariableBatchSizeLR(torch.optim.lr_scheduler.ReduceLROnPlateau(_optimizer()), 2, [2, 2]),
    ),
    _refusal("not an optimizer", TypeError, "Optimizer", VariableBatchSizeLR, 5, 2, [2, 2]),
    _refusal(
        "wrapped twice", TypeError, "VariableBatchSizeLR", lambda: VariableBatchSizeLR(_scheduler(2, [2]), 2, [2])
    ),
    # what needs a sampler's plans: a count of tokens, the default B_ref (train_batch_size)
    _refusal(
        "tokens unit, no sampler", ValueError, "VariableBatchSampler", _scheduler, 2, [2], lr_scaling_unit="tokens"
    ),
    _refusal("tokens clock, no sampler", ValueError, "VariableBatchSampler", _scheduler, 2, [2, 2], clock="tokens"),
    _refusal("default B_ref, no sampler", ValueError, "VariableBatchSampler", _scheduler, None, [2, 2]),
    _refusal(
        "tokens over given micro-batches",
        ValueError,
        "make_dataloader",
        lambda: _scheduler(2, _given_microbatches_loader(), lr_scaling_unit="tokens"),
    ),
    _refusal("base_batch_size not 'mean'", TypeError, "base_batch_size", _scheduler, "avg", [2, 2]),
    _refusal("B / B_ref overflows", ValueError, "lr_scaling_reference base_batch_size", _scheduler, 1e-320, [2, 2]),
    _refusal("batch_sizes empty", ValueError, "batch_sizes", _scheduler, 2, []),
    _refusal("batch_sizes zero", ValueError, "batch_sizes", _scheduler, 2, [2, 0]),
    _refusal("clock_step 0", ValueError, "clock_step", lambda: _scheduler(2, _sampler(), clock="tokens", clock_step=0)),
    _refusal(
        "clock_step, steps clock", ValueError, "clock clock_step", _scheduler, 2, [2, 2], clock="steps", clock_step=4
    ),
    # torch's own scheduler raised a KeyError
    _refusal(
        "last_epoch, no initial_lr", ValueError, "last_epoch load_state_dict", _scheduler, 2, [2, 2], last_epoch=3
    ),
    # step() takes a Batch record, nothing or 0 (DeepSpeed's epoch start)
    _refusal("step with an epoch", ValueError, "Batch 7", lambda: _scheduler(2, [2, 2]).step(7)),
    _refusal(
        "step with a plain tuple",
        ValueError,
        "Batch (0, 0, 2, True, 0)",
        lambda: _scheduler(2, [2, 2]).step((0, 0, 2, True, 0)),
    ),
    _refusal("step skipped=1", ValueError, "skipped=1", lambda: _scheduler(2, [2, 2]).step(skipped=1)),
    _refusal(
        "no scheduler nor optimizer",
        TypeError,
        "optimizer",
        lambda: varbatch.lr_scheduler_for_variable_batch_size(2, [2], None, None),
    ),
]


@pytest.mark.parametrize("call, error, names", _BAD_SCHEDULER)
def test_bad_input_VariableBatchSizeLR(call, error, names):
    """VariableBatchSizeLR refuses what it cannot scale (ReduceLROnPlateau) and bad values, naming them."""
    _check_refused(call, error, names)


def _hf_adapter(trainer, *args):
    return varbatch.hf_trainer_lr_scheduler(trainer, _optimizer(), *args)


@pytest.mark.parametrize(
    "call, error, names",
    [
        _refusal("not an HF Trainer", TypeError, "create_scheduler", lambda: _hf_adapter(object(), 2, [2, 2])),
        _refusal(
            "the Trainer's accumulation is not the sampler's",
            ValueError,
            "gradient_accumulation_steps",
            lambda: _hf_adapter(_fake_trainer(1), "mean", _sampler()),
        ),
    ],
)
def test_bad_input_hf_trainer_lr_scheduler(call, error, names):
    """hf_trainer_lr_scheduler refuses what is not an HF Trainer, and a Trainer that accumulates another number of
    step inputs than the sampler, before training, naming them."""
    pytest.importorskip("transformers")
    _check_refused(call, error, names)


def _given_loader(microbatch_ids, **options):
    """DeepSpeed's dataloader_for_variable_batch_size over three samples and two batches given."""
    return varbatch.dataloader_for_variable_batch_size([torch.ones(1)] * 3, microbatch_ids, [1, 1], **options)


def _planned_loader(effective_batch_size, **options):
    """DeepSpeed's get_dataloader_and_lr_scheduler_for_variable_batch_size over three samples of seqlen 2."""
    return varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size(
        [torch.ones(2)] * 3, [2, 2, 2], 4, effective_batch_size, **options
    )


_BAD_DEEPSPEED_FUNCTIONS = [
    _refusal(
        "unequal batches", ValueError, "microbatch_ids batch_by_seqlens", _given_loader, [(0, [0]), (0, [1]), (1, [2])]
    ),
    _refusal("given, rank 2", ValueError, "dataloader_rank", _given_loader, [(0, [0]), (1, [1])], dataloader_rank=2),
    _refusal("planned, rank 1", ValueError, "dataloader_rank", _planned_loader, 1, dataloader_rank=1),
    _refusal("batch geometry", ValueError, "train_batch_size", _planned_loader, 3, dataloader_num_replicas=2),
]


@pytest.mark.parametrize("call, error, names", _BAD_DEEPSPEED_FUNCTIONS)
def test_bad_input_deepspeed_compatible_functions(call, error, names):
    """DeepSpeed's function names refuse bad input with a TypeError/ValueError naming the value."""
    _check_refused(call, error, names)


def _section_config(section):
    return {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "data_efficiency": {"data_sampling": {"dynamic_batching": section}},
    }


def _glue_over(config):
    """The DeepSpeed glue over ``config``, with the seqlens of its dataset given."""
    return _glue(config, dataset_seqlens=_GLUE_SEQLENS)


_deepspeed_glue = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed
_SECTION = "data_efficiency.data_sampling.dynamic_batching"
_BAD_GLUE = [
    # a malformed section: a ValueError naming the key path, no AttributeError
    _refusal(
        "data_sampling",
        ValueError,
        "data_efficiency.data_sampling",
        _glue_over,
        {"data_efficiency": {"data_sampling": 5}},
    ),
    _refusal("dynamic_batching 5", ValueError, _SECTION, _glue_over, _section_config(5)),
    _refusal("no section", ValueError, "dynamic_batching", _glue_over, {"train_batch_size": 2, "data_efficiency": {}}),
    _refusal("enabled a string", ValueError, f"{_SECTION}.enabled", _glue_over, _glue_config(enabled="true")),
    _refusal("no max_tokens", ValueError, f"{_SECTION}.max_tokens", _glue_over, _section_config({"enabled": True})),
    _refusal("unknown key", ValueError, f"{_SECTION} 'max_tokens'", _glue_over, _glue_config(max_token=16)),
    _refusal(
        "both spellings, two orders",
        ValueError,
        "sentence_picking_order",
        _glue_over,
        _glue_config(sequence_picking_order="seqlen", sentence_picking_order="random"),
    ),
    # a bad value, named at its key path
    _refusal("budget unknown", ValueError, f"{_SECTION} budget", _glue_over, _glue_config(budget="pad")),
    _refusal("B_ref negative", ValueError, "lr_scaling_reference", _glue_over, _glue_config(lr_scaling_reference=-1)),
    _refusal(
        "lr_clock_step, steps clock", ValueError, "lr_clock lr_clock_step", _glue_over, _glue_config(lr_clock_step=4)
    ),
    _refusal("metrics_path a number", TypeError, "metrics_path", _glue_over, _glue_config(metrics_path=5)),
    _refusal("verbose not a bool", TypeError, "verbose", _glue_over, _glue_config(verbose="yes")),
    _refusal("num_workers negative", ValueError, "num_workers", _glue_over, _glue_config(num_workers=-1)),
    _refusal(
        "overlong", ValueError, "max_tokens on_overlong", _glue_over, _glue_config(max_tokens=7, on_overlong="error")
    ),
    _refusal(
        "padding-free padded",
        ValueError,
        f"{_SECTION}: padding_free=True budget='padded'",
        _glue_over,
        _glue_config(padding_free=True, budget="padded"),
    ),
    _refusal(
        "balanced without q",
        ValueError,
        f"{_SECTION}: quadratic_tokens=None",
        _glue_over,
        _glue_config(sequence_picking_order="random", balance_ranks=True),
    ),
    # the engine, its batch sizes and the seqlens
    _refusal(
        "not an engine", TypeError, "deepspeed.initialize", _deepspeed_glue, [[1, 1]], object(), dataset_seqlens=[2]
    ),
    _refusal(
        "batch sizes that do not multiply",
        ValueError,
        "train_batch_size",
        lambda: _deepspeed_glue(
            [[1, 1]] * 4, _Engine(_glue_config(), gradient_accumulation_steps=3), dataset_seqlens=[2] * 4
        ),
    ),
    _refusal("no source of seqlens", ValueError, "dataset_seqlens batch_seqlens_fn", _glue, _glue_config()),
    _refusal("miscounts", ValueError, "batch_seqlens_fn", _glue, _glue_config(), batch_seqlens_fn=lambda b: [2]),
]


@pytest.mark.parametrize("call, error, names", _BAD_GLUE)
def test_bad_input_deepspeed_glue(call, error, names):
    """The DeepSpeed glue refuses a bad dynamic_batching section before any data is read, naming the key path, and a
    wrong engine, batch sizes or seqlens source, naming what to fix."""
    _check_refused(call, error, names)


@pytest.mark.parametrize("key, value", [("num_workers", -1), ("pin_memory", "yes")])
def test_bad_input_deepspeed_glue_config_in_data_sampling_is_placed_there(key, value):
    """A bad data_sampling key the section falls back to is named at its own path, not dynamic_batching's."""
    config = _glue_config()
    config["data_efficiency"]["data_sampling"][key] = value
    with pytest.raises((TypeError, ValueError)) as info:
        _glue_over(config)
    message = str(info.value)
    assert f"{key}={value!r}" in message and "data_efficiency.data_sampling" in message, message
    assert "dynamic_batching" not in message, f"the message blames the dynamic_batching section: {message}"


_CLOCKS = ("steps", "tokens", "samples")
# Each check of a choice: (a call with the choice, a near miss, its closest choice, every choice).
_UNKNOWN_CHOICES = {
    "order": (lambda v: plan_batches([1, 2, 3], 10, order=v), "randm", "random", ORDERS),
    "lr_scaling_method": (lambda v: scale_lr(2, 4, method=v), "lineer", "linear", LR_METHODS),
    "lr_scaling_unit": (lambda v: _scheduler(2, [2], lr_scaling_unit=v), "token", "tokens", ("sequences", "tokens")),
    "clock": (lambda v: _scheduler(2, [2, 2], clock=v), "tokns", "tokens", _CLOCKS),
    "horizon unit": (lambda v: _sampler().horizon(2, v), "sample", "samples", _CLOCKS),
    "batch_count": (
        lambda v: _three_samples_loader(batch_count=v),
        "token",
        "tokens",
        ("sequences", "tokens", "label_tokens"),
    ),
}


@pytest.mark.parametrize("call, value, closest, valid", _UNKNOWN_CHOICES.values(), ids=_UNKNOWN_CHOICES)
def test_unknown_choice_lists_valid_ones_and_suggests_closest(call, value, closest, valid):
    """An unknown choice names the value, lists the valid ones and suggests the closest."""
    with pytest.raises(ValueError) as info:
        call(value)
    message = str(info.value)
    assert repr(value) in message and f"did you mean {closest!r}" in message, message
    assert all(repr(choice) in message for choice in valid), message


def test_values_once_mangled_are_handled():
    """Inputs the audit found mangled are handled: bfloat16, uint64, huge lengths (list and tuple samples:
    test_padded_collate_handles_lists_tuples_and_dicts, test_pad_sample_pads_sequence_fields_and_keeps_the_rest)."""
    ints = plan_batches([3, 4, 5, 2], 8).microbatches()
    assert plan_batches(torch.tensor([3, 4, 5, 2], dtype=torch.bfloat16), 8).microbatches() == ints
    assert plan_batches(np.array([3, 4, 5, 2], dtype=np.uint64), 8).microbatches() == ints
    huge = plan_batches(np.array([2**62, 3, 2**62, 4]), 2**31, same_size=True)
    assert huge.dropped["over_budget"].tolist() == [0, 2] and huge.batch_tokens.tolist() == [7]


# =============================================================================
# 9a. Padding-free step inputs: one flat row per step input (DESIGN.md, item 11)
# =============================================================================
# Rows of other samples against PaddedCollate (HF-style rows against transformers' DataCollatorWithFlattening:
# test_conformance.py); training on flat rows against padded batches (a tiny config-built Llama, sdpa and eager; a
# plain block-diagonal sdpa mask); the plans, the loader's rows and pipeline rows; the refusals. transformers is
# imported inside the tests.


def _tiny_llama(attn_implementation="sdpa", use_cache=False):
    """The tiny Llama with grouped-query attention (its 2 heads share keys and values), the same weights each call."""
    transformers = pytest.importorskip("transformers")
    config = _tiny_llama_config(num_key_value_heads=1, use_cache=use_cache, attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _token_samples(lengths, seed=1):
    """HF-style samples: ``input_ids``, ``labels`` (a fifth -100) and an ``attention_mask`` of ones."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for length in lengths:
        input_ids = torch.randint(0, 64, (length,), generator=generator)
        labels = input_ids.masked_fill(torch.rand(length, generator=generator) < 0.2, -100)
        samples.append({"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids)})
    return samples


def _gradient_difference(model, loss, reference):
    """The largest, over the parameters, of max |grad - grad_reference| / max |grad_reference|."""
    grads = []
    for each in (loss, reference):
        model.zero_grad()
        each.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*grads))


@given(
    form=st.sampled_from(["tensor", "tuple", "dict"]),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    width=st.sampled_from([(), (3,)]),
)
@settings(max_examples=40)
def test_flat_collate_keeps_padded_collates_structure(form, lengths, width):
    """Other samples: each sequence field is PaddedCollate's without its padding, as one 1 x T x ... row;
    cu_seqlens (int32), max_seqlen (an int) and position_ids (1 x T int64) stand where seqlens stands."""
    samples = []
    for index, length in enumerate(lengths):
        features, targets = torch.randn(length, *width), torch.randint(0, 9, (length,))
        samples.append(
            {"tensor": features, "tuple": (features, targets, index, f"text {index}"), "dict": {"x": features}}[form]
        )
    padded, flat = PaddedCollate()(samples), varbatch.FlatCollate()(samples)
    if form == "dict":
        padded, flat = [*padded.values()], [*flat.values()]
        assert list(varbatch.FlatCollate()(samples)) == ["x", "cu_seqlens", "max_seqlen", "position_ids"]
    seqlens, (cu_seqlens, max_seqlen, positions) = padded[-1], flat[-3:]
    assert len(flat) == len(padded) + 2
    for flat_field, padded_field in zip(flat[:-3], padded[:-1]):
        if isinstance(padded_field, list) or padded_field.dim() == 1:  # text, or one number per sample
            assert (
                flat_field == padded_field if isinstance(padded_field, list) else torch.equal(flat_field, padded_field)
            )
        else:
            assert torch.equal(flat_field, torch.cat([row[:n] for row, n in zip(padded_field, seqlens)])[None])
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, *np.cumsum(lengths)]
    assert type(max_seqlen) is int and max_seqlen == max(lengths)
    assert positions.dtype == torch.int64 and positions.tolist() == [[i for n in lengths for i in range(n)]]


@given(
    lengths=st.lists(st.integers(1, 12), min_size=8, max_size=40),
    extra=st.integers(0, 2),
    micro_batch_size=st.integers(1, 3),
    order=st.sampled_from(["dataloader", "random", "bucket"]),
)
@settings(max_examples=12)
def test_padding_free_rows_within_the_sum_budget_every_sample_once(lengths, extra, micro_batch_size, order):
    """Each step input one row of at most micro_batch_size x max_tokens tokens and no padding (the plan's totals
    say so), every sample once; seqlens may count what a collate adds."""
    dataset = [{"input_ids": torch.full((n,), i)} for i, n in enumerate(lengths)]
    planned = [n + extra for n in lengths]
    options = dict(max_tokens=16, micro_batch_size=micro_batch_size, order=order, num_replicas=1, rank=0)
    sampler = VariableBatchSampler(planned, padding_free=True, **options)
    totals = sampler.plan.totals()
    assert totals["padded_tokens"] == totals["real_tokens"] and totals["padding_free"]
    assert totals["largest_step_input"]["tokens"] <= micro_batch_size * 16
    seen, plan = [], sampler.plan
    for batch in make_dataloader(dataset, sampler):  # FlatCollate by default
        assert batch["input_ids"].shape[0] == 1 and batch["input_ids"].shape[1] <= micro_batch_size * 16
        seen += batch["input_ids"][0, batch["position_ids"][0] == 0].tolist()
    dropped = [int(i) for ids in plan.dropped.values() for i in ids]
    assert sorted(seen + dropped) == list(range(len(lengths)))


@pytest.mark.parametrize("redraws", [8, 0], ids=["packed", "last resort"])
def test_padding_free_plans_are_the_sum_budgets_with_their_rows(monkeypatch, redraws):
    """Every epoch's plan (packed, lengthened, or the last resort) is the sum budget's of its packing, with each
    micro-batch's padded seqlen its step input's row (same_length: its batch's longest row); batch_max_seqlens stay
    samples'."""
    monkeypatch.setattr(varbatch, "_REDRAWS", redraws)
    lengths = np.array(_lengths(400, 1, 60, seed=3))
    for same_length, packing in itertools.product((False, True), ("greedy", "best_fit")):
        options = dict(effective_batch_size=6, micro_batch_size=2, order="random", seed=5, same_length=same_length)
        options["packing"] = packing  # (the default packs flat rows by best fit, and the sum budget greedily)
        for epoch in range(3):
            plan = plan_batches(lengths, 100, epoch=epoch, padding_free=True, **options)
            padded = plan_batches(lengths, 100, epoch=epoch, **options)
            for name in ("sample_ids", "microbatch_offsets", "batch_sizes", "batch_tokens", "batch_max_seqlens"):
                assert np.array_equal(getattr(plan, name), getattr(padded, name)), (name, epoch)
            micro = plan.microbatches()
            rows = np.array([lengths[micro[j] + micro[j + 1]].sum() for j in range(0, len(micro), 2)])
            if same_length:  # 3 step inputs a batch
                rows = np.repeat(rows.reshape(-1, 3).max(axis=1), 3)
            assert plan.padded_seqlens.tolist() == np.repeat(rows, 2).tolist(), epoch


def test_padding_free_pipeline_rows_share_their_batchs_length():
    """same_length: every row of a batch is as long as its longest (the plan's padded_seqlens, the key's pad_to);
    the rest a padding segment of its own (positions from 0, labels the call's separator_id, as every sample's first
    label) that the totals count as padding."""
    lengths = [3, 9, 4, 7, 2, 8, 5, 6, 1, 9, 3, 4]
    dataset = [{"input_ids": torch.full((n,), i)} for i, n in enumerate(lengths)]
    sampler = VariableBatchSampler(
        lengths, 12, gradient_accumulation_steps=2, padding_free=True, same_length=True, num_replicas=1, rank=0
    )
    flat = varbatch.FlatCollate()

    def collate(samples, seqlens):
        return flat(samples, seqlens, separator_id=-7)

    plan, rows = sampler.plan, list(make_dataloader(dataset, sampler, collate_fn=collate))
    for b in range(plan.num_batches):
        batch_rows = rows[2 * b : 2 * b + 2]
        assert {row["input_ids"].shape for row in batch_rows} == {(1, int(plan.padded_seqlens[2 * b]))}
        for row, ids in zip(batch_rows, (plan.microbatch(2 * b), plan.microbatch(2 * b + 1))):
            real = int(sum(lengths[i] for i in ids))
            starts = row["position_ids"][0] == 0
            assert row["input_ids"][0, starts][: len(ids)].tolist() == ids.tolist()
            assert (row["labels"][0, starts] == -7).all() and (row["labels"][0, real:] == -7).all()
            assert row["position_ids"][0, real:].tolist() == list(range(row["input_ids"].shape[1] - real))
    totals = plan.totals()
    assert totals["padded_tokens"] == sum(row["input_ids"].shape[1] for row in rows) > totals["real_tokens"]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_hf_llama_trains_a_flat_row_as_the_padded_batch(attn_implementation):
    """use_cache=False: each sample's logits (max |diff| <= 1e-4), the token-mean loss (1e-5), the gradients (1e-4)."""
    model, lengths = _tiny_llama(attn_implementation), [5, 11, 1, 8, 3]
    samples = _token_samples(lengths)
    flat = model(**varbatch.FlatCollate()(samples))
    padded = model(**PaddedCollate(pad_value={"labels": -100}, seqlens_key=None)(samples))
    starts = np.cumsum([0, *lengths])
    for i, n in enumerate(lengths):
        difference = (flat.logits[0, starts[i] : starts[i + 1]] - padded.logits[i, :n]).abs().max()
        assert float(difference.detach()) <= 1e-4, i
    assert abs(float(flat.loss.detach()) / float(padded.loss.detach()) - 1) <= 1e-5
    assert _gradient_difference(model, flat.loss, padded.loss) <= 1e-4


def block_causal_mask(position_ids):
    """``T x T`` bool from a row's ``1 x T`` positions: each token sees its own sample's tokens up to itself."""
    sample = (position_ids[0] == 0).cumsum(0)  # T: the sample of each token (positions restart at 0)
    return torch.ones(len(sample), len(sample), dtype=torch.bool).tril() & (sample[:, None] == sample[None, :])


def test_plain_sdpa_with_a_block_diagonal_mask_trains_a_flat_row_as_the_padded_batch():
    """A plain model over flat rows: torch's sdpa, the mask from the positions; outputs, loss and gradients."""
    torch.manual_seed(0)
    qkv, head, lengths = torch.nn.Linear(16, 48), torch.nn.Linear(16, 5), [5, 11, 1, 8, 3]
    model = torch.nn.ModuleList([qkv, head])

    def forward(x, mask):  # B x S x 16, B x S x S -> B x S x 5
        q, k, v = qkv(x).chunk(3, dim=-1)
        return head(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    generator = torch.Generator().manual_seed(2)
    samples = [
        (torch.randn(n, 16, generator=generator), torch.randint(0, 5, (n,), generator=generator)) for n in lengths
    ]
    x, y, _, _, positions = varbatch.FlatCollate()(samples)
    flat = forward(x, block_causal_mask(positions)[None])[0]
    flat_loss = torch.nn.functional.cross_entropy(flat, y[0])
    x, y, seqlens = PaddedCollate(pad_value={1: -100})(samples)
    real = torch.arange(x.shape[1]) < seqlens[:, None]  # B x S
    padded = forward(x, torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril() & real[:, None, :])
    padded_loss = torch.nn.functional.cross_entropy(padded.flatten(0, 1), y.flatten(), ignore_index=-100)
    assert float((flat - padded[real]).abs().max().detach()) <= 1e-5
    assert abs(float(flat_loss.detach()) / float(padded_loss.detach()) - 1) <= 1e-6
    assert _gradient_difference(model, flat_loss, padded_loss) <= 1e-5
    assert varbatch.check_padding_free(lambda batch: forward(batch[0], block_causal_mask(batch[-1])), samples) < 1e-5


def _positions_counting_on(samples):
    batch = varbatch.FlatCollate()(samples)
    return {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}


def _mask_kept(samples):
    batch = varbatch.FlatCollate()(samples)
    return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}


@pytest.mark.parametrize(
    ("use_cache", "collate_fn", "cause"),
    [(False, None, None), (True, None, "use_cache=True"), (False, _positions_counting_on, ""), (False, _mask_kept, "")],
    ids=["correct", "use_cache", "positions", "attention_mask"],
)
def test_check_padding_free_refuses_samples_that_attend_to_each_other(use_cache, collate_fn, cause):
    """An HF Llama: passes with use_cache=False and FlatCollate's row; refuses a cache, positions that do not
    restart and a kept mask, naming the fixes; in eval mode and without gradients, every module's mode restored."""
    model = _tiny_llama(use_cache=use_cache).train()
    model.lm_head.eval()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append((module.training, torch.is_grad_enabled())))
    samples = _token_samples([5, 11, 1, 8])
    if cause is None:
        assert varbatch.check_padding_free(model, samples) <= 1e-5
    else:
        with pytest.raises(ValueError, match=rf"attend to each other.*restart at every sample.*{cause}.*attention_m"):
            varbatch.check_padding_free(model, samples, collate_fn)
    assert set(seen) == {(False, False)} and model.training and model.model.training and not model.lm_head.training


_TWO_SAMPLES = [torch.ones(2), torch.ones(1)]
# FlatCollate's refusals of HF-style samples that HF's collator takes are test_conformance.py's.
_BAD_PADDING_FREE = [
    _refusal("no samples", ValueError, "samples", varbatch.FlatCollate(), []),
    _refusal("longer than planned", ValueError, "seqlens", varbatch.FlatCollate(), [torch.ones(4)], [3]),
    _refusal("input_ids a string", ValueError, "input_ids", varbatch.FlatCollate(), [{"input_ids": "text"}]),
    _refusal("a field of other seqlens", ValueError, "field", varbatch.FlatCollate(), [(torch.ones(2), torch.ones(3))]),
    _refusal("no sequence field", ValueError, "tensor", varbatch.FlatCollate(), [(1, "text")]),
    _refusal("return_seq_idx not a bool", TypeError, "return_seq_idx", varbatch.FlatCollate, return_seq_idx=1),
    _refusal("position_ids_start -1", ValueError, "position_ids_start", varbatch.FlatCollate, position_ids_start=-1),
    _refusal("one sample to check", ValueError, "2 samples", varbatch.check_padding_free, torch.nn.Identity(), [[1]]),
    _refusal("outputs nan", ValueError, "nan", varbatch.check_padding_free, lambda batch: batch[0] / 0, _TWO_SAMPLES),
    _refusal("outputs not tensors", TypeError, "'x'", varbatch.check_padding_free, lambda batch: "x", _TWO_SAMPLES),
    _refusal("not per token", ValueError, "output", varbatch.check_padding_free, lambda b: b[0].sum(1), _TWO_SAMPLES),
]


@pytest.mark.parametrize("call, error, names", _BAD_PADDING_FREE)
def test_bad_input_flat_collate_and_check_padding_free(call, error, names):
    """FlatCollate and check_padding_free refuse what they cannot flatten or check, naming it."""
    _check_refused(call, error, names)


def test_check_padding_free_refuses_what_cannot_run_whole_on_one_rank():
    """A PipelineModule's stages live on other ranks; a DeepSpeed engine or ZeRO-3 parameters would hang."""
    pipe = pytest.importorskip("deepspeed.pipe")
    zero3 = torch.nn.Linear(4, 4)
    zero3.weight.ds_id = 0
    for model in (pipe.PipelineModule.__new__(pipe.PipelineModule), zero3):
        with pytest.raises(TypeError, match=r"run it on the plain model .* before deepspeed.initialize"):
            varbatch.check_padding_free(model, [torch.ones(2, 4), torch.ones(3, 4)])


def test_padding_free_from_the_config_section_and_the_pipeline_glue():
    """`"padding_free": true` reaches the plan (refused with the padded budget: test_bad_input_deepspeed_glue); a
    PipelineEngine gets rows of one length per batch (same_length), not same-size micro-batches, and needs no
    sample_padding_fn."""
    engine = _Engine(_glue_config(padding_free=True), optimizer=_optimizer())  # 2 micro-batches a batch
    engine.grid = types.SimpleNamespace(data_parallel_id=0, data_parallel_size=1)
    engine.train_batch = None  # a PipelineEngine's method: only its presence is read
    dataset = [{"input_ids": torch.full((n,), i)} for i, n in enumerate(_GLUE_SEQLENS)]
    glue = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed
    loader, _, _ = glue(dataset, engine, dataset_seqlens=_GLUE_SEQLENS)
    settings = loader.variable_batch_sampler.settings
    assert settings.padding_free and settings.same_length and not settings.same_size
    rows = [row["input_ids"].shape for row in loader]
    assert rows[0::2] == rows[1::2] and len(set(rows)) > 1


# =============================================================================
# 9b. Balanced ranks: step inputs of like cost at every reduction (DESIGN.md, item 12)
# =============================================================================
# A step input's cost is computed here from its samples (padded n S + n S^2 / q; flat T + sum(L^2) / q, T its row),
# apart from varbatch's; rank r's t-th step input is step input t R + r (the dealing rule).


@st.composite
def balance_cases(draw, pipeline=None):
    """Keyword arguments of plan_batches with balancing on: 2-6 ranks, random or bucket, either form, pipeline
    shapes where ``pipeline`` says so (drawn where it is None)."""
    ranks = draw(st.integers(2, 6))
    micro_batch_size = draw(st.integers(1, 2))
    k = micro_batch_size * draw(st.integers(1, 3)) * ranks
    padding_free = draw(st.booleans())
    budget = "sum" if padding_free else draw(st.sampled_from(BUDGETS))
    same_length = draw(st.booleans()) if pipeline is None else pipeline
    same_size = same_length and (budget == "padded" or draw(st.booleans()))
    if pipeline is None and not same_length:
        same_size = draw(st.booleans())
    return dict(
        seqlens=draw(st.lists(st.integers(1, 60), min_size=k, max_size=6 * k + 30)),
        max_tokens=draw(st.integers(60, 200)),
        effective_batch_size=k,
        micro_batch_size=micro_batch_size,
        num_replicas=ranks,
        budget=budget,
        order=draw(st.sampled_from(["random", "bucket"])),
        same_size=same_size,
        same_length=same_length,
        padding_free=padding_free,
        seed=draw(st.integers(0, 3)),
        epoch=draw(st.integers(0, 2)),
        balance_ranks=True,
        quadratic_tokens=draw(st.sampled_from([10, 100, 1_000])),
    )


def _balanced_and_not(case):
    """``(balanced plan, the same plan unbalanced)`` of a `balance_cases` case (too few samples: assumed away)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "balance_ranks=True does nothing")  # padded pipeline batches
            return plan_batches(**case), plan_batches(**{**case, "balance_ranks": False})
    except ValueError as error:
        assume("not enough samples for one batch" not in str(error))
        raise


def _step_inputs(plan):
    """Every step input of ``plan`` as a tuple of its micro-batches' id tuples, in plan order."""
    microbatches = [tuple(mb) for mb in plan.microbatches()]
    m = plan.settings.micro_batch_size
    return [tuple(microbatches[j : j + m]) for j in range(0, len(microbatches), m)]


def _costs(plan, seqlens, quadratic_tokens):
    """Each step input's cost, from its samples' seqlens and its tensor's width (the plan's padded seqlen)."""
    seqlens, m = np.asarray(seqlens, np.float64), plan.settings.micro_batch_size
    costs = []
    for g, step_input in enumerate(_step_inputs(plan)):
        lengths = seqlens[list(itertools.chain(*step_input))]
        width = float(plan.padded_seqlens[g * m])
        if plan.settings.padding_free:
            costs.append(width + (lengths**2).sum() / quadratic_tokens)
        else:
            costs.append(len(lengths) * width * (1 + width / quadratic_tokens))
    return np.array(costs)


@settings(max_examples=60, deadline=None)
@given(balance_cases())
def test_balanced_plans_hold_the_packed_step_inputs(case):
    """Balancing moves whole step inputs: the same ones, batches and drops; every array as its samples make it, and
    each step input's cost as its samples and width make it in its form."""
    balanced, plan = _balanced_and_not(case)
    assert collections.Counter(_step_inputs(balanced)) == collections.Counter(_step_inputs(plan))
    assert (balanced.num_batches, balanced.dropped.keys(), balanced.epoch) == (
        plan.num_batches,
        plan.dropped.keys(),
        plan.epoch,
    )
    assert all(np.array_equal(balanced.dropped[reason], plan.dropped[reason]) for reason in plan.dropped)
    seqlens, settings_ = np.asarray(case["seqlens"]), balanced.settings
    k, m = settings_.effective_batch_size, settings_.micro_batch_size
    batches = [np.concatenate(balanced.microbatches()[b : b + k]) for b in range(0, balanced.num_microbatches, k)]
    assert balanced.batch_sizes.tolist() == [len(ids) for ids in batches]
    assert balanced.batch_tokens.tolist() == [int(seqlens[ids].sum()) for ids in batches]
    assert balanced.batch_max_seqlens.tolist() == [int(seqlens[ids].max()) for ids in batches]
    widths = [int(seqlens[list(itertools.chain(*si))].sum()) for si in _step_inputs(balanced)]
    if not settings_.padding_free:
        widths = [max(int(seqlens[list(mb)].max()) for mb in si) for si in _step_inputs(balanced)]
    group = settings_.gradient_accumulation_steps * settings_.num_replicas if settings_.same_length else 1
    padded = [max(widths[g - g % group : g - g % group + group]) for g in range(len(widths))]
    assert balanced.padded_seqlens.tolist() == np.repeat(padded, m).tolist()
    costs = _costs(balanced, case["seqlens"], case["quadratic_tokens"])
    assert np.allclose(varbatch._step_input_costs(balanced, seqlens), costs)  # varbatch prices them as here
    assert all(not array.flags.writeable for array in (balanced.sample_ids, balanced.padded_seqlens))
    assert balanced.fingerprint() == _balanced_and_not(case)[0].fingerprint()  # the same on every rank


@settings(max_examples=60, deadline=None)
@given(balance_cases(pipeline=False))
def test_balanced_reductions_meet_cost_neighbours_and_the_ranks_wait_no_longer(case):
    """Outside pipelines the step inputs of each reduction span costs no other reduction's enter, odd accumulation
    steps are dealt costliest first, and the share of the epoch's reduction time the ranks wait never grows."""
    balanced, plan = _balanced_and_not(case)
    settings_ = balanced.settings
    ranks, steps_per_batch = settings_.num_replicas, settings_.gradient_accumulation_steps
    costs = _costs(balanced, case["seqlens"], case["quadratic_tokens"])
    steps = np.sort(costs.reshape(-1, ranks), axis=1)
    steps = steps[np.lexsort((steps[:, -1], steps[:, 0]))]  # by cheapest, then costliest: ties come first
    assert np.all(steps[:-1, -1] <= steps[1:, 0] * (1 + 1e-12))
    batches = costs.reshape(-1, steps_per_batch, ranks)
    assert np.all(np.diff(batches[:, 0::2], axis=2) >= 0) and np.all(np.diff(batches[:, 1::2], axis=2) <= 0)
    before = _costs(plan, case["seqlens"], case["quadratic_tokens"]).reshape(-1, ranks)
    after = costs.reshape(-1, ranks)
    assert after.max(axis=1).sum() <= before.max(axis=1).sum() * (1 + 1e-12)


@settings(max_examples=30, deadline=None)
@given(balance_cases(pipeline=True))
def test_balanced_pipeline_batches_keep_their_step_inputs(case):
    """A pipeline batch (one shape) keeps its step inputs, dealt anew; padded ones (one cost) are left as they are."""
    balanced, plan = _balanced_and_not(case)
    per_batch = balanced.settings.gradient_accumulation_steps * balanced.settings.num_replicas
    before, after = _step_inputs(plan), _step_inputs(balanced)
    for start in range(0, len(before), per_batch):
        assert sorted(after[start : start + per_batch]) == sorted(before[start : start + per_batch])
    if case["same_size"] and not case["padding_free"]:
        assert after == before


@given(seqlens=st.lists(st.integers(1, 40), min_size=1, max_size=5), ranks=st.integers(2, 4))
def test_balanced_ranks_refuse_too_few_samples_as_the_unbalanced_plan_does(seqlens, ranks):
    """Too few samples for one batch: balance_ranks=True refuses the sampler with the unbalanced plan's message (its
    counts), not an error of its own."""
    options = dict(num_replicas=ranks, rank=0, order="random")
    try:
        VariableBatchSampler(seqlens, 45, **options)
    except ValueError as error:
        unbalanced = str(error)
    else:
        assume(False)
    with pytest.raises(ValueError) as balanced:
        VariableBatchSampler(seqlens, 45, balance_ranks=True, quadratic_tokens=20.0, **options)
    assert str(balanced.value) == unbalanced


def test_one_rank_and_padded_pipeline_batches_are_left_as_they_are():
    """One rank waits for no one: its plan is the unbalanced one; padded same-size, same-length batches share one
    shape (test_balanced_pipeline_batches_keep_their_step_inputs: they stay as they are), and balancing says so."""
    seqlens = _lengths(300, high=60)
    options = dict(effective_batch_size=4, order="random", seed=1)
    alone = plan_batches(seqlens, 120, balance_ranks=True, quadratic_tokens=100, **options)
    assert alone.fingerprint() == plan_batches(seqlens, 120, **options).fingerprint()
    options.update(num_replicas=2, same_size=True, same_length=True, balance_ranks=True, quadratic_tokens=100)
    with pytest.warns(UserWarning, match=r"balance_ranks=True does nothing with same_size=True and same_length=True"):
        plan_batches(seqlens, 120, **options)


def test_the_balanced_sampler_deals_the_plan():
    """Every rank's sampler yields its share of `plan_batches`' balanced plan, each sample once an epoch (from any
    restored position: test_the_loader_yields_each_step_input_beside_its_batchs_record)."""
    seqlens = _long_tailed(3_000, seed=2)
    options = dict(num_replicas=4, order="bucket", seed=3, balance_ranks=True, quadratic_tokens=2_000)
    plan = plan_batches(seqlens, 8_192, effective_batch_size=8, epoch=1, **options)
    for rank in range(4):
        sampler = VariableBatchSampler(seqlens, 8_192, rank=rank, gradient_accumulation_steps=2, **options)
        sampler.set_epoch(1)
        assert list(sampler) == plan.microbatches()[rank::4], f"rank {rank}"


def test_balance_ranks_from_the_config_section_reaches_the_sampler():
    """The section's balance_ranks and quadratic_tokens reach the plan (bad ones: test_bad_input_deepspeed_glue)."""
    config = _glue_config(sequence_picking_order="random", balance_ranks=True, quadratic_tokens=512)
    _, (loader, _, _) = _glue(config, dataset_seqlens=_GLUE_SEQLENS)
    settings_ = loader.variable_batch_sampler.settings
    assert (settings_.balance_ranks, settings_.quadratic_tokens) == (True, 512.0)


def test_balanced_ranks_with_lr_in_sequences_warn_that_the_lr_swings():
    """Balancing with the LR scaled by sequences warns, with the swing in both units; by tokens it does not."""
    seqlens = _long_tailed(4_000, seed=4)
    options = dict(num_replicas=8, rank=0, order="bucket", balance_ranks=True, quadratic_tokens=2_000)
    messages = {}
    for unit in ("sequences", "tokens"):
        sampler = VariableBatchSampler(seqlens, 16_384, **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            VariableBatchSizeLR(_optimizer(), "mean", sampler, lr_scaling_unit=unit)
        messages[unit] = [str(w.message) for w in caught if "balance_ranks" in str(w.message)]
    assert not messages["tokens"]
    (message,) = messages["sequences"]
    assert re.search(r"spans [\d.]+x in sequences, [\d.]+x in tokens; .*lr_scaling_unit=.tokens.", message)


def _readme_quadratic_tokens():
    """The recipe for q the README links to (BENCHMARKS.md, "Timing q for your model"): its program run, the names it
    defines, and what it printed."""
    benchmarks = _README.with_name("BENCHMARKS.md")
    (program,) = [
        body
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", benchmarks.read_text(), re.S | re.M)
        if lang == "python" and "def quadratic_tokens" in body
    ]
    namespace = {"__name__": "readme_recipe"}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(program, benchmarks.name, "exec"), namespace)
    return namespace, printed.getvalue()


@pytest.mark.project
def test_readme_recipe_finds_q_of_a_model_whose_attention_dominates():
    """The recipe prints one line with q; it finds the q of a model whose cost is known, on a clock that model moves;
    and timed on CPU, a q far below the long shape for one attention layer of hidden size 32, and for a model of
    per-token layers alone one many times larger, or none (infinite): the shapes cost it alike."""
    torch.set_num_threads(1)
    recipe, printed = _readme_quadratic_tokens()
    shown = re.fullmatch(r"quadratic_tokens=(-?\d+|inf)\n", printed)
    assert shown, f"the recipe printed {printed!r}, not one line quadratic_tokens=<q>"
    quadratic_tokens = recipe["quadratic_tokens"]
    # On a clock that a model of known cost moves (n x (S + S^2 / q) seconds a pass), the recipe finds that q.
    clock = [0.0]
    recipe["time"] = types.SimpleNamespace(perf_counter=lambda: clock[0])
    for q in (300, math.inf):

        def known_cost(batch, q=q):
            clock[0] += batch.shape[0] * (batch.shape[1] + batch.shape[1] ** 2 / q)
            return batch

        found = quadratic_tokens(known_cost, lambda n, length: torch.zeros(n, length, requires_grad=True))
        assert found == pytest.approx(q), f"the recipe finds q={found} for a model whose q is {q}"
    recipe["time"] = time
    per_token = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    # NOTE [a timed measurement]: q comes from the ratio of the fastest of a few timed passes at two shapes. On a
    # loaded machine every pass of one shape can be slowed, and the ratio with it (the recipe then prints inf or a
    # negative q). Such a measurement is taken again, with more passes, up to three times: the recipe's arithmetic
    # is checked exactly on the clock above, and these tries check that it times real passes.
    tries = []  # per try: (q of the attention layer, q of the per-token model)
    q = float(shown[1])
    for _ in range(3):
        if tries:
            attention = recipe["Attention"]()
            q = quadratic_tokens(attention, lambda n, length: torch.randn(n, length, 32), repeats=9)
        tries.append((q, quadratic_tokens(per_token, lambda n, length: torch.randn(n, length, 64), repeats=9)))
        if 0 < q < 1024 and tries[-1][1] > 4 * q:
            return
    raise AssertionError(
        f"the recipe printed {printed!r}; per try, (q of the attention layer, expected 0 < q < 1024; q of the "
        f"per-token model, expected above 4 x the first): {tries}"
    )


# =============================================================================
# 10. The plan command: python plan.py ...
# =============================================================================

VARBATCH = str(Path(varbatch.__file__).resolve())
PLAN_SCRIPT = str(Path(_ROOT, "plan.py"))


def _plan_command():
    """plan.py, the plan command beside varbatch.py, imported where a project test runs it (`plan` names plans)."""
    import plan

    return plan


# A small dataset whose plans have several batches, padding and a tail.
LENGTHS = [3, 5, 2, 6, 4, 1, 7, 7, 2, 3, 8, 1, 1, 4, 6, 2, 5, 3, 3, 9, 2, 4]


def _cli(*args):
    """``plan.main(ARGS)`` (plan.py's) in this process: (exit code, stdout, stderr); argparse's exits included."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = _plan_command().main(list(args))
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def _cli_json(*args):
    """The JSON of ``plan.main([*ARGS, "--json"])``, which succeeds."""
    code, out, err = _cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


def _refused_in_one_line(*args):
    """``plan.main(ARGS)`` exits 2 with one line on stderr and nothing on stdout: that line."""
    code, out, err = _cli(*args)
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and err.startswith("varbatch: error:"), err
    return err


@pytest.fixture
def npy_file(tmp_path):
    path = tmp_path / "lengths.npy"
    np.save(path, np.array(LENGTHS))
    return str(path)


def _cell_values(cell, k):
    """A table cell of per-micro-batch values: one value stands for k equal ones."""
    values = [int(x) for x in cell.split(",")]
    return values * k if len(values) == 1 else values


def _table_rows(stdout):
    """The rows of the printed per-batch table, as lists of cells."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "B"])
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip() or not line.split()[0].isdigit():
            break
        rows.append(line.split())
    return rows


def _write_config(tmp_path, section=None, **batch_keys):
    config = dict(batch_keys)
    config["data_efficiency"] = {
        "data_sampling": {
            "dynamic_batching": section
            or {"enabled": True, "max_tokens": 12, "lr_scaling_method": "sqrt", "lr_scaling_reference": 4}
        }
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


# -- the table and the totals ----------------------------------------------------------------------


@pytest.mark.project
@pytest.mark.parametrize("pipeline", [False, True])
def test_table_json_and_totals_match_plan_batches(npy_file, pipeline):
    """Every row and total of the table and of the JSON (and its drops and settings) is what plan_batches and a slow
    recount give for the flags."""
    flags = "--max-tokens 10 --effective-batch-size 4 --world-size 2 --order random --seed 0 --epoch 2 --batches 0"
    flags = [*flags.split(), "--lr-scaling-method", "sqrt", "--lr-scaling-reference", "mean"]
    flags += ["--pipeline"] if pipeline else []
    code, out, err = _cli("--seqlens", npy_file, *flags)
    assert code == 0, err
    data = _cli_json("--seqlens", npy_file, *flags)
    options = dict(order="random", seed=0, epoch=2, same_size=pipeline, same_length=pipeline)
    plan = plan_batches(LENGTHS, 10, effective_batch_size=4, num_replicas=2, **options)
    sizes, tensor_s = plan.microbatch_sizes().tolist(), _tensor_seqlens(plan, LENGTHS)
    padded = [n * s for n, s in zip(sizes, tensor_s)]
    factors = [scale_lr(plan.batch_sizes.mean(), int(size), 1.0, "sqrt") for size in plan.batch_sizes]
    rows = _table_rows(out)
    assert len(rows) == len(data["batches"]) == plan.num_batches
    for b, (row, shown) in enumerate(zip(rows, data["batches"])):
        batch, sequences, microbatches, mb_sizes, pad_s, real, padding, factor = row
        assert (int(batch), int(sequences), int(microbatches)) == (b, plan.batch_sizes[b], 4)
        assert _cell_values(mb_sizes, 4) == shown["microbatch_sizes"] == sizes[4 * b : 4 * b + 4]
        assert _cell_values(pad_s, 4) == tensor_s[4 * b : 4 * b + 4]
        assert int(real) == shown["real_tokens"] == plan.batch_tokens[b]
        slots = sum(padded[4 * b : 4 * b + 4])
        assert float(padding) == pytest.approx(100 * (1 - plan.batch_tokens[b] / slots), abs=0.051)
        assert float(factor) == pytest.approx(factors[b], rel=5e-3), "the table shows three digits"
        assert shown["lr_factor"] == pytest.approx(factors[b])
    totals = data["totals"]
    assert (totals["real_tokens"], totals["padded_tokens"]) == (sum(LENGTHS[i] for i in plan.sample_ids), sum(padded))
    assert f"tokens: {totals['real_tokens']} real / {totals['padded_tokens']} padded" in out
    assert totals["efficiency"] == pytest.approx(totals["real_tokens"] / totals["padded_tokens"])
    assert f"epoch 2: {plan.num_batches} batches of 4 micro-batches" in out
    assert f"samples: {plan.batch_sizes.sum()} trained, {plan.num_dropped} dropped" in out
    assert totals["samples"] + totals["num_dropped"] == len(LENGTHS) and plan.num_dropped > 0
    assert totals["dropped"] == {reason: len(ids) for reason, ids in plan.dropped.items()}
    assert data["dropped_ids"] == {reason: ids.tolist() for reason, ids in plan.dropped.items()}
    assert totals["lr_factor"]["mean"] == pytest.approx(np.mean(factors))
    assert data["settings"]["seed"] == 0 and data["settings"]["epoch"] == 2
    assert all(line in out.splitlines() for line in _plan_command()._format_totals(plan.totals()).splitlines())


@pytest.mark.project
def test_padding_free_plan_shows_its_rows(npy_file):
    """--padding-free: the plan says so, its step inputs are 1 x T rows with no padding."""
    code, out, _ = _cli("--seqlens", npy_file, "--padding-free", "--effective-batch-size", "2")
    assert code == 0, out
    assert "padding-free (one flat row per step input)" in out and "= 100.0% efficiency" in out
    assert re.search(r"largest step input: a row of \d+ samples?, 1 x \d+ = \d+ tokens = [01]\.\d\d x", out), out


@pytest.mark.project
def test_synthetic_default_runs_alone():
    """`python plan.py` without files plans 2000 synthetic lengths, always the same ones."""
    data = _cli_json()
    assert _cli_json() == data
    assert data["settings"]["num_samples"] == 2000 and data["settings"]["max_tokens"] == 4096
    totals = data["totals"]
    assert totals["samples"] + totals["num_dropped"] == 2000
    assert 150 * 2000 < totals["real_tokens"] < 500 * 2000  # median about 240 tokens


@pytest.mark.project
def test_lr_unit_trap_is_flagged(npy_file):
    """The totals warn when the default B_ref puts the mean LR factor far from 1, and not when B_ref is the mean."""
    _, trap, _ = _cli("--seqlens", npy_file, "--max-tokens", "20")
    _, fixed, _ = _cli("--seqlens", npy_file, "--max-tokens", "20", "--lr-scaling-reference", "mean")
    assert "warning: the configured LR is multiplied by" in trap and "lr_scaling_reference" in trap
    assert "warning" not in fixed


# -- inputs: .npy, text, stdin, a DeepSpeed config -------------------------------------------------


@pytest.mark.project
def test_npy_text_and_stdin_give_the_same_plan(monkeypatch, npy_file, tmp_path):
    """The three ways to pass lengths give the same JSON (but for the source's name)."""
    text = "\n".join(map(str, LENGTHS)) + "\n\n"
    (tmp_path / "lengths.txt").write_text(text)
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    shown = [
        _cli_json("--seqlens", source, "--max-tokens", "10")
        for source in (npy_file, str(tmp_path / "lengths.txt"), "-")
    ]
    for data in shown:
        data["settings"].pop("seqlens")
    assert shown[0] == shown[1] == shown[2]


@pytest.mark.project
@pytest.mark.parametrize(
    "batch_keys, flags, expected",
    [
        # (k, micro batch per GPU, accumulation, ranks), resolved as DeepSpeed does
        (dict(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2), [], (8, 2, 2, 2)),
        (dict(train_batch_size=8, train_micro_batch_size_per_gpu=1), ["--world-size", "4"], (8, 1, 2, 4)),
        (dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3), ["--world-size", "2"], (12, 2, 3, 2)),
        (dict(train_batch_size=6), [], (6, 6, 1, 1)),
        (dict(train_batch_size=6, gradient_accumulation_steps=3), ["--world-size", "2"], (6, 1, 3, 2)),
        # the flag keeps the config's micro-batch size, as training with train_batch_size 12 would (it planned 1)
        (
            dict(train_batch_size=4, train_micro_batch_size_per_gpu=2),
            ["--effective-batch-size", "12", "--world-size", "2"],
            (12, 2, 3, 2),
        ),
    ],
)
def test_config_batch_geometry(tmp_path, npy_file, batch_keys, flags, expected):
    """train_batch_size = micro batch per GPU x accumulation x world size, any one of them derived; the plan shown
    is plan_batches' with them."""
    config = _write_config(tmp_path, **batch_keys)
    shown = _cli_json("--config", config, "--seqlens", npy_file, "--batches", "0", *flags)
    totals = shown["totals"]
    geometry = ("effective_batch_size", "micro_batch_size", "gradient_accumulation_steps", "num_replicas")
    assert tuple(totals[key] for key in geometry) == expected
    assert totals["max_tokens"] == 12 and totals["lr_factor"]["method"] == "sqrt"
    assert totals["lr_factor"]["reference_value"] == 4
    k, micro_batch_size, _, num_replicas = expected
    trained = plan_batches(
        LENGTHS, 12, effective_batch_size=k, micro_batch_size=micro_batch_size, num_replicas=num_replicas
    )
    assert [n for row in shown["batches"] for n in row["microbatch_sizes"]] == trained.microbatch_sizes().tolist()


@pytest.mark.project
def test_config_world_size_that_contradicts_it_is_an_error(tmp_path, npy_file):
    """A --world-size the config's batch sizes contradict exits 2, naming both."""
    config = _write_config(
        tmp_path, train_batch_size=4, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2
    )
    err = _refused_in_one_line("--config", config, "--seqlens", npy_file, "--world-size", "3")
    assert "train_batch_size=4" in err and "world size 3" in err


_CLI_SEQLENS = [*_lengths(60, 1, 30, seed=19), 45]


@st.composite
def config_sections(draw):
    """A dynamic_batching section: max_tokens, and any subset of the keys training reads, with valid values."""
    section = {"enabled": True, "max_tokens": draw(st.integers(12, 60))}
    optional = {
        "budget": st.sampled_from(BUDGETS),
        "sequence_picking_order": st.sampled_from(ORDERS),
        "seed": st.one_of(st.none(), st.integers(0, 5)),  # null: as if absent
        "min_batch_size": st.integers(1, 3),
        "max_batch_size": st.one_of(st.none(), st.integers(3, 8)),
        "bucket_size": st.integers(1, 16),
        "on_overlong": st.sampled_from(["skip", "error"]),
        "lr_scaling_method": st.sampled_from(LR_METHODS),
        "lr_scaling_unit": st.sampled_from(["sequences", "tokens"]),
        "lr_scaling_reference": st.one_of(st.none(), st.just("mean"), st.integers(1, 50)),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            section[key] = draw(strategy)
    if "sequence_picking_order" in section and draw(st.booleans()):
        section["sentence_picking_order"] = section.pop("sequence_picking_order")  # DeepSpeed's older key
    return section


@pytest.mark.project
@given(section=config_sections(), seed=st.one_of(st.none(), st.integers(0, 9)))
# on_overlong "error" with a sample over budget: training refuses, so must the command
@example(section={"enabled": True, "max_tokens": 40, "on_overlong": "error"}, seed=None)
# "seed": null plans as without the key (data_efficiency.seed, else 1234), not as seed 0
@example(section={"enabled": True, "max_tokens": 40, "sequence_picking_order": "random", "seed": None}, seed=None)
@settings(max_examples=40)
def test_the_plan_command_plans_what_training_plans(tmp_path_factory, section, seed):
    """For any dynamic_batching section, `plan` shows training's plan and LR factors, or refuses as training does."""
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "data_efficiency": {"data_sampling": {"dynamic_batching": section}},
    }
    if seed is not None:
        config["data_efficiency"]["seed"] = seed
    folder = tmp_path_factory.mktemp("cli")
    (folder / "ds_config.json").write_text(json.dumps(config))
    np.save(folder / "lengths.npy", np.array(_CLI_SEQLENS))
    code, out, err = _cli(
        "--config", str(folder / "ds_config.json"), "--seqlens", str(folder / "lengths.npy"), "--json", "--batches", "0"
    )
    optimizer = _optimizer()
    engine = _Engine(config, optimizer=optimizer, gradient_accumulation_steps=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unit-trap warning of some sections
            loader, scheduler, _ = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
                [torch.ones(n) for n in _CLI_SEQLENS], engine, dataset_seqlens=_CLI_SEQLENS
            )
    except (TypeError, ValueError) as error:
        assert code == 2, f"training refuses ({error}) but the command exits {code}"
        assert out == "" and err.count("\n") == 1, err
    else:
        assert code == 0, f"training accepts the section but the command exits {code}: {err}"
        shown, plan, factors = json.loads(out), loader.variable_batch_sampler.plan, []
        for _ in range(plan.num_batches):
            factors.append(scheduler.lr_factor)
            optimizer.step()
            scheduler.step()
        assert [n for row in shown["batches"] for n in row["microbatch_sizes"]] == plan.microbatch_sizes().tolist()
        assert shown["dropped_ids"] == {reason: ids.tolist() for reason, ids in plan.dropped.items()}
        assert [row["lr_factor"] for row in shown["batches"]] == pytest.approx(factors)


# -- errors: one line, exit code 2 -----------------------------------------------------------------


@pytest.mark.project
@pytest.mark.parametrize(
    "args, names",
    [
        (["--max-tokenz", "5"], "--max-tokenz"),
        (["--budget", "sideways"], "sideways"),
        (["--max-tokens", "0"], "'0'"),
        (["--lr-scaling-reference", "abc"], "argument --lr-scaling-reference: expected a number > 0 or mean"),
        (["--lr-scaling-reference", "1e-320"], "B / B_ref is inf: B_ref is too small"),  # the LR factors were inf
        (["--order", "randm"], "did you mean 'random'"),
        # the command was `python varbatch.py plan ...`: the word `plan` now is no subcommand
        (["plan", "--json"], "unrecognized arguments: plan"),
        (["--json", "--plot", "plan.png"], "argument --plot: not allowed with argument --json"),  # one output
    ],
)
def test_bad_flag_values_exit_2_with_one_line(args, names):
    """An unknown flag, a bad flag value, an argument that is no flag, or two outputs: one line naming it, exit 2."""
    assert names in _refused_in_one_line(*args)


# a section without max_tokens: one of the config reader's refusals, the glue's own (test_bad_input_deepspeed_glue)
_SECTION_REFUSED = '{"data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": true, "budget": "pad"}}}}'


@pytest.mark.project
@pytest.mark.parametrize(
    "flag, name, content, names",
    [
        ("--config", "ds_config.json", '{"train_batch_size": ', "not valid JSON"),
        ("--config", "ds_config.json", "[1]", "JSON object"),
        ("--config", "ds_config.json", _SECTION_REFUSED, "max_tokens"),
        ("--seqlens", "nope.npy", None, "No such file or directory"),
        ("--seqlens", "lengths.npy", "", "lengths.npy"),
        ("--seqlens", "lengths.txt", "3\n4\nfour\n", "line 3"),
        ("--seqlens", "lengths.txt", "3\n0\n", "seqlens[1]=0"),
        ("--seqlens", "lengths.txt", "\n\n", "no lengths"),
    ],
    ids=["not JSON", "a list", "a section refused", "missing", "corrupt .npy", "a bad line", "a bad length", "none"],
)
def test_a_bad_config_or_lengths_file_exits_2_with_one_line(tmp_path, flag, name, content, names):
    """A config malformed or refused, a lengths file missing, corrupt, with a bad line, a bad length or no lengths
    at all: one line naming the problem (and the lengths file) and exit code 2, no traceback."""
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    err = _refused_in_one_line(flag, str(path))
    assert names in err and (flag == "--config" or str(path) in err), err


@pytest.mark.project
def test_help_explains_every_flag(monkeypatch):
    """`plan.py --help` describes every flag it lists, the batch arithmetic and the synthetic default."""
    monkeypatch.setenv("COLUMNS", "80")  # a pipe's width, as in a fresh interpreter
    code, out, _ = _cli("--help")
    assert code == 0
    usage, _, options = out.partition("\n\n")
    flags = re.findall(r"[\[|] ?(--[\w-]+)", usage)  # [--flag ...] and [--json | --plot ...]
    assert len(flags) >= 12, usage
    for flag in flags:
        block = re.search(rf"^  {re.escape(flag)}\b(.*?)(?=^  -|\Z)", options, re.S | re.M)
        assert block, f"{flag} is not described"
        words = block[1].split()
        assert len([w for w in words if not w.isupper()]) >= 2, f"flag {flag} has no help: {block[0]!r}"
    assert "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps" in out
    assert "synthetic" in out


@pytest.mark.project
def test_the_vendored_file_draws_nothing_and_the_table_needs_no_matplotlib(monkeypatch, npy_file, tmp_path):
    """varbatch.py never imports matplotlib; plan.py imports it only to draw: where it is missing, the table and
    the JSON run and --plot exits 2 with one line that says how to install it, writing no picture."""
    assert "matplotlib" not in Path(VARBATCH).read_text()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it raises ImportError
    picture = tmp_path / "plan.png"
    assert _cli("--seqlens", npy_file)[0] == 0
    assert _cli("--seqlens", npy_file, "--json")[0] == 0
    err = _refused_in_one_line("--seqlens", npy_file, "--plot", str(picture))
    assert err == "varbatch: error: --plot needs matplotlib, which is not installed: pip install matplotlib\n"
    assert not picture.exists()


@pytest.mark.project
def test_varbatch_py_holds_no_command_line():
    """The command left the vendored file: varbatch.py imports no argparse, has no __main__ block, and defines none
    of plan.py's names (moved, not copied)."""
    tree = ast.parse(Path(VARBATCH).read_text())
    nodes = list(ast.walk(tree))
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
    assert "argparse" not in imported, "varbatch.py imports argparse"
    mains = [node.lineno for node in nodes if isinstance(node, ast.Constant) and node.value == "__main__"]
    assert mains == [], f"varbatch.py tests for __main__ at line {mains}"
    plan_names = {name for name, _ in _top_level_names(ast.parse(Path(PLAN_SCRIPT).read_text()))}
    both = {name for name, _ in _top_level_names(tree)} & plan_names
    assert not both, f"varbatch.py and plan.py both define {sorted(both)}"


@pytest.mark.project
def test_plot_draws_a_fixed_number_of_artists_per_micro_batch(tmp_path):
    """plan.py's drawing grows with the micro-batches drawn, not with the tokens (item 14)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    rng = np.random.default_rng(14)

    def artists(scale):
        seqlens = rng.integers(8, 49, 20_000) * scale
        plan = varbatch.plan_batches(seqlens, 16_384 * scale, effective_batch_size=8, num_replicas=8)
        shown = sum(len(m) for m in _plan_command()._shown(plan, 2))
        ax = Figure().add_subplot()
        _plan_command()._draw_plan(ax, plan, seqlens, np.ones(plan.num_batches), 2, 4000.0, 1.0, 48 * scale)
        return len(ax.get_children()), shown

    small, large = artists(1), artists(64)
    assert small[1] == large[1] == 12, (small, large)  # 2 batches x the first 6 of 8 micro-batches
    assert small[0] == large[0] <= 3 * 12 + 20, (small, large)  # a box, a row outline and a label each


@pytest.mark.project
def test_plot_batches_0_draws_at_most_max_batches_per_plan(tmp_path, monkeypatch, capsys):
    """plan.py --plot with --batches 0 on 3,000 lengths draws the first MAX_BATCHES batches of each plan and says
    so on stderr (it drew all of them: minutes on 30,000 samples)."""
    pytest.importorskip("matplotlib")
    lengths = tmp_path / "lengths.npy"
    np.save(lengths, np.array(_lengths(3000, 8, 300, seed=41)))
    drawn, draw_plan = [], _plan_command()._draw_plan  # (the plan's batches, the batches drawn) per panel

    def counting(ax, plan, seqlens, factors, num_batches, *args):
        drawn.append((plan.num_batches, len(_plan_command()._shown(plan, num_batches))))
        return draw_plan(ax, plan, seqlens, factors, num_batches, *args)

    monkeypatch.setattr(_plan_command(), "_draw_plan", counting)
    code = _plan_command().main(
        ["--seqlens", str(lengths), "--max-tokens", "600", "--batches", "0", "--plot", str(tmp_path / "plan.png")]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    assert len(drawn) == 2 and all(batches > _plan_command().MAX_BATCHES for batches, _ in drawn), (
        f"plans too short to cut: {drawn}"
    )
    assert [shown for _, shown in drawn] == [_plan_command().MAX_BATCHES] * 2, f"(batches, drawn) per plan: {drawn}"
    assert f"drawing the first {_plan_command().MAX_BATCHES} batches of each plan" in err, err


# =============================================================================
# 11. Launched runs (slow): several processes, the DeepSpeed launcher, the README's commands
# =============================================================================
# The example runs under the DeepSpeed launcher with 2 CPU ranks (gloo), DDP and pipeline; its
# rank-0 step lines are compared with plans computed here from the dataset's real seqlens. Every launch of the
# section is a job of `_jobs`, run once for all the tests that read it (see `jobs`).

_STEP_LINE = re.compile(
    r"^step +(\d+) \| epoch (\d+) \| B ([\d,]+) \| S ([\d,]+) \| tokens (\d+) \| "
    r"padding ([\d.]+)% \| lr (\S+) \| loss (\S+)$",
    re.M,
)
_SUMMARY_LINE = re.compile(r"^summary \| epochs (\S+) \| .*\| samples trained (\d+) \| dropped (.*?) \|", re.M)
# Small runs: a few seconds of training each; the launcher's start-up dominates. The README test runs the
# README's example commands at these sizes too, so that they and the example tests' launches are one set,
# each launched once (see `launched`): 36 steps on DDP (9 an epoch: the README's `--max-steps 33` stops inside epoch 3).
_NUM_SAMPLES, _EPOCHS = 700, 4
_SMALL_RUN = ["--num-samples", str(_NUM_SAMPLES), "--epochs", str(_EPOCHS)]
_LAUNCH_TIMEOUT_S = 600
_DEEPSPEED_LAUNCHER = [sys.executable, "-m", "deepspeed.launcher.runner"]  # `deepspeed`, this Python's


# torch 2.13's gloo can abort a CPU process at interpreter exit, after its work is done: a gloo worker
# thread that releases a tensor needs the GIL while the interpreter shuts down (pytorch/pytorch#179291;
# seen here in a few percent of 2-rank runs, also of scripts without varbatch). Such an exit is not the
# program's failure: a launch that ends so runs once more, and the second run must pass. The second run must find
# the files the first one found: a launch reads what it wrote (checkpoints it resumes from, a seqlens cache, records),
# so the folder it may change is copied before the first run and put back before the second.
_GLOO_EXIT_ABORT = "terminate called without an active exception"


def _run(cmd, timeout=_LAUNCH_TIMEOUT_S, cwd=_ROOT, env=None, restores="cwd"):
    """Runs ``cmd`` in its own process group; on timeout kills the whole group (launcher and ranks); once more where
    gloo aborted it at exit (above).

    ``restores``: the folder a second run gets back as the first run found it, or None: nothing to put back. By
    default ``cwd``, a launch's own folder, unless that is the project's root (its launches write nothing).
    """
    if restores == "cwd":
        restores = None if Path(cwd).resolve() == Path(_ROOT).resolve() else cwd
    with _kept_as_found(restores) as put_back:
        done = _run_once(cmd, timeout, cwd, env)
        if done.returncode != 0 and _GLOO_EXIT_ABORT in done.stdout + done.stderr:
            print(f"gloo aborted a process at exit; running once more from its folder as found: {' '.join(cmd)}")
            put_back()
            done = _run_once(cmd, timeout, cwd, env)
    return done


def _run_once(cmd, timeout, cwd, env):
    env = dict(env or os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s (a hang):\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@contextlib.contextmanager
def _kept_as_found(folder):
    """Copies ``folder`` (None: nothing; or notes that it is absent) and yields a function that puts it back."""
    with tempfile.TemporaryDirectory() as keep:
        copy = Path(keep) / "copy"
        if folder is not None and Path(folder).exists():
            shutil.copytree(folder, copy, symlinks=True)

        def put_back():
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            if copy.exists():
                shutil.copytree(copy, folder, symlinks=True)

        yield put_back


def _launch(script, args, cwd=_ROOT):
    """``deepspeed --num_gpus 2 script args`` (the launcher's own entry point, this Python), one thread a rank."""
    command = [*_DEEPSPEED_LAUNCHER, "--num_gpus", "2", "--master_port", str(_master_port()), script, *args]
    return _run(command, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"))


_PORTS_GIVEN = set()


def _master_port():
    """A free port below the kernel's ephemeral range (32768 up): a launcher binds its master port seconds after
    the test picked it, and a port of that range (`_free_port`'s) may meanwhile go to any process's outgoing
    connection (gloo's, another job's), which fails the launch with "address already in use"."""
    low = 32768
    with contextlib.suppress(OSError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in np.random.default_rng().permutation(np.arange(20000, low)).tolist():
        if port in _PORTS_GIVEN:  # picked for a launch that may not have bound it yet
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            _PORTS_GIVEN.add(port)
            return port
    raise AssertionError(f"no free port in [20000, {low})")


def _check_ok(result):
    assert result.returncode == 0, (
        f"exit code {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}"
        f"\n--- stderr ---\n{result.stderr[-4000:]}"
    )


# The section's launches, each a job of `_jobs`: a function of no argument whose result the tests read.
def _jobs(launched, tmp_path_factory):
    """The jobs by name: the example's launches and the README's commands (chains of commands run in order; the
    example's first, as the README's ask for the same launches), the launcher runs, the 2-rank checks, the
    DeepSpeed-style script and the example's pipeline on one process."""
    chains = {f"example: {name}": chain for name, chain in _example_chains().items()}
    chains.update({f"readme {i}": [text for text, _ in chain] for i, chain in enumerate(_readme_chains(launched))})
    jobs = {name: functools.partial(_each, launched, chain) for name, chain in chains.items()}
    in_folders = {
        "hf": _hf_two_process_job,
        "lightning": _lightning_job,
        "rank checks": _rank_checks_job,
        "accelerate": _accelerate_job,
        "stateful": _stateful_job,
        "deepspeed style": _deepspeed_style_job,
    }
    for name, job in in_folders.items():
        jobs[name] = functools.partial(job, tmp_path_factory.mktemp(name.replace(" ", "_")))
    jobs["pipeline on one process"] = _one_process_pipeline_job
    return jobs


def _each(launched, chain):
    """The results of the commands of ``chain``, run in order."""
    return [launched(text) for text in chain]


@pytest.fixture(scope="module")
def jobs(launched, tmp_path_factory):
    """``jobs(name)``: what the job ``name`` of `_jobs` returned; a job that raised (a failure, a hang, a skip)
    raises in every test that reads it. All the jobs run when the first test asks, two at a time: a launch leaves a
    core idle for most of its start-up (one process imports at a time), and the other job fills it."""
    import concurrent.futures

    def outcome(job):
        try:
            return job()
        except BaseException as error:  # pytest's failures and skips too: the tests that read the job report them
            return error

    named = _jobs(launched, tmp_path_factory)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = dict(zip(named, pool.map(outcome, named.values())))

    def result(name):
        if isinstance(outcomes[name], BaseException):
            raise outcomes[name]
        return outcomes[name]

    return result


# The checks that need the 2 processes of one job, before any training: processes that deal one plan differently
# (seqlens that differ, one rank given twice, a sampler made before torch.distributed was up) and a seqlen cache
# only some ranks have. One torchrun job runs each case in turn on one process group (a refusal is raised on every
# rank alike, so the ranks stay in step); each rank saves what each case raised, and what the glue measured and
# planned the second time it read the seqlens, when rank 0's folder held a cache and rank 1's none.
_RANK_CHECKS_SCRIPT = """
import datetime, json, os, sys, types
import torch
import varbatch
out, rank = sys.argv[1], int(os.environ["RANK"])
early = varbatch.VariableBatchSampler([10] * 100, 64)  # made before init_process_group: it deals to 1 rank
torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
samplers = {
    "different seqlens": lambda: varbatch.VariableBatchSampler([10 if rank == 0 else 5] * 100, 64, order="bucket"),
    "one rank twice": lambda: varbatch.VariableBatchSampler([10] * 100, 64, num_replicas=2, rank=0),
    "made before init_process_group": lambda: early,
}
refused = {}
for case, make in samplers.items():
    try:
        sampler = make()
        dataset = [torch.ones(n) for n in sampler.seqlens]
        loader = varbatch.make_dataloader(dataset, sampler, collate_fn=varbatch.PaddedCollate())
        refused[case] = f"trained {sum(1 for _ in loader)} step inputs, no error"
    except RuntimeError as error:
        refused[case] = str(error)


def glue(measured):
    # The DeepSpeed glue on a stand-in engine, the seqlen cache in this rank's own folder (node-local disks).
    section = {"enabled": True, "max_tokens": 64, "metrics_path": os.path.abspath(f"metrics{rank}")}
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
              "data_efficiency": {"data_sampling": {"dynamic_batching": section}}}
    engine = types.SimpleNamespace(_config=types.SimpleNamespace(_param_dict=config), optimizer=None,
                                   lr_scheduler=None, data_parallel_group=None, train_batch_size=lambda: 2,
                                   train_micro_batch_size_per_gpu=lambda: 1, gradient_accumulation_steps=lambda: 1)

    def batch_seqlens(batch):
        measured.append(len(batch[1]))
        return batch[1]

    loader, _, _ = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        [torch.ones(3 + (7 * i) % 29) for i in range(200)], engine, dataloader_collate_fn=varbatch.PaddedCollate(),
        batch_seqlens_fn=batch_seqlens)
    return [list(map(int, m)) for m in loader.variable_batch_sampler.plan.microbatches()]


glue([])  # computes the seqlens, and leaves a cache in one folder
cached = [os.path.exists(f"metrics{r}/varbatch_seqlens.npy") for r in range(2)]
measured = []
plan = glue(measured)
with open(os.path.join(out, f"rank{rank}.json"), "w") as file:  # `_saved_ranks`' form
    json.dump({"records": dict(refused=refused, cached=cached, measured=sum(measured), plan=plan)}, file)
torch.distributed.destroy_process_group()
"""


def _rank_checks_job(folder):
    """The job of ``_RANK_CHECKS_SCRIPT`` on 2 ranks: (exit code, output, what each rank saved, or [] if none)."""
    rc, output, ranks, _ = _launch_ranks(folder, _RANK_CHECKS_SCRIPT, {})
    return rc, output, ranks


_MISMATCHED_RANKS_CASES = [
    ("different seqlens", ["rank 1 planned a different epoch than rank 0", "give every rank the same dataset"]),
    ("one rank twice", ["the processes deal to ranks [0, 0]", "pass every process its own data-parallel rank"]),
    (
        "made before init_process_group",
        ["made before torch.distributed was initialized", "the job now has 2", "make it after init_process_group"],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, names", _MISMATCHED_RANKS_CASES)
def test_processes_that_deal_one_plan_differently_fail_at_once_on_every_rank(jobs, case, names):
    """2 gloo processes that planned apart, deal to one rank twice or made the sampler too early: RuntimeError on
    both, naming the cause and the fix (the DeepSpeed glue checks through make_dataloader)."""
    rc, output, ranks = jobs("rank checks")
    assert rc == 0 and all(ranks), output[-3000:]
    for rank, saved in enumerate(ranks):
        for name in names:
            assert name in saved["refused"][case], f"rank {rank}: {name!r} not in {saved['refused'][case]!r}"


@pytest.mark.slow
def test_a_seqlen_cache_only_some_ranks_have_makes_every_rank_compute(jobs):
    """Per-rank metrics_path folders (node-local disks), a cache in rank 0's only: both ranks compute the seqlens and
    plan alike (rank 0 read its cache while rank 1 computed: mismatched collectives, "too many values to unpack")."""
    rc, output, ranks = jobs("rank checks")
    assert rc == 0 and all(ranks), output[-3000:]
    assert ranks[0]["cached"] == [True, False], "rank 0's folder has no cache, or rank 1's has one: it could not fail"
    for rank, saved in enumerate(ranks):
        assert saved["measured"] >= len(range(rank, 200, 2)), f"rank {rank} measured {saved['measured']} samples"
    seqlens = [3 + (7 * i) % 29 for i in range(200)]
    expected = plan_batches(seqlens, 64, effective_batch_size=2, num_replicas=2, seed=1234).microbatches()
    assert ranks[0]["plan"] == ranks[1]["plan"] == [list(map(int, m)) for m in expected]


# -- the example under the DeepSpeed launcher ------------------------------------------------------


def _steps(stdout):
    """The rank-0 step lines as dicts, in order."""
    return [
        dict(
            step=int(m[1]),
            epoch=int(m[2]),
            B=[int(x) for x in m[3].split(",")],
            S=[int(x) for x in m[4].split(",")],
            tokens=int(m[5]),
            padding=m[6],
            lr=m[7],
            loss=float(m[8]),
        )
        for m in _STEP_LINE.finditer(stdout)
    ]


def _example_config():
    with open(os.path.join(_ROOT, "ds_config.json")) as f:
        return json.load(f)


def _example_plans(config, pipeline):
    """The plans the example should train (2 ranks), from the dataset's real seqlens and the config's one reader."""
    import example

    seqlens = example.RunningSumSequences(_NUM_SAMPLES, seed=0).seqlens.numpy()
    options, lr_options, _ = varbatch._read_config(config)
    num_replicas = 1 if pipeline else 2  # 2 ranks: 2 stages x 1, or 2 data-parallel ranks
    shape = dict(  # DeepSpeed's batch sizes, and a pipeline's shapes where it runs one
        effective_batch_size=config["train_batch_size"],
        micro_batch_size=config.get("train_micro_batch_size_per_gpu", 1),
        num_replicas=num_replicas,
        same_size=pipeline,
        same_length=pipeline,
    )
    plans = [plan_batches(seqlens, **options, **shape, epoch=epoch) for epoch in range(_EPOCHS)]
    return plans, seqlens, lr_options, num_replicas


def _expected_steps(config, pipeline):
    """Per optimizer step: (epoch, rank 0's (B, S) per step input, real tokens, LR), and the plans. The LR is the
    example's schedule (warmup and cosine over the run's steps, stepped once a batch) x the batch's scaling factor."""
    import example

    plans, seqlens, lr, num_replicas = _example_plans(config, pipeline)
    assert (lr["lr_clock"], lr["lr_clock_step"]) == ("steps", 1), "ds_config.json's LR clock is not the oracle's"
    micro = config.get("train_micro_batch_size_per_gpu", 1)
    horizon = sum(p.num_batches for p in plans)
    steps = []
    for plan in plans:
        k, sizes, tensor_s = plan.effective_batch_size, plan.microbatch_sizes(), _tensor_seqlens(plan, seqlens)
        unit = plan.batch_tokens if lr["lr_scaling_unit"] == "tokens" else plan.batch_sizes
        reference = {None: config["train_batch_size"], "mean": float(unit.mean())}.get(
            lr["lr_scaling_reference"], lr["lr_scaling_reference"]
        )
        for b in range(plan.num_batches):
            shapes = [
                (int(sizes[g * micro : (g + 1) * micro].sum()), tensor_s[g * micro])
                for g in range(b * k // micro, (b + 1) * k // micro)
                if g % num_replicas == 0
            ]
            schedule = config["optimizer"]["params"]["lr"] * example.warmup_cosine(len(steps), horizon)
            factor = scale_lr(reference, float(unit[b]), 1.0, lr["lr_scaling_method"])
            steps.append((plan.epoch, shapes, int(plan.batch_tokens[b]), schedule * factor))
    return steps, plans


_PATHS = {"ddp": [], "pipeline": ["--pipeline-num-stages", "2"]}
_EXAMPLE_LAUNCH = "deepspeed --num_gpus 2 example.py"  # as the README writes it
# The example's padding-free mode at a small size: one process (DDP) and the README's launch (pipeline), and its
# flat rows' per-token model on padded step inputs of the same plan (`--per-token`).
_FLAT_RUN = "--num-samples 300 --epochs 3"
# Stopped and resumed runs of the example, each against the uninterrupted run of its path (on ds_config.json):
# (path, flags, the step it stops at, its checkpoint folder). "ddp" is the README's two commands as it writes them;
# "pipeline, 2 loader workers" runs ds_config.json with data_sampling.num_workers 2, so that its loader reads ahead
# (a checkpoint must save the record of the last step input trained, not where the workers read), stopped at batch 2
# of epoch 1 (10 batches an epoch). One pair of launches checks both the pipeline's resume and the read-ahead's.
_STOPS = {
    "ddp": ("ddp", [], 33, "ckpt"),
    "pipeline, 2 loader workers": (
        "pipeline",
        [*_PATHS["pipeline"], "--config", "ds_config_workers.json"],
        12,
        "ckpt-pipeline-workers",
    ),
}


def _example_command(*flags):
    """The README's form of a launch of the example with ``flags``, at the small run's sizes."""
    return " ".join([_EXAMPLE_LAUNCH, *flags, *_SMALL_RUN])


def _example_chains():
    """The example's launches the tests read, by name: each a chain of commands run in order."""
    chains = {f"stopped {case}": _stop_and_resume(*_STOPS[case][1:]) for case in _STOPS}
    chains.update({path: [_example_command(*flags)] for path, flags in _PATHS.items()})
    chains["pipeline flat"] = [f"{_EXAMPLE_LAUNCH} --pipeline-num-stages 2 --padding-free {_FLAT_RUN}"]
    chains.update({mode: [f"python example.py --{mode} {_FLAT_RUN}"] for mode in ("padding-free", "per-token")})
    return chains


def _stop_and_resume(flags, stop, checkpoint):
    """The commands of a run stopped after step ``stop`` and resumed."""
    return [
        _example_command(*flags, "--max-steps", str(stop), "--checkpoint-dir", checkpoint),
        _example_command(*flags, "--checkpoint-dir", checkpoint, "--resume"),
    ]


def _command_key(text):
    """A command line without its comment, its launcher's port and extra spaces: what makes two launches one."""
    return " ".join(re.sub(r"\s+#.*$|--master_port \d+", "", text).split())


def _copy_project(folder):
    """Copies the project's scripts and configs (not this file) into ``folder``, where the README's commands run, and
    the config of the example's run with 2 loader workers."""
    for path in [*Path(_ROOT).glob("*.py"), *Path(_ROOT).glob("*.json")]:
        if path.name != Path(__file__).name:
            (folder / path.name).write_bytes(path.read_bytes())
    config = _example_config()
    config["data_efficiency"]["data_sampling"]["num_workers"] = 2
    (folder / "ds_config_workers.json").write_text(json.dumps(config))


def _readme_env(folder):
    """`python`, `deepspeed`, `torchrun` as the README writes them: those of the interpreter running the tests; one
    thread a process (two launches run side by side)."""
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(folder),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        OMP_NUM_THREADS="1",
    )


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(command)``: the result of a README-style command line (``bash -c``, a free master port added), run
    in one folder that holds the project's files. Each distinct command runs once per test run, however many jobs
    ask for it (an example launch costs ~10 s): the README's chains and the example's ask for the same launches, and
    a launch that failed or hung fails every test that asks for it. ``launched.folder`` is the folder."""
    folder = tmp_path_factory.mktemp("launched")
    _copy_project(folder)
    results, locks = {}, {}

    def run(text):
        key = _command_key(text)
        with locks.setdefault(key, threading.Lock()):  # two jobs that ask at once: one runs it, the other waits
            if key not in results:
                line = re.sub(r"^(deepspeed|torchrun)\b(?!.*--master)", rf"\1 --master_port {_master_port()}", text)
                try:
                    # The folder is shared by the jobs running beside: a second run gets back the checkpoint
                    # folder the command writes (and resumes from), the one thing of the folder a command reads back.
                    checkpoints = re.search(r"--checkpoint-dir (\S+)", line)
                    restores = folder / checkpoints[1] if checkpoints else None
                    results[key] = _run(["bash", "-c", line], cwd=folder, env=_readme_env(folder), restores=restores)
                except pytest.fail.Exception as hung:  # kept: later tests that ask for it fail at once
                    results[key] = hung
        if isinstance(results[key], pytest.fail.Exception):
            raise results[key]
        return results[key]

    run.folder = folder
    return run


@pytest.mark.slow
@pytest.mark.project
@pytest.mark.parametrize("path", ["ddp", "pipeline"])
def test_example_trains_the_plan_and_the_loss_goes_down(jobs, path):
    """2 ranks, the README's commands (DDP; pipeline): every step's B, S, real tokens and LR are the plan's; the loss
    goes down; the summary counts the drops (logged once an epoch, by rank 0:
    test_drops_and_verbose_totals_are_logged_once_per_epoch_on_rank_0). (2 loader workers: the stop-and-resume test.)"""
    (result,) = jobs(f"example: {path}")
    _check_ok(result)
    steps = _steps(result.stdout)
    config = _example_config()
    expected, plans = _expected_steps(config, path == "pipeline")
    max_tokens = config["data_efficiency"]["data_sampling"]["dynamic_batching"]["max_tokens"]
    micro = config.get("train_micro_batch_size_per_gpu", 1)
    assert [s["step"] for s in steps] == list(range(1, len(expected) + 1)), (
        f"expected steps 1..{len(expected)}, got {[s['step'] for s in steps]}"
    )
    for s, (epoch, shapes, tokens, lr) in zip(steps, expected):
        assert s["epoch"] == epoch, f"step {s['step']}: epoch {s['epoch']}, expected {epoch}"
        assert list(zip(s["B"], s["S"])) == shapes, (
            f"step {s['step']}: B x S {list(zip(s['B'], s['S']))}, expected {shapes}"
        )
        assert all(n * seqlen <= micro * max_tokens for n, seqlen in shapes)  # budget="padded"
        assert s["tokens"] == tokens, f"step {s['step']}: {s['tokens']} real tokens, expected {tokens}"
        assert math.isclose(float(s["lr"]), lr, rel_tol=1e-5), (
            f"LR is wrong at step {s['step']}: expected {lr}, got {s['lr']}"
        )
    losses = [s["loss"] for s in steps]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), f"the loss did not go down: {losses}"
    summary = _SUMMARY_LINE.search(result.stdout)
    assert summary, result.stdout[-2000:]
    assert float(summary[1]) == _EPOCHS, f"the summary counts {summary[1]} epochs of {_EPOCHS}"
    assert int(summary[2]) == sum(int(p.batch_sizes.sum()) for p in plans)
    drops = {reason: sum(len(p.dropped[reason]) for p in plans) for reason in DROP_REASONS}
    assert summary[3] == " ".join(f"{reason}={count}" for reason, count in drops.items())
    progress = re.findall(r"^progress \| step (\d+)/(\d+) \| tokens/s (\d+) \| ETA ([\d.]+) s$", result.stdout, re.M)
    assert 5 <= len(progress) <= 15, f"expected a progress line about every tenth of the run, got {progress}"
    assert len(expected) - int(progress[-1][0]) <= len(expected) // 10
    assert abs(int(progress[-1][1]) - len(expected)) <= _EPOCHS
    assert all(int(tokens_per_s) > 0 for _, _, tokens_per_s, _ in progress)


@pytest.mark.slow
@pytest.mark.project
def test_example_padding_free_trains_as_its_per_token_model_padded_and_pipeline_rows_share_a_length(jobs):
    """One process (DDP path): `--padding-free` trains every step as `--per-token` does on padded step inputs of the
    same plan (the same samples, tokens and LRs; each step's loss within 1e-5, relatively, of the printed 6 digits),
    with no padding in its rows. Pipeline (2 stages): the step inputs of a batch are rows of one length, the batch's
    longest row, whose padding segment neither attention nor loss sees: the first step is the one-process run's."""
    (flat,), (padded,), (pipeline,) = (
        jobs(f"example: {mode}") for mode in ("padding-free", "per-token", "pipeline flat")
    )
    for result in (flat, padded, pipeline):
        _check_ok(result)
    flat_steps, padded_steps, pipeline_steps = _steps(flat.stdout), _steps(padded.stdout), _steps(pipeline.stdout)
    assert len(flat_steps) == len(padded_steps) > 10
    for a, b in zip(flat_steps, padded_steps):
        assert a["B"] == [1] * len(b["B"]) and sum(a["S"]) == a["tokens"] and a["padding"] == "0.0"
        assert (a["tokens"], a["lr"]) == (b["tokens"], b["lr"])
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=2e-6), (a, b)
    assert re.search(r"^summary \|.*\| padding 0\.0% \|", flat.stdout, re.M)
    assert len(pipeline_steps) > 10 and all(
        s["B"] == [1] * len(s["B"]) and len(set(s["S"])) == 1 for s in pipeline_steps
    )
    assert any(float(s["padding"]) > 0 for s in pipeline_steps)
    first = flat_steps[0]
    assert (pipeline_steps[0]["tokens"], pipeline_steps[0]["lr"]) == (first["tokens"], first["lr"])
    assert math.isclose(pipeline_steps[0]["loss"], first["loss"], rel_tol=1e-5, abs_tol=2e-6)


@pytest.mark.slow
@pytest.mark.project
@pytest.mark.parametrize("case", list(_STOPS))
def test_example_stop_and_resume_reproduces_the_uninterrupted_run(jobs, case):
    """Stopped mid-epoch and resumed (DDP as the README does it; pipeline with a loader that reads ahead), the run
    trains the same batches with the same LRs and losses."""
    path, _, stop, _ = _STOPS[case]
    (full,), (first, second) = jobs(f"example: {path}"), jobs(f"example: stopped {case}")
    for result in (full, first, second):
        _check_ok(result)
    plans, _, _, _ = _example_plans(_example_config(), path == "pipeline")
    starts = np.cumsum([0] + [p.num_batches for p in plans])  # the steps done before each epoch
    epoch = int(np.searchsorted(starts, stop, side="right")) - 1  # the epoch of step stop + 1
    assert 1 <= epoch < len(plans) and stop > starts[epoch], f"step {stop} is not mid-epoch after an epoch's end"
    assert f"at step {stop}; the sampler goes on in epoch {epoch}" in second.stdout, second.stdout[-2000:]
    expected, got = _steps(full.stdout), _steps(first.stdout) + _steps(second.stdout)
    assert [s["step"] for s in got] == [s["step"] for s in expected]
    for a, b in zip(got, expected):
        same = ("epoch", "B", "S", "tokens", "lr")
        assert [a[key] for key in same] == [b[key] for key in same], (
            f"step {a['step']} differs after resuming at step {stop}: {a} != {b}"
        )
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7), (
            f"loss is wrong at step {a['step']}: expected {b['loss']}, got {a['loss']}"
        )


def _one_process_pipeline_job():
    """The example's pipeline on one process, under the launcher and without: each finished run."""
    launcher = [*_DEEPSPEED_LAUNCHER, "--num_gpus", "1", "--master_port", str(_master_port())]
    commands = [[*launcher, "example.py", *_PATHS["pipeline"]], [sys.executable, "example.py", *_PATHS["pipeline"]]]
    return [_run(command, timeout=120) for command in commands]


@pytest.mark.slow
@pytest.mark.project
def test_example_pipeline_on_one_process_fails_at_once_with_the_command_that_works(jobs):
    """One process cannot hold 2 stages: the example says which command works, and never hangs."""
    fix = "deepspeed --num_gpus 2 example.py --pipeline-num-stages 2"
    for result in jobs("pipeline on one process"):
        assert result.returncode != 0
        assert fix in result.stderr + result.stdout, result.stderr[-2000:]
        assert "needs a multiple of 2 processes" in result.stderr + result.stdout


# The stalled job's collective timeout: short, as the test waits for it, but above the ranks' lag at start-up (their
# collectives before training wait with it too: on a busy machine one rank may lag the other by a few seconds).
_STALL_TIMEOUT_S = 5


@pytest.mark.slow
@pytest.mark.project
def test_example_a_stalled_rank_makes_the_job_fail_within_the_timeout():
    """Rank 1 frozen mid-training: rank 0 fails at its next collective after --dist-timeout, no 30-minute hang."""
    psutil = pytest.importorskip("psutil")  # a DeepSpeed dependency
    cmd = [*_DEEPSPEED_LAUNCHER, "--num_gpus", "2", "--master_port", str(_master_port()), "example.py"]
    cmd += ["--dist-timeout", str(_STALL_TIMEOUT_S), "--num-samples", "800", "--epochs", "200"]
    proc = subprocess.Popen(
        cmd,
        cwd=_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    frozen, waited, before = [], None, []
    try:
        for line in proc.stdout:  # wait until training runs
            before.append(line)
            if _STEP_LINE.match(line.strip()):
                break
        ranks = [
            p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in " ".join(p.cmdline())
        ]
        assert ranks, "rank 1's process was not found; the job before the freeze:\n" + "".join(before)[-3000:]
        for p in ranks:
            p.suspend()
            frozen.append(p)
        started = time.monotonic()
        for line in proc.stdout:
            if re.search(r"Timed out|sigkill_handler|Traceback", line):  # rank 0 gave up, or the launcher saw it
                waited = time.monotonic() - started
                break
        for p in frozen:  # a frozen process takes the launcher's SIGTERM only once it runs again
            p.resume()
        proc.stdout.read()
        proc.wait(timeout=240)
    finally:
        for p in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):  # the launcher ended it, as it should
                p.resume()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode != 0, "the job went on with a frozen rank"
    assert waited is not None and waited < 120, f"rank 0 took {waited} s to fail with --dist-timeout {_STALL_TIMEOUT_S}"
    print(f"rank 0 failed {waited:.1f} s after rank 1 froze")


# A training script written against DeepSpeed's module, in the style of DeepSpeed's example for the feature, ZeRO-1
# and the engine's own deepspeed_io() loader: its import line is the only thing varbatch changes. (DeepSpeed 0.19.8's
# own function fails on it: its DataAnalyzer crashes on CPU, and it rejects ZeRO's optimizer wrapper.)
_DEEPSPEED_STYLE_SCRIPT = """
import json
import random

import deepspeed
import torch
from torch import nn
from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the CPU comm op
deepspeed.init_distributed()


rng = random.Random(0)
sequences = [torch.ones(rng.randrange(2, 13), 4) for _ in range(200)]
dataset = [(sequence, len(sequence)) for sequence in sequences]  # (sequence, label)


def collate(batch):
    seqs, labels = zip(*batch)
    return nn.utils.rnn.pad_sequence(seqs, batch_first=True), torch.tensor(labels, dtype=torch.float32)


def seqlens(batch):
    seqs, _ = batch
    return (seqs[:, :, 0] != 0).sum(dim=1)


model = nn.Linear(4, 1)
config = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 1,
    "steps_per_print": 100000,
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "data_efficiency": {
        "enabled": True,
        "data_sampling": {
            "dynamic_batching": {
                "enabled": True,
                "max_tokens": 40,
                "metrics_path": "metrics",
                "lr_scaling_method": "linear",
                "sentence_picking_order": "seqlen",
                "max_batch_size": 10,
            },
        },
    },
}
engine, optimizer, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
dataloader, lr_scheduler, deepspeed_io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
    dataset=dataset, engine=engine, dataloader_collate_fn=collate, batch_seqlens_fn=seqlens)
engine.training_dataloader = engine.deepspeed_io(**deepspeed_io_kwargs)
lrs = []
for epoch in range(2):
    deepspeed_io_kwargs["data_sampler"].set_epoch(epoch)
    for i, (seqs, labels) in enumerate(engine.training_dataloader):
        if i % engine.gradient_accumulation_steps() == 0:
            lrs.append((engine.get_lr()[0], lr_scheduler.get_last_lr()[0]))
        loss = nn.functional.mse_loss(engine(seqs.to(engine.device)).sum(dim=(1, 2)), labels.to(engine.device))
        engine.backward(loss)
        engine.step()
if torch.distributed.get_rank() == 0:
    print("optimizer", type(engine.optimizer).__name__, flush=True)
    with open("lrs.json", "w") as file:  # a file, not stdout: the launcher's output can split long lines
        json.dump(lrs, file)
torch.distributed.destroy_process_group()  # torch 2.13 may abort at exit (SIGABRT) with a gloo group left
"""


def _deepspeed_style_job(folder):
    """The DeepSpeed-style script, its import line swapped for varbatch's, launched on 2 ranks in ``folder``: (the
    finished launch, rank 0's LRs, whether the seqlen cache is in metrics_path)."""
    script = _DEEPSPEED_STYLE_SCRIPT.replace(
        "from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import", "from varbatch import"
    )
    assert script != _DEEPSPEED_STYLE_SCRIPT
    (folder / "train.py").write_text(script)
    (folder / "varbatch.py").write_text(Path(_ROOT, "varbatch.py").read_text())
    result = _launch("train.py", [], folder)
    lrs = json.loads((folder / "lrs.json").read_text()) if result.returncode == 0 else None
    return result, lrs, (folder / "metrics" / "varbatch_seqlens.npy").exists()


@pytest.mark.slow
def test_deepspeed_style_script_runs_unchanged_on_varbatch_with_zero_stage_1(jobs):
    """A script for DeepSpeed's module runs on varbatch (import line swapped) on 2 ranks, ZeRO-1, over the engine's
    deepspeed_io() loader made from the kwargs the function returns: the seqlens computed with batch_seqlens_fn and
    cached in metrics_path, the LR in ZeRO's optimizer varbatch's (base LR x B_t / train_batch_size)."""
    result, lrs, cached = jobs("deepspeed style")
    _check_ok(result)
    assert cached, "no seqlen cache in metrics_path"
    assert "optimizer DeepSpeedZeroOptimizer" in result.stdout
    assert all(math.isclose(engine_lr, scheduler_lr) for engine_lr, scheduler_lr in lrs), lrs
    batch_sizes = [lr / 1e-3 * 4 for lr, _ in lrs]  # B_t = lr / base_lr x train_batch_size
    assert all(abs(b - round(b)) < 1e-6 and b >= 4 for b in batch_sizes), batch_sizes
    assert len({round(b) for b in batch_sizes}) > 1, "the LR never followed the batch size"


# -- README: every command and program in it runs, with the output it shows ------------------------
# ```bash blocks hold commands: each line runs (installation aside: `pip install X && cmd` runs cmd). Plain ```
# blocks whose lines start with `$ ` show a command and its exact output. ```python blocks are complete programs and
# run (one whose first line is `# run: CMD` is saved as the script CMD names, and CMD runs it, e.g. under torchrun);
# ```py blocks are fragments of a larger script and are not run. Launchers get a free master port, so runs never
# collide. The benchmark's commands run with --quick added, and the example's (those without shown output) on
# smaller sizes, since full runs take minutes: its launches on the example tests' `_SMALL_RUN`, `python example.py`
# on `_README_SMALL_EXAMPLE`. A block's steps run in order, as a reader runs them (one job); every command runs
# once per test run, through `launched`: the example tests above check the numbers of these same launches.

_README = Path(varbatch.__file__).with_name("README.md")
_README_TEST_COMMAND = "python -m pytest -q test_varbatch.py test_conformance.py"
_README_SMALL_EXAMPLE = ["--num-samples", "600", "--epochs", "3"]  # `python example.py`, which no test shares
# Recipes the tests run under _RECIPE_RECORDER, and check; the library each is about.
_README_RECIPE_NEEDS = {"hf_trainer.py": "transformers", "trl_sft.py": "trl"}
_README_RECORDED = tuple(_README_RECIPE_NEEDS)


def _readme_blocks():
    """The README's code blocks, in order, each a list of ``(kind, text, expected_output)`` for its commands and
    programs."""
    blocks = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", _README.read_text(), re.S | re.M):
        steps = []
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
            first, _, rest = body.partition("\n")
            run = re.match(r"#\s*run:\s*(.+)$", first.strip())
            steps.append(("launched", (run[1].strip(), rest), None) if run else ("program", body, None))
        elif lang == "" and body.startswith("$ "):
            for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
                command, _, output = chunk.partition("\n")
                steps.append(("command", command.strip(), output))
        blocks.append(steps)
    return blocks


def _readme_steps():
    """``(kind, text, expected_output)`` for every command and program of the README, in order."""
    return [step for block in _readme_blocks() for step in block]


@pytest.mark.project
def test_ci_runs_the_readmes_test_command():
    """Every README command that runs the whole suite (``python -m pytest`` with no ``-m`` selection) is a line of
    .ci/run: CI runs what the README tells its readers to run."""
    suite = [
        text
        for kind, text, _ in _readme_steps()
        if kind == "command" and text.startswith("python -m pytest ") and "-m" not in text.split()[3:]
    ]
    assert suite, "the README shows no command that runs the whole suite"
    ci = Path(_ROOT, ".ci", "run").read_text().splitlines()
    missing = [command for command in suite if command not in ci]
    assert not missing, f"CI does not run the README's test command: {missing}"


def _readme_chains(launched):
    """The README's commands and programs to run, as ``(command line, expected output)`` chains, one a code block, its
    steps in order (a checkpoint, then the resume; a lengths file, then its plan). A program is saved in the launch
    folder: a ``# run:`` program as the script its command names, another as readme_program_N.py."""
    chains = []
    for n, block in enumerate(_readme_blocks()):
        chain = []
        for kind, text, expected in block:
            if kind == "launched":
                text, program = text
                script = next(word for word in text.split() if word.endswith(".py"))
                if script in _README_RECORDED:
                    continue  # run under the recorder by the tests below
                if script == "lightning_recipe.py":
                    continue  # run on 2 processes by the lightning job, which checks it
                (launched.folder / script).write_text(program)
            elif kind == "program":
                (launched.folder / f"readme_program_{n}.py").write_text(text)
                text = f"python readme_program_{n}.py"
            elif text.startswith("python bench.py") and "--quick" not in text:
                text = text.replace("python bench.py", "python bench.py --quick", 1)
            elif (
                expected is None
                and re.search(r"\bexample\.py\b", text)
                and not {"--num-samples", "--epochs"} & set(text.split())
            ):
                command, hash_, comment = text.partition(" #")
                sizes = _SMALL_RUN if text.startswith("deepspeed ") else _README_SMALL_EXAMPLE  # launches: the tests'
                text = " ".join([command.rstrip(), *sizes]) + (f"  #{comment}" if hash_ else "")
            if text != _README_TEST_COMMAND:  # this suite itself
                chain.append((text, expected))
        chains.append(chain)
    return [chain for chain in chains if chain]


@pytest.mark.slow
@pytest.mark.project
def test_readme_commands_run_and_print_what_it_shows(jobs, launched):
    """Every README command exits 0 (or 2 where it shows an error) and prints exactly the output shown."""
    assert sum(kind == "command" for kind, _, _ in _readme_steps()) >= 10, "the README lost its commands"
    for i, chain in enumerate(_readme_chains(launched)):
        for (text, expected), done in zip(chain, jobs(f"readme {i}")):
            shows_error = expected is not None and expected.startswith("varbatch: error:")
            assert done.returncode == (2 if shows_error else 0), (
                f"{text!r} exited {done.returncode}:\n{done.stderr[-3000:]}"
            )
            if expected is not None:
                got = (done.stderr if shows_error else done.stdout).rstrip("\n").splitlines()
                want = expected.rstrip("\n").splitlines()
                assert [line.rstrip() for line in got] == [line.rstrip() for line in want], (
                    f"README output of {text!r} differs:\n{done.stdout}{done.stderr}"
                )


# The README's HF Trainer and TRL SFTTrainer recipes run as they are under a recorder (`python recorder.py
# RECIPE OUT`, or their `# run:` launcher with recorder.py before the script), which notes the samples of every
# step input varbatch's loader loads and the LR of every optimizer step, and saves them per rank with the plans of
# the recipe's epochs. The check: every planned sample once per epoch (rank r the plan's step inputs r, r + R, ...)
# and update n at the recipes' LR, learning_rate x HF's cosine with warmup at n x sqrt(B_b / mean B), B in real
# tokens (the Trainer's own schedule, scaled).
_RECIPE_RECORDER = textwrap.dedent("""
    import json, os, runpy, sys
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    import varbatch

    recipe, out = sys.argv[1], sys.argv[2]
    inputs, lrs = [], []
    load = varbatch._LoadStepInput.__call__

    def recording(self, keys):
        inputs.append([keys[0].epoch, list(keys[0].sample_ids)])
        return load(self, keys)

    def record_lr(optimizer, args, kwargs):  # after the optimizer's own pre-step hooks (varbatch's may write the LR)
        lrs.append([group["lr"] for group in optimizer.param_groups])

    def hook_optimizer(optimizer, args, kwargs):  # a global hook runs before those: it adds record_lr after them
        if record_lr not in optimizer._optimizer_step_pre_hooks.values():
            optimizer.register_step_pre_hook(record_lr)

    varbatch._LoadStepInput.__call__ = recording
    hook = register_optimizer_step_pre_hook(hook_optimizer)
    try:
        sys.argv = [recipe]
        run = runpy.run_path(recipe, run_name="__main__")
    finally:
        varbatch._LoadStepInput.__call__ = load
        hook.remove()
    trainer, sampler = run["trainer"], run["trainer"].sampler
    plans = [sampler.plan_for_epoch(epoch) for epoch in range(run["epochs"])]
    horizon = sum(p.num_batches for p in plans)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{sampler.rank}.json"), "w") as f:
        json.dump(dict(ranks=sampler.num_replicas, micro_batch_size=sampler.micro_batch_size, inputs=inputs,
                       gradient_accumulation_steps=sampler.gradient_accumulation_steps, lr=trainer.args.learning_rate,
                       warmup=trainer.args.get_warmup_steps(horizon), lrs=lrs,
                       plans=[dict(microbatches=p.microbatches(), batch_tokens=p.batch_tokens.tolist())
                              for p in plans], global_step=trainer.state.global_step), f)
""")


def _readme_recipe(script):
    """The ``# run:`` command and the program of the README's recipe saved as ``script``."""
    for kind, text, _ in _readme_steps():
        if kind == "launched" and script in text[0].split():
            return text
    raise AssertionError(f"the README lost its {script} recipe")


# The README's training loop (train.py) on 1 process, twice in one interpreter (`python runner.py RECIPE`): run
# through, each of its checkpoints kept; then started again in a folder that holds its second checkpoint (a run
# preempted right after it), resuming from there. A real GradScaler, turned on (the recipe turns it on with CUDA), finds an inf in the gradients of
# the batches in SKIPPED and skips their updates, as AMP does; it counts the batches in its own state, which the
# recipe checkpoints. Each run notes, per batch, whether its update was skipped, the LR its update applied, and how
# far the accumulated gradient is from the gradient of the batch's token mean (the oracle: the recipe's model, a
# Linear(4, 1), on the plan's samples of the batch, whose loss is the mean squared output over their tokens).
_LOOP_RUNNER = textwrap.dedent("""
    import json, os, runpy, shutil, sys
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    import varbatch

    recipe = os.path.abspath(sys.argv[1])
    SKIPPED = {2, 3, 25, 40, 41, 75}  # 40: the first batch after the resume
    make_dataloader, made = varbatch.make_dataloader, {}

    def recording_make_dataloader(dataset, sampler, **kwargs):
        made.update(dataset=dataset, sampler=sampler)
        return make_dataloader(dataset, sampler, **kwargs)

    def gradient_error(params, scale, b):  # the accumulated gradient against the gradient of batch b's token mean
        sampler = made["sampler"]
        per_epoch = len(sampler) // sampler.gradient_accumulation_steps
        plan, index = sampler.plan_for_epoch(b // per_epoch), b % per_epoch
        k = plan.effective_batch_size
        ids = [i for j in range(k * index, k * (index + 1)) for i in plan.microbatch(j).tolist()]
        x = torch.cat([made["dataset"][i] for i in ids])  # the batch's real tokens, T x 4
        weight, bias = (p.detach().clone().requires_grad_() for p in params)
        want = torch.autograd.grad(((x @ weight.T + bias) ** 2).mean(), (weight, bias))
        return max(float((p.grad / scale - w).abs().max() / w.abs().max()) for p, w in zip(params, want))

    class Overflowing(torch.amp.GradScaler):
        def __init__(self, device, enabled=True):
            super().__init__(device, enabled=True)
            self.batch = self.start = 0

        def step(self, optimizer):
            params = optimizer.param_groups[0]["params"]
            error = gradient_error(params, self.get_scale(), self.batch)
            if self.batch in SKIPPED:
                params[0].grad.view(-1)[0] = float("inf")
            lrs.clear()
            super().step(optimizer)
            batches.append([not lrs, lrs[0] if lrs else None])
            errors.append(error)

        def update(self, new_scale=None):
            super().update(new_scale)
            self.batch += 1

        def state_dict(self):
            return {**super().state_dict(), "batch": self.batch}

        def load_state_dict(self, state):
            state = dict(state)
            self.batch = self.start = state.pop("batch")
            super().load_state_dict(state)

    def record_lr(optimizer, args, kwargs):  # after the optimizer's own pre-step hooks (varbatch's may write the LR)
        lrs.append(optimizer.param_groups[0]["lr"])

    def hook_optimizer(optimizer, args, kwargs):
        if record_lr not in optimizer._optimizer_step_pre_hooks.values():
            optimizer.register_step_pre_hook(record_lr)

    def run(folder):
        global batches, lrs, errors
        batches, lrs, errors, saves, save = [], [], [], [], torch.save

        def saving(state, path):  # each checkpoint kept as well, as checkpoint.pt.N
            save(state, path)
            saves.append(path)
            save(state, f"{path}.{len(saves)}")

        os.makedirs(folder, exist_ok=True)
        os.chdir(folder)
        torch.amp.GradScaler, torch.save = Overflowing, saving
        varbatch.make_dataloader = recording_make_dataloader
        hook = register_optimizer_step_pre_hook(hook_optimizer)
        try:
            namespace = runpy.run_path(recipe, run_name="__main__")
        finally:
            torch.amp.GradScaler, torch.save = Overflowing.__bases__[0], save
            varbatch.make_dataloader = make_dataloader
            hook.remove()
            os.chdir("..")
        sampler, model = namespace["sampler"], namespace["model"].module
        return {
            "batches": batches,
            "errors": errors,
            "start": namespace["scaler"].start,
            "batch_tokens": [sampler.plan_for_epoch(e).batch_tokens.tolist() for e in range(namespace["epochs"])],
            "lr": namespace["optimizer"].defaults["lr"],
            "parameters": [p.tolist() for p in model.parameters()],
        }

    runs = {"full": run("full")}
    os.makedirs("resumed")  # a run stopped right after its second checkpoint, started again
    shutil.copy("full/checkpoint.pt.2", "resumed/checkpoint.pt")
    runs["resumed"] = run("resumed")
    with open("runs.json", "w") as f:
        json.dump(runs, f)
""")


@pytest.mark.project
def test_readme_training_loop_tells_amp_skips_weights_and_resumes_exactly(tmp_path):
    """The README's training loop (1 process, loader workers, a train-set side pass every 20 batches): every
    planned batch once, each update's gradient the gradient of its batch's token mean (the loss weights), AMP's
    skipped updates told (each applied update at the cosine of the updates applied before it x sqrt(batch tokens /
    the epoch's mean)); stopped after a checkpoint and started again, it trains the rest exactly as the
    uninterrupted run (the same LRs, skips, gradients and final parameters, bit for bit)."""
    command, program = _readme_recipe("train.py")
    assert command == "torchrun --nproc_per_node 2 train.py", command
    (tmp_path / "train.py").write_text(program)
    (tmp_path / "runner.py").write_text(_LOOP_RUNNER)
    env = dict(os.environ, PYTHONPATH=_ROOT, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(_master_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", CUDA_VISIBLE_DEVICES="")
    done = _run([sys.executable, "runner.py", "train.py"], timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    runs = json.loads((tmp_path / "runs.json").read_text())
    full, resumed = runs["full"], runs["resumed"]
    planned = [tokens for epoch in full["batch_tokens"] for tokens in epoch]
    means = [np.mean(epoch) for epoch in full["batch_tokens"] for _ in epoch]
    assert len(full["batches"]) == len(planned), f"{len(full['batches'])} batches trained, {len(planned)} planned"
    skipped = [b for b, (skip, _) in enumerate(full["batches"]) if skip]
    assert skipped == [2, 3, 25, 40, 41, 75]
    assert max(full["errors"]) < 1e-5 and max(resumed["errors"]) < 1e-5, "the gradient is not the batch mean's"
    updates = 0
    for b, (skip, lr) in enumerate(full["batches"]):
        if skip:
            continue
        cosine = 0.5 * (1 + math.cos(math.pi * updates / len(planned)))
        assert lr == pytest.approx(full["lr"] * cosine * math.sqrt(planned[b] / means[b]), rel=1e-9), f"batch {b}"
        updates += 1
    assert resumed["start"] == 40
    assert resumed["batches"] == full["batches"][40:], "the resumed run is not the rest of the uninterrupted one"
    assert resumed["errors"] == full["errors"][40:]
    assert resumed["parameters"] == full["parameters"]


def _hf_cosine(step, warmup, total):
    """HF's ``lr_scheduler_type="cosine"`` factor at ``step`` (transformers' get_cosine_schedule_with_warmup)."""
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _check_recipe_records(out):
    """The recorded ranks of a recipe's run (see _RECIPE_RECORDER) against its plans; returns them by rank."""
    ranks = [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]
    assert ranks and len(ranks) == ranks[0]["ranks"], f"{len(ranks)} ranks recorded"
    plans, mbs = ranks[0]["plans"], ranks[0]["micro_batch_size"]
    horizon = sum(len(plan["batch_tokens"]) for plan in plans)
    for rank, record in enumerate(ranks):
        n = 0
        for epoch, plan in enumerate(plans):
            micro = plan["microbatches"]
            step_inputs = [[i for ids in micro[j : j + mbs] for i in ids] for j in range(0, len(micro), mbs)]
            got = [ids for e, ids in record["inputs"] if e == epoch]
            assert got == step_inputs[rank :: len(ranks)], f"rank {rank} epoch {epoch}: not the plan's step inputs"
            mean = np.mean(plan["batch_tokens"])
            for b, tokens in enumerate(plan["batch_tokens"]):
                want = record["lr"] * _hf_cosine(n, record["warmup"], horizon) * math.sqrt(tokens / mean)
                assert record["lrs"][n] == pytest.approx([want] * len(record["lrs"][n]), rel=1e-9), (
                    f"rank {rank} epoch {epoch} update {b}: LR {record['lrs'][n]}, planned {want}"
                )
                n += 1
        assert len(record["lrs"]) == n, f"rank {rank}: {len(record['lrs'])} updates, {n} planned"
    for epoch, plan in enumerate(plans):  # the ranks' shares make the whole epoch
        trained = sorted(i for record in ranks for e, ids in record["inputs"] if e == epoch for i in ids)
        assert trained == sorted(i for ids in plan["microbatches"] for i in ids), (
            f"epoch {epoch}: not every sample once"
        )
    return ranks


def _resume_inside_epoch_1(out, per_epoch):
    """Deletes the checkpoints in ``out`` after the last one inside epoch 1 (past its first update): the recipe
    started again resumes there, by the Trainer's own skip of the epoch's trained step inputs. Returns its step."""
    steps = sorted(int(path.name.split("-")[1]) for path in Path(out).glob("checkpoint-*"))
    inside = [step for step in steps if per_epoch < step < 2 * per_epoch]
    assert inside, f"no checkpoint inside epoch 1 ({per_epoch} updates an epoch) among {steps}: nothing to skip"
    for step in steps:
        if step > inside[-1]:
            shutil.rmtree(Path(out) / f"checkpoint-{step}")
    return inside[-1]


@pytest.mark.slow
@pytest.mark.project
@pytest.mark.parametrize("script", _README_RECORDED)
def test_readme_hf_recipes_on_two_processes(jobs, script):
    """The README's HF Trainer and TRL recipes under their `# run:` command (2 processes; the first part of the HF
    job): every planned sample once per epoch, each rank its share, at the plan's LRs."""
    pytest.importorskip(_README_RECIPE_NEEDS[script])
    done, folder = jobs("hf")
    records = folder / script.removesuffix(".py") / "records"
    assert records.is_dir(), f"{script} did not finish:\n{done.stderr[-3000:]}"
    assert len(_check_recipe_records(records)) == 2


# -- launchers: HF Accelerate and Lightning ---------------------------------------------
# Each runs 2 real CPU ranks (torchrun, or Lightning's devices=2) on 160 samples whose sample i is a tensor filled with
# i + 1, records the sample ids and the LR of every step input, and compares the union over the ranks with the plan:
# every planned sample once, optimizer step b trains the plan's batch b, at LR base_lr x B_b / mean(B).

BASE_LR, MAX_TOKENS, N = 0.1, 72, 160
LENS = np.random.default_rng(0).integers(4, 41, N).tolist()  # the workers' seqlens (COMMON's LENS)
# A seed whose packings of the Lightning job's 4 epochs (1 micro-batch per step input, no accumulation) differ in
# length: a loop that read len() in another epoch would cut one, were the epochs not made one length.
SEED = _packings_differ(
    LENS, MAX_TOKENS, range(4), budget="padded", order="random", effective_batch_size=2, num_replicas=2
)


def _plan(epoch, mbs, gas):
    """Rank 0's plan of ``epoch`` as the workers' sampler makes it."""
    options = dict(budget="padded", order="random", seed=SEED, micro_batch_size=mbs, gradient_accumulation_steps=gas)
    return VariableBatchSampler(LENS, MAX_TOKENS, num_replicas=2, rank=0, **options).plan_for_epoch(epoch)


# The pieces every worker script shares: data, sampler (seeded by SEED, as `_plan`), recording.
COMMON = f"SEED = {SEED}\n" + textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import torch
    import varbatch
    torch.set_num_threads(1)
    OUT, OPTS = sys.argv[1], json.loads(sys.argv[2])
    MBS, GAS, EPOCHS = OPTS.get("mbs", 1), OPTS.get("gas", 1), OPTS.get("epochs", 2)
    LENS = np.random.default_rng(0).integers(4, 41, 160).tolist()

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(LENS)
        def __getitem__(self, i):
            return torch.full((LENS[i],), float(i + 1))

    def make_sampler():
        return varbatch.VariableBatchSampler(LENS, 72, budget="padded", order="random", seed=SEED,
                                             micro_batch_size=MBS, gradient_accumulation_steps=GAS)

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of(model, batch):
        return model(batch[0].unsqueeze(-1)).pow(2).mean() * 1e-6

    RECORDS = []
    def record(epoch, step, batch, lr):
        RECORDS.append([int(epoch), int(step), [int(v) - 1 for v in batch[0][:, 0].tolist()], float(lr)])

    def save(rank, **extra):
        json.dump(dict(records=RECORDS, **extra), open(os.path.join(OUT, f"rank{rank}.json"), "w"))
""")

ACCELERATE = COMMON + textwrap.dedent("""
    from accelerate import Accelerator, DataLoaderConfiguration

    def train(opts):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS, dataloader_config=DataLoaderConfiguration(
            split_batches=opts.get("split_batches", False), dispatch_batches=opts.get("dispatch_batches"),
            even_batches=opts.get("even_batches", True)))
        rank = accelerator.process_index
        sampler = make_sampler()
        loader = varbatch.make_dataloader(Data(), sampler, collate_fn=varbatch.PaddedCollate())
        model, optimizer = model_and_optimizer()
        raw_optimizer = optimizer
        scheduler = varbatch.VariableBatchSizeLR(optimizer, "mean", sampler)
        try:
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            for epoch in range(EPOCHS):
                loader.set_epoch(epoch)
                step = 0
                for batch in loader:
                    with accelerator.accumulate(model):
                        record(epoch, step, batch, raw_optimizer.param_groups[0]["lr"])
                        accelerator.backward(loss_of(model, batch))
                        optimizer.step()
                        if accelerator.sync_gradients:
                            scheduler.step()
                        optimizer.zero_grad()
                    step += accelerator.sync_gradients
        except Exception as error:
            save(rank, error=f"{type(error).__name__}: {error}")
            raise
        save(rank)

    # OPTS["runs"]: [name, options] of runs one after another in these processes (one start-up for all), each saving
    # into OUT/name; a run that raises ends the job.
    BASE = OUT
    for name, opts in OPTS["runs"]:
        MBS, GAS, OUT = opts.get("mbs", 1), opts.get("gas", 1), os.path.join(BASE, name)
        os.makedirs(OUT, exist_ok=True)
        RECORDS.clear()
        train(opts)
""")


LIGHTNING = COMMON + textwrap.dedent("""
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model_and_optimizer()[0]
        def setup(self, stage):
            self.sampler = make_sampler()  # torch.distributed is up: the ranks come from it
        def train_dataloader(self):
            return varbatch.make_dataloader(Data(), self.sampler, collate_fn=varbatch.PaddedCollate())
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = varbatch.VariableBatchSizeLR(optimizer, "mean", self.sampler)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        def training_step(self, batch, batch_idx):
            record(self.current_epoch, batch_idx // GAS, batch, self.trainer.optimizers[0].param_groups[0]["lr"])
            return loss_of(self.net, batch)

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, accumulate_grad_batches=GAS,
                         reload_dataloaders_every_n_epochs=1, enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Module())
    except Exception as error:
        save(trainer.global_rank, error=f"{type(error).__name__}: {error}")
        raise
    save(trainer.global_rank)
    # The README's Lightning recipe as it is, on these 2 processes (Lightning launched them).
    import runpy
    runpy.run_path(OPTS["recipe"], run_name="__main__")
    open(os.path.join(OUT, f"recipe{torch.distributed.get_rank()}.done"), "w").close()
""")

STATEFUL = COMMON + textwrap.dedent("""
    import copy
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state_path = os.path.join(OUT, f"state{rank}.pt")

    def build(state=None):
        \"\"\"A fresh sampler, loader (its own worker processes), model, optimizer and scheduler; restored from
        the checkpoint file's ``state`` if given, as a new process would build them.\"\"\"
        sampler = make_sampler()
        loader = varbatch.make_dataloader(Data(), sampler, collate_fn=varbatch.PaddedCollate(),
                                          num_workers=OPTS.get("workers", 0), dataloader_class=StatefulDataLoader,
                                          batch_count="tokens")
        model, optimizer = model_and_optimizer()
        scheduler = varbatch.VariableBatchSizeLR(optimizer, "mean", sampler)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            loader.load_state_dict(state["loader"])
            for parameter, grad in zip(model.parameters(), state["grads"]):  # a batch cut by the checkpoint
                parameter.grad = grad
        return sampler, loader, model, optimizer, scheduler

    def token_mean(model, step_input):
        \"\"\"The loss averaged over the step input's real tokens, and their number.\"\"\"
        x, lengths = step_input
        mask = torch.arange(x.shape[1]) < lengths[:, None]
        return (model(x.unsqueeze(-1)).squeeze(-1).pow(2) * mask).sum() / mask.sum() * 1e-6, mask.sum()

    GRAD_ERRORS = []
    def check_gradient(model, sampler, batch, b):
        \"\"\"Averages the gradient over the ranks (as DDP does) and notes how far it is from the gradient of the
        token mean of the epoch's batch b, from the plan.\"\"\"
        grads = [p.grad for p in model.parameters()]
        for grad in grads:
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        plan, k = sampler.plan_for_epoch(batch.epoch), sampler.effective_batch_size
        ids = plan.sample_ids[plan.microbatch_offsets[b * k]:plan.microbatch_offsets[(b + 1) * k]].tolist()
        reference = copy.deepcopy(model)
        reference.zero_grad()
        token_mean(reference, varbatch.PaddedCollate()([Data()[i] for i in ids]))[0].backward()
        want = torch.cat([p.grad.flatten() for p in reference.parameters()])
        GRAD_ERRORS.append(float((torch.cat([g.flatten() for g in grads]) - want).norm() / want.norm()))

    def run(sampler, loader, model, optimizer, scheduler, start_epoch=0, stop_after=None):
        \"\"\"The loop the records steer: each step input's loss weighted by its batch's token count, the update
        after the batch's last step input, the scheduler told the batch; a checkpoint file after ``stop_after``
        step inputs.\"\"\"
        trained = 0
        for epoch in range(start_epoch, EPOCHS):
            sampler.set_epoch(epoch)
            for step_input, batch in loader:
                b = batch.index - batch.epoch * (len(sampler) // GAS)  # the batch's place in its epoch
                record(batch.epoch, b, step_input, optimizer.param_groups[0]["lr"])
                loss, tokens = token_mean(model, step_input)
                (loss * varbatch.micro_batch_loss_weight(tokens, batch.count, num_replicas=2)).backward()
                trained += 1
                if batch.last:
                    check_gradient(model, sampler, batch, b)
                    optimizer.step()
                    scheduler.step(batch)
                    optimizer.zero_grad()
                if trained == stop_after:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                                "grads": [p.grad for p in model.parameters()], "epoch": epoch}, state_path)
                    return

    # Stopped after stop_after step inputs (checkpoint saved to a file), then every object dropped (the loader's
    # workers end) and the run resumed from the file alone by objects built afresh: the restore a new process does.
    run(*build(), stop_after=OPTS["stop_after"])
    state = torch.load(state_path, weights_only=False)
    run(*build(state), start_epoch=state["epoch"])
    save(rank, grad_errors=GRAD_ERRORS)
    dist.barrier()
    dist.destroy_process_group()
""")


def _launch_ranks(tmp_path, source, opts, *, torchrun=True, timeout=180):
    """Runs ``source`` on 2 ranks; returns (returncode, output, records per rank, errors per rank)."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=_ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(script), str(out), json.dumps(opts)]
    if torchrun:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", str(_master_port())]
    else:  # Lightning starts the second rank itself
        env.update(MASTER_PORT=str(_master_port()))
    done = _run(cmd, timeout=timeout, cwd=tmp_path, env=env)
    records, errors = _saved_ranks(out)
    return done.returncode, done.stdout + done.stderr, records, errors


def _saved_ranks(out):
    """(records per rank, errors of the ranks that saved) from the files a worker's ranks saved into ``out``."""
    ranks = [
        json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None for r in range(2)
    ]
    return [r["records"] if r else [] for r in ranks], [r.get("error") for r in ranks if r]


def _check_against_plan(records, *, mbs, gas, epochs):
    """Every planned sample once per epoch; step b trains the plan's batch b at base_lr x B_b / mean(B)."""
    for epoch in range(epochs):
        plan = _plan(epoch, mbs, gas)
        k = plan.effective_batch_size
        mine = [r for rank in records for r in rank if r[0] == epoch]
        trained = sorted(i for r in mine for i in r[2])
        assert trained == sorted(plan.sample_ids.tolist()), (
            f"epoch {epoch}: {len(set(trained))} distinct of {len(plan.sample_ids)} planned samples trained, "
            f"{len(trained) - len(set(trained))} twice"
        )
        for b in range(plan.num_batches):
            step = [r for r in mine if r[1] == b]
            want = sorted(i for j in range(b * k, (b + 1) * k) for i in plan.microbatch(j).tolist())
            assert sorted(i for r in step for i in r[2]) == want, f"epoch {epoch} step {b}: not the plan's batch"
            expected = BASE_LR * plan.batch_sizes[b] / plan.batch_sizes.mean()
            assert all(r[3] == pytest.approx(expected, rel=1e-9) for r in step), (
                f"epoch {epoch} step {b}: LR {sorted({r[3] for r in step})}, planned {expected}"
            )


# -- HF Accelerate -------------------------------------------------------------------------------


# One Accelerate job on 2 ranks for the two tests below: the trained run, then (same processes, one start-up)
# dispatch_batches, refused on rank 0 at its first batch (the job ends there: rank 1 waits for rank 0's broadcast).
_ACCELERATE_RUNS = [
    ["prepare", {"mbs": 2, "gas": 2, "even_batches": True}],
    ["dispatch_batches", {"dispatch_batches": True}],
]


def _accelerate_job(folder):
    """The Accelerate job of ``_ACCELERATE_RUNS``: (exit code, output, {run name: (records, errors)})."""
    pytest.importorskip("accelerate")
    rc, output, _, _ = _launch_ranks(folder, ACCELERATE, {"runs": _ACCELERATE_RUNS})
    return rc, output, {name: _saved_ranks(folder / "out" / name) for name, _ in _ACCELERATE_RUNS}


@pytest.mark.slow
def test_accelerate_prepare_trains_every_planned_sample_once(jobs):
    """HF Accelerate's prepare() on varbatch's loader: every planned sample once, the plan's batches and LRs."""
    _, output, runs = jobs("accelerate")
    records, errors = runs["prepare"]
    assert errors == [None, None], (errors, output[-3000:])  # both ranks saved after their loop ended
    _check_against_plan(records, mbs=2, gas=2, epochs=2)


@pytest.mark.slow
def test_accelerate_dispatch_batches_which_redeals_is_refused_at_the_first_batch(jobs):
    """dispatch_batches=True, which re-deals the loader's step inputs from rank 0, stops at once, naming the
    setting."""
    rc, output, runs = jobs("accelerate")
    records, errors = runs["dispatch_batches"]
    assert rc != 0  # the refusal ended the job
    assert errors and all(error is not None for error in errors), (errors, output[-2000:])  # no rank ran on
    assert any("dispatch_batches=False" in (error or "") for error in errors), (errors, output[-2000:])
    assert sum(len(r) for r in records) <= 4, "trained on after the first batch"


# The HF runs on 2 processes, one torchrun job (torch and transformers imported once): the README's HF recipes as
# they are under the recorder (its `# run:` command with recorder.py before the script), each in its folder
# OUT/<recipe>, recorded into OUT/<recipe>/records; then the HF recipe started again after its checkpoints past one
# inside epoch 1 were deleted: it resumes there, by the Trainer's own skip over the prepared loader (OUT/hf_trainer/
# resumed, and resumed_from, the checkpoint's step).
_HF_TWO_PROCESS_SCRIPT = """
import json, os, runpy, sys, pathlib, torch
base = pathlib.Path(sys.argv[1])


def record(script, out):
    os.chdir(base / script.removesuffix(".py"))
    sys.argv = ["recorder.py", script, out]
    runpy.run_path("recorder.py", run_name="__main__")


recipes = sys.argv[2:]
for script in recipes:  # the README's recipes: the Trainer's Accelerator sets up the processes
    record(script, "records")
if "hf_trainer.py" in recipes:
    import test_varbatch as T
    folder = base / "hf_trainer"
    if torch.distributed.get_rank() == 0:
        per_epoch = len(json.loads((folder / "records" / "rank0.json").read_text())["plans"][0]["batch_tokens"])
        (folder / "resumed_from").write_text(str(T._resume_inside_epoch_1(folder / "out", per_epoch)))
    torch.distributed.barrier()
    record("hf_trainer.py", "resumed")
torch.distributed.destroy_process_group()
"""


def _hf_two_process_job(tmp_path):
    """The job of ``_HF_TWO_PROCESS_SCRIPT`` (the README's recipes whose libraries are installed) in ``tmp_path``:
    (finished process, the job's folder)."""
    pytest.importorskip("transformers")
    recipes = [script for script in _README_RECORDED if importlib.util.find_spec(_README_RECIPE_NEEDS[script])]
    for script in recipes:
        command, program = _readme_recipe(script)
        assert command == f"torchrun --nproc_per_node 2 {script}", command  # the job's launch
        folder = tmp_path / script.removesuffix(".py")
        folder.mkdir()
        (folder / script).write_text(program)
        (folder / "recorder.py").write_text(_RECIPE_RECORDER)
    script = tmp_path / "job.py"
    script.write_text(_HF_TWO_PROCESS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=_ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port"]
    done = _run([*command, str(_master_port()), str(script), str(tmp_path), *recipes], cwd=tmp_path, env=env)
    return done, tmp_path


# -- Lightning -----------------------------------------------------------------------------------


def _lightning_job(tmp_path):
    """One Lightning job on 2 ranks (its start-up is most of a run's time): a Trainer that reloads the loader every
    epoch trains 4 epochs, whose packings differ in length (see SEED), then the README's Lightning recipe runs in the
    same processes. Returns (exit code, output, records, errors, the ranks whose recipe run returned)."""
    pytest.importorskip("pytorch_lightning")
    command, program = _readme_recipe("lightning_recipe.py")
    assert command == "python lightning_recipe.py", command  # Lightning starts the second process itself, as here
    (tmp_path / "lightning_recipe.py").write_text(program)
    opts = {"epochs": 4, "recipe": str(tmp_path / "lightning_recipe.py")}
    rc, output, records, errors = _launch_ranks(tmp_path, LIGHTNING, opts, torchrun=False)
    return rc, output, records, errors, [r for r in (0, 1) if (tmp_path / "out" / f"recipe{r}.done").exists()]


@pytest.mark.slow
@pytest.mark.project
def test_lightning_ddp_trains_every_planned_sample_once_and_runs_the_readmes_recipe(jobs):
    """Lightning DDP reloading its loader every epoch: every planned sample once in each epoch, each step the plan's
    batch at its LR. Then the README's Lightning recipe runs as it is on those 2 processes (the README test leaves
    it to this job)."""
    rc, output, records, errors, recipe_done = jobs("lightning")
    # Each rank saves after its fit() returned: the Trainer's fit ended without an error on both ranks.
    assert errors == [None, None], (errors, output[-3000:])
    _check_against_plan(records, mbs=1, gas=1, epochs=4)
    assert rc == 0 and recipe_done == [0, 1], output[-3000:]


@pytest.mark.slow
def test_lightning_rebuilding_the_loader_is_refused():
    """If Lightning ever re-shards varbatch's loader (its predict path does), iterating it raises."""
    pytest.importorskip("pytorch_lightning")
    from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
    from pytorch_lightning.utilities.data import _update_dataloader

    sampler = varbatch.VariableBatchSampler(LENS, MAX_TOKENS, num_replicas=2, rank=1)
    loader = varbatch.make_dataloader(list(range(N)), sampler)
    rebuilt = _update_dataloader(loader, DistributedSamplerWrapper(loader.sampler, num_replicas=2, rank=1))
    with pytest.raises(RuntimeError, match="use_distributed_sampler=False"):
        next(iter(rebuilt))


# -- torchdata StatefulDataLoader ----------------------------------------------------------------


def _stateful_job(folder):
    """The StatefulDataLoader worker (2 loader workers, 2 accumulation steps, the checkpoint after step input 57, an
    odd count: it cuts a batch) on 2 ranks: (exit code, output, records, each rank's gradient errors)."""
    pytest.importorskip("torchdata")
    rc, output, records, _ = _launch_ranks(folder, STATEFUL, {"gas": 2, "workers": 2, "stop_after": 57})
    saved = [folder / "out" / f"rank{rank}.json" for rank in range(2)]
    return rc, output, records, [json.loads(path.read_text())["grad_errors"] for path in saved if path.exists()]


@pytest.mark.slow
def test_stateful_dataloader_resumes_exactly(jobs):
    """StatefulDataLoader with workers on 2 ranks, stopped mid-epoch inside an accumulation step with a checkpoint
    file and resumed from that file by a loader, sampler and scheduler built afresh (in the same processes: varbatch
    keeps no state outside its objects), the loop steered by the Batch records: the ranks train the plan exactly once
    at its LRs, and every update's gradient, averaged over the ranks, is its batch's token mean's (the cut batch's
    too)."""
    rc, output, records, grad_errors = jobs("stateful")
    assert rc == 0, output[-3000:]
    _check_against_plan(records, mbs=1, gas=2, epochs=2)
    for rank, errors in enumerate(grad_errors):
        assert len(errors) == len(_plan(0, 1, 2).batch_sizes) + len(_plan(1, 1, 2).batch_sizes), len(errors)
        # float32 sums over a batch: 1e-4 relative is rounding, a batch weighted with another's count is off by 0.1 to 1
        assert max(errors) < 1e-4, f"rank {rank}: gradients off their batch's token mean's by up to {max(errors):.2g}"


@pytest.mark.slow
@pytest.mark.project
def test_readme_hf_recipe_resumes_inside_an_epoch_on_two_processes(jobs):
    """The README's HF Trainer recipe on 2 processes (the second part of the HF job), started again after its
    checkpoints past one inside epoch 1 were deleted: each rank trains the rest of its step inputs at the first run's
    LRs, by the Trainer's own skip over the prepared loader."""
    done, folder = jobs("hf")
    resumed = folder / "hf_trainer" / "resumed"
    assert resumed.is_dir(), f"the resumed run did not finish:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-3000:]
    updates = int((folder / "hf_trainer" / "resumed_from").read_text())  # before the resume
    for rank, first in enumerate(_check_recipe_records(folder / "hf_trainer" / "records")):
        again = json.loads((resumed / f"rank{rank}.json").read_text())
        rest = first["inputs"][updates * first["gradient_accumulation_steps"] :]
        assert again["inputs"] == rest, f"rank {rank}, resumed after {updates} updates: not the rest of the run"
        assert np.array(again["lrs"]) == pytest.approx(np.array(first["lrs"][updates:]), rel=1e-12), "LRs differ"
        assert again["global_step"] == first["global_step"]
