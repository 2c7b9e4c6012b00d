"""Where a benchmark ran, as its tables name it: the device and the threads torch used."""

from __future__ import annotations

import platform

import torch


def device_name(device: torch.device | str) -> str:
    """``"NVIDIA H100 ... (CUDA)"`` or ``"CPU <model name>, <n> threads"``."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"CPU {cpu}, {threads} thread{'s' if threads != 1 else ''}"
