"""Study: time to reach a fixed-batch baseline's loss, per batching and LR rule.

People switch to token budgets to reach a given model quality sooner on the same
memory. A comparison at a fixed token count (bench.py, section 3) hides that: a
token budget takes fewer, larger optimizer steps per token. This study trains a
small causal language model on variable-length text and measures the *training
time* each way of batching needs to reach the loss that a tuned fixed-batch
baseline reaches in its time budget. Every arm has the same peak padded tensor,
``B0 x L_max = max_tokens`` slots:

  (a) fixed batch of B0 samples in random order, padded to the longest; its LR
      is tuned over a small grid (on the first seed) and the best one is kept;
  (b) fixed B0, grouped by length (megabatches of 50 x B0 shuffled samples,
      sorted by length: the "group by length" option of common trainers);
  (c) varbatch, budget="padded", order="bucket", with the LR rules none, sqrt
      and linear, in sequences (B_ref = B0) and in tokens (B_ref = the
      baseline's mean real tokens per batch), all from (a)'s tuned LR;
  (d) DeepSpeed's own module with its defaults (sum budget, dataloader order,
      reference batch size = train_batch_size, linear rule), same max_tokens;
  (e) varbatch padding-free: each batch one flat row of at most max_tokens
      tokens (sum budget, random order), positions restarting at each sample,
      attention sample by sample (as a varlen kernel), sqrt in tokens as (c):
      the same loss per token as a padded batch of the same samples;
  (f) R = B0 data-parallel ranks simulated on the one process, each with a
      budget of L_max slots (so a batch holds at most max_tokens, as every
      arm's step): varbatch as (c) with num_replicas=R, sqrt in tokens, the
      gradients of a batch's R step inputs summed in plan order as R ranks'
      would be;
  (g) the same with balance_ranks=True (issue 30), quadratic_tokens from the
      README's rule of thumb: the same step inputs regrouped so that each
      reduction meets step inputs of nearly equal cost. The ranks' idle time
      is not simulated (the time is the R step inputs' sum on one process):
      the race asks whether the regrouping costs convergence, not what it
      saves at the reduction.

Two data sets: functions of the Python standard library's source as bytes
(real text, no download), and synthetic arithmetic progressions with lognormal
lengths. Validation loss is taken at 12 even marks of *training* time (the
clock stops while evaluating). Training time is the process's CPU time with one
torch thread by default (--clock wall for the wall clock): on a shared machine
it is the time the steps need, whatever else runs. Arms of one seed run
interleaved, so what remains of machine noise hits all of them alike.

The default budgets are short (6 and 4 s of training, a few hundred optimizer
steps), so that three seeds of every arm fit in minutes; the real tokens a
token budget needs to reach a loss depend on how far training has gone, so a
longer ``--budget-seconds`` shows how the comparison moves with the horizon.

Usage:
    python study.py                    # full study (minutes), tables on stdout, study.png
    python study.py --quick            # smoke form in seconds (CI), no figure
    python study.py --json study.json  # also the raw numbers
    python study.py --seeds 5 --budget-seconds 12 --datasets stdlib

Progress goes to stderr, markdown tables to stdout. Nothing asserts a time: the
"Targets" table reports each target next to its measurement. DeepSpeed and
matplotlib are optional: without DeepSpeed arm (d) is left out; matplotlib is
imported only to draw the figure (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import hashlib
import importlib.util
import itertools
import json
import math
import os
import sys
import sysconfig
import textwrap
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

import varbatch
from bench import _plan_idle, _table, machine_description  # the benchmark's report helpers and idle share

_HERE = os.path.dirname(os.path.abspath(__file__))
_START = time.perf_counter()

BOS = 256  # the token before every sample's first byte
VOCAB = 257  # 256 byte values + BOS; padding reuses byte 0 (masked out everywhere)
GROUP_MEGABATCH = 50  # arm (b): megabatch = 50 x B0 samples, as HF's LengthGroupedSampler
CLIP_NORM = 1.0  # gradient clipping, the common default of trainers
BETAS = (0.9, 0.95)  # AdamW betas usual for language models
WEIGHT_DECAY = 0.01
DATASETS = ("stdlib", "synthetic")
RULES = ("none", "sqrt", "linear")
UNITS = ("sequences", "tokens")
# What a training second is (--clock). CPU time of the process: with one torch
# thread it is the time the step needs, unaffected by other processes taking the
# core meanwhile (see NOTE [which clock] in `race`).
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
CLOCK_WORDS = {"cpu": "CPU time of the process (time.process_time)", "wall": "wall clock (time.perf_counter)"}


@dataclasses.dataclass(frozen=True)
class Setup:
    """Sizes of one study run: model, batching, data and time budget."""

    layers: int
    dim: int
    heads: int
    max_seqlen: int  # L_max: samples are truncated to it (BOS included)
    batch_size: int  # B0 of arms (a) and (b); max_tokens = B0 x L_max
    num_train: int
    num_val: int
    budget_seconds: dict  # data set -> training seconds of every arm ((a)'s time budget)
    num_evals: int  # validation points per run, evenly spaced in training time
    lr_grid: tuple  # the LRs tried for arm (a)
    seeds: int

    @property
    def max_tokens(self) -> int:
        return self.batch_size * self.max_seqlen

    @property
    def simulated_ranks(self) -> int:
        """R of arms (f) and (g): B0 ranks of L_max slots each hold a batch of at most max_tokens slots."""
        return self.batch_size

    @property
    def quadratic_tokens(self) -> int:
        """q of arm (g): the README's rule of thumb, 6 x E, for attention that computes all of S x S (a mask here,
        no causal kernel). The timing recipe in BENCHMARKS.md (long 256, short 8 to 32) measured 330 to 780 on the full study's
        model, median about 650 (its LM head adds linear work): the rule errs low, the side the README advises."""
        return 6 * self.dim


# The full study takes about 9 minutes on a 2-core CPU (more when other work
# shares it: training time is CPU time, the wall clock stretches around it):
# per data set, the LR grid (one seed) plus 11 arms per seed, each trained for
# budget_seconds.
FULL = Setup(
    layers=2,
    dim=64,
    heads=4,
    max_seqlen=256,
    batch_size=8,
    num_train=2000,
    num_val=64,
    budget_seconds={"stdlib": 6.0, "synthetic": 4.0},
    num_evals=12,
    lr_grid=(4e-3, 8e-3, 1.6e-2, 3.2e-2),
    seeds=3,
)
# The smoke form: same code path, tiny sizes, one seed.
QUICK = Setup(
    layers=1,
    dim=32,
    heads=2,
    max_seqlen=64,
    batch_size=4,
    num_train=160,
    num_val=32,
    budget_seconds={"stdlib": 0.4, "synthetic": 0.4},
    num_evals=4,
    lr_grid=(2e-3, 8e-3),
    seeds=1,
)


# =============================================================================
# Helpers: progress, formatting, machine
# =============================================================================


def _progress(message: str) -> None:
    print(f"[study {time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


def _median(values) -> float:
    """The median, with inf (not reached) ordered last; nan for no values."""
    values = [v for v in values if not math.isnan(v)]
    return float(np.median(values)) if values else float("nan")


def _spread(values, fmt: str = "{:.3g}", unit: str = "") -> str:
    """``median [min, max]`` over seeds; inf (not reached) prints as '-'."""

    def one(v):
        return "-" if not math.isfinite(v) else fmt.format(v) + unit

    values = list(values)
    if len(values) == 1:
        return one(values[0])
    return f"{one(_median(values))} [{one(min(values))}, {one(max(values))}]"


def _deepspeed_module():
    """DeepSpeed's variable-batch module, or None when DeepSpeed is not installed.

    Only its pure-Python planner, dataloader and LR scheduler are used: nothing
    is compiled and no accelerator is needed.
    """
    if importlib.util.find_spec("deepspeed") is None:
        return None
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # only pure-Python code is used; no warning on stdout
    from deepspeed.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr

    return variable_batch_size_and_lr


# =============================================================================
# Data: standard-library functions as bytes, and synthetic progressions
# =============================================================================
# Every sample is a 1-D int64 tensor: BOS, then its tokens; its seqlen counts
# BOS, and the loss predicts every token after BOS. Both sets are fixed by the
# code (no seed): every seed of the study trains on the same split.

_STDLIB_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
SYN_LOGNORMAL_MEAN, SYN_LOGNORMAL_SIGMA = 3.9, 0.8  # median ~50 tokens
SYN_MODULUS = 64


def stdlib_functions(count: int, max_seqlen: int) -> list[torch.Tensor]:
    """``count`` distinct functions of the standard library's source, as BOS + UTF-8 bytes.

    Files are read in a fixed pseudo-random order (a hash of their path), so the
    first ``count`` functions mix many modules and are the same on every run of
    one Python installation. Each function (methods and nested ones included)
    is dedented and truncated to ``max_seqlen`` tokens.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        paths += [os.path.join(dirpath, name) for name in filenames if name.endswith(".py")]
    paths.sort(key=lambda p: hashlib.sha1(os.path.relpath(p, root).encode()).hexdigest())
    seen, samples = set(), []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                text = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
                if text in seen:
                    continue
                seen.add(text)
                data = list(text.encode("utf-8")[: max_seqlen - 1])
                samples.append(torch.tensor([BOS, *data], dtype=torch.int64))
                if len(samples) == count:
                    return samples
    raise RuntimeError(
        f"the standard library at {root} holds only {len(samples)} distinct functions, but the "
        f"study needs {count}; run with --datasets synthetic"
    )


