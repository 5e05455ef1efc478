"""Code that runs inside each TP worker process: registry client, engine identity, NIXL
endpoint, and the prefill/decode entrypoints. Talks to the service only over REST."""
