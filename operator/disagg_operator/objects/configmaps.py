"""The model's ConfigMap: the sidecar's routing config and, when given inline, the chat template."""

from __future__ import annotations

from typing import Any

import yaml

from disagg_operator import names
from disagg_operator.objects.deployments import SIDECAR_CONFIG_FILE
from disagg_operator.plan import Plan
from disagg_sidecar.config import dump_config


# libyaml's emitter when present: this runs on every child event and PyYAML's is slow.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def sidecar_config_yaml(config: Any) -> str:
    return yaml.dump(config, Dumper=_DUMPER, sort_keys=False, default_flow_style=False)


def config_map(plan: Plan, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    data = {SIDECAR_CONFIG_FILE: sidecar_config_yaml(dump_config(plan.sidecar.config))}
    template = plan.chat_template
    if template is not None and template.inline is not None:
        data[template.path.rsplit("/", 1)[1]] = template.inline
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(plan.name, plan.namespace, names.config_map(plan.name),
                                   names.CONFIG_COMPONENT, owner),
        "data": data,
    }
