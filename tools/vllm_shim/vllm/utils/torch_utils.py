"""``vllm.utils.torch_utils.set_random_seed``: seeds Python's, NumPy's and torch's generators."""

from vllm.platforms import current_platform


def set_random_seed(seed):
    current_platform.seed_everything(seed)
