"""Object stores: versioned objects read by range, listings, and S3, GCS and Azure Blob."""
