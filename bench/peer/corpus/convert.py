"""Convert the corpus models with exllamav3's own converter over the settings it offers (GPU machine).

    python3 bench/peer/corpus/convert.py --hf /tmp/corpus/hf --out /tmp/corpus/exl3 --set fixture|sample|gate|full|mtp \
        [--jobs 4]

Each entry of JOBS is one `exllamav3.conversion.convert_model` run (or a recipe, or the measure + optimize path) and
names its output directory. exllamav3 must be importable (its package on PYTHONPATH, its extension built).
Writes OUT/<name>/ and OUT/convert.json (command, seconds, return code per job), rewritten as each job ends so that
the reference forward (pipeline.sh) can start on a checkpoint while the others convert. Jobs that quantize the
embedding (-eb) start first: exllamav3 encodes the table on the GPU for about 270 s (825 s with five at once).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

# Per-tensor K that exllamav3's budgeted allocation never writes (it keeps q/k/v and gate/up at one K), but its
# --recipe and measure + optimize paths do: fused shards of different K (dense and experts).
RECIPE_DENSE = {"target_bpw": 3.5, "head_bits": 4, "tensors": {
    "*.q_proj": 4, "*.k_proj": 5, "*.v_proj": 3.5, "*.o_proj": 3, "*.gate_proj": 3, "*.up_proj": 4,
    "*.down_proj": 2.5}}
RECIPE_MOE = {"target_bpw": 3.0, "head_bits": 4, "tensors": {
    "*.q_proj": 3, "*.k_proj": 4, "*.v_proj": 4, "*.o_proj": 3, "*.experts.*.gate_proj": 3,
    "*.experts.*.up_proj": 3, "*.experts.*.down_proj": 2.5}}

# name: (model, converter arguments | ("recipe", dict, extra args) | ("optimize", [inputs], bits)
#        | ("sliced", MLP slicing bound, converter arguments), sets)
JOBS = {
    # CI fixtures (tests/data/corpus): two-layer models, mixed-K fused shards, quantized embeddings.
    "llama-recipe-eb4": ("llama-2l", ("recipe", RECIPE_DENSE, ["-eb", "4"]), "fixture sample gate full"),
    "qwen3-moe-recipe-eb3": ("qwen3-moe-2l", ("recipe", RECIPE_MOE, ["-eb", "3"]), "fixture sample gate full"),
    # Integer and fractional targets (budgeted allocation), default head (6 bits) and codebook (mul1).
    "llama-b2": ("llama", ["-b", "2"], "full"),
    "llama-b3": ("llama", ["-b", "3"], "gate full"),
    "llama-b4": ("llama", ["-b", "4"], "gate sample full"),
    "llama-b5": ("llama", ["-b", "5"], "full"),
    "llama-b6": ("llama", ["-b", "6"], "full"),
    "llama-b8": ("llama", ["-b", "8"], "full"),
    "llama-b2.25": ("llama", ["-b", "2.25"], "gate full"),
    "llama-b3.5": ("llama", ["-b", "3.5"], "gate full"),
    "llama-b4.13": ("llama", ["-b", "4.13"], "full"),
    "llama-b5.5": ("llama", ["-b", "5.5"], "full"),
    # Head bits, codebooks, --hq, quantized embeddings.
    "llama-b4-hb8": ("llama", ["-b", "4", "-hb", "8"], "gate full"),
    "llama-b3-hb3.5": ("llama", ["-b", "3", "-hb", "3.5"], "full"),
    "llama-b4-mcg": ("llama", ["-b", "4", "-cb", "mcg"], "full"),
    "llama-b5-mcg": ("llama", ["-b", "5", "-cb", "mcg"], "gate full"),
    "llama-b4-3inst": ("llama", ["-b", "4", "-cb", "3inst"], "gate sample full"),
    "llama-b4-hq": ("llama", ["-b", "4", "-hq"], "gate full"),
    "llama-b3.5-eb6": ("llama", ["-b", "3.5", "-eb", "6"], "full"),
    "llama-b4-eb8-hb16": ("llama", ["-b", "4", "-eb", "8", "-hb", "16"], "full"),
    # Measure + optimize between two models of one codebook (exllamav3's optimizer reads every input with the
    # first one's tensor names, so it cannot mix codebooks): shards of one fused layer may differ in K.
    "llama-opt3.5": ("llama", ("optimize", ["llama-b3", "llama-b4"], 3.5), "gate full"),
    # A sliced MLP (.slice.N modules), as the converter writes MLPs wider than 55,296: here with the bound at 256.
    "llama-b4-sl2": ("llama", ("sliced", 256, ["-b", "4"]), "gate full"),
    # Tied source embeddings (the converter unties and quantizes a separate head).
    "llama-tied-b4": ("llama-tied", ["-b", "4"], "gate sample full"),
    "llama-tied-b3.5-eb4": ("llama-tied", ["-b", "3.5", "-eb", "4"], "full"),
    # Qwen3 (hidden 384: the quantized embedding's last 256-group is half padding).
    "qwen3-b4": ("qwen3", ["-b", "4"], "full"),
    "qwen3-b3.5-eb5": ("qwen3", ["-b", "3.5", "-eb", "5"], "gate sample full"),
    "qwen3-b2.5-mcg": ("qwen3", ["-b", "2.5", "-cb", "mcg"], "full"),
    # Qwen3-MoE.
    "qwen3-moe-b4": ("qwen3-moe", ["-b", "4"], "gate sample full"),
    "qwen3-moe-b3-hq": ("qwen3-moe", ["-b", "3", "-hq"], "full"),
    "qwen3-moe-b2.5-eb4": ("qwen3-moe", ["-b", "2.5", "-eb", "4"], "full"),
    "qwen3-moe-b4-mcg": ("qwen3-moe", ["-b", "4", "-cb", "mcg"], "full"),
    "qwen3-moe-b6-hb8": ("qwen3-moe", ["-b", "6", "-hb", "8"], "full"),
    # Qwen3.5 (multimodal class) with its trained MTP layer (issue 46): the draft at 4 bits and the vision tower
    # unquantized, then the converter's defaults for both (mtp_bits 4, the architecture's vision bits).
    "qwen3.5-mtp-b4": ("qwen3.5-mtp", ["-b", "4", "-mb", "4", "-vb", "16"], "mtp"),
    "qwen3.5-mtp-b3.5": ("qwen3.5-mtp", ["-b", "3.5"], "mtp"),
    # GLM-4-MoE-Lite (GLM-4.7-Flash's class) with its trained DeepSeek-style MTP layer: the converter's defaults (the
    # draft at 4 bits, its eh_proj too: vLLM serves it with `--load-format exl3`), then the draft unquantized (served
    # without it; kv_a's padded fp16 shard in the draft's fused q_a/kv_a).
    "glm4-moe-lite-mtp-b4": ("glm4-moe-lite-mtp", ["-b", "4"], "mtp"),
    "glm4-moe-lite-mtp-b3.5-mb16": ("glm4-moe-lite-mtp", ["-b", "3.5", "-mb", "16"], "mtp"),
}
EXL = [sys.executable, "-m"]


def _run(cmd: list[str], log: str) -> tuple[int, float]:
    t = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    return rc, time.time() - t


def convert(name: str, hf: str, out: str, work: str) -> dict:
    model, spec, _ = JOBS[name]
    dst, wd, log = os.path.join(out, name), os.path.join(work, name), os.path.join(out, f"{name}.log")
    base = EXL + ["exllamav3.conversion.convert_model", "-i", os.path.join(hf, model), "-o", dst, "-w", wd, "-d", "0"]
    if isinstance(spec, list):
        cmd = base + spec
    elif spec[0] == "sliced":  # the converter with exllamav3's MLP slicing bound lowered (ex3_slicing.py)
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ex3_slicing.py"),
               str(spec[1])] + base[2:] + spec[2]
    elif spec[0] == "recipe":
        import yaml

        path = os.path.join(work, f"{name}.yaml")
        os.makedirs(work, exist_ok=True)
        with open(path, "w") as f:
            yaml.safe_dump(spec[1], f)
        cmd = base + ["-rcp", path] + spec[2]
    else:
        inputs, bits = spec[1], spec[2]  # converted by an earlier batch of this run
        meas = os.path.join(work, f"{name}.measurement.json")
        rc, s1 = _run(EXL + ["exllamav3.conversion.measure_model", "-r", os.path.join(hf, model), "-i"]
                      + [os.path.join(out, i) for i in inputs] + ["-o", meas], log + ".measure")
        if rc:
            return {"name": name, "rc": rc, "seconds": s1, "cmd": "measure_model"}
        cmd = EXL + ["exllamav3.conversion.optimize_model", "-m", meas, "-b", str(bits), "-o", dst, "-i"] + \
            [os.path.join(out, i) for i in inputs]
    rc, secs = _run(cmd, log)
    return {"name": name, "model": model, "rc": rc, "seconds": round(secs, 1),
            "cmd": " ".join(c if not c.startswith("/") else os.path.basename(c) for c in cmd[2:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/corpus/work")
    ap.add_argument("--set", default="full", help="fixture, sample, gate, full or mtp; several comma-separated")
    ap.add_argument("--only", default="")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--skip-set", default="", help="leave out the jobs of these sets, comma-separated (done by an "
                                                   "earlier run: --set full --skip-set gate is the rest)")
    ap.add_argument("--list", action="store_true", help="print the chosen job names and exit")
    args = ap.parse_args()
    skips, sets = set(filter(None, args.skip_set.split(","))), set(args.set.split(","))
    if sets - {"fixture", "sample", "gate", "full", "mtp"}:
        sys.exit(f"unknown set in --set {args.set}")
    names = args.only.split(",") if args.only else [n for n, j in JOBS.items() if sets & set(j[2].split())
                                                    and not skips & set(j[2].split())]
    if args.list:
        print(",".join(names))
        return
    os.makedirs(args.out, exist_ok=True)
    # Optimize jobs read other outputs: run them after everything else. Longest (quantized embedding) first.
    first = sorted((n for n in names if isinstance(JOBS[n][1], list) or JOBS[n][1][0] != "optimize"),
                   key=lambda n: "-eb" not in str(JOBS[n][1]))
    later = [n for n in names if n not in first]
    record = os.path.join(args.out, "convert.json")
    earlier = [r for r in json.load(open(record)) if r["name"] not in names] if os.path.exists(record) else []
    results = []
    for batch in (first, later):
        with ThreadPoolExecutor(args.jobs) as pool:
            for fut in as_completed([pool.submit(convert, n, args.hf, args.out, args.work) for n in batch]):
                r = fut.result()
                print(f"[convert] {r['name']}: rc={r['rc']} {r['seconds']}s", flush=True)
                results.append(r)
                with open(record + ".tmp", "w") as f:
                    json.dump(earlier + results, f, indent=1)
                os.replace(record + ".tmp", record)
    if any(r["rc"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
