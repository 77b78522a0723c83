"""``vllm.platforms.current_platform``: the few questions the two test files ask of it."""

import random

import numpy as np
import torch


class _Platform:
    def fp8_dtype(self):
        return torch.float8_e4m3fn  # the OCP format (ROCm's MI300 would say e4m3fnuz)

    def is_rocm(self):
        return False

    def is_cuda(self):
        return torch.cuda.is_available()

    def seed_everything(self, seed):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)


current_platform = _Platform()
