"""What a synthetic checkpoint holds: every module, its tensors, shapes and bits (no data)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from math import prod

from ..format import codebook as cb
from ..format import embedding as emb
from ..format import trellis as tr
from ..format.errors import Exl3FormatError
from ..format.hadamard import HAD
from .presets import load_config
from .tokenizer import MIN_VOCAB

EXL3_VERSION = "1.6.5"
CALIBRATION = {"rows": 250, "cols": 2048}
HEAD_KEY = "lm_head"
DTYPE_SIZES = {"I16": 2, "F16": 2, "BF16": 2, "I32": 4, "F32": 4}
TORCH_DTYPE_NAMES = {"I16": "torch.int16", "F16": "torch.float16", "BF16": "torch.bfloat16",
                     "I32": "torch.int32", "F32": "torch.float32"}
MULTIPLIERS = {"mul1": cb.MUL1_MULT, "mcg": cb.MCG_MULT}

# architectures[0] (or model_type) -> layout family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5", "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
}
# Multimodal classes: the decoder's sizes in text_config, a vision tower in vision_config.
MULTIMODAL = ("Qwen3_5ForConditionalGeneration",)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe_lite")
# Where the decoder lives: exllamav3 writes Qwen3.5 under model.language_model even for the text-only model.
ROOTS = {"qwen3_5": "model.language_model"}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write; `role` and `live` tell the generator what values to put in it."""
    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    role: str  # trellis | suh | svh | marker | bias | norm | normal | embed_trellis | signs
    live: int = 0  # vectors: leading entries that are not padding
    codebook: str | None = None
    scale: float = 0.02

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_SIZES[self.dtype]

    def storage(self) -> dict:
        return {"shape": list(self.shape), "n_bytes": self.nbytes, "dtype": TORCH_DTYPE_NAMES[self.dtype]}


@dataclass
class ModulePlan:
    """One leaf module: an EXL3 linear or an unquantized module (norm, embedding, router, fp16 head)."""
    key: str
    kind: str  # exl3 | dense | exl3_embedding | raw (a bare parameter tensor)
    role: str  # attn | mlp | expert | head | embed | norm | router
    in_features: int = 0
    out_features: int = 0
    k: int = 0  # padded to 128 (EXL3 only)
    n: int = 0
    bits: int | float | None = None
    codebook: str | None = None
    bias: bool = False
    tensors: list[TensorPlan] = field(default_factory=list)
    listed: bool = True  # in quantization_config.json's tensor_storage (exllamav3 leaves MTP modules out)

    @property
    def is_head(self) -> bool:
        return self.role == "head"

    def tensor(self, suffix: str) -> TensorPlan:
        name = f"{self.key}.{suffix}"
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def storage_entry(self) -> dict:
        entry = {"stored_tensors": {t.name: t.storage() for t in sorted(self.tensors, key=lambda t: t.name)}}
        if self.kind == "exl3":
            entry["quant_format"] = "exl3"
            entry["bits_per_weight"] = self.bits
            if self.codebook in MULTIPLIERS:
                entry[f"{self.codebook}_multiplier"] = MULTIPLIERS[self.codebook]
        return entry


@dataclass
class Plan:
    config: dict  # the source HF config, unchanged
    arch: str
    bits: int | float
    codebook: str
    head_bits: int | float
    modules: list[ModulePlan]

    @property
    def text(self) -> dict:
        """The decoder's config: text_config for a multimodal model, else the config itself."""
        tc = self.config.get("text_config")
        return tc if isinstance(tc, dict) else self.config

    def exl3_modules(self) -> list[ModulePlan]:
        return [m for m in self.modules if m.kind == "exl3"]

    def decoder_linears(self) -> list[ModulePlan]:
        """What config's `bits` speaks of: MTP and vision modules state theirs apart (mtp_bits, vision_bits)."""
        return [m for m in self.exl3_modules() if not m.is_head and m.listed]

    @property
    def average_bpw(self) -> float | None:
        """Trellis bits per weight over the decoder linears, at their padded sizes (as the reader counts)."""
        mods = self.decoder_linears()
        weights = sum(m.k * m.n for m in mods)
        return sum(m.bits * m.k * m.n for m in mods) / weights if weights else None

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.modules)

    def quantization_config(self) -> dict:
        avg = self.average_bpw
        return {
            "quant_method": "exl3",
            "version": EXL3_VERSION,
            "bits": round(avg, 2) if avg is not None else self.bits,
            "head_bits": self.head_bits,
            "calibration": dict(CALIBRATION),
            "out_scales": "always",
            "codebook": self.codebook,
            # The only EXL3 modules outside tensor_storage are MTP layers' (synth stores vision towers unquantized).
            **({"mtp_bits": mtp[0].bits} if (mtp := [m for m in self.exl3_modules() if not m.listed]) else {}),
        }

    def tensor_storage(self) -> dict:
        return {m.key: m.storage_entry() for m in self.modules if m.kind != "raw" and m.listed}


