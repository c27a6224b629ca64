"""What the GPU tests share: the relative error they gate on and the report file the device run collects."""

import os

REPORT = os.environ.get("EXL3_TEST_REPORT")


def rel(out, ref):
    """||out - ref|| / ||ref|| in float64."""
    return ((out.double() - ref).norm() / ref.norm()).item()


def report(line):
    print(line)
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(line + "\n")
