"""Integrations with other libraries. Each submodule imports its library lazily, inside its functions.

- :mod:`addnorm.integrations.hf`: Hugging Face transformers (``apply(model)`` / ``revert(model)``).
"""
