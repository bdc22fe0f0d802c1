"""What a step costs and where memory goes: step metrics, monitors, the
flops profiler, memory reports, saved activations, plots and the
communication benchmark."""
