"""varbatch with DeepSpeed: token-budget batches and batch-size-aware LR, data parallel and pipeline.

A causal attention head and a fixed-size feed-forward learn a running sum over
variable-length sequences; each batch has its own B and S, and the LR follows
its real tokens. Settings: ds_config.json. On a CPU machine each "GPU" is a process.

    deepspeed --num_gpus 2 example.py --pipeline-num-stages 2   # pipeline: attention | feed-forward
    deepspeed --num_gpus 2 example.py                           # data parallel (DDP)
    python example.py                                           # one process, no launcher
    deepspeed --num_gpus 2 example.py --max-steps 20 --checkpoint-dir ckpt   # stop, then resume exactly:
    deepspeed --num_gpus 2 example.py --checkpoint-dir ckpt --resume
    deepspeed --num_gpus 2 example.py --padding-free             # flat rows (also with --pipeline-num-stages 2)

--padding-free trains each step input as one flat row under the sum budget: the attention keeps each
sample to itself by a block-diagonal causal mask read from the positions, and the feed-forward works
per token. --per-token trains that model on padded step inputs of the same plan, for comparison.
"""

import argparse
import collections
import json
import math
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

import varbatch


def print0(*args):  # on rank 0 only
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(*args, flush=True)


# -- 1. Data and the two callbacks --------------------------------------------
class RunningSumSequences(list):
    """Samples ``(x, y)``: ``x`` is L x E noise, ``y_t = sum_{s<=t} w.x_s / sqrt(t+1)``; L log-normal in [4, 64]."""

    def __init__(self, num_samples, max_seqlen=64, embed_dim=16, seed=0):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.exp(math.log(20) + 0.6 * torch.randn(num_samples, generator=gen))
        self.seqlens = lengths.round().clamp(4, max_seqlen).long()
        self.max_seqlen, self.embed_dim = max_seqlen, embed_dim
        w = torch.randn(embed_dim, generator=gen)
        xs = [torch.randn(n, embed_dim, generator=gen) for n in self.seqlens.tolist()]  # L x E
        super().__init__((x, torch.cumsum(x @ (w / w.norm()), 0) / torch.arange(1, len(x) + 1).sqrt()) for x in xs)


def collate(samples, seqlens=None):
    """``((x B x S x E, lengths), (y B x S, lengths))``: (inputs, labels); ``seqlens``: varbatch's real lengths."""
    x, y, lengths = varbatch.PaddedCollate()(samples, seqlens=seqlens)
    return (x, lengths), (y, lengths)


def flat_collate(samples, seqlens=None):
    """``((x 1 x T x E, positions 1 x T), (y 1 x T, real tokens))``: one flat row, positions restarting at each
    sample; in a pipeline the row ends in a padding segment (the batch's rows share one length) that the loss skips."""
    x, y, _, _, positions = varbatch.FlatCollate()(samples, seqlens=seqlens)
    real = torch.tensor([len(sample[0]) for sample in samples]).sum().reshape(1)
    return (x, positions), (y, real)


def batch_seqlens(batch):
    """The real length of every sample of a collated batch: varbatch computes the seqlens with it, once."""
    return batch[0][1]


# -- 2. The model: layers map (h, lengths) to the next, as nn.Sequential or pipeline stages
class CausalAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, inputs):
        x, lengths = inputs  # B x S x E and B; or, flat, 1 x T x E and the positions 1 x T
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        pos = torch.arange(x.shape[1], device=x.device)
        if lengths.dim() == 2:  # a flat row: each token sees its own sample (positions restart at 0) up to itself
            sample = (lengths[0] == 0).cumsum(0)  # T
            mask = (pos[:, None] >= pos[None, :]) & (sample[:, None] == sample[None, :])  # T x T, block-diagonal
            return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), lengths
        mask = (pos[:, None] >= pos[None, :]) & (pos[None, None, :] < lengths[:, None, None])  # B x S x S: causal, real
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # memory-efficient kernels store no S x S scores
        return self.out(h) * (pos[None, :, None] < lengths[:, None, None]), lengths


class FeedForward(nn.Module):
    """Pads to the dataset's longest sample M and mixes positions and channels: B x S x E -> B x M (fixed size)."""

    def __init__(self, max_seqlen, dim, hidden=64):
        super().__init__()
        self.max_seqlen, self.mix = max_seqlen, nn.Linear(max_seqlen, max_seqlen)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, 1)

    def forward(self, inputs):
        h, _ = inputs
        h = F.pad(h, (0, 0, 0, self.max_seqlen - h.shape[1]))  # B x M x E
        h = h + self.mix(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h + self.mlp(h)).squeeze(-1)  # B x M


class TokenFeedForward(nn.Module):
    """Per token, as a flat row needs (no position mixes with another): B x S x E -> B x S."""

    def __init__(self, dim, hidden=64):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, 1)

    def forward(self, inputs):
        h, _ = inputs
        return self.head(h + self.mlp(h)).squeeze(-1)


def token_loss(pred, labels):
    """Mean squared error over the real tokens of a step input, times its weight (see `weigh`)."""
    y, lengths, weight = labels
    real = torch.arange(y.shape[1], device=y.device)[None, :] < lengths[:, None]  # B x S
    return ((pred[:, : y.shape[1]] - y).pow(2) * real).sum() / real.sum() * weight


def weigh(step_inputs, batch_tokens, num_replicas, accumulation):
    """Each step input's loss weight, so the engine's average over ranks and steps is the batch's token mean
    (``batch_tokens``: the batch's real tokens over all ranks and steps, its record's count)."""
    return [
        (
            inputs,
            (
                y,
                lengths,
                torch.tensor(
                    varbatch.micro_batch_loss_weight(
                        int(lengths.sum()),
                        batch_tokens,
                        num_replicas=num_replicas,
                        gradient_accumulation_steps=accumulation,
                    )
                ),
            ),
        )
        for inputs, (y, lengths) in step_inputs
    ]


def warmup_cosine(t, steps, warmup=10, floor=0.1):
    """The schedule: linear warmup over ``warmup`` steps, then a cosine down to ``floor`` at step ``steps``."""
    progress = min(1.0, max(0, t - warmup) / max(1, steps - warmup))
    return (t + 1) / warmup if t < warmup else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# -- 3. Training -----------------------------------------------------------------
def init_distributed(args):
    """torch.distributed through DeepSpeed, also for a plain ``python example.py``; CPU runs made robust."""
    import deepspeed

    if "RANK" not in os.environ:  # no launcher: a world of one process, on a free port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1])
            )
    if deepspeed.get_accelerator().device_name() == "cpu":
        # Each CPU rank gets its share of the cores (oversubscribed ranks run ~10x slower); DeepSpeed's shared-
        # memory all-reduce op is not compiled (minutes; a killed build leaves a lock that hangs later runs).
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_SIZE", "1"))))
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # A frozen rank fails the job after --dist-timeout, not after 30 minutes, in every group DeepSpeed makes.
    c10d, timeout = torch.distributed.distributed_c10d, timedelta(seconds=args.dist_timeout)
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(timeout=timeout)


def build_engine(args, pipeline):
    """1. The data, the model and the engine (DDP, or two pipeline stages: attention | feed-forward)."""
    import deepspeed

    with open(args.config) as f:
        config = json.load(f)
    section = config["data_efficiency"]["data_sampling"]["dynamic_batching"]
    if args.max_tokens:
        section["max_tokens"] = args.max_tokens
    if args.padding_free or args.per_token:  # flat rows are bounded by the sum budget; --per-token: the same plan
        section.update(budget="sum", padding_free=args.padding_free)
    dataset = RunningSumSequences(args.num_samples, seed=args.seed)
    torch.manual_seed(args.seed)
    attention = CausalAttention(dataset.embed_dim)  # first: the padded mode's weights as they always were
    if args.padding_free or args.per_token:
        layers = [attention, TokenFeedForward(dataset.embed_dim)]
    else:
        layers = [attention, FeedForward(dataset.max_seqlen, dataset.embed_dim)]
    model = (
        deepspeed.pipe.PipelineModule(layers, num_stages=2, loss_fn=token_loss, partition_method="uniform")
        if pipeline
        else nn.Sequential(*layers)
    )
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return dataset, engine, optimizer


def build_loader(args, dataset, engine, optimizer):
    """2. varbatch's loader and LR scheduler (as engine.lr_scheduler), sized exactly: every epoch has len(sampler).
    The loader yields each step input with its batch's record (`varbatch.Batch`): its real tokens, its end."""

    def schedule(sampler):
        steps = len(sampler) // sampler.gradient_accumulation_steps * args.epochs
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: warmup_cosine(t, steps))

    dataloader, lr_scheduler, _ = varbatch.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset,
        engine,
        dataloader_collate_fn=flat_collate if args.padding_free else collate,
        sample_padding_fn=varbatch.pad_sample,
        batch_seqlens_fn=batch_seqlens,
        dataset_seqlens=dataset.seqlens.tolist() if args.padding_free else None,  # flat: no padded batch to measure
        lr_scheduler_fn=schedule,
        batch_count="tokens",  # each step input as (step input, its Batch record), the count in real tokens
    )
    return dataloader, lr_scheduler


def resume(args, engine, sampler):
    """3. DeepSpeed restores the model, optimizer and LR scheduler; the sampler its position."""
    path, client_state = engine.load_checkpoint(args.checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"--resume: no checkpoint in --checkpoint-dir {args.checkpoint_dir}")
    sampler.load_state_dict(client_state["varbatch_sampler"])
    print0(f"resumed from {path} at step {engine.global_steps}; the sampler goes on in epoch {sampler.epoch}")


def train_batch(engine, step_inputs, pipeline, shape, parts):
    """4. Trains one batch, this rank's step inputs; returns the loss and the activation shape the stages now hold.

    The loss is the batch's under a pipeline, this rank's part of it under DDP: each step input's over ``parts``, the
    step inputs of the batch on all ranks.
    """
    if pipeline:  # 4a. one call trains the batch; the stages exchange activations of one shape
        first = tuple(step_inputs[0][0][0].shape[:2])
        if first != shape:
            engine.reset_activation_shape()
        return engine.train_batch(data_iter=iter(step_inputs)).item(), first
    loss = 0.0  # 4b. forward and backward per step input; the engine steps at the batch boundary
    for inputs, labels in step_inputs:
        inputs, labels = [[t.to(engine.device) for t in part] for part in (inputs, labels)]
        step_loss = token_loss(engine(inputs), labels)
        engine.backward(step_loss)
        engine.step()
        loss += step_loss.item() / parts
    return loss, shape


def batch_totals(engine, step_inputs, shapes, loss, ranks):
    """The batch's real tokens, padded slots and loss (as `train_batch` gave it), summed over the data-parallel
    ranks."""
    totals = torch.tensor(
        [sum(int(labels[1].sum()) for _, labels in step_inputs), sum(n * s for n, s in shapes), loss],
        dtype=torch.float64,
        device=engine.device,
    )
    if ranks > 1:  # the whole batch: every data-parallel rank
        torch.distributed.all_reduce(totals, group=engine.data_parallel_group)
    return int(totals[0]), totals[1].item(), totals[2].item()