# ---- argument checking -----------------------------------------------------------------------

def parse_bits(value, what: str = "bits", allow_16: bool = False) -> int | float:
    """1..8 or 1.5/2.5/3.5 (and 16 = unquantized where allowed) as int or float."""
    v = value
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            v = None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Exl3FormatError(f"{what} must be a number, got {value!r}",
                              fix=f"use one of {', '.join(map(str, tr.ALL_BITS))}" + (" or 16" if allow_16 else ""))
    if float(v).is_integer():
        v = int(v)
    if v in tr.ALL_BITS or (allow_16 and v == 16):
        return v
    raise Exl3FormatError(f"{what} = {value!r} is not an EXL3 bitrate",
                          fix=f"use one of {', '.join(map(str, tr.ALL_BITS))}" + (" or 16" if allow_16 else ""))


def parse_codebook(value, what: str = "codebook") -> str:
    if value not in cb.CODEBOOKS:
        raise Exl3FormatError(f"{what} {value!r} is not an EXL3 codebook", fix=f"use one of {', '.join(cb.CODEBOOKS)}")
    return value


def _check_half(bits, codebook: str, where: str) -> None:
    if bits != int(bits) and codebook != "mul1":
        raise Exl3FormatError(f"{where}: half-integer K={bits} needs the mul1 codebook, not {codebook}",
                              fix="use codebook mul1 for this module (a bits-map entry can give "
                                  "{\"bits\": %s, \"codebook\": \"mul1\"}) or an integer bitrate" % bits)


def load_bits_map(bits_map) -> list[tuple[str, int | float, str | None]]:
    """A JSON file path or a dict {glob: bits | {"bits": b, "codebook": c}} -> ordered rules."""
    if bits_map is None:
        return []
    source = "bits map"
    if isinstance(bits_map, (str, os.PathLike)):
        source = os.fspath(bits_map)
        try:
            with open(source, "rb") as f:
                bits_map = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            raise Exl3FormatError("bits map file does not exist", file=source) from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise Exl3FormatError(f"bits map is not valid JSON ({type(e).__name__}: {e})", file=source) from None
        except OSError as e:
            raise Exl3FormatError(f"cannot read bits map: {e.strerror or e}", file=source) from None
    if not isinstance(bits_map, dict):
        raise Exl3FormatError("bits map must be a JSON object {\"glob pattern\": bits, ...}", file=source)
    rules = []
    for pattern, value in bits_map.items():
        where = f"{source} entry {pattern!r}"
        code = None
        if isinstance(value, dict):
            unknown = set(value) - {"bits", "codebook"}
            if unknown or "bits" not in value:
                raise Exl3FormatError(f"{where}: an object entry needs 'bits' and may have 'codebook' "
                                      f"(found keys {sorted(value)})")
            if "codebook" in value:
                code = parse_codebook(value["codebook"], f"{where}: codebook")
            value = value["bits"]
        rules.append((pattern, parse_bits(value, f"{where}: bits"), code))
    return rules


# ---- layout per architecture -----------------------------------------------------------------

