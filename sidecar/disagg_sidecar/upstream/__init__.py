"""The engines behind the sidecar: one HTTP client for every leg (timeouts, retries, aborts), the
endpoint pools and how a prefill endpoint is chosen (prefix affinity), discovery (static, DNS,
EndpointSlices through the Kubernetes API), TLS to the engines, and the decode engine's metrics."""
