"""Small host lists onto the device without a host sync.

`torch.tensor(values, device="cuda")` copies from pageable memory and waits for the copy, and so for
every kernel queued before it: one such call in a step undoes async scheduling (the host then waits
for the step in flight). From pinned memory the copy is queued like a kernel.
"""

import numpy as np
import torch


def on_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list (or numpy array) as a device tensor without a host sync: a blocking copy from pageable
    memory would wait for every step queued before it, and undo async scheduling."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    if isinstance(values, np.ndarray):  # (torch.tensor cannot pin what it builds from numpy)
        host = torch.from_numpy(values).to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)
