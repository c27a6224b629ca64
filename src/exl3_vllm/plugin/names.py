"""vLLM module prefixes -> checkpoint module keys, and which shards of a fused layer share a kernel call."""

from __future__ import annotations

import re

from ..format.errors import Exl3FormatError

# Wrappers that vLLM and checkpoints add around the same module path.
_WRAPPERS = ("model.", "language_model.", "lm.", "text_model.")
DEFAULT_PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    # Latent attention (DeepSeek, GLM-4-MoE-Lite): models add it to their mapping at construction; an MTP draft
    # that builds the same layer may not carry the model's mapping.
    "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
}
_SLICE = re.compile(r"\.slice\.(\d+)$")


def canonical(key: str) -> str:
    """Strip wrapper prefixes so that vLLM and checkpoint paths compare equal."""
    parts = key.split(".")
    keep = [p for p in parts if p + "." not in _WRAPPERS]
    return ".".join(keep)


class NameResolver:
    """Finds the checkpoint keys behind a vLLM layer prefix."""

    def __init__(self, checkpoint_keys, packed_modules_mapping: dict | None = None):
        self.keys = set(checkpoint_keys)
        self.by_canonical: dict[str, list[str]] = {}
        for k in self.keys:
            self.by_canonical.setdefault(canonical(_SLICE.sub("", k)), []).append(k)
        self.packed = dict(DEFAULT_PACKED)
        if packed_modules_mapping:
            self.packed.update({k: list(v) for k, v in packed_modules_mapping.items()})

    def lookup(self, key: str) -> list[str]:
        """Checkpoint keys (slices in order) for one unfused module, or []."""
        if key in self.keys:
            return [key]
        found = self.by_canonical.get(canonical(key), [])
        if len(found) > 1 and all(_SLICE.search(f) for f in found):
            return sorted(found, key=lambda f: int(_SLICE.search(f).group(1)))
        if len(found) > 1:
            raise Exl3FormatError(f"vLLM module {key!r} matches several checkpoint modules {sorted(found)}",
                                  fix="rename the checkpoint's modules so each path is unique")
        return found

    def shards(self, prefix: str) -> list[tuple[str, list[str]]]:
        """(shard name, checkpoint keys) for each shard a vLLM layer fuses, or one for itself."""
        head, _, last = prefix.rpartition(".")
        own = self.lookup(prefix)
        if own or last not in self.packed:
            return [(last, own)]
        return [(s, self.lookup(f"{head}.{s}" if head else s)) for s in self.packed[last]]


def shard_groups(specs) -> list[list[int]]:
    """Runs of adjacent shards of one fused layer that share K and codebook: each run is one trellis and one kernel
    call."""
    groups: list[list[int]] = []
    for i, s in enumerate(specs):
        if groups and (specs[groups[-1][0]].bits, specs[groups[-1][0]].codebook) == (s.bits, s.codebook):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
