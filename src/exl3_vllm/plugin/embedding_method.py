"""Exl3EmbeddingMethod: a quantized token embedding in vLLM's vocab-parallel embedding, rows decoded per lookup."""

from __future__ import annotations

import weakref

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.utils import set_weight_attrs

from .. import kernels  # noqa: F401  (registers torch.ops.exl3.embedding)
from ..format import codebook as cb
from ..format import embedding as emb
from ..format.checkpoint import EmbeddingSpec
from ..format.errors import Exl3FormatError
from .loading import damaged


class Exl3EmbeddingMethod(QuantizeMethodBase):
    """Rows split across tensor-parallel ranks like vLLM's own embedding (each row decodes on its own)."""

    def __init__(self, config, prefix: str, spec: EmbeddingSpec):
        self.config = config
        self.prefix = prefix
        self.spec = spec
        self.hidden: int | None = None  # the model's hidden size (create_weights; one method per layer)

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        spec = self.spec
        hidden = input_size_per_partition
        if emb.groups_of(hidden) * emb.GROUP != spec.hidden:
            raise Exl3FormatError(f"{self.prefix}: the quantized embedding holds rows of {spec.hidden} values "
                                  f"({spec.hidden // emb.GROUP} groups of {emb.GROUP}) but the model's hidden size "
                                  f"is {hidden}", file=self.config.checkpoint.path,
                                  tensor=f"{spec.key}.trellis", fix="the checkpoint does not belong to this model config")
        org_vocab = getattr(layer, "org_vocab_size", spec.rows)
        if spec.rows != org_vocab:
            raise Exl3FormatError(f"{self.prefix}: the quantized embedding has {spec.rows} rows but the model's "
                                  f"vocabulary is {org_vocab}", file=self.config.checkpoint.path,
                                  tensor=f"{spec.key}.trellis", fix="the checkpoint does not belong to this model config")
        rows = sum(output_partition_sizes)
        words = spec.tensors["trellis"].shape[1]
        trellis = torch.nn.Parameter(torch.empty(rows, words, dtype=torch.int16), requires_grad=False)
        # vLLM's vocab loader takes this rank's rows and zeroes padding rows (a zero row decodes to zeros).
        set_weight_attrs(trellis, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(trellis, extra_weight_attrs)
        signs = torch.nn.Parameter(torch.empty(spec.hidden // emb.GROUP, emb.GROUP, dtype=torch.float16),
                                   requires_grad=False)
        set_weight_attrs(signs, extra_weight_attrs)
        layer.register_parameter("trellis", trellis)
        layer.register_parameter("signs", signs)
        self.hidden = hidden

    def process_weights_after_loading(self, layer) -> None:
        # The 65536 mul1 values (128 KiB): a lookup per weight instead of the integer decode.
        layer.register_buffer("mul1_values", cb.all_values("mul1").to(layer.trellis.device), persistent=False)
        bad = (~torch.isfinite(emb.row_scales(layer.trellis.data, self.spec.hidden // emb.GROUP))).any(1).nonzero()
        if bad.numel():
            raise damaged(f"{self.prefix}: {bad.numel()} rows of the quantized embedding (e.g. row {int(bad[0])} of "
                          "this rank's) have a NaN or Inf scale", self.config.checkpoint.path, f"{self.spec.key}.trellis")
        s = layer.signs.data
        if not bool(((s == 1) | (s == -1)).all()):
            raise Exl3FormatError(f"{self.prefix}: the embedding signs must all be +1 or -1",
                                  file=self.config.checkpoint.path, tensor=f"{self.spec.key}.signs",
                                  fix="re-convert or re-download the checkpoint")

    def embedding(self, layer, input_: torch.Tensor) -> torch.Tensor:
        out = torch.ops.exl3.embedding(input_, layer.trellis, layer.signs, layer.mul1_values, self.hidden)
        return out.to(layer.params_dtype)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise Exl3FormatError(f"{self.prefix}: a quantized embedding cannot double as the output head",
                              file=self.config.checkpoint.path, fix="the checkpoint must store its own lm_head")


def padded_dense_head_method():
    """vLLM's own method for an unquantized head that the converter stored with its rows padded to a multiple of
    128 (`-hb 16`): the padding rows are dropped before vLLM's loader, which wants exactly the vocabulary."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    class PaddedDenseHead(UnquantizedEmbeddingMethod):
        def create_weights(self, layer, *args, **extra_weight_attrs):
            # Weakly held: a draft's own head that vLLM replaces by the model's must be freed (linear_method._loader).
            loader = weakref.WeakMethod(extra_weight_attrs.pop("weight_loader"))
            vocab = layer.org_vocab_size

            def load(param, loaded_weight):
                return loader()(param, loaded_weight.narrow(0, 0, vocab))

            super().create_weights(layer, *args, weight_loader=load, **extra_weight_attrs)

    return PaddedDenseHead()
