"""Tensor parallelism: how a model splits over the ranks of a device group, and the
collectives (torch.distributed) that join the parts.

`shapes.py`: whether a model divides over N ranks (no torch: the API process checks flags with
it); `sharding.py`: which rows or columns of each weight a rank holds; `group.py`: the process
group of one replica's ranks and its collectives; `channel.py`: rank 0 handing every message it
receives to the other ranks.
"""
