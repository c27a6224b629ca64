"""Synthetic EXL3 checkpoints: random but valid trellises with exllamav3's layout, for tests and benchmarks."""

from .plan import ModulePlan, Plan, TensorPlan, load_bits_map, parse_bits, plan
from .presets import PRESETS, load_config
from .writer import DEFAULT_SHARD_BYTES, synthesize, write_config_only

__all__ = ["DEFAULT_SHARD_BYTES", "PRESETS", "ModulePlan", "Plan", "TensorPlan", "load_bits_map", "load_config",
           "parse_bits", "plan", "synthesize", "write_config_only"]
