"""How our torch ops are registered: torch.library's low-level API, as vLLM registers its own. One schema (from the
default implementation's type annotations), that implementation for every device, an optional CUDA one, and the
fake for torch.compile. torch.library.custom_op would wrap every call in Python autograd and aliasing checks, a
host cost that steps outside CUDA graphs pay on every layer (bench/host_cost.py --dispatch)."""

from __future__ import annotations

from typing import Callable

import torch

_LIB = torch.library.Library("exl3", "FRAGMENT")  # the registrations live as long as this object


def define(name: str, default: Callable, fake: Callable, cuda: Callable | None = None) -> torch._ops.OpOverload:
    """torch.ops.exl3.<name>: default on any device (cuda instead on CUDA tensors), fake under torch.compile."""
    _LIB.define(name + torch.library.infer_schema(default, mutates_args=()))
    _LIB.impl(name, default, "CompositeExplicitAutograd")
    if cuda is not None:
        _LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"exl3::{name}", fake, lib=_LIB)
    return getattr(torch.ops.exl3, name).default
