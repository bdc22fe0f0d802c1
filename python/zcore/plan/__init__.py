"""Will it fit: memory estimates per stage and offload setting, activation
estimates, and the recommended configuration."""
