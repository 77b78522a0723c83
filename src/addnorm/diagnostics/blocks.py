"""Where things are in any PyTorch model: its repeated blocks, its norm layers, and what a module "returns".

Shared by :class:`~addnorm.diagnostics.monitor.Monitor` (which hooks the blocks and norms) and the doctor (which
re-runs them): both need the same answer to "which modules are the layers" for the same model.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["find_blocks", "is_norm_module", "first_tensor", "output_logits", "call_model"]

# Where well-known model families keep their repeated blocks, tried in this order before the general search.
_KNOWN_BLOCK_PATHS = (
    "blocks",  # addnorm, nanoGPT-style
    "model.layers",  # Llama, Mistral, Qwen, Gemma (…ForCausalLM)
    "layers",  # the same families' bare …Model
    "transformer.h",  # GPT-2, GPT-J, Falcon
    "h",
    "gpt_neox.layers",
    "model.decoder.layers",  # OPT
    "decoder.layers",
    "bert.encoder.layer",
    "roberta.encoder.layer",
    "encoder.layer",  # BertModel, RobertaModel
    "transformer.blocks",
    "transformer.layers",
)

_TORCH_NORMS = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def is_norm_module(module: nn.Module) -> bool:
    """True for torch's norm layers, leaf modules whose class name says "Norm" (LlamaRMSNorm, T5LayerNorm), DyT."""
    if isinstance(module, _TORCH_NORMS):
        return True
    name = type(module).__name__.lower()
    if name in ("nonorm", "identitynorm"):  # stand-ins for "no norm here"
        return False
    # DyT (Zhu et al. 2025) replaces the norm in place, so it counts as one.
    return ("norm" in name or name in ("dyt", "dynamictanh")) and next(module.children(), None) is None


def first_tensor(value: Any) -> Tensor | None:
    """The tensor a module "returns": itself, the first tensor of a tuple/list, or ``.last_hidden_state``-like."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, Tensor):
                return v
        return None
    if isinstance(value, dict):  # Hugging Face ModelOutput is a dict subclass
        for v in value.values():
            if isinstance(v, Tensor):
                return v
    return None


def output_logits(value: Any) -> Tensor | None:
    """The logits in a model's output: ``.logits`` (Hugging Face), else the first tensor, if it is (.., V) float."""
    logits = getattr(value, "logits", None)
    if not isinstance(logits, Tensor):
        logits = first_tensor(value)
    if logits is None or logits.dim() < 2 or not logits.is_floating_point():
        return None
    return logits


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on a batch given as a tensor, a tuple/list of positional inputs, or a dict of keyword inputs."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _resolve(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _homogeneous(container: nn.Module) -> bool:
    children = list(container.children())
    return len(children) >= 1 and len({type(c) for c in children}) == 1


def find_blocks(model: nn.Module, blocks: Any = None) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks as ``[(qualified_name, module), ...]`` in execution order.

    ``blocks`` overrides the search: an attribute path ("model.layers"), a ModuleList/Sequential, or a list of
    modules of ``model``. Otherwise: known paths (addnorm ``model.blocks``, Hugging Face ``model.layers``,
    ``transformer.h``, ``encoder.layer``, ...), then the largest ModuleList/Sequential whose children share a class.
    Raises ValueError when nothing fits.
    """
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is not None:
        if isinstance(blocks, str):
            found = _resolve(model, blocks)
            if found is None:
                raise ValueError(f"blocks={blocks!r}: the model has no submodule with that path")
            blocks = list(found.children())
        elif isinstance(blocks, nn.Module):
            blocks = list(blocks.children())
        else:
            blocks = list(blocks)
        if not blocks:
            raise ValueError("blocks: got an empty list of blocks")
        out = []
        for b in blocks:
            if not isinstance(b, nn.Module) or id(b) not in names:
                raise ValueError(f"blocks: every block must be a submodule of the model, got {type(b).__name__}")
            out.append((names[id(b)], b))
        return out

    for path in _KNOWN_BLOCK_PATHS:
        found = _resolve(model, path)
        if isinstance(found, (nn.ModuleList, nn.Sequential)) and _homogeneous(found):
            return [(names[id(c)], c) for c in found.children()]

    best, best_key = None, None
    for _, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and _homogeneous(mod):
            n_params = sum(p.numel() for p in mod.parameters())
            key = (len(mod), n_params)  # most blocks first, then the heavier stack (blocks vs. a list of heads)
            if n_params > 0 and (best_key is None or key > best_key):
                best, best_key = mod, key
    if best is None:
        raise ValueError(
            f"could not find repeated blocks in {type(model).__name__}: no ModuleList/Sequential of same-class "
            "modules with parameters; pass blocks= (an attribute path such as 'model.layers', or a list of modules)"
        )
    return [(names[id(c)], c) for c in best.children()]
