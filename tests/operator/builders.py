"""Shared builders for the operator tests: the example spec, plans, and an argv reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from disagg_operator.plan import Plan, Role, build_plan
from disagg_operator.pool_plan import PoolPlan
from disagg_operator.manifest import parse_spec
from disagg_sidecar.config import dump_config
from tests.operator.cases import merged

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b.yaml"
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
# Flags that decide how text becomes tokens and tokens become a response.
TOKENIZER_FLAGS = ("--served-model-name", "--max-model-len", "--chat-template", "--default-chat-template-kwargs",
                   "--trust-remote-code", "--tokenizer-mode")
PARSER_FLAGS = ("--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice")


def example_doc() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def full_spec() -> dict[str, Any]:
    """The example plus everything that has to stay consistent: template, kwargs, a separate derender pool."""
    return merged(example_doc()["spec"], {
        "model": {"chatTemplate": {"inline": TEMPLATE}, "defaultChatTemplateKwargs": {"enable_thinking": False},
                  "engineArgs": ["--dtype", "bfloat16", "--trust-remote-code", "--tokenizer-mode", "auto"],
                  "revision": "a1b2c3"},
        "pools": {"derender": {"replicas": 3, "rendererWorkers": 16}},
    })


def plan_of(spec: dict[str, Any], name: str = "qwen3-8b", namespace: str = "prod") -> Plan:
    return build_plan(parse_spec(spec), name, namespace)


def flags(argv: list[str]) -> dict[str, str | bool]:
    """--flag value / --flag=value / bare --flag, as an argparse-like reader sees them."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-"):
            name, eq, value = arg.partition("=")
            if eq:
                out[name] = value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                out[name] = argv[i + 1]
                i += 1
            else:
                out[name] = True
        i += 1
    return out


def argv(plan: Plan, role: Role) -> list[str]:
    pool = plan.pool(role)
    assert pool is not None, role
    return pool.argv(plan.model)


def env(pool: PoolPlan) -> dict[str, Any]:
    return {e.name: e.value_from if e.value_from is not None else e.value for e in pool.env}




def sidecar_file(plan: Plan) -> dict[str, Any]:
    """The sidecar's configuration file as the operator writes it."""
    return dump_config(plan.sidecar.config)
