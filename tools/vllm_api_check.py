"""Does each vLLM release have what the plugin uses? Checked statically from the released wheels' sources (no install,
no GPU): import paths, the signatures of the methods the plugin overrides or calls, and the layer attributes it reads.

    python3 tools/vllm_api_check.py --wheels DIR [--out docs/vllm-api.md]

DIR holds vllm-<version>-*.whl files (`pip download --no-deps --only-binary=:all: --python-version 3.12
--platform manylinux_2_28_x86_64 -d DIR vllm==X`). Only the wheels' .py sources are read. A cell is "ok", "missing",
or the signature found when it lacks a parameter the plugin passes or expects. The last three rows check that the layout
digest Exl3Config.maybe_update_config writes into hf_config reaches vLLM's compiled-graph cache key.
"""
from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import zipfile

# (what the plugin needs, module, name, parameters the plugin relies on, in order; None: only that it exists)
IMPORTS = [
    ("register_quantization_config", "vllm.model_executor.layers.quantization", "register_quantization_config"),
    ("QuantizationConfig", "vllm.model_executor.layers.quantization.base_config", "QuantizationConfig"),
    ("QuantizeMethodBase", "vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase"),
    ("LinearBase", "vllm.model_executor.layers.linear", "LinearBase"),
    ("LinearMethodBase", "vllm.model_executor.layers.linear", "LinearMethodBase"),
    ("RowParallelLinear", "vllm.model_executor.layers.linear", "RowParallelLinear"),
    ("UnquantizedLinearMethod", "vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),
    ("VocabParallelEmbedding", "vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"),
    ("ParallelLMHead", "vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
    ("UnquantizedEmbeddingMethod", "vllm.model_executor.layers.vocab_parallel_embedding",
     "UnquantizedEmbeddingMethod"),
    ("RoutedExperts", "vllm.model_executor.layers.fused_moe", "RoutedExperts"),
    ("FusedMoEMethodBase", "vllm.model_executor.layers.fused_moe.fused_moe_method_base", "FusedMoEMethodBase"),
    ("set_weight_attrs", "vllm.model_executor.utils", "set_weight_attrs"),
    ("get_current_vllm_config", "vllm.config", "get_current_vllm_config"),
    ("get_current_vllm_config_or_none", "vllm.config", "get_current_vllm_config_or_none"),
    ("register_model_loader", "vllm.model_executor.model_loader", "register_model_loader"),
    ("DefaultModelLoader", "vllm.model_executor.model_loader.default_loader", "DefaultModelLoader"),
]
METHODS = [
    ("DefaultModelLoader.get_all_weights", "vllm.model_executor.model_loader.default_loader", "DefaultModelLoader",
     "get_all_weights", ["model_config", "model"]),
    ("QuantizationConfig.get_quant_method", "vllm.model_executor.layers.quantization.base_config",
     "QuantizationConfig", "get_quant_method", ["layer", "prefix"]),
    ("QuantizationConfig.maybe_update_config", "vllm.model_executor.layers.quantization.base_config",
     "QuantizationConfig", "maybe_update_config", ["model_name"]),
    ("QuantizationConfig.override_quantization_method", "vllm.model_executor.layers.quantization.base_config",
     "QuantizationConfig", "override_quantization_method", ["hf_quant_cfg", "user_quant"]),
    ("LinearMethodBase.create_weights", "vllm.model_executor.layers.linear", "LinearMethodBase", "create_weights",
     ["layer", "input_size_per_partition", "output_partition_sizes", "input_size", "output_size", "params_dtype"]),
    ("LinearMethodBase.apply", "vllm.model_executor.layers.linear", "LinearMethodBase", "apply",
     ["layer", "x", "bias"]),
    ("QuantizeMethodBase.embedding", "vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase",
     "embedding", ["layer"]),
    ("FusedMoEMethodBase.__init__", "vllm.model_executor.layers.fused_moe.fused_moe_method_base",
     "FusedMoEMethodBase", "__init__", ["moe"]),
    ("FusedMoEMethodBase.create_weights", "vllm.model_executor.layers.fused_moe.fused_moe_method_base",
     "FusedMoEMethodBase", "create_weights",
     ["layer", "num_experts", "hidden_size", "intermediate_size_per_partition", "params_dtype"]),
    ("FusedMoEMethodBase.apply", "vllm.model_executor.layers.fused_moe.fused_moe_method_base",
     "FusedMoEMethodBase", "apply", ["layer", "x", "topk_weights", "topk_ids"]),
    ("FusedMoEMethodBase.get_fused_moe_quant_config", "vllm.model_executor.layers.fused_moe.fused_moe_method_base",
     "FusedMoEMethodBase", "get_fused_moe_quant_config", ["layer"]),
    ("VocabParallelEmbedding.weight_loader", "vllm.model_executor.layers.vocab_parallel_embedding",
     "VocabParallelEmbedding", "weight_loader", ["param", "loaded_weight"]),
    ("UnquantizedEmbeddingMethod.create_weights", "vllm.model_executor.layers.vocab_parallel_embedding",
     "UnquantizedEmbeddingMethod", "create_weights", ["layer"]),
]
# Layer attributes the plugin reads (plugin/compat.py, linear_method.py, embedding_method.py): some assignment
# `self.<name> =` (or a def/property of that name) must exist in the package named.
ATTRS = [
    (f"RoutedExperts.{a}", "vllm/model_executor/layers/fused_moe/", a) for a in (
        "moe_config", "expert_map", "layer_name", "_map_global_expert_id_to_local_expert_id", "get_expert_mapping",
        "global_num_experts", "apply_router_weight_on_input")
] + [
    ("FusedMoEConfig.moe_parallel_config", "vllm/model_executor/layers/fused_moe/", "moe_parallel_config"),
    ("FusedMoEConfig.experts_per_token", "vllm/model_executor/layers/fused_moe/", "experts_per_token"),
    ("FusedMoEConfig.num_logical_experts", "vllm/model_executor/layers/fused_moe/", "num_logical_experts"),
    ("QKVParallelLinear.num_kv_head_replicas", "vllm/model_executor/layers/linear.py", "num_kv_head_replicas"),
    ("VocabParallelEmbedding.org_vocab_size", "vllm/model_executor/layers/vocab_parallel_embedding.py",
     "org_vocab_size"),
    ("VocabParallelEmbedding.params_dtype", "vllm/model_executor/layers/vocab_parallel_embedding.py",
     "params_dtype"),
]


# Our subclasses: every abstract method of their vLLM base (and its bases) must be defined, or they cannot be built.
HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN = os.path.join(os.path.dirname(HERE), "src", "exl3_vllm", "plugin")
OURS = [
    ("Exl3Config", "config.py", "vllm.model_executor.layers.quantization.base_config", "QuantizationConfig"),
    ("Exl3LinearMethod", "linear_method.py", "vllm.model_executor.layers.linear", "LinearMethodBase"),
    ("Exl3EmbeddingMethod", "embedding_method.py", "vllm.model_executor.layers.quantization.base_config",
     "QuantizeMethodBase"),
    ("Exl3MoEMethod", "moe_method.py", "vllm.model_executor.layers.fused_moe.fused_moe_method_base",
     "FusedMoEMethodBase"),
]


def our_methods(cls: str, file: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(open(os.path.join(PLUGIN, file)).read())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _is_abstract(fn) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "abstractmethod")
               or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod") for d in fn.decorator_list)


class Sources:
    """The .py files of one vllm wheel (or of an installed vllm: the directory holding its `vllm/`), parsed on
    demand."""

    def __init__(self, wheel: str):
        self.root = wheel if os.path.isdir(wheel) else None
        if self.root:
            base = os.path.join(self.root, "vllm")
            self.names = {os.path.relpath(os.path.join(d, f), self.root) for d, _, fs in os.walk(base)
                          for f in fs if f.endswith(".py")}
        else:
            self.zip = zipfile.ZipFile(wheel)
            self.names = {n for n in self.zip.namelist() if n.endswith(".py")}
        self._trees: dict[str, ast.Module | None] = {}

    def text(self, path: str) -> str:
        if self.root:
            with open(os.path.join(self.root, path), encoding="utf-8", errors="replace") as f:
                return f.read()
        return self.zip.read(path).decode("utf-8", "replace")

    def tree(self, module: str) -> tuple[ast.Module | None, str | None]:
        base = module.replace(".", "/")
        for path in (base + ".py", base + "/__init__.py"):
            if path in self.names:
                if path not in self._trees:
                    try:
                        self._trees[path] = ast.parse(self.text(path))
                    except SyntaxError:
                        self._trees[path] = None
                return self._trees[path], path
        return None, None

    def find(self, module: str, name: str, depth: int = 0):
        """(the def/class node or True for another binding, module) of a top-level name, following re-exports."""
        tree, path = self.tree(module)
        if tree is None or depth > 4:
            return None, None
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node, module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                src = node.module or ""
                if node.level:
                    pkg = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    src = ".".join(pkg + ([src] if src else []))
                orig = next(a.name for a in node.names if (a.asname or a.name) == name)
                found = self.find(src, orig, depth + 1)
                if found[0] is not None:
                    return found
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return True, module
        return None, None

    def method(self, module: str, cls: str, name: str, depth: int = 0):
        node, mod = self.find(module, cls)
        if not isinstance(node, ast.ClassDef) or depth > 4:
            return None
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                return item
        for b in node.bases:
            base = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
            if base:
                m = self.method(mod, base, name, depth + 1)
                if m is not None:
                    return m
        return None


    def abstract(self, module: str, cls: str, depth: int = 0) -> dict[str, bool]:
        """Method name -> abstract?, over the class and its bases (the nearest definition wins)."""
        node, mod = self.find(module, cls)
        if not isinstance(node, ast.ClassDef) or depth > 5:
            return {}
        out: dict[str, bool] = {}
        for b in node.bases:
            base = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
            if base and base not in ("ABC", "object", "Generic"):
                out.update(self.abstract(mod, base, depth + 1))
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[item.name] = _is_abstract(item)
        return out


def params(fn: ast.FunctionDef) -> tuple[list[str], bool]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return names, a.kwarg is not None


def check(src: Sources) -> dict[str, str]:
    out = {}
    for label, module, name in IMPORTS:
        out[label] = "ok" if src.find(module, name)[0] is not None else "missing"
    for label, module, cls, name, want in METHODS:
        fn = src.method(module, cls, name)
        if fn is None:
            out[label] = "missing"
            continue
        have, kwargs = params(fn)
        lacking = [p for p in want if p not in have]
        out[label] = "ok" if not lacking else f"({', '.join(have)}{', **kw' if kwargs else ''})"
    for cls, file, module, base in OURS:
        ours = our_methods(cls, file)
        lacking = sorted(m for m, abstract in src.abstract(module, base).items() if abstract and m not in ours)
        out[f"{cls} defines every abstract method of {base}"] = "ok" if not lacking else "lacks " + ", ".join(lacking)
        # vLLM calls our overrides with the base method's parameters: ours must accept each of them.
        bad = []
        for name, fn in sorted(ours.items()):
            theirs = src.method(module, base, name)
            if theirs is None or name == "__init__":
                continue
            have, kwargs = params(fn)
            missing = [p for p in params(theirs)[0] if p not in have]
            if missing and not kwargs:
                bad.append(f"{name} lacks {'/'.join(missing)}")
        out[f"{cls} overrides accept {base}'s parameters"] = "ok" if not bad else "; ".join(bad)
    for label, where, attr in ATTRS:
        files = [n for n in src.names if n.startswith(where)] if where.endswith("/") else [where]
        pat = re.compile(rf"(self\.{re.escape(attr)}\s*[:=]|def {re.escape(attr)}\b|^\s+{re.escape(attr)}\s*:)",
                         re.M)
        out[label] = "ok" if any(n in src.names and pat.search(src.text(n)) for n in files) else "missing"
    out.update(cache_key(src))
    return out


def _calls(fn, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == name] if fn is not None else []


def cache_key(src: Sources) -> dict[str, str]:
    """Exl3Config.maybe_update_config adds a layout digest to hf_config.quantization_config: is it in the hash?"""
    out = {}
    # (a) the quantization config is handed the model's own hf_config, by keyword.
    fn = src.method("vllm.config", "VllmConfig", "_get_quantization_config")
    calls = _calls(fn, "maybe_update_config")
    want = f"{params(fn)[0][0]}.hf_config" if fn is not None and params(fn)[0] else None
    ok = any(ast.unparse(k.value) == want for c in calls for k in c.keywords if k.arg == "hf_config")
    out["VllmConfig._get_quantization_config passes hf_config= to maybe_update_config"] = (
        "missing" if fn is None else "ok" if ok else "calls " + ast.unparse(calls[0]) if calls
        else "no maybe_update_config call")
    # (b) __post_init__ runs it on self.model_config itself, not through the deep-copying get_quantization_config.
    fn = src.method("vllm.config", "VllmConfig", "__post_init__")
    calls = _calls(fn, "_get_quantization_config") + _calls(fn, "get_quantization_config")
    ok = any(c.func.attr == "_get_quantization_config" and c.args and ast.unparse(c.args[0]) == "self.model_config"
             for c in calls)
    out["VllmConfig.__post_init__ calls _get_quantization_config(self.model_config, ...)"] = (
        "missing" if fn is None else "ok" if ok else "calls " + ast.unparse(calls[0]) if calls
        else "no (_)get_quantization_config call")
    # (c) VllmConfig's cache-key factors take ModelConfig's, which hash every field but its ignored_factors.
    name = next((m for m in ("compile_factors", "compute_hash") if src.method("vllm.config", "VllmConfig", m)), "")
    vhash = src.method("vllm.config", "VllmConfig", name)  # compute_hash to 0.33, compile_factors from 0.34
    mhash = src.method("vllm.config", "ModelConfig", name)
    if vhash is None or mhash is None:
        why = "missing"
    else:
        # ModelConfig's is called directly or through a local helper (0.34's get_factors).
        helpers = {n.name for n in ast.walk(vhash) if isinstance(n, ast.FunctionDef) and n is not vhash
                   and _calls(n, name)}
        calls = {ast.unparse(c) for c in ast.walk(vhash) if isinstance(c, ast.Call)}
        takes_model = f"self.model_config.{name}()" in calls or any(f"{h}(self.model_config)" in calls for h in helpers)
        ignored = {e.value for n in ast.walk(mhash) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Set)
                   and any(isinstance(t, ast.Name) and t.id == "ignored_factors" for t in n.targets)
                   for e in n.value.elts if isinstance(e, ast.Constant)}
        called = {n.func.id for n in ast.walk(mhash) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        fields = {n.target.id for n in src.find("vllm.config", "ModelConfig")[0].body
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        why = (f"VllmConfig.{name} does not take ModelConfig's" if not takes_model
               else "ignores hf_config" if "hf_config" in ignored
               else f"ModelConfig.{name} does not hash its fields" if not called & {"get_hash_factors",
                                                                                   "get_compile_factors"}
               else "hf_config is not a field" if "hf_config" not in fields else "ok")
    out["ModelConfig's hash (part of VllmConfig's) covers hf_config"] = why
    return out


def version_of(wheel: str) -> str:
    return os.path.basename(wheel).split("-")[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheels", required=True)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    wheels = sorted(glob.glob(os.path.join(a.wheels, "vllm-*.whl")),
                    key=lambda w: tuple(int(p) for p in re.findall(r"\d+", version_of(w))))
    results = {version_of(w): check(Sources(w)) for w in wheels}
    versions = list(results)
    labels = list(next(iter(results.values())))
    lines = ["| check | " + " | ".join(versions) + " |", "|---|" + "---|" * len(versions)]
    for lab in labels:
        lines.append(f"| `{lab}` | " + " | ".join(results[v][lab].replace("|", "/") for v in versions) + " |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# vLLM API the plugin uses, per release (tools/vllm_api_check.py)\n\n" + table + "\n")


if __name__ == "__main__":
    main()
