"""Data-parallel training that does the work of one big batch: N processes x batch b train exactly as one
process with batch N*b does.

- Examples: every process draws the same global micro-batch of N*b examples (from (seed, step)) and keeps its
  own slice of b rows, as a distributed sampler does (`BatchSplit`).
- Losses: a mean over positions (or anchors) is the sum over this process's rows divided by the count over
  *all* processes, times N, so that the gradient average data parallelism takes is the global batch's mean
  (`GlobalMean`); one process divides by its own count (`batch_mean`).
- Gradients: the objective runs inside `TrainingStep.forward`, so the data-parallel wrapper (DDP, a DeepSpeed
  engine) sees a forward and reduces the gradients. Calling the drafter's methods outside such a forward
  would train each process on its own slice with no gradient exchange.
- Random draws (E-step anchors and samples): one stream per process and micro-step (`rank_seed`); process 0's
  is the single-process stream, so VSD's samples are equal in distribution, not draw for draw, across N.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mmvsd.errors import UserError

Mean = Callable[[Tensor, Tensor], Tensor]  # (sum over this process's items, their count) -> the loss's mean
SEED_STRIDE = 1_000_003  # the run's seed times this, plus an index, seeds one of its derived streams
RANK_SEED_STRIDE = 2**40  # far apart from the single-process seeds derived_seed(seed, micro_step)


def batch_mean(total: Tensor, count: Tensor) -> Tensor:
    """The mean over this batch's items (0 where there are none)."""
    return total / count.clamp(min=1)


class GlobalMean:
    """The mean over the items of all processes' rows, scaled by N for the gradient average data parallelism
    takes: sum_r grad(total_r) / sum_r count_r, the one-process gradient of the whole global batch."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator

    def __call__(self, total: Tensor, count: Tensor) -> Tensor:
        count = torch.as_tensor(count, dtype=torch.float32, device=total.device).detach().reshape(1)
        everywhere = self.accelerator.reduce(count, "sum")[0]  # a new tensor: `count` is not reduced in place
        return total * self.accelerator.num_processes / everywhere.clamp(min=1)


def mean_for(accelerator) -> Mean:
    return batch_mean if accelerator.num_processes == 1 else GlobalMean(accelerator)


@dataclass(frozen=True)
class BatchSplit:
    """The global micro-batch and this process's rows of it."""

    global_size: int  # examples per micro-batch over all processes
    per_process: int
    num_processes: int
    rank: int

    @classmethod
    def of(cls, batch_size: int, global_batch_size: int, num_processes: int, rank: int) -> BatchSplit:
        """`batch_size` per process, or `global_batch_size` (> 0) split evenly across the processes."""
        if global_batch_size <= 0:
            return cls(batch_size * num_processes, batch_size, num_processes, rank)
        if global_batch_size < num_processes:
            raise UserError(f"global_batch_size={global_batch_size} gives {num_processes} processes fewer than one "
                            f"example each: use at least {num_processes}, or fewer processes")
        if global_batch_size % num_processes:
            raise UserError(f"global_batch_size={global_batch_size} does not split evenly across {num_processes} "
                            f"processes: use a multiple of {num_processes}")
        return cls(global_batch_size, global_batch_size // num_processes, num_processes, rank)

    def rows(self, global_indices: list[int]) -> list[int]:
        """This process's slice of a global micro-batch."""
        return global_indices[self.rank * self.per_process : (self.rank + 1) * self.per_process]

    def check_fits(self, num_examples: int) -> None:
        if self.global_size > num_examples:
            raise UserError(f"a global batch of {self.global_size} examples ({self.num_processes} process(es) x "
                            f"{self.per_process}) exceeds the {num_examples} training examples: lower batch_size "
                            f"or global_batch_size, or use more data")


def derived_seed(seed: int, index: int) -> int:
    """The seed of a run's `index`-th stream of one kind (an epoch's permutation, a micro-step's draws, a shard's
    permutation and validation split): every derived seed of the run comes from here."""
    return seed * SEED_STRIDE + index


def rank_seed(seed: int, micro_step: int, rank: int) -> int:
    """The seed of process `rank`'s random stream at `micro_step` (process 0: the single-process seed)."""
    return derived_seed(seed, micro_step) + rank * RANK_SEED_STRIDE


class TrainingStep(nn.Module):
    """The drafter and its objective as one module, so that a data-parallel wrapper sees the forward."""

    def __init__(self, drafter: nn.Module, target, objective: Callable) -> None:
        super().__init__()
        self.drafter = drafter
        self.target = target  # a plain attribute (`Target` is no module): its weights are not trained or synced
        self.objective = objective

    def forward(self, batch, generator: torch.Generator, mean: Mean):
        return self.objective(self.drafter, self.target, batch, generator, mean)

    # checkpoints hold the drafter's own names, as before this wrapper (and as single-process runs wrote them)
    def state_dict(self, *args, **kwargs):
        return self.drafter.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.drafter.load_state_dict(state_dict, strict=strict, assign=assign)


def reduce_metrics(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """The mean of each metric over the processes (every process has the same keys)."""
    if accelerator.num_processes == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([metrics[key] for key in keys], dtype=torch.float64, device=accelerator.device)
    return dict(zip(keys, accelerator.reduce(values, "mean").tolist(), strict=True))


def reduce_count(accelerator, count: int) -> int:
    """A count summed over the processes."""
    if accelerator.num_processes == 1:
        return count
    return int(accelerator.reduce(torch.tensor([count], dtype=torch.long, device=accelerator.device), "sum")[0])