class Tally:
    """What the run has trained, for the progress lines (about ten a run) and the summary."""

    def __init__(self, first_step, total_steps):
        self.first_step, self.total_steps = first_step, total_steps
        self.every = max(1, (total_steps - first_step) // 10)
        self.started = time.perf_counter()
        self.dropped = collections.Counter()
        self.samples = 0
        self.tokens = 0
        self.slots = 0.0

    def add(self, samples, tokens, slots, step):
        """Counts a batch trained, and prints a progress line at every tenth of the run."""
        self.samples += samples
        self.tokens += tokens
        self.slots += slots
        if (step - self.first_step) % self.every == 0:
            elapsed = time.perf_counter() - self.started
            eta = elapsed / (step - self.first_step) * (self.total_steps - step)
            print0(
                f"progress | step {step}/{self.total_steps} | tokens/s {self.tokens / elapsed:.0f} | ETA {eta:.1f} s"
            )

    def summary(self, epochs_done, step):
        """The summary line: epochs, steps, samples, drops, padding, wall time and throughput since the start."""
        wall = time.perf_counter() - self.started
        return (
            f"summary | epochs {epochs_done:.3g} | steps {step} | samples trained {self.samples} | dropped "
            f"{' '.join(f'{r}={n}' for r, n in self.dropped.items())} | padding "
            f"{100 * (1 - self.tokens / max(self.slots, 1)):.1f}% | wall {wall:.1f} s | "
            f"tokens/s {self.tokens / max(wall, 1e-9):.0f}"
        )


def main(args):
    init_distributed(args)
    pipeline = args.pipeline_num_stages > 0
    dataset, engine, optimizer = build_engine(args, pipeline)
    dataloader, lr_scheduler = build_loader(args, dataset, engine, optimizer)
    sampler, gas, ranks = dataloader.variable_batch_sampler, engine.gradient_accumulation_steps(), engine.dp_world_size
    if args.resume:
        resume(args, engine, sampler)
    total_steps = min(len(sampler) // gas * args.epochs, args.max_steps or 10**9)
    print0(
        f"{total_steps} optimizer steps of {sampler.effective_batch_size} micro-batches: "
        f"{'pipeline' if pipeline else 'DDP'}{', padding-free' if args.padding_free else ''}, {ranks} data-parallel "
        f"rank(s), device {engine.device}"
    )

    # 4. Train. Each batch is `gas` step inputs per rank, gathered up to the one its record marks last, and
    # weighted to the batch's token mean; the engine steps the scheduler (its fp16 skips followed).
    tally, shape = Tally(engine.global_steps, total_steps), None
    trained, epochs_done = None, sampler.epoch  # the record of the last step input trained; epochs done
    for epoch in range(sampler.epoch, args.epochs):
        if engine.global_steps >= total_steps:
            break
        sampler.set_epoch(epoch)  # a state saved at an epoch's end resumes as its empty rest: then the next
        plan, step_inputs = sampler.plan, []
        tally.dropped.update({reason: len(ids) for reason, ids in plan.dropped.items()})
        for step_input, batch in dataloader:
            step_inputs.append(step_input)
            if not batch.last:
                continue
            step_inputs = weigh(step_inputs, batch.count, ranks, gas)
            shapes, lr = [tuple(inputs[0].shape[:2]) for inputs, _ in step_inputs], lr_scheduler.get_last_lr()[0]
            loss, shape = train_batch(engine, step_inputs, pipeline, shape, ranks * gas)
            tokens, slots, total_loss = batch_totals(engine, step_inputs, shapes, loss, ranks)
            loss = loss if pipeline else total_loss
            trained, epochs_done, step_inputs = batch, epoch + (batch.step_input + 1) / len(sampler), []
            print0(
                f"step {engine.global_steps:4d} | epoch {epoch} | B {','.join(str(n) for n, _ in shapes)} | "
                f"S {','.join(str(s) for _, s in shapes)} | tokens {tokens} | padding "
                f"{100 * (1 - tokens / slots):.1f}% | lr {lr:.6e} | loss {loss:.6f}"
            )
            tally.add(int(plan.batch_sizes[batch.step_input // gas]), tokens, slots, engine.global_steps)
            if engine.global_steps >= total_steps:
                break

    # 5. Save the engine and the sampler's position after the last step input trained (a loader reads ahead).
    summary = tally.summary(epochs_done, engine.global_steps)  # the wall time of the training alone
    if args.checkpoint_dir:
        engine.save_checkpoint(args.checkpoint_dir, client_state={"varbatch_sampler": sampler.state_dict(trained)})
        print0(f"saved checkpoint at step {engine.global_steps} in {args.checkpoint_dir}")
    print0(summary)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json"),
        help="DeepSpeed config with the dynamic_batching section (default: ds_config.json)",
    )
    parser.add_argument(
        "--pipeline-num-stages",
        type=int,
        default=0,
        choices=[0, 2],
        help="0: data parallel (DDP); 2: a pipeline of 2 stages (needs a multiple of 2 processes)",
    )
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train (default 10)")
    parser.add_argument("--num-samples", type=int, default=2000, help="dataset size (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dataset and the model's initial weights")
    parser.add_argument("--max-tokens", type=int, help="token budget of one micro-batch (default: the config's)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this global optimizer step (0: never)")
    parser.add_argument("--checkpoint-dir", help="save the engine and varbatch's sampler here at the end")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    parser.add_argument(
        "--padding-free",
        action="store_true",
        help="one flat row per step input (the sum budget, a block-diagonal attention mask, a per-token feed-forward)",
    )
    parser.add_argument(
        "--per-token",
        action="store_true",
        help="the --padding-free model and plan on padded step inputs (to compare the two)",
    )
    parser.add_argument("--dist-timeout", type=float, default=180, help="seconds a rank waits in a collective")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()
    if args.pipeline_num_stages and int(os.environ.get("WORLD_SIZE", "1")) % 2:
        parser.error(
            "--pipeline-num-stages 2 needs a multiple of 2 processes (one per stage). Run: deepspeed "
            "--num_gpus 2 example.py --pipeline-num-stages 2 (on a CPU machine each GPU is a process)"
        )
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir, the folder a run with --checkpoint-dir saved into")
    main(args)
    sys.stdout.flush()
    os._exit(0)  # skips teardown: gloo groups in DeepSpeed's globals can abort it (SIGABRT) after the work is saved
