"""vLLM's ``tests/kernels/quant_utils.FP8_DTYPE``: the FP8 format of CUDA (OCP e4m3fn)."""

import torch

FP8_DTYPE = torch.float8_e4m3fn
