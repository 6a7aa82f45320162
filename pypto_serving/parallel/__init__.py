"""Tensor parallelism: how a model splits over the ranks of a device group, and the
collectives (torch.distributed) that join the parts.

`sharding.py`: which rows or columns of each weight a rank holds (pure arithmetic, no
torch.distributed); `group.py`: the process group of one replica's ranks and its collectives;
`channel.py`: rank 0 handing every message it receives to the other ranks.
"""

from pypto_serving.parallel.sharding import SINGLE, TensorParallel, check_divisible

__all__ = ["SINGLE", "TensorParallel", "check_divisible"]