def synthetic_progressions(count: int, max_seqlen: int) -> list[torch.Tensor]:
    """Arithmetic progressions mod 64 with lognormal lengths (median ~50, clipped to 8..max_seqlen).

    Each sample is BOS, then ``(a + d*t) mod 64`` for a random start ``a`` and
    step ``d`` in 1..7: after two tokens the rest is predictable, so the loss
    has far to fall, and the lengths are long-tailed like real text.
    """
    rng = np.random.default_rng(20240613)
    seqlens = np.clip(np.round(rng.lognormal(SYN_LOGNORMAL_MEAN, SYN_LOGNORMAL_SIGMA, count)), 8, max_seqlen)
    seqlens[: max(1, count // 100)] = max_seqlen  # the longest possible samples exist: they set the peak
    rng.shuffle(seqlens)
    starts = rng.integers(0, SYN_MODULUS, count)
    steps = rng.integers(1, 8, count)
    return [
        torch.tensor([BOS, *((a + d * np.arange(int(n) - 1)) % SYN_MODULUS).tolist()], dtype=torch.int64)
        for a, d, n in zip(starts, steps, seqlens)
    ]


def load_dataset(name: str, setup: Setup) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(train, validation) samples of data set ``name``, split by a fixed shuffle."""
    total = setup.num_train + setup.num_val
    if name == "stdlib":
        samples = stdlib_functions(total, setup.max_seqlen)
    else:
        samples = synthetic_progressions(total, setup.max_seqlen)
    order = np.random.default_rng(7).permutation(total)
    samples = [samples[i] for i in order]
    return samples[setup.num_val :], samples[: setup.num_val]


# =============================================================================
# Model and loss
# =============================================================================
# A small pre-norm transformer on padded B x S batches. Padding genuinely costs
# compute: every layer runs on all B x S slots, and attention takes a per-sample
# B x 1 x S x S mask (no variable-length kernels), as in bench.py. Arm (e)'s flat
# rows attend sample by sample, as a varlen kernel does (attention work sum(L^2)):
# one T x T block-diagonal mask on the row, the same math, cost 4.3x the step time
# of the padded arms in a run of this study (attention work T^2).


class Block(torch.nn.Module):
    """Pre-norm causal self-attention and feed-forward."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.ff = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | list[int]) -> torch.Tensor:
        """``mask``: B x 1 x S x S, or a flat row's sample lengths (each sample attends causally to itself)."""
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        if isinstance(mask, list):  # a flat row, sample by sample: 1 x H x L x E/H each
            parts = zip(*(t.split(mask, dim=2) for t in (q, k, v)))
            attended = torch.cat([F.scaled_dot_product_attention(*qkv, is_causal=True) for qkv in parts], dim=2)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # B x H x S x E/H
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.ff(self.norm2(x))


class TinyLM(torch.nn.Module):
    """Token and position embeddings, ``layers`` blocks, final norm, LM head."""

    def __init__(self, setup: Setup):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, setup.dim)
        self.position = torch.nn.Embedding(setup.max_seqlen, setup.dim)
        self.blocks = torch.nn.ModuleList(Block(setup.dim, setup.heads) for _ in range(setup.layers))
        self.norm = torch.nn.LayerNorm(setup.dim)
        self.head = torch.nn.Linear(setup.dim, VOCAB)

    def forward(self, tokens: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
        """``seqlens``: B real lengths (padded rows), or a flat row's 1 x T positions (arm (e))."""
        seq = tokens.shape[1]
        if seqlens.dim() == 2:  # a flat row: positions restart at each sample, whose tokens see only each other
            x = self.embed(tokens) + self.position(seqlens)  # 1 x T x E
            starts = torch.nonzero(seqlens[0] == 0).flatten().tolist()
            mask = [b - a for a, b in zip(starts, [*starts[1:], seq])]  # the samples' lengths
        else:  # query i sees keys j <= i that are real tokens of its own sample
            x = self.embed(tokens) + self.position(torch.arange(seq))  # B x S x E
            real = torch.arange(seq)[None, :] < seqlens[:, None]  # B x S
            causal = torch.ones(seq, seq, dtype=torch.bool).tril()  # S x S
            mask = (causal[None] & real[:, None, :])[:, None]  # B x 1 x S x S
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))  # B x S x V


