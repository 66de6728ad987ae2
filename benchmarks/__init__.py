"""Disagg's benchmarks: what the sidecar and the derender paths cost beside coupled
vLLM, and what the sidecar and the operator hold under load.

``python -m benchmarks.run [PART ...]`` (``make bench BENCH=...``) runs the parts: ``proxy``
(proxy.py), ``derender`` (derender.py), ``serve`` (serve.py, vLLM's own ``vllm bench serve``),
``operator`` (operator_load.py) and ``soak`` (soak.py), then writes ``bench/results.json``,
``bench/RESULTS.md`` and the PNG plots (report.py, plots.py).
"""
