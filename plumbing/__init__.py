"""Process plumbing that the service and the facade share."""
