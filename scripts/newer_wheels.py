"""Print those of the wheels named (the carried .whl/, scripts/serve_wheels.sh) that this Python lacks or has
older: the GPU box's own versions stay first choice (an older carried typing_extensions once broke its anyio)."""
import importlib.metadata
import pathlib
import sys

from packaging.version import Version

for whl in sys.argv[1:]:
    name, version = pathlib.Path(whl).name.split("-")[:2]
    try:
        if Version(importlib.metadata.version(name)) >= Version(version):
            continue
    except importlib.metadata.PackageNotFoundError:
        pass
    print(whl)
