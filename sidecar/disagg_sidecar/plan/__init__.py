"""Pure per-request decisions: what the decode engine may be asked for (``capabilities``), the
output mode and derender strategy (``decisions``), the request's work limits (``requestlimits``)
and each leg's body (``legs``). No I/O: the contracts in pyproject.toml keep it so."""
