"""Who may do what: bearer tokens and their scopes, the tokens file, the service's TLS."""