def _pad(x: int) -> int:
    return -(-x // HAD) * HAD


def _arch(config: dict) -> str:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and archs[0] in ARCHITECTURES:
        return ARCHITECTURES[archs[0]]
    mt = config.get("model_type")
    if mt in MODEL_TYPES:
        return mt
    raise Exl3FormatError(f"unsupported architecture (architectures={archs!r}, model_type={mt!r})",
                          fix=f"supported: {', '.join(ARCHITECTURES)}")


def _int(config: dict, key: str, default=None) -> int:
    v = config.get(key, default)
    if type(v) is not int or v <= 0:
        raise Exl3FormatError(f"config field {key!r} must be a positive integer, got {v!r}")
    return v


def _gdn_modules(c: dict, p: str) -> list[tuple]:
    """A Qwen3.5 gated-delta-net layer's linear attention as exllamav3 writes it: in_proj_qkv and in_proj_z EXL3,
    in_proj_b/a fp16, conv1d, A_log and dt_bias raw ("raw": a tensor with no module suffix)."""
    hidden = _int(c, "hidden_size")
    nk, nv = _int(c, "linear_num_key_heads"), _int(c, "linear_num_value_heads")
    dk, dv = _int(c, "linear_key_head_dim"), _int(c, "linear_value_head_dim")
    conv = 2 * nk * dk + nv * dv
    a = f"{p}.linear_attn"
    return [("lin", f"{a}.in_proj_qkv", hidden, conv, False, "attn"),
            ("lin", f"{a}.in_proj_z", hidden, nv * dv, False, "attn"),
            ("dense", f"{a}.in_proj_b", (nv, hidden), "normal"),
            ("dense", f"{a}.in_proj_a", (nv, hidden), "normal"),
            ("dense", f"{a}.conv1d", (conv, 1, _int(c, "linear_conv_kernel_dim")), "normal"),
            ("raw", f"{a}.A_log", (nv,), "F32"),
            ("raw", f"{a}.dt_bias", (nv,), "F16"),
            ("dense", f"{a}.norm", (dv,), "norm"),
            ("lin", f"{a}.out_proj", nv * dv, hidden, False, "attn")]


def _qwen3_5_attention(c: dict, p: str) -> list[tuple]:
    """Qwen3.5's full attention: q_proj carries each head's output gate beside its query (2 x heads x head_dim)."""
    hidden, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    kv, hd = _int(c, "num_key_value_heads", heads), _int(c, "head_dim")
    return [("lin", f"{p}.self_attn.q_proj", hidden, 2 * heads * hd, False, "attn"),
            ("lin", f"{p}.self_attn.k_proj", hidden, kv * hd, False, "attn"),
            ("lin", f"{p}.self_attn.v_proj", hidden, kv * hd, False, "attn"),
            ("dense", f"{p}.self_attn.q_norm", (hd,), "norm"),
            ("dense", f"{p}.self_attn.k_norm", (hd,), "norm"),
            ("lin", f"{p}.self_attn.o_proj", heads * hd, hidden, False, "attn")]


def _qwen3_5_mlp(c: dict, p: str) -> list[tuple]:
    hidden, inter = _int(c, "hidden_size"), _int(c, "intermediate_size")
    return [("dense", f"{p}.post_attention_layernorm", (hidden,), "norm"),
            ("lin", f"{p}.mlp.gate_proj", hidden, inter, False, "mlp"),
            ("lin", f"{p}.mlp.up_proj", hidden, inter, False, "mlp"),
            ("lin", f"{p}.mlp.down_proj", inter, hidden, False, "mlp")]


def _qwen3_5_mtp(c: dict) -> list[tuple]:
    """Qwen3.5's MTP draft as exllamav3 writes it (mtp_num_hidden_layers > 0): fc over [embedding; hidden], then
    full-attention layers, all outside tensor_storage."""
    hidden = _int(c, "hidden_size")
    out = [("dense", "mtp.pre_fc_norm_embedding", (hidden,), "norm"),
           ("dense", "mtp.pre_fc_norm_hidden", (hidden,), "norm"),
           ("lin", "mtp.fc", 2 * hidden, hidden, False, "mtp")]
    for j in range(c.get("mtp_num_hidden_layers") or 0):
        p = f"mtp.layers.{j}"
        out += [("dense", f"{p}.input_layernorm", (hidden,), "norm")] + _qwen3_5_attention(c, p) + _qwen3_5_mlp(c, p)
    return out + [("dense", "mtp.norm", (hidden,), "norm")]


def _mla_layer(c: dict, p: str, sparse: bool) -> list[tuple]:
    """A GLM-4-MoE-Lite decoder layer as exllamav3 writes it: the latent attention's q_a/q_b/kv_a/o projections EXL3
    (kv_a's 576 outputs padded to 640 like any linear), kv_b_proj fp16 (MLA reads it whole), then a dense MLP, or
    routed experts with a shared one behind an fp16 router and its fp32 score-correction bias."""
    hidden, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    kvl, rope = _int(c, "kv_lora_rank"), _int(c, "qk_rope_head_dim")
    qk, v = _int(c, "qk_nope_head_dim") + rope, _int(c, "v_head_dim")
    a = f"{p}.self_attn"
    out = [("dense", f"{p}.input_layernorm", (hidden,), "norm")]
    if c.get("q_lora_rank"):
        ql = _int(c, "q_lora_rank")
        out += [("lin", f"{a}.q_a_proj", hidden, ql, False, "attn"), ("dense", f"{a}.q_a_layernorm", (ql,), "norm"),
                ("lin", f"{a}.q_b_proj", ql, heads * qk, False, "attn")]
    else:
        out.append(("lin", f"{a}.q_proj", hidden, heads * qk, False, "attn"))
    out += [("lin", f"{a}.kv_a_proj_with_mqa", hidden, kvl + rope, False, "attn"),
            ("dense", f"{a}.kv_a_layernorm", (kvl,), "norm"),
            ("dense", f"{a}.kv_b_proj", (heads * (qk - rope + v), kvl), "normal"),
            ("lin", f"{a}.o_proj", heads * v, hidden, False, "attn"),
            ("dense", f"{p}.post_attention_layernorm", (hidden,), "norm")]
    if not sparse:
        inter = _int(c, "intermediate_size")
        return out + [("lin", f"{p}.mlp.{n}", *((inter, hidden) if n == "down_proj" else (hidden, inter)), False,
                       "mlp") for n in ("gate_proj", "up_proj", "down_proj")]
    experts, inter = _int(c, "n_routed_experts"), _int(c, "moe_intermediate_size")
    out += [("dense", f"{p}.mlp.gate", (experts, hidden), "router"),
            ("raw", f"{p}.mlp.gate.e_score_correction_bias", (experts,), "F32")]
    for q, width, role in [(f"{p}.mlp.experts.{e}", inter, "expert") for e in range(experts)] + \
            [(f"{p}.mlp.shared_experts", inter * _int(c, "n_shared_experts", 1), "mlp")]:
        out += [("lin", f"{q}.gate_proj", hidden, width, False, role),
                ("lin", f"{q}.up_proj", hidden, width, False, role),
                ("lin", f"{q}.down_proj", width, hidden, False, role)]
    return out


def _nextn_layers(c: dict) -> list[tuple]:
    """DeepSeek-style MTP layers (num_nextn_predict_layers), numbered on from the decoder's: enorm and hnorm over
    [embedding; hidden], eh_proj EXL3 (exllamav3's --mtp_bits, default 4), a full decoder layer, the shared head's
    norm. The draft reuses the model's embedding and head, so the converter writes neither."""
    hidden, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    out = []
    for j in range(c.get("num_nextn_predict_layers") or 0):
        p = f"model.layers.{layers + j}"
        out += [("dense", f"{p}.enorm", (hidden,), "norm"), ("dense", f"{p}.hnorm", (hidden,), "norm"),
                ("lin", f"{p}.eh_proj", 2 * hidden, hidden, False, "mtp")]
        out += _mla_layer(c, p, sparse=True) + [("dense", f"{p}.shared_head.norm", (hidden,), "norm")]
    return out


def _layer_modules(arch: str, c: dict, i: int) -> list[tuple]:
    """Decoder layer i in execution order: ("lin", key, in, out, bias, role), ("dense", key, shape, role) or
    ("raw", name, shape, dtype)."""
    hidden = _int(c, "hidden_size")
    heads = _int(c, "num_attention_heads")
    kv = _int(c, "num_key_value_heads", heads)
    hd = c.get("head_dim") or hidden // heads
    if type(hd) is not int or hd <= 0:
        raise Exl3FormatError(f"config field 'head_dim' must be a positive integer, got {hd!r}")
    p = f"{ROOTS.get(arch, 'model')}.layers.{i}"
    if arch == "glm4_moe_lite":
        return _mla_layer(c, p, sparse=i >= c.get("first_k_dense_replace", 1))
    attn_bias = arch in ("qwen2", "qwen2_moe") or (arch != "mixtral" and bool(c.get("attention_bias", False)))
    o_bias = attn_bias and arch not in ("qwen2", "qwen2_moe")
    if arch == "qwen3_5":
        types = c.get("layer_types")
        if not isinstance(types, list) or len(types) != _int(c, "num_hidden_layers"):
            raise Exl3FormatError("config field 'layer_types' must list one type per layer for Qwen3.5")
        out = [("dense", f"{p}.input_layernorm", (hidden,), "norm")]
        out += _gdn_modules(c, p) if types[i] == "linear_attention" else _qwen3_5_attention(c, p)
        return out + _qwen3_5_mlp(c, p)
    out = [("dense", f"{p}.input_layernorm", (hidden,), "norm"),
           ("lin", f"{p}.self_attn.q_proj", hidden, heads * hd, attn_bias, "attn"),
           ("lin", f"{p}.self_attn.k_proj", hidden, kv * hd, attn_bias, "attn"),
           ("lin", f"{p}.self_attn.v_proj", hidden, kv * hd, attn_bias, "attn")]
    if arch in ("qwen3", "qwen3_moe"):
        out += [("dense", f"{p}.self_attn.q_norm", (hd,), "norm"),
                ("dense", f"{p}.self_attn.k_norm", (hd,), "norm")]
    out += [("lin", f"{p}.self_attn.o_proj", heads * hd, hidden, o_bias, "attn"),
            ("dense", f"{p}.post_attention_layernorm", (hidden,), "norm")]
    if arch == "mixtral":
        experts = _int(c, "num_local_experts")
        inter = _int(c, "intermediate_size")
        out.append(("dense", f"{p}.block_sparse_moe.gate", (experts, hidden), "router"))
        for e in range(experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            out += [("lin", f"{q}.w1", hidden, inter, False, "expert"),
                    ("lin", f"{q}.w3", hidden, inter, False, "expert"),
                    ("lin", f"{q}.w2", inter, hidden, False, "expert")]
        return out
    sparse = False
    if arch in ("qwen3_moe", "qwen2_moe"):
        step = c.get("decoder_sparse_step", 1)
        only = c.get("mlp_only_layers") or []
        experts = _int(c, "num_experts")
        sparse = i not in only and type(step) is int and step > 0 and (i + 1) % step == 0
    if sparse:
        inter = _int(c, "moe_intermediate_size")
        out.append(("dense", f"{p}.mlp.gate", (experts, hidden), "router"))
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            out += [("lin", f"{q}.gate_proj", hidden, inter, False, "expert"),
                    ("lin", f"{q}.up_proj", hidden, inter, False, "expert"),
                    ("lin", f"{q}.down_proj", inter, hidden, False, "expert")]
        shared = _int(c, "shared_expert_intermediate_size") if arch == "qwen2_moe" and \
            c.get("shared_expert_intermediate_size") else 0
        if shared:
            # Qwen2-MoE's shared expert is a plain MLP; its sigmoid gate stays unquantized like the router.
            q = f"{p}.mlp.shared_expert"
            out += [("lin", f"{q}.gate_proj", hidden, shared, False, "mlp"),
                    ("lin", f"{q}.up_proj", hidden, shared, False, "mlp"),
                    ("lin", f"{q}.down_proj", shared, hidden, False, "mlp"),
                    ("dense", f"{p}.mlp.shared_expert_gate", (1, hidden), "router")]
    else:
        inter = _int(c, "intermediate_size")
        mlp_bias = arch in ("llama", "mistral") and bool(c.get("mlp_bias", False))
        out += [("lin", f"{p}.mlp.gate_proj", hidden, inter, mlp_bias, "mlp"),
                ("lin", f"{p}.mlp.up_proj", hidden, inter, mlp_bias, "mlp"),
                ("lin", f"{p}.mlp.down_proj", inter, hidden, mlp_bias, "mlp")]
    return out


def _exl3_module(key, k_in, n_out, bias, role, bits, code) -> ModulePlan:
    k, n = _pad(k_in), _pad(n_out)
    m = ModulePlan(key, "exl3", role, k_in, n_out, k, n, bits, code, bias)
    m.tensors.append(TensorPlan(f"{key}.trellis", "I16", (k // 16, n // 16, tr.width_from_bits(bits)), "trellis"))
    m.tensors.append(TensorPlan(f"{key}.suh", "F16", (k,), "suh", live=k_in, codebook=code))
    m.tensors.append(TensorPlan(f"{key}.svh", "F16", (n,), "svh", live=n_out, codebook=code))
    if code in MULTIPLIERS:
        m.tensors.append(TensorPlan(f"{key}.{code}", "I32", (), "marker", codebook=code))
    if bias:
        m.tensors.append(TensorPlan(f"{key}.bias", "F16", (n,), "bias", live=n_out))
    return m


def _dense_module(key, shape, role) -> ModulePlan:
    m = ModulePlan(key, "dense", role)
    if role == "norm":
        m.tensors.append(TensorPlan(f"{key}.weight", "F16", tuple(shape), "norm"))
    else:
        m.tensors.append(TensorPlan(f"{key}.weight", "F16", tuple(shape), "normal"))
    if len(shape) == 2:
        m.out_features, m.in_features = shape
    return m


def _vision_modules(v: dict, text_hidden: int) -> list[ModulePlan]:
    """A Qwen3-VL-style vision tower stored unquantized (exllamav3's --vision_bits 16), outside tensor_storage:
    patch embedding, position embedding, blocks, and the merger into the decoder's width."""
    h, inter, depth = _int(v, "hidden_size"), _int(v, "intermediate_size"), _int(v, "depth")
    patch, tpatch, merge = _int(v, "patch_size"), _int(v, "temporal_patch_size"), _int(v, "spatial_merge_size")
    out_h = v.get("out_hidden_size", text_hidden)
    merged = h * merge * merge
    items = [("model.visual.patch_embed.proj", (h, v.get("in_channels", 3), tpatch, patch, patch), True),
             ("model.visual.pos_embed", (_int(v, "num_position_embeddings"), h), False)]
    for i in range(depth):
        b = f"model.visual.blocks.{i}"
        items += [(f"{b}.norm1", (h,), True), (f"{b}.norm2", (h,), True), (f"{b}.attn.qkv", (3 * h, h), True),
                  (f"{b}.attn.proj", (h, h), True), (f"{b}.mlp.linear_fc1", (inter, h), True),
                  (f"{b}.mlp.linear_fc2", (h, inter), True)]
    items += [("model.visual.merger.norm", (h,), True), ("model.visual.merger.linear_fc1", (merged, merged), True),
              ("model.visual.merger.linear_fc2", (out_h, merged), True)]
    out = []
    for key, shape, bias in items:
        m = _dense_module(key, shape, "norm" if key.endswith(("norm", "norm1", "norm2")) else "vision")
        if bias:
            m.tensors.append(TensorPlan(f"{key}.bias", "F16", (shape[0],), "normal"))
        m.listed = False
        out.append(m)
    return out


def _raw_tensor(name, shape, dtype) -> ModulePlan:
    """A parameter stored under its own name (Qwen3.5's A_log, dt_bias), outside tensor_storage as exllamav3 has it."""
    m = ModulePlan(name, "raw", "normal")
    m.tensors.append(TensorPlan(name, dtype, tuple(shape), "normal"))
    return m


def _embedding_module(key: str, vocab: int, hidden: int, bits: int) -> ModulePlan:
    """A quantized token embedding as exllamav3 >= 1.6 writes it (format/embedding.py)."""
    m = ModulePlan(key, "exl3_embedding", "embed", in_features=hidden, out_features=vocab, bits=bits, codebook="mul1")
    groups = emb.groups_of(hidden)
    m.tensors.append(TensorPlan(f"{key}.trellis", "I16", (vocab, groups * (1 + 16 * bits)), "embed_trellis",
                                live=groups))
    m.tensors.append(TensorPlan(f"{key}.signs", "F16", (groups, emb.GROUP), "signs"))
    return m


def slice_widths(inter: int, slices: int) -> list[int]:
    """How exllamav3 splits a wide MLP's intermediate size into slices: equal multiples of 128, the last takes the
    rest (it slices only above 55,296; synth's mlp_slices asks for it on any size)."""
    each = inter // slices // 128 * 128
    return [each] * (slices - 1) + [inter - each * (slices - 1)]


def plan(config_or_preset, bits=4.0, codebook: str = "mul1", head_bits=6, bits_map=None,
         embed_bits=16, mlp_slices: int = 1) -> Plan:
    """Every module of the synthetic checkpoint with shapes, bits and codebook; writes nothing.

    mlp_slices > 1: each dense MLP's gate/up/down stored as that many `.slice.N` modules along the intermediate
    size, as exllamav3 stores MLPs wider than 55,296."""
    config = load_config(config_or_preset)
    nested = isinstance(config.get("text_config"), dict)
    if nested != ((config.get("architectures") or [None])[0] in MULTIMODAL):
        raise Exl3FormatError("a nested text_config goes with a multimodal class, and only there",
                              fix=f"multimodal classes supported: {', '.join(MULTIMODAL)}")
    arch = _arch(config)
    full, config = config, (config["text_config"] if nested else config)
    bits = parse_bits(bits, "bits")
    codebook = parse_codebook(codebook)
    head_bits = parse_bits(head_bits, "head_bits", allow_16=True)
    embed_bits = parse_bits(embed_bits, "embed_bits", allow_16=True)
    if embed_bits != int(embed_bits):
        raise Exl3FormatError(f"embed_bits = {embed_bits} is not an embedding bitrate", fix="use 1..8, or 16")
    _check_half(bits, codebook, "--bits")
    if head_bits != 16:
        _check_half(head_bits, codebook, "--head-bits")
    rules = load_bits_map(bits_map)
    if isinstance(mlp_slices, bool) or not isinstance(mlp_slices, int) or mlp_slices < 1:
        raise Exl3FormatError(f"mlp_slices must be a positive integer, got {mlp_slices!r}")
    hidden = _int(config, "hidden_size")
    vocab = _int(config, "vocab_size")
    layers = _int(config, "num_hidden_layers")
    if vocab < MIN_VOCAB:
        raise Exl3FormatError(f"vocab_size {vocab} is too small for the synthetic byte-level tokenizer "
                              f"(needs >= {MIN_VOCAB})")

    def choose(key):
        for pattern, b, code in rules:
            if fnmatchcase(key, pattern):
                code = code or codebook
                _check_half(b, code, f"bits map pattern {pattern!r} (module {key})")
                return b, code
        return bits, codebook

    root = ROOTS.get(arch, "model")
    modules = [_dense_module(f"{root}.embed_tokens", (vocab, hidden), "embed") if embed_bits == 16
               else _embedding_module(f"{root}.embed_tokens", vocab, hidden, embed_bits)]
    for i in range(layers):
        for item in _layer_modules(arch, config, i):
            if item[0] == "dense":
                modules.append(_dense_module(*item[1:]))
            elif item[0] == "raw":
                modules.append(_raw_tensor(*item[1:]))
            else:
                _, key, k_in, n_out, bias, role = item
                proj = key.rsplit(".", 1)[-1]
                if mlp_slices > 1 and role == "mlp" and proj in ("gate_proj", "up_proj", "down_proj"):
                    widths = slice_widths(n_out if proj != "down_proj" else k_in, mlp_slices)
                    if bias or min(widths) < HAD:
                        raise Exl3FormatError(f"{key}: cannot slice into {mlp_slices} (bias, or slices under "
                                              f"{HAD} wide)", fix="fewer slices")
                    for j, w in enumerate(widths):
                        kk, nn = (k_in, w) if proj != "down_proj" else (w, n_out)
                        modules.append(_exl3_module(f"{key}.slice.{j}", kk, nn, False, role, *choose(key)))
                    continue
                modules.append(_exl3_module(key, k_in, n_out, bias, role, *choose(key)))
    modules.append(_dense_module(f"{root}.norm", (hidden,), "norm"))
    for item in _qwen3_5_mtp(config) if arch == "qwen3_5" else _nextn_layers(config):
        kind = {"dense": _dense_module, "raw": _raw_tensor}.get(item[0])
        m = kind(*item[1:]) if kind else _exl3_module(*item[1:], *choose(item[1]))
        m.listed = False
        modules.append(m)
    if nested:
        if not isinstance(full.get("vision_config"), dict):
            raise Exl3FormatError("a multimodal config needs a vision_config object",
                                  fix="add the vision tower's config")
        modules += _vision_modules(full["vision_config"], hidden)
    if head_bits == 16:
        # The converter stores a 16-bit head like any unquantized linear: rows padded to a multiple of 128.
        modules.append(_dense_module(HEAD_KEY, (-(-vocab // HAD) * HAD, hidden), "head"))
    else:
        modules.append(_exl3_module(HEAD_KEY, hidden, vocab, False, "head", head_bits, codebook))
    return Plan(full, arch, bits, codebook, head_bits, modules)
