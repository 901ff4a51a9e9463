"""`python -m bench <mode> [flags]`: the one front door to Sluice's measurements. Each mode is a module with a
`main(argv)`; `python -m bench <mode> --help` lists its flags.

To add a mode, add a line to MODES (name -> module). Flags first, without a mode (`python -m bench --sweep
1,4,16`), is the load mode, as it always was.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# name -> (module, what it measures)
MODES: dict[str, tuple[str, str]] = {
    "load": ("bench.cli", "the load generator against OpenAI-compatible servers (also --soak, --abuse, --compare)"),
    "offline": ("bench.experiments.offline", "the offline engine against transformers generate"),
    "gil": ("bench.experiments.gil", "the event loop's lag while the engine decodes in its worker thread"),
    "never-read": ("bench.experiments.never_read", "what clients that never read cost a server (RSS)"),
    "burst": ("bench.experiments.burst", "time to response headers in a burst, with a lean client"),
    "ready": ("bench.experiments.ready", "time to ready and the first request: Sluice's first and later starts, llama-server"),
    "structured": ("bench.experiments.structured", "constrained against unconstrained decoding"),
    "parallel-sampling": ("bench.experiments.parallel_sampling", "one request with n against n requests"),
    "cluster": ("bench.cluster", "engine replicas against one process, in one run"),
    "route-sim": ("bench.route_sim", "the replica router on a synthetic trace of conversations"),
    "kernels": ("bench.kernels", "every kernel variant this CPU runs against its measured peaks"),
    "step": ("bench.experiments.step", "one native decode step of a real model, per variant and row count"),
    "ggml": ("bench.experiments.ggml_gemm", "the GEMMs against ggml's own (llama.cpp's test-backend-ops), one core"),
    "variants": ("bench.experiments.variants", "the int8 GEMMs of kernel variants in tight turns: their ratios"),
    "sampler": ("bench.experiments.sampler", "the sampler's native and PyTorch paths, in turns"),
    "perplexity": ("bench.perplexity", "perplexity and KL divergence of each native precision against float32"),
    "speculative": ("bench.speculative", "speculative decoding on the server: off, auto/on and llama-server"),
}


def usage(prog: str = "python -m bench") -> str:
    width = max(len(name) for name in MODES)
    lines = [f"  {name:<{width}}  {about}" for name, (_, about) in MODES.items()]
    return f"usage: {prog} <mode> [flags]   ({prog} <mode> --help)\n\nmodes:\n" + "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "python -m bench") -> int:
    """prog: how the user called it ("sluice bench" from the sluice command), for the usage lines."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(usage(prog))
        return 0
    if not args or args[0].startswith("-"):
        name, rest = "load", args
    elif args[0] in MODES:
        name, rest = args[0], args[1:]
    else:
        print(f"{prog}: unknown mode {args[0]!r}\n\n{usage(prog)}", file=sys.stderr)
        return 2
    module = importlib.import_module(MODES[name][0])
    # argparse names a mode's usage after argv[0]: "python -m bench sampler" (or "sluice bench sampler"), not
    # "__main__.py" (or "sluice")
    sys.argv[0] = f"{prog} {name}" if args and args[0] == name else prog  # the load generator is also the default
    return module.main(rest) or 0