def lm_loss(model: TinyLM, tokens: torch.Tensor, seqlens: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy over the real tokens of the batch (mean over them, or their sum).

    The mean over all real tokens of the batch, not a mean of per-sample means:
    a long sample counts by its tokens, which is what makes the token count the
    batch size that sets the gradient noise.
    """
    logits = model(tokens, seqlens)[:, :-1]  # B x S-1 x V: position t predicts token t+1
    targets = tokens[:, 1:].clone()  # B x S-1
    if seqlens.dim() == 2:  # a flat row: no sample's last token predicts the next sample's first
        targets[seqlens[:, 1:] == 0] = -100
    else:
        targets[torch.arange(targets.shape[1])[None, :] >= (seqlens[:, None] - 1)] = -100  # padding
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction=reduction)


def validation_batches(samples: list[torch.Tensor], max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation set sorted by length and cut into padded batches of <= max_tokens slots (cheap to run)."""
    collate = varbatch.PaddedCollate()
    ordered = sorted(samples, key=len)
    batches, current = [], []
    for sample in ordered:
        if current and (len(current) + 1) * len(sample) > max_tokens:
            batches.append(collate(current))
            current = []
        current.append(sample)
    batches.append(collate(current))
    return batches


@torch.no_grad()
def validation_loss(model: TinyLM, batches) -> float:
    """Mean next-token cross-entropy over every real token of the validation set."""
    model.eval()
    total = count = 0.0
    for tokens, seqlens in batches:
        total += float(lm_loss(model, tokens, seqlens, reduction="sum"))
        count += float((seqlens - 1).sum())
    model.train()
    return total / count


# =============================================================================
# The arms: the ways of batching, one optimizer each
# =============================================================================
# Every arm yields (tokens B x S, seqlens B) batches from an endless iterator
# and trains one micro-batch per optimizer step (no accumulation), but arms (f)
# and (g), which yield each batch as the list of its R ranks' step inputs and
# accumulate them; so the loss of a step is the mean over every real token of
# its batch for every arm.


class GroupedByLengthSampler(torch.utils.data.Sampler):
    """Arm (b): fixed batches of similar lengths, like ``group_by_length`` of common trainers.

    Every epoch: a new random permutation, cut into megabatches of
    ``50 x batch_size`` samples; each megabatch sorted by length, longest first,
    and cut into batches of ``batch_size`` (the last one of the epoch may be
    smaller, as with ``drop_last=False``).
    """

    def __init__(self, seqlens: np.ndarray, batch_size: int, seed: int):
        self.seqlens = np.asarray(seqlens)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def __iter__(self):
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.seqlens))
        self.epoch += 1
        size = GROUP_MEGABATCH * self.batch_size
        for start in range(0, len(order), size):
            mega = order[start : start + size]
            mega = mega[np.argsort(-self.seqlens[mega], kind="stable")]
            for i in range(0, len(mega), self.batch_size):
                yield mega[i : i + self.batch_size].tolist()

    def __len__(self):
        return -(-len(self.seqlens) // self.batch_size)


def _forever(loader, before_epoch=None):
    """Batches of ``loader``, epoch after epoch; ``before_epoch(epoch)`` runs before each."""
    epoch = 0
    while True:
        if before_epoch is not None:
            before_epoch(epoch)
        yield from loader
        epoch += 1


@dataclasses.dataclass
class ArmSpec:
    """What distinguishes an arm: its key, its label and how its batches and LR are made."""

    key: str  # a, b, c-<rule>-<unit>, d, e, f, g
    label: str
    kind: str  # fixed, grouped, varbatch, deepspeed, flat, ranks, balanced
    rule: str = "none"
    unit: str = "sequences"


def arm_specs(with_deepspeed: bool, setup: Setup) -> list[ArmSpec]:
    """The arms raced on each seed. The rule none scales nothing, so it is the same run in either unit: run once."""
    specs = [
        ArmSpec("a", "(a) fixed B0, random order", "fixed"),
        ArmSpec("b", "(b) fixed B0, grouped by length", "grouped"),
        ArmSpec("c-none", "(c) varbatch, LR rule none (either unit)", "varbatch"),
    ]
    for unit in UNITS:
        for rule in RULES[1:]:
            specs.append(ArmSpec(f"c-{rule}-{unit}", f"(c) varbatch, {rule} in {unit}", "varbatch", rule, unit))
    specs.append(ArmSpec("e", "(e) varbatch padding-free, sqrt in tokens", "flat", "sqrt", "tokens"))
    ranks = f"{setup.simulated_ranks} simulated ranks"
    specs.append(ArmSpec("f", f"(f) varbatch, {ranks}, sqrt in tokens", "ranks", "sqrt", "tokens"))
    balanced = f"(g) varbatch, {ranks}, balance_ranks (q = {setup.quadratic_tokens}), sqrt in tokens"
    specs.append(ArmSpec("g", balanced, "balanced", "sqrt", "tokens"))
    if with_deepspeed:
        specs.append(
            ArmSpec(
                "d",
                "(d) DeepSpeed defaults (sum budget, linear, B_ref=train_batch_size)",
                "deepspeed",
                "linear",
                "sequences",
            )
        )
    return specs


class Arm:
    """One training run: a model, AdamW, an LR rule, an endless stream of batches, and a clock.

    ``clock`` counts the seconds of training steps only, on ``clock_fn`` (see
    `CLOCKS`): fetching and collating the batch, forward, backward, clipping,
    the optimizer and LR scheduler steps. Planning, evaluation and bookkeeping
    are outside it.
    """

    def __init__(self, spec: ArmSpec, model: TinyLM, optimizer, lr: float, batches, scheduler, clock_fn):
        self.spec = spec
        self.model = model
        self.optimizer = optimizer
        self.lr = lr  # the configured LR; the scheduler, if any, scales it per batch
        self.batches = batches
        self.scheduler = scheduler
        self.clock_fn = clock_fn
        self.clock = 0.0  # training seconds on clock_fn
        self.wall = 0.0  # the same steps on the wall clock
        self.steps = self.tokens = self.slots = self.peak_slots = 0
        self.lr_factors: list[float] = []
        self.curve: list[tuple[float, int, int, float]] = []  # (clock, steps, real tokens, validation loss)
        self.diverged = False

    def step(self) -> None:
        lr_now = self.optimizer.param_groups[0]["lr"]  # the LR this step trains with
        start, wall_start = self.clock_fn(), time.perf_counter()
        batch = next(self.batches)
        step_inputs = batch if isinstance(batch, list) else [batch]  # (f), (g): a list, one step input per rank
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._backward(step_inputs)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()  # the LR of the next batch
        self.clock += self.clock_fn() - start
        self.wall += time.perf_counter() - wall_start
        self.lr_factors.append(lr_now / self.lr)
        self.steps += 1
        for tokens, seqlens in step_inputs:
            self.tokens += int(seqlens.sum()) if seqlens.dim() == 1 else tokens.numel()  # a flat row: all real
        slots = sum(tokens.numel() for tokens, _ in step_inputs)  # (f), (g): the R ranks' tensors together
        self.slots += slots
        self.peak_slots = max(self.peak_slots, slots)
        if not math.isfinite(loss.item()):
            self.diverged = True

    def _backward(self, step_inputs: list) -> torch.Tensor:
        """The batch's loss, the mean over its real tokens, with its gradient left in the parameters."""
        if len(step_inputs) == 1:
            loss = lm_loss(self.model, *step_inputs[0])
            loss.backward()
            return loss
        # R ranks that weight their step input's mean loss by `micro_batch_loss_weight` (count / batch_count x R)
        # and average their gradients reach the gradient of the batch's token mean; here each step input's loss
        # sum over the batch's count, accumulated in plan order, gives that same gradient on one process.
        batch_count = sum(int((seqlens - 1).sum()) for _, seqlens in step_inputs)  # padded rows: L - 1 targets each
        loss = torch.zeros(())
        for tokens, seqlens in step_inputs:
            part = lm_loss(self.model, tokens, seqlens, reduction="sum") / batch_count
            part.backward()
            loss += part.detach()
        return loss

    def evaluate(self, batches) -> None:
        loss = float("inf") if self.diverged else validation_loss(self.model, batches)
        if not math.isfinite(loss):
            self.diverged, loss = True, float("inf")
        self.curve.append((self.clock, self.steps, self.tokens, loss))


@dataclasses.dataclass
class Data:
    """One data set, ready for the arms: samples, their seqlens, validation batches, DeepSpeed's plan."""

    name: str
    train: list
    seqlens: np.ndarray
    val_batches: list
    reference_tokens: float  # the baseline's mean real tokens per batch: B0 x mean seqlen
    ds_plan: tuple | None = None  # DeepSpeed's batch_by_seqlens output, planned once
    ds_plan_seconds: float = 0.0


def _varbatch_sampler(spec: ArmSpec, data: Data, setup: Setup, seed: int) -> varbatch.VariableBatchSampler:
    """Arms (c): the padded budget in the bucket order; arm (e): flat rows under the sum budget, random order;
    arms (f), (g): (c)'s on R simulated ranks of L_max slots each (rank 0's sampler: the plan is every rank's), (g)
    balanced."""
    max_tokens, num_replicas = setup.max_tokens, 1
    if spec.kind == "flat":
        options = dict(padding_free=True, order="random")
    else:
        options = dict(budget="padded", order="bucket")
    if spec.kind in ("ranks", "balanced"):
        max_tokens, num_replicas = setup.max_seqlen, setup.simulated_ranks
    if spec.kind == "balanced":
        options.update(balance_ranks=True, quadratic_tokens=setup.quadratic_tokens)
    return varbatch.VariableBatchSampler(
        data.seqlens, max_tokens, num_replicas=num_replicas, rank=0, seed=seed, **options
    )


def _rank_batches(sampler: varbatch.VariableBatchSampler, train: list, collate):
    """Arms (f), (g): every batch of the plan, epoch after epoch, as the list of its R step inputs, rank r's at r.

    By the dealing rule (micro_batch_size and gradient_accumulation_steps 1), batch b is the plan's micro-batches
    b R .. b R + R - 1 and rank r trains the r-th of them.
    """
    for epoch in itertools.count():
        microbatches = sampler.plan_for_epoch(epoch).microbatches()
        for start in range(0, len(microbatches), sampler.num_replicas):
            yield [collate([train[i] for i in ids]) for ids in microbatches[start : start + sampler.num_replicas]]


def _flat_row(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A step input as one flat row: ``(tokens 1 x T, positions 1 x T)``."""
    tokens, _, _, positions = varbatch.FlatCollate()(samples)
    return tokens, positions


def make_arm(spec: ArmSpec, data: Data, setup: Setup, lr: float, seed: int, initial_state: dict, ds, clock_fn) -> Arm:
    """Builds one arm as a user of its batching would: loader, AdamW, LR scheduler."""
    model = TinyLM(setup)
    model.load_state_dict(initial_state)  # every arm of a seed starts from the same weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    collate = varbatch.PaddedCollate()
    scheduler = None
    if spec.kind == "fixed":
        loader = torch.utils.data.DataLoader(
            data.train,
            batch_size=setup.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
            collate_fn=collate,
        )
        batches = _forever(loader)
    elif spec.kind == "grouped":
        sampler = GroupedByLengthSampler(data.seqlens, setup.batch_size, seed)
        batches = _forever(torch.utils.data.DataLoader(data.train, batch_sampler=sampler, collate_fn=collate))
    elif spec.kind in ("varbatch", "flat", "ranks", "balanced"):
        sampler = _varbatch_sampler(spec, data, setup, seed)
        if spec.kind == "flat":  # (tokens 1 x T, positions 1 x T) of FlatCollate's row
            batches = _forever(varbatch.make_dataloader(data.train, sampler, collate_fn=_flat_row), sampler.set_epoch)
        elif spec.kind == "varbatch":
            batches = _forever(varbatch.make_dataloader(data.train, sampler, collate_fn=collate), sampler.set_epoch)
        else:  # the scheduler follows the plan's batches: it counts them, the sampler need not hand them out
            batches = _rank_batches(sampler, data.train, collate)
        reference = setup.batch_size if spec.unit == "sequences" else data.reference_tokens
        with warnings.catch_warnings():
            # varbatch warns when the mean LR factor leaves [0.5, 2]: here that is the rule under study.
            warnings.simplefilter("ignore")
            scheduler = varbatch.VariableBatchSizeLR(
                optimizer, reference, sampler, lr_scaling_method=spec.rule, lr_scaling_unit=spec.unit
            )
    else:
        # DeepSpeed's get_dataloader_and_lr_scheduler_for_variable_batch_size, unrolled: its plan
        # (batch_by_seqlens) depends on nothing that changes between seeds, so it is made once per data
        # set (it takes seconds); the loader and scheduler are made here with the arguments and
        # defaults that function passes (effective_batch_size 1, no workers, linear rule).
        microbatch_ids, batch_sizes, batch_max_seqlens = data.ds_plan
        loader, _ = ds.dataloader_for_variable_batch_size(
            dataset=data.train,
            microbatch_ids=microbatch_ids,
            batch_max_seqlens=batch_max_seqlens,
            dataloader_num_workers=0,
            dataloader_collate_fn=collate,
        )
        with warnings.catch_warnings():
            # torch's warnings about DeepSpeed's scheduler stepping with an epoch argument.
            warnings.simplefilter("ignore")
            scheduler = ds.lr_scheduler_for_variable_batch_size(
                base_batch_size=1,
                batch_sizes=batch_sizes,
                dataloader=loader,
                lr_scheduler_or_optimizer=optimizer,
                lr_scaling_method="linear",
            )
        batches = _forever(loader)
    return Arm(spec, model, optimizer, lr, batches, scheduler, clock_fn)


# =============================================================================
# The race: arms of one seed trained in turns, on a clock of training time
# =============================================================================


def race(arms: list[Arm], data: Data, budget_seconds: float, num_evals: int) -> None:
    """Trains every arm for ``budget_seconds`` of training time, evaluating at ``num_evals`` even marks.

    The arm with the least training time steps next, so all arms move through
    the budget together and a burst of load from other processes falls on all
    of them alike. An arm evaluates after the step that crosses each mark (the
    clock is stopped meanwhile) and stops after the step that crosses the budget.

    NOTE [which clock]: three identical runs of arm (a) raced for 4 s on this
    2-core machine while other work ran took 97, 97 and 97 steps on the CPU
    clock with one thread; 76 to 79 on the wall clock with one thread; 11 to 15
    on the wall clock with two threads (each op waits for the thread whose core
    another process took). Hence the defaults: one thread, CPU time.
    """
    marks = [budget_seconds * (i + 1) / num_evals for i in range(num_evals)]
    next_mark = {id(arm): 0 for arm in arms}
    for arm in arms:
        arm.evaluate(data.val_batches)
    active = list(arms)
    while active:
        arm = min(active, key=lambda a: a.clock)
        arm.step()
        crossed = False  # a long step may cross several marks: one evaluation for them all
        while next_mark[id(arm)] < num_evals and arm.clock >= marks[next_mark[id(arm)]]:
            next_mark[id(arm)] += 1
            crossed = True
        if crossed or arm.diverged:
            arm.evaluate(data.val_batches)
        if arm.clock >= budget_seconds or arm.diverged:
            active.remove(arm)


def _warm_up(setup: Setup, data: Data) -> None:
    """One untimed forward and backward at the peak shape: allocator and kernels warm."""
    model = TinyLM(setup)
    tokens, seqlens = varbatch.PaddedCollate()(sorted(data.train, key=len)[-setup.batch_size :])
    lm_loss(model, tokens, seqlens).backward()


# =============================================================================
# Analysis: time to the baseline's loss, tables, findings
# =============================================================================


def _crossing(curve, target: float, column: int) -> float:
    """Where ``curve`` first reaches ``target`` loss, interpolated in ``column`` (0 clock, 1 steps, 2 tokens).

    Linear interpolation between the last validation point above the target and
    the first at or below it; inf when it never does.
    """
    for i, point in enumerate(curve):
        if point[3] <= target:
            if i == 0:
                return float(point[column])
            before = curve[i - 1]
            share = (before[3] - target) / (before[3] - point[3])
            return float(before[column] + share * (point[column] - before[column]))
    return float("inf")


def arm_metrics(arm: Arm, target: float, max_tokens: int) -> dict:
    """Everything the tables report about one run, as plain data."""
    factors = np.asarray(arm.lr_factors) if arm.lr_factors else np.ones(1)
    return dict(
        key=arm.spec.key,
        label=arm.spec.label,
        lr=arm.lr,
        target=target,
        time_to_target=_crossing(arm.curve, target, 0),
        steps_to_target=_crossing(arm.curve, target, 1),
        tokens_to_target=_crossing(arm.curve, target, 2),
        final_loss=arm.curve[-1][3],
        clock=arm.clock,
        wall=arm.wall,
        steps=arm.steps,
        tokens=arm.tokens,
        slots=arm.slots,
        real_share=arm.tokens / max(arm.slots, 1),
        peak_over_budget=arm.peak_slots / max_tokens,
        mean_slots_over_budget=arm.slots / max(arm.steps, 1) / max_tokens,
        tokens_per_second=arm.tokens / max(arm.clock, 1e-9),
        ms_per_step=1e3 * arm.clock / max(arm.steps, 1),
        us_per_kslot=1e6 * arm.clock / max(arm.slots / 1000, 1e-9),
        lr_factor_mean=float(factors.mean()),
        lr_factor_min=float(factors.min()),
        lr_factor_max=float(factors.max()),
        diverged=arm.diverged,
        curve=[list(point) for point in arm.curve],
    )


def steps_per_epoch(spec: ArmSpec, data: Data, setup: Setup) -> int:
    if spec.kind in ("fixed", "grouped"):
        return -(-len(data.train) // setup.batch_size)
    if spec.kind in ("varbatch", "flat", "ranks", "balanced"):
        return len(_varbatch_sampler(spec, data, setup, 0))  # (f), (g): G = 1, a rank's step inputs are the batches
    return len(data.ds_plan[1])


def _arm_median(runs: dict, key: str, field: str) -> float:
    """The median of ``field`` over the seeds of arm ``key``."""
    return _median([m[field] for m in runs[key]])


def _ranked_c(runs: dict) -> list[str]:
    """The varbatch arms, fastest first: least median time to the target, then lowest median final loss."""
    keys = [k for k in runs if k.startswith("c-")]
    return sorted(keys, key=lambda k: (_arm_median(runs, k, "time_to_target"), _arm_median(runs, k, "final_loss")))


def best_c(runs: dict) -> str:
    """The varbatch arm with the least median time to the target (then the lowest median final loss)."""
    return _ranked_c(runs)[0]


def results_table(runs: dict, specs: list[ArmSpec], data: Data, setup: Setup, budget: float) -> str:
    """Outcomes per arm, median [min, max] over seeds."""
    seeds = len(runs["a"])
    a_time = budget
    b_time = _arm_median(runs, "b", "time_to_target")
    rows = []
    for spec in specs:
        ms = runs[spec.key]
        times = [m["time_to_target"] for m in ms]
        reached = sum(math.isfinite(t) for t in times)
        median_time = _median(times)
        rows.append(
            [
                spec.label,
                _spread(times, "{:.2f}", " s") + ("" if reached == seeds else f" ({reached}/{seeds} reached)"),
                f"{median_time / a_time:.2f}" if math.isfinite(median_time) else "-",
                f"{median_time / b_time:.2f}" if math.isfinite(median_time) and math.isfinite(b_time) else "-",
                _spread([m["steps_to_target"] for m in ms], "{:.0f}"),
                _spread([m["tokens_to_target"] / 1e3 for m in ms], "{:.0f}", "k"),
                _spread([m["final_loss"] for m in ms], "{:.3f}"),
                _spread([100 * m["real_share"] for m in ms], "{:.1f}", "%"),
                steps_per_epoch(spec, data, setup),
            ]
        )
    return _table(
        [
            "arm",
            "time to (a)'s final loss",
            "/ (a)'s time",
            "/ (b)'s time",
            "steps to it",
            "real tokens to it",
            f"loss at {budget:g} s",
            "real / padded",
            "steps / epoch",
        ],
        rows,
    )


def cost_table(runs: dict, specs: list[ArmSpec]) -> str:
    """Why: what a step costs and what LR it trains with, median [min, max] over seeds."""
    rows = []
    for spec in specs:
        ms = runs[spec.key]
        rows.append(
            [
                spec.label,
                _spread([m["steps"] for m in ms], "{:.0f}"),
                _spread([m["ms_per_step"] for m in ms], "{:.1f}"),
                _spread([m["tokens_per_second"] / 1e3 for m in ms], "{:.1f}", "k"),
                _spread([m["us_per_kslot"] for m in ms], "{:.0f}"),
                f"{_median([m['mean_slots_over_budget'] for m in ms]):.2f} / {max(m['peak_over_budget'] for m in ms):.2f}",
                f"{_median([m['lr_factor_mean'] for m in ms]):.2f} ({min(m['lr_factor_min'] for m in ms):.2f}.."
                f"{max(m['lr_factor_max'] for m in ms):.2f})",
                sum(m["diverged"] for m in ms),
            ]
        )
    return _table(
        [
            "arm",
            "steps in budget",
            "ms / step",
            "real tokens / s",
            "us / 1k padded slots",
            "padded / max_tokens mean / peak",
            "LR factor mean (min..max)",
            "diverged runs",
        ],
        rows,
    )


def rule_unit_table(runs: dict) -> str:
    """The varbatch arms side by side: each LR rule in sequences and in tokens, medians over seeds."""
    med = functools.partial(_arm_median, runs)

    def time(key):
        value = med(key, "time_to_target")
        return f"{value:.2f} s" if math.isfinite(value) else "-"

    rows = [["none (either unit)", f"{med('c-none', 'final_loss'):.3f}", "", time("c-none"), "", "1 (1..1)", ""]]
    for rule in RULES[1:]:
        seq, tok = f"c-{rule}-sequences", f"c-{rule}-tokens"
        factors = [
            f"{med(k, 'lr_factor_mean'):.2f} ({min(m['lr_factor_min'] for m in runs[k]):.2f}.."
            f"{max(m['lr_factor_max'] for m in runs[k]):.2f})"
            for k in (seq, tok)
        ]
        rows.append(
            [rule, f"{med(seq, 'final_loss'):.3f}", f"{med(tok, 'final_loss'):.3f}", time(seq), time(tok), *factors]
        )
    return _table(
        [
            "rule",
            "loss at budget: sequences",
            "tokens",
            "time to (a)'s loss: sequences",
            "tokens",
            "LR factor mean (min..max): sequences",
            "tokens",
        ],
        rows,
    )


def balance_table(result: dict) -> tuple[str, dict]:
    """Arms (f) and (g) side by side and seed by seed, and the check that balancing costs no time to (a)'s loss.

    The study's noise is the spread of the seeds: (g) passes when its median time is at most (f)'s slowest seed's
    (where neither median run reaches the loss, the same for the loss at the budget: at most (f)'s highest).
    """
    runs, idle = result["runs"], result["rank_idle"]
    rows = []
    for key in ("f", "g"):
        ms = runs[key]
        rows.append(
            [
                ms[0]["label"],
                f"{100 * idle[key]:.1f}%",
                _spread([m["time_to_target"] for m in ms], "{:.2f}", " s"),
                _spread([m["steps_to_target"] for m in ms], "{:.0f}"),
                _spread([m["final_loss"] for m in ms], "{:.3f}"),
                _spread([m["ms_per_step"] for m in ms], "{:.1f}"),
            ]
        )
    pairs = list(zip(runs["f"], runs["g"]))  # the same seed: the same first weights and target
    times = [(g["time_to_target"], f["time_to_target"]) for f, g in pairs]
    ratios = [g / f for g, f in times if math.isfinite(g) and math.isfinite(f)]  # seeds where both reached it
    steps = [(g["steps_to_target"], f["steps_to_target"]) for f, g in pairs]
    steps = [(g, f) for g, f in steps if math.isfinite(g) and math.isfinite(f)]
    rows.append(
        [
            "(g) / (f), seed by seed (time, steps: ratio; loss: difference)",
            "",
            _spread(ratios, "{:.2f}") if ratios else "-",
            _spread([g / f for g, f in steps], "{:.2f}") if steps else "-",
            _spread([g["final_loss"] - f["final_loss"] for f, g in pairs], "{:+.3f}"),
            _spread([g["ms_per_step"] / f["ms_per_step"] for f, g in pairs], "{:.2f}"),
        ]
    )
    table = _table(
        [
            "arm",
            "idle share of a reduction (plan, not simulated)",
            "time to (a)'s final loss",
            "steps to it",
            "loss at budget",
            "ms / step",
        ],
        rows,
    )
    med = functools.partial(_arm_median, runs)
    field = "time_to_target"
    if not (math.isfinite(med("f", field)) or math.isfinite(med("g", field))):
        field = "final_loss"
    slowest = max(m[field] for m in runs["f"])
    check = dict(field=field, f=med("f", field), f_slowest=slowest, g=med("g", field), met=med("g", field) <= slowest)
    return table, check


def findings(runs: dict, budget: float) -> tuple[list[str], dict]:
    """Plain-language findings and the target checks of one data set."""
    med = functools.partial(_arm_median, runs)
    lines = []
    best = best_c(runs)
    label = runs[best][0]["label"]
    best_time = med(best, "time_to_target")
    b_time = med("b", "time_to_target")
    half = best_time <= 0.5 * budget
    if math.isfinite(b_time):
        three_quarters = best_time <= 0.75 * b_time
    elif best_time <= 0.75 * budget:  # (b) did not reach the target: its time is above the budget
        three_quarters = True
    else:
        three_quarters = None  # undecided: (b)'s time is unknown beyond the budget
    if math.isfinite(best_time):
        lines.append(
            f"- Best varbatch arm: {label}: {best_time:.2f} s to (a)'s final loss (median), "
            f"{best_time / budget:.2f} of (a)'s {budget:g} s"
            + (
                f" and {best_time / b_time:.2f} of (b)'s {b_time:.2f} s."
                if math.isfinite(b_time)
                else "; (b) did not reach that loss within the budget."
            )
        )
    else:
        lines.append(
            f"- No varbatch arm reached (a)'s final loss within {budget:g} s (median over seeds); the "
            f"lowest final loss: {label}."
        )
    # Padding alone can speed (a) up by at most its real share's inverse: a target beyond that
    # needs fewer real tokens to the loss, which fewer, larger steps do not give for free.
    bound = med("a", "real_share") / med(best, "real_share")
    lines.append(
        f"- Padding bound: (a) fills {100 * med('a', 'real_share'):.0f}% of its slots with real tokens, "
        f"{label} {100 * med(best, 'real_share'):.0f}%: at equal cost per slot and equal real tokens to the "
        f"loss, its time would be {bound:.2f} of (a)'s."
    )
    # Time to the loss = real tokens needed / real tokens per second: the gain splits into the two.
    # (a)'s reference is its whole budget (its final loss defines the target); (b)'s is its crossing.
    for ref, share in (("a", 0.5), ("b", 0.75)):
        ref_tokens = med("a", "tokens") if ref == "a" else med("b", "tokens_to_target")
        ref_steps = med("a", "steps") if ref == "a" else med("b", "steps_to_target")
        throughput = med(best, "tokens_per_second") / med(ref, "tokens_per_second")
        per_step = (med(best, "tokens") / med(best, "steps")) / (med(ref, "tokens") / med(ref, "steps"))
        text = (
            f"- vs ({ref}): each step holds {per_step:.2f}x the real tokens and takes "
            f"{med(best, 'ms_per_step') / med(ref, 'ms_per_step'):.2f}x the time (real / padded "
            f"{100 * med(best, 'real_share'):.0f}% vs {100 * med(ref, 'real_share'):.0f}%), so "
            f"{throughput:.2f}x the real tokens per second"
        )
        tokens_needed = med(best, "tokens_to_target") / ref_tokens
        steps_needed = med(best, "steps_to_target") / ref_steps
        if math.isfinite(ref_tokens) and math.isfinite(tokens_needed):
            # Which of the two the loss followed: the ratio nearer to 1.
            follows = "optimizer steps" if abs(math.log(steps_needed)) < abs(math.log(tokens_needed)) else "real tokens"
            text += (
                f"; it needed {tokens_needed:.2f}x the real tokens and {steps_needed:.2f}x the optimizer steps "
                f"({med(best, 'steps_to_target'):.0f} vs {ref_steps:.0f}) to reach the loss, which here "
                f"followed {follows} more closely: time ratio = {tokens_needed:.2f} / {throughput:.2f} = "
                f"{tokens_needed / throughput:.2f}."
            )
            if tokens_needed / throughput > share:
                text += (
                    f" For {share:g} of ({ref})'s time at this throughput it would have to need at most "
                    f"{share * throughput:.2f}x the real tokens."
                )
        else:
            text += "; one of the two did not reach the loss, so no split of the time."
        lines.append(text)
    if "d" in runs:
        lines.append(
            f"- DeepSpeed's defaults: mean LR factor {med('d', 'lr_factor_mean'):.1f} (the linear rule "
            f"with B in sequences against B_ref = train_batch_size = 1 micro-batch), padded tensor "
            f"{med('d', 'mean_slots_over_budget'):.2f}x max_tokens on average and "
            f"{max(m['peak_over_budget'] for m in runs['d']):.2f}x at peak (sum budget); loss at the "
            f"budget {med('d', 'final_loss'):.3f} vs (a)'s {med('a', 'final_loss'):.3f}"
            + (
                f"; {sum(m['diverged'] for m in runs['d'])} run(s) diverged."
                if any(m["diverged"] for m in runs["d"])
                else "."
            )
        )
    checks = dict(
        best=best,
        best_label=label,
        best_time=best_time,
        budget=budget,
        b_time=b_time,
        half_of_a=half,
        three_quarters_of_b=three_quarters,
    )
    return lines, checks


# =============================================================================
# The figure
# =============================================================================


def _median_curve(curves: list, column: int, grid: np.ndarray) -> np.ndarray:
    """The median over seeds of the loss, each seed's curve interpolated on ``grid`` of ``column``."""
    values = []
    for curve in curves:
        xs = np.array([p[column] for p in curve], dtype=float)
        ys = np.array([p[3] for p in curve], dtype=float)
        values.append(np.interp(grid, xs, ys, right=np.nan))
    return np.nanmedian(np.array(values), axis=0)


def write_figure(path: str, study: dict) -> None:
    """Validation loss against training time and against real tokens, median over seeds, one row per data set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(study["datasets"])
    fig, axes = plt.subplots(len(names), 2, figsize=(13, 4.6 * len(names)), squeeze=False)
    colors = {"none": "tab:green", "sqrt": "tab:blue", "linear": "tab:purple"}
    for row, name in zip(axes, names):
        result = study["datasets"][name]
        budget = result["budget_seconds"]
        target = _arm_median(result["runs"], "a", "target")
        finite = []
        for key, ms in result["runs"].items():
            curves = [m["curve"] for m in ms]
            if key == "a":
                style = dict(color="black", linewidth=2.2)
            elif key == "b":
                style = dict(color="tab:gray", linewidth=2.0)
            elif key == "d":
                style = dict(color="tab:red", linewidth=1.5)
            elif key in ("f", "g"):
                style = dict(color="tab:brown", linewidth=1.6, linestyle="--" if key == "f" else "-")
            elif key == "e":
                style = dict(color="tab:orange", linewidth=1.8, linestyle="-.")
            else:
                rule = ms[0]["key"].split("-")[1]
                style = dict(color=colors[rule], linewidth=1.5, linestyle="--" if key.endswith("sequences") else "-")
            time_grid = np.linspace(0, budget, 60)
            token_grid = np.linspace(0, min(c[-1][2] for c in curves), 60)
            loss_t = _median_curve(curves, 0, time_grid)
            loss_k = _median_curve(curves, 2, token_grid)
            label = ms[0]["label"]
            if key == "d":
                # DeepSpeed's LR factor can throw its curve far above the others: name its end in the legend.
                label += f": {_median([m['final_loss'] for m in ms]):.2f} at the budget"
            else:
                # The y-range follows the other curves after their first fall, where the arms differ.
                finite += [v for v in loss_t[time_grid >= 0.15 * budget] if math.isfinite(v)]
            row[0].plot(time_grid, loss_t, label=label, **style)
            row[1].plot(token_grid / 1e3, loss_k, label=label, **style)
        top = max(finite) + 0.05 if finite else 6.0
        for ax, xlabel in zip(row, ("training time (s, evaluation excluded)", "real tokens trained (thousands)")):
            ax.axhline(target, color="black", linestyle=":", linewidth=1)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("validation loss (nats / token)")
            ax.set_ylim(bottom=min(finite) - 0.05 if finite else None, top=top)
            ax.grid(alpha=0.3)
        seeds = f"{result['seeds']} seed{'s' if result['seeds'] > 1 else ''}"
        row[0].set_title(f"{name}: loss vs training time (median of {seeds}; dotted: (a)'s final loss)")
        row[1].set_title(f"{name}: loss vs real tokens")
        row[1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =============================================================================
# Main: per data set, tune (a)'s LR, then race all arms on every seed
# =============================================================================


def prepare(name: str, setup: Setup, ds) -> Data:
    """Loads data set ``name`` and, when DeepSpeed is there, plans its epoch with DeepSpeed's defaults."""
    train, val = load_dataset(name, setup)
    seqlens = np.array([len(s) for s in train], dtype=np.int64)
    data = Data(
        name,
        train,
        seqlens,
        validation_batches(val, setup.max_tokens),
        reference_tokens=setup.batch_size * float(seqlens.mean()),
    )
    if ds is not None:
        start = time.perf_counter()
        # DeepSpeed's defaults: sum budget, dataloader order, effective_batch_size 1.
        data.ds_plan = ds.batch_by_seqlens(seqlens=seqlens.tolist(), max_tokens=setup.max_tokens)
        data.ds_plan_seconds = time.perf_counter() - start
    return data


def rank_idle(specs: list[ArmSpec], data: Data, setup: Setup, seed: int) -> dict:
    """The share of each reduction the ranks of arms (f) and (g) would wait, on the first epoch's plan under q."""
    idle = {}
    for spec in specs:
        if spec.kind in ("ranks", "balanced"):
            plan = _varbatch_sampler(spec, data, setup, seed).plan_for_epoch(0)
            idle[spec.key] = _plan_idle(plan, data.seqlens, setup.quadratic_tokens)[0]  # G = 1: per batch the same
    return idle


def study_dataset(name: str, setup: Setup, ds, seeds: list[int], clock_fn) -> dict:
    """Tunes (a)'s LR on the first seed, then races every arm on every seed; returns the raw results."""
    _progress(f"{name}: loading data")
    data = prepare(name, setup, ds)
    budget = setup.budget_seconds[name]
    _warm_up(setup, data)
    specs = arm_specs(ds is not None, setup)

    # 1. (a)'s LR: a race of the grid on the first seed; the lowest final loss wins.
    torch.manual_seed(seeds[0])
    initial = TinyLM(setup).state_dict()
    _progress(f"{name}: tuning (a)'s LR over {len(setup.lr_grid)} values, {budget:g} s of training each")
    grid_arms = [make_arm(specs[0], data, setup, lr, seeds[0], initial, ds, clock_fn) for lr in setup.lr_grid]
    race(grid_arms, data, budget, setup.num_evals)
    grid = [dict(lr=arm.lr, final_loss=arm.curve[-1][3], steps=arm.steps) for arm in grid_arms]
    lr = min(grid, key=lambda g: g["final_loss"])["lr"]
    _progress(f"{name}: best LR {lr:g} (" + ", ".join(f"{g['lr']:g}: {g['final_loss']:.3f}" for g in grid) + ")")

    # 2. Every arm on every seed, from (a)'s tuned LR, against that seed's (a) final loss.
    runs: dict = {spec.key: [] for spec in specs}
    for seed in seeds:
        torch.manual_seed(seed)
        initial = TinyLM(setup).state_dict()
        arms = [make_arm(spec, data, setup, lr, seed, initial, ds, clock_fn) for spec in specs]
        _progress(f"{name}: seed {seed}: racing {len(arms)} arms, {budget:g} s of training each")
        race(arms, data, budget, setup.num_evals)
        target = arms[0].curve[-1][3]
        for arm in arms:
            runs[arm.spec.key].append(arm_metrics(arm, target, setup.max_tokens))
    return dict(
        name=name,
        budget_seconds=budget,
        seeds=len(seeds),
        lr=lr,
        grid=grid,
        runs=runs,
        num_train=len(data.train),
        mean_seqlen=float(data.seqlens.mean()),
        max_seqlen=int(data.seqlens.max()),
        truncated=float(np.mean(data.seqlens == setup.max_seqlen)),
        reference_tokens=data.reference_tokens,
        ds_plan_seconds=data.ds_plan_seconds,
        rank_idle=rank_idle(specs, data, setup, seeds[0]),
        specs=[dataclasses.asdict(s) for s in specs],
        data=data,
    )


def report_dataset(result: dict, setup: Setup) -> tuple[str, dict]:
    """The markdown section of one data set, and its target checks."""
    name, budget, data = result["name"], result["budget_seconds"], result["data"]
    specs = [ArmSpec(**s) for s in result["specs"]]
    out = [f"## {name}", ""]
    if name == "stdlib":
        source = (
            f"{result['num_train']:,} distinct functions of the Python standard library's source "
            f"(ast, dedented), UTF-8 bytes after a BOS token, truncated to {setup.max_seqlen} "
            f"({100 * result['truncated']:.0f}% are)"
        )
    else:
        source = (
            f"{result['num_train']:,} arithmetic progressions mod {SYN_MODULUS} after a BOS token, lengths "
            f"lognormal({SYN_LOGNORMAL_MEAN}, {SYN_LOGNORMAL_SIGMA}) clipped to 8..{setup.max_seqlen}"
        )
    out.append(
        f"Training set: {source}; mean seqlen {result['mean_seqlen']:.1f}, {setup.num_val} validation "
        f"samples. Peak padded tensor of every arm but (d): B0 x L_max = {setup.batch_size} x "
        f"{setup.max_seqlen} = max_tokens = {setup.max_tokens} slots. Time budget of (a), and training "
        f"time of every arm: {budget:g} s; validation every {budget / setup.num_evals:.2g} s of training "
        f"time. Token-unit reference: B_ref = B0 x mean seqlen = {result['reference_tokens']:.0f} real "
        f"tokens; sequence-unit reference: B_ref = B0 = {setup.batch_size}."
    )
    clock_total = sum(m["clock"] for ms in result["runs"].values() for m in ms)
    wall_total = sum(m["wall"] for ms in result["runs"].values() for m in ms)
    out.append(
        f"Training steps of the {result['seeds']}-seed races: {clock_total:.0f} s on the clock, "
        f"{wall_total:.0f} s of wall clock ({wall_total / clock_total:.2f}x; above 1 with one thread: other "
        f"processes took the core meanwhile)."
    )
    if result["ds_plan_seconds"]:
        out.append(
            f"DeepSpeed's `batch_by_seqlens` planned the epoch once in {result['ds_plan_seconds']:.1f} s "
            "(setup time, outside every clock; varbatch plans in milliseconds)."
        )
    out.append("")
    out.append(f"### (a)'s LR grid (first seed, lowest loss at {budget:g} s kept)")
    out.append("")
    out.append(
        _table(
            ["LR", f"loss at {budget:g} s", "steps"],
            [
                [f"{g['lr']:g}" + (" (kept)" if g["lr"] == result["lr"] else ""), f"{g['final_loss']:.3f}", g["steps"]]
                for g in result["grid"]
            ],
        )
    )
    if result["lr"] in (setup.lr_grid[0], setup.lr_grid[-1]):
        out.append("\nThe best LR is at the edge of the grid: the tuned baseline may be better still.")
    out.append("")
    out.append(
        f"### Time to reach (a)'s final loss (LR {result['lr']:g} for all; median [min, max] over "
        f"{result['seeds']} seeds)"
    )
    out.append("")
    out.append(results_table(result["runs"], specs, data, setup, budget))
    out.append("")
    out.append(
        "(a)'s row: where its own curve first reaches its loss at the budget; below the budget when "
        "validation loss dips to that level earlier. Ratios to (a) use its budget, those to (b) (b)'s "
        "median time; '-': the median run did not reach the loss within the budget."
    )
    out.append("")
    out.append("### Why: cost per step and LR per arm")
    out.append("")
    out.append(cost_table(result["runs"], specs))
    out.append("")
    out.append("### The LR rules in each unit (varbatch arms, medians)")
    out.append("")
    out.append(rule_unit_table(result["runs"]))
    out.append("")
    ranks = setup.simulated_ranks
    out.append(f"### Balanced ranks: (f) and (g), {ranks} simulated ranks (median [min, max] over seeds)")
    out.append("")
    table, balance = balance_table(result)
    out.append(table)
    out.append("")
    out.append(
        f"Each batch: the plan's {ranks} step inputs of at most L_max = {setup.max_seqlen} slots, one per rank, "
        f"trained one after another on this process, their gradients summed as {ranks} ranks' would be. The time "
        f"is their sum: the ranks' waiting at each reduction, which balancing cuts, is not simulated (the idle "
        f"share: 1 - mean / max of the {ranks} step inputs' costs under q = {setup.quadratic_tokens}, per "
        f"reduction, averaged over the first epoch's plan). The race asks whether the regrouping costs "
        f"convergence."
    )
    out.append("")
    lines, checks = findings(result["runs"], budget)
    checks["balance"] = balance
    out.append("### Findings")
    out.append("")
    out += lines
    return "\n".join(out), checks


def targets_table(checks: dict) -> str:
    def mark(ok):
        return "undecided" if ok is None else ("yes" if ok else "no")

    def seconds(value):
        return f"{value:.2f} s" if math.isfinite(value) else "not reached"

    rows = []
    for name, c in checks.items():
        rows.append(
            [
                name,
                "best varbatch arm <= 1/2 of (a)'s time",
                f"{c['best_label']}: {seconds(c['best_time'])} vs {0.5 * c['budget']:.2f} s",
                mark(c["half_of_a"]),
            ]
        )
        b = f"{0.75 * c['b_time']:.2f} s" if math.isfinite(c["b_time"]) else f"> {0.75 * c['budget']:.2f} s"
        rows.append(
            [
                name,
                "best varbatch arm <= 3/4 of (b)'s time",
                f"{seconds(c['best_time'])} vs {b}",
                mark(c["three_quarters_of_b"]),
            ]
        )
        balance = c["balance"]
        if balance["field"] == "time_to_target":
            target = "(g) balanced: time to (a)'s loss <= (f)'s slowest seed"
            measured = (
                f"{seconds(balance['g'])} vs {seconds(balance['f_slowest'])} ((f)'s median {seconds(balance['f'])})"
            )
        else:
            target = "(g) balanced: loss at budget <= (f)'s highest seed (neither reached (a)'s loss)"
            measured = f"{balance['g']:.3f} vs {balance['f_slowest']:.3f} ((f)'s median {balance['f']:.3f})"
        rows.append([name, target, measured, mark(balance["met"])])
    return _table(["data", "target (median over seeds)", "measured", "met"], rows)


def defaults_table(results: dict) -> str:
    """The varbatch arms across data sets, ranked by median time to (a)'s loss (ties: loss at the budget)."""
    keys = [k for k in next(iter(results.values()))["runs"] if k.startswith("c-")]
    ranks = {k: [] for k in keys}
    cells = {k: [] for k in keys}
    for result in results.values():
        runs = result["runs"]
        order = _ranked_c(runs)
        for k in keys:
            ranks[k].append(order.index(k) + 1)
            t = _arm_median(runs, k, "time_to_target")
            cells[k].append(f"{t / result['budget_seconds']:.2f}" if math.isfinite(t) else "-")
            cells[k][-1] += f" / {_arm_median(runs, k, 'final_loss'):.3f}"
    labels = {k: next(iter(results.values()))["runs"][k][0]["label"].replace("(c) varbatch, ", "") for k in keys}
    rows = [
        [labels[k], *cells[k], " ".join(map(str, ranks[k])), f"{np.mean(ranks[k]):.1f}"]
        for k in sorted(keys, key=lambda k: np.mean(ranks[k]))
    ]
    return _table(
        [
            "varbatch LR rule",
            *[f"{name}: time / (a)'s, loss at budget" for name in results],
            "rank per data set",
            "mean rank",
        ],
        rows,
    )


def _method(setup: Setup, threads: int, clock: str, with_deepspeed: bool) -> str:
    """The paragraph that says how the study measures: the model, the loss, the optimizer, the clock, the arms."""
    return (
        f"Model: byte-level causal LM, {setup.layers} pre-norm transformer block{'s' if setup.layers > 1 else ''}, "
        f"E={setup.dim}, "
        f"{setup.heads} heads, feed-forward 4E, context {setup.max_seqlen}, vocabulary {VOCAB}; per-sample "
        f"B x 1 x S x S attention masks, so padded slots cost compute. Loss: next-token cross-entropy, mean over "
        f"the real tokens of the batch. AdamW (betas {BETAS}, weight decay {WEIGHT_DECAY}), constant LR scaled "
        f"per batch by the arm's rule, gradients clipped to norm {CLIP_NORM}; one micro-batch per optimizer step "
        f"(no accumulation) but in (f) and (g). Time: {CLOCK_WORDS[clock]} of the training steps only (fetching and "
        f"collating the batch, forward, backward, clipping, optimizer and LR scheduler steps), {threads} torch "
        f"thread{'s' if threads > 1 else ''}; planning and validation are outside the clock. The arms of one seed "
        f"run interleaved: the arm with the least training time steps next, so whatever else the machine runs "
        f"hits all arms alike. Every arm of a seed starts "
        f"from the same weights. Varbatch arms: `VariableBatchSampler(budget='padded', order='bucket')`, "
        f"`make_dataloader`, `VariableBatchSizeLR` stepped after every optimizer step; (e): "
        f"`VariableBatchSampler(padding_free=True, order='random')` and `FlatCollate`'s rows, attention sample by "
        f"sample (a varlen kernel's work); (f), (g): `VariableBatchSampler(budget='padded', order='bucket', "
        f"num_replicas={setup.simulated_ranks})` with a budget of L_max = {setup.max_seqlen} slots per rank, its "
        f"plan's batches iterated by the dealing rule (`plan_for_epoch`), each batch's {setup.simulated_ranks} "
        f"step inputs accumulated in plan order as the sum of the ranks' gradients, (g) with "
        f"`balance_ranks=True, quadratic_tokens={setup.quadratic_tokens}` (6 x E, the README's rule of thumb); (d): "
        f"DeepSpeed's "
        f"`batch_by_seqlens`, `dataloader_for_variable_batch_size` and `lr_scheduler_for_variable_batch_size` "
        f"with the arguments `get_dataloader_and_lr_scheduler_for_variable_batch_size` passes by default"
        + ("" if with_deepspeed else " (not run: DeepSpeed is not installed or --no-deepspeed)")
        + "."
    )


def _parser() -> argparse.ArgumentParser:
    """The command line, a help= on every flag."""
    parser = argparse.ArgumentParser(
        description="Time to reach a fixed-batch baseline's loss, per batching and LR "
        "rule (markdown tables on stdout, progress on stderr)."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke form with tiny sizes and one seed, in seconds (CI); no figure unless --plot",
    )
    parser.add_argument(
        "--datasets",
        default=",".join(DATASETS),
        help=f"comma-separated data sets, of {', '.join(DATASETS)} (default: both)",
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 3, 1 with --quick)")
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=None,
        help="training seconds of every arm, (a)'s time budget (default 6 for stdlib and 4 for "
        "synthetic; 0.4 with --quick)",
    )
    parser.add_argument(
        "--lr-grid",
        default=None,
        metavar="LR,LR,...",
        help="comma-separated LRs tried for arm (a) (default 0.004,0.008,0.016,0.032; 0.002,0.008 with --quick)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine, several threads stall each other "
        "whenever another process takes a core)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="what a training second is: cpu, the process's CPU time (default; with one thread it "
        "is the time the step needs, whatever else the machine runs), or wall, the wall clock",
    )
    parser.add_argument(
        "--plot",
        nargs="?",
        const=os.path.join(_HERE, "study.png"),
        default=None,
        metavar="PNG",
        help="write the figure (needs matplotlib; default path study.png next to study.py; the "
        "full study writes it unless --no-plot)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write the figure")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the raw numbers to FILE")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave out arm (d), DeepSpeed's module")
    return parser


def _setup(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], Setup]:
    """The data sets and the setup the flags ask for; a bad flag ends the command with its usage line."""
    names = [s.strip() for s in args.datasets.split(",") if s.strip()]
    unknown = sorted(set(names) - set(DATASETS))
    if unknown or not names:
        parser.error(f"--datasets should name some of {', '.join(DATASETS)}, but got {args.datasets!r}")
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds should be at least 1, but got {args.seeds}")
    if args.budget_seconds is not None and not args.budget_seconds > 0:
        parser.error(f"--budget-seconds should be > 0, but got {args.budget_seconds}")
    setup = QUICK if args.quick else FULL
    if args.seeds is not None:
        setup = dataclasses.replace(setup, seeds=args.seeds)
    if args.lr_grid is not None:
        try:
            grid = tuple(float(x) for x in args.lr_grid.split(","))
        except ValueError:
            grid = ()
        if not grid or not all(lr > 0 for lr in grid):
            parser.error(f"--lr-grid should be comma-separated LRs > 0, but got {args.lr_grid!r}")
        setup = dataclasses.replace(setup, lr_grid=grid)
    if args.budget_seconds is not None:
        setup = dataclasses.replace(setup, budget_seconds=dict.fromkeys(DATASETS, args.budget_seconds))
    if args.threads < 1:
        parser.error(f"--threads should be at least 1, but got {args.threads}")
    return names, setup


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    names, setup = _setup(parser, args)
    plot = None if args.no_plot else (args.plot or (None if args.quick else os.path.join(_HERE, "study.png")))
    have_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if args.plot and not args.no_plot and not have_matplotlib:
        parser.error("--plot needs matplotlib, which is not installed: pip install matplotlib")
    threads = args.threads
    torch.set_num_threads(threads)
    clock = CLOCKS[args.clock]
    ds = None if args.no_deepspeed else _deepspeed_module()

    print(f"# varbatch study: time to reach a fixed-batch baseline's loss{' (--quick)' if args.quick else ''}\n")
    print(machine_description(threads) + "\n")
    print(_method(setup, threads, args.clock, ds is not None) + "\n", flush=True)

    seeds = list(range(setup.seeds))
    study = dict(setup=dataclasses.asdict(setup), threads=threads, clock=args.clock, datasets={})
    checks = {}
    for name in names:
        result = study_dataset(name, setup, ds, seeds, clock)
        text, checks[name] = report_dataset(result, setup)
        print(text + "\n", flush=True)
        del result["data"]
        study["datasets"][name] = result
    print("## Targets\n")
    print(targets_table(checks) + "\n")
    print("## Which unit and rule: the evidence for the defaults\n")
    print(
        "Time to (a)'s final loss as a share of (a)'s budget, and loss at the budget, medians over seeds; rank 1 = "
        "fastest. B_ref: B0 sequences, or B0 x mean seqlen real tokens (the batch (a)'s LR was tuned for).\n"
    )
    print(defaults_table(study["datasets"]) + "\n")
    if plot:
        if have_matplotlib:
            write_figure(plot, study)
            print(f"Figure written to {os.path.relpath(plot)}.\n")
        else:
            print("No figure: matplotlib is not installed (pip install matplotlib).\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(study, f, indent=1, default=float)
        print(f"Raw numbers written to {args.json}.\n")
    print(f"Total study time: {time.perf_counter() - _START:.0f} s.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
