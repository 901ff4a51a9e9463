"""Build the native step (`make install` runs `python -m engine.native.build`) into engine/native/_build/.

One translation unit, one g++ command with torch's include and library paths (no ninja needed), about 40 s.
A failure leaves the engine on its eager PyTorch path, which says so once in the log; it never fails the install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from engine.native import BUILD_DIR, MODULE_NAME

SOURCE = Path(__file__).resolve().parent / "csrc" / "sluice_native.cpp"
# -ffp-contract=fast: a * b + c becomes one FMA (batch invariance needs one fixed sequence of operations per row,
# whatever it is). GCC does not contract every such sum alike in every instantiation of a template, so the sums
# whose bits must not depend on the instantiation (attention's scores) call the variant's fmadd explicitly.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-Wno-unused-function", "-Wno-psabi"]


def compile_command(output: Path) -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-std=c++20", *CFLAGS,
        f"-DTORCH_EXTENSION_NAME={MODULE_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-isystem{p}" for p in include_paths()), f"-isystem{sysconfig.get_paths()['include']}",
        str(SOURCE), "-o", str(output),
        *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python",
    ]  # fmt: skip


def build() -> Path:
    BUILD_DIR.mkdir(exist_ok=True)
    target = BUILD_DIR / f"{MODULE_NAME}.so"
    fd, tmp = tempfile.mkstemp(prefix=f".{MODULE_NAME}.", suffix=".so", dir=BUILD_DIR)
    os.close(fd)
    try:
        subprocess.run(compile_command(Path(tmp)), check=True)
        os.replace(tmp, target)  # atomic: a running server keeps the old file, a new one loads the whole new one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def main() -> int:
    try:
        path = build()
    except Exception as exc:  # noqa: BLE001 - any failure means: stay on the eager path
        print(f"warning: the native step did not build ({exc}); Sluice will use its eager PyTorch path", file=sys.stderr)
        stale = BUILD_DIR / f"{MODULE_NAME}.so"
        if stale.exists():  # an older build may not match these sources
            stale.unlink()
        return 0
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
