"""`preinfer inspect`: an activation store or cache directory in human terms."""

from __future__ import annotations

import argparse
import json

from pipelines.arguments import add_s3_endpoint, store_location, use_s3_endpoint
from pipelines.cache.report import describe, format_description


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="STORE", type=store_location,
                        help="a cache directory (all its splits) or a single store: a local path or s3://BUCKET/PATH")
    parser.add_argument("--json", action="store_true", help="print the description as JSON")
    add_s3_endpoint(parser)


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    infos = describe(args.path)
    if args.json:
        print(json.dumps(infos if len(infos) > 1 or infos[0]["split"] else infos[0], indent=1))
    else:
        print("\n".join(format_description(info) for info in infos))
    return 0
