"""Importing this package registers every experiment, in the order the modules are listed."""

import importlib

MODULES: list[str] = [
    "init_time",
    "xiong",
    "deepnet",
    "admin",
    "numerics",
    "xiong_warmup",
    "deepnet_depth",
    "wortsman",
    "z_loss",
    "placement_init",
    "rmsnorm",
    "peri_ln",
    "dyt",
    "rezero",
    "mix_ln",
    "layernorm_scaling",
    "branch_scaling",
    "olmo2",
    "powernorm",
    "seed_advice_claims",
    "divergence",
    "fp16_stats",
]

for _m in MODULES:
    importlib.import_module(f"addnorm.lab.experiments.{_m}")
