"""The library that runs inside each TP worker process: registry client, engine identity, the
agents' leases, NIXL endpoint, the prefill/decode entrypoints and the vLLM plugin. Talks to the
service only over REST and imports none of its code; never imports `workers.tools`, the demo,
launcher and process helpers built around it."""
