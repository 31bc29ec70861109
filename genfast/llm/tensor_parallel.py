"""Tensor parallelism over torch.distributed: every rank holds a slice of each block's heads and
feed-forward columns (the Megatron layout) and the ranks sum their partial outputs.

Per transformer block, for world size W and rank r:
- attention wqkv, column-parallel: rank r keeps q heads [r*H/W, (r+1)*H/W) and kv heads
  [r*KV/W, (r+1)*KV/W). Both are contiguous blocks of the same fraction, so every local q head
  still reads its own kv head (GQA). The fused [q | k | v] rows are sliced part by part and
  re-fused; a q/k/v bias goes with its rows.
- attention wo, row-parallel: the input columns of those q heads. Partial outputs are summed
  across ranks (all-reduce) and the out bias is added once, after the sum.
- feed-forward w13, column-parallel: the same slice of the gate half and of the up half.
- feed-forward w2, row-parallel: the matching input columns, all-reduced.
- a mixture of experts is sharded the same way inside every expert (each rank holds the same
  slice of every expert's columns; the router is replicated), not expert by expert: a token's k
  experts then cost every rank the same 1/W of their bytes, whatever the routing, and the
  block keeps the dense MLP's single all-reduce. Whole experts per rank would leave a rank idle
  whenever a token's experts live elsewhere (top-2 of 8 on 2 ranks: both on one rank 3 times in
  7) and would need the tokens exchanged (all-to-all) for batches.
Embedding, norms and the output head are replicated: simplest, and the head's logits are then
complete on every rank (vocab-parallel would add an all-gather per token). Two all-reduces per
block per forward, the minimum for this layout; they are functional collectives, which
torch.compile traces into the graph (fullgraph, no break).

Quantized layers are sharded as codes, never re-quantized: rows are sliced with their scales,
columns in whole quantization groups, so each rank computes with exactly the weights of TP=1.

Every rank runs the same program on the same inputs and, after each all-reduce, holds the same
sums, so all ranks compute the same logits and sample the same tokens (one shared RNG seed; see
`join`). Rank 0 reads the input (`from_main_rank`) and prints; `check_same_tokens` verifies.
Ranks are started by `launch_tp` (torch.distributed's elastic launcher, the engine of `torchrun
--standalone`) or by torchrun itself; either way `launch_or_join` is the entry.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from genfast.errors import UserError
from genfast.llm.model import families
from genfast.llm.model.config import ModelArgs
from genfast.llm.model.layers import TransformerBlock
from genfast.llm.model.transformer import Transformer
from genfast.nn import ExpertLinear, Linear
from genfast.quant.grids import QuantizedWeight
from genfast.quant.linear import QuantExpertLinear, QuantLinear, quantized_layer

QUANTIZED = (QuantLinear, QuantExpertLinear)

T = TypeVar("T")


# ---- the process group ---------------------------------------------------------------------


def launched() -> bool:
    """True in a process started by torchrun or `launch_tp` (the launcher sets these variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def current_world_size() -> int:
    """Ranks in the joined process group (1 when there is none)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main_rank() -> bool:
    return current_rank() == 0


def join(tp: int) -> None:
    """Join the process group of the ranks the launcher started (gloo on CPU, NCCL on CUDA).

    Also gives every rank the same RNG state (sampling with temperature draws random numbers on
    each rank, and they must draw the same ones) and silences the followers' stdout.
    """
    if not launched():
        raise UserError(
            f"--tp {tp} runs {tp} processes: start it as `genfast ... --tp {tp}` (which "
            "launches them) or under torchrun"
        )
    started = int(os.environ["WORLD_SIZE"])
    if started != tp:
        raise UserError(
            f"--tp {tp} was asked for, but the launcher started {started} processes; "
            f"make them equal (torchrun --nproc-per-node {tp})"
        )
    if not dist.is_initialized():
        if gpu_per_rank(started):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            backend = "cpu:gloo,cuda:nccl"  # CPU tensors (e.g. --device cpu, object broadcasts) via gloo
        else:  # a CPU machine, or --device cpu where there are fewer GPUs than ranks (check_devices)
            backend = "gloo"
        dist.init_process_group(backend)
        atexit.register(leave)
    torch.manual_seed(from_main_rank(torch.seed))
    if not is_main_rank():  # every rank produces the same text: rank 0 prints it (errors still show)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (open for the rest of the process)


def gpu_per_rank(ranks: int) -> bool:
    """Whether each of `ranks` ranks on this machine can have a CUDA GPU of its own."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= ranks


def check_devices(device: str, tp: int) -> None:
    """`--device` resolved, and on CUDA a GPU for each of the `tp` ranks (NCCL runs one rank per
    GPU): checked before the ranks start, so `--tp 2` on one GPU is one clear error."""
    from genfast.platform.hardware import resolve_device

    if resolve_device(device).type == "cuda" and not gpu_per_rank(tp):
        gpus = torch.cuda.device_count()
        fewer = f"--tp {gpus} at most, or " if gpus > 1 else ""
        raise UserError(
            f"--tp {tp} on CUDA runs each rank on a GPU of its own, but torch sees {gpus}; "
            f"use {fewer}--device cpu to run the ranks on the CPU"
        )


def leave() -> None:
    """Leave the joined process group (a no-op if there is none); run at exit.

    gloo's worker threads free a finished collective's tensors after the caller has its result,
    and freeing a tensor Python has seen takes the GIL. A worker that asks for the GIL once the
    interpreter is finalizing is ended inside C++ and the process aborts ("terminate called
    without an active exception"), which happened in ~1 of 8 runs when a command's last
    collective was its last statement. Sleeping releases the GIL to those workers first."""
    if dist.is_available() and dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()


def tp_device(device: torch.device) -> torch.device:
    """This rank's device: on CUDA each rank has its own GPU (its local rank), made the current
    device again (resolving `--device cuda:N` made cuda:N current in every rank)."""
    if device.type == "cuda" and launched():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return device


def from_main_rank(read: Callable[[], T]) -> T:
    """`read()` run on rank 0 and its result given to every rank (user input is read once).
    A UserError raised there is raised on every rank, so none is left waiting."""
    if current_world_size() == 1:
        return read()
    box: list[tuple[bool, object] | None] = [None]
    if is_main_rank():
        try:
            box[0] = (True, read())
        except UserError as e:
            box[0] = (False, str(e))
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise UserError(str(value))
    return value  # type: ignore[return-value]


def check_same_tokens(token_ids: list[list[int]]) -> None:
    """Raise if the ranks generated different tokens (a bug: their logits must be identical)."""
    if current_world_size() == 1:
        return
    gathered: list[list[list[int]] | None] = [None] * current_world_size()
    dist.all_gather_object(gathered, token_ids)
    differing = [r for r, ids in enumerate(gathered) if ids != gathered[0]]
    if differing:
        raise RuntimeError(f"tensor-parallel ranks {differing} generated different tokens than rank 0")


# ---- launching -----------------------------------------------------------------------------


def default_threads(ranks: int) -> int:
    """CPU threads per rank: this process's cores shared evenly."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // ranks)


def launch_tp(argv: Sequence[str], n: int, grace_s: float = 30.0, module: str = "genfast") -> int:
    """Run `python -m <module> *argv` as `n` ranks on this machine and return their exit code (0,
    or the first failing rank's). The ranks see the launcher's environment (RANK, WORLD_SIZE, ...), so
    the same command line joins instead of launching again.

    Ctrl-C or SIGTERM is passed on to the ranks, which get `grace_s` seconds to finish (e.g. a
    server's in-flight requests) before they are killed; this process then ends as they do."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torchrun would set 1 thread per rank; give each rank its share of the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(default_threads(n)))
    # The ranks print their own errors; the agent's log lines would only repeat them.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # torch before 2.13 (the lent GPU machines' 2.11) has no shutdown_timeout; its agent gives the
    # ranks a fixed 30 s.
    fields = {field.name for field in dataclasses.fields(LaunchConfig)}
    grace = {"shutdown_timeout": math.ceil(grace_s)} if "shutdown_timeout" in fields else {}
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        **grace,
    )
    try:
        elastic_launch(config, sys.executable)("-m", module, *argv)
    except SignalException as e:
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        signal.signal(e.sigval, signal.SIG_DFL)  # end by the same signal, as a single process would
        os.kill(os.getpid(), e.sigval)
        return 128 + e.sigval  # not reached
    except ChildFailedError as e:
        failed_rank, failure = e.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode
        # Killed by a signal (e.g. out of memory): the rank could not say so itself.
        print(
            f"genfast: error: tensor-parallel rank {failed_rank} was killed by signal {-failure.exitcode}",
            file=sys.stderr,
        )
        return 1
    return 0


def launch_or_join(tp: int, model: str | None, device: str, argv: Sequence[str], grace_s: float = 30.0) -> int | None:
    """The `--tp N` entry of a command. In a rank (started by torchrun or by us): join the others
    and return None, so the command goes on. Otherwise: check that the model divides and that the
    device has room for the ranks, launch them with this same command line (see `launch_tp` for
    `grace_s`), and return their exit code."""
    check_devices(device, tp)
    if launched():
        join(tp)
        return None
    from genfast.llm.checkpoints.checkpoint import resolve_checkpoint

    check_shardable(resolve_checkpoint(model).args, tp)  # fail before starting processes
    return launch_tp(argv, tp, grace_s)


# ---- sharding ------------------------------------------------------------------------------


def check_shardable(args: ModelArgs, world: int) -> None:
    """Heads (q and kv) and the feed-forward width must split evenly over `world` ranks, and the
    family's blocks must be ones the sharding knows."""
    why = families.family(args.family).not_shardable
    if why is not None and world > 1:
        raise UserError(f"--tp {world}: {args.family} models do not run tensor-parallel yet ({why}); use --tp 1")
    sizes = {
        "attention heads": args.n_heads,
        "key/value heads": args.n_kv_heads,
        "feed-forward width": args.intermediate_size,
    }
    if args.n_experts:
        sizes["expert width"] = args.expert_intermediate_size
    bad = [f"{n} {what}" for what, n in sizes.items() if n % world]
    if bad:
        common = math.gcd(*sizes.values())
        fits = [str(d) for d in range(2, common + 1) if common % d == 0]
        hint = f"--tp {' or '.join(fits)}" if fits else "no --tp above 1"
        raise UserError(
            f"--tp {world} needs the model's heads and feed-forward widths to divide by {world}, but it "
            f"has {' and '.join(bad)}; this model supports {hint}"
        )


class RowParallelLinear(nn.Module):
    """This rank's slice of a layer's input features: the partial outputs of all ranks are summed
    (all-reduce) and the bias is added once, after the sum."""

    def __init__(self, local: nn.Module, bias: Tensor | None, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.local = local
        self.register_buffer("bias", bias)
        self.group = group

    def forward(self, x: Tensor, *args: Tensor) -> Tensor:  # args: each row's expert, for experts
        out = funcol.all_reduce(self.local(x, *args), "sum", self.group)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def shard_model(model: Transformer, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> Transformer:
    """Keep rank `rank`'s share of every block (see the module docstring), in place. The model
    must be loaded (and quantized, if it is to be) and have no KV caches yet. `group`: the ranks
    to all-reduce over (default: the joined world, which must have `world_size` ranks). Everything
    is checked before anything changes: on an error the model is left whole."""
    if world_size == 1:
        return model
    check_shardable(model.args, world_size)
    if model.max_seq_len:
        raise ValueError("shard the model before setting up its KV caches")
    for i, block in enumerate(model.layers):
        _check_block_split(block, world_size, f"layers.{i}.")
    for i, block in enumerate(model.layers):
        shard_block(block, rank, world_size, f"layers.{i}.", group)
    return model


def shard_block(
    block: TransformerBlock, rank: int, world_size: int, prefix: str = "", group: dist.ProcessGroup | None = None
) -> None:
    """Keep rank `rank`'s share of one transformer block, in place (`shard_model`, a block at a
    time: the loader shards each block as it reads it). `prefix`: the block's name, for errors."""
    _check_block_split(block, world_size, prefix)
    if group is None:
        if current_world_size() != world_size:
            raise ValueError(
                f"sharding for {world_size} ranks needs a process group of {world_size} "
                "(tensor_parallel.join, or pass `group`)"
            )
        group = dist.group.WORLD
    attn, ff = block.attention, block.feed_forward
    hd, heads, kv_heads = attn.head_dim, attn.n_heads // world_size, attn.n_kv_heads // world_size
    q_rows, kv_rows = _block(rank, heads * hd), _block(rank, kv_heads * hd)
    attn.wqkv = _rows(
        attn.wqkv, torch.cat([q_rows, attn.n_heads * hd + kv_rows, (attn.n_heads + attn.n_kv_heads) * hd + kv_rows])
    )
    attn.wo = _row_parallel(attn.wo, rank, heads * hd, group)
    attn.n_heads, attn.n_kv_heads = heads, kv_heads

    width = ff.intermediate_size // world_size
    cols = _block(rank, width)
    ff.w13 = _rows(ff.w13, torch.cat([cols, ff.intermediate_size + cols]))
    ff.w2 = _row_parallel(ff.w2, rank, width, group)
    ff.intermediate_size = width


def _check_block_split(block: TransformerBlock, world_size: int, prefix: str) -> None:
    attn, ff = block.attention, block.feed_forward
    if isinstance(attn.wo, RowParallelLinear):
        raise ValueError(f"{prefix}: block is already sharded")
    _check_column_split(attn.wo, attn.n_heads * attn.head_dim // world_size, f"{prefix}attention.wo")
    _check_column_split(ff.w2, ff.intermediate_size // world_size, f"{prefix}feed_forward.w2")


def _block(rank: int, size: int) -> Tensor:
    """Indices of rank `rank`'s contiguous block of `size`."""
    return torch.arange(rank * size, (rank + 1) * size)


def _activation_dtype(layer: nn.Module) -> torch.dtype | None:
    """The activations' dtype a quantized layer was made for (a QuantExpertLinear keeps none)."""
    return getattr(layer, "activation_dtype", None)


def _rows(layer: nn.Module, index: Tensor) -> nn.Module:
    """The layer restricted to the output features `index` (a column-parallel shard; of each
    expert, for experts)."""
    bias = None if layer.bias is None else layer.bias[index].clone()
    if isinstance(layer, QUANTIZED):
        qw = layer.quantized_weight()
        rows = QuantizedWeight(
            qw.codes[..., index, :], qw.scales[..., index, :], qw.mins[..., index, :], qw.bits, qw.group_size,
            qw.in_features,
        )  # fmt: skip
        return quantized_layer(rows, bias, layer.dynamic, _activation_dtype(layer))
    return _linear(layer.weight[..., index, :], bias)


def _column_slice(qw: QuantizedWeight, start: int, stop: int) -> tuple[int, slice]:
    """(group size, groups) of input columns [start, stop) of a quantized weight. Per-channel
    scales (one group per row) serve every slice as they are, the slice becoming the group."""
    if qw.group_size == qw.codes.shape[-1]:
        return stop - start, slice(0, 1)
    return qw.group_size, slice(start // qw.group_size, stop // qw.group_size)


def _check_column_split(layer: nn.Module, columns: int, name: str) -> None:
    """A quantized layer splits by input features only in whole groups (and in multiples of 32,
    the native kernel's activation blocks)."""
    if not isinstance(layer, QUANTIZED):
        return
    qw = layer.quantized_weight()
    group_size, _ = _column_slice(qw, 0, columns)
    if qw.codes.shape[-1] != qw.in_features or columns % group_size or group_size % 32:
        raise UserError(
            f"{name} has {qw.in_features} input features quantized in groups of {qw.group_size}; "
            f"split over the ranks, each gets {columns} columns, which must be whole groups and a "
            "multiple of 32; use another --tp or --group-size"
        )


def _row_parallel(layer: nn.Module, rank: int, columns: int, group: dist.ProcessGroup) -> RowParallelLinear:
    """The layer restricted to rank `rank`'s block of `columns` input features, all-reduced."""
    start, stop = rank * columns, (rank + 1) * columns
    bias = None if layer.bias is None else layer.bias.detach().clone()
    if not isinstance(layer, QUANTIZED):
        return RowParallelLinear(_linear(layer.weight[..., start:stop], None), bias, group)
    qw = layer.quantized_weight()
    group_size, groups = _column_slice(qw, start, stop)
    local = QuantizedWeight(
        qw.codes[..., start:stop].contiguous(),
        qw.scales[..., groups].contiguous(),
        qw.mins[..., groups].contiguous(),
        qw.bits,
        group_size,
        columns,
    )
    return RowParallelLinear(quantized_layer(local, None, layer.dynamic, _activation_dtype(layer)), bias, group)


def _linear(weight: Tensor, bias: Tensor | None) -> Linear | ExpertLinear:
    if weight.dim() == 3:  # a mixture's experts
        with torch.device("meta"):
            experts = ExpertLinear(weight.shape[0], weight.shape[2], weight.shape[1])
        experts.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        return experts
    with torch.device("meta"):
        layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer
