"""Run-time compilation of the package's CUDA sources with NVRTC, a disk cache, and module loading.

Needs only the `cuda-bindings` and `nvidia-cuda-nvrtc` wheels: the sources include no CUDA
headers, so no toolkit is required.  Compiling needs no GPU; loading and launching do.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .. import settings

FILE_HEADERS = ("exl3_common.cuh", "exl3_input.cuh", "exl3_wgmma.cuh", "exl3_linear_args.cuh", "exl3_gemm_copy.cuh",
                "exl3_gemm_tail.cuh", "exl3_gemm_mma.cuh", "exl3_gemm_wg.cuh", "exl3_gemm_body.cuh",
                "exl3_gemm_ws.cuh", "exl3_recon.cuh")
# Headers made in Python at compile time, not files: the tier table's kernel instantiations.
GENERATED_HEADERS = ("exl3_tiers.cuh",)
HEADERS = FILE_HEADERS + GENERATED_HEADERS
# Fixed options; --use_fast_math is avoided so fp32 arithmetic stays IEEE round-to-nearest.
_BASE_OPTS = ("-std=c++17", "-Xptxas=-v", "--fmad=true")


class KernelError(RuntimeError):
    """A kernel could not be compiled, loaded or launched; the message says what to do."""


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise KernelError(
            "exl3-vllm kernels need NVRTC through cuda-python: `pip install 'cuda-bindings>=13' "
            "'nvidia-cuda-nvrtc>=13'` (or the exl3-vllm[kernels] extra)") from e
    return nvrtc


def _check(res, what: str):
    err = res[0]
    if int(err) != 0:
        raise KernelError(f"{what} failed: {err!r}")
    return res[1] if len(res) == 2 else res[1:]


def nvrtc_version() -> tuple[int, int]:
    nv = _nvrtc()
    r = nv.nvrtcVersion()
    _check((r[0], None), "nvrtcVersion")
    return int(r[1]), int(r[2])


def supported_archs() -> list[int]:
    nv = _nvrtc()
    return [int(a) for a in _check(nv.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")]


def read_source(name: str) -> bytes:
    if name == "exl3_tiers.cuh":
        from .variants import tier_instantiations
        return tier_instantiations().encode()
    return resources.files("exl3_vllm.kernels").joinpath("cuda", name).read_bytes()


def cache_dir() -> Path:
    base = settings.get("EXL3_VLLM_CACHE_DIR")
    if base:
        return Path(base) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".cache"
    return root / "exl3_vllm" / "kernels"


@dataclass
class KernelInfo:
    name: str
    registers: int
    smem_static: int
    stack: int
    spill_stores: int
    spill_loads: int


@dataclass
class Compiled:
    source: str
    arch: int
    defines: dict
    cubin: bytes
    log: str
    cached: bool

    def kernels(self) -> list[KernelInfo]:
        return parse_ptxas_log(self.log)


_FUNC_RE = re.compile(r"Function properties for (\w+)")
_STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REG_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str) -> list[KernelInfo]:
    """Registers, static shared memory, stack and spills per kernel from a `-Xptxas -v` log."""
    out: list[KernelInfo] = []
    cur = None
    for line in log.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            cur = KernelInfo(m.group(1), 0, 0, 0, 0, 0)
            out.append(cur)
            continue
        if cur is None:
            continue
        m = _STACK_RE.search(line)
        if m:
            cur.stack, cur.spill_stores, cur.spill_loads = map(int, m.groups())
            continue
        m = _REG_RE.search(line)
        if m:
            cur.registers = int(m.group(1))
            cur.smem_static = int(m.group(2) or 0)
    return out


def arch_flag(arch: int) -> str:
    """The NVRTC target: Hopper builds for sm_90a so the wgmma tiers exist (the cubin runs only on sm_90 parts)."""
    return f"sm_{arch}a" if arch == 90 else f"sm_{arch}"


def _key(src: bytes, arch: int, defines: dict) -> str:
    h = hashlib.sha256()
    h.update(src)
    for hdr in HEADERS:
        h.update(read_source(hdr))
    h.update(repr((arch_flag(arch), sorted(defines.items()), _BASE_OPTS, nvrtc_version())).encode())
    return h.hexdigest()[:32]


def compile_source(source: str, arch: int, defines: dict | None = None, use_cache: bool = True,
                   text: bytes | None = None) -> Compiled:
    """Compile one .cu of the package to a cubin for sm_<arch>, through the disk cache.

    text: compile this source instead of the package file (benchmark probes that include the package's headers);
    source then only names it."""
    defines = dict(defines or {})
    src = read_source(source) if text is None else text
    key = _key(src, arch, defines)
    cdir = cache_dir()
    stem = f"{Path(source).stem}-sm{arch}-{key}"
    cubin_path, log_path = cdir / f"{stem}.cubin", cdir / f"{stem}.log"
    if use_cache and cubin_path.is_file() and log_path.is_file():
        return Compiled(source, arch, defines, cubin_path.read_bytes(), log_path.read_text(), True)
    if arch not in supported_archs():
        raise KernelError(f"this NVRTC {nvrtc_version()} cannot compile for sm_{arch} "
                          f"(supports {supported_archs()}); install a newer nvidia-cuda-nvrtc")
    if arch < 80:
        raise KernelError(f"exl3-vllm kernels need compute capability 8.0 or newer, got sm_{arch}")
    nv = _nvrtc()
    hdrs = [read_source(h) for h in HEADERS]
    prog = _check(nv.nvrtcCreateProgram(src, source.encode(), len(hdrs), hdrs,
                                        [h.encode() for h in HEADERS]), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch_flag(arch)}".encode(), *(o.encode() for o in _BASE_OPTS)]
        opts += [f"-D{k}={v}".encode() for k, v in sorted(defines.items())]
        res = nv.nvrtcCompileProgram(prog, len(opts), opts)
        size = _check(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        nv.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\x00 ").decode(errors="replace")
        if int(res[0]) != 0:
            raise KernelError(f"NVRTC failed to compile {source} for sm_{arch} with {defines}:\n{log}")
        size = _check(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        nv.nvrtcGetCUBIN(prog, cubin)
    finally:
        nv.nvrtcDestroyProgram(prog)
    if use_cache:
        try:
            cdir.mkdir(parents=True, exist_ok=True)
            for path, data in ((log_path, log.encode()), (cubin_path, cubin)):
                fd, tmp = tempfile.mkstemp(dir=cdir, prefix=".tmp-")
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs recompiles
    return Compiled(source, arch, defines, cubin, log, False)


# ---------------------------------------------------------------------------------------------
# Loading and launching (GPU only)

_lock = threading.Lock()
_modules: dict = {}


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover
        raise KernelError("cuda-bindings is needed to launch exl3-vllm kernels: pip install 'cuda-bindings>=13'") from e
    return driver


def driver_version() -> str:
    """The CUDA driver's version number as a string, "na" when it cannot be read (a key part, not a check)."""
    try:
        err, v = _driver().cuDriverGetVersion()
        return str(v) if int(err) == 0 else "na"
    except Exception:  # noqa: BLE001 - a key without the driver only re-times more often
        return "na"


def _ensure_context(device_index: int):
    import torch
    drv = _driver()
    _check((drv.cuInit(0)[0], None), "cuInit")
    with torch.cuda.device(device_index):
        torch.empty(1, device=f"cuda:{device_index}")  # makes the runtime's primary context current
        ctx = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(ctx) == 0:
            dev = _check(drv.cuDeviceGet(device_index), "cuDeviceGet")
            ctx = _check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _check((drv.cuCtxSetCurrent(ctx)[0], None), "cuCtxSetCurrent")


class Module:
    """A loaded cubin on one device; functions looked up once, dynamic smem raised as needed."""

    def __init__(self, compiled: Compiled, device_index: int):
        drv = _driver()
        _ensure_context(device_index)
        self.device_index = device_index
        self.compiled = compiled
        self._image = ctypes.create_string_buffer(compiled.cubin, len(compiled.cubin))
        self.handle = _check(drv.cuModuleLoadData(ctypes.addressof(self._image)), f"cuModuleLoadData({compiled.source})")
        self._funcs: dict = {}
        self._smem: dict = {}

    def function(self, name: str, dyn_smem: int = 0):
        drv = _driver()
        f = self._funcs.get(name)
        if f is None:
            f = _check(drv.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
            self._funcs[name] = f
        # Raised whenever asked for more: static shared memory also counts against the 48 KiB default.
        if dyn_smem > self._smem.get(name, 0):
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check((drv.cuFuncSetAttribute(f, attr, dyn_smem)[0], None), f"cuFuncSetAttribute({name}, {dyn_smem})")
            self._smem[name] = dyn_smem
        return f


def load(source: str, arch: int, defines: dict | None, device_index: int) -> Module:
    """Compile (or read from the cache) and load once per process and device."""
    key = (source, arch, tuple(sorted((defines or {}).items())), device_index)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = Module(compile_source(source, arch, defines), device_index)
            _modules[key] = mod
    return mod


def loaded(source: str, arch: int, defines: dict | None, device_index: int) -> Module | None:
    return _modules.get((source, arch, tuple(sorted((defines or {}).items())), device_index))


_PDL_CONFIGS: dict = {}


def _pdl_config(grid, block, smem: int, stream: int):
    """cuLaunchKernelEx's configuration for a programmatic dependent launch, built once per (grid, block, smem,
    stream): building it costs more than the launch's other Python (4.6 µs on the CPU machine)."""
    key = (grid, block, smem, stream)
    cfg = _PDL_CONFIGS.get(key)
    if cfg is None:
        drv = _driver()
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = smem
        cfg.hStream = drv.CUstream(stream)
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        if len(_PDL_CONFIGS) >= 4096:  # distinct launch shapes x streams; rebuilt when full
            _PDL_CONFIGS.clear()
        _PDL_CONFIGS[key] = cfg
    return cfg


def launch(func, grid, block, smem: int, stream: int, args, overlap_previous: bool = False) -> None:
    """cuLaunchKernel with args given as ctypes values (kept alive for the call).

    overlap_previous: a programmatic dependent launch (sm_90+): the kernel may start once every block of the previous
    kernel on the stream has called pdl_launch_dependents(), and must pdl_wait() before reading that kernel's output.
    """
    drv = _driver()
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    if overlap_previous:
        err = drv.cuLaunchKernelEx(_pdl_config(tuple(grid), tuple(block), smem, stream), func,
                                   ctypes.addressof(ptrs), 0)[0]
    else:
        err = drv.cuLaunchKernel(func, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
                                 drv.CUstream(stream), ctypes.addressof(ptrs), 0)[0]
    if int(err) != 0:
        raise KernelError(f"cuLaunchKernel{'Ex' if overlap_previous else ''} failed: {err!r} "
                          f"(grid {grid}, block {block}, smem {smem})")
