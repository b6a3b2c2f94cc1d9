"""Tensor parallelism: one engine's weights and KV heads split over N ranks (GPUs), one process each.

- `group.py`: the torch.distributed group (NCCL on CUDA, gloo on CPU) and the model's collectives.
- `plan.py`: what rank 0 tells the other ranks to run, one op at a time, over a pipe to each.
- `ranks.py`: rank 0's side: starts ranks 1..N-1, watches them, stops them.
- `worker.py`: the process of ranks 1..N-1: loads its slice and follows rank 0's ops.
"""
