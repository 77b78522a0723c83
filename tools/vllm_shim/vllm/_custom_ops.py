"""``vllm._custom_ops`` served by ``addnorm.compat.vllm`` (which registers ``torch.ops.addnorm_vllm``)."""

from addnorm.compat.vllm import *  # noqa: F403
