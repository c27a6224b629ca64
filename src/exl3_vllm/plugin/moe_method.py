"""Exl3MoEMethod: routed experts stored as one EXL3 linear per expert and projection (docs/format.md 1.9)."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from .. import settings
from ..format import codebook as cb
from ..format.checkpoint import Exl3Spec, signs_to_half
from ..format.errors import Exl3FormatError
from ..format.hadamard import HAD
from ..format.reconstruct import w_hat
from . import compat
from .loading import damaged, marker, tp_hint
from .moe_op import ExpertStack, exl3_moe
from .op import prepare_experts

# vLLM's shard ids per parameter stem: w1 = gate and w3 = up fill the two halves of w13, w2 = down.
_SHARDS = {"w13": ("w1", "w3"), "w2": ("w2",)}
_MARKERS = tuple(cb.MARKER_VALUES)
# What each checkpoint role fills: legacy su/sv signs are stored expanded, as suh/svh.
_KIND = {"trellis": "trellis", "suh": "suh", "su": "suh", "svh": "svh", "sv": "svh"} | dict.fromkeys(_MARKERS, "marker")
logger = logging.getLogger("exl3_vllm")


@dataclass
class MoEState:
    """One experts layer's EXL3 state (layer.exl3): this rank's share of the experts, the tensors the loader must
    see, and after loading the two expert stacks apply runs."""
    plan: dict  # n_pp, start, local, where, groups, inter_valid (create_weights)
    expected: set  # (stem, shard, kind, slot) of every tensor this rank loads
    loaded: set = field(default_factory=set)
    w13: ExpertStack | None = None
    w2: ExpertStack | None = None


def _ranges(ids) -> str:
    """[0,1,2,5] -> '0-2,5' for messages about many experts."""
    ids, out = sorted(ids), []
    for i, e in enumerate(ids):
        if i == 0 or e != ids[i - 1] + 1:
            out.append([e, e])
        else:
            out[-1][1] = e
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def _trellis_name(stem: str, group: int) -> str:
    return f"{stem}_trellis" if group == 0 else f"{stem}_trellis_g{group}"


class Exl3MoEMethod(FusedMoEMethodBase):
    """EXL3 experts: [gate|up] of each expert fused along n into w13_*, down in w2_*.

    Experts of a projection may differ in K and codebook (each (K, codebook) is its own stacked group);
    gate and up of one expert must agree, since they share one fused trellis.
    """

    def __init__(self, config, prefix: str, layer: torch.nn.Module):
        super().__init__(compat.moe_config(layer))
        self.config = config
        self.prefix = prefix
        self.path = config.checkpoint.path
        act = compat.moe_activation(layer)
        if act != "silu" or not compat.moe_is_gated(layer) or getattr(layer, "swiglu_limit", None) is not None:
            raise Exl3FormatError(f"{prefix}: EXL3 experts support the gated SiLU (SwiGLU) activation only, "
                                  f"this layer uses {act!r}", file=self.path, tensor=prefix,
                                  fix="serve this model unquantized or with another method")
        gate, up, down = compat.moe_ckpt_names(layer)
        self.names = {"w1": gate, "w3": up, "w2": down}
        self.n_experts = compat.moe_num_logical_experts(layer)
        # specs[stem][e]: the checkpoint modules of expert e, one per shard of that stem.
        self.specs = {stem: self._collect(shards) for stem, shards in _SHARDS.items()}
        self.sigs = {stem: self._signatures(stem) for stem in _SHARDS}
        self._check_shapes()

    # ---- checkpoint checks (headers only, before any tensor is read) ------------------------
    def _collect(self, shards: tuple[str, ...]) -> list[tuple[Exl3Spec, ...]]:
        out, missing = [], []
        for e in range(self.n_experts):
            row = []
            for s in shards:
                key = f"{self.prefix}.{e}.{self.names[s]}"
                found = self.config.resolver.lookup(key)
                if len(found) > 1:
                    raise Exl3FormatError(f"{key} is stored as {len(found)} slices, which experts do not support",
                                          file=self.path, tensor=found[0], fix="re-convert without MLP slicing")
                spec = self.config.checkpoint.modules.get(found[0]) if found else None
                if not isinstance(spec, Exl3Spec):
                    missing.append((e, self.names[s], "missing" if spec is None else "unquantized"))
                    continue
                if spec.has_bias:
                    raise Exl3FormatError(f"{self.prefix}: expert linears with a bias are not supported yet",
                                          file=self.path, tensor=f"{spec.key}.bias",
                                          fix="serve this model unquantized")
                row.append(spec)
            out.append(tuple(row))
        if missing:
            what = "; ".join(f"experts {_ranges({e for e, p, m in missing if (p, m) == pm})} {pm[0]}: {pm[1]}"
                             for pm in sorted({(p, m) for _, p, m in missing}))
            raise Exl3FormatError(f"{self.prefix}: the model has {self.n_experts} experts, but not every expert "
                                  f"projection is an EXL3 linear in the checkpoint ({what})", file=self.path,
                                  tensor=f"{self.prefix}.{missing[0][0]}.{missing[0][1]}",
                                  fix="the checkpoint is incomplete or belongs to another config; every routed "
                                      "expert must be quantized")
        return out

    def _signatures(self, stem: str) -> list[tuple[float, str]]:
        """(K, codebook) of each expert's stem; gate and up share a fused trellis, so they must agree."""
        sigs, bad = [], {}
        for e, row in enumerate(self.specs[stem]):
            found = tuple((s.bits, s.codebook) for s in row)
            if len(set(found)) > 1:
                bad.setdefault(found, []).append(e)
            sigs.append(found[0])
        if bad:
            parts = "; ".join(f"experts {_ranges(es)}: " + ", ".join(f"{self.names[s]} {b:g} bits {c}"
                                                                     for s, (b, c) in zip(_SHARDS[stem], found))
                              for found, es in bad.items())
            e = next(iter(bad.values()))[0]
            raise Exl3FormatError(f"{self.prefix}: gate and up of an expert differ in K or codebook ({parts}), but "
                                  "vLLM fuses them into one w13 tensor", file=self.path,
                                  tensor=self.specs[stem][e][1].key,
                                  fix="re-convert with one bitrate and codebook for gate and up of each expert")
        return sigs

    def _check_shapes(self) -> None:
        for stem in _SHARDS:
            shapes: dict[tuple[int, int], list[int]] = {}
            for e, row in enumerate(self.specs[stem]):
                for s in row:
                    shapes.setdefault((s.k, s.n), []).append(e)
            if len(shapes) > 1:
                parts = "; ".join(f"experts {_ranges(set(es))}: {k}x{n}" for (k, n), es in shapes.items())
                raise Exl3FormatError(f"{self.prefix}: every expert's {'/'.join(self.names[s] for s in _SHARDS[stem])} "
                                      f"must have one shape (k x n), found {parts}", file=self.path,
                                      tensor=self.specs[stem][0][0].key,
                                      fix="the checkpoint does not belong to this model config")
        g0, d0 = self.specs["w13"][0][0], self.specs["w2"][0][0]
        if g0.n != d0.k or g0.k != d0.n:
            raise Exl3FormatError(f"{self.prefix}: experts' {self.names['w1']}/{self.names['w3']} are {g0.k}x{g0.n} "
                                  f"but {self.names['w2']} is {d0.k}x{d0.n}; down must map the intermediate width "
                                  "back to hidden", file=self.path, tensor=d0.key,
                                  fix="the checkpoint does not belong to this model config")

    # ---- weights -----------------------------------------------------------------------------
    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        tp_rank, tp_size = compat.moe_tp(layer)
        g0 = self.specs["w13"][0][0]
        hk, ik = g0.k, g0.n  # checkpoint hidden and intermediate widths (padded to 128)
        inter = intermediate_size_per_partition * tp_size
        if hk < hidden_size or hk - hidden_size >= HAD:
            raise Exl3FormatError(f"{self.prefix}: the experts' {self.names['w1']} takes k={hk} but the model's "
                                  f"hidden size is {hidden_size}", file=self.path, tensor=g0.key,
                                  fix="the checkpoint does not belong to this model config")
        if ik < inter or ik - inter >= HAD:
            raise Exl3FormatError(f"{self.prefix}: the experts' intermediate width is {ik} in the checkpoint but "
                                  f"{inter} in the model config", file=self.path, tensor=g0.key,
                                  fix="the checkpoint does not belong to this model config")
        if tp_size > 1 and (ik % tp_size or (ik // tp_size) % HAD):
            raise Exl3FormatError(
                f"{self.prefix}: the experts' intermediate width {ik} ({self.names['w1']}/{self.names['w3']} "
                f"columns, {self.names['w2']} rows) is {ik / tp_size:g} per rank at tensor_parallel_size={tp_size}; "
                "EXL3 can only split on multiples of 128", file=self.path, tensor=g0.key,
                fix=f"use {tp_hint(ik, tp_size)}, or --enable-expert-parallel to place whole experts on ranks")
        n_pp = ik // tp_size
        start = tp_rank * n_pp
        local = [None] * num_experts  # local slot -> checkpoint expert
        for e in range(self.n_experts):
            slot = compat.moe_local_expert(layer, e)
            if 0 <= slot < num_experts:
                local[slot] = e
        if None in local:
            raise Exl3FormatError(f"{self.prefix}: vLLM places {num_experts} experts on this rank but only "
                                  f"{num_experts - local.count(None)} of them are checkpoint experts",
                                  file=self.path, tensor=self.prefix,
                                  fix="redundant experts (EPLB) are not supported with EXL3")
        params: dict[str, torch.Tensor] = {}
        where: dict[str, list[tuple[int, int]]] = {}
        groups: dict[str, list[tuple[float, str]]] = {}
        for stem in _SHARDS:
            members: dict[tuple[float, str], list[int]] = {}
            for slot, e in enumerate(local):
                members.setdefault(self.sigs[stem][e], []).append(slot)
            groups[stem] = list(members)
            where[stem] = [(0, 0)] * num_experts
            for g, (sig, slots) in enumerate(members.items()):
                for i, slot in enumerate(slots):
                    where[stem][slot] = (g, i)
                width = self.specs[stem][local[slots[0]]][0].tensors["trellis"].shape[2]
                shape = (hk // 16, 2 * n_pp // 16) if stem == "w13" else (n_pp // 16, hk // 16)
                params[_trellis_name(stem, g)] = torch.empty(len(slots), *shape, width, dtype=torch.int16)
            # Every role any checkpoint expert has needs a parameter: vLLM looks it up before it asks the loader.
            roles = {r for row in self.specs[stem] for s in row for r in s.tensors}
            for r in sorted(roles & {"su", "sv"}):
                # Legacy sign vectors arrive here and are stored expanded in suh/svh.
                params[f"{stem}_{r}"] = torch.empty(0, dtype=torch.int16)
            for r in sorted(roles & set(_MARKERS)):
                params[f"{stem}_{r}"] = torch.empty((), dtype=torch.int32)
        if settings.get("EXL3_VLLM_DEBUG_NAMES"):
            logger.warning("exl3 experts: %s -> %d of %d experts on this rank (%s), intermediate columns %d-%d of "
                           "%d; (K, codebook) groups: w13 %s, w2 %s", self.prefix, num_experts, self.n_experts,
                           _ranges(local), start, start + n_pp, ik, groups["w13"], groups["w2"])
        e = num_experts
        params.update(w13_suh=torch.empty(e, 2, hk, dtype=torch.float16),
                      w13_svh=torch.empty(e, 2 * n_pp, dtype=torch.float16),
                      w2_suh=torch.empty(e, n_pp, dtype=torch.float16),
                      w2_svh=torch.empty(e, hk, dtype=torch.float16))
        layer.exl3 = MoEState(
            plan={"n_pp": n_pp, "start": start, "local": local, "where": where, "groups": groups,
                  "inter_valid": max(0, min(n_pp, inter - start))},
            expected={(stem, shard, kind, slot) for stem, shards in _SHARDS.items()
                      for slot, ex in enumerate(local) for shard in shards
                      for kind in ("trellis", "suh", "svh")
                      + (("marker",) if self.sigs[stem][ex][1] in _MARKERS else ())})
        for name, data in params.items():
            p = torch.nn.Parameter(data, requires_grad=False)
            if not name.startswith(("w13_trellis_g", "w2_trellis_g")):
                # Our loader replaces vLLM's, which silently skips names without "weight" (e.g. *_trellis).
                set_weight_attrs(p, {"weight_loader": self._loader(layer, name)})
            layer.register_parameter(name, p)
        # vLLM 0.25 unbinds every 3-D expert tensor as if it stacked experts; a trellis is one expert's 3-D tensor.
        layer.load_weights = self._expert_tensors_loader(layer)

    def _expert_tensors_loader(self, layer):
        """RoutedExperts.load_weights for per-expert tensors: each goes whole to its expert's parameter loader."""

        def load_weights(weights):
            table = {w: (p, e, s) for p, w, e, s in layer.get_expert_mapping()}
            path = self.path
            for name, w in weights:
                qual = f"{layer.layer_name}.{name}"
                expert, _, rest = qual.rpartition("experts.")[2].partition(".")
                key = f"experts.{expert}.{rest.partition('.')[0]}."
                if key not in table:
                    continue  # not an expert tensor, as vLLM's own loader skips it
                prefix, expert_id, shard_id = table[key]
                full = qual.replace(key, prefix)
                pname = full.removeprefix(f"{layer.layer_name}.")
                param = getattr(layer, pname, None)
                if param is None:
                    raise Exl3FormatError(f"{qual} is an expert tensor of a kind EXL3 experts do not have "
                                          f"(no parameter {pname})", file=path, tensor=qual,
                                          fix="the checkpoint is not a plain EXL3 conversion of this model")
                if param.weight_loader(param=param, loaded_weight=w, weight_name=full, shard_id=shard_id,
                                       expert_id=expert_id, return_success=True):
                    yield pname
        return load_weights

    def _loader(self, layer, name: str):
        stem, _, role = name.partition("_")
        shards = _SHARDS[stem]
        layer_ref = weakref.ref(layer)  # as Exl3LinearMethod._loader: a dropped layer must not outlive its loading

        def load(param, loaded_weight: torch.Tensor, weight_name: str = "", shard_id: str | None = None,
                 expert_id: int | None = None, return_success: bool = False, **kwargs):
            if expert_id is None or shard_id not in shards or not 0 <= int(expert_id) < self.n_experts:
                raise Exl3FormatError(f"{self.prefix}: {weight_name or name} arrived as shard {shard_id!r} of "
                                      f"expert {expert_id}, which does not fit {name}", file=self.path,
                                      tensor=weight_name or name,
                                      fix="EXL3 stores one linear per expert; stacked expert tensors are not EXL3")
            layer = layer_ref()
            slot = compat.moe_local_expert(layer, expert_id)
            if slot < 0:
                return False if return_success else None  # the expert lives on another rank
            spec = self.specs[stem][int(expert_id)][shards.index(shard_id)]
            tensor = f"{spec.key}.{role}"
            info = spec.tensors.get(role)
            if info is None or tuple(loaded_weight.shape) != tuple(info.shape):
                raise Exl3FormatError(f"vLLM passed shape {list(loaded_weight.shape)} to the expert loader, but the "
                                      f"checkpoint header says {list(info.shape) if info else 'no such tensor'}: it "
                                      "split or stacked the tensor as if it held several experts", file=self.path,
                                      tensor=tensor,
                                      fix="use a vLLM release this plugin supports (0.25 or 0.32)")
            plan = layer.exl3.plan
            n_pp, start, half = plan["n_pp"], plan["start"], shards.index(shard_id)
            w = loaded_weight
            if role in _MARKERS:
                param.data.fill_(marker(w, role, self.path, tensor))
            elif role == "trellis":
                g, i = plan["where"][stem][slot]
                dst = getattr(layer, _trellis_name(stem, g)).data[i]
                if stem == "w13":
                    t = n_pp // 16  # gate/up are column-parallel: this rank's columns of the intermediate
                    dst[:, half * t:(half + 1) * t].copy_(w.narrow(1, start // 16, t))
                else:
                    dst.copy_(w.narrow(0, start // 16, n_pp // 16))  # down is row-parallel
            else:
                v = w if role in ("suh", "svh") else signs_to_half(w)
                side = _KIND[role]
                dst = getattr(layer, f"{stem}_{side}").data[slot]
                if stem == "w13" and side == "suh":
                    dst[half].copy_(v)  # gate and up keep their own input scales
                elif stem == "w13":
                    dst[half * n_pp:(half + 1) * n_pp].copy_(v.narrow(0, start, n_pp))
                else:
                    dst.copy_(v.narrow(0, start, n_pp) if side == "suh" else v)
            layer.exl3.loaded.add((stem, shard_id, _KIND[role], slot))
            return True if return_success else None
        return load

    def process_weights_after_loading(self, layer) -> None:
        state = layer.exl3
        plan = state.plan
        missing = sorted(state.expected - state.loaded)
        if missing:
            names = [f"{self.specs[stem][plan['local'][slot]][_SHARDS[stem].index(shard)].key}.{kind}"
                     for stem, shard, kind, slot in missing[:4]]
            raise Exl3FormatError(f"{self.prefix}: {len(missing)} expert tensors were never loaded (e.g. "
                                  f"{', '.join(names)})", file=self.path, tensor=names[0],
                                  fix="the checkpoint is incomplete; re-download it")
        state.expected, state.loaded = set(), set()
        # A NaN or Inf scale would turn its expert's outputs into NaN: refuse it at load, naming it.
        for stem in _SHARDS:
            for side in ("suh", "svh"):
                ok = torch.isfinite(getattr(layer, f"{stem}_{side}").data).flatten(1).all(1).tolist()
                if not all(ok):
                    slot = ok.index(False)
                    spec = self.specs[stem][plan["local"][slot]][0]
                    raise damaged(f"{self.prefix}: expert {plan['local'][slot]}'s {stem} {side} holds NaN or Inf "
                                  "values", self.path, f"{spec.key}.{side}")
        for stem in _SHARDS:
            for r in ("su", "sv"):
                if hasattr(layer, f"{stem}_{r}"):
                    delattr(layer, f"{stem}_{r}")
        n_pp, hk = plan["n_pp"], self.specs["w13"][0][0].k
        for stem, sizes in (("w13", [n_pp, n_pp]), ("w2", [hk])):
            trellis = [getattr(layer, _trellis_name(stem, g)).data for g in range(len(plan["groups"][stem]))]
            codes = [int(cb.Codebook.of(code)) for _, code in plan["groups"][stem]]
            decoded = where_dev = None
            if trellis[0].device.type == "cpu":
                # The CPU path keeps each expert's exact fp16 decode; one expert at a time bounds the scratch.
                t0 = trellis[0]
                decoded = torch.empty(len(plan["local"]), t0.shape[1] * 16, t0.shape[2] * 16, dtype=torch.float16,
                                      device=t0.device)
                for slot, (g, i) in enumerate(plan["where"][stem]):
                    decoded[slot] = w_hat(trellis[g][i], codes[g])
            else:
                where_dev = torch.tensor(plan["where"][stem], dtype=torch.int32, device=trellis[0].device)
            setattr(state, stem, ExpertStack(trellis, codes, plan["where"][stem], getattr(layer, f"{stem}_suh").data,
                                             getattr(layer, f"{stem}_svh").data, sizes, decoded, where_dev))
        w13, w2 = state.w13, state.w2
        if w13.where_dev is not None:
            prepare_experts(w13.trellis, w13.codebooks, w2.trellis, w2.codebooks, len(plan["local"]),
                            compat.moe_top_k(layer))

    def get_fused_moe_quant_config(self, layer):
        return None

    # ---- forward -----------------------------------------------------------------------------
    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None, *args, **kwargs) -> torch.Tensor:
        # vLLM routed already (topk_weights are final) and runs shared experts and the TP/EP reduction itself.
        ids = topk_ids.long()
        expert_map = compat.moe_expert_map(layer)
        if expert_map is not None:
            ids = expert_map[ids]
        state = layer.exl3
        return exl3_moe(x, topk_weights, ids, state.w13, state.w2, state.plan["inter_valid"],
                        weights_on_input=bool(getattr(layer, "apply_router_weight_on_input", False)))
