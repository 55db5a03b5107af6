"""Run every example script in this folder (the README's demo)."""
import pathlib
import runpy
import sys

here = pathlib.Path(__file__).parent
for script in sorted(here.glob("*.py")):
    if script.name == "run_all.py":
        continue
    print(f"\n=== {script.name} ===")
    runpy.run_path(str(script), run_name="__main__")
sys.exit(0)
