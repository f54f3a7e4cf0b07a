"""Write the .pyc files of .venv/'s site-packages that policy-bundle's processes import (run by setup.sh).

Where PYTHONDONTWRITEBYTECODE is set (this machine and CI), a module with no .pyc is compiled from source by
every process that imports it, every time: a server start took 19 s instead of 11 s (2 cores).
Compiling the whole site-packages (uv's --compile-bytecode: 29k files) took about 35 s of setup; half of them are
never imported here (test suites, pandas/numba/wandb/tensorboard that dependencies pull in, transformers' other
model families), so this compiles the rest on every core, in chunks. A skipped module that is
imported after all is compiled at import, as without this script: the list costs speed, never correctness.

    python compile_venv.py SITE_PACKAGES
"""

from __future__ import annotations

import os
import py_compile
import re
import sys
from multiprocessing import Pool
from typing import Iterator, List

# the model families policy-bundle loads (Llama, Qwen2/3; SmolLM is a Llama) and what transformers' and vLLM's
# registries import beside them; found by running the main job and a server with bytecode writing on
KEPT_TRANSFORMERS_MODELS = "auto|llama|qwen2|qwen3|qwen3_5|gemma|gpt2|t5|whisper|encoder_decoder|deepseek_v2|deepseek_v3"
NEVER_IMPORTED = "tests?|pandas|numba|anthropic|wandb|tensorboard|pyarrow|datasets|pip"
SKIP = re.compile(rf"/({NEVER_IMPORTED})/|/transformers/models/(?!({KEPT_TRANSFORMERS_MODELS})/|__init__\.py)")


def sources(root: str) -> Iterator[str]:
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            # matched below site-packages only: a checkout under a folder named tests/ still compiles
            if name.endswith(".py") and not SKIP.search("/" + os.path.relpath(path, root)):
                yield path


def compile_chunk(paths: List[str]) -> int:
    failed = 0
    for path in paths:
        try:
            py_compile.compile(path, doraise=True, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
        except (py_compile.PyCompileError, OSError, UnicodeError):
            failed += 1  # a file some package ships that this Python cannot compile: imported, it fails the same
    return failed


def main(root: str) -> None:
    if not os.path.isdir(root):
        sys.exit(f"compile_venv.py: {root!r} is not a folder")
    todo = sorted(sources(root))
    chunks = [todo[i:i + 200] for i in range(0, len(todo), 200)]
    with Pool(len(os.sched_getaffinity(0))) as pool:
        failed = sum(pool.imap_unordered(compile_chunk, chunks))
    print(f"setup: bytecode for {len(todo) - failed} modules ({failed} not compilable)")


if __name__ == "__main__":
    main(sys.argv[1])
