"""The registry's torch-free client: what the service's CLI commands, router-sync, the vLLM
plugin and users' own code import (client, watch, errors, models, TLS, the compat rule)."""
