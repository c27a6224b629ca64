from torchvision import ImageReadMode, InterpolationMode, __getattr__  # noqa: F401
