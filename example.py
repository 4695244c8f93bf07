"""varbatch with DeepSpeed: token-budget batches and batch-size-aware LR, DDP and pipeline.

A causal attention head (per-sample B x S x S masks from the real lengths)
followed by a fixed-size feed-forward (input padded to the dataset's max
seqlen M: B x S x E -> B x M x E) learns a running sum over synthetic
variable-length sequences. Every batch holds a different number of sequences
B and a different padded length S; the LR follows B.

Launch (on a CPU machine every "GPU" is a process talking gloo):

    deepspeed --num_gpus 2 example.py --pipeline-num-stages 2   # pipeline: attention | feed-forward
    deepspeed --num_gpus 2 example.py                           # data parallel (DDP)
    deepspeed example.py                                        # one process per GPU of this machine
    python example.py                                           # one process, no launcher

Stop and resume (the resumed run trains exactly the batches and LRs of an
uninterrupted one):

    deepspeed --num_gpus 2 example.py --max-steps 20 --checkpoint-dir ckpt
    deepspeed --num_gpus 2 example.py --checkpoint-dir ckpt --resume

Every step, rank 0 prints one line: step, epoch, B and padded S of each of its
step inputs, real tokens in the batch, padding %, LR, loss (the mean over the
real tokens of the whole batch); about every tenth of the run a progress line
with tokens/s and the time left. The settings are in ds_config.json
(``--config`` picks another); the flags below override the common ones.
"""

import argparse
import json
import logging
import math
import os
import socket
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import varbatch

HERE = os.path.dirname(os.path.abspath(__file__))


