"""A stand-in for torchvision, which the CPU test set-up does not install: vLLM's Qwen3.5 module imports the
Qwen3-VL processors, and transformers' image processors import torchvision at module level. Text-only models never
call into it; any call raises."""
__version__ = "0.0.0+stub"


class InterpolationMode:
    NEAREST, NEAREST_EXACT, BILINEAR, BICUBIC, BOX, HAMMING, LANCZOS = (
        "nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")


class ImageReadMode:
    UNCHANGED, GRAY, GRAY_ALPHA, RGB, RGB_ALPHA = range(5)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"torchvision stub: {name} (tests/stubs)")
    return unavailable
