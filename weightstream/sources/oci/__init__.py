"""OCI registries: artifacts as a store, registry credentials, the blob digest check."""
