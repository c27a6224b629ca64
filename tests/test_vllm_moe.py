"""EXL3 mixture-of-experts in vLLM: the per-expert reference, the expert loaders, and the real CPU engine.

Engine runs (tiny Qwen3-MoE at TP=1, tiny Mixtral at TP=2, tiny Qwen2-MoE with a shared expert under
expert parallelism) are compared with HF transformers on the dense twin (--also-dense, float32), which
holds each expert's reconstructed weight.
"""

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (the README's set-up command installs it)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine import results, run_engine  # noqa: E402
from exl3_vllm.format import codebook as cb  # noqa: E402
from exl3_vllm.format.checkpoint import Checkpoint, signs_to_half  # noqa: E402
from exl3_vllm.format.errors import Exl3FormatError  # noqa: E402
from exl3_vllm.format.reconstruct import dense_weight, w_hat  # noqa: E402
from exl3_vllm.synth import load_config, synthesize  # noqa: E402

PROMPTS = ["w1 w2 w3 w4", "w10 w20 w30", "w5 w600 w7 w8 w9 w10 w11", "w999 w3"]
MAX_TOKENS = 16
QWEN_PREFIX = "model.layers.{}.mlp.experts"
MIXTRAL_PREFIX = "model.layers.{}.block_sparse_moe.experts"
# k/v and experts 256 wide: 128-wide halves at TP=2.
QWEN_CFG = dict(load_config("tiny-qwen3-moe"), num_key_value_heads=4, moe_intermediate_size=256)
# Per layer one K per projection; gate/up (fused into w13) share theirs; down and the layers differ.
QWEN_BITS = {
    "model.layers.0.mlp.experts.*.gate_proj": 3,
    "model.layers.0.mlp.experts.*.up_proj": 3,
    "model.layers.0.mlp.experts.*.down_proj": 5,
    "model.layers.1.mlp.experts.*": {"bits": 2.5, "codebook": "mul1"},
}
# Experts 192 wide, padded to 256 in the checkpoint (128 + 64 real columns per rank at TP=2); layer 0
# mixes K and codebooks across experts, layer 1 gives down its own codebook.
MIXTRAL_CFG = dict(load_config("tiny-mixtral"), num_key_value_heads=4, intermediate_size=192)
MIXTRAL_BITS = {
    "model.layers.0.block_sparse_moe.experts.[0-3].*": 4,
    "model.layers.0.block_sparse_moe.experts.[4-5].*": {"bits": 3, "codebook": "3inst"},
    "model.layers.0.block_sparse_moe.experts.[6-7].w[13]": {"bits": 2, "codebook": "mcg"},
    "model.layers.0.block_sparse_moe.experts.[6-7].w2": 6,
    "model.layers.1.block_sparse_moe.experts.*.w2": {"bits": 3, "codebook": "mcg"},
    "model.layers.1.block_sparse_moe.experts.*.w[13]": 4,
}

# Shared expert 256 wide (dense path, split at TP=2); routed experts whole on each rank under EP.
QWEN2_CFG = dict(load_config("tiny-qwen2-moe"), num_key_value_heads=4)
QWEN2_BITS = {"*.mlp.shared_expert.*": 5, "*.mlp.experts.*": {"bits": 3, "codebook": "mcg"}}


def run_vllm(model, tp=1, extra=None):
    """Results and the engine's log (EXL3_VLLM_DEBUG_NAMES on: each rank logs its experts)."""
    proc = run_engine(model, "float32", PROMPTS, MAX_TOKENS, tp, extra, env={"EXL3_VLLM_DEBUG_NAMES": "1"})
    return results(proc), proc.stdout + proc.stderr


def _pair(tmp_path_factory, name, cfg, bits_map, seed, embed_bits=16):
    """A synthetic EXL3 checkpoint and its fp32 dense twin."""
    root = tmp_path_factory.mktemp(name)
    q, d = str(root / "exl3"), str(root / "dense")
    synthesize(cfg, q, bits=4, head_bits=6, bits_map=bits_map, seed=seed, also_dense=d, dense_dtype="float32",
               embed_bits=embed_bits)
    return q, d


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _pair(tmp_path_factory, "qwen3moe", QWEN_CFG, QWEN_BITS, 1, embed_bits=3)  # a quantized embedding too


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _pair(tmp_path_factory, "mixtral", MIXTRAL_CFG, MIXTRAL_BITS, 2)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _pair(tmp_path_factory, "qwen2moe", QWEN2_CFG, QWEN2_BITS, 4)


def _route(t, n_experts, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.softmax(torch.randn(t, n_experts, generator=g), -1).topk(top_k, -1)
    return w / w.sum(-1, keepdim=True), ids


def _dense(ck, key):
    """fp64 original-basis W (k x n) of one checkpoint module."""
    w = ck.weights(key)
    return dense_weight(w.trellis, w.suh, w.svh, w.codebook, torch.float64)


def _dense_experts(ck, prefix, names, n):
    """(gate, up, down) of every expert, trimmed to the model's widths."""
    hidden, inter = ck.config["hidden_size"], ck.config.get("moe_intermediate_size") or ck.config["intermediate_size"]
    out = []
    for e in range(n):
        g, u, d = (_dense(ck, f"{prefix}.{e}.{p}") for p in names)
        out.append((g[:hidden, :inter], u[:hidden, :inter], d[:inter, :hidden]))
    return out


def _dense_moe(x, w, ids, experts):
    """fp64 oracle: SwiGLU per routed expert, weighted sum; ids < 0 contribute nothing."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            if ids[t, j] < 0:
                continue
            g, u, d = experts[int(ids[t, j])]
            xt = x[t].double()
            out[t] += w[t, j].double() * ((torch.nn.functional.silu(xt @ g) * (xt @ u)) @ d)
    return out


def _close(got, want, rel=1e-5):
    return (got.double() - want).abs().max().item() <= rel * want.abs().max().item() + 1e-6


def _stacks(ck, prefix, names, n, decode):
    """ExpertStacks straight from the checkpoint, every expert its own group (the mixed-K layout)."""
    from exl3_vllm.plugin.moe_op import ExpertStack

    ws = [[ck.weights(f"{prefix}.{e}.{p}") for p in names] for e in range(n)]
    out = []
    for sel in (slice(0, 2), slice(2, 3)):
        rows = [r[sel] for r in ws]
        trellis = [torch.cat([w.trellis for w in r], dim=1)[None] for r in rows]
        codes = [int(cb.Codebook.of(r[0].codebook)) for r in rows]
        suh = torch.stack([torch.stack([w.suh for w in r]) if len(r) > 1 else r[0].suh for r in rows])
        svh = torch.stack([torch.cat([w.svh for w in r]) for r in rows])
        sizes = [r.svh.numel() for r in rows[0]] if len(rows[0]) > 1 else [rows[0][0].svh.numel()]
        dec = torch.stack([w_hat(t[0], c) for t, c in zip(trellis, codes)]) if decode else None
        out.append(ExpertStack(trellis, codes, [(e, 0) for e in range(n)], suh, svh, sizes, dec))
    return out


@pytest.mark.parametrize("model", ["qwen", "mixtral"])
def test_reference_moe_equals_dense_per_expert_and_traces(model, request):
    from exl3_vllm.plugin.moe_op import exl3_moe

    q, _ = request.getfixturevalue(model)
    ck = Checkpoint(q)
    prefix, names = ((QWEN_PREFIX.format(0), ("gate_proj", "up_proj", "down_proj")) if model == "qwen"
                     else (MIXTRAL_PREFIX.format(0), ("w1", "w3", "w2")))  # Mixtral layer 0: mixed K
    inter = ck.config.get("moe_intermediate_size") or ck.config["intermediate_size"]
    experts = _dense_experts(ck, prefix, names, 8)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(5))
    w, ids = _route(37, 8, 2, 6)
    want = _dense_moe(x, w, ids, experts)
    w13, w2 = _stacks(ck, prefix, names, 8, decode=True)
    sparse = exl3_moe(x, w, ids, w13, w2, inter, dense=False)
    for got in (sparse, exl3_moe(x, w, ids, w13, w2, inter, dense=True),
                exl3_moe(x, w, ids, *_stacks(ck, prefix, names, 8, decode=False), inter)):  # decodes per call
        assert _close(got, want)
    assert torch.equal(sparse, exl3_moe(x, w, ids, w13, w2, inter, dense=False))  # deterministic
    # Experts on another rank (id -1) contribute nothing.
    ids_ep = torch.where(ids >= 4, torch.full_like(ids, -1), ids)
    assert _close(exl3_moe(x, w, ids_ep, w13, w2, inter), _dense_moe(x, w, ids_ep, experts))
    # vLLM's CPU engine traces apply() with Dynamo in one graph: there the experts run as the opaque
    # exl3::moe op, which gathers the routed rows exactly as the eager call does.
    traced = torch.compile(lambda a, b, c: exl3_moe(a, b, c, w13, w2, inter), fullgraph=True, backend="eager")
    assert torch.equal(traced(x, w, ids), sparse)


class _FakeExperts(torch.nn.Module):
    """The RoutedExperts attributes Exl3MoEMethod reads (vLLM 0.32 names), without an engine."""

    def __init__(self, n, tp_rank=0, tp_size=1, local=None, names=("gate_proj", "down_proj", "up_proj")):
        super().__init__()
        from types import SimpleNamespace

        self.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size),
                                          activation="silu", is_act_and_mul=True, num_logical_experts=n,
                                          num_experts=n)
        self.global_num_experts = n
        self.activation = "silu"
        self.ckpt_gate_proj_name, self.ckpt_down_proj_name, self.ckpt_up_proj_name = names
        self.local = list(range(n)) if local is None else local
        self.expert_map = None if local is None else torch.tensor(
            [self.local.index(e) if e in self.local else -1 for e in range(n)])
        self.apply_router_weight_on_input = False

    def _map_global_expert_id_to_local_expert_id(self, e):
        return self.local.index(e) if e in self.local else -1


MIXTRAL_NAMES = ("w1", "w2", "w3")


def _config(path):
    from exl3_vllm.plugin.config import Exl3Config

    c = Exl3Config({"quant_method": "exl3"})
    c.load_checkpoint(path)
    return c


def _load_layer(path, prefix, layer, inter=256, hidden=256, skip=()):
    """Build and load a fake experts layer the way RoutedExperts.load_weights calls our loaders."""
    from exl3_vllm.plugin.moe_method import Exl3MoEMethod

    cfg = _config(path)
    method = Exl3MoEMethod(cfg, prefix, layer)
    tp_size = layer.moe_config.moe_parallel_config.tp_size
    method.create_weights(layer, num_experts=len(layer.local), hidden_size=hidden,
                          intermediate_size_per_partition=inter // tp_size, params_dtype=torch.float32,
                          weight_loader=None)
    ck = cfg.checkpoint
    gate, down, up = layer.ckpt_gate_proj_name, layer.ckpt_down_proj_name, layer.ckpt_up_proj_name
    loaded = 0
    for e in range(layer.global_num_experts):
        for proj, stem, shard in ((gate, "w13", "w1"), (up, "w13", "w3"), (down, "w2", "w2")):
            spec = ck.modules[f"{prefix}.{e}.{proj}"]
            for suffix in spec.tensors:
                if f"{e}.{proj}.{suffix}" in skip:
                    continue
                param = getattr(layer, f"{stem}_{suffix}")
                ok = param.weight_loader(param=param, loaded_weight=ck.tensor(f"{spec.key}.{suffix}"),
                                         weight_name=f"{prefix}.{stem}_{suffix}", shard_id=shard, expert_id=e,
                                         return_success=True)
                loaded += ok
                assert ok == (e in layer.local)
    method.process_weights_after_loading(layer)
    return method, loaded


def test_loaders_tp2_shards_are_the_reference_slices_and_tp_ep_sum_to_tp1(qwen):
    q, _ = qwen
    prefix = QWEN_PREFIX.format(1)  # K = 2.5, mul1
    ck = Checkpoint(q)
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(7))
    w, ids = _route(19, 8, 2, 8)
    m1, loaded = _load_layer(q, prefix, l1 := _FakeExperts(8))
    assert loaded == 8 * 3 * 4  # trellis, suh, svh and the mul1 marker per projection and expert
    assert tuple(l1.w13_trellis.shape) == (8, 16, 32, 40) and tuple(l1.w2_trellis.shape) == (8, 16, 16, 40)
    want = m1.apply(l1, x, w, ids)
    assert isinstance(want, torch.Tensor) and want.shape == x.shape
    assert _close(want, _dense_moe(x, w, ids, _dense_experts(ck, prefix, ("gate_proj", "up_proj", "down_proj"), 8)))
    parts = []
    for r in range(2):
        m, _ = _load_layer(q, prefix, lay := _FakeExperts(8, r, 2))
        assert tuple(lay.w13_trellis.shape) == (8, 16, 16, 40) and tuple(lay.w2_suh.shape) == (8, 128)
        # Rank r holds columns [128r, 128r+128) of gate and up and the same rows of down, exactly.
        e = 5
        cols = slice(128 * r, 128 * r + 128)
        for h, proj in enumerate(("gate_proj", "up_proj")):
            shard = dense_weight(lay.w13_trellis[e][:, 8 * h:8 * h + 8], lay.w13_suh[e, h],
                                 lay.w13_svh[e, 128 * h:128 * h + 128], "mul1", torch.float64)
            assert torch.allclose(shard, _dense(ck, f"{prefix}.{e}.{proj}")[:, cols], rtol=0, atol=1e-12)
        shard = dense_weight(lay.w2_trellis[e], lay.w2_suh[e], lay.w2_svh[e], "mul1", torch.float64)
        assert torch.allclose(shard, _dense(ck, f"{prefix}.{e}.down_proj")[cols], rtol=0, atol=1e-12)
        parts.append(m.apply(lay, x, w, ids))
    assert _close(parts[0] + parts[1], want, 1e-4)
    ep = [_load_layer(q, prefix, lay := _FakeExperts(8, local=list(range(4 * r, 4 * r + 4))))[0].apply(lay, x, w, ids)
          for r in range(2)]
    assert tuple(lay.w13_trellis.shape)[0] == 4
    assert _close(ep[0] + ep[1], want)


def test_loaders_group_mixed_k_and_drop_padding_columns(mixtral):
    q, _ = mixtral
    ck = Checkpoint(q)
    prefix = MIXTRAL_PREFIX.format(0)  # experts 0-3: 4 bits mul1, 4-5: 3 bits 3inst, 6-7: 2 bits mcg / 6 bits
    experts = _dense_experts(ck, prefix, ("w1", "w3", "w2"), 8)
    x = torch.randn(23, 256, generator=torch.Generator().manual_seed(9))
    w, ids = _route(23, 8, 2, 10)
    want = _dense_moe(x, w, ids, experts)
    for tp in (1, 2):
        got = 0
        for r in range(tp):
            m, _ = _load_layer(q, prefix, lay := _FakeExperts(8, r, tp, names=MIXTRAL_NAMES), inter=192)
            assert [tuple(t.shape[::3]) for t in lay.exl3.w13.trellis] == [(4, 64), (2, 48), (2, 32)]
            assert [tuple(t.shape[::3]) for t in lay.exl3.w2.trellis] == [(4, 64), (2, 48), (2, 96)]
            assert lay.exl3.w13.codebooks == [2, 0, 1] and lay.exl3.w2.codebooks == [2, 0, 2]
            # Real checkpoints' padding columns decode to noise: they must not reach the output.
            n_pp = 256 // tp
            for h in range(2):
                lay.w13_svh[:, h * n_pp:(h + 1) * n_pp][:, lay.exl3.plan["inter_valid"]:] = 1
            lay.w2_suh[:, lay.exl3.plan["inter_valid"]:] = 1
            got = got + m.apply(lay, x, w, ids)
        assert lay.exl3.plan["inter_valid"] == (192 if tp == 1 else 64)
        assert _close(got, want, 1e-4)


def test_legacy_sign_vectors_load_expanded(qwen):
    from exl3_vllm.format.safetensors_io import TensorInfo

    q, _ = qwen
    cfg = _config(q)
    prefix = QWEN_PREFIX.format(0)
    spec = cfg.checkpoint.modules[f"{prefix}.2.up_proj"]
    t = spec.tensors.pop("suh")
    spec.tensors["su"] = TensorInfo(f"{spec.key}.su", "I16", (t.shape[0] // 16,), t.file, 0, t.shape[0] // 8)
    from exl3_vllm.plugin.moe_method import Exl3MoEMethod

    lay = _FakeExperts(8)
    Exl3MoEMethod(cfg, prefix, lay).create_weights(lay, num_experts=8, hidden_size=256,
                                                   intermediate_size_per_partition=256,
                                                   params_dtype=torch.float32)
    packed = torch.randint(-32768, 32767, (16,), dtype=torch.int16)
    assert lay.w13_su.weight_loader(lay.w13_su, packed, shard_id="w3", expert_id=2, return_success=True)
    assert torch.equal(lay.w13_suh[2, 1], signs_to_half(packed))


def test_clear_errors_128_rule_gate_up_mismatch_missing_experts_and_bad_shapes(tmp_path, qwen):
    from exl3_vllm.plugin.config import Exl3Config
    from exl3_vllm.plugin.moe_method import Exl3MoEMethod

    q, _ = qwen
    prefix = QWEN_PREFIX.format(0)
    with pytest.raises(Exl3FormatError, match=r"intermediate width 256 .* 64 per rank at tensor_parallel_size=4"
                                              r".*multiples of 128.*tensor_parallel_size in \[1, 2\]"
                                              r".*enable-expert-parallel"):
        _load_layer(q, prefix, _FakeExperts(8, 0, 4))
    bad = str(tmp_path / "mixed")
    synthesize(QWEN_CFG, bad, bits=4, seed=3, bits_map={"model.layers.0.mlp.experts.[35].up_proj": 2})
    # Refused when vLLM reads the config, before any model exists; inspect says the same and exits 1.
    with pytest.raises(Exl3FormatError, match=r"experts\.3\.gate_proj.*2 routed experts in 1 layer\(s\) whose gate and "
                                              r"up differ .*here 4 bits mul1 and 2 bits mul1.*one tensor"):
        _config(bad)
    assert "whose gate and up differ" in Checkpoint(bad).unsupported[0][1]
    # The method's own guard, for a config that got past that check.
    cfg = Exl3Config({"quant_method": "exl3"})
    cfg.checkpoint = Checkpoint(bad)
    with pytest.raises(Exl3FormatError, match=r"gate and up of an expert differ .*experts 3,5: gate_proj 4 bits "
                                              r"mul1, up_proj 2 bits mul1\).*one w13 tensor"):
        Exl3MoEMethod(cfg, prefix, _FakeExperts(8))
    cfg = _config(q)
    for e in (3, 4, 6):
        del cfg.checkpoint.modules[f"{prefix}.{e}.down_proj"]
    cfg._resolver = None
    with pytest.raises(Exl3FormatError, match=r"8 experts, but not every .*experts 3-4,6 down_proj: missing"):
        Exl3MoEMethod(cfg, prefix, _FakeExperts(8))
    with pytest.raises(Exl3FormatError, match=r"experts\.5\.down_proj\.svh.*never loaded"):
        _load_layer(q, prefix, _FakeExperts(8), skip={"5.down_proj.svh"})
    lay = _FakeExperts(8)
    _load_layer(q, prefix, lay)
    t = Checkpoint(q).tensor(f"{prefix}.1.gate_proj.trellis")
    with pytest.raises(Exl3FormatError, match=r"experts\.1\.gate_proj\.trellis'.*shape \[16, 48\] to the "
                                              r"expert loader.*header says \[16, 16, 48\]"):
        lay.w13_trellis.weight_loader(lay.w13_trellis, t[0], shard_id="w1", expert_id=1, return_success=True)
    lay.activation = "gelu"
    with pytest.raises(Exl3FormatError, match="SwiGLU"):
        Exl3MoEMethod(_config(q), prefix, lay)


# ---- the real vLLM CPU engine ------------------------------------------------------------------

def _check_against_dense_oracle(results, dense_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    for res in results:
        ids = res["prompt_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              min_new_tokens=MAX_TOKENS)
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        assert res["tokens"] == out[0, len(ids):].tolist()
        want = [lp[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
        got = res["prompt_logprobs"]
        assert all(g is not None for g in got)
        assert max(abs(a - b) for a, b in zip(got, want)) < 2e-3


def test_engine_qwen3_moe_greedy_and_prompt_logprobs_match_dense_oracle(qwen):
    q, d = qwen
    results, log = run_vllm(q)
    assert "exl3 experts: model.layers.1.mlp.experts -> 8 of 8 experts on this rank (0-7)" in log
    _check_against_dense_oracle(results, d)


def test_engine_mixtral_tensor_parallel_2_matches_dense_oracle(mixtral):
    # TP=2 splits every expert (padded intermediate, experts of mixed K and codebook) across two ranks.
    q, d = mixtral
    results, log = run_vllm(q, tp=2)
    for cols in ("0-128", "128-256"):
        assert f"block_sparse_moe.experts -> 8 of 8 experts on this rank (0-7), intermediate columns {cols}" in log
    _check_against_dense_oracle(results, d)


def test_engine_qwen2_moe_shared_expert_and_expert_parallel_2_match_dense_oracle(qwen2):
    # Each rank holds 4 whole experts; the shared expert takes the dense EXL3 path (split at TP=2) and
    # its sigmoid gate loads unquantized.
    q, d = qwen2
    results, log = run_vllm(q, tp=2, extra={"enable_expert_parallel": True})
    for ids in ("0-3", "4-7"):
        assert f"mlp.experts -> 4 of 8 experts on this rank ({ids})" in log
    assert "mlp.shared_expert.gate_up_proj -> gate_proj=model.layers.0.mlp.shared_expert.gate_proj:Exl3Spec" in log
    _check_against_dense_oracle(results, d)


def test_expert_tensors_loader_keeps_3d_tensors_whole():
    """vLLM 0.25 unbinds every 3-D expert tensor as stacked experts; ours hands each trellis whole to its expert."""
    from types import SimpleNamespace

    from exl3_vllm.plugin.moe_method import Exl3MoEMethod
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    calls = []

    def param(name):
        return SimpleNamespace(weight_loader=lambda **kw: calls.append((name, kw)) or True)

    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts=12,
                                                        num_redundant_experts=0, routed_experts_prefix="")
    layer = SimpleNamespace(layer_name="model.layers.3.mlp.experts", get_expert_mapping=lambda: mapping,
                            w13_trellis=param("w13_trellis"), w2_trellis=param("w2_trellis"), w2_mul1=param("w2_mul1"))
    trellis = torch.zeros(16, 32, 64, dtype=torch.int16)
    weights = [("11.down_proj.trellis", trellis), ("1.up_proj.trellis", trellis), ("1.down_proj.mul1", torch.tensor(1)),
               ("0.gate_proj.weight_not_ours", trellis)]
    method = SimpleNamespace(path="/ckpt")
    load = Exl3MoEMethod._expert_tensors_loader(method, layer)
    with pytest.raises(Exl3FormatError, match="experts.0.gate_proj.weight_not_ours"):
        list(load(weights))
    assert [n for n, _ in calls] == ["w2_trellis", "w13_trellis", "w2_mul1"]
    got = [(n, kw["expert_id"], kw["shard_id"], kw["loaded_weight"].shape) for n, kw in calls]
    assert got == [("w2_trellis", 11, "w2", trellis.shape), ("w13_trellis", 1, "w3", trellis.shape),
                   ("w2_mul1", 1, "w2", torch.Size([]))]


def test_an_experts_non_finite_scale_is_refused_at_load(tmp_path):
    q = str(tmp_path / "nan")
    synthesize(QWEN_CFG, q, bits=4, seed=3)
    name = "model.layers.1.mlp.experts.2.down_proj.svh"
    info = Checkpoint(q).tensors[name]
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 2 * 9)
        f.write(bytes([0x00, 0x7C]))  # fp16 +Inf in channel 9
    proc = run_engine(q, "float32", PROMPTS[:1], 4, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and name in out and "NaN or Inf" in out, out[-3000:]


def test_engine_refuses_experts_of_mixed_gate_up_k_before_building_the_model(tmp_path):
    import time

    bad = str(tmp_path / "mixed")
    synthesize(QWEN_CFG, bad, bits=4, seed=3, bits_map={"model.layers.1.mlp.experts.[35].up_proj": 2})
    t0 = time.time()
    proc = run_engine(bad, "float32", PROMPTS[:1], 4, timeout=300)
    seconds = time.time() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "model.layers.1.mlp.experts.3.gate_proj" in out and "whose gate and up differ" in out, out[-3000:]
    # Raised while vLLM builds its config (VllmConfig): no layer was built, no weight method ran.
    assert "create_engine_config" in out and "create_weights" not in out and "FusedMoE" not in out, out[-4000:]
    ours = proc.stderr.find("EXL3 checkpoint error:")
    assert ours != -1 and (proc.stderr.find("Traceback") == -1 or ours < proc.stderr.find("Traceback"))
    print(f"refused in {seconds:.1f} s (engine process start included)")