def print0(*args):
    """Prints on global rank 0 only."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(*args, flush=True)


# -----------------------------------------------------------------------------
# Data: variable-length sequences whose target is a causal running sum
# -----------------------------------------------------------------------------


class RunningSumSequences(Dataset):
    """Sequences ``x`` (L x E, normal noise) with targets ``y_t = sum_{s<=t} w.x_s / sqrt(t+1)``.

    Lengths are log-normal, clipped to ``[min_seqlen, max_seqlen]``, so most
    sequences are short and a few are long (as in text). A sample is
    ``(x, y, L)``; ``seqlens`` holds every L (the example lets varbatch
    compute them instead, with `batch_seqlens`, to show that path).
    """

    def __init__(self, num_samples, max_seqlen=64, embed_dim=16, min_seqlen=4, seed=0):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.exp(math.log(20) + 0.6 * torch.randn(num_samples, generator=gen))
        self.seqlens = lengths.round().clamp(min_seqlen, max_seqlen).long()
        self.max_seqlen, self.embed_dim = max_seqlen, embed_dim
        w = torch.randn(embed_dim, generator=gen)
        w = w / w.norm()
        self.samples = []
        for seqlen in self.seqlens.tolist():
            x = torch.randn(seqlen, embed_dim, generator=gen)                   # L x E
            y = torch.cumsum(x @ w, dim=0) / torch.arange(1, seqlen + 1).sqrt()  # L
            self.samples.append((x, y, torch.tensor(seqlen)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def pad_to_length(sample, length):
    """``sample_padding_fn``: pads x and y to ``length`` (pipeline batches share one S); keeps L."""
    x, y, seqlen = sample
    return varbatch.pad_sample(x, length), varbatch.pad_sample(y, length), seqlen


_collate_padded = varbatch.PaddedCollate(pad_value=0)


def collate(samples):
    """``dataloader_collate_fn``: ``((x B x S x E, lengths B), (y B x S, lengths B))``.

    The shape DeepSpeed's pipeline engine wants: (inputs, labels). The real
    lengths travel with the inputs (the attention masks need them) and with
    the labels (the loss ignores padding).
    """
    x, y, lengths, _ = _collate_padded(samples)
    return (x, lengths), (y, lengths)


def batch_seqlens(batch):
    """``batch_seqlens_fn``: the real length of every sample of a collated batch."""
    (_, lengths), _ = batch
    return lengths


# -----------------------------------------------------------------------------
# Model: a variable-shape attention head, then a fixed-size feed-forward
# -----------------------------------------------------------------------------
# Every layer maps a tuple (h, lengths) to the next, so the same layers run as
# nn.Sequential (DDP) or as pipeline stages (PipelineModule).


class CausalAttention(nn.Module):
    """One attention head over the real tokens of each sample: B x S x E -> B x S x E."""

    def __init__(self, embed_dim):
        super().__init__()
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, inputs):
        x, lengths = inputs                                                   # B x S x E, B
        _, seqlen, embed_dim = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)                                # B x S x E each
        pos = torch.arange(seqlen, device=x.device)
        # Per-sample causal mask: query t sees keys s <= t that are real tokens.
        mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])  # B x S x S
        scores = (q @ k.transpose(1, 2)) / math.sqrt(embed_dim)               # B x S x S
        weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        real = (pos[None, :] < lengths[:, None]).unsqueeze(-1)                # B x S x 1
        return self.out(weights @ v) * real, lengths                         # B x S x E


class TokenMixing(nn.Module):
    """Pads to the dataset's max seqlen M and mixes positions: B x S x E -> B x M x E.

    Its weight is M x M, so every input must be padded to M: the kind of
    fixed-size layer that variable S meets in real models.
    """

    def __init__(self, max_seqlen):
        super().__init__()
        self.max_seqlen = max_seqlen
        self.mix = nn.Linear(max_seqlen, max_seqlen)

    def forward(self, inputs):
        h, lengths = inputs
        h = F.pad(h, (0, 0, 0, self.max_seqlen - h.shape[1]))                 # B x M x E
        return h + self.mix(h.transpose(1, 2)).transpose(1, 2), lengths


class ChannelMLP(nn.Module):
    """Position-wise feed-forward with a residual: B x M x E -> B x M x E."""

    def __init__(self, embed_dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, embed_dim)

    def forward(self, inputs):
        h, lengths = inputs
        return h + self.fc2(F.gelu(self.fc1(h))), lengths


class Head(nn.Module):
    """One prediction per position: B x M x E -> B x M."""

    def __init__(self, embed_dim):
        super().__init__()
        self.proj = nn.Linear(embed_dim, 1)

    def forward(self, inputs):
        h, _ = inputs
        return self.proj(h).squeeze(-1)


def build_layers(max_seqlen, embed_dim, seed, hidden_dim=64):
    """The model's layers, initialized from ``seed`` (identical on every rank and path)."""
    torch.manual_seed(seed)
    return [CausalAttention(embed_dim), TokenMixing(max_seqlen), ChannelMLP(embed_dim, hidden_dim), Head(embed_dim)]


