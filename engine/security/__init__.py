"""Security: credentials, the auth interceptor, path confinement and certificates."""
