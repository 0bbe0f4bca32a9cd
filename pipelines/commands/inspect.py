"""`preinfer inspect`: an activation store or cache directory in human terms."""

from __future__ import annotations

import argparse
import json

from pipelines.flags import add_flags, use_s3_endpoint
from pipelines.cache.report import describe, format_description


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "path", "--json", "--s3-endpoint")


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    infos = describe(args.path)
    if args.json:
        print(json.dumps(infos if len(infos) > 1 or infos[0]["split"] else infos[0], indent=1))
    else:
        print("\n".join(format_description(info) for info in infos))
    return 0
