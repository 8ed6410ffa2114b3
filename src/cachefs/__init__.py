"""cachefs: a read-only FUSE cache that feeds training jobs from slow storage."""

__version__ = "0.1.0"