def pipeline_stages(layers, num_stages):
    """Groups the layers into ``num_stages`` stages: the attention alone, the feed-forward split after it."""
    feed_forward = layers[1:]
    bounds = [round(i * len(feed_forward) / (num_stages - 1)) for i in range(num_stages)]
    return [layers[0]] + [nn.Sequential(*feed_forward[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def token_loss(pred, labels):
    """Mean squared error over the real tokens of a step input, times its weight in the batch.

    ``labels`` is ``(y B x S, lengths B, weight)``; ``weight`` comes from
    `varbatch.micro_batch_loss_weight`, so that the engine's averaging over
    ranks and accumulation steps yields the mean over every real token of the
    batch, whatever the sizes of its micro-batches.
    """
    targets, lengths, weight = labels
    seqlen = targets.shape[1]
    real = torch.arange(seqlen, device=targets.device)[None, :] < lengths[:, None]  # B x S
    squared = (pred[:, :seqlen] - targets).pow(2) * real
    return squared.sum() / real.sum() * weight


# -----------------------------------------------------------------------------
# Training
# -----------------------------------------------------------------------------


def init_distributed(args):
    """Starts torch.distributed through DeepSpeed, also for a plain ``python example.py``."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    if "RANK" not in os.environ:  # no launcher: a world of one process
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if get_accelerator().device_name() == "cpu":
        if "OMP_NUM_THREADS" not in os.environ:
            # CPU ranks share this machine's cores: without a share each, torch gives
            # every rank all the cores, and the oversubscribed ranks run ~10x slower.
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_SIZE", "1"))))
        # DeepSpeed compiles a shared-memory all-reduce op for CPU ranks on its first
        # init (only its inference all-reduce uses it). The build takes minutes on a
        # small machine, and a build killed midway leaves a lock file under
        # ~/.cache/torch_extensions that hangs every later run. Training uses gloo.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # A rank that hangs would otherwise keep the others waiting in a collective for
    # DeepSpeed's default timeout (10 minutes, or $DEEPSPEED_TIMEOUT), and 30 minutes
    # in the groups DeepSpeed makes later (data-parallel, pipeline), which get torch's
    # default rather than this one: make this torch's default too. (A rank that dies
    # is noticed at once: the launcher stops the others.)
    timeout = timedelta(seconds=args.dist_timeout)
    torch.distributed.distributed_c10d.default_pg_timeout = timeout
    torch.distributed.distributed_c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(timeout=timeout)


def load_config(args):
    """ds_config.json (or --config), with the flags that override it."""
    with open(args.config) as f:
        config = json.load(f)
    section = config.setdefault("data_efficiency", {}).setdefault("data_sampling", {}) \
        .setdefault("dynamic_batching", {})
    if args.max_tokens is not None:
        section["max_tokens"] = args.max_tokens
    if args.lr_scaling_method is not None:
        section["lr_scaling_method"] = args.lr_scaling_method
    return config


def make_engine(args, config, dataset):
    """The DeepSpeed engine (DDP or pipeline) and varbatch's dataloader and LR scheduler."""
    import deepspeed
    layers = build_layers(dataset.max_seqlen, dataset.embed_dim, args.seed)
    if args.pipeline_num_stages:
        from deepspeed.pipe import PipelineModule
        model = PipelineModule(layers=pipeline_stages(layers, args.pipeline_num_stages),
                               num_stages=args.pipeline_num_stages, loss_fn=token_loss,
                               partition_method="uniform")
    else:
        model = nn.Sequential(*layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dataloader, lr_scheduler, _ = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset=dataset, engine=engine, dataloader_collate_fn=collate, sample_padding_fn=pad_to_length,
        batch_seqlens_fn=batch_seqlens)
    return engine, dataloader, lr_scheduler


def weigh(step_inputs, batch_tokens, num_replicas, gradient_accumulation_steps):
    """Appends each step input's loss weight to its labels: ``(inputs, (y, lengths, weight))``."""
    weighted = []
    for inputs, (targets, lengths) in step_inputs:
        weight = varbatch.micro_batch_loss_weight(int(lengths.sum()), batch_tokens, num_replicas=num_replicas,
                                                  gradient_accumulation_steps=gradient_accumulation_steps)
        weighted.append((inputs, (targets, lengths, torch.tensor(weight))))
    return weighted


def train_ddp_batch(engine, step_inputs):
    """One batch on the DDP path: forward and backward per step input; the engine steps at the boundary.

    Returns this rank's sum of weighted losses.
    """
    loss_sum = 0.0
    for (x, lengths), (targets, _, weight) in step_inputs:
        x, lengths = x.to(engine.device), lengths.to(engine.device)
        loss = token_loss(engine((x, lengths)), (targets.to(engine.device), lengths, weight.to(engine.device)))
        engine.backward(loss)
        engine.step()
        loss_sum += loss.item()
    return loss_sum


def train_pipeline_batch(engine, step_inputs, activation_shape):
    """One batch on the pipeline path. Returns the batch's loss and the (B, S) the stages now exchange.

    The stages pass B x S x E activations through buffers sized at the first
    micro-batch after `reset_activation_shape`. varbatch gives every micro-batch
    of a batch the same B and S, so a reset is needed only when the next batch's
    shape differs (``PipelineModule(dynamic_shape=True)`` instead sends the shape
    with every micro-batch).
    """
    shapes = {tuple(inputs[0].shape[:2]) for inputs, _ in step_inputs}
    if len(shapes) != 1:
        raise RuntimeError(f"the step inputs of one pipeline batch differ in shape: {sorted(shapes)}")
    shape = shapes.pop()
    if shape != activation_shape:
        engine.reset_activation_shape()
    return engine.train_batch(data_iter=iter(step_inputs)).item(), shape


def main(args):
    import deepspeed
    init_distributed(args)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    if torch.distributed.get_rank() == 0:
        logging.basicConfig(format="varbatch: %(message)s")
        logging.getLogger("varbatch").setLevel(logging.INFO)
    pipeline = args.pipeline_num_stages > 0

    # 1. Data, engine, and varbatch's loader and LR scheduler (installed as engine.lr_scheduler).
    dataset = RunningSumSequences(args.num_samples, seed=args.seed)
    engine, dataloader, lr_scheduler = make_engine(args, load_config(args), dataset)
    sampler = dataloader.variable_batch_sampler  # plan, set_epoch, state_dict
    gas = engine.gradient_accumulation_steps()
    num_replicas = sampler.num_replicas

    # 2. Resume: DeepSpeed restores the model, optimizer and LR scheduler; varbatch's sampler its position.
    start_epoch, start_batch = 0, 0
    if args.resume:
        path, client_state = engine.load_checkpoint(args.checkpoint_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in --checkpoint-dir {args.checkpoint_dir}")
        sampler.load_state_dict(client_state["varbatch_sampler"])
        start_epoch, start_batch = sampler.epoch, sampler.state_dict()["steps_done"] // gas
        print0(f"resumed from {path} at step {engine.global_steps}: epoch {start_epoch}, batch {start_batch}")
    plan = sampler.plan
    print0(f"plan of epoch {plan.epoch}: {plan.num_batches} batches of {plan.effective_batch_size} micro-batches, "
           f"{int(plan.batch_sizes.sum())} samples, B per batch {int(plan.batch_sizes.min())}.."
           f"{int(plan.batch_sizes.max())}, {plan.num_dropped} dropped; "
           f"{f'pipeline of {args.pipeline_num_stages} stages' if pipeline else 'DDP'}, "
           f"{num_replicas} data-parallel rank(s), {gas} accumulation step(s), device {engine.device}")

    # 3. Train: each batch is `gas` step inputs per rank, weighted so the loss is the batch's token mean.
    dropped = {reason: 0 for reason in varbatch.DROP_REASONS}
    samples_trained = tokens_trained = 0
    epochs_done, steps_done = float(start_epoch), None  # steps_done: step inputs done in the sampler's epoch
    activation_shape = None
    # A progress line about every tenth of the run: steps, tokens/s, ETA (plans of later
    # epochs may hold a batch more or less; the estimate uses the current one).
    total_steps = engine.global_steps + sampler.plan.num_batches * (args.epochs - start_epoch) - start_batch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    progress_every = max(1, (total_steps - engine.global_steps) // 10)
    first_step = engine.global_steps
    started = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        if args.max_steps and engine.global_steps >= args.max_steps:
            break
        sampler.set_epoch(epoch)
        plan = sampler.plan
        for reason, ids in plan.dropped.items():
            dropped[reason] += len(ids)
        batches = iter(dataloader)
        for b in range(start_batch if epoch == start_epoch else 0, plan.num_batches):
            assert lr_scheduler.steps_in_epoch == b, "the LR scheduler and the loop disagree on the batch"
            step_inputs = weigh([next(batches) for _ in range(gas)], int(plan.batch_tokens[b]), num_replicas, gas)
            shapes = [tuple(inputs[0].shape[:2]) for inputs, _ in step_inputs]  # (B, S) of each
            lr = lr_scheduler.get_last_lr()[0]  # the LR of this batch's optimizer step
            loss_sum = 0.0
            if pipeline:
                loss, activation_shape = train_pipeline_batch(engine, step_inputs, activation_shape)
            else:
                loss_sum = train_ddp_batch(engine, step_inputs)
            # Real tokens, padded slots and weighted losses of the whole batch (all data-parallel ranks).
            totals = torch.tensor([sum(int(labels[1].sum()) for _, labels in step_inputs),
                                   sum(n * s for n, s in shapes), loss_sum],
                                  dtype=torch.float64, device=engine.device)  # NCCL reduces device tensors
            if num_replicas > 1:
                torch.distributed.all_reduce(totals, group=engine.data_parallel_group)
            tokens, slots = int(totals[0]), totals[1].item()
            if not pipeline:  # the weighted means sum to (ranks x accumulation steps) x the batch's mean
                loss = totals[2].item() / (num_replicas * gas)
            samples_trained += int(plan.batch_sizes[b])
            tokens_trained += tokens
            epochs_done, steps_done = epoch + (b + 1) / plan.num_batches, (b + 1) * gas
            print0(f"step {engine.global_steps:4d} | epoch {epoch} | B {','.join(str(n) for n, _ in shapes)} | "
                   f"S {','.join(str(s) for _, s in shapes)} | tokens {tokens} | "
                   f"padding {100 * (1 - tokens / slots):.1f}% | lr {lr:.6e} | loss {loss:.6f}")
            done = engine.global_steps - first_step
            if done % progress_every == 0:
                elapsed = time.perf_counter() - started
                eta = elapsed / done * max(0, total_steps - engine.global_steps)
                print0(f"progress | step {engine.global_steps}/{total_steps} | "
                       f"tokens/s {tokens_trained / max(elapsed, 1e-9):.0f} | ETA {eta:.1f} s")
            if args.max_steps and engine.global_steps >= args.max_steps:
                break
    wall = time.perf_counter() - started

    # 4. Save (engine + sampler position) and report.
    if args.checkpoint_dir:
        engine.save_checkpoint(args.checkpoint_dir,
                               client_state={"varbatch_sampler": sampler.state_dict(steps_done=steps_done)})
        print0(f"saved checkpoint at step {engine.global_steps} in {args.checkpoint_dir}")
    print0(f"summary | epochs {epochs_done:.3g} | steps {engine.global_steps} | samples trained {samples_trained} | "
           f"dropped {' '.join(f'{reason}={count}' for reason, count in dropped.items())} | "
           f"wall {wall:.1f} s | tokens/s {tokens_trained / max(wall, 1e-9):.0f}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(HERE, "ds_config.json"),
                        help="DeepSpeed config with the dynamic_batching section (default: ds_config.json)")
    parser.add_argument("--pipeline-num-stages", type=int, default=0,
                        help="0: data parallel (DDP); N >= 2: PipelineModule with N stages (needs N processes)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train (default 10)")
    parser.add_argument("--num-samples", type=int, default=2000, help="dataset size (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dataset and the model's init")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="token budget of one micro-batch (default: the config's max_tokens)")
    parser.add_argument("--lr-scaling-method", choices=varbatch.LR_SCALING_METHODS, default=None,
                        help="how the LR follows the batch size (default: the config's lr_scaling_method)")
    parser.add_argument("--max-steps", type=int, default=0,
                        help="stop after this global optimizer step (0: train every epoch)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save the engine and the varbatch sampler here when the run ends")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    parser.add_argument("--dist-timeout", type=float, default=180,
                        help="seconds a rank waits for the others in a collective before failing (default 180)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)

    stages = args.pipeline_num_stages
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if stages == 1 or stages < 0 or stages > 4:
        parser.error(f"--pipeline-num-stages should be 0 (DDP) or 2..4 (the model has 4 layers), but got {stages}")
    if stages and world_size % stages:
        parser.error(f"--pipeline-num-stages {stages} needs a multiple of {stages} processes (one per stage), but "
                     f"this run has {world_size}. Run: deepspeed --num_gpus {stages} example.py "
                     f"--pipeline-num-stages {stages} (on a CPU machine each GPU is a process; on a machine with "
                     f"fewer GPUs run the DDP path: deepspeed example.py)")
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir, the folder a run with --checkpoint-dir saved into")
    for name in ("epochs", "num_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} should be >= 1, but got {getattr(args, name)}")
    return args


if __name__ == "__main__":
    main(parse_args())
