"""weight-sync service: versioned weights from the trainer to the engines."""
