"""Exl3LinearMethod: EXL3 weights in vLLM's linear layers, sharded for tensor parallelism."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.utils import set_weight_attrs

from ..format import codebook as cb
from ..format.checkpoint import Exl3Spec, signs_to_half
from ..format.errors import Exl3FormatError
from ..format.hadamard import HAD
from ..format.reconstruct import w_hat
from .loading import damaged, marker, tp_hint
from .names import shard_groups
from .op import exl3_linear, prepare_layer
from .vision import tp_note

_QKV = {"q": 0, "k": 1, "v": 2}


def _kind(layer: torch.nn.Module) -> str:
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    if isinstance(layer, RowParallelLinear):
        return "row"
    if isinstance(layer, ParallelLMHead):
        return "head"
    return "column"  # Column, Merged, QKV and Replicated (tp_size 1) all split n, if at all


@dataclass
class LinearState:
    """One layer's EXL3 state (layer.exl3): what create_weights decides, which the weight loader reads, and, after
    loading, what apply runs."""
    shards: list  # per shard: (checkpoint column offset, parameter column offset, width, logical width)
    layout: list  # per group: (first shard, end shard, first column, end column, flat trellis offset, trellis shape)
    k_start: int  # the first input row of this rank's slice of the checkpoint
    keep: torch.Tensor | None = None  # the output columns left after padding is trimmed (None: every column)
    groups: list = field(default_factory=list)  # per group: (trellis, suh rows, svh, widths, codebook id, CPU decode)


class Exl3LinearMethod(LinearMethodBase):
    """One (possibly fused) EXL3 linear; shards of different K or codebook run as separate groups."""

    def __init__(self, config, prefix: str, specs: list[Exl3Spec], window: tuple[int, int, int, int] | None = None):
        """window: (first input row, rows, first output column, columns) of every shard to take, instead of what
        the layer's tensor-parallel rank implies (a sliced layer's piece on one rank)."""
        self.config = config
        self.prefix = prefix
        self.specs = specs
        self.window = window
        if len({s.legacy_signs for s in specs}) > 1:
            raise Exl3FormatError(
                f"vLLM fuses {[x.key for x in specs]} into one layer, but only some of them store legacy su/sv "
                "sign vectors", file=config.checkpoint.path, tensor=prefix,
                fix="re-convert the model with one exllamav3 version")
        self.owner = list(range(len(specs)))  # per vLLM partition: its checkpoint module (create_weights may spread)
        self.groups = shard_groups(specs)
        self.widths = [specs[g[0]].tensors["trellis"].shape[2] for g in self.groups]
        self.legacy = specs[0].legacy_signs

    def _spread(self, kind: str, parts: list[int], tp_size: int) -> list[int]:
        """When vLLM makes more output partitions than the checkpoint has modules (a module holding several of
        them, loaded with a tuple shard id), assign the partitions to modules in order by their full widths; each
        partition becomes a shard of its own, and its column offset in its module is returned."""
        specs, path = self.specs, self.config.checkpoint.path
        full = [p * tp_size for p in parts] if kind == "column" else parts
        owner, offsets, i = [], [], 0
        for j, spec in enumerate(specs):
            used = 0
            while i < len(parts) and used < spec.n:
                owner.append(j)
                offsets.append(used)
                used += full[i]
                i += 1
            if used != spec.n:
                raise Exl3FormatError(f"vLLM gives {len(parts)} output partitions {full} for {self.prefix!r}, which "
                                      f"do not divide the checkpoint's {len(specs)} modules "
                                      f"({', '.join(f'{s.key}: n={s.n}' for s in specs)})",
                                      file=path, tensor=spec.key,
                                      fix="the checkpoint does not belong to this model config")
        if i != len(parts):
            raise Exl3FormatError(f"vLLM gives {len(parts)} output partitions for {self.prefix!r} but the checkpoint "
                                  f"has {len(specs)} modules for it", file=path, tensor=self.prefix)
        bad = [(specs[owner[k]].key, parts[k]) for k in range(len(parts)) if parts[k] % HAD]
        if bad:
            raise Exl3FormatError(f"{self.prefix}: the part of {bad[0][0]} vLLM takes is {bad[0][1]} columns wide "
                                  f"(per rank at tensor_parallel_size={tp_size}); EXL3 can only cut a module on "
                                  "multiples of 128 columns", file=path, tensor=bad[0][0],
                                  fix="serve it with a tensor-parallel size that keeps each part a multiple of 128")
        self.owner = owner
        self.specs = [specs[j] for j in owner]
        self.groups = shard_groups(self.specs)
        self.widths = [self.specs[g[0]].tensors["trellis"].shape[2] for g in self.groups]
        return offsets

    # ---- weights -----------------------------------------------------------------------------
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        kind = _kind(layer)
        tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
        spread = len(output_partition_sizes) != len(self.specs)
        offsets = self._spread(kind, list(output_partition_sizes), tp_size) if spread else None
        replicas = getattr(layer, "num_kv_head_replicas", 1)
        plan = []  # per shard: (ckpt column tile offset, param column offset, width, logical width)
        col = 0
        for i, (spec, part) in enumerate(zip(self.specs, output_partition_sizes)):
            if spread:
                # One of several vLLM partitions cut from one checkpoint module (Qwen3.5's in_proj_qkv: q, k, v).
                logical_k = input_size_per_partition
                width, start = part, offsets[i] + tp_rank * part
                plan.append((start, col, width, part))
                col += width
                continue
            if self.window is not None:
                logical_k = self.window[1]
                width, start = self.window[3], self.window[2]
            elif kind == "row":
                logical_k = input_size
                width, start = spec.n, 0
                if spec.n < part or spec.n - part >= HAD:
                    raise self._shape_error(spec, f"n={spec.n}", f"{part}")
            else:
                logical_k = input_size_per_partition
                rank = tp_rank // replicas if kind != "head" and i > 0 and replicas > 1 else tp_rank
                if tp_size == 1:
                    if kind != "head" and (spec.n < part or spec.n - part >= HAD):
                        raise self._shape_error(spec, f"n={spec.n}", f"{part}")
                    width, start = spec.n, 0
                else:
                    if part % HAD:
                        raise Exl3FormatError(
                            f"{self.prefix}: shard {spec.key} is {part} columns per rank at "
                            f"tensor_parallel_size={tp_size}; EXL3 can only split on multiples of 128 columns",
                            file=self.config.checkpoint.path, tensor=spec.key,
                            fix=f"use {tp_hint(part * tp_size // max(1, replicas if i else 1), tp_size)}"
                                f"{tp_note(self.prefix)}")
                    width, start = part, rank * part
                    if start + width > spec.n:
                        raise self._shape_error(spec, f"n={spec.n}", f"{start + width} at rank {tp_rank}")
            plan.append((start, col, width, min(part, width)))
            col += width
        if self.window is not None:
            k_param, k_start = self.window[1], self.window[0]
        elif kind == "row":
            if input_size_per_partition % HAD:
                raise Exl3FormatError(
                    f"{self.prefix}: {input_size_per_partition} input rows per rank at "
                    f"tensor_parallel_size={tp_size}; EXL3 can only split on multiples of 128 rows",
                    file=self.config.checkpoint.path, tensor=self.specs[0].key,
                    fix=f"use {tp_hint(input_size, tp_size)}{tp_note(self.prefix)}")
            k_param = input_size_per_partition if tp_size > 1 else self.specs[0].k
            k_start = tp_rank * input_size_per_partition if tp_size > 1 else 0
        else:
            k_param, k_start = self.specs[0].k, 0
        for spec in self.specs:
            if self.window is not None:
                if self.window[0] + self.window[1] > spec.k or self.window[2] + self.window[3] > spec.n:
                    raise self._shape_error(spec, f"k={spec.k}, n={spec.n}", f"the window {self.window}")
            elif spec.k < logical_k or spec.k - logical_k >= HAD or (kind == "row" and tp_size > 1
                                                                      and spec.k != input_size):
                raise self._shape_error(spec, f"k={spec.k}", f"{logical_k}")
        n_total = col
        nshard = len(self.specs)
        k16 = k_param // 16
        # Per group: (first shard, end shard, first column, end column, flat trellis offset, trellis shape).
        layout, offset = [], 0
        for g, width in zip(self.groups, self.widths):
            c0, c1 = plan[g[0]][1], plan[g[-1]][1] + plan[g[-1]][2]
            shape = (k16, (c1 - c0) // 16, width)
            layout.append((g[0], g[-1] + 1, c0, c1, offset, shape))
            offset += shape[0] * shape[1] * shape[2]
        # One group keeps the plain 3-D trellis; several share one flat parameter (one checkpoint name, "trellis").
        trellis_shape = layout[0][5] if len(layout) == 1 else (offset,)
        params = {"trellis": torch.empty(*trellis_shape, dtype=torch.int16)}
        if self.legacy:
            params["su"] = torch.empty(nshard, k_param // 16, dtype=torch.int16)
            params["sv"] = torch.empty(n_total // 16, dtype=torch.int16)
        else:
            params["suh"] = torch.empty(nshard, k_param, dtype=torch.float16)
            params["svh"] = torch.empty(n_total, dtype=torch.float16)
        for code in sorted({s.codebook for s in self.specs} & cb.MARKER_VALUES.keys()):
            params[code] = torch.empty((), dtype=torch.int32)
        layer.exl3 = LinearState(plan, layout, k_start)
        for name, data in params.items():
            p = torch.nn.Parameter(data, requires_grad=False)
            set_weight_attrs(p, {"weight_loader": self._loader(layer, name)})
            layer.register_parameter(name, p)

    @staticmethod
    def _group_trellis(layer, g: int) -> torch.Tensor:
        _, _, _, _, offset, shape = layer.exl3.layout[g]
        t = layer.trellis.data
        if t.dim() == 3:
            return t
        return t[offset:offset + shape[0] * shape[1] * shape[2]].view(shape)

    def _shape_error(self, spec: Exl3Spec, have: str, want: str) -> Exl3FormatError:
        return Exl3FormatError(f"{self.prefix}: the checkpoint's {spec.key} has {have} but vLLM's layer needs "
                               f"{want}", file=self.config.checkpoint.path, tensor=spec.key,
                               fix="the checkpoint does not belong to this model config")

    def _shard_index(self, shard_id) -> int:
        if shard_id is None:
            if len(self.specs) != 1:
                raise Exl3FormatError(f"{self.prefix}: a tensor arrived fused on disk, but EXL3 stores each shard "
                                      "separately", file=self.config.checkpoint.path, tensor=self.prefix)
            return 0
        if isinstance(shard_id, str):
            return _QKV[shard_id]
        if isinstance(shard_id, tuple):
            shard_id = shard_id[0]
        return int(shard_id)

    def _loader(self, layer, name: str):
        # A weak reference: a layer that vLLM drops after loading (an MTP draft's own head, replaced by the model's)
        # must not be kept alive by its parameters' loaders.
        layer_ref = weakref.ref(layer)

        def load(param, loaded_weight: torch.Tensor, shard_id=None, *args, **kwargs):
            if isinstance(shard_id, tuple) and len(self.owner) != len(set(self.owner)):
                for s in shard_id:  # one checkpoint module holding several partitions: each takes its columns
                    load_one(param, loaded_weight, s)
                return
            load_one(param, loaded_weight, self._shard_index(shard_id))

        def load_one(param, loaded_weight: torch.Tensor, s: int):
            layer = layer_ref()
            spec = self.specs[s]
            src_start, dst_col, width, _ = layer.exl3.shards[s]
            k0 = layer.exl3.k_start
            w = loaded_weight
            if name in cb.MARKER_VALUES:
                param.data.fill_(marker(w, name, self.config.checkpoint.path, f"{spec.key}.{name}"))
                return
            k_rows = param.shape[1] if name in ("suh", "su") else param.shape[0]
            if name == "trellis":
                g = next(i for i, lay in enumerate(layer.exl3.layout) if lay[0] <= s < lay[1])
                dst = self._group_trellis(layer, g)
                c = dst_col - layer.exl3.layout[g][2]
                w = w.narrow(0, k0 // 16, dst.shape[0]).narrow(1, src_start // 16, width // 16)
                dst[:, c // 16:(c + width) // 16].copy_(w)
            elif name in ("suh", "su"):
                unit = 1 if name == "suh" else 16
                param.data[s].copy_(w.narrow(0, k0 // unit, k_rows))
            else:
                unit = 1 if name == "svh" else 16
                param.data[dst_col // unit:(dst_col + width) // unit].copy_(w.narrow(0, src_start // unit,
                                                                                     width // unit))
        return load

    def process_weights_after_loading(self, layer) -> None:
        if self.legacy:
            suh = torch.stack([signs_to_half(r) for r in layer.su.data])
            svh = signs_to_half(layer.sv.data)
            del layer.su, layer.sv
            layer.register_parameter("suh", torch.nn.Parameter(suh, requires_grad=False))
            layer.register_parameter("svh", torch.nn.Parameter(svh, requires_grad=False))
        state = layer.exl3
        plan = state.shards
        self._check_finite(layer, plan)
        if any(p[3] != p[2] for p in plan):
            state.keep = torch.cat([torch.arange(p[1], p[1] + p[3]) for p in plan]).to(layer.trellis.device)
        state.groups = []
        for g, (s0, s1, c0, c1, _, _) in enumerate(state.layout):
            trellis = self._group_trellis(layer, g)
            code = self.specs[s0].codebook
            # Adjacent parts cut from one checkpoint module share its suh: one kernel shard, one input transform.
            rows, sizes = [], []
            for i in range(s0, s1):
                if rows and self.owner[i] == self.owner[rows[-1]]:
                    sizes[-1] += plan[i][2]
                else:
                    rows.append(i)
                    sizes.append(plan[i][2])
            suh = layer.suh.data[s0:s1] if len(rows) == s1 - s0 else layer.suh.data[rows]
            # The CPU path keeps the exact fp16 decode instead of decoding on every forward.
            decoded = w_hat(trellis, code) if trellis.device.type == "cpu" else None
            code_id = int(cb.Codebook.of(code))  # a plain int: it reaches the ops and their traced graphs
            state.groups.append((trellis, suh, layer.svh.data[c0:c1], sizes, code_id, decoded))
            prepare_layer(trellis, sizes, code_id)

    def _check_finite(self, layer, plan) -> None:
        """A NaN or Inf scale would turn every output of its shard into NaN: refuse it at load, naming it."""
        suh_ok = torch.isfinite(layer.suh.data).all(dim=1).tolist()
        svh_ok = [bool(torch.isfinite(layer.svh.data[p[1]:p[1] + p[3]]).all()) for p in plan]  # padding is trimmed
        for spec, a, b in zip(self.specs, suh_ok, svh_ok):
            if not (a and b):
                what = "suh" if not a else "svh"
                raise damaged(f"{self.prefix}: {spec.key}.{what} holds NaN or Inf values",
                              spec.tensors["trellis"].file, f"{spec.key}.{what}")

    # ---- forward -----------------------------------------------------------------------------
    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        state = layer.exl3
        k = state.groups[0][0].shape[0] * 16
        if x2.shape[-1] != k:
            x2 = F.pad(x2, (0, k - x2.shape[-1]))
        fused_bias = bias if state.keep is None and len(state.groups) == 1 else None
        ys = [exl3_linear(x2, trellis, suh, svh, fused_bias, sizes, code, decoded)
              for trellis, suh, svh, sizes, code, decoded in state.groups]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        if bias is not None and fused_bias is None and state.keep is None:
            y = y + bias
        if state.keep is not None:
            y = y.index_select(1, state.keep)
            if bias is not None:
                y = y + bias
        return y.reshape(*lead, y.shape[-1])

    def embedding(self, layer, *args, **kwargs):
        raise Exl3FormatError(f"{self.prefix}: an EXL3 head cannot double as the token embedding",
                              fix="the checkpoint must not tie word embeddings")


class SlicedExl3LinearMethod(LinearMethodBase):
    """An MLP projection exllamav3 stored as `.slice.N` modules along the intermediate size (it slices MLPs wider
    than 55,296). Each slice this rank touches is an Exl3LinearMethod on the child module `slice.N` over its part of
    the slice (vLLM's weight names `<layer>.slice.N.<tensor>`, with the unsliced layer's shard ids, reach its
    loaders); gate/up pieces' columns are put back in order, down's partial products are summed in fp32 (vLLM then
    reduces across ranks)."""

    def __init__(self, config, prefix: str, slices: list[list[Exl3Spec]]):
        self.config = config
        self.prefix = prefix
        self.slices = slices
        self.row = False
        biased = [sp.key for sl in slices for sp in sl if sp.has_bias]
        if biased:  # vLLM's loaders would drop `<layer>.slice.N.bias` without a word
            raise Exl3FormatError(f"{prefix} is stored as slices with biases ({biased[0]}), which this version "
                                  "does not join", file=config.checkpoint.path, tensor=f"{biased[0]}.bias",
                                  fix="serve it with exllamav3")
        self.pieces: list[tuple[int, int, int, Exl3LinearMethod]] = []  # (slice, local start, width, method)

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        self.row = _kind(layer) == "row"
        tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
        widths = [s[0].k if self.row else s[0].n for s in self.slices]
        local = input_size_per_partition if self.row else output_partition_sizes[0]
        if sum(widths) != local * tp_size or any(sp.n != s[0].n or sp.k != s[0].k for s in self.slices for sp in s):
            raise Exl3FormatError(f"{self.prefix}: its slices are {widths} wide ({len(self.slices[0])} shards each), "
                                  f"but vLLM's layer needs {local * tp_size} in all", file=self.config.checkpoint.path,
                                  tensor=self.slices[0][0].key, fix="the checkpoint does not belong to this model config")
        if local % HAD:
            raise Exl3FormatError(f"{self.prefix}: {local} intermediate rows per rank at tensor_parallel_size="
                                  f"{tp_size}; EXL3 can only split on multiples of 128", file=self.config.checkpoint.path,
                                  tensor=self.slices[0][0].key, fix=f"use {tp_hint(local * tp_size, tp_size)}")
        lo, hi = tp_rank * local, (tp_rank + 1) * local
        holders, a = torch.nn.Module(), 0
        for s, (specs, w) in enumerate(zip(self.slices, widths)):
            p0, p1 = max(a, lo), min(a + w, hi)
            if p0 < p1:  # this rank's part of slice s: its rows (down) or columns (gate / up)
                sp = specs[0]
                window = (p0 - a, p1 - p0, 0, sp.n) if self.row else (0, sp.k, p0 - a, p1 - p0)
                method = Exl3LinearMethod(self.config, f"{self.prefix}.slice.{s}", specs, window)
                h = torch.nn.Module()
                parts = output_partition_sizes if self.row else [p1 - p0] * len(specs)
                method.create_weights(h, window[1], parts, window[1], sum(parts), params_dtype, **extra_weight_attrs)
                holders.add_module(str(s), h)
                self.pieces.append((s, p0 - lo, p1 - p0, method))
            else:  # another rank's slice: its tensors still arrive here, and are dropped
                holders.add_module(str(s), self._sink(specs))
            a += w
        layer.add_module("slice", holders)

    @staticmethod
    def _sink(specs: list[Exl3Spec]) -> torch.nn.Module:
        h = torch.nn.Module()
        names = {"su", "sv"} if specs[0].legacy_signs else {"suh", "svh"}
        names |= {"trellis"}
        names |= {sp.codebook for sp in specs} & cb.MARKER_VALUES.keys()
        for name in sorted(names):
            p = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            set_weight_attrs(p, {"weight_loader": lambda *args, **kwargs: None})
            h.register_parameter(name, p)
        return h

    def process_weights_after_loading(self, layer) -> None:
        for s, _, _, method in self.pieces:
            method.process_weights_after_loading(getattr(layer.slice, str(s)))

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        outs = [(m.apply(getattr(layer.slice, str(s)), x[..., k0:k0 + w] if self.row else x), w)
                for s, k0, w, m in self.pieces]
        if self.row:
            y = outs[0][0].float()
            for o, _ in outs[1:]:
                y = y + o.float()
            y = y.to(x.dtype)
        else:
            shards = len(self.slices[0])
            y = torch.cat([o[..., j * w:(j + 1) * w] for j in range(shards) for o, w in outs], dim=-1)
        return y if bias is None else y + bias
