"""Every module imports on its own, first, as `python -m flexengine.cli make-model` imports models.presets first: a
circular import between two rooms shows only when one of them is entered before the other."""
import pkgutil
import subprocess
import sys

import flexengine

CHECK = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] == "flexengine"]:
        del sys.modules[loaded]  # torch and the rest stay loaded: only this package starts over
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first():
    names = [m.name for m in pkgutil.walk_packages(flexengine.__path__, "flexengine.")
             if not m.name.startswith("flexengine.server")]  # the serve extra's modules: test_server imports them
    names += ["flexengine.masks", "flexengine.compile"]
    assert "flexengine.models.presets" in names and "flexengine.parallel.launch" in names
    run = subprocess.run([sys.executable, "-c", CHECK, *names], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
