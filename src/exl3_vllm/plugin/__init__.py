"""vLLM plugin entry point: registers the "exl3" quantization method."""

from __future__ import annotations

_registered = False


def register() -> None:
    """Called by vLLM in every process through the vllm.general_plugins entry point."""
    global _registered
    if _registered:
        return
    _registered = True
    import torch

    # vLLM's CPU bf16 attention uses AMX tiles, which Linux grants per process on request.
    init_amx = getattr(torch.cpu, "_init_amx", None)
    if init_amx is not None:
        try:
            init_amx()
        except Exception:  # noqa: BLE001 - a CPU without AMX simply has nothing to enable
            pass
    import logging

    from ..format import errors

    log = logging.getLogger("exl3_vllm")
    errors.on_raise = lambda msg: log.error("EXL3 checkpoint error: %s", msg)
    from . import compat, config, loader  # noqa: F401  (the imports register the config class and --load-format exl3)

    if (note := compat.version_note()) is not None:
        log.warning(note)
    from .. import settings

    try:  # the kernels refuse them at their first dispatch; say it here too, before vLLM's own start-up lines
        settings.check_retired()
    except settings.SettingError as e:
        log.error("%s", e)
