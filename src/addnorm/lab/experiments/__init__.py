"""Importing this package registers every experiment, in the order the modules are listed."""

import importlib

MODULES: list[str] = [
    "init_time",
    "init_xiong",
    "init_deepnet",
    "init_admin",
    "numerics",
    "xiong_warmup",
    "deepnet_depth",
    "training_logits",
    "placement_init",
    "rmsnorm",
    "peri_ln",
    "dyt",
    "training_residuals",
    "training_depth",
    "training_norm_choices",
    "seed_advice_claims",
    "training_seeds_faults",
]

for _m in MODULES:
    importlib.import_module(f"addnorm.lab.experiments.{_m}")
