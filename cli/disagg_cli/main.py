"""``disagg`` console script: one command, subcommands implemented by the packages that own them.

Each subcommand is imported only when run, so ``disagg sidecar`` never imports vLLM and
``disagg engine`` never imports kopf.
"""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", help). The function takes the remaining argv and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "crd": ("disagg_operator.commands:crd_main", "print the DisaggregatedModel CRD (YAML)"),
    "manifests": ("disagg_operator.commands:manifests_main", "print the Kubernetes objects for a DisaggregatedModel file"),
    "scrape-config": ("disagg_operator.commands:scrape_config_main",
                      "print the Prometheus scrape_configs of a model's PodMonitors"),
    "operator": ("disagg_operator.commands:operator_main", "run the operator (kopf)"),
    "sidecar": ("disagg_sidecar.commands:sidecar_main", "run the routing sidecar"),
    "engine": ("disagg_engine.commands:engine_main", "run vLLM with Disagg's engine extension"),
    "up": ("disagg_cli.local.commands:up_main", "run a DisaggregatedModel as local processes"),
    "down": ("disagg_cli.local.commands:down_main", "stop what `disagg up` started"),
    "status": ("disagg_cli.local.commands:status_main", "show the local deployment"),
    "supervise": ("disagg_cli.local.commands:supervise_main", "restart crashed processes of a detached `disagg up`"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: disagg COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"disagg: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, func_name = COMMANDS[name][0].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"disagg {name}: not available in this installation ({exc.name} is missing)", file=sys.stderr)
        return 2
    return int(getattr(module, func_name)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
